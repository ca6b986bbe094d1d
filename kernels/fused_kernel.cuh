/* fused_kernel.cuh: the fused per-memory path of the rule engine on the GPU
 * (DESIGN.md, Fast paths; kernels/plan.h says when it runs). Same contract
 * as mn_rule_step_kernel in rule_kernel.cuh (SPEC.md section 2), which this
 * template follows in the source and whose helpers (mn_round, the argument
 * struct, mn_memory_params) it uses, with update_math.cuh's clip and update
 * and, with out_norm, fused_norm.cuh's row math.
 *
 * One persistent block per memory walks every step of the segment. The
 * gradient point's weights P (W itself when refresh = step, else the anchor)
 * live in shared memory for the whole segment, zero-padded to multiples of
 * 16 so that every product is whole tensor-core tiles; the activations of
 * one chunk of MN_FUSED_ROWS token rows sit beside them. A step, per chunk:
 *   x <- k rows; z = x W1^T + b1, h = phi(z); y = h W2^T + b2 (+ x)
 *   (out_norm: o = h W2^T + b2, y = g N(o) + beta (+ x), a warp per row)
 *   loss terms and dy = theta R f'(y, v) (padded rows and columns: 0;
 *   out_norm: dy then goes back through the norm to dL/do)
 *   G2 += dy^T h;  dz = (dy W2) * phi'(z);  G1 += dz^T x;  bias sums
 * then the gradient's norm (summed as the last chunk's G is written), the
 * clip, and the update of S (global) and W (shared, or the padded copy in
 * the workspace when P is the anchor). Products (fused_gemm.cuh's mn_gemm,
 * before this file in the fused source): mma.sync m16n8k8 tf32 (tf32
 * mode), m16n8k16 bf16 (bf16 mode), and for fp32 the 3xTF32 split (a b ~
 * a_hi b_hi + a_hi b_lo + a_lo b_hi), which keeps fp32's accuracy on tensor
 * cores. Operands are rounded as mn_round rounds them. The block has
 * MN_FUSED_THREADS threads (512: more warps to hide the latency of the
 * many short dependent steps; tests/bench/RESULTS.md has the measurements).
 *
 * The step's gradient G of each parameter (unpadded, in parameter order,
 * total rounded up to 4 floats) sits in shared memory after the chunk
 * buffers where it fits (MN_G_SHARED, kernels/plan.c), else first in the
 * block's workspace (global); when refresh != step the workspace then holds
 * W in P's padded layout.
 *
 * This file holds the pieces: the padded weights (mn_pset), the chunk
 * buffers, the chunk's forward (on mn_gemm's products) and the block sums;
 * fused_wgrad.cuh, next in the fused source, the chunk's weight gradients;
 * fused_step.cuh, after them, is the step kernel that puts them
 * together. */

#ifdef __CUDACC_RTC__

#define MN_FR MN_FUSED_ROWS
#define MN_LDK (MN_PDK + MN_FUSED_PAD)
#define MN_LDH (MN_PDH + MN_FUSED_PAD)
#define MN_LDV (MN_PDV + MN_FUSED_PAD)
#define MN_P_AT_W (MN_REFRESH == MN_STEP) /* the gradient point is always the current W */

/* A memory over a cluster (sm_90): where a 2-layer memory's weights do not
 * fit one block's shared memory, kernels/plan.c splits it by hidden units
 * over a cluster of MN_CLUSTER blocks. Block rank c holds rows c Hs .. (c +
 * 1) Hs - 1 of W1 and b1 and the same columns of W2 (Hs = MN_DH_FULL /
 * MN_CLUSTER), so everything below that is shaped by MN_DH is the slice's:
 * the first layer and the activation are whole in each block, the output
 * layer's product is a partial sum over the block's hidden units, summed
 * across the cluster through distributed shared memory (mn_cl_rows_reduce,
 * on fused_cluster.cuh's primitives, before this file in the fused
 * source), as are the gradient's and the weights' squared norms
 * (mn_cl_sums). b2, the residual and every output to global memory belong
 * to rank 0. Every block then holds the whole output rows: out_norm's row
 * math runs in each as it does in one block. Only the global tensors (W,
 * S, the anchor: mn_memory_params, before this point) keep the whole
 * hidden width. */

/* Phase profiling of the step kernel (MNEMO_FUSED_PROFILE) and of the
 * fused backward (MNEMO_FG_PROFILE): plan.c defines MN_PROFILE into that
 * source alone. Block 0's thread 0 adds the clock cycles between marks to
 * the phase's counter, and prints the counters when the kernel ends. A
 * mark sits after a barrier, so a phase's count is the block's wall time
 * in it, waits included. Profiling only: the kernel is recompiled with the
 * marks, and the counters start at 0 each launch. */
#ifdef MN_PROFILE
#define MN_PROFILE_PHASES 24
__device__ long long mn_prof[MN_PROFILE_PHASES], mn_prof_last;
#define MN_PROF_FIRST (threadIdx.x == 0 && blockIdx.x == 0)
#define MN_PROF_START()                                                                                               \
    do {                                                                                                              \
        if (MN_PROF_FIRST) {                                                                                          \
            for (int i_ = 0; i_ < MN_PROFILE_PHASES; i_++) mn_prof[i_] = 0;                                           \
            mn_prof_last = clock64();                                                                                 \
        }                                                                                                             \
    } while (0)
#define MN_PROF_MARK(i)                                                                                               \
    do {                                                                                                              \
        if (MN_PROF_FIRST) {                                                                                          \
            const long long now_ = clock64();                                                                         \
            mn_prof[i] += now_ - mn_prof_last;                                                                        \
            mn_prof_last = now_;                                                                                      \
        }                                                                                                             \
    } while (0)
/* The counters of phases 1 .. n - 1 that ran (phase 0 takes what no phase
 * counts), a line each: "TAG phase I: C cycles", then ": NAME" where names
 * are given. */
