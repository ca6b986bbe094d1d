/* rule_kernel.cuh: the kernel template of the rule engine on the GPU (SPEC.md
 * section 2, computed exactly as model/engine_cpu.c does it). One persistent
 * thread block per memory walks the steps of a segment; W, S and the anchor
 * stay in the state's global tensors, the activations of a chunk of the
 * step's rows and the step's gradients live in a per-block slice of a global
 * workspace. Phases are separated by __syncthreads; each thread owns output
 * elements of the small products (fp32 accumulate, operands rounded by
 * mn_round for tf32/bf16) and norms are block reductions in double.
 *
 * Two parts. The first is plain C and is also included by the host
 * (kernels/engine_cuda.c), so the argument struct and the workspace layout
 * have one definition. The second is compiled by NVRTC only, after the
 * code generator (kernels/codegen.c) has put in front of it:
 *   the MN_* size and flag constants (MN_LAYERS, MN_DK, MN_STEP, ...),
 *   the expression prelude (mn_f_*), and the hooks taken from the rule's IR:
 *   mn_hook_loss(y, v, r), mn_hook_loss_grad(y, v, r), mn_hook_act(z),
 *   mn_hook_act_grad(z), mn_hook_clip_scale(n), mn_hook_clip_elem(g).
 * A faster path may replace the step body and keep the hooks as they are. */
#ifndef MN_RULE_KERNEL_ARGS
#define MN_RULE_KERNEL_ARGS

#define MN_RULE_MAX_LAYERS 8
#define MN_RULE_MAX_PARAMS 32 /* 4 L - 2 with glu and bias at 8 layers (param_layout.h) */
#ifndef MN_RULE_THREADS
#define MN_RULE_THREADS 256 /* a multiple of 32 (block sums go by warps) */
#endif
/* Rows of a step processed at once: bounds the workspace for long steps. */
#define MN_RULE_CHUNK_MAX 64

#ifdef __CUDACC_RTC__
#define MN_SHARED_FN __device__ __forceinline__
#else
#define MN_SHARED_FN static inline
#endif

/* Passed by value to both kernels. Parameter pointers are the [B,H,...]
 * bases of the state's tensors; memory m's slice starts m * numel later. */
typedef struct mn_rule_kargs {
    float *W[MN_RULE_MAX_PARAMS], *S[MN_RULE_MAX_PARAMS], *A[MN_RULE_MAX_PARAMS];
    const float *k, *v, *q;                /* q NULL: q = k (read: q is the input) */
    const float *theta, *eta, *alpha;      /* [B,H,n], [B,H,S], [B,H,S] */
    float *y;                              /* [B,H,n,dv] or NULL */
    float *loss, *grad_norm, *clip_scale, *skipped, *step_loss, *weight_norm;
    float *work;                           /* workspace, work_floats per block */
    long long work_floats;
    double *ns_work;                       /* newton_schulz: ns_doubles per block, else NULL */
    long long ns_doubles;
    const long long *lengths;              /* ragged batches (SPEC v2): [B] real tokens from the segment's
                                            * start, or NULL (every token real); memory m is sequence m / heads */
    long long heads;
    const float *ln_g, *ln_b;              /* out_norm's gain and shift [B,H,dv], else NULL */
    long long n, nsteps, steps_done;
} mn_rule_kargs;

/* Offsets (in floats) within one block's workspace slice. */
typedef struct mn_rule_layout {
    long long z[MN_RULE_MAX_LAYERS], h[MN_RULE_MAX_LAYERS]; /* hidden layers: pre-activation, phi(z) */
    long long u[MN_RULE_MAX_LAYERS];                        /* glu: the gate U h + c (h = phi(z) u) */
    long long y;                                            /* model output of the chunk */
    long long da, db;                                       /* backward ping-pong; loss terms */
    long long g[MN_RULE_MAX_PARAMS];                        /* the step's gradient per parameter */
    long long nhat, ns;                                     /* out_norm: the normalised rows and their 1/rms */
    long long total;
} mn_rule_layout;

/* Parameter sizes: model/param_layout.h (its text precedes this one in
 * generated source; the host includes it). */
