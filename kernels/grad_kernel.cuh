/* grad_kernel.cuh: the backward of a run (SPEC.md section 7) on the GPU,
 * general path: the kernel template that model/grad_cpu.c is the plain
 * statement of, mirrored step for step so that fp32 results agree closely.
 * One thread block per memory (as the general forward, rule_kernel.cuh):
 *
 *   1. run the forward from the initial state, keeping (W, S, anchor) at
 *      checkpoints every K steps (grad_cpu.c run_memory);
 *   2. for each block of K steps, last block first: recompute the block
 *      from its checkpoint keeping W^(s), S^(s), the gradient point Wbar_s
 *      and G_s of every step, then walk the block's steps in reverse with
 *      the adjoints dW, dS, dA (grad_cpu.c step_reverse): retrieval after,
 *      update, clip, the step gradient's second-order adjoint
 *      (mlp_grad_cpu.c mn_mlp_step_adjoint), retrieval before, refresh.
 *
 * The state and every per-step vector live in a global workspace slice per
 * memory (sized on the host, kernels/grad_cuda.c, by mn_grad_layout_init):
 * one memory's parameters are a flat vector of P floats in parameter order
 * (param_layout.h), as the CPU's. The memory model's passes take a step's
 * rows in chunks of MN_ROWS (the forward kernel's), each chunk's activations
 * recomputed; the CPU takes a step's rows at once, and since every part of
 * the adjoint is a sum over rows, chunks only change the order of float
 * sums. Vector ops give each thread elements e = tid, tid + threads, ...;
 * every phase ends with a barrier (plain and correct first). Reductions
 * that decide control flow are block sums, so every thread takes the same
 * branch.
 *
 * out_norm (MN_OUT_NORM) is part of the memory model, as on the CPU: the
 * forward's passes take the rule kernel's norm (mn_forward), the tangent
 * and the reverse go through it (mn_gnorm_tangent, mn_gnorm_reverse:
 * mlp_grad_cpu.c's norm_reverse and rownorm.c's jvp, vjp and second-order
 * term), and ln_g's and ln_b's gradients add up over every pass of a memory.
 *
 * glu's gates (U_i, c_i of the hidden layers) join the flat parameters
 * after the layers' W_i, b_i (param_layout.h), their tangents gdot and
 * adjoints gbar, gdotbar the slice; the fused backward (fused_grad.cuh)
 * does not run glu.
 *
 * precondition = newton_schulz: the recompute orthogonalises the clipped G
 * with the forward's own mn_newton_schulz, and the reverse walk runs its
 * adjoint (mn_ns_adjoint, in double as model/precond.c) between the
 * update's adjoint and the clip's; its scratch (every iterate of the
 * largest matrix) follows the workspace slice (mn_grad_layout_add_ns),
 * out_norm's rows after it (mn_grad_layout_out_norm).
 *
 * qk_norm is covered around the kernel, which never sees it:
 * kernels/grad_cuda.c hands it the normalised keys and queries and takes
 * their gradients back through the normalisation. Every option of SPEC v2
 * runs here: mn_cuda_backward_covers (kernels/plan.c) leaves to the CPU
 * only a rule with more parameters than the kernel takes.
 *
 * Checked on a GPU against the CPU by tests/lua/test_grad_cuda.lua, and
 * without one by tests/unit/test_grad_emulated.c, which compiles this
 * source as C++ over tests/emu/cuda_shim.h (a block's threads as pthreads):
 * keep it to the CUDA that shim knows (__syncthreads, __shfl_*_sync on
 * doubles, the _rn intrinsics) or teach the shim.
 *
 * Two parts, as rule_kernel.cuh: plain C shared with the host (arguments,
 * workspace layout), then the NVRTC part, after rule_kernel.cuh (mn_forward,
 * mn_backward, mn_block_sum) and the hooks of kernels/codegen.c, which for
 * this source adds the adjoint's: mn_ghook_loss_dy, _dv, _dyy, _dyv (in
 * y, v, r), mn_ghook_act_d, _dd (phi', phi''), mn_ghook_clip_dscale(n),
 * mn_ghook_clip_elem(g), mn_ghook_clip_delem(g), all in double as the
 * CPU's expression programs. */
#ifndef MN_GRAD_KERNEL_ARGS
#define MN_GRAD_KERNEL_ARGS

#define MN_GRAD_KERNEL "mn_grad_kernel"

/* Passed by value. Per-parameter pointers are [B,H,...] bases; memory m's
 * slice starts m * numel later. Optional inputs are NULL when absent. */
typedef struct mn_grad_kargs {
    const float *W0[MN_RULE_MAX_PARAMS], *S0[MN_RULE_MAX_PARAMS];   /* the initial parameters and momenta */
    const float *dWf[MN_RULE_MAX_PARAMS], *dSf[MN_RULE_MAX_PARAMS]; /* upstream of the final ones, or NULL */
    float *gW[MN_RULE_MAX_PARAMS], *gS[MN_RULE_MAX_PARAMS];         /* gradients of the initial ones */
    const float *k, *v, *q;                 /* [B,H,n,dk|dv]; q NULL: q = k */
    const float *theta, *eta, *alpha;       /* [B,H,n], [B,H,S], [B,H,S] */
    const float *dy, *dloss;                /* upstream [B,H,n,dv], [B,H,n], or NULL */
    float *gk, *gv, *gq, *gtheta, *geta, *galpha; /* zeroed by the host: passes accumulate */
    const long long *lengths;               /* [B] real tokens, or NULL */
    long long heads;
    const float *ln_g, *ln_b;               /* out_norm: gain and shift [B,H,dv], else NULL */
    float *gln_g, *gln_b;                   /* out_norm: their gradients [B,H,dv], zeroed by the host */
    float *work;                            /* work_floats per memory */
    long long work_floats;
    long long n, nsteps, K, nblocks;
} mn_grad_kargs;

/* Offsets (floats) within one memory's workspace slice. */
typedef struct mn_grad_layout {
    long long P;                                   /* floats of one memory's parameters */
    long long fwd;                                 /* the forward kernel's chunk slice (mn_ws) */
    long long W, S, A, dW, dS, dA, dG, dGt, tmp;   /* running state and adjoints, P each */
    long long ck;                                  /* nblocks x (W, S, A) */
    long long Wb, Sb;                              /* (K + 1) x P */
    long long Ab, Gb;                              /* K x P */
    long long skip;                                /* K: what each step of the block did */
    long long xc, xbad;                            /* chunk: x with non-finite rows zeroed, and which */
    long long zdot[MN_RULE_MAX_LAYERS], hdot[MN_RULE_MAX_LAYERS]; /* tangents of the hidden layers */
    long long gdot[MN_RULE_MAX_LAYERS];            /* glu: the gates' tangents (0 without glu) */
    long long u, ybar, ubar;                       /* rows x dv */
    long long zbar, zdotbar, hbar, hdotbar;        /* rows x widest */
    long long nhat, ns, od, nd;                    /* out_norm (mn_grad_layout_out_norm), else 0 */
    long long gbar, gdotbar;                       /* glu: the gates' adjoints, rows x widest (0 without) */
    long long ns_scratch;                          /* newton_schulz's doubles (mn_grad_layout_add_ns), or 0 */
    long long total;
} mn_grad_layout;

MN_SHARED_FN long long mn_grad_up4(long long x) { return (x + 3) & ~3LL; }

/* glu is the rule's glu && layers > 1 (codegen.c's MN_GLU): the gates' U_i,
 * c_i join the flat parameters, and their tangents and adjoints the slice. */