__device__ void mn_prof_print(const char *tag, const char *const *names, int n)
{
    if (!MN_PROF_FIRST) return;
    for (int i = 1; i < n; i++) {
        if (!mn_prof[i]) continue;
        if (names) printf("%s phase %d: %lld cycles: %s\n", tag, i, mn_prof[i], names[i]);
        else printf("%s phase %d: %lld cycles\n", tag, i, mn_prof[i]);
    }
}
#else
#define MN_PROF_START() ((void)0)
#define MN_PROF_MARK(i) ((void)0)
#endif

/* The dynamic shared memory of the step kernel and the fused backward (the
 * emulation's shim, tests/emu/cuda_shim.h, gives its own). */
#ifndef MN_DYNAMIC_SMEM
#define MN_DYNAMIC_SMEM(name) extern __shared__ float4 name[]
#endif

#if MN_CLUSTER > 1
static_assert(MN_LAYERS == 2 && !MN_PRECOND && !MN_GLU,
              "a cluster splits a 2-layer memory without gates or newton_schulz");
static_assert(MN_DH_FULL % MN_CLUSTER == 0, "whole slices");
#undef MN_DH
#define MN_DH (MN_DH_FULL / MN_CLUSTER)
#endif
#define MN_MEMORY ((long long)(blockIdx.x / MN_CLUSTER)) /* the memory this block works on */
#ifndef MN_FUSED_MINB
#define MN_FUSED_MINB 1 /* blocks an SM the step kernel is compiled to share (kernels/plan.c) */
#endif
/* every parameter's rows (and sizes) a multiple of 4 floats: the update goes by float4 */
#define MN_VEC4 (MN_DK % 4 == 0 && MN_DV % 4 == 0 && (MN_LAYERS == 1 || MN_DH % 4 == 0))

/* Where the block's threads share n items (rows, columns, outputs) in
 * groups of adjacent lanes that sum by shuffles: the group's size, the
 * largest power of two up to cap that still gives every item a group
 * (at least 1). */
constexpr int mn_group_lanes(int n, int cap)
{
    int g = cap;
    while (g > 1 && MN_FT / n < g) g /= 2;
    return g;
}

/* Layer i of the model (0-based): real and padded sizes. */
#define MN_LIN(i) mn_layer_in((i), MN_DK, MN_DH)
#define MN_LOUT(i) mn_layer_out((i), MN_LAYERS, MN_DV, MN_DH)
#define MN_LPIN(i) mn_layer_in((i), MN_PDK, MN_PDH)
#define MN_LPOUT(i) mn_layer_out((i), MN_LAYERS, MN_PDV, MN_PDH)
#define MN_LLD(i) (MN_LPIN(i) + MN_FUSED_PAD)

static_assert(MN_FR % 16 == 0 && MN_PDK % 16 == 0 && MN_PDV % 16 == 0 && MN_PDH % 16 == 0, "whole tiles");

/* Pointers into one padded copy of the parameters. */
struct mn_pset {
    float *w[MN_LAYERS], *b[MN_LAYERS];
};

/* bf16's weights in shared memory as bf16 (MN_W16; kernels/plan.c
 * defines it and counts the bytes), where W lives in the workspace
 * (refresh > step, P1-c16). There P is the anchor: a copy of W^(s) made at
 * each refresh, which only the products read, and they round it to bf16.
 * So P's weights are stored rounded, as bf16 rows, and beside them the
 * same of the current W (fb.wh), which the update writes as it computes
 * each element (the fp32 W stays in the workspace). The retrieval at W,
 * whose products read W from L2 (its output layer: 4 tiles of y = h W2^T
 * over K = dh, 12 of 16 warps idle while 4 walked dh / 16 dependent rounds
 * of loads), then takes both layers from shared memory, and every product
 * takes its weights by ldmatrix (mn_gemm's BH) with no conversion. Two
 * bf16 rows take the room of one float row: the shared memory grows only
 * by the rows' 8-element pads (5 KB for P1-c16). A copy of W2 alone, in
 * 33 KB more, made the kernel 0.8% slower, though reading W2 from shared
 * memory had made it 3.5% faster: most likely the larger allocation took
 * the SM's L1 carve-out down a step (not measured). The same values in the
 * same k order, so the same bits (same_bits.sh with MNEMO_FUSED_W16 0 and
 * 1). Not in a cluster, with newton_schulz (its update is a separate pass),
 * nor where G sits in shared memory; not in the fused backward nor the
 * emulation (whose mn_gemm takes floats). A row: MN_LPIN(i) bf16 and 8 more, so that
 * rows fall 4 banks apart (ldmatrix's 8 rows of 16 bytes: no conflict). */
#if defined(MN_EMULATED) || defined(MN_FUSED_GRAD)
#undef MN_W16
#define MN_W16 0
#endif
#ifndef MN_W16
#define MN_W16 0
#endif
#define MN_W16_LD(i) ((MN_LPIN(i) + 8) / 2) /* floats a bf16 row of layer i's weights (mn_gemm's ldb) */
#define MN_W16_FLOATS(i) (MN_LPOUT(i) * MN_W16_LD(i))

#if MN_W16
/* Elements e .. e + 3 (e a multiple of 4, an unpadded index o * in + j)
 * of layer i's weights into its bf16 rows w: one 8-byte store */
__device__ __forceinline__ void mn_w16_put4(float *w, int i, int e, float4 v)
{
    const int ni = MN_LIN(i), o = e / ni, j = e % ni;
    *reinterpret_cast<uint2 *>(reinterpret_cast<unsigned short *>(w + o * MN_W16_LD(i)) + j) =
        make_uint2(mn_bf16x2(v.x, v.y), mn_bf16x2(v.z, v.w));
}

/* Layer i's weights from global, unpadded (src), into bf16 rows w, zeros in
 * the padding */