#ifndef __CUDACC_RTC__
#include "../model/param_layout.h"
#endif

/* newton_schulz's doubles per block: two iterates of the largest matrix and
 * two square products of its smaller side (model/precond.c's X, A, B).
 * glu's U_i have W_i's shapes, so the layers' weights bound them too. */
MN_SHARED_FN long long mn_rule_ns_doubles(int layers, int bias, long long dk, long long dv, long long dh)
{
    long long most = 0;
    for (int p = 0; p < mn_param_count(layers, bias); p++) {
        if (mn_param_is_bias(bias, p)) continue;
        int layer = mn_param_layer(bias, p);
        long long rows = mn_layer_out(layer, layers, dv, dh), cols = mn_layer_in(layer, dk, dh);
        long long small = rows < cols ? rows : cols, need = 2 * rows * cols + 2 * small * small;
        if (need > most) most = need;
    }
    return most;
}

MN_SHARED_FN long long mn_rule_chunk_rows(long long step)
{
    return step < MN_RULE_CHUNK_MAX ? step : MN_RULE_CHUNK_MAX;
}

MN_SHARED_FN void mn_rule_layout_init(mn_rule_layout *lo, int layers, int bias, int glu, long long dk,
                                      long long dv, long long dh, long long rows)
{
    long long off = 0, wide = dk > dv ? dk : dv;
    if (layers > 1 && dh > wide) wide = dh;
    for (int i = 0; i < MN_RULE_MAX_LAYERS; i++) lo->z[i] = lo->h[i] = lo->u[i] = 0;
    for (int i = 0; i + 1 < layers; i++) {
        lo->z[i] = off;
        off += rows * dh;
        lo->h[i] = off;
        off += rows * dh;
        if (glu) {
            lo->u[i] = off;
            off += rows * dh;
        }
    }
    lo->y = off;
    off += rows * dv;
    lo->da = off;
    off += rows * wide;
    lo->db = off;
    off += rows * wide;
    int np = mn_param_count_glu(layers, bias, glu);
    for (int p = 0; p < MN_RULE_MAX_PARAMS; p++) lo->g[p] = 0;
    for (int p = 0; p < np; p++) {
        lo->g[p] = off;
        off += mn_param_numel_glu(layers, bias, dk, dv, dh, p);
    }
    lo->nhat = lo->ns = 0;
    lo->total = (off + 3) & ~3LL; /* every block's slice 16-byte aligned */
}

/* out_norm's part of the workspace, after the rest: what the backward
 * through the norm reads (the CPU's nhat and s, model/mlp_cpu.c). */
MN_SHARED_FN void mn_rule_layout_out_norm(mn_rule_layout *lo, long long dv, long long rows)
{
    lo->nhat = lo->total;
    lo->ns = lo->nhat + rows * dv;
    lo->total = (lo->ns + rows + 3) & ~3LL;
}

#endif /* MN_RULE_KERNEL_ARGS */

#ifdef __CUDACC_RTC__

#define MN_PER (MN_BIAS ? 2 : 1)
/* glu's U_i, c_i of the hidden layers follow the layers' W_i, b_i: the
 * count and indices from param_layout.h (constexpr here) */
#define MN_NPARAMS mn_param_count_glu(MN_LAYERS, MN_BIAS, MN_GLU)
#define MN_GATE(i) mn_param_index(MN_LAYERS, MN_BIAS, (i), 1) /* hidden layer i's U (c the next) */
#define MN_IN(i) mn_layer_in((i), MN_DK, MN_DH)
#define MN_OUT(i) mn_layer_out((i), MN_LAYERS, MN_DV, MN_DH)
#define MN_ROWS (MN_STEP < MN_RULE_CHUNK_MAX ? MN_STEP : MN_RULE_CHUNK_MAX)

/* Two floats to bf16x2 (lo in the low half), round to nearest even, NaN
 * kept NaN: what mn_round does in bf16 mode, in one instruction (sm_80 on;
 * the fused kernels' bf16 operands, and mn_round2 below). */
