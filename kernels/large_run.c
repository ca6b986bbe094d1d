/* large_run.c: the large path's workspace, one block carved into a
 * segment's buffers, and the weights its products and kernels read
 * (kernels/large_run.h): the layout that kernels/engine_large.c (a
 * segment's own block) and kernels/large_keep.c (a kept step's) share. */
#include "large_run.h"
#include "rule_kernel.cuh" /* mn_rule_ns_doubles: newton_schulz's workspace */

static void *take(char *base, size_t *off, size_t bytes)
{
    void *p = base ? base + *off : NULL;
    *off += (bytes + 255) & ~(size_t)255; /* every piece 256-byte aligned, as cuBLAS likes */
    return p;
}

size_t mn_large_carve(run *R, char *base)
{
    mn_large_kargs *a = &R->a;
    const bool bf16 = R->prec == MN_PREC_BF16;
    const size_t es = bf16 ? 2 : 4, rows = (size_t)(R->M * R->CR), M = (size_t)R->M;
    size_t off = 0;
    R->dargs = take(base, &off, sizeof(mn_large_kargs));
    R->blas_ws = take(base, &off, MN_LARGE_BLAS_WORKSPACE);
    R->X = take(base, &off, rows * R->dk * es);
    for (int i = 0; i + 1 < R->L; i++) {
        R->Z[i] = take(base, &off, rows * R->dh * 4);
        R->H[i] = take(base, &off, rows * R->dh * es);
        R->U[i] = R->glu ? take(base, &off, rows * R->dh * 4) : NULL;
    }
    R->Y = take(base, &off, rows * R->dv * 4);
    for (int p = 0; p < R->np; p++) {
        bool is_bias = mn_param_is_bias_glu(R->L, R->per == 2, p);
        a->Wb[p] = bf16 && !is_bias ? take(base, &off, M * a->numel[p] * 2) : NULL;
        a->Ab[p] = bf16 && !is_bias && R->training && R->refresh != R->step ? take(base, &off, M * a->numel[p] * 2)
                                                                          : NULL;
        if (R->own) {
            R->own_W[p] = take(base, &off, M * a->numel[p] * 4);
            R->own_A[p] = R->refresh != R->step ? take(base, &off, M * a->numel[p] * 4) : NULL;
        }
    }
    if (!R->training) return off;
    R->D[0] = take(base, &off, rows * R->wide * 4);
    R->D[1] = take(base, &off, rows * R->wide * 4);
    R->Db = bf16 ? take(base, &off, rows * R->wide * 2) : NULL;
    R->DUb = bf16 && R->glu ? take(base, &off, rows * R->dh * 2) : NULL;
    for (int p = 0; p < R->np; p++) a->G[p] = take(base, &off, M * a->numel[p] * 4);
    size_t nrb = (size_t)((R->CR + MN_LARGE_COL_ROWS - 1) / MN_LARGE_COL_ROWS);
    size_t ntiles = (size_t)((R->wide + 31) / 32);
    /* glu: a gated layer's column sums of du follow those of dz */
    size_t parts = M * (size_t)a->nslices, colparts = (R->glu ? 2 : 1) * M * nrb * (size_t)R->wide;
    a->part = take(base, &off, (parts > colparts ? parts : colparts) * sizeof(double));
    a->tickets = take(base, &off, (1 + M * ntiles) * sizeof(unsigned));
    a->counter = take(base, &off, sizeof(long long));
    a->scale = take(base, &off, M * R->np * sizeof(float));
    a->finite = take(base, &off, M * sizeof(int));
    a->rowbuf = take(base, &off, 2 * M * (size_t)(R->dh > 0 ? R->dh : 1) * sizeof(float));
    if (R->ns) {
        /* a slot per parameter of every memory: the ns kernel's blocks run at once */
        a->ns_doubles = mn_rule_ns_doubles(R->L, R->per == 2, R->dk, R->dv, R->dh);
        a->ns_work = take(base, &off, M * (size_t)R->np * (size_t)a->ns_doubles * sizeof(double));
    }
    return off;
}

/* The weights the products and the kernels read, once the workspace is
 * carved: a kept segment's are the path's own copies of W and A (the
 * caller's, Wu and Au, are copied in by begin and out by store). */
void mn_large_point_weights(run *R)
{
    const bool at_w = R->refresh == R->step, bf16 = R->prec == MN_PREC_BF16;
    for (int p = 0; p < R->np; p++) {
        if (R->own) {
            R->a.Wu[p] = R->a.W[p];
            R->a.W[p] = R->own_W[p];
            if (R->own_A[p]) {
                R->a.Au[p] = R->a.A[p];
                R->a.A[p] = R->own_A[p];
            }
        }
        R->P[p] = at_w ? R->a.W[p] : R->a.A[p];
        R->Wop[p] = bf16 ? R->a.Wb[p] : R->a.W[p];
        R->Pop[p] = bf16 ? (at_w ? R->a.Wb[p] : R->a.Ab[p]) : R->P[p];
    }
}
