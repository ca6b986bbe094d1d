/* check.h: the tiny assertion kit of the C unit tests. Every check prints one
 * line, "PASS name", "FAIL name: detail" or "SKIP name: reason"; tests/run.sh
 * counts those lines across every test program, and a program that exits
 * non-zero or prints no line at all counts as a failure. */
#ifndef MN_CHECK_H
#define MN_CHECK_H

#include <math.h>
#include <stdio.h>
#include <string.h>

static int check_failures_ = 0;

#define CHECK(name, cond)                                                      \
    do {                                                                       \
        if (cond) printf("PASS %s\n", (name));                                 \
        else { printf("FAIL %s: %s (%s:%d)\n", (name), #cond, __FILE__, __LINE__); check_failures_++; } \
    } while (0)

/* |got - want| <= tol * max(1, |want|) */
#define CHECK_NEAR(name, got, want, tol)                                       \
    do {                                                                       \
        double g_ = (got), w_ = (want);                                        \
        if (fabs(g_ - w_) <= (tol) * fmax(1.0, fabs(w_))) printf("PASS %s\n", (name)); \
        else { printf("FAIL %s: got %.17g want %.17g (%s:%d)\n", (name), g_, w_, __FILE__, __LINE__); check_failures_++; } \
    } while (0)

#define CHECK_STR_CONTAINS(name, haystack, needle)                             \
    do {                                                                       \
        const char *h_ = (haystack);                                           \
        if (h_ && strstr(h_, (needle))) printf("PASS %s\n", (name));           \
        else { printf("FAIL %s: '%s' does not contain '%s' (%s:%d)\n", (name), h_ ? h_ : "(null)", (needle), __FILE__, __LINE__); check_failures_++; } \
    } while (0)

#define CHECK_STR_EQ(name, got, want)                                          \
    do {                                                                       \
        const char *g_ = (got), *w_ = (want);                                  \
        if (g_ && strcmp(g_, w_) == 0) printf("PASS %s\n", (name));            \
        else { printf("FAIL %s: got '%s' want '%s' (%s:%d)\n", (name), g_ ? g_ : "(null)", w_, __FILE__, __LINE__); check_failures_++; } \
    } while (0)

#define SKIP(name, reason) printf("SKIP %s: %s\n", (name), (reason))

#define CHECK_DONE() (check_failures_ ? 1 : 0)

#endif
