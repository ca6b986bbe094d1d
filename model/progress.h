/* progress.h: the progress line of long runs, on a terminal (stderr):
 *
 *     run 1234/8192 steps  15% | 52.3k tok/s | 0:03 left
 *
 * fed (done, total) by the engine's progress hook (engine.h, mn_set_progress),
 * shown only once a run has taken a second, redrawn in place with a carriage
 * return at most ten times a second, and erased when the run ends (done
 * reaches total) or is finished early (an error, Ctrl-C). Silent when its
 * stream is not a terminal or when disabled. No Lua here: the REPL reaches it
 * through dsl/l_progress.c, `mnemo run` through mn_progress_stderr_begin/end. */
#ifndef MN_PROGRESS_H
#define MN_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef double (*mn_clock_fn)(void);

typedef struct mn_progress {
    FILE *out;
    bool enabled;              /* false: never prints (set by init: wanted and a terminal) */
    char label[40];
    double tokens_per_step;    /* tokens in one reported step (the rule's step size); 0 hides tok/s */
    double delay;              /* seconds before the first line (1.0) */
    double interval;           /* seconds between redraws (0.1) */
    mn_clock_fn clock;         /* seconds, monotonic; tests put a fake one here */
    double start, last;        /* clock at init and at the last draw */
    int shown;                 /* width of the line on screen, 0 when none */
    bool finished;
} mn_progress;

/* Seconds from a monotonic clock (CLOCK_MONOTONIC). */
double mn_clock_monotonic(void);

/* Start a progress line labelled label on out; it prints only when enabled
 * and out is a terminal. The clock starts now. */
void mn_progress_init(mn_progress *p, const char *label, FILE *out, bool enabled, double tokens_per_step);

/* Report done of total steps: draws the line when due; erases it when done
 * reaches total. Cheap when nothing is due. */
void mn_progress_update(mn_progress *p, int64_t done, int64_t total);

/* Erase the line if one is shown; later updates print nothing. Idempotent. */
void mn_progress_finish(mn_progress *p);

/* The text of the line (no carriage return), e.g.
 * "run 250/1000 steps  25% | 500 tok/s | 0:06 left"; elapsed in seconds.
 * Returns the length, as snprintf. */
int mn_progress_format(char *buf, size_t size, const char *label, int64_t done, int64_t total, double elapsed,
                       double tokens_per_step);

/* Install p as the engine's progress hook / finish it and uninstall. */
void mn_progress_attach(mn_progress *p);
void mn_progress_detach(mn_progress *p);

/* For `mnemo run`: a progress line on stderr around one engine run, held in
 * a static; begin before the run, end after it (on every path). */
void mn_progress_stderr_begin(const char *label, double tokens_per_step);
void mn_progress_stderr_end(void);

#endif