#if !defined(MN_EMULATED) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned mn_bf16x2(float lo, float hi)
{
    unsigned u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
}
#endif

/* Operand rounding of the precision mode (what tensor cores compute with). */
#if MN_PREC == 1
__device__ __forceinline__ float mn_round(float x)
{
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return __uint_as_float(u);
}
#elif MN_PREC == 2 && !defined(MN_EMULATED) && __CUDA_ARCH__ >= 800
/* bfloat16, round to nearest even, by the instruction sm_80 has: one cvt
 * and a shift where the integer form below is seven instructions (the
 * fused kernels' row layers round every operand). A NaN comes out as the
 * canonical NaN rather than x's payload: still NaN, as everywhere else. */
__device__ __forceinline__ float mn_round(float x)
{
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
    return __uint_as_float((unsigned)b << 16);
}
#elif MN_PREC == 2
/* bfloat16, round to nearest even; NaN stays NaN (the carry could make Inf). */
__device__ __forceinline__ float mn_round(float x)
{
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}
#else
__device__ __forceinline__ float mn_round(float x) { return x; }
#endif

/* a and b rounded as mn_round rounds them; in bf16 by one cvt for the pair */
__device__ __forceinline__ void mn_round2(float &a, float &b)
{
#if MN_PREC == 2 && !defined(MN_EMULATED) && __CUDA_ARCH__ >= 800
    const unsigned u = mn_bf16x2(a, b);
    a = __uint_as_float(u << 16), b = __uint_as_float(u & 0xffff0000u);
#else
    a = mn_round(a), b = mn_round(b);
#endif
}

/* This block's workspace slices. */
struct mn_ws {
    float *z[MN_LAYERS], *h[MN_LAYERS], *u[MN_LAYERS], *y, *da, *db, *g[MN_NPARAMS];
    float *nhat, *ns;          /* out_norm, else unset */
    const float *ln_g, *ln_b;  /* out_norm: this memory's gain and shift [dv] */
};

/* Memory m's slices of its block's workspace (base), and with out_norm its
 * gain and shift of ln_g, ln_b ([B,H,dv]; unread without out_norm). */
__device__ __forceinline__ void mn_ws_init(mn_ws *ws, float *base, const float *ln_g, const float *ln_b, long long m)
{
    mn_rule_layout lo;
    mn_rule_layout_init(&lo, MN_LAYERS, MN_BIAS, MN_GLU, MN_DK, MN_DV, MN_DH, MN_ROWS);
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        ws->z[i] = base + lo.z[i];
        ws->h[i] = base + lo.h[i];
        ws->u[i] = base + lo.u[i];
    }
    ws->y = base + lo.y;
    ws->da = base + lo.da;
    ws->db = base + lo.db;
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) ws->g[p] = base + lo.g[p];
#if MN_OUT_NORM
    mn_rule_layout_out_norm(&lo, MN_DV, MN_ROWS);
    ws->nhat = base + lo.nhat;
    ws->ns = base + lo.ns;
    ws->ln_g = ln_g + m * MN_DV;
    ws->ln_b = ln_b + m * MN_DV;
#else
    (void)ln_g, (void)ln_b, (void)m;
#endif
}

/* Sum of v over the block, returned to every thread. Starts with a barrier,
 * so back-to-back calls never overwrite partials still being read. */
__device__ double mn_block_sum(double v)
{
    __shared__ double part[MN_RULE_THREADS / 32];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double t = lane < MN_RULE_THREADS / 32 ? part[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) t += __shfl_down_sync(0xffffffffu, t, off);
        if (lane == 0) part[0] = t;
    }
    __syncthreads();
    return part[0];
}

