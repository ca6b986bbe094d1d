/* grad_common.cuh: what the GPU's two backward sources begin with, the
 * general one (grad_kernel.cuh) and the fused one (fused_grad.cuh): the
 * kernels' arguments and the general backward's workspace layout, then the
 * device helpers (the flat parameter vector's offsets, the general
 * kernel's pieces of the workspace, vector ops over P floats, the run's
 * index arithmetic, the clip and its adjoint). Its own file because the
 * templates that follow it in both sources use it: codegen concatenates
 * templates, so it comes after rule_kernel.cuh (mn_block_sum, mn_ws) and
 * the hooks of kernels/codegen.c and before grad_ns_adjoint.cuh (both
 * sources), grad_out_norm.cuh and grad_kernel.cuh (the general one's,
 * codegen.c mn_cuda_grad_source) or fused_grad_model.cuh and fused_grad.cuh
 * (the fused one's, plan.c mn_cuda_fused_grad_source).
 *
 * Two parts, as rule_kernel.cuh: plain C shared with the host (the
 * arguments, mn_grad_layout_init and its appendices for newton_schulz and
 * out_norm, with which kernels/grad_cuda.c sizes the workspace; the fused
 * layout's newton_schulz scratch is mn_grad_ns_doubles too), then the
 * NVRTC part. Keep it to the CUDA that tests/emu/cuda_shim.h knows (see
 * grad_kernel.cuh). */
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

__device__ __forceinline__ long long mn_steps_rows(long long n, long long s) { return mn_step_rows_at(s * MN_STEP, n); }

/* Rows of step s that are real tokens (0: the step starts in the padding). */
__device__ __forceinline__ long long mn_real_rows(const mn_grad_kargs &a, long long m, long long s)
{
    long long t0 = s * MN_STEP, rows = mn_steps_rows(a.n, s);
    if (!a.lengths) return rows;
    return mn_real_rows_at(t0, rows, a.lengths[m / a.heads]);
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

#endif /* __CUDACC_RTC__ */
