/* large_bgrad.h: the large path's weight gradient of a layer with a bias,
 * G_W = D^T X, with the bias's gradient (the column sums of D over the
 * rows) from the same product: cuBLASLt's bias-gradient epilogue
 * (CUBLASLT_EPILOGUE_BGRADB), which sums the operand D as the product
 * loads it, where a launch of its own read D again (11.6-12.1 us of L1's
 * step on an H200). Internal to kernels/engine_large.c. */
#ifndef MN_LARGE_BGRAD_H
#define MN_LARGE_BGRAD_H

#include "../model/engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

/* One product's shape as kernels/engine_large.c's gemm() takes it
 * (column-major, C^T = A op_T(B), batched over the memories with strides):
 * C [m, n] = A [m, k] (not transposed) times B^T, B stored [n, k]; the bias
 * gradient has n entries a memory, bias_stride apart. */
typedef struct mn_bgrad_shape {
    cudaDataType_t type;        /* of A and B; C and the bias are fp32 */
    cublasComputeType_t compute;
    long long m, n, k, lda, sa, ldb, sb, ldc, sc, bias_stride;
    int batch;
} mn_bgrad_shape;

typedef struct mn_bgrad_plan mn_bgrad_plan;

/* The plan for shape (remembered: a later run of the same shape takes it
 * without asking cuBLASLt again), or NULL without an error where cuBLASLt
 * offers no algorithm for it, a batch's matrices are not 256-byte aligned
 * (A, B, C and the bias on buffers that are assumed), or
 * MNEMO_LARGE_BGRAD=0: the caller then sums the columns in a launch of its
 * own. ws_bytes: the workspace the product may use. */
mn_status mn_bgrad_plan_for(const mn_bgrad_shape *shape, size_t ws_bytes, const mn_bgrad_plan **out);

/* C = A op_T(B) (beta 0) and bias = the column sums of B's rows, on stream. */
mn_status mn_bgrad_run(const mn_bgrad_plan *plan, const void *A, const void *B, float *C, float *bias, void *ws,
                       size_t ws_bytes, cudaStream_t stream);

#endif
