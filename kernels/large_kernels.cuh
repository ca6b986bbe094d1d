/* large_kernels.cuh: the elementwise and reduction kernels of the large-memory
 * path (kernels/engine_large.c), which does the matrix products with cuBLAS
 * and everything between them here. The semantics are those of
 * kernels/rule_kernel.cuh (SPEC.md section 2); only the split differs: there
 * one block walks a memory's steps, here every kernel spans all rows and all
 * memories of one step, and one step is a fixed sequence of launches that
 * the host captures once into a CUDA graph.
 *
 * So that one captured graph serves every step, nothing that changes from
 * step to step is a kernel argument: the step index s of the segment lives
 * in device memory (a.counter), the kernels derive the token offset s * c
 * from it, and the step's last kernel advances it. Reductions are
 * deterministic: fixed partitions summed in double, the partials combined
 * in a fixed order by the last block to finish (mn_lg_last_arrival), never
 * by floating-point atomics.
 *
 * Two parts, as in rule_kernel.cuh. The first is plain C, included by the
 * host too: the argument structs and the sizes. The second is compiled by
 * NVRTC only, after kernels/codegen.c has put in front of it the MN_* size
 * and flag constants, the expression prelude and the rule's hooks
 * (mn_hook_loss, mn_hook_loss_grad, mn_hook_act, mn_hook_act_grad,
 * mn_hook_clip_scale, mn_hook_clip_elem), and the template list
 * (kernels/engine_large.c) large_device.cuh's loads, sums and wait. */
#ifndef MN_LARGE_KERNEL_ARGS
#define MN_LARGE_KERNEL_ARGS

#ifndef __CUDACC_RTC__
#include "large_common.cuh" /* MN_LARGE_THREADS; NVRTC gets its text ahead of this one */
#endif
#define MN_LARGE_MAX_PARAMS 32 /* 4 L - 2 with glu and bias at 8 layers (param_layout.h) */
#define MN_LARGE_COL_ROWS 128  /* rows per block of the column kernel */

/* mn_large_op.flags */
#define MN_LARGE_ACT 1         /* cols: multiply by phi'(z) */
#define MN_LARGE_BIAS 2        /* cols: column sums into gb */
#define MN_LARGE_ACCUM 4       /* cols: add to gb (a later chunk of the step) */
#define MN_LARGE_ADVANCE 8     /* update, row: this is the step's last kernel: advance the counter */
#define MN_LARGE_REFRESH 16    /* params: A = W at the first step of a refresh block */
#define MN_LARGE_CONVERT_W 32  /* params: Wb = bf16(W) */
#define MN_LARGE_CONVERT_A 64  /* params: Ab = bf16(A) */
#define MN_LARGE_FROM_Q 128    /* stage, out, row: the rows come from q, not k */
#define MN_LARGE_COPY_Y 256    /* loss: y of the rows below copy_rows copied out */
#define MN_LARGE_LOAD 512      /* params: W = Wu, A = Au (and their operand copies): a kept segment's start */
#define MN_LARGE_STORE 1024    /* params: Wu = W, Au = A: a kept segment's end */
#define MN_LARGE_KEEP_GRAD 2048 /* act: out = phi'(z), not z (training, no glu); cols: in is phi'(z) */

/* Every kernel takes the segment's arguments (mn_large_kargs) from device
 * memory, written by mn_large_args_kernel at the segment's start, and what
 * one launch works on (mn_large_op) by value. So a captured step holds no
 * pointer to the caller's tensors: its inputs and outputs are reached
 * through the arguments, its weights through W and A, which are the
 * caller's or, in a segment that replays a step kept from an earlier one
 * (kernels/engine_large.c), the path's own copies of them (Wu and Au the
 * caller's, copied in and out at the ends). */

/* Fixed for a whole segment (every launch gets the same copy). Parameter
 * pointers are [M, numel] bases (M = B*H memories). */