#if MN_OUT_NORM
/* Sum of v over the warp, returned to every lane. */
__device__ __forceinline__ double mn_warp_sum(double v)
{
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* SPEC.md section 1's out_norm on the rows of the model's output, as
 * model/rownorm.c and mn_mlp_forward compute it: out holds the last layer's
 * o (no residual) on entry and y = g nhat + beta (+ x) on exit, with nhat = c
 * s, c = o - mean o (layernorm, MN_OUT_NORM 1) or o (rmsnorm, 2), s = 1 /
 * sqrt(|c|^2 / dv + 1e-6); nhat and s stay in ws for mn_out_norm_backward.
 * One warp per row, sums in double; the products in float, unfused, as the
 * CPU's loop. Ends with a barrier. */
__device__ void mn_out_norm_forward(const float *x, int rows, float *out, const mn_ws *ws)
{
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < rows; r += MN_RULE_THREADS / 32) {
        float *o = out + (long long)r * MN_DV, *nh = ws->nhat + (long long)r * MN_DV;
        double mu = 0.0, sq = 0.0;
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) mu += o[j];
            mu = mn_warp_sum(mu) / (double)MN_DV;
        }
        for (int j = lane; j < MN_DV; j += 32) {
            const double c = (double)o[j] - mu;
            sq += c * c;
        }
        const double sc = 1.0 / sqrt(mn_warp_sum(sq) / (double)MN_DV + 1e-6);
        for (int j = lane; j < MN_DV; j += 32) {
            const float h = (float)(((double)o[j] - mu) * sc);
            float y = __fadd_rn(__fmul_rn(ws->ln_g[j], h), ws->ln_b[j]);
            if (MN_RESIDUAL) y = __fadd_rn(y, x[(long long)r * MN_DK + j]);
            nh[j] = h;
            o[j] = y;
        }
        if (lane == 0) ws->ns[r] = (float)sc;
    }
    __syncthreads();
}

/* dL/do in place of dL/dy (da, rows x dv), after mn_out_norm_forward on these
 * rows: with a = g dL/dy, do = s (a - nhat <a, nhat> / dv), centred for
 * layernorm (model/rownorm.c mn_rownorm_vjp, as mn_mlp_backward calls it).
 * The residual's x holds no parameter. Ends with a barrier. */
__device__ void mn_out_norm_backward(int rows, float *da, const mn_ws *ws)
{
    const int lane = threadIdx.x & 31;
    const double D = (double)MN_DV;
    for (int r = threadIdx.x >> 5; r < rows; r += MN_RULE_THREADS / 32) {
        float *d = da + (long long)r * MN_DV;
        const float *h = ws->nhat + (long long)r * MN_DV;
        const double sc = ws->ns[r];
        double B = 0.0, mean = 0.0;
        for (int j = lane; j < MN_DV; j += 32) B += (double)__fmul_rn(ws->ln_g[j], d[j]) * h[j];
        B = mn_warp_sum(B);
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) mean += sc * ((double)__fmul_rn(ws->ln_g[j], d[j]) - h[j] * B / D);
            mean = mn_warp_sum(mean) / D;
        }
        for (int j = lane; j < MN_DV; j += 32)
            d[j] = (float)(sc * ((double)__fmul_rn(ws->ln_g[j], d[j]) - h[j] * B / D) - mean);
    }
    __syncthreads();
}
#endif

/* out[rows x dv] = M(x[rows x dk]; P), keeping z and h of the hidden layers
 * (with glu also the gate u, h = phi(z) u) in the workspace for mn_backward.
 * out may be global (retrieval) or ws->y. Ends with a barrier. */
__device__ void mn_forward(float *const *P, const float *x, int rows, float *out, const mn_ws *ws)
{
    const float *in = x;
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_IN(i), no = MN_OUT(i);
        const float *Wi = P[i * MN_PER];
        const float *bi = MN_BIAS ? P[i * MN_PER + 1] : 0;
        const bool last = i == MN_LAYERS - 1;
        for (int e = threadIdx.x; e < rows * no; e += MN_RULE_THREADS) {
            const int r = e / no, o = e % no;
            const float *xr = in + (long long)r * ni, *wr = Wi + (long long)o * ni;
            float acc = 0.0f;
#pragma unroll 4
            for (int j = 0; j < ni; j++) acc += mn_round(xr[j]) * mn_round(wr[j]);
            if (MN_BIAS) acc += bi[o];
            if (last) {
                if (MN_RESIDUAL && !MN_OUT_NORM) acc += x[(long long)r * MN_DK + o];
                out[e] = acc;
            } else if (MN_GLU) {
                const float *ur = P[MN_GATE(i)] + (long long)o * ni;
                float gate = 0.0f;
#pragma unroll 4
                for (int j = 0; j < ni; j++) gate += mn_round(xr[j]) * mn_round(ur[j]);
                if (MN_BIAS) gate += P[MN_GATE(i) + 1][o];
                ws->z[i][e] = acc;
                ws->u[i][e] = gate;
                ws->h[i][e] = mn_hook_act(acc) * gate;
            } else {
                ws->z[i][e] = acc;
                ws->h[i][e] = mn_hook_act(acc);
            }
        }
        __syncthreads();
        if (!last) in = ws->h[i];
    }