MN_SHARED_FN void mn_grad_layout_init(mn_grad_layout *lo, int layers, int bias, int glu, long long dk, long long dv,
                                      long long dh, long long rows, long long K, long long nblocks)
{
    long long P = 0, wide = dk > dv ? dk : dv;
    if (layers > 1 && dh > wide) wide = dh;
    for (int p = 0; p < mn_param_count_glu(layers, bias, glu); p++)
        P += mn_param_numel_glu(layers, bias, dk, dv, dh, p);
    lo->P = P;
    mn_rule_layout f;
    mn_rule_layout_init(&f, layers, bias, glu, dk, dv, dh, rows);
    long long off = 0;
    lo->fwd = off;
    off += f.total;
    long long *flat[] = {&lo->W, &lo->S, &lo->A, &lo->dW, &lo->dS, &lo->dA, &lo->dG, &lo->dGt, &lo->tmp};
    for (int i = 0; i < 9; i++) {
        *flat[i] = off;
        off += mn_grad_up4(P);
    }
    lo->ck = off;
    off += mn_grad_up4(nblocks * 3 * P);
    lo->Wb = off;
    off += mn_grad_up4((K + 1) * P);
    lo->Sb = off;
    off += mn_grad_up4((K + 1) * P);
    lo->Ab = off;
    off += mn_grad_up4(K * P);
    lo->Gb = off;
    off += mn_grad_up4(K * P);
    lo->skip = off;
    off += mn_grad_up4(K);
    lo->xc = off;
    off += mn_grad_up4(rows * dk);
    lo->xbad = off;
    off += mn_grad_up4(rows);
    for (int i = 0; i < MN_RULE_MAX_LAYERS; i++) lo->zdot[i] = lo->hdot[i] = lo->gdot[i] = 0;
    for (int i = 0; i + 1 < layers; i++) {
        lo->zdot[i] = off;
        off += mn_grad_up4(rows * dh);
        lo->hdot[i] = off;
        off += mn_grad_up4(rows * dh);
        if (glu) {
            lo->gdot[i] = off;
            off += mn_grad_up4(rows * dh);
        }
    }
    long long *byv[] = {&lo->u, &lo->ybar, &lo->ubar};
    for (int i = 0; i < 3; i++) {
        *byv[i] = off;
        off += mn_grad_up4(rows * dv);
    }
    long long *byw[] = {&lo->zbar, &lo->zdotbar, &lo->hbar, &lo->hdotbar};
    for (int i = 0; i < 4; i++) {
        *byw[i] = off;
        off += mn_grad_up4(rows * wide);
    }
    lo->gbar = lo->gdotbar = 0;
    if (glu) {
        lo->gbar = off;
        off += mn_grad_up4(rows * wide);
        lo->gdotbar = off;
        off += mn_grad_up4(rows * wide);
    }
    lo->nhat = lo->ns = lo->od = lo->nd = 0;
    lo->ns_scratch = 0;
    lo->total = off;
}

/* out_norm's part of one memory's slice, after the rest: the forward's nhat
 * and s of a chunk (the kernel points its mn_ws there: the spot mn_ws_init
 * gives them lies past the forward's chunk slice, where W begins here) and
 * the tangents of o and of nhat (mlp_grad_cpu.c's od, nd). */
MN_SHARED_FN void mn_grad_layout_out_norm(mn_grad_layout *lo, long long dv, long long rows)
{
    long long off = lo->total;
    lo->nhat = off;
    off += mn_grad_up4(rows * dv);
    lo->ns = off;
    off += mn_grad_up4(rows);
    lo->od = off;
    off += mn_grad_up4(rows * dv);
    lo->nd = off;
    off += mn_grad_up4(rows * dv);
    lo->total = off;
}

/* newton_schulz's scratch (doubles) for one memory: the adjoint of the
 * largest matrix [m x n, m <= n] keeps every iterate X_0 .. X_steps, four
 * m x m products and three more m x n (model/precond.c's work with
 * adjoint); the forward's 2 m n + 2 m^2 fit in it. glu's U_i have W_i's
 * shapes, so the layers' weights bound them too. */
MN_SHARED_FN long long mn_grad_ns_doubles(int layers, long long dk, long long dv, long long dh, int steps)
{
    long long most = 0;
    for (int i = 0; i < layers; i++) {
        long long rows = mn_layer_out(i, layers, dv, dh), cols = mn_layer_in(i, dk, dh);
        long long small = rows < cols ? rows : cols, need = (steps + 4) * rows * cols + 4 * small * small;
        if (need > most) most = need;
    }
    return most;
}

/* Appends newton_schulz's scratch to a layout of mn_grad_layout_init
 * (steps 0: none, the layout unchanged): at an offset and with a total
 * that are multiples of 4 floats, so that in a 16-byte aligned workspace
 * every memory's slice stays so aligned and its doubles 8-byte aligned.
 * The host and the kernel call it alike. */
MN_SHARED_FN void mn_grad_layout_add_ns(mn_grad_layout *lo, int layers, long long dk, long long dv, long long dh,
                                        int steps)
{
    if (steps <= 0) return;
    lo->ns_scratch = mn_grad_up4(lo->total);
    lo->total = (lo->ns_scratch + 2 * mn_grad_ns_doubles(layers, dk, dv, dh, steps) + 3) & ~3LL;
}

#endif /* MN_GRAD_KERNEL_ARGS */

#ifdef __CUDACC_RTC__

#define MN_GNP MN_NPARAMS /* glu's gates included (rule_kernel.cuh) */
#define MN_GT MN_RULE_THREADS

/* What step_forward did (grad_cpu.c). */
#define MN_STEP_TAKEN 0
#define MN_STEP_SKIPPED 1
#define MN_STEP_PADDING 2

/* Parameter p's offset in the flat vector of one memory. */
__device__ __forceinline__ long long mn_goff(int p)
{
    long long o = 0;
    for (int i = 0; i < p; i++) o += MN_NUMEL(i);
    return o;
}

__device__ __forceinline__ void mn_gptrs(float *base, float **out)
{
#pragma unroll
    for (int p = 0; p < MN_GNP; p++) out[p] = base + mn_goff(p);
}

/* This block's pieces of the workspace. */
struct mn_gstate {
    long long P;
    float *W, *S, *A, *dW, *dS, *dA, *dG, *dGt, *tmp, *ck, *Wb, *Sb, *Ab, *Gb, *skip;
    float *xc, *xbad, *zdot[MN_LAYERS], *hdot[MN_LAYERS], *u, *ybar, *ubar, *zbar, *zdotbar, *hbar, *hdotbar;
    float *od, *nd, *gln_g, *gln_b; /* out_norm: tangents of o and nhat; this memory's ln_g, ln_b gradients */
    float *gdot[MN_LAYERS], *gbar, *gdotbar; /* glu, else unset */
    double *ns; /* newton_schulz's scratch (mn_grad_layout_add_ns), else NULL */
};

/* ---- flat vectors of P floats (each ends with a barrier) ---- */

__device__ void mn_vcopy(float *dst, const float *src, long long n)
{
    for (long long e = threadIdx.x; e < n; e += MN_GT) dst[e] = src[e];
    __syncthreads();
}

__device__ void mn_vzero(float *dst, long long n)
{
    for (long long e = threadIdx.x; e < n; e += MN_GT) dst[e] = 0.0f;
    __syncthreads();
}

/* <a, b> over n elements in double, to every thread (mn_block_sum's barriers). */
__device__ double mn_vdot(const float *a, const float *b, long long n)
{
    double acc = 0.0;
    for (long long e = threadIdx.x; e < n; e += MN_GT) acc += (double)a[e] * (double)b[e];
    return mn_block_sum(acc);
}

/* ---- the run's index arithmetic (grad_cpu.c) ---- */

__device__ __forceinline__ long long mn_steps_rows(long long n, long long s)
{
    return s * MN_STEP + MN_STEP <= n ? MN_STEP : n - s * MN_STEP;
}

/* Rows of step s that are real tokens (0: the step starts in the padding). */
__device__ __forceinline__ long long mn_real_rows(const mn_grad_kargs &a, long long m, long long s)
{
    long long t0 = s * MN_STEP, rows = mn_steps_rows(a.n, s);
    if (!a.lengths) return rows;
    long long real = a.lengths[m / a.heads];
    return t0 >= real ? 0 : (t0 + rows <= real ? rows : real - t0);
}