typedef struct mn_large_kargs {
    float *W[MN_LARGE_MAX_PARAMS], *S[MN_LARGE_MAX_PARAMS], *A[MN_LARGE_MAX_PARAMS];
    float *Wu[MN_LARGE_MAX_PARAMS], *Au[MN_LARGE_MAX_PARAMS]; /* kept: the caller's W and A (Au NULL: A unused) */
    float *G[MN_LARGE_MAX_PARAMS];           /* the step's gradient */
    void *Wb[MN_LARGE_MAX_PARAMS], *Ab[MN_LARGE_MAX_PARAMS]; /* bf16 copies of weight matrices, or NULL */
    long long numel[MN_LARGE_MAX_PARAMS];
    long long slice_start[MN_LARGE_MAX_PARAMS + 1]; /* parameter p has slices [start[p], start[p+1]) */
    long long nslices;                       /* per memory */
    const float *k, *v, *theta, *eta, *alpha; /* [M,n,dk], [M,n,dv], [M,n], [M,nsteps] x 2 */
    const float *q;                          /* [M,n,dk] retrieval queries, or NULL (q = k) */
    float *y;                                /* [M,n,dv] retrieval output, or NULL */
    float *loss, *grad_norm, *clip_scale, *skipped, *step_loss, *weight_norm;
    long long memories, n, nsteps, steps_done;
    long long *counter;                      /* the segment's step index; NULL in a read (offset 0) */
    double *part;                            /* block partials of the reductions */
    unsigned *tickets;                       /* [0]: whole-grid kernels; [1 + ...]: column tiles */
    float *scale;                            /* [M, nparams]: clip scale of the step (norm-type clips) */
    int *finite;                             /* [M]: the step's gradient is finite (else skipped) */
    float *rowbuf;                           /* [2, M, dh]: hidden activations of the row forward */
    const long long *lengths;                /* ragged batches: [B] real tokens from the segment's start, or NULL */
    long long heads;                         /* H: memory m is sequence m / H's */
    double *ns_work;                         /* newton_schulz: [M, NP, ns_doubles] iterates, or NULL */
    long long ns_doubles;                    /* per parameter slot: the largest matrix's */
} mn_large_kargs;

/* What one launch works on; each kernel's comment says which fields. */
typedef struct mn_large_op {
    const float *in;       /* main fp32 input */
    const float *bias;     /* a layer's bias [M, out], or NULL */
    float *out;            /* fp32 output (or in place) */
    void *out_op;          /* the same values as a GEMM operand (bf16 or fp32), or NULL */
    float *gb;             /* bias gradient [M, out] */
    float *gate;           /* glu: a hidden layer's gate u = U h + c [M, ld, dh] (act), then du (cols), or NULL */
    const float *gate_bias; /* glu: the gate's bias c [M, dh] (act), or NULL */
    void *gate_op;         /* glu: du as GEMM operand (cols, bf16 only), or NULL */
    float *gc;             /* glu: the gate's bias gradient [M, dh] (cols) */
    long long r0, rows;    /* this launch's rows r0 .. r0 + rows - 1 of the step */
    long long step_rows;   /* rows of the whole step */
    long long copy_rows;   /* loss: step rows < copy_rows copy y out */
    long long ld;          /* rows per memory of the chunk buffers */
    int cols, layer, flags, pad_;
} mn_large_op;

#endif /* MN_LARGE_KERNEL_ARGS */

#ifdef __CUDACC_RTC__

#define MN_LG_PER (MN_BIAS ? 2 : 1)
/* the layers' W_i, b_i, then glu's U_i, c_i of the hidden layers: the
 * count and indices from param_layout.h (constexpr here) */
#define MN_LG_NP mn_param_count_glu(MN_LAYERS, MN_BIAS, MN_GLU)
#define MN_LG_GATE(i) mn_param_index(MN_LAYERS, MN_BIAS, (i), 1) /* layer i's U; its c the next */
#define MN_LG_DH (MN_DH > 0 ? MN_DH : 1) /* a divisor even for one layer */

/* ---- what a launch reads of the segment: the step, its rows, ragged batches
 * (loads, sums, the last block and the wait: large_device.cuh) ---- */

__device__ __forceinline__ long long mn_lg_step(const mn_large_kargs &a) { return a.counter ? *a.counter : 0; }

/* The model's input rows of a launch: q with MN_LARGE_FROM_Q, else k. */
__device__ __forceinline__ const float *mn_lg_rows_of(const mn_large_kargs &a, const mn_large_op &o)
{
    return (o.flags & MN_LARGE_FROM_Q) ? a.q : a.k;
}

/* Ragged batches (SPEC.md section 2): how many of the rows rows of memory
 * m's step sl are real (before its sequence's length); rows without lengths. */
__device__ __forceinline__ long long mn_lg_real_rows(const mn_large_kargs &a, long long m, long long sl, long long rows)
{
    if (!a.lengths) return rows;
    const long long t0 = sl * MN_STEP, real = a.lengths[m / a.heads];
    return t0 >= real ? 0 : (t0 + rows <= real ? rows : real - t0);
}

/* ---- the kernels ---- */

/* Parameter copies; grid (nslices, M). flags:
 *   MN_LARGE_REFRESH: at the first step of a refresh block (steps_done + s a
 *     multiple of refresh / c) the gradient point moves: A = W, Ab = bf16(W);
 *     other steps return at once. Launched only when refresh is neither 0
 *     nor c, as the step's first kernel.
 *   MN_LARGE_CONVERT_W / _A: Wb = bf16(W) / Ab = bf16(A) (bf16, segment start).
 *   MN_LARGE_LOAD: a kept segment's start: W = Wu, and A = Au where A is
 *     used, with their operand copies (Wb, Ab) where there are any.
 *   MN_LARGE_STORE: a kept segment's end: Wu = W, and Au = A where used. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_params_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y;
    long long e0, e1;
    const int p = mn_lg_slice<MN_LG_NP>(a.slice_start, a.numel, blockIdx.x, &e0, &e1);
    const long long base = m * a.numel[p];
    const bool refresh = (o.flags & MN_LARGE_REFRESH) != 0;
    const long long sl = refresh ? mn_lg_step(a) : 0;
    mn_lg_after_prior();
    if (refresh) {
        (void)sl; /* used where refresh blocks span steps */
