/* cuda_ops.h: the CUDA backend's entry points, one per mn_backend member
 * (model/ops.h says what the front end hands each of them). ops.cu holds the
 * elementwise, reduction, copy and fill kernels; blas.c the matrix product;
 * staging.c the staged transfers.
 * cuda.c assembles them into the backend it registers for MN_CUDA. */
#ifndef MN_CUDA_OPS_H
#define MN_CUDA_OPS_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../model/ops.h"

mn_status mn_cuda_unary(mn_op op, mn_tensor *out, const mn_tensor *a);
mn_status mn_cuda_binary(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
mn_status mn_cuda_where(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b);
mn_status mn_cuda_reduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim);
mn_status mn_cuda_argreduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim);
mn_status mn_cuda_reduce_all(mn_op op, const mn_tensor *a, double *result);
/* dst (any strides, cuda) = src (same shape, any strides, cuda), converting dtype. */
mn_status mn_cuda_copy(mn_tensor *dst, const mn_tensor *src);
mn_status mn_cuda_fill(mn_tensor *dst, double value);
/* Initial weights drawn on the device (model/random_counter.h; ops.h's init_fill). */
mn_status mn_cuda_init_fill(mn_tensor *dst, int kind, double scale, uint64_t seed, uint64_t stream, int64_t period);
mn_status mn_cuda_tile_many(int n, mn_tensor *const *dst, const mn_tensor *const *src);
/* The row normalisation of model/rownorm.h (qk_norm's keys), with each
 * row's scale where scale is given, and its adjoint: one warp a row
 * (rownorm_warp.cuh). */
mn_status mn_cuda_rownorm(mn_tensor *out, mn_tensor *scale, const mn_tensor *x, bool center, bool sum, double eps);
mn_status mn_cuda_rownorm_vjp(mn_tensor *xbar, const mn_tensor *nhat, const mn_tensor *scale, const mn_tensor *a,
                              bool center, bool sum);
/* Staged transfers through page-locked buffers (staging.c; ops.h's stage_in,
 * stage_out); mn_cuda_empty_cache gives the buffers back. */
mn_status mn_cuda_stage_in(void *dev, size_t nbytes, const mn_stage_io *io);
mn_status mn_cuda_stage_out(const void *dev, size_t nbytes, const mn_stage_io *io);
void mn_cuda_staging_release(void);
/* Batched [batch,m,k] x [batch,k,n] -> out [batch,m,n] contiguous (blas.c). */
mn_status mn_cuda_matmul(mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
/* The i64 product (no cuBLAS type for it), same layout as mn_cuda_matmul (ops.cu). */
mn_status mn_cuda_matmul_i64(mn_tensor *out, const mn_tensor *a, const mn_tensor *b);

#ifdef __cplusplus
}
#endif

#endif
