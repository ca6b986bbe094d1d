/* fused_cluster.cuh: the thread-block cluster's primitives for the fused
 * step kernel (sm_90), where a 2-layer memory too large for one block's
 * shared memory is split by hidden units over MN_CLUSTER blocks
 * (kernels/plan.c chooses it; fused_kernel.cuh's header says what each
 * block holds): a block's rank, the cluster's barrier, and loads and sums
 * from the same place in a peer block's shared memory (distributed shared
 * memory). Nothing here knows the memory's layout. It comes before
 * fused_kernel.cuh in the fused sources (kernels/plan.c); with MN_CLUSTER
 * 1 (every other kernel) only MN_CL_LEAD is left. */

#ifdef __CUDACC_RTC__

#ifndef MN_CLUSTER
#define MN_CLUSTER 1
#endif

#if MN_CLUSTER > 1
/* ---- the cluster: rank, barrier, loads from a peer block's shared memory ---- */
__device__ __forceinline__ unsigned mn_cl_rank()
{
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of every block of the cluster: the writes to shared memory
 * before it are seen by the loads after it, in any block. */
__device__ __forceinline__ void mn_cl_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* p (in this block's shared memory) in block rank's, as ld.shared::cluster takes it */
__device__ __forceinline__ unsigned mn_cl_addr(const void *p, unsigned rank)
{
    unsigned local, remote;
    asm("{ .reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t; }" : "=r"(local) : "l"(p));
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

__device__ __forceinline__ float mn_cl_load(const float *p, unsigned rank)
{
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(mn_cl_addr(p, rank)) : "memory");
    return v;
}

__device__ __forceinline__ float2 mn_cl_load(const float2 *p, unsigned rank)
{
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(mn_cl_addr(p, rank))
                 : "memory");
    return v;
}

__device__ __forceinline__ double mn_cl_load(const double *p, unsigned rank)
{
    double v;
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(mn_cl_addr(p, rank)) : "memory");
    return v;
}

__device__ __forceinline__ float2 mn_cl_add(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
template <class T> __device__ __forceinline__ T mn_cl_add(T a, T b) { return a + b; }

/* The sum over the cluster of *p, each block's copy at the same place in
 * its shared memory, in rank order: every block that asks gets the same
 * bits. */
template <class T> __device__ __forceinline__ T mn_cl_sum(const T *p)
{
    T t = mn_cl_load(p, 0);
#pragma unroll
    for (unsigned c = 1; c < MN_CLUSTER; c++) t = mn_cl_add(t, mn_cl_load(p, c));
    return t;
}
#define MN_CL_LEAD (mn_cl_rank() == 0)
#else
#define MN_CL_LEAD true
#endif

#endif /* __CUDACC_RTC__ */