#if MN_REFRESH > 0 && MN_REFRESH != MN_STEP
        if ((a.steps_done + sl) % (MN_REFRESH / MN_STEP) != 0) return;
        mn_lg_copy_slice(a.A[p] + base, a.Ab[p] ? (mn_lg_op *)a.Ab[p] + base : 0, a.W[p] + base, e0, e1);
#endif
        return;
    }
    if (o.flags & (MN_LARGE_LOAD | MN_LARGE_STORE)) {
        const bool load = (o.flags & MN_LARGE_LOAD) != 0;
        for (int j = 0; j < 2; j++) {
            float *own = (j ? a.A[p] : a.W[p]) + base, *user = j ? a.Au[p] : a.Wu[p];
            if (!user) continue; /* the anchor, where the gradient point is W */
            user += base;
            void *opv = j ? a.Ab[p] : a.Wb[p];
            if (load) mn_lg_copy_slice(own, opv ? (mn_lg_op *)opv + base : 0, user, e0, e1);
            else mn_lg_copy_slice(user, 0, own, e0, e1);
        }
        return;
    }
    const bool from_a = (o.flags & MN_LARGE_CONVERT_A) != 0;
    const float *src = (from_a ? a.A[p] : a.W[p]) + base;
    void *dst = from_a ? a.Ab[p] : a.Wb[p];
    if (!dst) return; /* a bias: added in fp32, never a GEMM operand */
    mn_lg_copy_slice(0, (mn_lg_op *)dst + base, src, e0, e1);
}

/* The segment's arguments into device memory (*dst), where every other
 * kernel reads them: one block, a word a thread at a time.
 * __grid_constant__: read in place, never copied per thread. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_args_kernel(const __grid_constant__ mn_large_kargs a,
    mn_large_kargs *dst)
{
    const unsigned *src = (const unsigned *)&a;
    unsigned *out = (unsigned *)dst;
    for (unsigned i = threadIdx.x; i < sizeof(mn_large_kargs) / sizeof(unsigned); i += blockDim.x) out[i] = src[i];
}

/* GEMM operand rows: out_op[m, r, :] = x[m, t0 + r0 + r, :] for r < rows,
 * t0 = s * c (x: k, or q with MN_LARGE_FROM_Q). A copy, because a captured GEMM reads fixed
 * addresses while the step's rows move; in bf16 it is also the rounding.
 * Padding rows (ragged batches; step_rows: the step's) are zeros, so that
 * what they hold (NaN too) never reaches a product: their dL/dy is 0, and
 * 0 times NaN would not be. Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_stage_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y, sl = mn_lg_step(a), t = sl * MN_STEP + o.r0;
    const long long real = mn_lg_real_rows(a, m, sl, o.step_rows) - o.r0; /* real rows of this launch's */
    const float *src = mn_lg_rows_of(a, o) + (m * a.n + t) * MN_DK;
    mn_lg_op *dst = (mn_lg_op *)o.out_op + m * o.ld * MN_DK;
    mn_lg_after_prior();
    if (MN_DK % 4 == 0 && mn_lg_al16(src) && mn_lg_op_al(dst)) {
        MN_LG_GRID_STRIDE(q, o.rows * MN_DK / 4)
        {
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (q * 4 / MN_DK < real) mn_lg_unpack(mn_lg_ld4(src + q * 4), v);
            mn_lg_st_op4(dst + q * 4, v);
        }
        return;
    }
    MN_LG_GRID_STRIDE(e, o.rows * MN_DK) dst[e] = mn_lg_to_op(e / MN_DK < real ? src[e] : 0.0f);
}

