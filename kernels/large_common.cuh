/* large_common.cuh: what the large path's kernels and its backward's
 * (large_kernels.cuh, large_grad.cuh) share: the block size, and sums in a
 * fixed order (every reduction of either is deterministic), and the
 * grid-stride loop. Its own file because the backward's source does not
 * carry the forward's kernels: each source's template list puts this one
 * first (kernels/engine_large.c, kernels/grad_large.c), and the host gets
 * its C part through the other two headers. */
#ifndef MN_LARGE_COMMON
#define MN_LARGE_COMMON

#define MN_LARGE_THREADS 256 /* every kernel's block (8 warps); the column kernels as 32 x 8 */
#define MN_LARGE_SLICE 4096  /* parameter elements per block of the per-slice kernels */

/* Parameter p's slices of MN_LARGE_SLICE elements are [slice_start[p],
 * slice_start[p + 1]) of one memory's; slice_start[p] for p from np to
 * max_params holds the total, which is returned. */
static inline long long mn_large_slices(const long long *numel, int np, int max_params, long long *slice_start)
{
    long long slices = 0;
    for (int p = 0; p < np; p++) {
        slice_start[p] = slices;
        slices += (numel[p] + MN_LARGE_SLICE - 1) / MN_LARGE_SLICE;
    }
    for (int p = np; p <= max_params; p++) slice_start[p] = slices;
    return slices;
}

#endif /* MN_LARGE_COMMON */

#ifdef __CUDACC_RTC__

#define MN_LG_WARPS (MN_LARGE_THREADS / 32)
#define MN_LG_GRID_STRIDE(e, count)                                                                   \
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < (count);                \
         e += (long long)gridDim.x * blockDim.x)

/* Butterfly: every lane ends with the same bits (each pairwise sum is the
 * same two numbers in either order), so every lane may use the result. */
__device__ __forceinline__ double mn_lg_warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float mn_lg_warp_sumf(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The parameter of slice s (of one memory, among NP parameters; the
 * slices of mn_large_slices) and the slice's element range [e0, e1). */
template <int NP>
__device__ __forceinline__ int mn_lg_slice(const long long *slice_start, const long long *numel, long long s,
                                           long long *e0, long long *e1)
{
    int p = 0;
#pragma unroll
    for (int i = 1; i < NP; i++)
        if (s >= slice_start[i]) p = i;
    *e0 = (s - slice_start[p]) * MN_LARGE_SLICE;
    *e1 = *e0 + MN_LARGE_SLICE < numel[p] ? *e0 + MN_LARGE_SLICE : numel[p];
    return p;
}

/* Sum over a 1-d block of MN_LARGE_THREADS, in a fixed order, to every thread. */
__device__ double mn_lg_block_sum(double v)
{
    __shared__ double part[MN_LG_WARPS];
    v = mn_lg_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
#pragma unroll
    for (int w = 0; w < MN_LG_WARPS; w++) t += part[w];
    return t;
}

#endif /* __CUDACC_RTC__ */
