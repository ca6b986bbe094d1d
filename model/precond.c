/* precond.c: the preconditioners of rule.def's MN_PRECONDS rows.
 *
 * newton_schulz (Muon's quintic iteration, SPEC.md section 2), for a matrix
 * G [m0 x n0], worked on as X [m x n] with m <= n (transposed when m0 > n0):
 *   nu = |G|_F, X_0 = G / (nu + 1e-7)
 *   X_{i+1} = a X_i + B_i X_i,  B_i = b A_i + c A_i^2,  A_i = X_i X_i^T
 *   out = X_k nu / |X_k|_F
 * Its adjoint, given dout (all in the worked-on orientation):
 *   dX_k = (nu/rho) dout - (nu/rho^3) <dout, X_k> X_k,  rho = |X_k|_F
 *   dnu  = <dout, X_k> / rho
 *   step i in reverse, with dX' the adjoint of X_{i+1}:
 *     dX_i = a dX' + B_i dX' + (dA + dA^T) X_i   (B_i is symmetric)
 *     dA   = b dB + c (dB A_i + A_i dB),  dB = dX' X_i^T
 *   dG   = dX_0 / (nu + eps) + (dnu - <dX_0, G> / (nu + eps)^2) G / nu
 * The iterates are recomputed from G and kept, (k + 1) m n doubles. Double
 * precision: the iteration amplifies rounding where G has small singular
 * values, and the engine's fp32 G is rounded once on the way in. */
#include "precond.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NS_A 3.4445
#define NS_B (-4.7750)
#define NS_C 2.0315
#define NS_EPS 1e-7

bool mn_precond_on(const mn_rule *r) { return r->precondition != MN_PRECOND_NONE; }

bool mn_precond_matrix(const mn_mlp_shape *s, int p, int64_t *rows, int64_t *cols)
{
    /* glu's U_i are matrices too (SPEC.md: every 2-D parameter), c_i biases */
    if (mn_param_is_bias_glu(s->layers, s->bias, p)) return false;
    int layer = mn_param_layer_glu(s->layers, s->bias, p);
    *rows = s->out[layer];
    *cols = s->in[layer];
    return true;
}

void mn_precond_work_free(mn_precond_work *w)
{
    double *bufs[] = {w->X, w->A, w->B, w->dB, w->dA, w->dX, w->dXn, w->G};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    memset(w, 0, sizeof *w);
}

static void caps(const mn_rule *r, const mn_mlp_shape *s, int64_t *mn, int64_t *mm)
{
    *mn = *mm = 0;
    if (!mn_precond_on(r)) return;
    for (int p = 0; p < s->nparams; p++) {
        int64_t rows, cols;
        if (!mn_precond_matrix(s, p, &rows, &cols)) continue;
        int64_t small = rows < cols ? rows : cols;
        if (rows * cols > *mn) *mn = rows * cols;
        if (small * small > *mm) *mm = small * small;
    }
}

static int64_t kept_iterates(const mn_rule *r, bool adjoint) { return adjoint ? r->ns_steps + 1 : 2; }

int64_t mn_precond_work_bytes(const mn_rule *r, const mn_mlp_shape *s, bool adjoint)
{
    int64_t mn, mm;
    caps(r, s, &mn, &mm);
    return (int64_t)sizeof(double) * ((kept_iterates(r, adjoint) + 3) * mn + 4 * mm);
}

mn_status mn_precond_work_init(mn_precond_work *w, const mn_rule *r, const mn_mlp_shape *s, bool adjoint)
{
    memset(w, 0, sizeof *w);
    caps(r, s, &w->cap_mn, &w->cap_mm);
    if (w->cap_mn == 0) return MN_OK;
    w->steps = r->ns_steps;
    w->adjoint = adjoint;
    size_t mn = sizeof(double) * (size_t)w->cap_mn, mm = sizeof(double) * (size_t)w->cap_mm;
    bool ok = (w->X = malloc(mn * (size_t)kept_iterates(r, adjoint))) && (w->A = malloc(mm)) && (w->B = malloc(mm)) &&
              (w->dB = malloc(mm)) && (w->dA = malloc(mm)) && (w->dX = malloc(mn)) && (w->dXn = malloc(mn)) &&
              (w->G = malloc(mn));
    if (!ok) {
        mn_precond_work_free(w);
        return mn_fail(MN_ERR_OOM, "out of memory for the Newton-Schulz scratch");
    }
    return MN_OK;
}

/* ---- newton_schulz ---- */

/* X [m x n] from the float matrix g [rows x cols], transposed when rows > cols. */
static void load(const float *g, int64_t rows, int64_t cols, double *X)
{
    if (rows <= cols)
        for (int64_t e = 0; e < rows * cols; e++) X[e] = g[e];
    else
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) X[j * rows + i] = g[i * cols + j];
}

static void store(const double *X, int64_t rows, int64_t cols, double scale, float *g)
{
    if (rows <= cols)
        for (int64_t e = 0; e < rows * cols; e++) g[e] = (float)(X[e] * scale);
    else
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) g[i * cols + j] = (float)(X[j * rows + i] * scale);
}

static double dot(const double *a, const double *b, int64_t n)
{
    double acc = 0;
    for (int64_t e = 0; e < n; e++) acc += a[e] * b[e];
    return acc;
}

/* A = X X^T and B = b A + c A^2 for X [m x n]. */
static void ns_products(mn_precond_work *w, const double *X, int64_t m, int64_t n)
{
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)m, (int)n, 1.0, X, (int)n, X, (int)n, 0.0,
                w->A, (int)m);
    for (int64_t e = 0; e < m * m; e++) w->B[e] = NS_B * w->A[e];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)m, (int)m, NS_C, w->A, (int)m, w->A, (int)m,
                1.0, w->B, (int)m);
}

