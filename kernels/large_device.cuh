/* large_device.cuh: how the large path's forward kernels
 * (large_kernels.cuh) move and sum numbers, apart from what they compute:
 * GEMM operands in the precision's type and its rounding, four neighbours
 * a load, sums in a fixed order with their loads in flight, a slice copied
 * with its loads in flight, the last block of a grid to arrive, the wait
 * for the kernel ahead (programmatic dependent launch) and a lane's part
 * of a dot product. None of it knows the segment's arguments. NVRTC only:
 * kernels/engine_large.c's template list puts it after large_common.cuh
 * (the block size, the warp and block sums) and before large_kernels.cuh. */
#ifdef __CUDACC_RTC__

/* ---- precision: how GEMM operands are stored, and rounded where we multiply ourselves ---- */

/* bfloat16 bits of x, round to nearest even; NaN stays NaN (a quiet bit is
 * set: the top half of a signalling NaN alone could read as Inf). */
__device__ __forceinline__ unsigned short mn_lg_bf16_bits(float x)
{
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

#if MN_PREC == 2
typedef unsigned short mn_lg_op; /* cuBLAS reads these as CUDA_R_16BF */
__device__ __forceinline__ mn_lg_op mn_lg_to_op(float x) { return mn_lg_bf16_bits(x); }
__device__ __forceinline__ float mn_lg_round(float x) { return __uint_as_float((unsigned)mn_lg_bf16_bits(x) << 16); }
#elif MN_PREC == 1
typedef float mn_lg_op; /* cuBLAS rounds to tf32 itself (CUBLAS_COMPUTE_32F_FAST_TF32) */
__device__ __forceinline__ mn_lg_op mn_lg_to_op(float x) { return x; }
__device__ __forceinline__ float mn_lg_round(float x)
{
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return __uint_as_float(u);
}
#else
typedef float mn_lg_op;
__device__ __forceinline__ mn_lg_op mn_lg_to_op(float x) { return x; }
__device__ __forceinline__ float mn_lg_round(float x) { return x; }
#endif

/* ---- four neighbours at once ----
 * The elementwise kernels move 16 bytes a load where a row's width is a
 * multiple of 4 and the pointers are aligned (always, for buffers from the
 * allocator; a view at an odd offset takes the scalar loop): a memory-bound
 * kernel then keeps four times the bytes in flight a load. Each element gets
 * the same arithmetic as in the scalar loop, so the bits do not change. */
__device__ __forceinline__ bool mn_lg_al16(const void *p) { return ((unsigned long long)p & 15u) == 0; }
/* an operand pointer that takes four at once (8 bytes in bf16, 16 else) */
__device__ __forceinline__ bool mn_lg_op_al(const void *p) { return ((unsigned long long)p & (MN_PREC == 2 ? 7u : 15u)) == 0; }
__device__ __forceinline__ float4 mn_lg_ld4(const float *p) { return *(const float4 *)p; }
__device__ __forceinline__ void mn_lg_st4(float *p, const float v[4]) { *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]); }
__device__ __forceinline__ void mn_lg_unpack(float4 q, float v[4])
{
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
}
/* v[i] += p[i] for the four, p read as one 16-byte load */
__device__ __forceinline__ void mn_lg_add4(float v[4], const float *p)
{
    float w[4];
    mn_lg_unpack(mn_lg_ld4(p), w);
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] += w[i];
}
__device__ __forceinline__ void mn_lg_st_op4(mn_lg_op *p, const float v[4])
{
#if MN_PREC == 2
    uint2 w;
    w.x = (unsigned)mn_lg_bf16_bits(v[0]) | ((unsigned)mn_lg_bf16_bits(v[1]) << 16);
    w.y = (unsigned)mn_lg_bf16_bits(v[2]) | ((unsigned)mn_lg_bf16_bits(v[3]) << 16);
    *(uint2 *)p = w;
#else
    mn_lg_st4(p, v);
#endif
}

/* s + p[i] + p[i + stride] + ... below end in double, in that order, with
 * NB loads in flight: the last block of a kernel walks partials and loss
 * rows alone, and one load at a time would put a global load's latency per
 * element on the step's critical path. CG: past L1 (other blocks'
 * partials). NB changes how many loads wait together, never the sum. */
template <bool CG, int NB = 8, typename T>
__device__ __forceinline__ double mn_lg_strided_sum(const T *p, long long i, long long end, long long stride,
                                                    double s = 0.0)
{
    for (; i + (NB - 1) * stride < end; i += NB * stride) {
        T v[NB];
#pragma unroll
        for (int k = 0; k < NB; k++) v[k] = CG ? __ldcg(p + i + k * stride) : p[i + k * stride];
#pragma unroll
        for (int k = 0; k < NB; k++) s += (double)v[k];
    }
    for (; i < end; i += stride) s += (double)(CG ? __ldcg(p + i) : p[i]);
    return s;
}

/* This thread's sum of squares of x over [e0, e1), in double, in a fixed
 * order. Where the range is a whole number of aligned float4s (a slice of
 * the per-slice kernels, 4096 elements, nearly always): the thread's float4s
 * q = threadIdx.x, then every MN_LARGE_THREADS further, four in flight, the
 * four elements of one in order, so a slice is one round of loads a thread.
 * Else elements e0 + threadIdx.x, then every MN_LARGE_THREADS further, four
 * loads in flight (a loop of one load a round waits for each in turn). */