#if MN_OUT_NORM
    mn_out_norm_forward(x, rows, out, ws);
#endif
}

/* gW += d^T in (no x ni) and, with a bias, gb += the column sums of d:
 * one layer's (or one gate's) gradients from the gradient d at its output. */
__device__ __forceinline__ void mn_affine_grads(const float *d, const float *in, int rows, int no, int ni, float *gw,
                                                float *gb)
{
    for (int e = threadIdx.x; e < no * ni; e += MN_RULE_THREADS) {
        const int o = e / ni, j = e % ni;
        float acc = 0.0f;
        for (int r = 0; r < rows; r++) acc += mn_round(d[r * no + o]) * mn_round(in[(long long)r * ni + j]);
        gw[e] += acc;
    }
    if (MN_BIAS) {
        for (int o = threadIdx.x; o < no; o += MN_RULE_THREADS) {
            double acc = 0.0;
            for (int r = 0; r < rows; r++) acc += d[r * no + o];
            gb[o] += (float)acc;
        }
    }
}

/* Adds the gradients of this chunk to ws->g, given dL/dy in ws->da (rows x dv)
 * after mn_forward on the same x at the same P. With glu (model/mlp_cpu.c's
 * product rule): h = a u with a = phi(z), so du = dh a and dz = dh u phi'(z);
 * du takes the place of u in the workspace once read, and a hidden layer's
 * input gradient adds du U to dz W. Ends with a barrier. */
__device__ void mn_backward(float *const *P, const float *x, int rows, const mn_ws *ws)
{
#if MN_OUT_NORM
    mn_out_norm_backward(rows, ws->da, ws);
#endif
    float *dz = ws->da, *other = ws->db;
#pragma unroll
    for (int i = MN_LAYERS - 1; i >= 0; i--) {
        const int ni = MN_IN(i), no = MN_OUT(i);
        const bool gated = MN_GLU && i < MN_LAYERS - 1;
        const float *in = i == 0 ? x : ws->h[i > 0 ? i - 1 : 0];
        mn_affine_grads(dz, in, rows, no, ni, ws->g[i * MN_PER], MN_BIAS ? ws->g[i * MN_PER + 1] : 0);
        if (gated) mn_affine_grads(ws->u[i], in, rows, no, ni, ws->g[MN_GATE(i)], MN_BIAS ? ws->g[MN_GATE(i) + 1] : 0);
        if (i == 0) break;
        /* dh = dz W (+ du U), then through the activation (and gate) of layer i-1 */
        const float *Wi = P[i * MN_PER];
        const float *zp = ws->z[i > 0 ? i - 1 : 0];
        for (int e = threadIdx.x; e < rows * ni; e += MN_RULE_THREADS) {
            const int r = e / ni, j = e % ni;
            float acc = 0.0f;
            for (int o = 0; o < no; o++) acc += mn_round(dz[r * no + o]) * mn_round(Wi[(long long)o * ni + j]);
            if (gated) {
                const float *du = ws->u[i], *Ui = P[MN_GATE(i)];
                float gacc = 0.0f;
                for (int o = 0; o < no; o++) gacc += mn_round(du[r * no + o]) * mn_round(Ui[(long long)o * ni + j]);
                acc += gacc;
            }
            if (MN_GLU) {
                float *up = ws->u[i > 0 ? i - 1 : 0];
                const float gate = up[e];
                up[e] = acc * mn_hook_act(zp[e]);
                acc *= gate;
            }
            other[e] = acc * mn_hook_act_grad(zp[e]);
        }
        __syncthreads();
        float *t = dz;
        dz = other;
        other = t;
    }
    __syncthreads();
}