/* A hidden layer after its product: z = out + bias in place (kept for the
 * backward), out_op = phi(z) (the next product's operand). With
 * MN_LARGE_KEEP_GRAD (a training forward without glu) phi'(z) takes z's
 * place: the column kernel multiplies by it where it evaluated phi' again.
 * With glu, gate holds the gate's product: u = gate + gate_bias in place
 * (kept for the backward) and out_op = phi(z) u, in that order of rounding
 * as rule_kernel.cuh's mn_forward. Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_act_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    mn_lg_after_prior();
    const mn_large_kargs &a = *ap;
    (void)a;
    const long long m = blockIdx.y;
    float *z = o.out + m * o.ld * MN_LG_DH;
    mn_lg_op *h = (mn_lg_op *)o.out_op + m * o.ld * MN_LG_DH;
    const float *b = o.bias ? o.bias + m * MN_LG_DH : 0;
    float *u = o.gate ? o.gate + m * o.ld * MN_LG_DH : 0;
    const float *cb = o.gate_bias ? o.gate_bias + m * MN_LG_DH : 0;
    const bool keep_grad = (o.flags & MN_LARGE_KEEP_GRAD) != 0; /* never with a gate */
    if (MN_LG_DH % 4 == 0 && mn_lg_al16(z) && mn_lg_op_al(h) && (!b || mn_lg_al16(b)) && (!u || mn_lg_al16(u)) &&
        (!cb || mn_lg_al16(cb))) {
        MN_LG_GRID_STRIDE(q, o.rows * MN_DH / 4)
        {
            const long long e = q * 4, c = e % MN_LG_DH;
            float v[4], hv[4];
            mn_lg_unpack(mn_lg_ld4(z + e), v);
            if (b) mn_lg_add4(v, b + c);
            if (keep_grad) {
                /* phi and phi' share their terms: phi' here costs little,
                 * where the column kernel would evaluate it again */
                float dv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    hv[i] = mn_hook_act(v[i]);
                    dv[i] = mn_hook_act_grad(v[i]);
                }
                mn_lg_st4(z + e, dv);
            } else {
                if (b) mn_lg_st4(z + e, v);
#pragma unroll
                for (int i = 0; i < 4; i++) hv[i] = mn_hook_act(v[i]);
            }
            if (u) {
                float g[4];
                mn_lg_unpack(mn_lg_ld4(u + e), g);
                if (cb) {
                    mn_lg_add4(g, cb + c);
                    mn_lg_st4(u + e, g);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) hv[i] *= g[i];
            }
            mn_lg_st_op4(h + e, hv);
        }
        return;
    }
    MN_LG_GRID_STRIDE(e, o.rows * MN_DH)
    {
        float v = z[e];
        if (b) v += b[e % MN_LG_DH];
        float hv = mn_hook_act(v);
        z[e] = keep_grad ? mn_hook_act_grad(v) : v;
        if (u) {
            float g = u[e];
            if (cb) g += cb[e % MN_LG_DH];
            u[e] = g;
            hv *= g;
        }
        h[e] = mn_lg_to_op(hv);
    }
}

/* The loss of the step's rows, one warp per row; grid (ceil(rows/8), M).
 * in: the last layer's product; y = in + bias (+ k if residual). Writes
 * loss[t] = R sum_j f, out = dL/dy = theta_t (/ rows for mean) R f'(y)
 * (fp32: the bias column sums), out_op = the same as GEMM operand (bf16
 * only), and y (with MN_LARGE_COPY_Y) for step rows < copy_rows: retrieval at W^(s)
 * is this forward when q = k and the gradient point is W^(s). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_loss_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y, r = (long long)blockIdx.x * MN_LG_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const bool in_rows = r < o.rows; /* the whole warp */
    const long long sl = mn_lg_step(a), t = sl * MN_STEP + o.r0 + (in_rows ? r : 0);
    const long long grows = mn_lg_real_rows(a, m, sl, o.step_rows);
    const float *vr = a.v + (m * a.n + t) * MN_DV;
    /* v of the lane's first eight columns and theta: inputs, so loaded
     * before the wait (mn_lg_after_prior), in flight while it waits */
    float v0[8];
    float theta_t = 0.0f;
    if (in_rows && o.r0 + r < grows) {
        theta_t = a.theta[m * a.n + t];
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (lane + 32 * i < MN_DV) v0[i] = vr[lane + 32 * i];
    }
    mn_lg_after_prior();
    if (!in_rows) return;
    const float *yr = o.in + (m * o.ld + r) * MN_DV;
    const float *xr = a.k + (m * a.n + t) * MN_DK;
    const float *b = o.bias ? o.bias + m * MN_DV : 0;
    float *dy = o.out + (m * o.ld + r) * MN_DV;
    mn_lg_op *dyo = o.out_op ? (mn_lg_op *)o.out_op + (m * o.ld + r) * MN_DV : 0;
    float *yo = ((o.flags & MN_LARGE_COPY_Y) && o.r0 + r < o.copy_rows) ? a.y + (m * a.n + t) * MN_DV : 0;
    if (o.r0 + r >= grows) { /* padding: no gradient, loss 0, y 0 */
        for (int j = lane; j < MN_DV; j += 32) {
            dy[j] = 0.0f;
            if (dyo) dyo[j] = mn_lg_to_op(0.0f);
            if (yo) yo[j] = 0.0f;
        }
        if (lane == 0) a.loss[m * a.n + t] = 0.0f;
        return;
    }
    const double R = MN_FEATURE_SCALE;
    const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
    const float wt = (float)((double)theta_t * tscale);
    double acc = 0.0;
    /* a lane's columns j, j + 32, ... eight at a time: their loads all
     * issue before the first store (which the compiler may not move them
     * past); a row of 256 is one round */
    for (int j0 = lane; j0 < MN_DV; j0 += 8 * 32) {
        float yy[8], vv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = j0 + 32 * i;
            if (j < MN_DV) {
                yy[i] = yr[j];
                if (b) yy[i] += b[j];
                if (MN_RESIDUAL) yy[i] += xr[j];
                vv[i] = j0 == lane ? v0[i] : vr[j];
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = j0 + 32 * i;
            if (j < MN_DV) {
                const float rr = yy[i] - vv[i];
                acc += mn_hook_loss(yy[i], vv[i], rr);
                const float g = (float)((double)wt * R * (double)mn_hook_loss_grad(yy[i], vv[i], rr));
                dy[j] = g;
                if (dyo) dyo[j] = mn_lg_to_op(g);
                if (yo) yo[j] = yy[i];
            }
        }
    }
    acc = mn_lg_warp_sum(acc);
    if (lane == 0) a.loss[m * a.n + t] = (float)(R * acc);
}

