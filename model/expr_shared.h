/* expr_shared.h: expression programs in one variable whose repeated calls
 * are evaluated once (expr_shared.c); the backward's phi' and phi'' use them. */
#ifndef MN_EXPR_SHARED_H
#define MN_EXPR_SHARED_H

#include "expr.h"

#define MN_SHARED_MAX 4

typedef struct mn_shared_program {
    int nsub;
    char names[MN_SHARED_MAX][8];              /* _s0, _s1, ... */
    mn_expr_program *sub[MN_SHARED_MAX];       /* sub[i] in (var, _s0 .. _s{i-1}) */
    mn_expr_program *main;                     /* e in (var, _s0 .. _s{nsub-1}) */
} mn_shared_program;

mn_status mn_shared_program_compile(const mn_expr *e, const char *var, const char *const *consts,
                                    const double *const_values, int nconsts, mn_shared_program *out);
/* out[i] = e(x[i]) for n elements; scratch: MN_SHARED_MAX arrays of n doubles. */
void mn_shared_program_run(const mn_shared_program *p, const double *x, double *const *scratch, double *out,
                           int64_t n);
void mn_shared_program_free(mn_shared_program *p);

#endif
