/* phase_timing.c: the phase report of `mnemo run --timing` (phase_timing.h). */
#include "phase_timing.h"
#include "progress.h"

#include <stdarg.h>
#include <string.h>

void mn_phase_timer_init(mn_phase_timer *t, bool on)
{
    memset(t, 0, sizeof *t);
    t->on = on;
    t->start = t->last = mn_clock_monotonic();
}

void mn_phase_mark(mn_phase_timer *t, const char *name, double bytes)
{
    if (!t || !t->on) return;
    double now = mn_clock_monotonic();
    if (t->count < MN_PHASE_MAX) {
        mn_phase *p = &t->phases[t->count++];
        snprintf(p->name, sizeof p->name, "%s", name);
        p->seconds = now - t->last;
        p->bytes = bytes;
        p->note[0] = 0;
    }
    t->last = now;
}

void mn_phase_note(mn_phase_timer *t, const char *fmt, ...)
{
    if (!t || !t->on || t->count == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->phases[t->count - 1].note, sizeof t->phases[0].note, fmt, ap);
    va_end(ap);
}

int mn_phase_format(char *buf, size_t size, const char *name, double seconds, double bytes, const char *note)
{
    int n = snprintf(buf, size, "timing: %-14s %10.1f ms", name, seconds * 1e3);
    if (n < 0 || (size_t)n >= size) return n;
    /* MB/s of a phase too short to time says nothing: no rate then. */
    if (bytes > 0 && seconds > 0)
        n += snprintf(buf + n, size - (size_t)n, " %10.1f MB %9.0f MB/s", bytes / 1e6, bytes / 1e6 / seconds);
    else if (bytes > 0)
        n += snprintf(buf + n, size - (size_t)n, " %10.1f MB", bytes / 1e6);
    if (n >= 0 && (size_t)n < size && note && note[0]) n += snprintf(buf + n, size - (size_t)n, "  (%s)", note);
    return n;
}

void mn_phase_report(const mn_phase_timer *t, FILE *out)
{
    if (!t || !t->on) return;
    char line[256];
    for (int i = 0; i < t->count; i++) {
        const mn_phase *p = &t->phases[i];
        mn_phase_format(line, sizeof line, p->name, p->seconds, p->bytes, p->note);
        fprintf(out, "%s\n", line);
    }
    mn_phase_format(line, sizeof line, "total", mn_clock_monotonic() - t->start, 0, NULL);
    fprintf(out, "%s\n", line);
}
