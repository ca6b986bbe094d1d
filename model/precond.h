/* precond.h: what replaces the clipped step gradient before the update
 * (SPEC.md section 2, `precondition`): each row of MN_PRECONDS (rule.def)
 * has its math here, forward and adjoint, so the engine and the backward
 * call one function whatever the row. Newton-Schulz works on each 2-D
 * parameter (W1, W2, ...; biases are left alone) in double precision. */
#ifndef MN_PRECOND_H
#define MN_PRECOND_H

#include "mlp_cpu.h"

/* Scratch for one thread, sized for the rule's largest matrix. */
typedef struct mn_precond_work {
    int steps;
    bool adjoint;                      /* keeps every iterate (else two) */
    int64_t cap_mn, cap_mm;
    double *X;                         /* (steps + 1) x cap_mn with adjoint, else 2 x cap_mn */
    double *A, *B, *dB, *dA;           /* cap_mm each */
    double *dX, *dXn, *G;              /* cap_mn each */
} mn_precond_work;

/* Whether the rule's precondition does anything. */
bool mn_precond_on(const mn_rule *r);
/* Parameter p is a matrix the preconditioner replaces: its rows and cols. */
bool mn_precond_matrix(const mn_mlp_shape *s, int p, int64_t *rows, int64_t *cols);

/* adjoint: scratch for mn_precond_adjoint too (the forward alone keeps two
 * iterates, the adjoint all ns_steps + 1). */
mn_status mn_precond_work_init(mn_precond_work *w, const mn_rule *r, const mn_mlp_shape *s, bool adjoint);
void mn_precond_work_free(mn_precond_work *w);
int64_t mn_precond_work_bytes(const mn_rule *r, const mn_mlp_shape *s, bool adjoint);

/* G[p] <- precondition(G[p]) in place, for every parameter p. */
void mn_precond_apply(const mn_rule *r, const mn_mlp_shape *s, mn_precond_work *w, float *const *G);

/* The adjoint (a work made with adjoint = true): G[p] is the input the forward saw (the clipped gradient),
 * dG[p] holds the adjoint of the output on entry and of the input on exit.
 * A zero matrix (the output is zero too) passes no gradient. */
void mn_precond_adjoint(const mn_rule *r, const mn_mlp_shape *s, mn_precond_work *w, float *const *G,
                        float *const *dG);

#endif