/* Pointers to memory m's slice of each parameter tensor. */
__device__ __forceinline__ void mn_memory_params(float *const *base, long long m, float **out)
{
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++)
        out[p] = base[p] + m * mn_param_numel_glu(MN_LAYERS, MN_BIAS, MN_DK, MN_DV, MN_DH, p);
}

#define MN_NUMEL(p) mn_param_numel_glu(MN_LAYERS, MN_BIAS, MN_DK, MN_DV, MN_DH, (p))

/* The rows of the step that starts at token t0 (the run's last step may be
 * short), and how many of them are real tokens, before real_end (SPEC.md
 * section 2's ragged batches; 0: the step starts in the padding). Every
 * walk over the steps counts them so, forward and backward. rows keeps its
 * caller's type (int in the forwards, long long in the backwards): so each
 * kernel compiles to the instructions it had with the expression inline. */
__device__ __forceinline__ long long mn_step_rows_at(long long t0, long long n)
{
    return t0 + MN_STEP <= n ? MN_STEP : n - t0;
}

template <class Rows> __device__ __forceinline__ long long mn_real_rows_at(long long t0, Rows rows, long long real_end)
{
    return t0 >= real_end ? 0 : (t0 + rows <= real_end ? rows : real_end - t0);
}

/* Whether step s of the whole run (steps_done counted in) opens a refresh
 * block: the gradient point moves to W^(s) there. Never with refresh 0. */
__device__ __forceinline__ bool mn_refresh_start(long long s)
{
    return MN_REFRESH > 0 && s % (MN_REFRESH > 0 ? MN_REFRESH / MN_STEP : 1) == 0;
}

/* Ragged batches: padding tokens [from, to) of a memory have y = 0 and
 * loss = 0 (y_out NULL: no retrieval). No barrier: nothing else in the step
 * writes these rows. In the fused kernel the loops stay rolled: stores
 * alone gain little from unrolling, which there tripled this code and cost
 * 0.1 s of NVRTC's compile (tests/bench/RESULTS.md, "NVRTC compile time");
 * the general kernel keeps the compiler's choice (rolled, its registers
 * went from 80 to 103 on sm_80). */
#ifdef MN_FUSED_ROWS
#define MN_PADDING_LOOP _Pragma("unroll 1")
#else
#define MN_PADDING_LOOP
#endif
__device__ void mn_zero_padding(float *y_out, float *loss_out, long long from, long long to)
{
    MN_PADDING_LOOP
    for (long long t = from + threadIdx.x; t < to; t += MN_RULE_THREADS) loss_out[t] = 0.0f;
    if (y_out) {
        MN_PADDING_LOOP
        for (long long e = from * MN_DV + threadIdx.x; e < to * MN_DV; e += MN_RULE_THREADS) y_out[e] = 0.0f;
    }
}

/* The general kernels; a fast path's source (MN_FUSED_ROWS defined) and
 * the backward's (MN_GRAD_SOURCE, grad_kernel.cuh) keep only the helpers
 * above and bring their own kernels. */
#if !defined(MN_FUSED_ROWS) && !defined(MN_GRAD_SOURCE)

/* This thread's part of |W|^2 over every parameter (a step that leaves W as
 * it was still reports its weight norm). */
__device__ __forceinline__ double mn_weight_sumsq_part(float *const *W)
{
    const int tid = threadIdx.x;
    double wsq = 0.0;
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++)
        for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) wsq += (double)W[p][e] * W[p][e];
    return wsq;
}

