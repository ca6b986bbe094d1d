/* fused_gemm.cuh: the fused kernels' tensor-core products (mn_gemm), the
 * one piece of the fused source that every fused kernel (the step kernel,
 * the fused backward) builds its chunk's products from: C = A B over the
 * block, operands in shared memory, fragments to mma.sync (tf32 m16n8k8,
 * bf16 m16n8k16, fp32 as 3xTF32), a pre and an epilogue per output pair so
 * that callers fuse their loads and elementwise work into the product. It
 * comes first in the fused sources (kernels/plan.c), before fused_kernel.cuh
 * and its design notes; under tests/emu/cuda_shim.h (MN_EMULATED) mn_gemm is
 * a plain loop over the same tiles. */

#ifdef __CUDACC_RTC__

#define MN_FT MN_FUSED_THREADS
#define MN_FWARPS (MN_FT / 32)
static_assert(MN_FT % 32 == 0 && MN_FT <= 1024, "whole warps");

/* The products' operands from shared memory by ldmatrix (mn_gemm): in tf32
 * only. Measured on an H100 (tests/bench/RESULTS.md, 2026-11-27): P1's
 * forward 4.27 -> 3.80 ms in tf32, M1's 6.64 -> 6.41; in fp32 (three mma a
 * tile, twice the operand registers) P1 4.92 without it, 4.98-5.01 with.
 * MNEMO_FUSED_LDSM=0 or 1 (plan.c) sets it for a measurement. */
#ifndef MN_LDSM
#define MN_LDSM (MN_PREC == 1)
#endif

/* bf16's operands stored as bf16 by their producers (MN_H16), in the step
 * kernel: the hidden activations h, and where nothing else reads them the
 * chunk's x rows, dz and dL/dy (fused_kernel.cuh, MN_X16 and below, says
 * which and where). The products rounded each of them to bf16 again at
 * every tile that loaded it, from floats, by one scalar load an element
 * where the product's k is the buffer's rows (the weight gradients). Stored
 * so, they come by ldmatrix (ldmatrix.trans where k is the rows), with no
 * conversion (mn_gemm's AH and BH). The tensor cores get the same values
 * (mn_bf16x2, in rule_kernel.cuh, rounds as mn_round does), and the
 * products that take them order k as the instruction does (NAT in
 * mn_gemm): on an H200 every
 * output, final weight and gradient compared was the same to the bit, and
 * P1's, H1's and H2's step kernels were 19% faster, M1's 14%
 * (tests/bench/RESULTS.md, 2026-11-29). A bf16 row keeps the float row's
 * byte stride: its ldmatrix rows then fall on distinct banks, and the
 * buffers' layout is unchanged. The fused backward keeps floats (its
 * recompute stores them unrounded); MNEMO_FUSED_H16 (plan.c) turns it off
 * (0), or keeps h alone (h), or all but dL/dy (hx), to measure. */
#ifndef MN_H16
#if MN_PREC == 2 && !defined(MN_FUSED_GRAD) && !defined(MN_EMULATED)
#define MN_H16 1
#else
#define MN_H16 0
#endif
#endif

/* bf16's weights stored rotated in shared memory (MN_WROT): the odd rows
 * of each layer's W turned by 12 floats within every 32 of the row, column
 * c at (c & ~31) | ((c + 12) & 31) (mn_wcol; even rows as they are). The
 * rows are PAD = 4 floats (4 banks) apart, which makes ldmatrix's 16-byte
 * rows (tf32) conflict-free, but bf16's products load W as 8-byte pairs of
 * k (NAT below): lanes 0-15 read rows g = 0..3, each 8 floats from bank 4g,
 * so every bank was read twice. Nsight Compute on P1 (H200): those loads of
 * the forward's products took two wavefronts each where one would do, 55%
 * of the kernel's excess shared-memory wavefronts. Turned, rows 0..3 start
 * at banks 0, 16, 8, 24: one wavefront. dL/dy W2's loads (k is W2's rows:
 * rows 2t and 2t + 1, 8 columns each) stay conflict-free (banks 8t + g and
 * 8t + 16 + g). The values are the same: only where they sit. It needs every
 * layer's padded input width a multiple of 32 (P1, H1, H2, M1); the fused
 * backward keeps plain rows. Every reader of W goes through mn_wcol:
 * mn_pset_el, mn_pset_from and _to, the row layers and mn_gemm (BW). */
