/* mlp_cpu.h: the memory model M(x; W) of SPEC.md section 1 on the CPU, for
 * one memory and a block of rows: forward (keeping what backward needs) and
 * the parameter gradients for a given dL/dy. Float32 with BLAS products. */
#ifndef MN_MLP_CPU_H
#define MN_MLP_CPU_H

#include "expr.h"
#include "rownorm.h"
#include "rule.h"

typedef struct mn_mlp_shape {
    int layers;
    bool bias, residual, glu; /* glu: hidden layers phi(W h + b) * (U h + c) */
    mn_activation activation;
    mn_rownorm out_norm;                          /* the last layer's output normalised (v2) */
    int64_t in[MN_MAX_LAYERS], out[MN_MAX_LAYERS]; /* W_i is out[i] x in[i] */
    int nparams;
    int64_t numel[MN_MAX_PARAMS];                 /* per parameter, one memory */
} mn_mlp_shape;

/* Scratch for one thread: activations of every layer for up to max_rows rows,
 * plus the programs of a custom activation (compiled per thread, so no
 * program is shared between threads). */
typedef struct mn_mlp_work {
    int64_t max_rows;
    float *z[MN_MAX_LAYERS];   /* pre-activations of hidden layers */
    float *h[MN_MAX_LAYERS];   /* h[i] = phi(z[i]), with glu a[i] * g[i] */
    float *a[MN_MAX_LAYERS];   /* glu only: phi(z[i]) */
    float *g[MN_MAX_LAYERS];   /* glu only: the gate U h + c */
    float *aux[MN_MAX_LAYERS]; /* what phi' needs, kept from the forward: sigmoid(z) for
                                * silu, tanh(z) for tanh, Phi(z) for gelu (so the backward
                                * needs no second exp per element) */
    float *dz, *dh, *dg;       /* backward scratch, max_rows x max width (dg with glu) */
    double *dbuf_in, *dbuf_out;/* custom activation evaluation */
    mn_expr_program *act, *act_grad;
    /* out_norm: the memory's g and beta ([dv], set by the caller before a
     * forward), and what the forward keeps: nhat (max_rows x dv) and the
     * rows' scales s */
    const float *ln_g, *ln_b;
    float *nhat, *ns;
} mn_mlp_work;

void mn_mlp_shape_init(mn_mlp_shape *s, const mn_rule *rule, const mn_dims *d);
/* Layer i's weight (gate: U_i) and bias (gate: c_i; NULL without bias) in
 * params, indexed as model/param_layout.h lays them out. */
void mn_mlp_layer_params(const mn_mlp_shape *s, float *const *params, int i, bool gate, float **W, float **b);
mn_status mn_mlp_work_init(mn_mlp_work *w, const mn_mlp_shape *s, const mn_rule *rule, int64_t max_rows);
void mn_mlp_work_free(mn_mlp_work *w);

/* y[rows x dv] = M(x[rows x dk]; params); params[i] points at one memory's
 * parameter i. Keeps z and h (and out_norm's nhat, s) in w for
 * mn_mlp_backward. With out_norm, w->ln_g and w->ln_b must be set. */
void mn_mlp_forward(const mn_mlp_shape *s, mn_mlp_work *w, float *const *params, const float *x,
                    int64_t rows, float *y);
/* grads[i] = dL/dparam_i given dy = dL/dy (rows x dv), after a forward on x.
 * dy is consumed (overwritten). */
void mn_mlp_backward(const mn_mlp_shape *s, mn_mlp_work *w, float *const *params, const float *x,
                     int64_t rows, float *dy, float *const *grads);

#endif