/* One segment: every step of memory blockIdx.x (model/engine_cpu.c run_memory). */
extern "C" __global__ void __launch_bounds__(MN_RULE_THREADS) mn_rule_step_kernel(const mn_rule_kargs a)
{
    const long long m = blockIdx.x, n = a.n, nsteps = a.nsteps;
    const int tid = threadIdx.x;
    mn_ws ws;
    mn_ws_init(&ws, a.work + m * a.work_floats, a.ln_g, a.ln_b, m);
    float *W[MN_NPARAMS], *Sm[MN_NPARAMS], *A[MN_NPARAMS];
    mn_memory_params(a.W, m, W);
    mn_memory_params(a.S, m, Sm);
    mn_memory_params(a.A, m, A);
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV;
    const float *q = a.q ? a.q + m * n * MN_DK : 0;
    const float *theta = a.theta + m * n, *eta = a.eta + m * nsteps, *alpha = a.alpha + m * nsteps;
    float *y_out = a.y ? a.y + m * n * MN_DV : 0;
    float *loss_out = a.loss + m * n;
    const double R = MN_FEATURE_SCALE;
    /* Ragged batches: tokens at and after real are padding (SPEC.md section 2). */
    const long long real = a.lengths ? a.lengths[m / a.heads] : n;

    for (long long sl = 0; sl < nsteps; sl++) {
        const long long s_global = a.steps_done + sl, t0 = sl * MN_STEP;
        const int rows = (int)mn_step_rows_at(t0, n);
        /* Gradient point: the weights at the start of this step's refresh block. */
        float *const *P = W;
        bool at_current = MN_REFRESH == MN_STEP;
        if (MN_REFRESH != MN_STEP) {
            if (mn_refresh_start(s_global)) {
#pragma unroll
                for (int p = 0; p < MN_NPARAMS; p++)
                    for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) A[p][e] = W[p][e];
                at_current = true;
            }
            P = A;
        }
        /* A step that starts in the padding leaves S and W as they are; the
         * others take their grows real rows (gradient, loss, retrieval). */
        const int grows = (int)mn_real_rows_at(t0, rows, real);
        if (grows == 0) {
            mn_zero_padding(y_out, loss_out, t0, t0 + rows);
            const double wsq = mn_block_sum(mn_weight_sumsq_part(W));
            if (tid == 0) {
                const long long o = m * nsteps + sl;
                mn_padding_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, o);
                a.weight_norm[o] = (float)sqrt(wsq);
            }
            continue;
        }
        if (grows < rows) mn_zero_padding(y_out, loss_out, t0 + grows, t0 + rows);
        const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
        const int before_rows = MN_RETRIEVE_BEFORE ? rows : rows - 1;
        const int before_real = before_rows < grows ? before_rows : grows;
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++)
            for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) ws.g[p][e] = 0.0f;
        __syncthreads();

        for (int r0 = 0; r0 < grows; r0 += MN_ROWS) {
            const int cr = grows - r0 < MN_ROWS ? grows - r0 : MN_ROWS;
            const long long t = t0 + r0;
            const float *x = k + t * MN_DK;
            mn_forward(P, x, cr, ws.y, &ws);
            /* loss terms (ws.db) and dL/dy (ws.da), token weights theta * (1/rows for mean) */
            for (int e = tid; e < cr * MN_DV; e += MN_RULE_THREADS) {
                const int r = e / MN_DV;
                const float yy = ws.y[e], vv = v[t * MN_DV + e], rr = yy - vv;
                const float wt = (float)((double)theta[t + r] * tscale);
                ws.db[e] = mn_hook_loss(yy, vv, rr);
                ws.da[e] = (float)((double)wt * R * (double)mn_hook_loss_grad(yy, vv, rr));
                /* retrieval at W^(s) = P for the rows that see the weights before the step */
                if (y_out && !q && at_current && r0 + r < before_rows) y_out[t * MN_DV + e] = yy;
            }
            __syncthreads();
            for (int r = tid; r < cr; r += MN_RULE_THREADS) {
                double acc = 0.0;
                for (int j = 0; j < MN_DV; j++) acc += ws.db[r * MN_DV + j];
                loss_out[t + r] = (float)(R * acc);
            }
            __syncthreads();
            mn_backward(P, x, cr, &ws);
        }

        double sumsq[MN_NPARAMS];
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            double acc = 0.0;
            for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) acc += (double)ws.g[p][e] * ws.g[p][e];
            sumsq[p] = mn_block_sum(acc);
        }
        mn_step_control ctl = mn_step_control_of<MN_NPARAMS>(sumsq);
        /* retrieval at W^(s) where the forward above was not at W^(s) on q */
        if (y_out && before_real > 0 && (q || !at_current)) {
            const float *xq = q ? q : k;
            for (int r0 = 0; r0 < before_real; r0 += MN_ROWS) {
                const int cr = before_real - r0 < MN_ROWS ? before_real - r0 : MN_ROWS;
                mn_forward(W, xq + (t0 + r0) * MN_DK, cr, y_out + (t0 + r0) * MN_DV, &ws);
            }
        }

        double wsq = 0.0;
        if (ctl.finite) {
            double scale[MN_NPARAMS];
            ctl.clip_scale = mn_clip_scales<MN_NPARAMS>(sumsq, ctl.gnorm, scale);
            const float e_s = eta[sl], keep = 1.0f - alpha[sl];
#if MN_PRECOND
            /* SPEC.md section 2's order: the clip, each matrix's Newton-Schulz, then momentum and decay */
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++) {
                const float fs = (float)scale[p];
                for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) ws.g[p][e] = mn_clip_elem(ws.g[p][e], fs);
            }
            __syncthreads();
            double *ns = a.ns_work + m * a.ns_doubles;
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++)
                if (!mn_param_is_bias_glu(MN_LAYERS, MN_BIAS, p)) /* W_i and glu's U_i */
                    mn_newton_schulz(ws.g[p], MN_OUT(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)),
                                     MN_IN(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)), ns);
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++)
                for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) {
                    const float w = mn_momentum_elem(ws.g[p][e], e_s, keep, &Sm[p][e], W[p][e]);
                    W[p][e] = w;
                    wsq += (double)w * w;
                }
