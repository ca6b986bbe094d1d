/* test_progress.c: model/progress.c with a fake clock writing to a temporary
 * file: the text of the line (counts, percent, tok/s, time left), the
 * 1-second delay, the 10 Hz throttle, carriage-return redraws padded over a
 * longer line, erasing at the end, silence when disabled or not a terminal,
 * and the engine hook (mn_set_progress) driving it. */
#include <stdlib.h>

#include "check.h"
#include "engine.h"
#include "progress.h"

static double fake_now;
static double fake_clock(void) { return fake_now; }

/* Everything written to f so far (f rewound and read; the caller frees). */
static char *contents(FILE *f)
{
    fflush(f);
    long n = ftell(f);
    char *s = calloc((size_t)n + 1, 1);
    rewind(f);
    if (n > 0 && fread(s, 1, (size_t)n, f) != (size_t)n) s[0] = 0;
    fseek(f, 0, SEEK_END);
    return s;
}

static int count_char(const char *s, char c)
{
    int n = 0;
    for (; *s; s++) n += *s == c;
    return n;
}

/* A progress on f that prints although f is not a terminal, on the fake clock. */
static void start(mn_progress *p, FILE *f, double per_step)
{
    fake_now = 100.0;
    mn_progress_init(p, "run", f, true, per_step);
    CHECK("a file is not a terminal: disabled by init", !p->enabled);
    p->enabled = true;
    p->clock = fake_clock;
    p->start = p->last = fake_now;
}

static void test_format(void)
{
    char buf[160];
    int n = mn_progress_format(buf, sizeof buf, "run", 250, 1000, 2.0, 4);
    CHECK_STR_CONTAINS("format: counts", buf, "run 250/1000 steps");
    CHECK_STR_CONTAINS("format: percent", buf, " 25%");
    CHECK_STR_CONTAINS("format: tokens per second", buf, "| 500 tok/s");
    CHECK_STR_CONTAINS("format: time left", buf, "| 0:06 left");
    CHECK("format: returns the length", n == (int)strlen(buf));

    mn_progress_format(buf, sizeof buf, "mem:write", 1, 4, 1.0, 65536);
    CHECK_STR_CONTAINS("format: k rate", buf, "65.5k tok/s");
    CHECK_STR_CONTAINS("format: minutes", buf, "0:03 left");
    mn_progress_format(buf, sizeof buf, "run", 1, 1000, 10.0, 1e6);
    CHECK_STR_CONTAINS("format: M rate", buf, "100.0k tok/s");
    CHECK_STR_CONTAINS("format: hours", buf, "2:46:30 left");
    mn_progress_format(buf, sizeof buf, "run", 3, 4, 1.0, 2e9);
    CHECK_STR_CONTAINS("format: M and G rates", buf, "6.0G tok/s");
    mn_progress_format(buf, sizeof buf, "run", 0, 10, 0.5, 1);
    CHECK_STR_CONTAINS("format: nothing done yet", buf, "0/10 steps   0% | 0 tok/s | ? left");
    mn_progress_format(buf, sizeof buf, "run", 5, 10, 1.0, 0);
    CHECK("format: no tok/s without a step size", strstr(buf, "tok/s") == NULL);
    mn_progress_format(buf, sizeof buf, "run", 20, 10, 1.0, 0);
    CHECK_STR_CONTAINS("format: done clamped to total", buf, "10/10 steps 100%");
    n = mn_progress_format(buf, 8, "run", 5, 10, 1.0, 1);
    CHECK("format: truncates like snprintf", strlen(buf) == 7 && n > 7);
}

static void test_throttle(void)
{
    FILE *f = tmpfile();
    mn_progress p;
    start(&p, f, 1);
    char *s;

    fake_now = 100.5;
    mn_progress_update(&p, 10, 100);
    s = contents(f);
    CHECK("quiet during the first second", s[0] == 0);
    free(s);

    fake_now = 101.2;
    mn_progress_update(&p, 20, 100);
    s = contents(f);
    CHECK("a line after one second", s[0] == '\r' && strstr(s, "run 20/100 steps  20%") != NULL);
    CHECK("no newline in a progress line", strchr(s, '\n') == NULL);
    free(s);

    fake_now = 101.25;
    mn_progress_update(&p, 21, 100);
    s = contents(f);
    CHECK("throttled within 0.1 s", strstr(s, "21/100") == NULL && count_char(s, '\r') == 1);
    free(s);

    fake_now = 101.31;
    mn_progress_update(&p, 30, 100);
    s = contents(f);
    CHECK("redrawn after 0.1 s", strstr(s, "\rrun 30/100 steps  30%") != NULL && count_char(s, '\r') == 2);
    free(s);

    /* a shorter line than the one shown: padded with spaces, then redrawn */
    p.tokens_per_step = 0;
    fake_now = 101.5;
    mn_progress_update(&p, 31, 100);
    s = contents(f);
    const char *last = strrchr(s, '\r');
    CHECK("a shorter line is padded and redrawn", last && strncmp(last, "\rrun 31/100", 11) == 0 &&
                                                      strstr(s, "left  ") != NULL);
    free(s);

    fake_now = 102.0;
    mn_progress_update(&p, 100, 100);
    s = contents(f);
    size_t len = strlen(s);
    CHECK("erased at the end: spaces between carriage returns",
          len >= 3 && s[len - 1] == '\r' && s[len - 2] == ' ');
    CHECK("finished at done == total", p.finished && p.shown == 0);
    free(s);

    fake_now = 103.0;
    long before = ftell(f);
    mn_progress_update(&p, 50, 100);
    mn_progress_finish(&p);
    CHECK("silent after finishing", ftell(f) == before);
    fclose(f);
}

static void test_short_and_disabled(void)
{
    FILE *f = tmpfile();
    mn_progress p;
    start(&p, f, 1);
    fake_now = 100.9;
    mn_progress_update(&p, 99, 100);
    mn_progress_update(&p, 100, 100);
    mn_progress_finish(&p);
    CHECK("a run under a second prints nothing", ftell(f) == 0);

    start(&p, f, 1);
    p.enabled = false;
    fake_now = 105;
    mn_progress_update(&p, 1, 100);
    mn_progress_finish(&p);
    CHECK("disabled prints nothing", ftell(f) == 0);

    /* finish early (an error): the line shown is erased */
    start(&p, f, 1);
    fake_now = 102;
    mn_progress_update(&p, 5, 100);
    long shown = ftell(f);
    mn_progress_finish(&p);
    char *s = contents(f);
    CHECK("finish erases a line shown", shown > 0 && ftell(f) > shown && s[strlen(s) - 1] == '\r');
    free(s);
    fclose(f);
}

static void test_hook(void)
{
    FILE *f = tmpfile();
    mn_progress p;
    start(&p, f, 2);
    mn_progress_attach(&p);
    fake_now = 101.5;
    mn_report_progress(7, 70);
    char *s = contents(f);
    CHECK("the engine hook drives the line", strstr(s, "run 7/70 steps  10%") != NULL);
    free(s);
    mn_progress_detach(&p);
    long at = ftell(f);
    fake_now = 110;
    mn_report_progress(8, 70);
    CHECK("detached: the hook is gone", ftell(f) == at && p.finished);
    fclose(f);

    double a = mn_clock_monotonic(), b = mn_clock_monotonic();
    CHECK("monotonic clock does not go back", b >= a && a > 0);
}

int main(void)
{
    test_format();
    test_throttle();
    test_short_and_disabled();
    test_hook();
    return CHECK_DONE();
}