__device__ __forceinline__ bool mn_refresh_start(long long s)
{
    return MN_REFRESH > 0 && s % (MN_REFRESH > 0 ? MN_REFRESH / MN_STEP : 1) == 0;
}

__device__ __forceinline__ void mn_grefresh(mn_gstate *g, long long s)
{
    if (mn_refresh_start(s)) mn_vcopy(g->A, g->W, g->P);
}

/* ---- the clip and its adjoint (grad_cpu.c clip_forward, clip_adjoint) ---- */

#if MN_CLIP_MODE == 1
/* The clip's groups: every parameter (global) or each one. */
#define MN_CLIP_GROUPS (MN_CLIP_TENSOR ? MN_GNP : 1)
__device__ __forceinline__ void mn_clip_group(int gi, long long *e0, long long *e1)
{
    if (MN_CLIP_TENSOR) {
        *e0 = mn_goff(gi);
        *e1 = mn_goff(gi + 1);
    } else {
        *e0 = 0;
        *e1 = mn_goff(MN_GNP);
    }
}
#endif

/* Gt = clip(G). */
__device__ void mn_gclip_forward(const float *G, float *Gt, long long P)
{
#if MN_CLIP_MODE == 1
    for (int gi = 0; gi < MN_CLIP_GROUPS; gi++) {
        long long e0, e1;
        mn_clip_group(gi, &e0, &e1);
        const float sc = (float)mn_hook_clip_scale(sqrt(mn_vdot(G + e0, G + e0, e1 - e0)));
        for (long long e = e0 + threadIdx.x; e < e1; e += MN_GT) Gt[e] = __fmul_rn(G[e], sc);
    }
#elif MN_CLIP_MODE == 2
    for (long long e = threadIdx.x; e < P; e += MN_GT) Gt[e] = (float)mn_ghook_clip_elem((double)G[e]);
#else
    for (long long e = threadIdx.x; e < P; e += MN_GT) Gt[e] = G[e];
#endif
    (void)P;
    __syncthreads();
}

/* dG from dGt: Gt = G sc(|G|) gives dG = sc dGt + sc'(n) <dGt, G> / n G
 * (n = 0: the second term is 0); elementwise clips multiply by clip'(G). */
__device__ void mn_gclip_adjoint(const float *G, const float *dGt, float *dG, long long P)
{
#if MN_CLIP_MODE == 1
    for (int gi = 0; gi < MN_CLIP_GROUPS; gi++) {
        long long e0, e1;
        mn_clip_group(gi, &e0, &e1);
        const double nrm = sqrt(mn_vdot(G + e0, G + e0, e1 - e0)), sc = mn_hook_clip_scale(nrm);
        const double dot = mn_vdot(dGt + e0, G + e0, e1 - e0);
        const double through = nrm > 0 ? mn_ghook_clip_dscale(nrm) * dot / nrm : 0.0;
        for (long long e = e0 + threadIdx.x; e < e1; e += MN_GT)
            dG[e] = (float)(sc * (double)dGt[e] + through * (double)G[e]);
    }
#elif MN_CLIP_MODE == 2
    for (long long e = threadIdx.x; e < P; e += MN_GT)
        dG[e] = (float)((double)dGt[e] * mn_ghook_clip_delem((double)G[e]));
#else
    for (long long e = threadIdx.x; e < P; e += MN_GT) dG[e] = dGt[e];
#endif
    (void)P;
    __syncthreads();
}

#if MN_PRECOND
/* ---- newton_schulz and its adjoint (model/precond.c) ---- */

/* Gt <- newton_schulz(Gt) for each matrix (W_i; biases are left alone), by
 * the run's own device function (update_math.cuh), so that the recomputed
 * update is the forward's. ns: the memory's scratch. */
__device__ void mn_gprecond_forward(float *Gt, double *ns)
{
#pragma unroll
    for (int p = 0; p < MN_GNP; p++)
        if (!mn_param_is_bias_glu(MN_LAYERS, MN_BIAS, p))
            mn_newton_schulz(Gt + mn_goff(p), MN_OUT(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)),
                             MN_IN(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)), ns);
    __syncthreads(); /* a zero matrix returns without one */
}

/* The adjoint of newton_schulz on one matrix (model/precond.c ns_adjoint,
 * the same steps in double): g [rows x cols] is the clipped gradient the
 * forward saw, dg holds the adjoint of the output on entry and of the input
 * on exit. The iterates X_0 .. X_k are recomputed from g and kept; in the
 * worked-on orientation (m <= n, transposed when rows > cols), with dX'
 * the adjoint of X_{i+1}:
 *   dX_k = (nu/rho) dout - (nu/rho^3) <dout, X_k> X_k,  dnu = <dout, X_k> / rho
 *   dX_i = a dX' + B_i dX' + (dA + dA^T) X_i,  dA = b dB + c (dB A_i + A_i dB),  dB = dX' X_i^T
 *   dg   = dX_0 / (nu + eps) + (dnu - <dX_0, G> / (nu + eps)^2) G / nu
 * A zero g (or X_k) passes no gradient. ns: mn_grad_ns_doubles of scratch.
 * The block's threads (1-d, any count) share the products; ends with a barrier. */
__device__ void mn_ns_adjoint(const float *g, float *dg, int rows, int cols, double *ns)
{
    const bool wide = rows <= cols;
    const int m = wide ? rows : cols, n = wide ? cols : rows, tid = threadIdx.x, nt = blockDim.x;
    const long long mn = (long long)m * n, mm = (long long)m * m;
    double *Xs = ns, *A = Xs + (MN_NS_STEPS + 1) * mn, *Bm = A + mm, *dB = Bm + mm, *dA = dB + mm;
    double *dX = dA + mm, *dXn = dX + mn, *G = dXn + mn;
    double acc = 0.0;
    for (int e = tid; e < mn; e += nt) {
        const int a = e / n, b = e % n;
        const double x = wide ? g[e] : g[(long long)b * cols + a];
        G[e] = x;
        acc += x * x;
    }
    const double nu = sqrt(mn_ns_block_sum(acc));
    if (!(nu > 0.0)) { /* every thread sees the same nu */
        for (int e = tid; e < mn; e += nt) dg[e] = 0.0f;
        __syncthreads();
        return;
    }
    for (int e = tid; e < mn; e += nt) Xs[e] = G[e] / (nu + 1e-7);
    __syncthreads();
    for (int it = 0; it < MN_NS_STEPS; it++) {
        const double *X = Xs + it * mn;
        double *Xn = Xs + (it + 1) * mn;
        mn_ns_products(X, m, n, A, Bm);
        for (int e = tid; e < mn; e += nt) {
            const int i = e / n, j = e % n;
            double s = 0.0;
            for (int l = 0; l < m; l++) s += Bm[i * m + l] * X[(long long)l * n + j];
            Xn[e] = 3.4445 * X[e] + s;
        }
        __syncthreads();
    }
    const double *Y = Xs + MN_NS_STEPS * mn;
    acc = 0.0;
    for (int e = tid; e < mn; e += nt) acc += Y[e] * Y[e];
    const double rho = sqrt(mn_ns_block_sum(acc));
    if (!(rho > 0.0)) {
        for (int e = tid; e < mn; e += nt) dg[e] = 0.0f;
        __syncthreads();
        return;
    }
    /* dout into dXn, then the adjoint of X_k */
    acc = 0.0;
    for (int e = tid; e < mn; e += nt) {
        const int a = e / n, b = e % n;
        const double d = wide ? dg[e] : dg[(long long)b * cols + a];
        dXn[e] = d;
        acc += d * Y[e];
    }
    const double dY = mn_ns_block_sum(acc);
    double dnu = dY / rho;
    for (int e = tid; e < mn; e += nt) dXn[e] = (nu / rho) * dXn[e] - (nu * dY / (rho * rho * rho)) * Y[e];
    __syncthreads();
    for (int it = MN_NS_STEPS - 1; it >= 0; it--) {
        const double *X = Xs + it * mn;
        mn_ns_products(X, m, n, A, Bm);
        /* dX = a dX' + B dX'; dB = dX' X^T */
        for (int e = tid; e < mn; e += nt) {
            const int i = e / n, j = e % n;
            double s = 0.0;
            for (int l = 0; l < m; l++) s += Bm[i * m + l] * dXn[(long long)l * n + j];
            dX[e] = 3.4445 * dXn[e] + s;
        }
        for (int e = tid; e < m * m; e += nt) {
            const double *di = dXn + (long long)(e / m) * n, *xj = X + (long long)(e % m) * n;
            double s = 0.0;
            for (int l = 0; l < n; l++) s += di[l] * xj[l];
            dB[e] = s;
        }
        __syncthreads();
        /* dA = b dB + c dB A + c A dB */
        for (int e = tid; e < m * m; e += nt) {
            const int i = e / m, j = e % m;
            double s1 = 0.0, s2 = 0.0;
            for (int l = 0; l < m; l++) s1 += dB[i * m + l] * A[l * m + j];
            for (int l = 0; l < m; l++) s2 += A[i * m + l] * dB[l * m + j];
            dA[e] = (-4.7750 * dB[e] + 2.0315 * s1) + 2.0315 * s2;
        }
        __syncthreads();
        /* B is free now: it holds dA + dA^T */
        for (int e = tid; e < m * m; e += nt) {
            const int i = e / m, j = e % m;
            Bm[e] = dA[i * m + j] + dA[j * m + i];
        }
        __syncthreads();
        /* dX += (dA + dA^T) X */
        for (int e = tid; e < mn; e += nt) {
            const int i = e / n, j = e % n;
            double s = 0.0;
            for (int l = 0; l < m; l++) s += Bm[i * m + l] * X[(long long)l * n + j];
            dX[e] += s;
        }
        __syncthreads();
        double *swap = dXn;
        dXn = dX;
        dX = swap;
    }
    /* dXn: the adjoint of X_0 = G / (nu + eps) */
    const double den = nu + 1e-7;
    acc = 0.0;
    for (int e = tid; e < mn; e += nt) acc += dXn[e] * G[e];
    dnu -= mn_ns_block_sum(acc) / (den * den);
    for (int e = tid; e < mn; e += nt) {
        const int a = e / n, b = e % n;
        dg[wide ? e : (long long)b * cols + a] = (float)(dXn[e] / den + dnu * G[e] / nu);
    }
    __syncthreads();
}