__device__ void mn_w16_from(float *w, int i, const float *src)
{
    const int ni = MN_LIN(i), no = MN_LOUT(i), half = MN_LPIN(i) / 2;
    for (int e = threadIdx.x; e < MN_LPOUT(i) * half; e += MN_FT) {
        const int o = e / half, j = 2 * (e % half);
        const bool in = o < no;
        reinterpret_cast<unsigned *>(w + o * MN_W16_LD(i))[j / 2] =
            mn_bf16x2(in && j < ni ? src[o * ni + j] : 0.0f, in && j + 1 < ni ? src[o * ni + j + 1] : 0.0f);
    }
}
#endif

/* The parameters' layout from base: each layer's weights, then its bias.
 * ROWS16 (MN_W16): the weights as bf16 rows (MN_W16_FLOATS), else padded
 * float rows. */
template <bool ROWS16 = false> __device__ __forceinline__ float *mn_pset_init(mn_pset *ps, float *base)
{
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        ps->w[i] = base;
        base += ROWS16 ? (long long)MN_W16_FLOATS(i) : (long long)MN_LPOUT(i) * MN_LLD(i);
        ps->b[i] = MN_BIAS ? base : 0;
        base += MN_BIAS ? MN_LPOUT(i) : 0;
    }
    return base;
}


/* Element e (flat, in the block's slice) of parameter p, as an offset into
 * the memory's global tensor once mn_cl_params has moved its pointer to the
 * slice: W2's slice is columns, so its rows are MN_DH_FULL apart there. */
__device__ __forceinline__ int mn_gel(int p, int e)
{
#if MN_CLUSTER > 1
    if (p == MN_PER) return (e / MN_DH) * MN_DH_FULL + e % MN_DH;
#endif
    (void)p;
    return e;
}

/* Whether this block updates (and counts in the norms) parameter p: in a
 * cluster, b2 is rank 0's. */
__device__ __forceinline__ bool mn_owns(int p, bool lead)
{
    return MN_CLUSTER == 1 || !MN_BIAS || p != MN_PER + 1 || lead;
}


/* bf16's operands stored as bf16 by their producers (fused_gemm.cuh's
 * MN_H16, the step kernel), each the value the products rounded it to
 * before, for fused_wgrad.cuh's and mn_fused_forward's products:
 * - h, in its own buffer (mn_fused_forward);
 * - the chunk's x rows (MN_X16) where, as MN_PRE's x in tf32, nothing but
 *   products reads them: a 2-layer memory without residual or out_norm (the
 *   step's last token, which the row retrieval reads, is widened into fb.xs
 *   first);
 * - a copy of dz (MN_DZ16: the first layer's weight gradient's operand)
 *   beside h in each of h's rows, from float MN_DZ16_AT on (16-byte
 *   aligned: h's bf16 row takes 2 PDH of the row's 4 (PDH + PAD) bytes);
 * - a copy of dL/dy (MN_DY16: the second layer's weight gradient's and dh's
 *   operand) beside x's in x's rows, from float MN_DY16_AT on, where a row
 *   of it (dv) fits there.
 * dz's and dL/dy's floats stay for the bias gradients' sums. */
#ifndef MN_H16_X
#define MN_H16_X MN_H16
#endif
#ifndef MN_H16_DY
#define MN_H16_DY MN_H16_X
#endif
#define MN_X16 (MN_H16_X && MN_LAYERS == 2 && !MN_RESIDUAL && !MN_OUT_NORM)
#define MN_DZ16 (MN_H16_X && MN_LAYERS == 2)
#define MN_DZ16_AT ((MN_PDH + 8) / 2)
#define MN_DY16 (MN_H16_DY && MN_X16 && MN_PDV <= MN_PDK)
#define MN_DY16_AT ((MN_PDK + 8) / 2)
static_assert(MN_FUSED_PAD >= 4, "dz's and dL/dy's bf16 copies fit beside h's and x's in a row");

/* z's layout in bf16's step kernel. z's rows are 4 banks apart, as every
 * chunk buffer's, and the products' epilogues store z as 8-byte pairs (the
 * forward) and read and store them again (dz = dh phi'): lanes 0-15's
 * pairs, rows g = 0..3 of 8 floats from bank 4g, met every bank twice
 * (Nsight Compute, P1 bf16, H200: 2.6M of the step kernel's 11.5M
 * bank-conflict wavefronts). Two ways out, the same values either way:
 * - MN_ZPAD (kernels/plan.c sets it where the rows fit in shared memory):
 *   rows 4 floats wider (MN_LDZ), 8 banks apart, so rows 0..3 take banks
 *   8g .. 8g + 7: no index arithmetic.
 * - MN_ZROT where they do not fit (P1: its 32 rows fill the SM): odd rows
 *   turned by 12 floats within every 32, as W's are (mn_turned_col), so
 *   rows 0..3 start at banks 0, 16, 8, 24. Its index costs registers, so
 *   only where it was measured to pay (H200, step kernel): P1 1-2% faster;
 *   H1 (a cluster) 2.5% slower, its ptxas frame 24 -> 48 bytes; M1 (chunks
 *   of 16 rows) 2.2% slower, 0 -> 8 bytes; P1-c16 (16 rows) no change. So
 *   without a cluster, in chunks of 32 rows or more.
 * z's other readers lose nothing: the activation's loop reads 32 or 16
 * adjacent columns of one or two rows, the bias gradient's sums 1, 2 or 4
 * rows of adjacent columns a warp (with the turn, 8 rows would meet its
 * four starting banks twice: hence MN_FT / MN_DH < 8). In bf16 no product
 * reads z (its operand is dz's bf16 copy, MN_DZ16). tf32 keeps plain rows:
 * its first layer's weight gradient reads z by columns, rows 2t and 2t + 1
 * a lane, which rows 8 banks apart would put on one bank, and the turn's
 * registers were not measured there (the emulation, without dz's copy,
 * reads turned rows through mn_gemm's AZ).
 * MNEMO_FUSED_ZPAD=0 and MNEMO_FUSED_ZROT=0 keep plain rows, to measure. */
