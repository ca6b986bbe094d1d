/* wgmma.cuh: Hopper's warpgroup products (wgmma.mma_async, sm_90a) in tf32,
 * and the shared-memory layout their operands must have. Issue 14's item 1
 * asks for them in the fused kernels: the products and the activation are
 * 70-75% of P1's and H1's steps on mma.sync, with the tensor pipe a few
 * percent busy and the issue slots half (tests/bench/RESULTS.md). This file
 * is the first piece: the instruction, its descriptors and the layout, which
 * tests/unit/test_wgmma.c checks against exact products on the GPU (an
 * H200, 2026-11-28: every case equal) before any kernel is built on them.
 * No engine source includes it yet: the fused kernels keep W and a chunk's
 * rows in padded row-major layouts, and tf32 wgmma takes both operands
 * K-major, so the gradient's products (sums over a chunk's rows) need the
 * rows stored transposed, which P1's shared memory has no room for
 * (tests/bench/RESULTS.md). NVRTC only, for sm_90a.
 *
 * What a warpgroup computes: D [64 x N] (+)= A [64 x 8] B^T, B [N x 8], for
 * one k-step of 8; a product over K is K / 8 of them into the same D. The
 * four warps of the group (warps 4g .. 4g + 3 of the block) each hold 16
 * rows of D: warp w's thread with lane l holds, for each 8 columns j of N,
 * D[16w + l/4][8j + 2(l%4) + {0, 1}] in d[4j], d[4j + 1] and
 * D[16w + l/4 + 8][...] in d[4j + 2], d[4j + 3]: mma.sync m16n8's
 * accumulator, once for every 8 columns.
 *
 * Operands. tf32 takes both A and B K-major (each row's K values adjacent)
 * and neither transposed. B always comes from shared memory, through a
 * descriptor; A from shared memory too, or from registers (mma.sync m16n8k8's
 * A fragment: rows l/4 and l/4 + 8 of the warp's 16, columns l%4 and
 * l%4 + 4 of the k-step). In shared memory without swizzling (the layout
 * here), the unit is the core matrix: 8 rows x 16 bytes (4 values of each
 * row), its 128 bytes contiguous, row after row. The descriptor says how
 * far apart core matrices are: LBO, the next one along K; SBO, the next 8
 * rows. mn_wg_offset lays a [rows x K] matrix out with the K-neighbours of a
 * core matrix adjacent (LBO 128 bytes) and each 8 rows' whole K after the
 * previous 8 rows' (SBO K x 32 bytes); a k-step (8 values) is then two core
 * matrices, 256 bytes on from the previous step. */

#ifndef MN_WGMMA_CUH
#define MN_WGMMA_CUH

/* Float index of element (r, k) of a [rows x K] K-major operand in the
 * canonical layout above (K a multiple of 4). */
__device__ __forceinline__ int mn_wg_offset(int r, int k, int K)
{
    return (r >> 3) * (K * 8) + (k >> 2) * 32 + (r & 7) * 4 + (k & 3);
}

/* The layout's strides, in bytes. */
__device__ __forceinline__ unsigned mn_wg_lbo(void) { return 128u; }
__device__ __forceinline__ unsigned mn_wg_sbo(int K) { return (unsigned)K * 32u; }

/* A shared-memory matrix descriptor, no swizzling: the start address, LBO
 * and SBO, each in 16-byte units (bits 0-13, 16-29, 32-45), base offset 0
 * (bits 49-51), layout 0 (bits 62-63). p: the core matrix where the
 * operand's k-step starts (16-byte aligned). */
__device__ __forceinline__ unsigned long long mn_wg_desc(const void *p, unsigned lbo, unsigned sbo)
{
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFFu) >> 4) << 32);
}

/* Ordinary stores into shared memory, made visible to the tensor cores'
 * reads (the async proxy): each writing thread, before the barrier. */
__device__ __forceinline__ void mn_wg_fence_smem(void) { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* Before the first wgmma of a batch: orders the accumulators' registers
 * and shared memory before the asynchronous products. */
__device__ __forceinline__ void mn_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mn_wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
/* Wait until at most N committed batches are still in flight. */
template <int N>
__device__ __forceinline__ void mn_wg_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* The compiler must not read or move an accumulator between the products'
 * issue and their wait: each register passes through an empty asm after
 * the wait, as a use the compiler cannot see through. */
__device__ __forceinline__ void mn_wg_pin(float *d, int n)
{
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define MN_WG_D32                                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MN_WG_OUT32(d)                                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

/* D [64 x 64] (+)= A B^T for one k-step, A from registers (a0..a3: tf32
 * bits), B through its descriptor; accumulate 0: D = A B^T. */
__device__ __forceinline__ void mn_wg_tf32_n64_rs(float *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                  unsigned long long b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " MN_WG_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : MN_WG_OUT32(d)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(accumulate));
}

/* The same with A from shared memory through its descriptor. */
__device__ __forceinline__ void mn_wg_tf32_n64_ss(float *d, unsigned long long a, unsigned long long b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " MN_WG_D32 ", %32, %33, p, 1, 1;\n}\n"
                 : MN_WG_OUT32(d)
                 : "l"(a), "l"(b), "r"(accumulate));
}

#endif /* MN_WGMMA_CUH */