/* dGt <- the adjoint of Gt's input through newton_schulz, matrix by
 * matrix (model/precond.c mn_precond_adjoint); Gt: the clipped G. */
__device__ void mn_gprecond_adjoint(const float *Gt, float *dGt, double *ns)
{
#pragma unroll
    for (int p = 0; p < MN_GNP; p++)
        if (!mn_param_is_bias_glu(MN_LAYERS, MN_BIAS, p))
            mn_ns_adjoint(Gt + mn_goff(p), dGt + mn_goff(p), MN_OUT(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)),
                          MN_IN(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)), ns);
}
#endif

#ifndef MN_FUSED_GRAD
/* The general path's kernel from here on; the fused backward
 * (fused_grad.cuh) takes the helpers above and has its own kernel. */

/* ---- one step of the forward (grad_cpu.c step_forward) ---- */

/* G at the gradient point g->A from the step's real rows, then clip and
 * update of g->W, g->S unless G is not finite. Returns MN_STEP_*. */
__device__ int mn_gstep_forward(const mn_grad_kargs &a, mn_gstate *g, mn_ws *ws, long long m, long long s, float *G)
{
    const long long rows = mn_real_rows(a, m, s), t0 = s * MN_STEP, P = g->P;
    if (rows == 0) return MN_STEP_PADDING;
    const float *k = a.k + m * a.n * MN_DK, *v = a.v + m * a.n * MN_DV, *theta = a.theta + m * a.n;
    float *Ap[MN_GNP];
    mn_gptrs(g->A, Ap);
    mn_gptrs(G, ws->g);
    mn_vzero(G, P);
    const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)rows : 1.0, R = MN_FEATURE_SCALE;
    for (long long r0 = 0; r0 < rows; r0 += MN_ROWS) {
        const int cr = (int)(rows - r0 < MN_ROWS ? rows - r0 : MN_ROWS);
        const long long t = t0 + r0;
        const float *x = k + t * MN_DK;
        mn_forward(Ap, x, cr, ws->y, ws);
        /* dyhat = weight R f'(y, v) (mn_loss_dyhat) */
        for (int e = threadIdx.x; e < cr * MN_DV; e += MN_GT) {
            const int r = e / MN_DV;
            const float wt = (float)((double)theta[t + r] * tscale);
            const double yy = ws->y[e], vv = v[t * MN_DV + e];
            ws->da[e] = (float)((double)wt * R * mn_ghook_loss_dy(yy, vv, yy - vv));
        }
        __syncthreads();
        mn_backward(Ap, x, cr, ws);
    }
    if (!(mn_vdot(G, G, P) <= 1.7976931348623157e308)) return MN_STEP_SKIPPED;
    mn_gclip_forward(G, g->tmp, P);
#if MN_PRECOND
    mn_gprecond_forward(g->tmp, g->ns);
#endif
    const float e_s = a.eta[m * a.nsteps + s], keep = 1.0f - a.alpha[m * a.nsteps + s];
    for (long long e = threadIdx.x; e < P; e += MN_GT) {
        const float sn = __fsub_rn(__fmul_rn(e_s, g->S[e]), g->tmp[e]);
        g->S[e] = sn;
        g->W[e] = __fadd_rn(__fmul_rn(keep, g->W[e]), sn);
    }
    __syncthreads();
    return MN_STEP_TAKEN;
}

/* ---- the memory model's adjoints on one chunk of rows (mlp_grad_cpu.c) ---- */

/* Zeroes the rows of x with a non-finite entry into g->xc (the passes run
 * on finite numbers) and marks them in g->xbad. */
__device__ void mn_gclean_rows(const float *x, int rows, mn_gstate *g)
{
    for (int r = threadIdx.x; r < rows; r += MN_GT) {
        bool bad = false;
        for (int j = 0; j < MN_DK; j++) bad = bad || !isfinite(x[(long long)r * MN_DK + j]);
        g->xbad[r] = bad ? 1.0f : 0.0f;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * MN_DK; e += MN_GT) g->xc[e] = g->xbad[e / MN_DK] != 0.0f ? 0.0f : x[e];
    __syncthreads();
}

#if MN_OUT_NORM
/* out_norm's tangent, after the layers' (the last one's in g->od): nd =
 * J(o) od and u = g nd, with J the norm's Jacobian at the forward's nhat
 * and s (model/rownorm.c mn_rownorm_jvp, then mn_mlp_step_adjoint's u).
 * One warp a row, sums in double as the CPU's. Ends with a barrier. */
__device__ void mn_gnorm_tangent(int rows, const mn_ws *ws, mn_gstate *g)
{
    const int lane = threadIdx.x & 31;
    const double D = (double)MN_DV;
    for (int r = threadIdx.x >> 5; r < rows; r += MN_GT / 32) {
        const float *h = ws->nhat + (long long)r * MN_DV, *d = g->od + (long long)r * MN_DV;
        float *nd = g->nd + (long long)r * MN_DV, *u = g->u + (long long)r * MN_DV;
        const double sc = ws->ns[r];
        double mu = 0.0, mm = 0.0;
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) mu += d[j];
            mu = mn_warp_sum(mu) / (double)MN_DV;
        }
        for (int j = lane; j < MN_DV; j += 32) mm += (double)h[j] * ((double)d[j] - mu);
        mm = mn_warp_sum(mm) / D;
        for (int j = lane; j < MN_DV; j += 32) {
            nd[j] = (float)(sc * (((double)d[j] - mu) - h[j] * mm));
            u[j] = __fmul_rn(ws->ln_g[j], nd[j]);
        }
    }
    __syncthreads();
}

