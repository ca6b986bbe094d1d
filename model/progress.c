/* progress.c: the progress line of long runs (progress.h): formatting,
 * throttling and drawing with carriage returns, and the glue to the engine's
 * progress hook. */
#include "progress.h"
#include "engine.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

double mn_clock_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void mn_progress_init(mn_progress *p, const char *label, FILE *out, bool enabled, double tokens_per_step)
{
    memset(p, 0, sizeof *p);
    p->out = out;
    p->enabled = enabled && out && isatty(fileno(out));
    snprintf(p->label, sizeof p->label, "%s", label ? label : "run");
    p->tokens_per_step = tokens_per_step;
    p->delay = 1.0;
    p->interval = 0.1;
    p->clock = mn_clock_monotonic;
    p->start = p->clock();
    p->last = p->start;
}

/* 1234 -> "1234", 52300 -> "52.3k", 1.5e6 -> "1.5M". */
static void format_rate(char *buf, size_t size, double x)
{
    if (x < 1e3) snprintf(buf, size, "%.0f", x);
    else if (x < 1e6) snprintf(buf, size, "%.1fk", x / 1e3);
    else if (x < 1e9) snprintf(buf, size, "%.1fM", x / 1e6);
    else snprintf(buf, size, "%.1fG", x / 1e9);
}

/* Seconds as m:ss, or h:mm:ss from an hour on. */
static void format_time(char *buf, size_t size, double s)
{
    if (!(s >= 0) || s > 1e7) {
        snprintf(buf, size, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, size, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
    else snprintf(buf, size, "%ld:%02ld", t / 60, t % 60);
}

int mn_progress_format(char *buf, size_t size, const char *label, int64_t done, int64_t total, double elapsed,
                       double tokens_per_step)
{
    if (total < 1) total = 1;
    if (done < 0) done = 0;
    if (done > total) done = total;
    int pct = (int)(100.0 * (double)done / (double)total);
    char rate[48] = "", left[32];
    if (done > 0 && elapsed > 0) format_time(left, sizeof left, elapsed * (double)(total - done) / (double)done);
    else snprintf(left, sizeof left, "?");
    if (tokens_per_step > 0) {
        char r[24];
        if (elapsed > 0) format_rate(r, sizeof r, (double)done * tokens_per_step / elapsed);
        else snprintf(r, sizeof r, "?");
        snprintf(rate, sizeof rate, " | %s tok/s", r);
    }
    return snprintf(buf, size, "%s %lld/%lld steps %3d%%%s | %s left", label, (long long)done, (long long)total, pct,
                    rate, left);
}

static void draw(mn_progress *p, const char *line, int len)
{
    /* Spaces over what is left of a longer previous line. */
    int pad = p->shown > len ? p->shown - len : 0;
    fprintf(p->out, "\r%s%*s", line, pad, "");
    if (pad) fprintf(p->out, "\r%s", line);
    fflush(p->out);
    p->shown = len;
}

void mn_progress_update(mn_progress *p, int64_t done, int64_t total)
{
    if (!p->enabled || p->finished) return;
    if (total > 0 && done >= total) {
        mn_progress_finish(p);
        return;
    }
    double now = p->clock();
    if (now - p->start < p->delay) return;
    if (p->shown && now - p->last < p->interval) return;
    char line[160];
    int len = mn_progress_format(line, sizeof line, p->label, done, total, now - p->start, p->tokens_per_step);
    if (len >= (int)sizeof line) len = (int)sizeof line - 1;
    p->last = now;
    draw(p, line, len);
}

void mn_progress_finish(mn_progress *p)
{
    if (p->finished) return;
    p->finished = true;
    if (p->enabled && p->shown) {
        fprintf(p->out, "\r%*s\r", p->shown, "");
        fflush(p->out);
    }
    p->shown = 0;
}

static void hook(void *ctx, int64_t done, int64_t total) { mn_progress_update(ctx, done, total); }

void mn_progress_attach(mn_progress *p) { mn_set_progress(hook, p); }

void mn_progress_detach(mn_progress *p)
{
    mn_set_progress(NULL, NULL);
    mn_progress_finish(p);
}

static mn_progress stderr_progress;

void mn_progress_stderr_begin(const char *label, double tokens_per_step)
{
    mn_progress_init(&stderr_progress, label, stderr, true, tokens_per_step);
    mn_progress_attach(&stderr_progress);
}

void mn_progress_stderr_end(void) { mn_progress_detach(&stderr_progress); }
