/* fused_wgrad.cuh: the weight gradients of one chunk in the fused kernels,
 * G (+)= dy^T h, dz^T x and the bias sums, on fused_gemm.cuh's mn_gemm
 * with mn_gacc as its epilogue (which also squares G into the gradient's
 * norm on the step's last chunk). The step kernel (fused_step.cuh) and the
 * fused backward (fused_grad.cuh, fused_grad_model.cuh) both use them; it
 * comes right after fused_kernel.cuh, whose buffers and padded weights it
 * takes, in both sources (kernels/plan.c). */

#ifdef __CUDACC_RTC__

/* pre's 8-byte loads of the old sums (below): in the step kernel in tf32
 * and bf16 where a step has more than one chunk (P1, H1: 2-4.5% faster on
 * an H200). Where every chunk is its step's first (c <= the chunk's rows:
 * M1, P1-c16) pre never loads, but its code compiled in made those
 * kernels 2% slower in tf32 (registers); fp32's P1 and H1 were 1% slower.
 * There, and in the fused backward (not measured), the code stays as it
 * was (tests/bench/RESULTS.md, 2026-11-28) */
#if !defined(MN_FUSED_GRAD) && MN_STEP > MN_FR && MN_PREC != 0
#define MN_GACC_PAIR_LOADS 1
#else
#define MN_GACC_PAIR_LOADS 0
#endif
/* MN_G_SWZ (kernels/plan.c defines it, with G in shared memory): the
 * float4 groups of G's row r are XORed with r & 7 within each 32 floats.
 * The epilogue's pair stores put 8 rows of a tile into one instruction;
 * with rows 64 or 128 floats apart they all fell on the same 8 banks, and
 * on M1 that one store made two thirds of the kernel's excess shared
 * wavefronts (ncu, H200). The update reads G through mn_g_el, the same
 * map. The plan never defines it with newton_schulz, which reads G as a
 * plain matrix, nor for the fused backward, whose G lives elsewhere. */
#ifndef MN_G_SWZ
#define MN_G_SWZ 0
#endif
__device__ __forceinline__ int mn_g_col(int r, int c, int cols)
{
    return MN_G_SWZ && cols % 32 == 0 ? c ^ ((r & 7) << 2) : c;
}

/* G (+)= a gradient product over the real rows and columns: the earlier
 * chunks' sum comes in through pre (loaded before the tile's products), the
 * new sum is stored, and squared into *ss after the step's last chunk.
 * rows and cols are the kernel's constants: the products' tiles cover
 * up16(rows) x up16(cols), so where a dimension is a multiple of 16 no
 * element is out of range and its test folds away; in the step kernel so
 * does the pairs' 8-byte alignment where cols is even (pairs below). ncu on
 * M1 had this epilogue at 13% of the kernel's instructions, most of them
 * those tests and their branches. */
struct mn_gacc {
    float *g;
    int rows, cols;
    bool first, last;
    double *ss;
    /* The step kernel's tests (the fused backward's are as they were: its
     * code with these folds measured slower, as mn_gemm's MN_GEMM_LANE_BASE
     * says). 8-byte loads and stores of a pair (c even) at p = g + r cols + c:
     * in the step kernel every parameter's G starts on a float4
     * (mn_fused_step_kernel and kernels/plan.c's fused_grad_floats), so that
     * is known at compile time; the backward tests p. */
#if defined(MN_FUSED_GRAD)
    __device__ __forceinline__ static bool row_out(int r, int rows) { return r >= rows; }
    __device__ __forceinline__ static bool col_out(int c, int cols) { return c >= cols; }
    __device__ __forceinline__ static bool col_in(int c, int cols) { return c < cols; }
    __device__ __forceinline__ static bool pairs(const float *p, int) { return ((size_t)p & 7) == 0; }
#else
    __device__ __forceinline__ static bool row_out(int r, int rows) { return rows % 16 != 0 && r >= rows; }
    __device__ __forceinline__ static bool col_out(int c, int cols) { return cols % 16 != 0 && c >= cols; }
    __device__ __forceinline__ static bool col_in(int c, int cols) { return cols % 16 == 0 || c < cols; }
    __device__ __forceinline__ static bool pairs(const float *, int cols) { return cols % 2 == 0; }
#endif
    struct old {
        const float *g;
        int rows, cols;
        bool skip;
        __device__ __forceinline__ float2 operator()(int r, int c) const
        {
            if (skip || row_out(r, rows)) return make_float2(0.0f, 0.0f);
            /* Where a step fits one chunk (MN_STEP <= MN_FR: M1, a linear
             * P1) every chunk is its step's first and this never loads; the
             * swizzle's arithmetic compiled in here anyway cost M1 1.6% in
             * tf32 (ptxas computed the offsets ahead of the test), so there
             * the dead code keeps the plain offset */
            const float *p = g + r * cols + (MN_STEP > MN_FR ? mn_g_col(r, c, cols) : c);
            /* one 8-byte load where the pair is whole and aligned, as the
             * store below does: G is global where it does not fit shared
             * memory, and these loads were the epilogue's longest waits */
            if (MN_GACC_PAIR_LOADS && col_in(c + 1, cols) && pairs(p, cols))
                return *reinterpret_cast<const float2 *>(p);
            return make_float2(col_in(c, cols) ? p[0] : 0.0f, col_in(c + 1, cols) ? p[1] : 0.0f);
        }
    };
    __device__ __forceinline__ old pre() const { return old{g, rows, cols, first}; }
    __device__ __forceinline__ void operator()(int r, int c, float s0, float s1) const
    {
        if (row_out(r, rows) || col_out(c, cols)) return;
        float *p = g + r * cols + mn_g_col(r, c, cols);
        if (col_in(c + 1, cols) && pairs(p, cols)) {
            *reinterpret_cast<float2 *>(p) = make_float2(s0, s1);
        } else {
            p[0] = s0;
            if (col_in(c + 1, cols)) p[1] = s1;
            else s1 = 0.0f;
        }
        /* the pair's squares summed in float (a rounding of 6e-8 on a sum
         * of two), then in double: one conversion and one add a pair, where
         * two squares in double were the epilogue's largest line (ncu on M1) */
        if (last) *ss += (double)fmaf(s0, s0, s1 * s1);
    }
};