#else
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++) {
                const float fs = (float)scale[p];
                for (long long e = tid; e < MN_NUMEL(p); e += MN_RULE_THREADS) {
                    const float w = mn_update_elem(ws.g[p][e], fs, e_s, keep, &Sm[p][e], W[p][e]);
                    W[p][e] = w;
                    wsq += (double)w * w;
                }
            }
#endif
        } else {
            wsq = mn_weight_sumsq_part(W);
        }
        wsq = mn_block_sum(wsq); /* its barriers also publish the new W */
        if (tid == 0) {
            const long long o = m * nsteps + sl;
            double lsum = 0.0;
            for (int r = 0; r < grows; r++) lsum += loss_out[t0 + r];
            mn_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, o, lsum, grows, ctl);
            a.weight_norm[o] = (float)sqrt(wsq);
        }
        if (y_out && !MN_RETRIEVE_BEFORE && grows == rows) { /* a padding last token keeps y = 0 */
            const long long last = t0 + rows - 1;
            mn_forward(W, (q ? q : k) + last * MN_DK, 1, y_out + last * MN_DV, &ws);
        }
    }
}

/* Retrieval only: y = M(q; W) for every row (model/engine_cpu.c cpu_read). */
extern "C" __global__ void __launch_bounds__(MN_RULE_THREADS) mn_rule_read_kernel(const mn_rule_kargs a)
{
    const long long m = blockIdx.x, n = a.n;
    mn_ws ws;
    mn_ws_init(&ws, a.work + m * a.work_floats, a.ln_g, a.ln_b, m);
    float *W[MN_NPARAMS];
    mn_memory_params(a.W, m, W);
    const float *q = a.q + m * n * MN_DK;
    float *y = a.y + m * n * MN_DV;
    for (long long r0 = 0; r0 < n; r0 += MN_ROWS) {
        const int cr = (int)(n - r0 < MN_ROWS ? n - r0 : MN_ROWS);
        mn_forward(W, q + r0 * MN_DK, cr, y + r0 * MN_DV, &ws);
    }
}

#endif /* !MN_FUSED_ROWS && !MN_GRAD_SOURCE */

#endif /* __CUDACC_RTC__ */