/* out_norm's part of the reverse (mlp_grad_cpu.c norm_reverse), on the
 * seeds ybar (and with the tangent, ubar) of y = g nhat(o) + beta: adds
 * their share to this memory's ln_g and ln_b gradients, then turns them in
 * place into the seeds of o and od:
 *   obar  = J^T (g ybar) + d/do <g ubar, J(o) od>   (rownorm.c's vjp and hvp)
 *   odbar = J^T (g ubar)
 * ln_g, ln_b first, one thread a feature over the rows in order (the CPU's
 * float sums); then one warp a row, sums in double. Ends with a barrier. */
__device__ void mn_gnorm_reverse(int rows, bool tangent, const mn_ws *ws, mn_gstate *g)
{
    for (int j = threadIdx.x; j < MN_DV; j += MN_GT) {
        float sg = g->gln_g[j], sb = g->gln_b[j];
        for (int r = 0; r < rows; r++) {
            const long long e = (long long)r * MN_DV + j;
            sg += __fadd_rn(__fmul_rn(g->ybar[e], ws->nhat[e]), tangent ? __fmul_rn(g->ubar[e], g->nd[e]) : 0.0f);
            sb += g->ybar[e];
        }
        g->gln_g[j] = sg;
        g->gln_b[j] = sb;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const double D = (double)MN_DV, n = (double)MN_DV;
    for (int r = threadIdx.x >> 5; r < rows; r += MN_GT / 32) {
        float *yb = g->ybar + (long long)r * MN_DV, *ub = g->ubar + (long long)r * MN_DV;
        const float *h = ws->nhat + (long long)r * MN_DV, *od = g->od + (long long)r * MN_DV;
        const double sc = ws->ns[r];
        /* a = g ybar (and g ubar), in place as the CPU's; each lane keeps to its own features */
        double B = 0.0, mean = 0.0;
        for (int j = lane; j < MN_DV; j += 32) {
            yb[j] = __fmul_rn(yb[j], ws->ln_g[j]);
            if (tangent) ub[j] = __fmul_rn(ub[j], ws->ln_g[j]);
            B += (double)yb[j] * h[j];
        }
        B = mn_warp_sum(B);
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) mean += sc * ((double)yb[j] - h[j] * B / D);
            mean = mn_warp_sum(mean) / n;
        }
        if (!tangent) {
            for (int j = lane; j < MN_DV; j += 32) yb[j] = (float)(sc * ((double)yb[j] - h[j] * B / D) - mean);
            continue;
        }
        /* the second-order term's sums (mn_rownorm_hvp_acc: a = g ubar, xd = od) and odbar's (mn_rownorm_vjp) */
        double mu = 0.0, mm = 0.0, Bu = 0.0, F = 0.0, hmean = 0.0, umean = 0.0;
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) mu += od[j];
            mu = mn_warp_sum(mu) / n;
        }
        for (int j = lane; j < MN_DV; j += 32) {
            mm += (double)h[j] * ((double)od[j] - mu);
            Bu += (double)ub[j] * h[j];
        }
        mm = mn_warp_sum(mm) / D;
        Bu = mn_warp_sum(Bu);
        for (int j = lane; j < MN_DV; j += 32) F += (double)ub[j] * sc * (((double)od[j] - mu) - h[j] * mm);
        F = mn_warp_sum(F);
        if (MN_OUT_NORM == 1) {
            for (int j = lane; j < MN_DV; j += 32) {
                const double ndj = sc * (((double)od[j] - mu) - h[j] * mm);
                hmean += -sc * h[j] * F / D - sc * Bu * ndj / D - sc * sc * mm * ub[j] + sc * sc * mm * h[j] * Bu / D;
                umean += sc * ((double)ub[j] - h[j] * Bu / D);
            }
            hmean = mn_warp_sum(hmean) / n;
            umean = mn_warp_sum(umean) / n;
        }
        for (int j = lane; j < MN_DV; j += 32) {
            const double ndj = sc * (((double)od[j] - mu) - h[j] * mm);
            const double t = -sc * h[j] * F / D - sc * Bu * ndj / D - sc * sc * mm * ub[j] + sc * sc * mm * h[j] * Bu / D;
            const float obar = (float)(sc * ((double)yb[j] - h[j] * B / D) - mean);
            yb[j] = __fadd_rn(obar, (float)(t - hmean));
            ub[j] = (float)(sc * ((double)ub[j] - h[j] * Bu / D) - umean);
        }
    }
    __syncthreads();
}
#endif

/* With dG: the tangent u = J_P(y) dG layer by layer (zdot, hdot of the
 * hidden layers, u of the last), after mn_forward on g->xc at P. With glu
 * (mlp_grad_cpu.c) a hidden layer's gate g = U in + c has the tangent
 * gdot = dU in + U hdot + dc, and h = a g with a = phi(z) gives
 * hdot = phi'(z) zdot g + a gdot; the gate g is the forward's ws->u. */
__device__ void mn_gtangent(float *const *P, float *const *dG, int rows, const mn_ws *ws, mn_gstate *g)
{
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_IN(i), no = MN_OUT(i);
        const bool gated = MN_GLU && i < MN_LAYERS - 1;
        const float *Wi = P[i * MN_PER], *dWi = dG[i * MN_PER];
        const float *dbi = MN_BIAS ? dG[i * MN_PER + 1] : 0;
        const float *Ui = gated ? P[MN_GATE(i)] : 0, *dUi = gated ? dG[MN_GATE(i)] : 0;
        const float *dci = gated && MN_BIAS ? dG[MN_GATE(i) + 1] : 0;
        const float *in = i == 0 ? g->xc : ws->h[i > 0 ? i - 1 : 0];
        const float *hd = g->hdot[i > 0 ? i - 1 : 0];
        float *zd = i == MN_LAYERS - 1 ? (MN_OUT_NORM ? g->od : g->u) : g->zdot[i];
        for (int e = threadIdx.x; e < rows * no; e += MN_GT) {
            const int r = e / no, o = e % no;
            float s1 = 0.0f, s2 = 0.0f;
            for (int j = 0; j < ni; j++) s1 += in[(long long)r * ni + j] * dWi[(long long)o * ni + j];
            float acc = MN_BIAS ? __fadd_rn(dbi[o], s1) : s1;
            if (i > 0) {
                for (int j = 0; j < ni; j++) s2 += hd[(long long)r * ni + j] * Wi[(long long)o * ni + j];
                acc = __fadd_rn(acc, s2);
            }
            zd[e] = acc;
            if (gated) {
                float t1 = 0.0f, t2 = 0.0f;
                for (int j = 0; j < ni; j++) t1 += in[(long long)r * ni + j] * dUi[(long long)o * ni + j];
                float gacc = MN_BIAS ? __fadd_rn(dci[o], t1) : t1;
                if (i > 0) {
                    for (int j = 0; j < ni; j++) t2 += hd[(long long)r * ni + j] * Ui[(long long)o * ni + j];
                    gacc = __fadd_rn(gacc, t2);
                }
                g->gdot[i][e] = gacc;
                const float z = ws->z[i][e], act = mn_hook_act(z);
                g->hdot[i][e] = (float)(mn_ghook_act_d((double)z) * (double)acc * (double)ws->u[i][e] +
                                        (double)act * (double)gacc);
            } else if (i < MN_LAYERS - 1) {
                g->hdot[i][e] = (float)(mn_ghook_act_d((double)ws->z[i][e]) * (double)acc);
            }
        }
        __syncthreads();
    }
#if MN_OUT_NORM
    mn_gnorm_tangent(rows, ws, g);
#endif
}

