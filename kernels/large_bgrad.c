/* large_bgrad.c: the weight gradient and its bias's gradient in one
 * cuBLASLt product (kernels/large_bgrad.h). The plans live as long as the
 * process, as cuBLAS's own handle does: a few shapes a process, each asked
 * of cuBLASLt's heuristic once (its first answer taken: timing every
 * candidate would cost a run's first step more than it saves). */
#include "large_bgrad.h"
#include "cuda_check.h"

#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

#define PLANS 8 /* shapes remembered; past that, the oldest is forgotten */

struct mn_bgrad_plan {
    mn_bgrad_shape shape;
    size_t ws_bytes;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    bool none; /* cuBLASLt has no algorithm for it */
};

static struct {
    cublasLtHandle_t handle;
    mn_bgrad_plan plans[PLANS];
    int used, next;
} lt;

static void plan_release(mn_bgrad_plan *p)
{
    if (p->lc) (void)cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb) (void)cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la) (void)cublasLtMatrixLayoutDestroy(p->la);
    if (p->desc) (void)cublasLtMatmulDescDestroy(p->desc);
    memset(p, 0, sizeof *p);
}

static mn_status layout(cublasLtMatrixLayout_t *l, cudaDataType_t type, long long rows, long long cols, long long ld,
                        int batch, long long stride)
{
    MN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l, type, (uint64_t)rows, (uint64_t)cols, ld));
    MN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
    return MN_CUBLAS_ST(
        cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
}

/* Whether every matrix of every batch of shape starts 256-byte aligned and
 * every column and bias vector 16-byte aligned, its buffers' bases being
 * 256-aligned (the path's workspace): the heuristic assumes 256 for every
 * pointer (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*'s default) and never sees a
 * batch's bias vector. Other shapes (odd widths, short chunks) keep the
 * column launch. */
static bool aligned(const mn_bgrad_shape *s)
{
    const long long es = s->type == CUDA_R_16BF ? 2 : 4;
    return (s->sa * es) % 256 == 0 && (s->sb * es) % 256 == 0 && (s->sc * 4) % 256 == 0 && (s->lda * es) % 16 == 0 &&
           (s->ldb * es) % 16 == 0 && (s->ldc * 4) % 16 == 0 && (s->bias_stride * 4) % 16 == 0;
}

/* Descriptor, layouts and the heuristic's first algorithm for p->shape;
 * p->none where it offers none or the shape is not aligned(). */
static mn_status plan_make(mn_bgrad_plan *p)
{
    const mn_bgrad_shape *s = &p->shape;
    if (!aligned(s)) {
        p->none = true;
        return MN_OK;
    }
    const cublasOperation_t na = CUBLAS_OP_N, tb = CUBLAS_OP_T;
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BGRADB;
    const int64_t bias_stride = s->bias_stride;
    MN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, s->compute, CUDA_R_32F));
    MN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &na, sizeof na));
    MN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    MN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    MN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bias_stride,
                                                   sizeof bias_stride));
    MN_TRY(layout(&p->la, s->type, s->m, s->k, s->lda, s->batch, s->sa));
    MN_TRY(layout(&p->lb, s->type, s->n, s->k, s->ldb, s->batch, s->sb));
    MN_TRY(layout(&p->lc, CUDA_R_32F, s->m, s->n, s->ldc, s->batch, s->sc));
    cublasLtMatmulPreference_t pref = NULL;
    MN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    mn_status st = MN_CUBLAS_ST(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                     &p->ws_bytes, sizeof p->ws_bytes));
    /* no algorithm is an answer, not a failure: the caller sums the columns itself */
    if (st == MN_OK &&
        cublasLtMatmulAlgoGetHeuristic(lt.handle, p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found) !=
            CUBLAS_STATUS_SUCCESS)
        found = 0;
    (void)cublasLtMatmulPreferenceDestroy(pref);
    if (st != MN_OK) return st;
    p->none = found < 1;
    if (!p->none) p->algo = res.algo;
    return MN_OK;
}

mn_status mn_bgrad_plan_for(const mn_bgrad_shape *shape, size_t ws_bytes, const mn_bgrad_plan **out)
{
    static int on = -1;
    *out = NULL;
    if (on < 0) {
        const char *knob = getenv("MNEMO_LARGE_BGRAD");
        on = !(knob && strcmp(knob, "0") == 0);
    }
    if (!on) return MN_OK;
    for (int i = 0; i < lt.used; i++) {
        const mn_bgrad_plan *p = &lt.plans[i];
        if (p->ws_bytes == ws_bytes && memcmp(&p->shape, shape, sizeof *shape) == 0) {
            *out = p->none ? NULL : p;
            return MN_OK;
        }
    }
    if (!lt.handle) MN_CUBLAS_CHECK(cublasLtCreate(&lt.handle));
    mn_bgrad_plan *p = &lt.plans[lt.next];
    plan_release(p);
    lt.next = (lt.next + 1) % PLANS;
    if (lt.used < PLANS) lt.used++;
    p->shape = *shape;
    p->ws_bytes = ws_bytes;
    mn_status s = plan_make(p);
    if (s != MN_OK) {
        plan_release(p);
        p->none = true; /* remembered as none: the same shape does not fail again */
        p->shape = *shape;
        p->ws_bytes = ws_bytes;
        return s;
    }
    *out = p->none ? NULL : p;
    return MN_OK;
}

mn_status mn_bgrad_run(const mn_bgrad_plan *plan, const void *A, const void *B, float *C, float *bias, void *ws,
                       size_t ws_bytes, cudaStream_t stream)
{
    const float one = 1.0f, zero = 0.0f;
    /* the bias pointer is the descriptor's, set for each product (host side only) */
    MN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    return MN_CUBLAS_ST(cublasLtMatmul(lt.handle, plan->desc, &one, A, plan->la, B, plan->lb, &zero, C, plan->lc, C,
                                       plan->lc, &plan->algo, ws, ws_bytes, stream));
}