/* dL/dz of one layer, [M, ld, cols] in out (fp32, in place); block 32 x 8
 * over 32 columns and MN_LARGE_COL_ROWS rows, grid (ceil(cols/32),
 * ceil(rows/COL_ROWS), M). flags: MN_LARGE_ACT: out *= phi'(in) (in = z of
 * the layer: out was dL/dh; with MN_LARGE_KEEP_GRAD in is phi'(z) itself);
 * out_op (if not NULL) = out as GEMM operand, stored there only (bf16: the
 * products read the operand, nothing reads out again, and its store was a
 * third of the launch's bytes);
 * MN_LARGE_BIAS: gb (+)= column sums of out over the rows, in double per
 * block, the blocks of a column tile combined in order by the last of them.
 * glu (gate not NULL, with MN_LARGE_ACT): h = phi(z) u, so first
 * du = dh phi(z) replaces u in gate (gate_op: its operand copy) and dh *= u,
 * as rule_kernel.cuh's mn_backward (with gate_op there only, as out_op);
 * MN_LARGE_BIAS also sums du into gc (its partials after dz's in part). */
#define MN_LG_COL_BATCH (MN_LARGE_COL_ROWS / 8) /* a thread's rows of a column block */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_cols_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    mn_lg_after_prior();
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.z, rb = blockIdx.y, nrb = gridDim.y;
    const int tx = threadIdx.x, ty = threadIdx.y, cols = o.cols;
    const int c = blockIdx.x * 32 + tx;
    const long long r_end = (rb + 1) * MN_LARGE_COL_ROWS < o.rows ? (rb + 1) * MN_LARGE_COL_ROWS : o.rows;
    float *d = o.out + m * o.ld * cols;
    const float *z = o.in ? o.in + m * o.ld * cols : 0;
    mn_lg_op *dop = o.out_op ? (mn_lg_op *)o.out_op + m * o.ld * cols : 0;
    float *u = o.gate ? o.gate + m * o.ld * cols : 0;
    mn_lg_op *uop = o.gate_op ? (mn_lg_op *)o.gate_op + m * o.ld * cols : 0;
    double acc = 0.0, gacc = 0.0;
    if (c < cols) {
        /* all of the thread's rows at once (MN_LG_COL_BATCH), loads first:
         * the stores would otherwise hold each load back, and four rows a
         * round kept too few bytes in flight (L1 tf32, Nsight Compute: 25.6
         * -> 24.0 us and 13.0 -> 11.8 us a launch). The sums stay in row
         * order, so the bits do not change. */
        for (long long r0 = rb * MN_LARGE_COL_ROWS + ty; r0 < r_end; r0 += MN_LG_COL_BATCH * 8) {
            float dv[MN_LG_COL_BATCH], zv[MN_LG_COL_BATCH], uv[MN_LG_COL_BATCH];
#pragma unroll
            for (int k = 0; k < MN_LG_COL_BATCH; k++) {
                const long long r = r0 + 8 * k, i = r * cols + c;
                if (r < r_end) {
                    dv[k] = d[i];
                    if (z) zv[k] = z[i];
                    if (u) uv[k] = u[i];
                }
            }
#pragma unroll
            for (int k = 0; k < MN_LG_COL_BATCH; k++) {
                const long long r = r0 + 8 * k, i = r * cols + c;
                if (r >= r_end) break;
                float v = dv[k];
                if (u) {
                    const float du = v * mn_hook_act(zv[k]);
                    if (uop) uop[i] = mn_lg_to_op(du);
                    else u[i] = du;
                    gacc += du;
                    v *= uv[k];
                }
                if (o.flags & MN_LARGE_ACT) {
                    v *= (o.flags & MN_LARGE_KEEP_GRAD) ? zv[k] : mn_hook_act_grad(zv[k]);
                    if (!dop) d[i] = v;
                }
                if (dop) dop[i] = mn_lg_to_op(v);
                acc += v;
            }
        }
    }
    if (!(o.flags & MN_LARGE_BIAS)) return; /* the same for the whole grid */
    __shared__ double part[8][32], gpart[8][32];
    part[ty][tx] = acc;
    gpart[ty][tx] = gacc;
    __syncthreads();
    double *du_part = a.part + a.memories * nrb * cols; /* glu: du's partials after dz's */
    if (ty == 0 && c < cols) {
        double s = 0.0, gs = 0.0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            s += part[i][tx];
            gs += gpart[i][tx];
        }
        a.part[(m * nrb + rb) * cols + c] = s;
        if (u) du_part[(m * nrb + rb) * cols + c] = gs;
    }
    if (!mn_lg_last_arrival(&a.tickets[1 + m * gridDim.x + blockIdx.x], (unsigned)nrb)) return;
    if (ty == 0 && c < cols) {
        const double s = mn_lg_strided_sum<true>(a.part + m * nrb * cols + c, 0, nrb * cols, cols);
        float *gb = o.gb + m * cols + c;
        *gb = (o.flags & MN_LARGE_ACCUM) ? *gb + (float)s : (float)s;
        if (u) {
            const double gs = mn_lg_strided_sum<true>(du_part + m * nrb * cols + c, 0, nrb * cols, cols);
            float *gc = o.gc + m * cols + c;
            *gc = (o.flags & MN_LARGE_ACCUM) ? *gc + (float)gs : (float)gs;
        }
    }
}