/* Column sums over the chunk's real rows into a bias gradient: TP threads
 * (adjacent lanes) per column take every TP-th row in double and combine by
 * shuffles, in a fixed order, so the block stays busy and the result
 * deterministic. Z: src is z, in its layout (mn_zcol; ld is MN_LDZ). */
template <int COLS, bool Z = false>
__device__ __forceinline__ void mn_bias_grad(float *gb, const float *src, int ld, int cr, bool first, bool last,
                                             double *ss)
{
    constexpr int TP = mn_group_lanes(COLS, 8);
    const int part = threadIdx.x % TP;
    for (int o0 = 0; o0 < COLS; o0 += MN_FT / TP) {
        const int o = o0 + threadIdx.x / TP;
        double acc = 0.0;
        if (o < COLS)
            for (int r = part; r < cr; r += TP) acc += src[r * ld + (Z ? mn_zcol(r, o) : o)];
#pragma unroll
        for (int off = TP / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off, TP);
        if (o < COLS && part == 0) {
            const float s = first ? (float)acc : gb[o] + (float)acc;
            gb[o] = s;
            if (last) *ss += (double)s * s;
        }
    }
}

/* The step gradient's share of one chunk (the backward at P): with dL/dy
 * in fb.dy and the forward's h and phi'(z) in fb.h and fb.z
 * (mn_fused_forward<true>), the chunk's products go into G (flat, per
 * parameter) through mn_gacc: the step's first chunk writes, later ones
 * add, its last squares the sums into ss. fb.z is left holding dz. The
 * step kernel and the fused backward's recompute share it, so that the
 * recomputed G is the run's (PRE, x and h stored rounded, changes no
 * product: rounding twice is rounding once). The caller ends it with a
 * barrier. */
template <bool PRE = false>
__device__ __forceinline__ void mn_fused_chunk_grad(const mn_pset &P, const mn_fbuf &fb, float *const *G, int cr,
                                                    bool first, bool last, double *ss)
{
#if MN_LAYERS == 2
    const mn_gacc g2 = {G[1 * MN_PER], MN_DV, MN_DH, first, last, &ss[1 * MN_PER]};
    /* dL/dy as the products' operand: its bf16 copy in x's rows (MN_DY16) */
    const float *dyo = MN_DY16 ? fb.x + MN_DY16_AT : fb.dy;
    constexpr int LDYO = MN_DY16 ? MN_LDK : MN_LDV;
    mn_gemm<MN_PDV, MN_PDH, MN_FR, true, true, true, false, PRE, MN_DY16, MN_H16>(dyo, LDYO, fb.h, MN_LDH, g2, g2.pre());
    /* W2 as bf16 rows where the step kernel keeps P so (MN_W16) */
    mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true, true, false, false, MN_DY16, MN_W16, !MN_W16>(
        dyo, LDYO, P.w[1], MN_W16 ? MN_W16_LD(1) : MN_LLD(1), [&](int r, int j, float a0, float a1) {
        /* fb.z holds phi'(z) since the forward (mn_fused_forward<true>) */
        float2 *zp = reinterpret_cast<float2 *>(fb.z + r * MN_LDZ + mn_zcol(r, j));
        const float2 d = *zp;
        const bool real = r < cr;
        const float2 dz = make_float2(real && j < MN_DH ? a0 * d.x : 0.0f, real && j + 1 < MN_DH ? a1 * d.y : 0.0f);
        *zp = dz;
#if MN_DZ16
        reinterpret_cast<unsigned *>(fb.h + r * MN_LDH + MN_DZ16_AT)[j / 2] = mn_bf16x2(dz.x, dz.y);
#endif
    });
    if (MN_BIAS) mn_bias_grad<MN_DV>(G[1 * MN_PER + 1], fb.dy, MN_LDV, cr, first, last, &ss[MN_PER + 1]);
    __syncthreads();
    const mn_gacc g1 = {G[0], MN_DH, MN_DK, first, last, &ss[0]};
#if MN_DZ16
    /* dz's bf16 copy beside h (the h products are done: the barrier above) */
    mn_gemm<MN_PDH, MN_PDK, MN_FR, true, true, true, false, PRE, true, MN_X16>(fb.h + MN_DZ16_AT, MN_LDH, fb.x, MN_LDK, g1,
                                                                            g1.pre());
#else
    mn_gemm<MN_PDH, MN_PDK, MN_FR, true, true, true, false, PRE, false, false, false, MN_ZROT>(
        fb.z, MN_LDZ, fb.x, MN_LDK, g1, g1.pre());
#endif
    if (MN_BIAS) mn_bias_grad<MN_DH, true>(G[1], fb.z, MN_LDZ, cr, first, last, &ss[1]);
#else
    const mn_gacc g1 = {G[0], MN_DV, MN_DK, first, last, &ss[0]};
    mn_gemm<MN_PDV, MN_PDK, MN_FR, true, true, true, false, PRE, false, MN_X16>(fb.dy, MN_LDV, fb.x, MN_LDK, g1, g1.pre());
    if (MN_BIAS) mn_bias_grad<MN_DV>(G[1], fb.dy, MN_LDV, cr, first, last, &ss[1]);
    (void)P, (void)cr;
#endif
}

#endif /* __CUDACC_RTC__ */
