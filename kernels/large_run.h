/* large_run.h: what kernels/engine_large.c (the large path's segments)
 * and kernels/large_keep.c (the steps it keeps between segments) share:
 * a segment's state (run), the workspace's layout (kernels/large_run.c),
 * and the kept entry. Internal to those files. */
#ifndef MN_LARGE_RUN_H
#define MN_LARGE_RUN_H

#include "../model/engine.h"
#include "cuda_module.h"
#include "large_kernels.cuh" /* its first part is C: the argument structs */

#include <cuda_runtime.h>

/* The kernels of the path's module, in mn_large_kernel_names' order. */
enum { K_PARAMS, K_STAGE, K_ACT, K_LOSS, K_COLS, K_NORM, K_UPDATE, K_OUT, K_ROW, K_NS, K_ARGS, K_COUNT };

struct kept;

typedef struct run {
    mn_cuda_module *mod;
    mn_large_kargs a;       /* the segment's arguments, built here ... */
    mn_large_kargs *dargs;  /* ... and their device copy, which every kernel reads */
    struct kept *kept;      /* the kept step this segment replays (its workspace), or NULL */
    bool own;               /* the workspace holds the path's copies of W and A (a kept segment) */
    float *own_W[MN_LARGE_MAX_PARAMS], *own_A[MN_LARGE_MAX_PARAMS]; /* kept: the path's W and A */
    int L, per, np, refresh, step;
    int nl;   /* the layers' parameters (W_i, b_i); glu's gates U_i, c_i follow (param_layout.h) */
    bool ns;  /* precondition = newton_schulz: the ns kernel between the norm and the update */
    bool glu; /* the hidden layers are gated: h = phi(z) u */
    long long M, dk, dv, dh, wide, CR;
    mn_precision prec;
    bool training;
    bool capturing; /* a step is being captured: launches are programmatic dependents (engine_large.c) */
    /* chunk buffers, [M, CR, width]: X, H, Db and DUb are GEMM operands (bf16
     * in bf16); U (glu) holds the gate u, then dL/du, an operand in fp32/tf32 */
    void *X, *H[MN_MAX_LAYERS], *Db, *DUb;
    float *Z[MN_MAX_LAYERS], *U[MN_MAX_LAYERS], *Y, *D[2];
    void *blas_ws;
    void *work;
    size_t work_bytes;
    cudaGraphExec_t graph;
    /* the weights: P the gradient point (fp32: biases, and the products in
     * fp32/tf32), Pop and Wop the operands of the products at P and at W */
    float *P[MN_LARGE_MAX_PARAMS];
    const void *Pop[MN_LARGE_MAX_PARAMS], *Wop[MN_LARGE_MAX_PARAMS];
    /* the segment */
    const float *k, *q; /* q NULL: q = k */
    float *y;           /* retrieval output or NULL */
    bool after;         /* retrieve = after: the last row of a step sees W^(s+1) */
    bool copy_y;        /* retrieval at W^(s) is the training forward (q = k, P = W) */
    bool retrieve;      /* ... else a forward of its own */
} run;

/* cuBLAS's workspace, given explicitly so that a captured product never
 * allocates (32 MiB: what cuBLAS asks for on Hopper); cuBLASLt's products
 * (kernels/large_bgrad.h) use the same. */
#define MN_LARGE_BLAS_WORKSPACE ((size_t)32 << 20)

/* Carves the workspace at base (NULL: only counts); returns its bytes
 * (kernels/large_run.c). */
size_t mn_large_carve(run *R, char *base);
/* Points the products and the kernels at their weights, once carved. */
void mn_large_point_weights(run *R);

/* ---- the kept steps (large_keep.c) ---- */
typedef struct kept {
    cudaGraphExec_t graph; /* the step, captured once; NULL until then */
    bool warm;             /* a step ran directly: cuBLAS and the modules are loaded, a capture may follow */
    bool no_graph;         /* a capture failed: this shape's steps run directly */
} kept;

/* R's workspace (carved, weights pointed) from the kept entry of its key,
 * or a new entry; R->kept stays NULL, without an error, where keeping is
 * off (MNEMO_LARGE_KEEP=0) or the workspace is over a quarter of
 * device_bytes: the caller allocates its own then. */
mn_status mn_large_kept_attach(run *R, size_t device_bytes);
/* Drops E (a failed segment's: its graph may be broken). */
void mn_large_kept_forget(kept *E);
/* Drops every entry; the caller has waited for the stream. */
void mn_large_kept_drop_all(void);
size_t mn_large_kept_bytes(void);

#endif