/* Sum of squares of the step's gradient, per parameter, grid (nslices, M);
 * the last block finishes the step's scalars, one warp per memory: |G|, the
 * non-finite guard (finite[m]), the clip scales (scale[m, p]), and the
 * outputs grad_norm, skipped, clip_scale and step_loss (the mean of the
 * step's loss rows). step_rows: rows of the step. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_norm_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y, sl = mn_lg_step(a);
    long long e0, e1;
    const int p = mn_lg_slice<MN_LG_NP>(a.slice_start, a.numel, blockIdx.x, &e0, &e1);
    const float *g = a.G[p] + m * a.numel[p];
    mn_lg_after_prior();
    const double acc = mn_lg_block_sum(mn_lg_thread_sumsq(g, e0, e1));
    if (threadIdx.x == 0) a.part[m * a.nslices + blockIdx.x] = acc;
    if (!mn_lg_last_arrival(&a.tickets[0], gridDim.x * gridDim.y)) return;

    const int lane = threadIdx.x & 31;
    for (long long mm = threadIdx.x >> 5; mm < a.memories; mm += MN_LG_WARPS) {
        const double *pp = a.part + mm * a.nslices;
        /* the lane's first partial of every parameter loaded together (a
         * parameter of up to 32 slices has no more): one round of loads
         * where a loop per parameter took one each; the sums as before
         * (with the loss rows below, L1: 12.0 -> 11.0 us a launch) */
        double sq[MN_LG_NP], first[MN_LG_NP];
#pragma unroll
        for (int q = 0; q < MN_LG_NP; q++) {
            const long long i = a.slice_start[q] + lane;
            first[q] = i < a.slice_start[q + 1] ? __ldcg(pp + i) : 0.0;
        }
#pragma unroll
        for (int q = 0; q < MN_LG_NP; q++) {
            const long long i = a.slice_start[q] + lane;
            const double s = i < a.slice_start[q + 1]
                ? mn_lg_strided_sum<true>(pp, i + 32, a.slice_start[q + 1], 32, 0.0 + first[q]) : 0.0;
            sq[q] = mn_lg_warp_sum(s);
        }
        mn_step_control ctl = mn_step_control_of<MN_LG_NP>(sq);
        if (ctl.finite) {
            double sc[MN_LG_NP];
            ctl.clip_scale = mn_clip_scales<MN_LG_NP>(sq, ctl.gnorm, sc);
#pragma unroll
            for (int q = 0; q < MN_LG_NP; q++)
                if (lane == 0) a.scale[mm * MN_LG_NP + q] = (float)sc[q];
        }
        const float *lrow = a.loss + mm * a.n + sl * MN_STEP;
        const long long grows = mn_lg_real_rows(a, mm, sl, o.step_rows);
        /* 32 loads in flight: a step of 1024 rows is one round a lane */
        const double lsum = mn_lg_warp_sum(mn_lg_strided_sum<false, 32>(lrow, lane, grows, 32));
        if (lane == 0) {
            const long long i = mm * a.nsteps + sl;
            if (grows == 0) {
                /* a step that starts in the padding changes nothing: the
                 * update takes it as skipped, the outputs say it was not */
                mn_padding_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, i);
                a.finite[mm] = 0;
            } else {
                mn_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, i, lsum, grows, ctl);
                a.finite[mm] = ctl.finite ? 1 : 0;
            }
        }
    }
}