/* The reverse of forward (+ tangent with dG) from the seeds ybar (and ubar)
 * in g: accumulates gP and gx (rows x dk). Reads the forward's z, h (with
 * glu the gate u) in ws, x in g->xc. mlp_grad_cpu.c's reverse loop: a gated
 * layer's U, c take gbar (and gdotbar) as W, b take zbar (and zdotbar), and
 * its input's adjoints add theirs through U (and dU). */
__device__ void mn_greverse(float *const *P, float *const *dG, int rows, const mn_ws *ws, mn_gstate *g,
                            float *const *gP, float *gx)
{
    if (MN_RESIDUAL)
        for (int e = threadIdx.x; e < rows * MN_DV; e += MN_GT) gx[e] += g->ybar[e]; /* dk = dv */
#if MN_OUT_NORM
    mn_gnorm_reverse(rows, dG != 0, ws, g); /* its first barrier orders the residual's reads before its writes */
#endif
    for (int e = threadIdx.x; e < rows * MN_DV; e += MN_GT) {
        g->zbar[e] = g->ybar[e];
        if (dG) g->zdotbar[e] = g->ubar[e];
    }
    __syncthreads();
#pragma unroll
    for (int i = MN_LAYERS - 1; i >= 0; i--) {
        const int ni = MN_IN(i), no = MN_OUT(i);
        const bool gated = MN_GLU && i < MN_LAYERS - 1;
        const float *Wi = P[i * MN_PER];
        const float *dWi = dG ? dG[i * MN_PER] : 0;
        float *gWi = gP[i * MN_PER];
        float *gbi = MN_BIAS ? gP[i * MN_PER + 1] : 0;
        const float *Ui = gated ? P[MN_GATE(i)] : 0, *dUi = gated && dG ? dG[MN_GATE(i)] : 0;
        float *gUi = gated ? gP[MN_GATE(i)] : 0;
        float *gci = gated && MN_BIAS ? gP[MN_GATE(i) + 1] : 0;
        const float *in = i == 0 ? g->xc : ws->h[i > 0 ? i - 1 : 0];
        const float *hd = g->hdot[i > 0 ? i - 1 : 0];
        /* gW += zbar^T in (+ zdotbar^T hdot), gb += the column sums of zbar;
         * gated: gU, gc alike from gbar (and gdotbar) */
        for (int e = threadIdx.x; e < no * ni; e += MN_GT) {
            const int o = e / ni, j = e % ni;
            float s1 = 0.0f;
            for (int r = 0; r < rows; r++) s1 += g->zbar[r * no + o] * in[(long long)r * ni + j];
            gWi[e] += s1;
            if (dG && i > 0) {
                float s2 = 0.0f;
                for (int r = 0; r < rows; r++) s2 += g->zdotbar[r * no + o] * hd[(long long)r * ni + j];
                gWi[e] += s2;
            }
            if (gated) {
                float t1 = 0.0f;
                for (int r = 0; r < rows; r++) t1 += g->gbar[r * no + o] * in[(long long)r * ni + j];
                gUi[e] += t1;
                if (dG && i > 0) {
                    float t2 = 0.0f;
                    for (int r = 0; r < rows; r++) t2 += g->gdotbar[r * no + o] * hd[(long long)r * ni + j];
                    gUi[e] += t2;
                }
            }
        }
        if (MN_BIAS)
            for (int o = threadIdx.x; o < no; o += MN_GT) {
                double acc = 0.0;
                for (int r = 0; r < rows; r++) acc += g->zbar[r * no + o];
                gbi[o] += (float)acc;
                if (gated) {
                    double gacc = 0.0;
                    for (int r = 0; r < rows; r++) gacc += g->gbar[r * no + o];
                    gci[o] += (float)gacc;
                }
            }
        /* hbar = zbar W + zdotbar dW (+ gbar U + gdotbar dU); hdotbar = zdotbar W (+ gdotbar U) */
        for (int e = threadIdx.x; e < rows * ni; e += MN_GT) {
            const int r = e / ni, j = e % ni;
            float hb = 0.0f, hdb = 0.0f;
            for (int o = 0; o < no; o++) hb += g->zbar[r * no + o] * Wi[(long long)o * ni + j];
            if (dG) {
                float s2 = 0.0f;
                for (int o = 0; o < no; o++) s2 += g->zdotbar[r * no + o] * dWi[(long long)o * ni + j];
                hb = __fadd_rn(hb, s2);
                if (i > 0)
                    for (int o = 0; o < no; o++) hdb += g->zdotbar[r * no + o] * Wi[(long long)o * ni + j];
            }
            if (gated) {
                float t1 = 0.0f;
                for (int o = 0; o < no; o++) t1 += g->gbar[r * no + o] * Ui[(long long)o * ni + j];
                hb = __fadd_rn(hb, t1);
                if (dG) {
                    float t2 = 0.0f, t3 = 0.0f;
                    for (int o = 0; o < no; o++) t2 += g->gdotbar[r * no + o] * dUi[(long long)o * ni + j];
                    hb = __fadd_rn(hb, t2);
                    if (i > 0) {
                        for (int o = 0; o < no; o++) t3 += g->gdotbar[r * no + o] * Ui[(long long)o * ni + j];
                        hdb = __fadd_rn(hdb, t3);
                    }
                }
            }
            if (dG && i > 0) g->hdotbar[e] = hdb;
            if (i == 0) gx[e] += hb;
            else g->hbar[e] = hb;
        }
        __syncthreads();
        if (i == 0) break;
        /* through the activation of layer i - 1 (with glu h = a g: also the gate's adjoints) */
        const float *zp = ws->z[i > 0 ? i - 1 : 0];
        const float *zdp = g->zdot[i > 0 ? i - 1 : 0];
        const float *gp = ws->u[i > 0 ? i - 1 : 0], *gdp = g->gdot[i > 0 ? i - 1 : 0];
        for (int e = threadIdx.x; e < rows * ni; e += MN_GT) {
            const double d1 = mn_ghook_act_d((double)zp[e]);
            if (MN_GLU) {
                const float act = mn_hook_act(zp[e]);
                const double gt = gp[e];
                if (dG) {
                    const double d2 = mn_ghook_act_dd((double)zp[e]), hb = g->hbar[e], hdb = g->hdotbar[e];
                    const double zd = zdp[e], gd = gdp[e];
                    g->zbar[e] = (float)(d1 * (hb * gt + hdb * gd) + d2 * zd * gt * hdb);
                    g->gbar[e] = (float)(hb * (double)act + hdb * d1 * zd);
                    g->zdotbar[e] = (float)(d1 * gt * hdb);
                    g->gdotbar[e] = (float)((double)act * hdb);
                } else {
                    g->zbar[e] = (float)(d1 * (double)g->hbar[e] * gt);
                    g->gbar[e] = g->hbar[e] * act;
                }
            } else if (dG) {
                const double d2 = mn_ghook_act_dd((double)zp[e]), hdb = g->hdotbar[e];
                g->zbar[e] = (float)(d1 * (double)g->hbar[e] + d2 * (double)zdp[e] * hdb);
                g->zdotbar[e] = (float)(d1 * hdb);
            } else {
                g->zbar[e] = (float)(d1 * (double)g->hbar[e]);
            }
        }
        __syncthreads();
    }
}

/* mn_mlp_step_adjoint on rows rows (a chunk of a step's real rows): with
 * y_t = M(x_t; P), dyhat_t = weight_t R f'(y_t, v_t) and G = sum_t J_P^T
 * dyhat_t, accumulate the gradient of <dG, G> + sum_t dloss_t l_t into gP,
 * gx, gv and gtheta (tscale times the weight's gradient). dG NULL: a
 * skipped step, the loss output's terms only. dyret (may be NULL): the
 * upstream of retrieval outputs that read M(x_t; P) for the first ret_rows
 * rows. Non-finite rows are cut as grad.h says. */