/* Slot of iterate i in w->X: every one kept for the adjoint, else two in turn. */
static double *iterate(mn_precond_work *w, int i, int64_t mn) { return w->X + (w->adjoint ? i : i % 2) * mn; }

/* The iterates X_0 .. X_k of G (already in w->G, m x n, norm nu > 0) into
 * w->X; returns X_k. */
static const double *ns_iterate(mn_precond_work *w, int64_t m, int64_t n, double nu)
{
    int64_t mn = m * n;
    for (int64_t e = 0; e < mn; e++) w->X[e] = w->G[e] / (nu + NS_EPS);
    for (int i = 0; i < w->steps; i++) {
        const double *X = iterate(w, i, mn);
        double *Xn = iterate(w, i + 1, mn);
        ns_products(w, X, m, n);
        for (int64_t e = 0; e < mn; e++) Xn[e] = NS_A * X[e];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)m, 1.0, w->B, (int)m, X, (int)n,
                    1.0, Xn, (int)n);
    }
    return iterate(w, w->steps, mn);
}

static void ns_forward(mn_precond_work *w, float *g, int64_t rows, int64_t cols)
{
    int64_t m = rows <= cols ? rows : cols, n = rows <= cols ? cols : rows, mn = m * n;
    load(g, rows, cols, w->G);
    double nu = sqrt(dot(w->G, w->G, mn));
    if (!(nu > 0)) return; /* Gt = 0 stays 0 */
    const double *Y = ns_iterate(w, m, n, nu);
    double rho = sqrt(dot(Y, Y, mn));
    store(Y, rows, cols, rho > 0 ? nu / rho : 0.0, g);
}

static void ns_adjoint(mn_precond_work *w, const float *g, float *dg, int64_t rows, int64_t cols)
{
    int64_t m = rows <= cols ? rows : cols, n = rows <= cols ? cols : rows, mn = m * n;
    load(g, rows, cols, w->G);
    double nu = sqrt(dot(w->G, w->G, mn));
    if (!(nu > 0)) {
        memset(dg, 0, sizeof(float) * (size_t)mn);
        return;
    }
    const double *Y = ns_iterate(w, m, n, nu);
    double rho = sqrt(dot(Y, Y, mn));
    if (!(rho > 0)) {
        memset(dg, 0, sizeof(float) * (size_t)mn);
        return;
    }
    load(dg, rows, cols, w->dXn); /* dout */
    double dY = dot(w->dXn, Y, mn);
    double dnu = dY / rho;
    for (int64_t e = 0; e < mn; e++) w->dXn[e] = (nu / rho) * w->dXn[e] - (nu * dY / (rho * rho * rho)) * Y[e];
    for (int i = w->steps - 1; i >= 0; i--) {
        const double *X = iterate(w, i, mn);
        ns_products(w, X, m, n);
        /* dX = a dX' + B dX' */
        for (int64_t e = 0; e < mn; e++) w->dX[e] = NS_A * w->dXn[e];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)m, 1.0, w->B, (int)m, w->dXn,
                    (int)n, 1.0, w->dX, (int)n);
        /* dB = dX' X^T; dA = b dB + c (dB A + A dB) */
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)m, (int)n, 1.0, w->dXn, (int)n, X, (int)n,
                    0.0, w->dB, (int)m);
        for (int64_t e = 0; e < m * m; e++) w->dA[e] = NS_B * w->dB[e];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)m, (int)m, NS_C, w->dB, (int)m, w->A,
                    (int)m, 1.0, w->dA, (int)m);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)m, (int)m, NS_C, w->A, (int)m, w->dB,
                    (int)m, 1.0, w->dA, (int)m);
        /* dX += (dA + dA^T) X; B is free now: it holds dA + dA^T */
        for (int64_t i2 = 0; i2 < m; i2++)
            for (int64_t j = 0; j < m; j++) w->B[i2 * m + j] = w->dA[i2 * m + j] + w->dA[j * m + i2];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)m, 1.0, w->B, (int)m, X, (int)n,
                    1.0, w->dX, (int)n);
        double *swap = w->dXn;
        w->dXn = w->dX;
        w->dX = swap;
    }
    /* w->dXn: the adjoint of X_0 = G / (nu + eps) */
    double den = nu + NS_EPS;
    dnu -= dot(w->dXn, w->G, mn) / (den * den);
    for (int64_t e = 0; e < mn; e++) w->dXn[e] = w->dXn[e] / den + dnu * w->G[e] / nu;
    store(w->dXn, rows, cols, 1.0, dg);
}

/* ---- the rows ---- */

void mn_precond_apply(const mn_rule *r, const mn_mlp_shape *s, mn_precond_work *w, float *const *G)
{
    switch (r->precondition) {
    case MN_PRECOND_NONE: return;
    case MN_PRECOND_NEWTON_SCHULZ:
        for (int p = 0; p < s->nparams; p++) {
            int64_t rows, cols;
            if (mn_precond_matrix(s, p, &rows, &cols)) ns_forward(w, G[p], rows, cols);
        }
        return;
    case MN_PRECOND_COUNT: return;
    }
}

void mn_precond_adjoint(const mn_rule *r, const mn_mlp_shape *s, mn_precond_work *w, float *const *G,
                        float *const *dG)
{
    switch (r->precondition) {
    case MN_PRECOND_NONE: return;
    case MN_PRECOND_NEWTON_SCHULZ:
        for (int p = 0; p < s->nparams; p++) {
            int64_t rows, cols;
            if (mn_precond_matrix(s, p, &rows, &cols)) ns_adjoint(w, G[p], dG[p], rows, cols);
        }
        return;
    case MN_PRECOND_COUNT: return;
    }
}
