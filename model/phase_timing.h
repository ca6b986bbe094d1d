/* phase_timing.h: the phase report of `mnemo run --timing` (docs/cli.md):
 * a run is cut into consecutive phases (read inputs, upload, run, ...), each
 * ended by a mark that records the seconds since the previous mark and the
 * bytes the phase moved; the report prints one line per phase and a total
 * on stderr:
 *
 *     timing: read inputs        41.2 ms    285.4 MB   6927 MB/s
 *     timing: run              4012.7 ms
 *
 * A timer that is off records nothing, so callers mark unconditionally. */
#ifndef MN_PHASE_TIMING_H
#define MN_PHASE_TIMING_H

#include <stdbool.h>
#include <stdio.h>

enum { MN_PHASE_MAX = 16 };

typedef struct mn_phase {
    char name[24];
    double seconds;
    double bytes;        /* moved by the phase; 0: no MB and MB/s columns */
    char note[96];       /* printed after the numbers, in parentheses, when set */
} mn_phase;

typedef struct mn_phase_timer {
    bool on;
    double start, last;  /* monotonic seconds at init and at the last mark */
    int count;
    mn_phase phases[MN_PHASE_MAX];
} mn_phase_timer;

/* Starts the clock (also when off, so that a timer switched on later has a
 * start). */
void mn_phase_timer_init(mn_phase_timer *t, bool on);
/* Ends the current phase: name, the time since the previous mark (or init)
 * and the bytes it moved. NULL-safe; phases past MN_PHASE_MAX are dropped. */
void mn_phase_mark(mn_phase_timer *t, const char *name, double bytes);
/* A note on the last phase marked ("168.2 MB of it from cuda"). */
void mn_phase_note(mn_phase_timer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One line per phase, then "total" (init to now), each prefixed "timing: ". */
void mn_phase_report(const mn_phase_timer *t, FILE *out);
/* One phase line as mn_phase_report prints it (no newline); returns the
 * length, as snprintf. */
int mn_phase_format(char *buf, size_t size, const char *name, double seconds, double bytes, const char *note);

#endif
