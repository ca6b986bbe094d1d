/* blas.c: matrix products on the device through cuBLAS (strided batched
 * SGEMM / DGEMM) with one handle created at the first product, and the
 * cuBLAS error translation of cuda_check.h. i64 products go to a plain
 * kernel (ops.cu): cuBLAS has no integer type that wraps as the CPU does.
 * cuBLAS is column-major and mnemo row-major: a row-major C = A B is the
 * column-major C^T = B^T A^T, so the operands go in swapped. */
#include "cuda_check.h"
#include "cuda_ops.h"

#include <cublas_v2.h>
#include <limits.h>

static cublasHandle_t handle;

mn_status mn_cublas_status(int status, const char *call, const char *file, int line)
{
    cublasStatus_t s = (cublasStatus_t)status;
    if (s == CUBLAS_STATUS_SUCCESS) return MN_OK;
    return mn_fail(s == CUBLAS_STATUS_ALLOC_FAILED ? MN_ERR_OOM : MN_ERR_DEVICE, "cublas: %s (%s) in %s at %s:%d",
                   cublasGetStatusString(s), cublasGetStatusName(s), call, file, line);
}

static mn_status get_handle(cublasHandle_t *out)
{
    if (!handle) {
        MN_TRY(mn_cuda_ensure_device());
        cublasHandle_t h = NULL;
        MN_CUBLAS_CHECK(cublasCreate(&h));
        /* fp32 means fp32: no tensor-core tf32 rounding (SPEC.md section 3) */
        mn_status st = MN_CUBLAS_ST(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
        if (st != MN_OK) {
            cublasDestroy(h);
            return st;
        }
        handle = h;
    }
    *out = handle;
    return MN_OK;
}

/* How cuBLAS can read one [rows, cols] matrix of a batch with these strides
 * (in elements): row-major (in cuBLAS's eyes, the transpose) or column-major,
 * with its leading dimension; false when neither fits and a copy is needed.
 * The same test as the CPU's blas_layout. */
static bool layout(const mn_tensor *t, bool *row_major, int64_t *ld)
{
    int64_t rows = t->shape[1], cols = t->shape[2], rs = t->stride[1], cs = t->stride[2];
    int64_t mincols = cols > 1 ? cols : 1, minrows = rows > 1 ? rows : 1;
    if (t->shape[0] > 1 && t->stride[0] == 0) return false; /* a broadcast batch: copy, to be safe */
    if ((cols == 1 || cs == 1) && (rows == 1 || rs >= mincols)) {
        *row_major = true;
        *ld = rows == 1 ? mincols : rs;
        return true;
    }
    if ((rows == 1 || rs == 1) && (cols == 1 || cs >= minrows)) {
        *row_major = false;
        *ld = cols == 1 ? minrows : cs;
        return true;
    }
    return false;
}

static mn_status check_operands(const mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[3] = {out, a, b};
    for (int i = 0; i < 3; i++)
        if (!t[i]->storage || t[i]->storage->device != MN_CUDA || t[i]->ndim != 3)
            return mn_fail(MN_ERR_ARG, "cuda matmul: operands must be 3-d cuda tensors");
    if (a->dtype != out->dtype || b->dtype != out->dtype)
        return mn_fail(MN_ERR_ARG, "cuda matmul: operand dtypes differ");
    int64_t batch = out->shape[0], m = out->shape[1], n = out->shape[2], k = a->shape[2];
    if (a->shape[0] != batch || b->shape[0] != batch || a->shape[1] != m || b->shape[1] != k || b->shape[2] != n ||
        !mn_tensor_is_contiguous(out))
        return mn_fail(MN_ERR_ARG, "cuda matmul: operand shapes do not fit");
    return MN_OK;
}

mn_status mn_cuda_matmul(mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    MN_TRY(check_operands(out, a, b));
    int64_t batch = out->shape[0], m = out->shape[1], n = out->shape[2], k = a->shape[2];
    if (batch == 0 || m == 0 || n == 0) return MN_OK;
    if (k == 0) return mn_cuda_fill(out, 0.0);
    if (out->dtype == MN_I64) return mn_cuda_matmul_i64(out, a, b);

    cublasHandle_t h = NULL;
    MN_TRY(get_handle(&h));
    mn_tensor ca = {0}, cb = {0};
    const mn_tensor *A = a, *B = b;
    bool arow = true, brow = true;
    int64_t lda = 1, ldb = 1;
    mn_status st = MN_OK;
    if (!layout(A, &arow, &lda)) {
        if ((st = mn_tensor_clone(&ca, a)) != MN_OK) goto done;
        A = &ca;
        layout(A, &arow, &lda);
    }
    if (!layout(B, &brow, &ldb)) {
        if ((st = mn_tensor_clone(&cb, b)) != MN_OK) goto done;
        B = &cb;
        layout(B, &brow, &ldb);
    }
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX || batch > INT_MAX) {
        st = mn_fail(MN_ERR_UNSUPPORTED, "matmul: %lldx%lld @ %lldx%lld (batch %lld) is too large for cuBLAS",
                     (long long)m, (long long)k, (long long)k, (long long)n, (long long)batch);
        goto done;
    }
    /* C^T (n x m) = op(B) (n x k) * op(A) (k x m), all column-major. */
    cublasOperation_t opb = brow ? CUBLAS_OP_N : CUBLAS_OP_T, opa = arow ? CUBLAS_OP_N : CUBLAS_OP_T;
    long long sa = A->stride[0], sb = B->stride[0], sc = m * n;
    if (out->dtype == MN_F32) {
        const float one = 1.0f, zero = 0.0f;
        st = MN_CUBLAS_ST(cublasSgemmStridedBatched(h, opb, opa, (int)n, (int)m, (int)k, &one,
                                                    (const float *)mn_tensor_data(B), (int)ldb, sb,
                                                    (const float *)mn_tensor_data(A), (int)lda, sa, &zero,
                                                    (float *)mn_tensor_data(out), (int)n, sc, (int)batch));
    } else {
        const double one = 1.0, zero = 0.0;
        st = MN_CUBLAS_ST(cublasDgemmStridedBatched(h, opb, opa, (int)n, (int)m, (int)k, &one,
                                                    (const double *)mn_tensor_data(B), (int)ldb, sb,
                                                    (const double *)mn_tensor_data(A), (int)lda, sa, &zero,
                                                    (double *)mn_tensor_data(out), (int)n, sc, (int)batch));
    }
done:
    mn_tensor_release(&ca);
    mn_tensor_release(&cb);
    return st;
}