#ifndef MN_ZPAD
#define MN_ZPAD 0
#endif
#ifndef MN_ZROT
#if MN_WROT && MN_DZ16 && !MN_ZPAD && MN_CLUSTER == 1 && MN_FR >= 32 && MN_FT / MN_DH < 8
#define MN_ZROT 1
#else
#define MN_ZROT 0
#endif
#endif
#if (MN_ZPAD || MN_ZROT) && defined(MN_FUSED_GRAD)
#error "the fused backward reads z in plain rows (fused_grad_model.cuh)"
#endif
static_assert(!MN_ZROT || (MN_LAYERS == 2 && MN_PDH % 32 == 0), "z's rows of whole 32s");
#define MN_LDZ (MN_LDH + 4 * MN_ZPAD)

/* The column where z's element (row, col) sits in its row (MN_ZROT); rows
 * are MN_LDZ floats apart. */
__device__ __forceinline__ int mn_zcol(int row, int col) { return MN_ZROT ? mn_turned_col(row, col) : col; }

/* Chunk buffers in shared memory. */
struct mn_fbuf {
    float *x, *z, *h, *y, *dy; /* [R x ld]; z holds phi'(z) after mn_fused_forward<true>, dz after the backward */
    float *xs, *hs, *ys;       /* one row's forward (ys: its output before out_norm) */
    float *lrow;               /* the chunk's row losses [R] */
    float *wh[MN_LAYERS];      /* MN_W16: the current W's weights as bf16 rows [MN_LPOUT(i) x MN_W16_LD(i)] */
};

/* L2 hints: the inputs (k, v, q, theta) are read once and the outputs (y,
 * loss) written once, while each memory's G and S are read and written at
 * every step (P1: 128 memories' 34 MB beside 200 MB of inputs and outputs
 * streaming through a 50 MB L2). With MN_STREAM (the default; 0 through
 * MNEMO_FUSED_STREAM, plan.c, to measure) the streams load and store with
 * .cs, evict-first, so that they pass through without pushing G and S out:
 * on an H200, P1 1-2.5% faster, M1 (whose G and S are small) the same
 * (tests/bench/RESULTS.md). A hint only: the same values either way. */