#ifndef MN_WROT
#if MN_PREC == 2 && !defined(MN_FUSED_GRAD) && !defined(MN_EMULATED) && MN_PDK % 32 == 0 &&                    \
    (MN_LAYERS == 1 || MN_PDH % 32 == 0)
#define MN_WROT 1
#else
#define MN_WROT 0
#endif
#endif
static_assert(!MN_WROT || (MN_PDK % 32 == 0 && (MN_LAYERS == 1 || MN_PDH % 32 == 0)), "rows of whole 32s");

/* The column where element (row, col) of a buffer whose odd rows are
 * turned sits in its row: W's (MN_WROT) and z's (fused_kernel.cuh's
 * MN_ZROT) layout. A pair (col even) or a quad (col a multiple of 4) stays
 * whole and in order. */
__device__ __forceinline__ int mn_turned_col(int row, int col) { return (col & ~31) | ((col + 12 * (row & 1)) & 31); }

/* The column where W's element (row, col) sits in its row (MN_WROT). */
__device__ __forceinline__ int mn_wcol(int row, int col) { return MN_WROT ? mn_turned_col(row, col) : col; }

#if MN_PREC == 2
#define MN_KSTEP 16
#else
#define MN_KSTEP 8
#endif
/* The K loops' unroll (at most). The forward's is always the plan's
 * (kernels/plan.c: by precision and shape, as measured; or
 * MNEMO_FUSED_KUNROLL, which sets the backward's too). The backward's,
 * where the knob is unset, is 1: measured on an H100 (tests/bench/RESULTS.md,
 * 2026-11-26), it is fastest not unrolled (P1 fp32 74.0 -> 54.9 ms:
 * unrolled, ptxas gave it a 2.4 KB stack frame; tf32 50.2 -> 47.9 ms) and
 * compiles 1-2 s sooner. The order of the products' sums is the same at
 * every unroll: the results are too. */
#ifndef MN_KUNROLL
#if defined(MN_FUSED_GRAD)
#define MN_KUNROLL 1
#else
#error "the fused forward's K-loop unroll (MN_KUNROLL) comes from its plan (kernels/plan.c)"
#endif
#endif

/* ---- tensor-core fragments ---- */
#ifndef MN_EMULATED /* tests/emu/cuda_shim.h: no PTX there; mn_gemm is a loop below */

__device__ __forceinline__ unsigned mn_tf32_bits(float x)
{
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return u;
}

