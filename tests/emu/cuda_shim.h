/* cuda_shim.h: just enough of CUDA to run a generated kernel source on the
 * CPU (tests/unit/test_grad_emulated.c): a block's threads are pthreads,
 * __syncthreads a barrier of all of them, a warp shuffle an exchange
 * through a buffer between two barriers of the warp's 32 threads, shared
 * memory a static (one block runs at a time), the _rn intrinsics plain IEEE
 * operations (compiled with -ffp-contract=off: no fused multiply-adds).
 * Not a CUDA: it runs the kernel's logic, its barriers and its reductions
 * as written, so that an index, phase or formula error shows on a machine
 * without a GPU; races it may not show. */
#ifndef MN_CUDA_SHIM_H
#define MN_CUDA_SHIM_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define __CUDACC_RTC__ 1
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct mn_dim3 {
    unsigned x, y, z;
};
extern thread_local mn_dim3 threadIdx;
extern mn_dim3 blockIdx, blockDim;
extern pthread_barrier_t mn_shim_block_barrier;
extern pthread_barrier_t mn_shim_warp_barrier[32];
extern double mn_shim_warp_buffer[32][32];

/* the read-only cache's load: a plain load here */
template <class T> static inline T __ldg(const T *p) { return *p; }

static inline void __syncthreads() { pthread_barrier_wait(&mn_shim_block_barrier); }
static inline void __syncwarp() { pthread_barrier_wait(&mn_shim_warp_barrier[threadIdx.x >> 5]); }

/* Lane l reads what lane source(l) put (its own value outside the warp). */
static inline double mn_shim_shuffle(double v, int source)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    mn_shim_warp_buffer[warp][lane] = v;
    pthread_barrier_wait(&mn_shim_warp_barrier[warp]);
    const double r = source >= 0 && source < 32 ? mn_shim_warp_buffer[warp][source] : v;
    pthread_barrier_wait(&mn_shim_warp_barrier[warp]);
    return r;
}
static inline double __shfl_down_sync(unsigned, double v, int off)
{
    return mn_shim_shuffle(v, (int)(threadIdx.x & 31) + off);
}
static inline double __shfl_xor_sync(unsigned, double v, int off)
{
    return mn_shim_shuffle(v, (int)(threadIdx.x & 31) ^ off);
}
/* float shuffles, and within groups of width lanes (a power of two) */
static inline float __shfl_xor_sync(unsigned, float v, int off)
{
    return (float)mn_shim_shuffle((double)v, (int)(threadIdx.x & 31) ^ off);
}
static inline double __shfl_xor_sync(unsigned, double v, int off, int width)
{
    (void)width; /* xor by off < width stays inside the group */
    return mn_shim_shuffle(v, (int)(threadIdx.x & 31) ^ off);
}
static inline float __shfl_xor_sync(unsigned, float v, int off, int width)
{
    (void)width;
    return (float)mn_shim_shuffle((double)v, (int)(threadIdx.x & 31) ^ off);
}
/* a warp vote: every lane's value through the buffer, then the whole warp reads it */
static inline bool mn_shim_vote(bool v, bool all)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    mn_shim_warp_buffer[warp][lane] = v ? 1.0 : 0.0;
    pthread_barrier_wait(&mn_shim_warp_barrier[warp]);
    bool r = all;
    for (int l = 0; l < 32; l++) r = all ? (r && mn_shim_warp_buffer[warp][l] != 0.0) : (r || mn_shim_warp_buffer[warp][l] != 0.0);
    pthread_barrier_wait(&mn_shim_warp_barrier[warp]);
    return r;
}
static inline bool __any_sync(unsigned, bool v) { return mn_shim_vote(v, false); }
static inline bool __all_sync(unsigned, bool v) { return mn_shim_vote(v, true); }

struct float2 {
    float x, y;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

/* The fused kernels' dynamic shared memory: one block runs at a time. */
#define MN_EMULATED 1
extern float4 mn_shim_smem[];
#define MN_DYNAMIC_SMEM(name) float4 *name = mn_shim_smem

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __longlong_as_double(long long x)
{
    double d;
    memcpy(&d, &x, sizeof d);
    return d;
}
static inline float __uint_as_float(unsigned x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
static inline unsigned __float_as_uint(float x)
{
    unsigned u;
    memcpy(&u, &x, sizeof u);
    return u;
}

#endif