#ifndef MN_STREAM
#define MN_STREAM 1
#endif
#if defined(MN_EMULATED) || !MN_STREAM
__device__ __forceinline__ float mn_ld_once(const float *p) { return *p; }
__device__ __forceinline__ void mn_st_once(float *p, float v) { *p = v; }
__device__ __forceinline__ float4 mn_ld4_once(const float *p) { return *reinterpret_cast<const float4 *>(p); }
__device__ __forceinline__ void mn_st4_once(float *p, float4 v) { *reinterpret_cast<float4 *>(p) = v; }
#else
__device__ __forceinline__ float mn_ld_once(const float *p)
{
    float v;
    asm volatile("ld.global.cs.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void mn_st_once(float *p, float v)
{
    asm volatile("st.global.cs.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
/* four neighbours, p 16-byte aligned */
__device__ __forceinline__ float4 mn_ld4_once(const float *p)
{
    float4 v;
    asm volatile("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void mn_st4_once(float *p, float4 v)
{
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}
#endif

/* The step's gradient in the workspace, dropped from L2 as the update reads
 * it (MN_DISCARD): discard.global.L2 invalidates a 128-byte line without
 * writing it back, and its bytes read as undefined until written again.
 * G is dead from the update's read until the next step's first chunk
 * stores it (it never adds to what is there), so its lines need not reach
 * HBM. Where W is in the workspace too (the gradient point the anchor,
 * P1-c16: G, S and W 48 MB against a 50 MB L2, every block in its update
 * at once) the write-backs were most of the kernel's HBM traffic (Nsight
 * Compute: 14.1 GB written, 5.1 GB read); dropped, 10.9 and 3.7, and the
 * kernel 6-7% faster (H200). Where W is in shared memory (P1, H1: HBM 14% busy) the
 * discards cost 1.7% and are left out. MNEMO_FUSED_DISCARD=0 or 1 (plan.c)
 * sets it, to measure; the values are the same either way. */
#ifndef MN_DISCARD
#define MN_DISCARD (!MN_P_AT_W)
#endif
/* The 128-byte line at g, a float4 of G that this lane has just read, lane
 * i of the warp reading the float4 after lane i - 1's: dropped where the
 * line starts at this lane and ends by end (G's parameter), so that the
 * lanes that read it are this one and the 7 after it. */
__device__ __forceinline__ void mn_discard_read_line(const float4 *g, const float *end)
{
#if !defined(MN_EMULATED)
    const size_t at = (size_t)g;
    __syncwarp(__activemask()); /* every lane's read of the line before its discard */
    if ((at & 127) == 0 && (threadIdx.x & 31) + 7 < 32 && at + 128 <= (size_t)end)
        asm volatile("discard.global.L2 [%0], 128;" ::"l"(at) : "memory");
#else
    (void)g, (void)end;
#endif
}

/* Row-chunk I/O in groups of MN_QW neighbours of a row: where the widths
 * are multiples of 4, a thread moves quads (one 16-byte load or store where
 * the pointer allows: a chunk's rows are contiguous in global memory), a
 * quarter of the load and store instructions and of their address and
 * bounds arithmetic (ncu on P1-lin: the scalar fetch and the loss pass's
 * loads and stores were a quarter of the step kernel's stall samples);
 * else single floats. A group is all real columns or all padding. */
#define MN_QW (MN_DK % 4 == 0 && MN_DV % 4 == 0 ? 4 : 1)

__device__ __forceinline__ bool mn_al16(const void *p) { return ((size_t)p & 15) == 0; }

/* Four floats at p, or zeros where !real: one wide load where p is 16-byte
 * aligned (al), else four */
__device__ __forceinline__ float4 mn_ld4_at(const float *p, bool real, bool al)
{
    if (!real) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (al) return mn_ld4_once(p);
    return make_float4(mn_ld_once(p), mn_ld_once(p + 1), mn_ld_once(p + 2), mn_ld_once(p + 3));
}

__device__ __forceinline__ void mn_st4_at(float *p, float4 v, bool al)
{
    if (al) {
        mn_st4_once(p, v);
    } else {
        mn_st_once(p, v.x), mn_st_once(p + 1, v.y), mn_st_once(p + 2, v.z), mn_st_once(p + 3, v.w);
    }
}

/* W (4 or 1) neighbours of global memory at p into x, zeros where !real */
template <int W> __device__ __forceinline__ void mn_ld_group(float *x, const float *p, bool real, bool al)
{
    static_assert(W == 4 || W == 1, "quads or single floats");
    if (W == 4) {
        const float4 v = mn_ld4_at(p, real, al);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
        x[0] = real ? mn_ld_once(p) : 0.0f;
    }
}

/* x's W floats to shared memory at p (16-byte aligned for quads) */
template <int W> __device__ __forceinline__ void mn_sh_put(float *p, const float *x)
{
    if (W == 4) *reinterpret_cast<float4 *>(p) = make_float4(x[0], x[1], x[2], x[3]);
    else p[0] = x[0];
}

/* W floats of shared memory at p (16-byte aligned for quads) into x */
template <int W> __device__ __forceinline__ void mn_sh_get(float *x, const float *p)
{
    if (W == 4) {
        const float4 v = *reinterpret_cast<const float4 *>(p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
        x[0] = p[0];
    }
}

#if MN_H16
/* x's W floats to shared memory as bf16 at p (8-byte aligned for quads),
 * rounded as mn_round rounds: the step kernel's bf16 operands (MN_H16) */
template <int W> __device__ __forceinline__ void mn_sh_put16(unsigned short *p, const float *x)
{
    if (W == 4) *reinterpret_cast<uint2 *>(p) = make_uint2(mn_bf16x2(x[0], x[1]), mn_bf16x2(x[2], x[3]));
    else p[0] = (unsigned short)mn_bf16x2(x[0], 0.0f);
}
#endif

/* x's W floats to global memory at p, streamed (al: p is 16-byte aligned) */
template <int W> __device__ __forceinline__ void mn_st_group(float *p, const float *x, bool al)
{
    if (W == 4) mn_st4_at(p, make_float4(x[0], x[1], x[2], x[3]), al);
    else mn_st_once(p, x[0]);
}

/* A chunk of input rows travels in two halves: mn_rows_fetch loads this
 * thread's share into registers (all loads issued together), mn_rows_store
 * puts it in shared memory, zero beyond cr rows and the real width. The
 * fetch of the next chunk is issued before the current chunk's products, so
 * its latency hides behind them. A thread's share is groups: x[MN_QW u ..
 * MN_QW u + MN_QW - 1] is group u, columns j .. j + MN_QW - 1 (j = MN_QW (e %
 * (MN_PDK / MN_QW))) of row e / (MN_PDK / MN_QW), e = threadIdx.x + u MN_FT. */
#define MN_NXG ((MN_FR * MN_PDK / MN_QW + MN_FT - 1) / MN_FT)
#define MN_NX (MN_QW * MN_NXG)

__device__ __forceinline__ void mn_rows_fetch(float (&x)[MN_NX], const float *src, int avail)
{
    const bool al = mn_al16(src);
#pragma unroll
    for (int u = 0; u < MN_NXG; u++) {
        const int e = threadIdx.x + u * MN_FT, r = e / (MN_PDK / MN_QW), j = MN_QW * (e % (MN_PDK / MN_QW));
        mn_ld_group<MN_QW>(x + MN_QW * u, src + (long long)r * MN_DK + j,
                           e < MN_FR * MN_PDK / MN_QW && r < avail && j < MN_DK, al);
    }
}

/* extra (shared memory, dk floats), where given, becomes row cr (the step
 * kernel's retrieval row; cr < MN_FR then). PRE: stored rounded as the
 * products round their operands (mn_round; see MN_PRE) */
template <bool PRE = false>
__device__ __forceinline__ void mn_rows_store(float *dst, const float (&x)[MN_NX], int cr, const float *extra = 0)
{
#pragma unroll
    for (int u = 0; u < MN_NXG; u++) {
        const int e = threadIdx.x + u * MN_FT, r = e / (MN_PDK / MN_QW), j = MN_QW * (e % (MN_PDK / MN_QW));
        if (e < MN_FR * MN_PDK / MN_QW) {
            float v[MN_QW];
#pragma unroll
            for (int i = 0; i < MN_QW; i++) {
                v[i] = r < cr ? x[MN_QW * u + i] : (extra && r == cr && j < MN_DK ? extra[j + i] : 0.0f);
                if (PRE) v[i] = mn_round(v[i]);
            }
#if MN_X16
            mn_sh_put16<MN_QW>(reinterpret_cast<unsigned short *>(dst + r * MN_LDK) + j, v);
#else
            mn_sh_put<MN_QW>(dst + r * MN_LDK + j, v);
#endif
        }
    }
}

#if MN_CLUSTER > 1
/* The chunk's output rows from the cluster's partial sums, each block's in
 * its y buffer: summed in rank order (so every block gets the same bits)
 * and handed to epi_y pair by pair, as mn_gemm's epilogue would hand them.
 * The first barrier publishes the parts, the second keeps every block's
 * buffer until all have read it (epi_y may write there). */
template <class EpiY> __device__ __forceinline__ void mn_cl_rows_reduce(const float *y, EpiY epi_y)
{
    constexpr int PAIRS = MN_FR * MN_PDV / 2, NP = (PAIRS + MN_FT - 1) / MN_FT;
    float2 sum[NP];
    mn_cl_sync();
#pragma unroll
    for (int u = 0; u < NP; u++) {
        const int e = threadIdx.x + u * MN_FT, r = e / (MN_PDV / 2), j = 2 * (e % (MN_PDV / 2));
        if (e >= PAIRS) break;
        sum[u] = mn_cl_sum(reinterpret_cast<const float2 *>(y + r * MN_LDV + j));
    }
    mn_cl_sync();
#pragma unroll
    for (int u = 0; u < NP; u++) {
        const int e = threadIdx.x + u * MN_FT, r = e / (MN_PDV / 2), j = 2 * (e % (MN_PDV / 2));
        if (e >= PAIRS) break;
        epi_y(r, j, sum[u].x, sum[u].y);
    }
}
#endif

/* Sums of v[0..n) over the cluster (every thread holds its block's, as
 * mn_block_sums leaves them), into v for every thread; in rank order, so
 * every block gets the same bits. Nothing without a cluster. */
template <int N> __device__ __forceinline__ void mn_cl_sums(double *v)
{
#if MN_CLUSTER > 1
    __shared__ double mine[N];
    if (threadIdx.x == 0)
#pragma unroll
        for (int i = 0; i < N; i++) mine[i] = v[i];
    mn_cl_sync();
#pragma unroll
    for (int i = 0; i < N; i++) v[i] = mn_cl_sum(&mine[i]);
    mn_cl_sync(); /* every block has read mine before it changes */
#else
    (void)v;
#endif
}

/* The memory's global parameter pointers (mn_memory_params) moved to this
 * block's slice: W1's and b1's rows, W2's columns (mn_gel). */
__device__ __forceinline__ void mn_cl_params(float **p)
{
#if MN_CLUSTER > 1
    const long long c = mn_cl_rank();
    p[0] += c * MN_DH * MN_DK;
    if (MN_BIAS) p[1] += c * MN_DH;
    p[MN_PER] += c * MN_DH;
#else
    (void)p;
#endif
}

/* y = M(x; P) for the chunk in fb.x (cr real rows): z and h kept (hidden
 * layer), y element (r, j) handed to epi_y with the bias (and residual)
 * added; with out_norm, o (the bias added, not the residual: the callers
 * normalise the rows and add it). Padded hidden units and rows hold h = 0, so whatever phi(0) is
 * never reaches a product. GRAD (the step's forward): fb.z is left holding
 * phi'(z), what the backward needs of z (0 in padding). BSH: P is in shared
 * memory (false: the weights' padded copy in the workspace, mn_gemm).
 * HROWS (the step kernel's retrieval row): rows cr .. hrows - 1 get their
 * h (and y) too, but phi' = 0, as a padded row's. PRE: fb.x holds its rows
 * rounded as the products round them (mn_rows_store<true>), and h is stored
 * so too: the products then take both as they are (MN_PRE). Ends with a
 * barrier. */
template <bool GRAD, bool BSH = true, bool HROWS = false, bool PRE = false, bool WH = false, class EpiY>
__device__ __forceinline__ void mn_fused_forward(const mn_pset &P, const mn_fbuf &fb, int cr, EpiY epi_y,
                                                 int hrows = 0)
{
    /* WH: P's weights are bf16 rows in shared memory (MN_W16), its biases floats */
    static_assert(!WH || MN_W16, "bf16 weights where the plan stored them so");
    if (!HROWS) hrows = cr;
#if MN_LAYERS == 2
    mn_gemm<MN_FR, MN_PDH, MN_PDK, false, false, BSH || WH, PRE, false, MN_X16, WH, !WH>(
        fb.x, MN_LDK, P.w[0], WH ? MN_W16_LD(0) : MN_LLD(0), [&](int r, int j, float a0, float a1) {
        float2 z = make_float2(a0, a1);
        if (MN_BIAS) z.x += P.b[0][j], z.y += P.b[0][j + 1];
        *reinterpret_cast<float2 *>(fb.z + r * MN_LDZ + mn_zcol(r, j)) = z;
    }, mn_no_pre(), [&](int m0, int n0, int width) {
        /* h = phi(z) and, for the backward, phi'(z) in place of z: a loop
         * over the warp's tile, so each is inlined once (not once per
         * epilogue call) and phi and phi' share their common terms */
        __syncwarp();
        const int lane = threadIdx.x & 31;
#pragma unroll 2
        for (int e = lane; e < 16 * width; e += 32) {
            const int r = m0 + e / width, j = n0 + e % width;
            const bool real = r < hrows && j < MN_DH;
            const float z = fb.z[r * MN_LDZ + mn_zcol(r, j)];
            /* phi and phi' in one branch, with no store between them, so
             * the compiler computes their common terms once (gelu's erfc:
             * about 50 instructions, which it computed twice when each
             * sat in a branch of its own; ncu on P1, RESULTS.md) */
            float hv = 0.0f, dv = 0.0f;
            if (real) {
                hv = mn_hook_act(z);
                if (GRAD && (!HROWS || r < cr)) dv = mn_hook_act_grad(z);
            }
#if MN_H16
            /* (not mn_sh_put16<1>: through it ptxas scheduled P1's and M1's bf16 step kernels otherwise) */
            reinterpret_cast<unsigned short *>(fb.h)[r * 2 * MN_LDH + j] = (unsigned short)mn_bf16x2(hv, 0.0f);
#else
            fb.h[r * MN_LDH + j] = PRE ? mn_round(hv) : hv;
#endif
            if (GRAD) fb.z[r * MN_LDZ + mn_zcol(r, j)] = dv;
        }
    });
    __syncthreads();
#endif
    /* the output layer: its input (h, or x for a linear memory) has the
     * leading dimension of the layer's padded weights */
    constexpr int OUT = MN_LAYERS - 1;
    const bool lead = MN_CL_LEAD; /* in a cluster, b2 and the residual are added once, by rank 0 */
    mn_gemm<MN_FR, MN_PDV, MN_LPIN(OUT), false, false, BSH || WH, PRE, false, MN_LAYERS == 2 ? MN_H16 : MN_X16, WH,
            !WH>(MN_LAYERS == 2 ? fb.h : fb.x, MN_LLD(OUT), P.w[OUT], WH ? MN_W16_LD(OUT) : MN_LLD(OUT),
                 [&](int r, int j, float a0, float a1) {
        float y0 = a0, y1 = a1;
        if (MN_BIAS && lead) y0 += P.b[OUT][j], y1 += P.b[OUT][j + 1];
        /* with out_norm the residual comes after the norm (mn_fused_norm_row's callers) */
        if (MN_RESIDUAL && !MN_OUT_NORM && lead) y0 += fb.x[r * MN_LDK + j], y1 += fb.x[r * MN_LDK + j + 1];
#if MN_CLUSTER > 1
        *reinterpret_cast<float2 *>(fb.y + r * MN_LDV + j) = make_float2(y0, y1); /* this block's part */
#else
        epi_y(r, j, y0, y1);
#endif
    });
#if MN_CLUSTER > 1
    mn_cl_rows_reduce(fb.y, epi_y);
#endif
    __syncthreads();
}

#if MN_OUT_NORM
/* Retrieval: the first rows of o in fb.y normalised into yo (global, dv
 * floats a row), the residual's x rows in fb.x. Ends with a barrier (the
 * next chunk rewrites fb.x). */
__device__ void mn_fused_norm_rows(const mn_fbuf &fb, int rows, const float *ln_g, const float *ln_b, float *yo)
{
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < rows && MN_CL_LEAD; r += MN_FWARPS) {
        float nh[MN_NCW];
        mn_fused_norm_row(fb.y + r * MN_LDV, nh);
#pragma unroll
        for (int u = 0; u < MN_NCW; u++) {
            const int j = lane + 32 * u;
            if (j < MN_DV) yo[(long long)r * MN_DV + j] = mn_fused_norm_y(ln_g, ln_b, j, nh[u], fb.x + r * MN_LDK);
        }
    }
    __syncthreads();
}
#endif

/* y_row = M(x_row; P) for one row, on the CUDA cores (the last token of a
 * step under retrieve = after). x_row is in shared memory (dk floats), out
 * in global memory. bias and x_res may be null: none added (a cluster's
 * ranks but 0). Each output is a dot product split over a group of
 * lanes (a power of two, up to a warp) and summed by shuffles, so a layer of
 * few outputs still keeps every thread busy. A hidden layer's outputs are
 * stored rounded as the next layer's products round them (IN_ROUNDED
 * there): each is rounded once, not by every output that reads it. */
template <int NI, int NO, bool IN_ROUNDED = false>
__device__ __forceinline__ void mn_row_layer(const float *w, int ld, const float *bias, const float *in, bool last,
                                             const float *x_res, float *out)
{
    constexpr int GS = mn_group_lanes(NO, 32);
    const int lane = threadIdx.x % GS;
    for (int o0 = 0; o0 < NO; o0 += MN_FT / GS) {
        const int o = o0 + threadIdx.x / GS; /* the same for the whole group */
        float acc = 0.0f;
        if (o < NO) {
            const float *wr = w + o * ld;
            int j = lane;
            for (; j + GS < NI; j += 2 * GS) { /* two at a time for mn_round2; the sum's order is the same */
                float x0 = in[j], x1 = in[j + GS], w0 = wr[mn_wcol(o, j)], w1 = wr[mn_wcol(o, j + GS)];
                if (!IN_ROUNDED) mn_round2(x0, x1);
                mn_round2(w0, w1);
                acc += x0 * w0;
                acc += x1 * w1;
            }
            if (j < NI) acc += (IN_ROUNDED ? in[j] : mn_round(in[j])) * mn_round(wr[mn_wcol(o, j)]);
        }
#pragma unroll
        for (int off = GS / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off, GS);
        if (o < NO && lane == 0) {
            if (MN_BIAS && bias) acc += bias[o];
            if (last) {
                if (MN_RESIDUAL && !MN_OUT_NORM && x_res) acc += x_res[o];
                out[o] = acc;
            } else {
                out[o] = mn_round(mn_hook_act(acc));
            }
        }
    }
}

template <bool X_ROUNDED = false> /* x_row holds rounded operands, read by products alone (no residual, no norm) */
__device__ void mn_fused_row(const mn_pset &P, const mn_fbuf &fb, const float *x_row, float *out, const float *ln_g,
                             const float *ln_b)
{
#if MN_OUT_NORM
    float *o = fb.ys; /* the norm needs the whole row */
#else
    float *o = out;
    (void)ln_g, (void)ln_b;
#endif
#if MN_LAYERS == 2 && MN_CLUSTER > 1
    /* each block's part of the output into fb.ys, summed over the cluster by
     * rank 0, which keeps the sums in registers until every block has read
     * the parts (with out_norm, o is fb.ys itself) */
    const bool lead = MN_CL_LEAD;
    static_assert(MN_DV <= MN_FT, "a thread per output column");
    mn_row_layer<MN_DK, MN_DH, X_ROUNDED>(P.w[0], MN_LLD(0), P.b[0], x_row, false, x_row, fb.hs);
    __syncthreads();
    mn_row_layer<MN_DH, MN_DV, true>(P.w[1], MN_LLD(1), lead ? P.b[1] : 0, fb.hs, true, lead ? x_row : 0, fb.ys);
    mn_cl_sync();
    const int j = threadIdx.x;
    const float t = lead && j < MN_DV ? mn_cl_sum(fb.ys + j) : 0.0f;
    mn_cl_sync();
    if (lead && j < MN_DV) o[j] = t;
#elif MN_LAYERS == 2
    mn_row_layer<MN_DK, MN_DH, X_ROUNDED>(P.w[0], MN_LLD(0), P.b[0], x_row, false, x_row, fb.hs);
    __syncthreads();
    mn_row_layer<MN_DH, MN_DV, true>(P.w[1], MN_LLD(1), P.b[1], fb.hs, true, x_row, o);
#else
    mn_row_layer<MN_DK, MN_DV, X_ROUNDED>(P.w[0], MN_LLD(0), P.b[0], x_row, true, x_row, o);
#endif
    __syncthreads();
#if MN_OUT_NORM
    if (threadIdx.x < 32 && MN_CL_LEAD) {
        float nh[MN_NCW];
        mn_fused_norm_row(fb.ys, nh);
#pragma unroll
        for (int u = 0; u < MN_NCW; u++) {
            const int j = threadIdx.x + 32 * u;
            if (j < MN_DV) out[j] = mn_fused_norm_y(ln_g, ln_b, j, nh[u], x_row);
        }
    }
    __syncthreads();
#endif
}

/* Sums of v[0..n) over the block, into v, for every thread (one pass for
 * several values). Starts with a barrier, so back-to-back calls never
 * overwrite partials still being read. */
__device__ __forceinline__ double (*mn_block_parts())[MN_FWARPS]
{
    __shared__ double part[MN_NPARAMS][MN_FWARPS]; /* one array for every call (kernels/plan.c counts it) */
    return part;
}

/* The same with the warps' partials in part, N rows of MN_FWARPS doubles of
 * shared memory that nothing reads or writes meanwhile (the step kernel's
 * sums of more values than the static array holds: P1's shared memory has
 * no 256 bytes to spare for it). */
template <int N> __device__ void mn_block_sums_in(double *v, double (*part)[MN_FWARPS])
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* The warp's sums. While a lane holds two values or more, each stage is
     * a reduce-scatter: a lane sends its partner half of its values and
     * adds the partner's half of the other half to its own, so N values
     * cost about N + 4 shuffles, not 5 N (ncu on M1: five rounds for each of
     * 4 values were 7.5% of the step kernel's stalls). Then a butterfly on
     * the one value left; every lane ends with the warp's sum of value
     * `which` (the same bits in the lanes that share it). */
    static_assert(N >= 1 && N <= 8, "up to 8 values");
    constexpr int M = N == 1 ? 1 : N == 2 ? 2 : N <= 4 ? 4 : 8; /* N padded to a power of two */
    double w[M];
#pragma unroll
    for (int i = 0; i < M; i++) w[i] = i < N ? v[i] : 0.0;
    int which = 0;
#pragma unroll
    for (int s = 0; s < 5; s++) {
        const int off = 16 >> s, cnt = M >> s; /* values a lane holds before this stage */
        if (cnt >= 2) {
            const bool upper = lane & off;
#pragma unroll
            for (int j = 0; j < cnt / 2; j++) {
                const double send = upper ? w[j] : w[j + cnt / 2], keep = upper ? w[j + cnt / 2] : w[j];
                w[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
            }
            if (upper) which += cnt / 2;
        } else {
            w[0] += __shfl_xor_sync(0xffffffffu, w[0], off);
        }
    }
    __syncthreads();
    if ((lane & (32 / M - 1)) == 0 && which < N) part[which][warp] = w[0];
    __syncthreads();
    /* The warps' partials summed by a butterfly over each group of
     * MN_FWARPS lanes (a power of two): at every stage a lane and its partner
     * add the same two numbers, and addition commutes, so every thread ends
     * with the same bits. Four shuffle stages for 16 warps rather than 16
     * dependent adds in each thread (ncu on M1: this loop's line had 4.7% of
     * the fused forward's stalls). */
    static_assert((MN_FWARPS & (MN_FWARPS - 1)) == 0 && MN_FWARPS <= 32, "MN_FWARPS: a power of two up to 32");
#pragma unroll
    for (int i = 0; i < N; i++) {
        double t = part[i][lane & (MN_FWARPS - 1)];
#pragma unroll
        for (int off = MN_FWARPS / 2; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
        v[i] = t;
    }
}

template <int N> __device__ __forceinline__ void mn_block_sums(double *v)
{
    static_assert(N <= MN_NPARAMS, "the static partials hold MN_NPARAMS values");
    mn_block_sums_in<N>(v, mn_block_parts());
}

/* Element e of parameter p inside a padded pset. */
__device__ __forceinline__ float *mn_pset_el(const mn_pset &ps, int p, int e)
{
    const int i = p / MN_PER;
    if (MN_BIAS && p % 2 == 1) return ps.b[i] + e;
    const int ni = MN_LIN(i);
    return ps.w[i] + (e / ni) * MN_LLD(i) + mn_wcol(e / ni, e % ni);
}

/* Copy parameters: global unpadded [numel] per parameter <-> a padded pset
 * (in a cluster, the block's slice: src and dst moved by mn_cl_params; b2
 * written back by rank 0). */
__device__ void mn_pset_from(const mn_pset &dst, float *const *src)
{
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_LIN(i), no = MN_LOUT(i), pin = MN_LPIN(i), pout = MN_LPOUT(i), ld = MN_LLD(i);
        const float *w = src[i * MN_PER];
        for (int e = threadIdx.x; e < pout * ld; e += MN_FT) {
            const int o = e / ld, j = e % ld; /* j: the column; it sits at mn_wcol(o, j) (padding as it is) */
            dst.w[i][MN_WROT && j < pin ? o * ld + mn_wcol(o, j) : e] =
                (o < no && j < ni) ? w[mn_gel(i * MN_PER, o * ni + j)] : 0.0f;
        }
        if (MN_BIAS) {
            const float *b = src[i * MN_PER + 1];
            for (int o = threadIdx.x; o < pout; o += MN_FT) dst.b[i][o] = o < no ? b[o] : 0.0f;
        }
    }
}

__device__ void mn_pset_to(float *const *dst, const mn_pset &src)
{
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_LIN(i), no = MN_LOUT(i);
        float *w = dst[i * MN_PER];
        for (int e = threadIdx.x; e < no * ni; e += MN_FT) w[mn_gel(i * MN_PER, e)] = *mn_pset_el(src, i * MN_PER, e);
        if (MN_BIAS && mn_owns(i * MN_PER + 1, MN_CL_LEAD)) {
            float *b = dst[i * MN_PER + 1];
            for (int o = threadIdx.x; o < no; o += MN_FT) b[o] = src.b[i][o];
        }
    }
}

#endif /* __CUDACC_RTC__ */