__device__ __forceinline__ void mn_mma_tf32(float *c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                            unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mn_mma_bf16(float *c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                            unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#endif /* !MN_EMULATED */

/* Elements (i, j) and (i, j + 1) of a row-major matrix with leading
 * dimension ld (one 8-byte load), or of its transpose (two loads); four
 * elements (i, j .. j + 3) likewise. j is even (a multiple of 4), ld a
 * multiple of 4 and the base 16-byte aligned, so the wide loads are aligned. */
template <bool T> __device__ __forceinline__ float2 mn_pair(const float *p, int ld, int i, int j)
{
    if (T) return make_float2(p[j * ld + i], p[(j + 1) * ld + i]);
    return *reinterpret_cast<const float2 *>(p + i * ld + j);
}

template <bool T> __device__ __forceinline__ float4 mn_quad(const float *p, int ld, int i, int j)
{
    if (T) return make_float4(p[j * ld + i], p[(j + 1) * ld + i], p[(j + 2) * ld + i], p[(j + 3) * ld + i]);
    return *reinterpret_cast<const float4 *>(p + i * ld + j);
}

/* The same of a layer's W in its turned rows (MN_WROT, mn_wcol): B(k, n)
 * and B(k + 1, n) (k even), or B(k .. k + 3, n) (k a multiple of 4), with
 * B(k, n) = BK ? w[k ld + n] : w[n ld + k]. Where k is along the row the
 * group stays whole (the turn is a multiple of 4 within a 32 that holds it). */
template <bool BK> __device__ __forceinline__ float2 mn_wpair(const float *w, int ld, int k, int n)
{
    if (BK) return make_float2(w[k * ld + mn_wcol(k, n)], w[(k + 1) * ld + mn_wcol(k + 1, n)]);
    return *reinterpret_cast<const float2 *>(w + n * ld + mn_wcol(n, k));
}

template <bool BK> __device__ __forceinline__ float4 mn_wquad(const float *w, int ld, int k, int n)
{
    if (BK)
        return make_float4(w[k * ld + mn_wcol(k, n)], w[(k + 1) * ld + mn_wcol(k + 1, n)],
                           w[(k + 2) * ld + mn_wcol(k + 2, n)], w[(k + 3) * ld + mn_wcol(k + 3, n)]);
    return *reinterpret_cast<const float4 *>(w + n * ld + mn_wcol(n, k));
}

/* The offset of element (i, j) in the same layouts: mn_gemm moves a lane's
 * operands to a base pointer once a tile, so that its loads in the unrolled
 * K loop are that base plus constants (ncu on P1: computed per load, the
 * weight gradients' addresses took two instructions for each load) */
template <bool T> __device__ __forceinline__ int mn_el(int ld, int i, int j) { return T ? j * ld + i : i * ld + j; }
/* The fused backward keeps the per-load addresses: its K loops are not
 * unrolled and it spills, and there the base pointers made P1's backward
 * slower (H200, grad_probe.lua T=4096: tf32 45.7 -> 47.5 ms, bf16 43.8 ->
 * 50.3), so its code is what it was. */
#if defined(MN_FUSED_GRAD)
#define MN_GEMM_LANE_BASE 0
#else
#define MN_GEMM_LANE_BASE 1
#endif

/* No value to add to a product. */
struct mn_no_pre {
    __device__ __forceinline__ float2 operator()(int, int) const { return make_float2(0.0f, 0.0f); }
};

/* Nothing to do after a tile. */
struct mn_no_post {
    __device__ __forceinline__ void operator()(int, int, int) const {}
};

/* C = A B over the block, M x N x K all multiples of 16, every warp taking
 * 16 x (8 NT8) output tiles in turn; epi(row, col, c0, c1) gets elements
 * (row, col) and (row, col + 1), col even, once, from the thread that holds
 * them (the same thread for the same tile in every call, which is what lets
 * G accumulate without atomics), with pre(row, col) added: pre is called
 * before the tile's products, so a load from global memory there is in
 * flight while the tensor cores work. post(m0, n0, width), when given, is
 * called by the whole warp after the epilogue of its tile (rows m0 .. m0 +
 * 15, columns n0 .. n0 + width - 1): elementwise work on the tile that is
 * too long to repeat in each of the unrolled epilogue's calls.
 *   A(m, k) = AT ? a[k lda + m] : a[m lda + k]
 *   B(k, n) = BK ? b[k ldb + n] : b[n ldb + k]   (BK false: b holds B^T rows, as W does)
 * a is in shared memory; b too unless BSH is false (the weights' padded
 * copy in the workspace). tf32 (MN_LDSM) with b in shared memory loads the
 * fragments of an operand stored by rows (A with AT false, B with BK
 * false) by ldmatrix, four 8 x 4 blocks an instruction straight into the
 * registers the mma reads (ncu on P1: the two 8-byte loads an A fragment
 * took before needed four register moves each mma, as many instructions as
 * the mma itself). Otherwise (bf16, or b in global memory) the k index
 * inside one instruction is permuted (the same way for A and B, so the sum
 * is unchanged) so that each thread's operands are adjacent along k: one
 * wide load where k is the contiguous direction. */
/* The output tiles of an M x N product: 16 x (8 NT8) each, NB of them
 * across N, TILES in all, warp w taking w, w + MN_FWARPS, ... (mn_gemm and
 * the emulation's, which must give each thread the same elements). */
template <int M, int N> struct mn_gemm_shape {
    /* enumerators, not static members: no device globals in the module */
    enum { NT8 = ((M / 16) * (N / 32) >= MN_FWARPS && N % 32 == 0) ? 4 : 2, NB = N / (8 * NT8), TILES = (M / 16) * NB };
};

#ifdef MN_EMULATED
/* The emulation's mn_gemm (tests/emu/cuda_shim.h): the same tiles to the
 * same threads, pre before, epi after and post after the tile, each output
 * a plain fp32 sum. */
template <int M, int N, int K, bool AT, bool BK, bool BSH = true, bool AR = false, bool BR = false, bool AH = false,
          bool BH = false, bool BW = false, bool AZ = false, class Epi, class Pre = mn_no_pre, class Post = mn_no_post>
__device__ __forceinline__ void mn_gemm(const float *a, int lda, const float *b, int ldb, Epi epi, Pre pre = Pre(),
                                        Post post = Post())
{
    static_assert(!AH && !BH, "bf16-stored operands only on the GPU (MN_H16)");
    static_assert(!AZ || AT, "z's turned rows as A: k its rows");
    constexpr int NT8 = mn_gemm_shape<M, N>::NT8, NB = mn_gemm_shape<M, N>::NB, TILES = mn_gemm_shape<M, N>::TILES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    for (int tile = warp; tile < TILES; tile += MN_FWARPS) {
        const int m0 = (tile / NB) * 16, n0 = (tile % NB) * (8 * NT8);
        float2 old[NT8][2];
        for (int j = 0; j < NT8; j++)
            for (int hf = 0; hf < 2; hf++) old[j][hf] = pre(m0 + g + 8 * hf, n0 + 8 * j + 2 * t);
        for (int j = 0; j < NT8; j++)
            for (int hf = 0; hf < 2; hf++) {
                const int i = m0 + g + 8 * hf, n = n0 + 8 * j + 2 * t;
                float c0 = 0.0f, c1 = 0.0f;
                for (int k = 0; k < K; k++) {
                    /* AZ: a is z with its odd rows turned (MN_ZROT; a product reads
                     * them only here, without dz's bf16 copy) */
                    const float av = AT ? a[k * lda + (AZ ? mn_turned_col(k, i) : i)] : a[i * lda + k];
                    /* BW: b is a layer's W, in its rows' layout (mn_wcol) */
                    c0 += av * (BK ? b[k * ldb + (BW ? mn_wcol(k, n) : n)] : b[n * ldb + (BW ? mn_wcol(n, k) : k)]);
                    c1 += av * (BK ? b[k * ldb + (BW ? mn_wcol(k, n + 1) : n + 1)]
                                   : b[(n + 1) * ldb + (BW ? mn_wcol(n + 1, k) : k)]);
                }
                epi(i, n, old[j][hf].x + c0, old[j][hf].y + c1);
            }
        post(m0, n0, 8 * NT8);
    }
}
#else
/* Four 8 x 4 blocks of floats (each row 16 bytes, 16-byte aligned, in shared
 * memory) into r[0..3] in one instruction: ldmatrix moves 8 x 8 blocks of
 * 16-bit elements, which is 8 x 4 of 32-bit ones, and gives lane l the
 * element (l / 4, l % 4) of each block: the m16n8k8 tf32 operands' layout.
 * Lanes 8i .. 8i + 7 name the rows of block i. volatile: it reads what other
 * threads stored before a barrier, which the compiler must not move it above. */
__device__ __forceinline__ void mn_ldsm_x4(unsigned (&r)[4], const void *row)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* The same four 8 x 8 blocks of 16-bit elements transposed: lane l gets
 * elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) of each block, so
 * a bf16 operand stored with k as its rows (B(k, n) = b[k ldb + n]) comes
 * out as m16n8k16's B fragment. */
__device__ __forceinline__ void mn_ldsm_x4_trans(unsigned (&r)[4], const void *row)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <int M, int N, int K, bool AT, bool BK, bool BSH = true, bool AR = false, bool BR = false, bool AH = false,
          bool BH = false, bool BW = false, bool AZ = false, class Epi, class Pre = mn_no_pre, class Post = mn_no_post>
__device__ __forceinline__ void mn_gemm(const float *a, int lda, const float *b, int ldb, Epi epi, Pre pre = Pre(),
                                        Post post = Post())
{
    /* on the GPU MN_ZROT comes with dz's bf16 copy (MN_DZ16), the product's operand */
    static_assert(!AZ, "z's turned rows as a product's operand: the emulation's mn_gemm only");
    constexpr int NT8 = mn_gemm_shape<M, N>::NT8, NB = mn_gemm_shape<M, N>::NB, TILES = mn_gemm_shape<M, N>::TILES;
    /* AR, BR: the caller stored that operand rounded to tf32 already
     * (mn_round), so in tf32 its fragments go to the mma as loaded: no
     * conversion (two instructions on sm_90) at each of its many loads */
    constexpr bool ARD = AR && MN_PREC == 1, BRD = BR && MN_PREC == 1;
    /* tf32 (fp32: MN_LDSM) with both operands in shared memory, one of them
     * stored by rows: fragments by ldmatrix. Where both are stored by
     * columns (the weight gradients' products) the permuted order's loads
     * stay: rows k0 + 2t and 2t + 1 of a buffer whose rows are 4 banks
     * apart hit 32 banks, where k0 + t and t + 4 would hit 16 twice */
    constexpr bool LDSM = MN_PREC != 2 && BSH && MN_LDSM && (!AT || !BK);
    /* AH, BH (bf16, MN_H16): that operand is stored as bf16 (a row keeps
     * the float row's stride, lda or ldb floats); its fragments come by
     * ldmatrix, transposed where k is its rows (AT; B with BK). The product then
     * takes k in the instruction's own order (NAT: slots 2t, 2t + 1 hold k =
     * 2t, 2t + 1 and slots 2t + 8, 2t + 9 k = 2t + 8, 2t + 9), as ldmatrix
     * delivers it, and the other operand's floats come as pairs in that
     * order. */
    constexpr bool NAT = MN_PREC == 2 && (AH || BH);
    static_assert(!AH || MN_PREC == 2, "A stored as bf16 in bf16 mode");
    static_assert(!BH || (MN_PREC == 2 && BSH), "B stored as bf16: in shared memory, in bf16 mode");
    static_assert(!NAT || MN_GEMM_LANE_BASE, "bf16-stored operands in the step kernel (the fused backward keeps floats)");
    /* BW: b is a layer's W; with MN_WROT its rows are turned (mn_wcol),
     * which bf16's loads below follow (MN_WROT is bf16's, the step kernel's) */
    constexpr bool WR = BW && MN_WROT;
    static_assert(!WR || (MN_PREC == 2 && MN_GEMM_LANE_BASE && !BH), "W's turned rows: bf16, the step kernel");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    for (int tile = warp; tile < TILES; tile += MN_FWARPS) {
        const int m0 = (tile / NB) * 16, n0 = (tile % NB) * (8 * NT8);
        /* the lane's first element of A and of B, by the k slots below: with
         * ldmatrix, the row it names (stored by rows) or slot t (by columns);
         * otherwise slots t and t + 4 hold k = 2t and 2t + 1 (bf16: 4t ..) */
#if MN_GEMM_LANE_BASE
        /* (NAT: a float operand's first pair, at k = 2t) */
        constexpr int KS = MN_PREC == 2 && !NAT ? 4 : 2;
        const float *const al0 =
            a + (!LDSM ? mn_el<AT>(lda, m0 + g, KS * t)
                       : AT ? t * lda + m0 + g : (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lda + (lane >> 4) * 4);
        const float *const bl0 =
            b + (!LDSM ? mn_el<BK>(ldb, n0 + g, KS * t)
                       : BK ? t * ldb + n0 + g : (n0 + (lane & 7) + (lane >> 4) * 8) * ldb + ((lane >> 3) & 1) * 4);
        /* NAT's bf16 operands (dead code without them): the lane's ldmatrix
         * row. A by rows, rows m0 + (l & 15) at k = 0 (l < 16) or 8; A by
         * columns, rows k = (l & 7) (+ 8 from l = 16) at m0 (+ 8 for l & 8);
         * B (k its rows), rows k = l & 15 at columns n0 (l < 16) or n0 + 8,
         * two n-tiles an instruction; B by columns (W's rows: BK false),
         * rows n = n0 + (l & 7) (+ 8 from l = 16) at k = 0 (+ 8 for l & 8).
         * The blocks come in the fragment's register order: a0 (rows 0-7,
         * k 0-7), a1 (rows 8-15), a2 (k 8-15), a3; b0, b1 of one n-tile,
         * then the next's */
        const unsigned short *const anh =
            AT ? reinterpret_cast<const unsigned short *>(a + ((lane & 7) + (lane >> 4) * 8) * lda) + m0 +
                     ((lane >> 3) & 1) * 8
               : reinterpret_cast<const unsigned short *>(a + (m0 + (lane & 15)) * lda) + (lane >> 4) * 8;
        const unsigned short *const bnh =
            BK ? reinterpret_cast<const unsigned short *>(b + (lane & 15) * ldb) + n0 + (lane >> 4) * 8
               : reinterpret_cast<const unsigned short *>(b + (n0 + (lane & 7) + (lane >> 4) * 8) * ldb) +
                     ((lane >> 3) & 1) * 8;
#endif
        float acc[NT8][4];
        float2 old[NT8][2];
#pragma unroll
        for (int j = 0; j < NT8; j++) {
            const int n = n0 + 8 * j + 2 * t;
            acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            old[j][0] = pre(m0 + g, n);
            old[j][1] = pre(m0 + g + 8, n);
        }
#pragma unroll(K / MN_KSTEP <= MN_KUNROLL ? K / MN_KSTEP : MN_KUNROLL)
        for (int k0 = 0; k0 < K; k0 += MN_KSTEP) {
#if MN_PREC == 2
#if MN_GEMM_LANE_BASE
            if (NAT) {
                unsigned af[4];
                if (AH && AT) {
                    mn_ldsm_x4_trans(af, anh + k0 * 2 * lda);
                } else if (AH) {
                    mn_ldsm_x4(af, anh + k0);
                } else {
                    const float2 p0 = mn_pair<AT>(al0, lda, 0, k0), p1 = mn_pair<AT>(al0, lda, 8, k0);
                    const float2 p2 = mn_pair<AT>(al0, lda, 0, k0 + 8), p3 = mn_pair<AT>(al0, lda, 8, k0 + 8);
                    af[0] = mn_bf16x2(p0.x, p0.y), af[1] = mn_bf16x2(p1.x, p1.y);
                    af[2] = mn_bf16x2(p2.x, p2.y), af[3] = mn_bf16x2(p3.x, p3.y);
                }
#pragma unroll
                for (int j = 0; j < NT8; j += 2) {
                    unsigned bf[4]; /* b0, b1 of tile j, then of tile j + 1 */
                    if (BH && BK) {
                        mn_ldsm_x4_trans(bf, bnh + k0 * 2 * ldb + 8 * j);
                    } else if (BH) {
                        mn_ldsm_x4(bf, bnh + 8 * j * 2 * ldb + k0);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            float2 q0, q1;
                            if (WR) { /* k = k0 + 2t (+ 8), +1; n = n0 + g + 8 (j + h) */
                                q0 = mn_wpair<BK>(b, ldb, k0 + 2 * t, n0 + g + 8 * (j + h));
                                q1 = mn_wpair<BK>(b, ldb, k0 + 8 + 2 * t, n0 + g + 8 * (j + h));
                            } else {
                                q0 = mn_pair<BK>(bl0, ldb, 8 * (j + h), k0);
                                q1 = mn_pair<BK>(bl0, ldb, 8 * (j + h), k0 + 8);
                            }
                            bf[2 * h] = mn_bf16x2(q0.x, q0.y), bf[2 * h + 1] = mn_bf16x2(q1.x, q1.y);
                        }
                    }
                    mn_mma_bf16(acc[j], af[0], af[1], af[2], af[3], bf[0], bf[1]);
                    mn_mma_bf16(acc[j + 1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
                }
                continue;
            }
#endif
            /* slots 2t, 2t+1, 2t+8, 2t+9 of the instruction hold k = 4t .. 4t+3 */
#if MN_GEMM_LANE_BASE
            const float4 ar0 = mn_quad<AT>(al0, lda, 0, k0), ar1 = mn_quad<AT>(al0, lda, 8, k0);
#else
            const float4 ar0 = mn_quad<AT>(a, lda, m0 + g, k0 + 4 * t), ar1 = mn_quad<AT>(a, lda, m0 + g + 8, k0 + 4 * t);
#endif
            const unsigned a0 = mn_bf16x2(ar0.x, ar0.y), a2 = mn_bf16x2(ar0.z, ar0.w);
            const unsigned a1 = mn_bf16x2(ar1.x, ar1.y), a3 = mn_bf16x2(ar1.z, ar1.w);
#pragma unroll
            for (int j = 0; j < NT8; j++) {
#if MN_GEMM_LANE_BASE
                const float4 br = WR ? mn_wquad<BK>(b, ldb, k0 + 4 * t, n0 + 8 * j + g) : mn_quad<BK>(bl0, ldb, 8 * j, k0);
#else
                const float4 br = mn_quad<BK>(b, ldb, n0 + 8 * j + g, k0 + 4 * t);
#endif
                mn_mma_bf16(acc[j], a0, a1, a2, a3, mn_bf16x2(br.x, br.y), mn_bf16x2(br.z, br.w));
            }
#else
            if (LDSM) {
                /* k in its own order: slot t holds k0 + t and slot t+4 k0 + t + 4.
                 * A: from rows (!AT) by one ldmatrix (blocks: rows 0-7 and 8-15
                 * at k0, then at k0 + 4), else four loads; B likewise (!BK: two
                 * n-tiles an ldmatrix, blocks k0 and k0 + 4 of each) */
                unsigned ar[4];
#if MN_GEMM_LANE_BASE
                if (!AT) {
                    mn_ldsm_x4(ar, al0 + k0);
                } else {
                    ar[0] = __float_as_uint(al0[k0 * lda]);
                    ar[1] = __float_as_uint(al0[k0 * lda + 8]);
                    ar[2] = __float_as_uint(al0[(k0 + 4) * lda]);
                    ar[3] = __float_as_uint(al0[(k0 + 4) * lda + 8]);
                }
#else
                if (!AT) {
                    mn_ldsm_x4(ar, a + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lda + k0 + (lane >> 4) * 4);
                } else {
                    ar[0] = __float_as_uint(a[(k0 + t) * lda + m0 + g]);
                    ar[1] = __float_as_uint(a[(k0 + t) * lda + m0 + g + 8]);
                    ar[2] = __float_as_uint(a[(k0 + t + 4) * lda + m0 + g]);
                    ar[3] = __float_as_uint(a[(k0 + t + 4) * lda + m0 + g + 8]);
                }
#endif
                unsigned ah[4];
#pragma unroll
                for (int i = 0; i < 4; i++) ah[i] = ARD ? ar[i] : mn_tf32_bits(__uint_as_float(ar[i]));
#if MN_PREC == 0
                unsigned al[4];
#pragma unroll
                for (int i = 0; i < 4; i++) al[i] = mn_tf32_bits(__uint_as_float(ar[i]) - __uint_as_float(ah[i]));
#endif
#pragma unroll
                for (int j = 0; j < NT8; j += 2) {
                    unsigned br[4]; /* b0, b1 of tile j, then of tile j + 1 */
#if MN_GEMM_LANE_BASE
                    if (!BK) {
                        mn_ldsm_x4(br, bl0 + 8 * j * ldb + k0);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            br[2 * h] = __float_as_uint(bl0[k0 * ldb + 8 * (j + h)]);
                            br[2 * h + 1] = __float_as_uint(bl0[(k0 + 4) * ldb + 8 * (j + h)]);
                        }
                    }
#else
                    if (!BK) {
                        mn_ldsm_x4(br, b + (n0 + 8 * j + (lane & 7) + (lane >> 4) * 8) * ldb + k0 + ((lane >> 3) & 1) * 4);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            br[2 * h] = __float_as_uint(b[(k0 + t) * ldb + n0 + 8 * (j + h) + g]);
                            br[2 * h + 1] = __float_as_uint(b[(k0 + t + 4) * ldb + n0 + 8 * (j + h) + g]);
                        }
                    }
#endif
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float b0 = __uint_as_float(br[2 * h]), b1 = __uint_as_float(br[2 * h + 1]);
                        const unsigned bh0 = BRD ? br[2 * h] : mn_tf32_bits(b0),
                                       bh1 = BRD ? br[2 * h + 1] : mn_tf32_bits(b1);
#if MN_PREC == 0
                        const unsigned bl0 = mn_tf32_bits(b0 - __uint_as_float(bh0));
                        const unsigned bl1 = mn_tf32_bits(b1 - __uint_as_float(bh1));
                        mn_mma_tf32(acc[j + h], al[0], al[1], al[2], al[3], bh0, bh1);
                        mn_mma_tf32(acc[j + h], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
#endif
                        mn_mma_tf32(acc[j + h], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
                    }
                }
                continue;
            }
            /* B in global memory: slots t and t+4 of the instruction hold k = 2t and 2t+1 */
#if MN_GEMM_LANE_BASE
            const float2 ar0 = mn_pair<AT>(al0, lda, 0, k0), ar1 = mn_pair<AT>(al0, lda, 8, k0);
#else
            const float2 ar0 = mn_pair<AT>(a, lda, m0 + g, k0 + 2 * t), ar1 = mn_pair<AT>(a, lda, m0 + g + 8, k0 + 2 * t);
#endif
            const float af[4] = {ar0.x, ar1.x, ar0.y, ar1.y};
            unsigned ah[4];
#pragma unroll
            for (int i = 0; i < 4; i++) ah[i] = ARD ? __float_as_uint(af[i]) : mn_tf32_bits(af[i]);
#if MN_PREC == 0
            unsigned al[4];
#pragma unroll
            for (int i = 0; i < 4; i++) al[i] = mn_tf32_bits(af[i] - __uint_as_float(ah[i]));
#endif
#pragma unroll
            for (int j = 0; j < NT8; j++) {
#if MN_GEMM_LANE_BASE
                const float2 br = mn_pair<BK>(bl0, ldb, 8 * j, k0);
#else
                const float2 br = mn_pair<BK>(b, ldb, n0 + 8 * j + g, k0 + 2 * t);
#endif
                const unsigned bh0 = BRD ? __float_as_uint(br.x) : mn_tf32_bits(br.x),
                               bh1 = BRD ? __float_as_uint(br.y) : mn_tf32_bits(br.y);
#if MN_PREC == 0
                /* small terms first: they are the ones fp32 accumulation would lose */
                const unsigned bl0 = mn_tf32_bits(br.x - __uint_as_float(bh0));
                const unsigned bl1 = mn_tf32_bits(br.y - __uint_as_float(bh1));
                mn_mma_tf32(acc[j], al[0], al[1], al[2], al[3], bh0, bh1);
                mn_mma_tf32(acc[j], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
#endif
                mn_mma_tf32(acc[j], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
            }
#endif
        }
#pragma unroll
        for (int j = 0; j < NT8; j++) {
            const int n = n0 + 8 * j + 2 * t;
            epi(m0 + g, n, old[j][0].x + acc[j][0], old[j][0].y + acc[j][1]);
            epi(m0 + g + 8, n, old[j][1].x + acc[j][2], old[j][1].y + acc[j][3]);
        }
        post(m0, n0, 8 * NT8);
    }
}

#endif /* MN_EMULATED */

#endif /* __CUDACC_RTC__ */