__device__ void mn_gstep_adjoint(float *const *P, float *const *dG, const float *x, const float *v,
                                 const float *theta, double tscale, const float *dloss, const float *dyret,
                                 int ret_rows, int rows, mn_ws *ws, mn_gstate *g, float *const *gP, float *gx,
                                 float *gv, float *gtheta)
{
    const double R = MN_FEATURE_SCALE;
    mn_gclean_rows(x, rows, g);
    mn_forward(P, g->xc, rows, ws->y, ws);
    if (dG) mn_gtangent(P, dG, rows, ws, g);
    /* the loss's pointwise terms, one thread a row (mlp_grad_cpu.c's loops) */
    for (int r = threadIdx.x; r < rows; r += MN_GT) {
        const float *yr = ws->y + (long long)r * MN_DV, *vr = v + (long long)r * MN_DV;
        float *ybar = g->ybar + (long long)r * MN_DV, *ubar = g->ubar + (long long)r * MN_DV;
        const float *u = g->u + (long long)r * MN_DV;
        float *gvr = gv + (long long)r * MN_DV;
        /* cut: a non-finite x, or a non-finite v where f' is not finite either */
        bool cut = g->xbad[r] != 0.0f, vfinite = true;
        for (int j = 0; j < MN_DV; j++) vfinite = vfinite && isfinite(vr[j]);
        if (!cut && !vfinite)
            for (int j = 0; j < MN_DV && !cut; j++) {
                const double yy = yr[j], vv = vr[j];
                cut = !isfinite(mn_ghook_loss_dy(yy, vv, yy - vv));
            }
        if (cut) {
            for (int j = 0; j < MN_DV; j++) {
                ybar[j] = 0.0f;
                if (dG) ubar[j] = 0.0f;
            }
        } else {
            const float wt = dG ? (float)((double)theta[r] * tscale) : 0.0f; /* a skipped step's theta is not read */
            const double dl = dloss ? (double)dloss[r] : 0.0;
            double acc = 0.0;
            for (int j = 0; j < MN_DV; j++) {
                const double yy = yr[j], vv = vr[j], d = mn_ghook_loss_dy(yy, vv, yy - vv);
                if (dG) ubar[j] = (float)((double)wt * R * d);
                ybar[j] = (float)(dl * R * d);
                if (dG) acc += d * (double)u[j];
            }
            if (dG) {
                const float gweight = (float)(R * acc);
                gtheta[r] += (float)(tscale * (double)gweight);
                for (int j = 0; j < MN_DV; j++) {
                    const double yy = yr[j], vv = vr[j];
                    ybar[j] += (float)((double)wt * R * mn_ghook_loss_dyy(yy, vv, yy - vv) * (double)u[j]);
                    gvr[j] += (float)((double)wt * R * mn_ghook_loss_dyv(yy, vv, yy - vv) * (double)u[j]);
                }
            }
            if (dloss)
                for (int j = 0; j < MN_DV; j++) {
                    const double yy = yr[j], vv = vr[j];
                    gvr[j] += (float)(dl * R * mn_ghook_loss_dv(yy, vv, yy - vv));
                }
        }
        /* retrieval outputs read x as the query: a non-finite one is cut */
        if (dyret && r < ret_rows && g->xbad[r] == 0.0f)
            for (int j = 0; j < MN_DV; j++) ybar[j] += dyret[(long long)r * MN_DV + j];
    }
    __syncthreads();
    mn_greverse(P, dG, rows, ws, g, gP, gx);
}

/* mn_mlp_vjp on rows rows: y = M(x; P) given dy, into gP and gx; a
 * non-finite query's output is cut. */
__device__ void mn_gvjp(float *const *P, const float *x, const float *dy, int rows, mn_ws *ws, mn_gstate *g,
                        float *const *gP, float *gx)
{
    mn_gclean_rows(x, rows, g);
    mn_forward(P, g->xc, rows, ws->y, ws);
    for (int e = threadIdx.x; e < rows * MN_DV; e += MN_GT)
        g->ybar[e] = g->xbad[e / MN_DV] != 0.0f ? 0.0f : dy[e];
    __syncthreads();
    mn_greverse(P, 0, rows, ws, g, gP, gx);
}

/* ---- the reverse of step s, block slot i (grad_cpu.c step_reverse) ---- */

__device__ void mn_gstep_reverse(const mn_grad_kargs &a, mn_gstate *g, mn_ws *ws, long long m, long long s,
                                 long long i, int code)
{
    const long long P = g->P, n = a.n, t0 = s * MN_STEP, rows = mn_steps_rows(n, s);
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV;
    const float *xq = a.q ? a.q + m * n * MN_DK : k;
    float *gk = a.gk + m * n * MN_DK, *gv = a.gv + m * n * MN_DV;
    float *gxq = a.q ? a.gq + m * n * MN_DK : gk;
    float *gtheta = a.gtheta + m * n;
    const float *dy = a.dy ? a.dy + m * n * MN_DV : 0, *dloss = a.dloss ? a.dloss + m * n : 0;
    const float *theta = a.theta + m * n;
    float *Wnow = g->Wb + i * P, *Wnext = g->Wb + (i + 1) * P, *Snow = g->Sb + i * P;
    float *G = g->Gb + i * P, *Abar = g->Ab + i * P;
    float *pW[MN_GNP], *pdW[MN_GNP], *pdA[MN_GNP], *pdG[MN_GNP], *pA[MN_GNP];
    mn_gptrs(g->dW, pdW);
    mn_gptrs(g->dA, pdA);
    mn_gptrs(g->dG, pdG);
    mn_gptrs(Abar, pA);
    const long long grows = mn_real_rows(a, m, s);
    const bool refresh = mn_refresh_start(s);
    if (code == MN_STEP_PADDING) {
        /* the identity, and its outputs (y = 0, loss = 0) are constants */
        if (refresh) {
            for (long long e = threadIdx.x; e < P; e += MN_GT) {
                g->dW[e] += g->dA[e];
                g->dA[e] = 0.0f;
            }
            __syncthreads();
        }
        return;
    }
    /* retrieval of the step's last token at W^(s+1) (retrieve = after), unless it is padding */
    if (dy && !MN_RETRIEVE_BEFORE && grows == rows) {
        const long long t = t0 + rows - 1;
        mn_gptrs(Wnext, pW);
        mn_gvjp(pW, xq + t * MN_DK, dy + t * MN_DV, 1, ws, g, pdW, gxq + t * MN_DK);
    }
    const bool skipped = code == MN_STEP_SKIPPED;
    if (!skipped) {
        const float e_s = a.eta[m * a.nsteps + s], keep = 1.0f - a.alpha[m * a.nsteps + s];
        /* the adjoint of S^(s+1) is dS + dW (both uses) */
        const double deta = mn_vdot(g->dS, Snow, P) + mn_vdot(g->dW, Snow, P), dalpha = -mn_vdot(g->dW, Wnow, P);
        for (long long e = threadIdx.x; e < P; e += MN_GT) {
            const float dSt = __fadd_rn(g->dS[e], g->dW[e]);
            g->dGt[e] = -dSt;
            g->dW[e] = __fmul_rn(g->dW[e], keep);
            g->dS[e] = __fmul_rn(e_s, dSt);
        }
        if (threadIdx.x == 0) {
            a.geta[m * a.nsteps + s] = (float)deta;
            a.galpha[m * a.nsteps + s] = (float)dalpha;
        }
        __syncthreads();
#if MN_PRECOND
        /* the preconditioner's adjoint before the clip's; its input is the clipped G */
        mn_gclip_forward(G, g->tmp, P);
        mn_gprecond_adjoint(g->tmp, g->dGt, g->ns);
#endif
        mn_gclip_adjoint(G, g->dGt, g->dG, P);
    }
    /* retrieval of the rows that see W^(s): with q = k and the gradient
     * point at W^(s) those are the step's own M(k_t; Wbar_s) */
    long long before = MN_RETRIEVE_BEFORE ? rows : rows - 1;
    if (before > grows) before = grows; /* padding rows read y = 0 */
    const bool merged = dy && before > 0 && !a.q && refresh;
    if (!skipped || dloss || merged) {
        const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
        for (long long r0 = 0; r0 < grows; r0 += MN_ROWS) {
            const int cr = (int)(grows - r0 < MN_ROWS ? grows - r0 : MN_ROWS);
            const long long t = t0 + r0;
            const int ret = (int)(before - r0 < 0 ? 0 : (before - r0 < cr ? before - r0 : cr));
            mn_gstep_adjoint(pA, skipped ? 0 : pdG, k + t * MN_DK, v + t * MN_DV, theta + t, tscale,
                             dloss ? dloss + t : 0, merged ? dy + t * MN_DV : 0, ret, cr, ws, g, pdA,
                             gk + t * MN_DK, gv + t * MN_DV, gtheta + t);
        }
    }
    if (dy && before > 0 && !merged) {
        mn_gptrs(Wnow, pW);
        for (long long r0 = 0; r0 < before; r0 += MN_ROWS) {
            const int cr = (int)(before - r0 < MN_ROWS ? before - r0 : MN_ROWS);
            const long long t = t0 + r0;
            mn_gvjp(pW, xq + t * MN_DK, dy + t * MN_DV, cr, ws, g, pdW, gxq + t * MN_DK);
        }
    }
    if (refresh) {
        for (long long e = threadIdx.x; e < P; e += MN_GT) {
            g->dW[e] += g->dA[e];
            g->dA[e] = 0.0f;
        }
        __syncthreads();
    }
}

