/* cuda_check.h: the check macros of the CUDA layer, and what its files
 * (cuda.c, ops.cu, blas.c, engine_cuda.c) share beyond kernels/cuda.h.
 * Every CUDA runtime and cuBLAS call goes through a macro that turns a
 * failure into an mn_status with a one-line message naming the library's own
 * error text, the call and file:line ("cuda: out of memory
 * (cudaErrorMemoryAllocation) in cudaMalloc(&p, n) at kernels/cuda.c:120").
 * Included from C and from CUDA C++. */
#ifndef MN_CUDA_CHECK_H
#define MN_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "cuda.h"
#include "../model/tensor.h"

/* MN_OK for cudaSuccess; otherwise records the message and returns
 * MN_ERR_OOM for cudaErrorMemoryAllocation, MN_ERR_DEVICE for the rest. The
 * runtime's last-error slot is cleared, so that a failure reported here is
 * not reported again by mn_cuda_check_pending. */
mn_status mn_cuda_status(cudaError_t err, const char *call, const char *file, int line);
/* The same for a cublasStatus_t (passed as int, so this header needs no
 * cuBLAS include): "cublas: <cublasGetStatusString> (<name>) in ... at ...". */
mn_status mn_cublas_status(int status, const char *call, const char *file, int line);

/* Number of multiprocessors of the device (for grid sizes); 1 if unknown. */
int mn_cuda_sm_count(void);

/* What enqueue(ctx) puts on stream, captured into a CUDA graph (a
 * thread-local capture, which enqueue's launches only record) and
 * instantiated: true and *exec; false and *exec NULL where the capture,
 * enqueue or the instantiation failed, with the runtime's error cleared:
 * the caller then launches directly. The capture always ends. */
bool mn_cuda_capture_graph(cudaStream_t stream, mn_status (*enqueue)(void *ctx), void *ctx, cudaGraphExec_t *exec);

#ifdef __cplusplus
}
#endif

/* An mn_status expression, for code that must clean up before returning. */
#define MN_CUDA_ST(call) mn_cuda_status((call), #call, __FILE__, __LINE__)
#define MN_CUBLAS_ST(call) mn_cublas_status((int)(call), #call, __FILE__, __LINE__)

/* Return the failure from the enclosing function (which returns mn_status). */
#define MN_CUDA_CHECK(call)                                                    \
    do {                                                                       \
        mn_status mn_cuda_st_ = MN_CUDA_ST(call);                              \
        if (mn_cuda_st_ != MN_OK) return mn_cuda_st_;                          \
    } while (0)
#define MN_CUBLAS_CHECK(call)                                                  \
    do {                                                                       \
        mn_status mn_cublas_st_ = MN_CUBLAS_ST(call);                          \
        if (mn_cublas_st_ != MN_OK) return mn_cublas_st_;                      \
    } while (0)
/* After a kernel launch: a bad configuration shows up here at once; faults
 * during execution show up later (mn_cuda_check_pending). */
#define MN_CUDA_CHECK_LAUNCH() MN_CUDA_CHECK(cudaGetLastError())

#endif