__device__ __forceinline__ double mn_lg_thread_sumsq(const float *x, long long e0, long long e1)
{
    double acc = 0.0;
    if (((e1 - e0) & 3) == 0 && mn_lg_al16(x + e0)) {
        const float4 *x4 = (const float4 *)(x + e0);
        const long long n4 = (e1 - e0) / 4;
        for (long long q = threadIdx.x; q < n4; q += 4 * MN_LARGE_THREADS) {
            float v[4][4];
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (q + k * MN_LARGE_THREADS < n4) mn_lg_unpack(x4[q + k * MN_LARGE_THREADS], v[k]);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (q + k * MN_LARGE_THREADS >= n4) break;
#pragma unroll
                for (int j = 0; j < 4; j++) acc += (double)v[k][j] * v[k][j];
            }
        }
        return acc;
    }
    long long e = e0 + threadIdx.x;
    for (; e + 3 * MN_LARGE_THREADS < e1; e += 4 * MN_LARGE_THREADS) {
        const float x0 = x[e], x1 = x[e + MN_LARGE_THREADS], x2 = x[e + 2 * MN_LARGE_THREADS],
                    x3 = x[e + 3 * MN_LARGE_THREADS];
        acc += (double)x0 * x0;
        acc += (double)x1 * x1;
        acc += (double)x2 * x2;
        acc += (double)x3 * x3;
    }
    for (; e < e1; e += MN_LARGE_THREADS) acc += (double)x[e] * x[e];
    return acc;
}

/* dst[e] = src[e] and op[e] = the operand of src[e] (either may be NULL)
 * over a slice [e0, e1): this thread's elements, e0 + threadIdx.x then
 * every MN_LARGE_THREADS further, all of a slice's loaded before any is
 * stored. Stores between loads would hold each load back (dst may alias
 * src as far as the compiler knows), and the copy then waited out a global
 * load's latency per element: 16 rounds a slice, about 10 us a launch of
 * P2's parameters, one block an SM (Nsight Compute, H200). */
__device__ __forceinline__ void mn_lg_copy_slice(float *dst, mn_lg_op *op, const float *src, long long e0, long long e1)
{
    constexpr int N = MN_LARGE_SLICE / MN_LARGE_THREADS;
    for (long long e = e0 + threadIdx.x; e < e1; e += N * MN_LARGE_THREADS) {
        float v[N];
#pragma unroll
        for (int k = 0; k < N; k++)
            if (e + k * MN_LARGE_THREADS < e1) v[k] = src[e + k * MN_LARGE_THREADS];
#pragma unroll
        for (int k = 0; k < N; k++) {
            const long long i = e + k * MN_LARGE_THREADS;
            if (i >= e1) break;
            if (dst) dst[i] = v[k];
            if (op) op[i] = mn_lg_to_op(v[k]);
        }
    }
}

/* ---- the last block, the wait for the kernel ahead, a lane's dot product ---- */

/* True in exactly one block: the last of count blocks to arrive at this
 * ticket, which then sees every other block's results (each fenced its
 * writes before arriving; the reader loads them with __ldcg, past L1) and
 * resets the ticket for the next launch. Every thread of the block calls it. */
__device__ bool mn_lg_last_arrival(unsigned *ticket, unsigned count)
{
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(ticket, 1u) == count - 1;
        if (last) atomicExch(ticket, 0u);
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* Programmatic dependent launch (sm_90; kernels/engine_large.c's launch): in
 * a captured step the host lets each of the path's kernels
 * (large_kernels.cuh) launch before the kernel ahead of it in the stream has
 * completed, so that the launch overlaps that kernel's tail instead of
 * following it. griddepcontrol.wait returns once the kernel ahead has
 * completed and its writes are visible (at once where there is no such
 * dependency). Every block calls this before it returns, and before it reads
 * anything a kernel of the run writes. What it may read before: the
 * arguments (*ap), the step counter (advanced only by a step's last kernel,
 * and a captured graph holds one step) and the run's inputs (k, v, q, theta,
 * eta, alpha, lengths), which no kernel writes: those loads then overlap the
 * wait. Waiting in every block also keeps the chain: this kernel completes
 * only after the one ahead has, so the kernel behind may rely on both.
 * (Signalling the kernel behind early, griddepcontrol.launch_dependents at
 * the start, made L1 no faster in tf32 and 3-5% slower in bf16 on an H200:
 * not in.) */
__device__ __forceinline__ void mn_lg_after_prior(void)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* A lane's part of the dot product of x and w (length n): elements lane,
 * lane + 32, ... in that order, operands rounded as the precision rounds
 * them. Eight of each loaded before the products: a loop of one load a
 * round waits for each in turn, and the row kernels' whole time is a few
 * such rounds (L1 tf32, Nsight Compute: 6.5 -> 5.4 us a launch). */
__device__ __forceinline__ float mn_lg_lane_dot(const float *x, const float *w, int n, int lane)
{
    float acc = 0.0f;
    int i = lane;
    for (; i + 7 * 32 < n; i += 8 * 32) {
        float xv[8], wv[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            xv[k] = x[i + 32 * k];
            wv[k] = w[i + 32 * k];
        }
#pragma unroll
        for (int k = 0; k < 8; k++) acc += mn_lg_round(xv[k]) * mn_lg_round(wv[k]);
    }
    for (; i < n; i += 32) acc += mn_lg_round(x[i]) * mn_lg_round(w[i]);
    return acc;
}

#endif /* __CUDACC_RTC__ */
