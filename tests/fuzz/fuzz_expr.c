/* fuzz_expr.c: libFuzzer target for the expression language (SPEC section 4).
 * The input, as a string, goes through everything a rule does with an
 * expression: parse, print and parse back (the two must print alike),
 * simplify, differentiate in each variable, compile and run over a few
 * values (the program must agree with the scalar evaluator), emit C. Any
 * crash, sanitizer report or failed agreement stops the fuzzer with the input.
 * Build and run: make fuzz (tests/fuzz/run_fuzz.sh). */
#include "expr.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const vars[] = {"y", "v", "r", "z", "g", "n"};
enum { NVARS = 6, NVALUES = 5 };
static const char *const consts[] = {"delta", "p"};
static const double const_values[] = {1.0, 1.5};

/* Equal as the program and the evaluator both compute in double: the same
 * bits, or both NaN. */
static int same(double a, double b) { return (isnan(a) && isnan(b)) || a == b || fabs(a - b) <= 1e-9 * fmax(1.0, fabs(b)); }

static void check_program(const mn_expr *e)
{
    mn_expr_program *p = NULL;
    if (mn_expr_compile(e, vars, NVARS, consts, const_values, 2, &p) != MN_OK) return;
    static const double samples[NVALUES] = {0.0, -1.5, 2.0, 1e-3, 40.0};
    double in[NVARS][NVALUES], out[NVALUES];
    const double *inputs[NVARS];
    for (int i = 0; i < NVARS; i++) {
        for (int j = 0; j < NVALUES; j++) in[i][j] = samples[(i + j) % NVALUES];
        inputs[i] = in[i];
    }
    mn_expr_program_run(p, inputs, out, NVALUES);
    for (int j = 0; j < NVALUES; j++) {
        double values[NVARS];
        for (int i = 0; i < NVARS; i++) values[i] = in[i][j];
        double want = mn_expr_eval(e, vars, values, NVARS, consts, const_values, 2);
        if (!same(out[j], want)) {
            char *s = mn_expr_to_string(e);
            fprintf(stderr, "program and evaluator disagree on '%s' at sample %d: %.17g vs %.17g\n",
                    s ? s : "?", j, out[j], want);
            abort();
        }
    }
    mn_expr_program_free(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *src = malloc(size + 1);
    if (!src) return 0;
    memcpy(src, data, size);
    src[size] = 0;
    mn_expr *e = NULL;
    if (mn_expr_parse(src, &e) != MN_OK) {
        /* every error is one line that quotes the expression */
        if (!strstr(mn_last_error(), "expression") || strchr(mn_last_error(), '\n')) {
            fprintf(stderr, "bad parse error: %s\n", mn_last_error());
            abort();
        }
        free(src);
        return 0;
    }
    /* printing and parsing back gives the same print */
    char *printed = mn_expr_to_string(e);
    if (printed) {
        mn_expr *back = NULL;
        if (mn_expr_parse(printed, &back) != MN_OK) {
            fprintf(stderr, "'%s' printed as '%s', which does not parse: %s\n", src, printed, mn_last_error());
            abort();
        }
        char *again = mn_expr_to_string(back);
        if (again && strcmp(again, printed) != 0) {
            fprintf(stderr, "'%s' printed as '%s', then as '%s'\n", src, printed, again);
            abort();
        }
        free(again);
        mn_expr_unref(back);
        free(printed);
    }
    mn_expr *s = mn_expr_simplify(e);
    mn_expr_unref(s);
    mn_expr *bound = mn_expr_bind(e, consts, const_values, 2);
    mn_expr_unref(bound);
    check_program(e);
    char *c = mn_expr_to_c(e, vars, vars, NVARS, consts, const_values, 2, true);
    free(c);
    for (int i = 0; i < NVARS; i++) {
        if (!mn_expr_uses(e, vars[i])) continue;
        mn_expr *d = mn_expr_diff(e, vars[i]);
        /* derivatives are walked like any expression (not printed: a chain
         * of products prints quadratically long) */
        if (d) check_program(d);
        mn_expr_unref(d);
    }
    mn_expr_unref(e);
    free(src);
    return 0;
}