/* newton_schulz (SPEC.md section 2's order: the clip, each matrix's
 * iteration, then momentum and decay in the update kernel), grid (NP, M),
 * one block per parameter of a memory: where the step runs (finite[m]), G =
 * clip(G), then a weight matrix's G orthogonalised in place in double
 * (mn_newton_schulz, as the other paths and the CPU), its iterates in the
 * parameter's slot of ns_work. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_ns_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    mn_lg_after_prior();
    const mn_large_kargs &a = *ap;
    (void)o;
#if MN_PRECOND
    const long long m = blockIdx.y;
    const int p = blockIdx.x;
    if (!a.finite[m]) return; /* the whole block */
    float *G = a.G[p] + m * a.numel[p];
    const float fs = MN_CLIP_MODE == 1 ? a.scale[m * MN_LG_NP + p] : 1.0f;
    for (long long e = threadIdx.x; e < a.numel[p]; e += MN_LARGE_THREADS) G[e] = mn_clip_elem(G[e], fs);
    __syncthreads();
    if (!mn_param_is_bias_glu(MN_LAYERS, MN_BIAS, p)) {
        const int layer = mn_param_layer_glu(MN_LAYERS, MN_BIAS, p);
        mn_newton_schulz(G, (int)mn_layer_out(layer, MN_LAYERS, MN_DV, MN_DH), (int)mn_layer_in(layer, MN_DK, MN_DH),
                         a.ns_work + (m * MN_LG_NP + p) * a.ns_doubles);
    }
#else
    (void)a;
#endif
}

/* Clip, momentum, decay, grid (nslices, M): where finite[m],
 * S = eta_s S - clip(G), W = (1 - alpha_s) W + S (and Wb = bf16(W)); else W
 * and S stay. Sums W^2 per block; the last block writes weight_norm, one
 * warp per memory, and with MN_LARGE_ADVANCE moves the counter to the next
 * step. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_update_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y, sl = mn_lg_step(a);
    long long e0, e1;
    const int p = mn_lg_slice<MN_LG_NP>(a.slice_start, a.numel, blockIdx.x, &e0, &e1);
    const long long base = m * a.numel[p];
    float *W = a.W[p] + base, *Sm = a.S[p] + base;
    const float *G = a.G[p] + base;
    mn_lg_op *Wb = a.Wb[p] ? (mn_lg_op *)a.Wb[p] + base : 0;
    const float e_s = a.eta[m * a.nsteps + sl], keep = 1.0f - a.alpha[m * a.nsteps + sl]; /* inputs */
    mn_lg_after_prior();
    double wsq = 0.0;
    if (a.finite[m]) {
        const float fs = MN_CLIP_MODE == 1 ? a.scale[m * MN_LG_NP + p] : 1.0f;
        /* four of the thread's elements at a time, loads first, the sum in order */
        for (long long e0t = e0 + threadIdx.x; e0t < e1; e0t += 4 * MN_LARGE_THREADS) {
            float gv[4], sv[4], wv[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const long long e = e0t + k * MN_LARGE_THREADS;
                if (e < e1) {
                    gv[k] = G[e];
                    sv[k] = Sm[e];
                    wv[k] = W[e];
                }
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const long long e = e0t + k * MN_LARGE_THREADS;
                if (e >= e1) break;
                /* newton_schulz: the ns kernel has clipped and orthogonalised G */
                const float w = MN_PRECOND ? mn_momentum_elem(gv[k], e_s, keep, &sv[k], wv[k])
                                           : mn_update_elem(gv[k], fs, e_s, keep, &sv[k], wv[k]);
                Sm[e] = sv[k];
                W[e] = w;
                if (Wb) Wb[e] = mn_lg_to_op(w);
                wsq += (double)w * w;
            }
        }
    } else {
        wsq = mn_lg_thread_sumsq(W, e0, e1);
    }
    wsq = mn_lg_block_sum(wsq);
    if (threadIdx.x == 0) a.part[m * a.nslices + blockIdx.x] = wsq;
    if (!mn_lg_last_arrival(&a.tickets[0], gridDim.x * gridDim.y)) return;

    const int lane = threadIdx.x & 31;
    for (long long mm = threadIdx.x >> 5; mm < a.memories; mm += MN_LG_WARPS) {
        const double s = mn_lg_warp_sum(mn_lg_strided_sum<true>(a.part + mm * a.nslices, lane, a.nslices, 32));
        if (lane == 0) a.weight_norm[mm * a.nsteps + sl] = (float)sqrt(s);
    }
    if (o.flags & MN_LARGE_ADVANCE) {
        __syncthreads();
        if (threadIdx.x == 0) *a.counter = sl + 1;
    }
}