/* out_norm's slices of memory m's workspace (after lo's, which this
 * extends), its ln_g, ln_b and where their gradients go (grad_cpu.c
 * run_memory's gln_g, gln_b); without out_norm the pointers are NULL. */
__device__ __forceinline__ void mn_gout_norm_init(const mn_grad_kargs &a, float *base, mn_grad_layout *lo, long long m,
                                                  mn_ws *ws, mn_gstate *g)
{
    g->od = g->nd = g->gln_g = g->gln_b = 0;
#if MN_OUT_NORM
    mn_grad_layout_out_norm(lo, MN_DV, MN_ROWS);
    ws->nhat = base + lo->nhat;
    ws->ns = base + lo->ns;
    g->od = base + lo->od;
    g->nd = base + lo->nd;
    g->gln_g = a.gln_g + m * MN_DV;
    g->gln_b = a.gln_b + m * MN_DV;
#else
    (void)a, (void)base, (void)lo, (void)m, (void)ws;
#endif
}

/* One memory's backward (grad_cpu.c run_memory). */
extern "C" __global__ void __launch_bounds__(MN_RULE_THREADS) mn_grad_kernel(const mn_grad_kargs a)
{
    const long long m = blockIdx.x, K = a.K;
    float *base = a.work + m * a.work_floats;
    mn_grad_layout lo;
    mn_grad_layout_init(&lo, MN_LAYERS, MN_BIAS, MN_GLU, MN_DK, MN_DV, MN_DH, MN_ROWS, K, a.nblocks);
    mn_grad_layout_add_ns(&lo, MN_LAYERS, MN_DK, MN_DV, MN_DH, MN_PRECOND ? MN_NS_STEPS : 0);
    const long long P = lo.P;
    mn_gstate g;
    g.P = P;
    g.W = base + lo.W;
    g.S = base + lo.S;
    g.A = base + lo.A;
    g.dW = base + lo.dW;
    g.dS = base + lo.dS;
    g.dA = base + lo.dA;
    g.dG = base + lo.dG;
    g.dGt = base + lo.dGt;
    g.tmp = base + lo.tmp;
    g.ck = base + lo.ck;
    g.Wb = base + lo.Wb;
    g.Sb = base + lo.Sb;
    g.Ab = base + lo.Ab;
    g.Gb = base + lo.Gb;
    g.skip = base + lo.skip;
    g.xc = base + lo.xc;
    g.xbad = base + lo.xbad;
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        g.zdot[i] = base + lo.zdot[i];
        g.hdot[i] = base + lo.hdot[i];
        g.gdot[i] = base + lo.gdot[i];
    }
    g.gbar = base + lo.gbar;
    g.gdotbar = base + lo.gdotbar;
    g.u = base + lo.u;
    g.ybar = base + lo.ybar;
    g.ubar = base + lo.ubar;
    g.zbar = base + lo.zbar;
    g.zdotbar = base + lo.zdotbar;
    g.hbar = base + lo.hbar;
    g.hdotbar = base + lo.hdotbar;
    g.ns = lo.ns_scratch ? (double *)(base + lo.ns_scratch) : 0;
    mn_ws ws;
    mn_ws_init(&ws, base + lo.fwd, a.ln_g, a.ln_b, m);
    mn_gout_norm_init(a, base, &lo, m, &ws, &g);

    /* initial state */
#pragma unroll
    for (int p = 0; p < MN_GNP; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = threadIdx.x; e < ne; e += MN_GT) {
            g.W[o + e] = a.W0[p][m * ne + e];
            g.S[o + e] = a.S0[p][m * ne + e];
        }
    }
    __syncthreads();
    mn_vcopy(g.A, g.W, P);
    /* 1. checkpoints at the first step of every block; the last block is
     * recomputed in 2 anyway, so this forward stops at its start */
    const long long last = (a.nblocks - 1) * K;
    for (long long s = 0; s <= last; s++) {
        if (s % K == 0) {
            float *ck = g.ck + (s / K) * 3 * P;
            mn_vcopy(ck, g.W, P);
            mn_vcopy(ck + P, g.S, P);
            mn_vcopy(ck + 2 * P, g.A, P);
        }
        if (s == last) break;
        mn_grefresh(&g, s);
        mn_gstep_forward(a, &g, &ws, m, s, g.dG); /* dG is free here: scratch for G */
    }
    /* adjoints of the final tensors */
#pragma unroll
    for (int p = 0; p < MN_GNP; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = threadIdx.x; e < ne; e += MN_GT) {
            g.dW[o + e] = a.dWf[p] ? a.dWf[p][m * ne + e] : 0.0f;
            g.dS[o + e] = a.dSf[p] ? a.dSf[p][m * ne + e] : 0.0f;
        }
    }
    __syncthreads();
    mn_vzero(g.dA, P);
    /* 2. blocks in reverse */
    for (long long b = a.nblocks - 1; b >= 0; b--) {
        const float *ck = g.ck + b * 3 * P;
        mn_vcopy(g.W, ck, P);
        mn_vcopy(g.S, ck + P, P);
        mn_vcopy(g.A, ck + 2 * P, P);
        const long long s0 = b * K, len = s0 + K <= a.nsteps ? K : a.nsteps - s0;
        for (long long i = 0; i < len; i++) {
            mn_vcopy(g.Wb + i * P, g.W, P);
            mn_vcopy(g.Sb + i * P, g.S, P);
            mn_grefresh(&g, s0 + i);
            mn_vcopy(g.Ab + i * P, g.A, P);
            const int code = mn_gstep_forward(a, &g, &ws, m, s0 + i, g.Gb + i * P);
            if (threadIdx.x == 0) g.skip[i] = (float)code;
        }
        mn_vcopy(g.Wb + len * P, g.W, P);
        mn_vcopy(g.Sb + len * P, g.S, P); /* its barrier publishes skip */
        for (long long i = len - 1; i >= 0; i--) mn_gstep_reverse(a, &g, &ws, m, s0 + i, i, (int)g.skip[i]);
    }
#pragma unroll
    for (int p = 0; p < MN_GNP; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = threadIdx.x; e < ne; e += MN_GT) {
            a.gW[p][m * ne + e] = g.dW[o + e] + g.dA[o + e];
            a.gS[p][m * ne + e] = g.dS[o + e];
        }
    }
}

#endif /* !MN_FUSED_GRAD */

#endif /* __CUDACC_RTC__ */