/* Retrieval rows: y[m, t0 + r0 + r] = in + bias (+ x if residual) for
 * r < rows; in: the last layer's product of those rows, x: their inputs
 * (k, or q with MN_LARGE_FROM_Q).
 * Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_out_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const long long m = blockIdx.y, sl = mn_lg_step(a), t = sl * MN_STEP + o.r0;
    const long long real = mn_lg_real_rows(a, m, sl, o.step_rows) - o.r0; /* y 0 from row real on */
    const float *in = o.in + m * o.ld * MN_DV;
    const float *b = o.bias ? o.bias + m * MN_DV : 0;
    const float *x = mn_lg_rows_of(a, o) + (m * a.n + t) * MN_DK;
    float *y = a.y + (m * a.n + t) * MN_DV;
    mn_lg_after_prior();
    if (MN_DV % 4 == 0 && mn_lg_al16(in) && mn_lg_al16(y) && (!b || mn_lg_al16(b)) && (!MN_RESIDUAL || mn_lg_al16(x))) {
        MN_LG_GRID_STRIDE(q, o.rows * MN_DV / 4)
        {
            const long long e = q * 4;
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (e / MN_DV < real) {
                mn_lg_unpack(mn_lg_ld4(in + e), v);
                if (b) mn_lg_add4(v, b + e % MN_DV);
                if (MN_RESIDUAL) mn_lg_add4(v, x + e);
            }
            mn_lg_st4(y + e, v);
        }
        return;
    }
    MN_LG_GRID_STRIDE(e, o.rows * MN_DV)
    {
        float v = in[e];
        if (b) v += b[e % MN_DV];
        if (MN_RESIDUAL) v += x[e];
        y[e] = e / MN_DV < real ? v : 0.0f;
    }
}

/* One layer of the forward of one row per memory at W (after the update):
 * the last row of a step, retrieve = after, sees W^(s+1). One warp per
 * output unit (with glu, a hidden unit's gate U_j in + c_j too), operands
 * rounded as the precision rounds them; grid
 * (ceil(out/8), M). Layer 0 reads row t = s c + step_rows - 1 of x (q or
 * k); hidden layers go through rowbuf; the last layer writes y[m, t]. With
 * MN_LARGE_ADVANCE (on the last layer) the last block moves the counter. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_large_row_kernel(const mn_large_kargs *__restrict__ ap,
    const mn_large_op o)
{
    const mn_large_kargs &a = *ap;
    const int layer = o.layer, lane = threadIdx.x & 31;
    const bool last = layer == MN_LAYERS - 1;
    const int ni = (int)mn_layer_in(layer, MN_DK, MN_DH), no = (int)mn_layer_out(layer, MN_LAYERS, MN_DV, MN_DH);
    const long long m = blockIdx.y, j = (long long)blockIdx.x * MN_LG_WARPS + (threadIdx.x >> 5);
    const long long sl = mn_lg_step(a), t = sl * MN_STEP + o.step_rows - 1;
    const float *x = mn_lg_rows_of(a, o) + (m * a.n + t) * MN_DK;
    const float *in = layer == 0 ? x : a.rowbuf + ((layer - 1) & 1) * a.memories * MN_LG_DH + m * MN_LG_DH;
    mn_lg_after_prior();
    const bool gated = MN_GLU && !last;
    if (j < no) {
        const float *w = a.W[layer * MN_LG_PER] + (m * no + j) * ni;
        float acc = mn_lg_warp_sumf(mn_lg_lane_dot(in, w, ni, lane)), gacc = 0.0f;
        if (gated) {
            const float *ug = a.W[MN_LG_GATE(layer)] + (m * no + j) * ni;
            gacc = mn_lg_warp_sumf(mn_lg_lane_dot(in, ug, ni, lane));
        }
        if (lane == 0) {
            if (MN_BIAS) acc += a.W[layer * MN_LG_PER + 1][m * no + j];
            if (last) {
                if (MN_RESIDUAL) acc += x[j];
                /* a padding last token keeps y = 0 */
                a.y[(m * a.n + t) * MN_DV + j] = mn_lg_real_rows(a, m, sl, o.step_rows) == o.step_rows ? acc : 0.0f;
            } else {
                float h = mn_hook_act(acc);
                if (gated) {
                    if (MN_BIAS) gacc += a.W[MN_LG_GATE(layer) + 1][m * no + j];
                    h *= gacc;
                }
                a.rowbuf[(layer & 1) * a.memories * MN_LG_DH + m * MN_LG_DH + j] = h;
            }
        }
    }
    if (o.flags & MN_LARGE_ADVANCE) {
        if (!mn_lg_last_arrival(&a.tickets[0], gridDim.x * gridDim.y)) return;
        if (threadIdx.x == 0) *a.counter = sl + 1;
    }
}

#endif /* __CUDACC_RTC__ */
