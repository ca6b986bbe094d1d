/* fused_grad.cuh: the backward of a run (SPEC.md section 7) on the fused
 * per-memory path. The same algorithm as the general backward
 * (grad_kernel.cuh, which model/grad_cpu.c states plainly; both take the
 * arguments, flat-vector helpers and clip adjoint of grad_common.cuh,
 * which comes before either in its source): checkpoints of
 * (W, S, and the anchor A when refresh != step) every K steps, each block
 * of K steps recomputed from its checkpoint keeping W^(s), S^(s) and G_s,
 * then walked in reverse with the adjoints dW, dS (and dA). What changes is
 * where the work runs: as in the fused forward (fused_kernel.cuh and its
 * step kernel, fused_step.cuh), one persistent block per memory holds the
 * gradient point (W^(s) when refresh = step, else the refresh block's
 * anchor) in shared memory, zero-padded to whole tensor-core tiles, and
 * every product of a chunk of token rows is an mma.sync product in the
 * run's precision (3xTF32 for fp32, tf32, bf16; fp32 accumulation):
 *
 *   forward        z = x W1^T + b1, h = phi(z), y = h W2^T + b2 (+ x)
 *   tangent (dG)   zd = x dG1^T + db1, hd = phi'(z) zd,
 *                  u = hd W2^T + h dG2^T + db2
 *   seeds          ubar = theta R f'(y, v); ybar = dloss R f' + theta R f'' u
 *                  (+ dy of retrievals that read the same forward)
 *   reverse        dA2 += ybar^T h + ubar^T hd, hbar = ybar W2 + ubar dG2,
 *                  hdbar = ubar W2, zbar = phi' hbar + phi'' zd hdbar,
 *                  zdbar = phi' hdbar, dA1 += zbar^T x,
 *                  dx += zbar W1 + zdbar dG1
 *
 * where dG is the adjoint of the step's gradient G (after the update's and
 * the clip's adjoints), held in the workspace in the padded layout so that
 * it is a product's operand as W is, and dA the adjoint of the gradient
 * point. refresh = step: the point is W^(s), and the chunks add dA
 * straight into dW. refresh != step: the point is the anchor, W at the
 * refresh block's first step (W0 throughout with refresh = 0); the
 * recompute keeps W flat in the workspace (the forward's padded Wp) and
 * the anchor in the slots, taking W into them at each refresh block's
 * first step; the walk's chunks add into a dA of their own, which joins
 * dW at that first step (and at the end), as grad_kernel.cuh's does; the
 * retrievals at W^(s) that are not the gradient's own forward take W^(s)
 * into the slots, and the last token's at W^(s+1) takes W^(s+1). The last
 * token's retrieval (retrieve = after) is one row, on the CUDA cores.
 * Everything P-sized (checkpoints, the block's states, G, the adjoints) is
 * in a global workspace per memory; the chunk's activations, tangents and
 * adjoints are in shared memory.
 *
 * Covers (kernels/plan.c, mn_cuda_plan_backward): the rules the fused
 * forward runs, any refresh, without out_norm (qk_norm is done around the
 * kernel by kernels/grad_cuda.c, which hands it the normalised keys).
 * newton_schulz: the recompute orthogonalises the clipped G as the step
 * kernel does (the same mn_newton_schulz) in a vector of its own, and the
 * update's adjoint runs the iteration's (grad_ns_adjoint.cuh
 * mn_gprecond_adjoint) before the clip's, its scratch after the workspace
 * slice (mn_fgrad_layout_add_ns). Non-finite inputs are handled as
 * grad_kernel.cuh does: a row with a non-finite key is zeroed and its
 * adjoints cut.
 *
 * The memory model's side (the chunk buffers and slots, a chunk's pass,
 * the retrieval row's vjp) is fused_grad_model.cuh, before this file in the
 * source; this file is the run's side and the kernel.
 *
 * Checked against the CPU by tests/lua/test_grad_cuda.lua on a GPU, and
 * without one by tests/unit/test_grad_emulated.c (tests/emu/cuda_shim.h,
 * where mn_gemm is a plain loop over the same tiles). */
#ifndef MN_FUSED_GRAD_ARGS
#define MN_FUSED_GRAD_ARGS

#define MN_FUSED_GRAD_KERNEL "mn_fused_grad_kernel"

/* Offsets (floats) within one memory's workspace slice: vectors of P floats
 * (one memory's parameters, flat, in parameter order) and one padded copy
 * (Pp floats, fused_kernel.cuh's mn_pset layout). anchor (refresh != step:
 * the gradient point is the refresh block's anchor A, not W^(s)): the
 * checkpoints keep A too, and its adjoint dA has a vector of its own. */
typedef struct mn_fgrad_layout {
    long long P, Pp;
    long long ck;                /* nblocks x (W, S) or, anchor, (W, S, A) */
    long long Wb, Sb;            /* (K + 1) x P: the block's W^(s), S^(s) */
    long long Gb;                /* K x P: the block's G_s */
    long long dW, dS, dGt;       /* P each: adjoints */
    long long dA;                /* P, anchor only: the anchor's adjoint (else 0: it is dW) */
    long long dGp, Wp;           /* Pp each: dG and W^(s) padded, whole layers copied into shared memory */
    long long skip;              /* K: what each step of the block did */
    long long tmp, ns;           /* newton_schulz (mn_fgrad_layout_add_ns): the clipped G, P; doubles; else 0 */
    long long total;
} mn_fgrad_layout;

MN_SHARED_FN void mn_fgrad_layout_init(mn_fgrad_layout *lo, long long P, long long Pp, long long K, long long nblocks,
                                       int anchor)
{
    const long long P4 = (P + 3) & ~3LL; /* every vector 16-byte aligned: the products load by float4 */
    long long off = 0;
    lo->P = P;
    lo->Pp = Pp;
    lo->ck = off;
    off += nblocks * (anchor ? 3 : 2) * P4;
    lo->Wb = off;
    off += (K + 1) * P4;
    lo->Sb = off;
    off += (K + 1) * P4;
    lo->Gb = off;
    off += K * P4;
    long long *flat[] = {&lo->dW, &lo->dS, &lo->dGt};
    for (int i = 0; i < 3; i++) {
        *flat[i] = off;
        off += P4;
    }
    lo->dA = 0;
    if (anchor) {
        lo->dA = off;
        off += P4;
    }
    lo->dGp = off;
    off += (Pp + 3) & ~3LL;
    lo->Wp = off;
    off += (Pp + 3) & ~3LL;
    lo->skip = off;
    off += (K + 3) & ~3LL;
    lo->tmp = lo->ns = 0;
    lo->total = off;
}

/* Appends newton_schulz's pieces to a layout of mn_fgrad_layout_init
 * (steps 0: none): a vector of P floats for the clipped G the iteration
 * reads, then the general backward's scratch (grad_common.cuh
 * mn_grad_ns_doubles). Every piece and the total stay multiples of 4
 * floats: each memory's slice starts 16-byte aligned (the padded copies
 * are read by float4), its doubles 8. */
MN_SHARED_FN void mn_fgrad_layout_add_ns(mn_fgrad_layout *lo, int layers, long long dk, long long dv, long long dh,
                                         int steps)
{
    if (steps <= 0) return;
    lo->tmp = lo->total;
    lo->ns = lo->tmp + ((lo->P + 3) & ~3LL);
    lo->total = (lo->ns + 2 * mn_grad_ns_doubles(layers, dk, dv, dh, steps) + 3) & ~3LL;
}

#endif /* MN_FUSED_GRAD_ARGS */

#ifdef __CUDACC_RTC__

/* ---- one step of the forward, recomputed (mn_fused_step_kernel's step) ---- */

/* Step s at the gradient point in P (shared: W^(s), or the anchor when
 * refresh != step): G into G (flat), then, unless G is not finite, the clip
 * and update: S from Sin to Sout (they may be the same); W, refresh = step,
 * in P and, when Wout, flat into Wout; refresh != step, from Win to Wout
 * (flat; they may be the same), P left as the anchor. Returns MN_STEP_*; a
 * step not taken changes nothing. The same float operations as the
 * forward kernel, so the recomputed states are the run's.
 * newton_schulz: the clipped G goes into Gt (P floats), is orthogonalised
 * there (ns: its scratch) and updates from there; G stays as it was. */
__device__ int mn_fg_step_forward(const mn_grad_kargs &a, const mn_pset &P, const mn_gbuf &gb, long long m, long long s,
                                  float *G, const float *Sin, float *Sout, const float *Win, float *Wout, float *Gt,
                                  double *ns)
{
    const long long n = a.n, t0 = s * MN_STEP;
    const int grows = (int)mn_real_rows(a, m, s);
    if (grows == 0) return MN_STEP_PADDING;
    const int tid = threadIdx.x;
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV, *theta = a.theta + m * n;
    float *Gp[MN_NPARAMS];
    mn_gptrs(G, Gp);
    const mn_fbuf fb = mn_gbuf_fwd(gb);
    const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0, R = MN_FEATURE_SCALE;
    double ss[MN_NPARAMS];
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) ss[p] = 0.0;
    for (int r0 = 0; r0 < grows; r0 += MN_FR) {
        const int cr = grows - r0 < MN_FR ? grows - r0 : MN_FR;
        const long long t = t0 + r0;
        const bool first = r0 == 0, last = r0 + MN_FR >= grows;
        {
            float xr[MN_NX];
            mn_rows_fetch(xr, k + t * MN_DK, cr);
            __syncthreads(); /* the previous chunk's readers of fb.x are done */
            mn_rows_store(fb.x, xr, cr);
        }
        __syncthreads();
        mn_fused_forward<true>(P, fb, cr, [&](int r, int j, float y0, float y1) {
            *reinterpret_cast<float2 *>(fb.y + r * MN_LDV + j) = make_float2(y0, y1);
        });
        for (int e = tid; e < MN_FR * MN_PDV; e += MN_FT) {
            const int r = e / MN_PDV, j = e % MN_PDV;
            float d = 0.0f;
            if (r < cr && j < MN_DV) {
                const float yy = fb.y[r * MN_LDV + j], vv = v[(t + r) * MN_DV + j];
                const float wt = (float)((double)theta[t + r] * tscale);
                d = (float)((double)wt * R * (double)mn_hook_loss_grad(yy, vv, yy - vv));
            }
            fb.dy[r * MN_LDV + j] = d;
        }
        __syncthreads();
        mn_fused_chunk_grad(P, fb, Gp, cr, first, last, ss);
        __syncthreads();
    }
    mn_block_sums<MN_NPARAMS>(ss);
    const mn_step_control ctl = mn_step_control_of<MN_NPARAMS>(ss);
    if (!ctl.finite) return MN_STEP_SKIPPED;
    double scale[MN_NPARAMS];
    mn_clip_scales<MN_NPARAMS>(ss, ctl.gnorm, scale);
    const float e_s = a.eta[m * a.nsteps + s], keep = 1.0f - a.alpha[m * a.nsteps + s];
#if MN_PRECOND
    /* the step kernel's order: the clip, each matrix's Newton-Schulz, then momentum and decay */
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const float fs = (float)scale[p];
        const long long o = mn_goff(p);
        for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) Gt[o + e] = mn_clip_elem(Gp[p][e], fs);
        (void)fs;
    }
    __syncthreads();
    mn_gprecond_forward(Gt, ns);
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long o = mn_goff(p);
        for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) {
            const float wo = MN_P_AT_W ? *mn_pset_el(P, p, e) : Win[o + e];
            float sv = Sin[o + e];
            const float w = mn_momentum_elem(Gt[o + e], e_s, keep, &sv, wo);
            Sout[o + e] = sv;
            if (MN_P_AT_W) *mn_pset_el(P, p, e) = w;
            if (Wout) Wout[o + e] = w;
        }
    }
#else
    /* MN_FG_U elements per thread at a time, every load issued before any
     * store (as the step kernel's update, fused_step.cuh): the loop waits on
     * memory latency, not bandwidth. Each element is read and written by one
     * thread, so Sin may be Sout and Win Wout. */
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const float fs = (float)scale[p];
        const long long o = mn_goff(p);
        const int numel = (int)MN_NUMEL(p);
        for (int base = tid; base < numel; base += MN_FG_U * MN_FT) {
            float gv[MN_FG_U], sv[MN_FG_U], wv[MN_FG_U];
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT;
                gv[u] = e < numel ? Gp[p][e] : 0.0f;
                sv[u] = e < numel ? Sin[o + e] : 0.0f;
                wv[u] = e < numel ? (MN_P_AT_W ? *mn_pset_el(P, p, e) : Win[o + e]) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT;
                if (e >= numel) break;
                const float w = mn_update_elem(gv[u], fs, e_s, keep, &sv[u], wv[u]);
                Sout[o + e] = sv[u];
                if (MN_P_AT_W) *mn_pset_el(P, p, e) = w;
                if (Wout) Wout[o + e] = w;
            }
        }
        (void)fs;
    }
#endif
    (void)Gt;
    (void)ns;
    __syncthreads();
    return MN_STEP_TAKEN;
}

/* This block's pieces of the workspace. */
struct mn_fg_state {
    long long P, stride; /* floats of one memory's parameters; of a slot (P rounded up to 4) */
    float *Wb, *Sb, *Gb, *dW, *dS, *dGt, *skip;
    float *dA;        /* the anchor's adjoint: dW itself when refresh = step (the anchor is W^(s)) */
    const float *Ack; /* refresh != step: the anchor at the start of the block being walked (its checkpoint's) */
    mn_pset dGp, Wg;  /* dG and the slots' weights padded (global): what a shared slot copies */
    float *tmp;       /* newton_schulz: the clipped G (mn_fgrad_layout_add_ns), else NULL */
    double *ns;       /* and its scratch */
};

/* The gradient point of step s, block slot i (flat): W^(s) when refresh =
 * step; else the anchor, W at the last refresh block's first step if that
 * is in this block, the block's checkpointed anchor if not (refresh = 0:
 * always, W0). */
__device__ __forceinline__ const float *mn_fg_anchor_of(const mn_fg_state &g, long long s, long long i)
{
    if (MN_P_AT_W) return g.Wb + i * g.stride;
    if (MN_REFRESH > 0) {
        const long long per = MN_REFRESH > 0 ? MN_REFRESH / MN_STEP : 1, opened = s - s % per;
        if (opened >= s - i) return g.Wb + (i - (s - opened)) * g.stride;
    }
    return g.Ack;
}

/* ---- the update's and the clip's adjoints ---- */

/* grad_kernel.cuh's update adjoint, its mn_vdot's and mn_gclip_adjoint, in
 * two passes over the parameters instead of eight: the first forms dGt =
 * -(dS + dW), the new dW = (1 - alpha) dW and dS = eta (dS + dW), and the
 * sums deta, dalpha and per parameter <dGt, G>, <G, G>; the second writes
 * dG (sc dGt + sc'(n) <dGt, G> / n G for a scale clip, clip'(G) dGt for an
 * elementwise one) straight into the padded dGp, whose padding stays 0.
 * newton_schulz: between the two, dGt goes back through the iteration
 * (mn_gprecond_adjoint on the clipped G, recomputed into g.tmp with the
 * clip's scales from G's norms as the step's forward takes them), and
 * <dGt, G> is taken after it. */
__device__ void mn_fg_update_adjoint(const mn_grad_kargs &a, const mn_fg_state &g, long long m, long long s,
                                     const float *G, const float *Snow, const float *Wnow)
{
    const int tid = threadIdx.x;
    const float e_s = a.eta[m * a.nsteps + s], keep = 1.0f - a.alpha[m * a.nsteps + s];
    double deta = 0.0, dalpha = 0.0, dot[MN_NPARAMS], gg[MN_NPARAMS];
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long o = mn_goff(p), ne = MN_NUMEL(p);
        double dp = 0.0, gp = 0.0;
        for (long long base = o + tid; base < o + ne; base += MN_FG_U * MN_FT) {
            float dSv[MN_FG_U], dWv[MN_FG_U], Sv[MN_FG_U], Gv[MN_FG_U], Wv[MN_FG_U];
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const long long e = base + u * MN_FT;
                const bool in = e < o + ne;
                dSv[u] = in ? g.dS[e] : 0.0f;
                dWv[u] = in ? g.dW[e] : 0.0f;
                Sv[u] = in ? Snow[e] : 0.0f;
                Gv[u] = in ? G[e] : 0.0f;
                Wv[u] = in ? Wnow[e] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const long long e = base + u * MN_FT;
                if (e >= o + ne) break;
                const float dS = dSv[u], dW = dWv[u];
                /* the adjoint of S^(s+1) is dS + dW (both uses) */
                deta += (double)dS * (double)Sv[u] + (double)dW * (double)Sv[u];
                dalpha -= (double)dW * (double)Wv[u];
                const float dSt = __fadd_rn(dS, dW);
                g.dGt[e] = -dSt;
                g.dW[e] = __fmul_rn(dW, keep);
                g.dS[e] = __fmul_rn(e_s, dSt);
                dp += -(double)dSt * (double)Gv[u]; /* newton_schulz: taken again below */
                gp += (double)Gv[u] * (double)Gv[u];
            }
        }
        dot[p] = dp;
        gg[p] = gp;
    }
    deta = mn_block_sum(deta);
    dalpha = mn_block_sum(dalpha);
    if (tid == 0) {
        a.geta[m * a.nsteps + s] = (float)deta;
        a.galpha[m * a.nsteps + s] = (float)dalpha;
    }
    MN_PROF_MARK(4);
#if MN_CLIP_MODE == 1 || MN_PRECOND
    mn_block_sums<MN_NPARAMS>(gg);
#endif
#if MN_PRECOND
    {
        double scale[MN_NPARAMS], total = 0.0;
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) total += gg[p];
        mn_clip_scales<MN_NPARAMS>(gg, sqrt(total), scale);
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            const float fs = (float)scale[p];
            const long long o = mn_goff(p);
            for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) g.tmp[o + e] = mn_clip_elem(G[o + e], fs);
            (void)fs;
        }
        __syncthreads();
        mn_gprecond_adjoint(g.tmp, g.dGt, g.ns);
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            const long long o = mn_goff(p), ne = MN_NUMEL(p);
            double dp = 0.0;
            for (long long e = o + tid; e < o + ne; e += MN_FT) dp += (double)g.dGt[e] * (double)G[e];
            dot[p] = dp;
        }
    }
#endif
#if MN_CLIP_MODE == 1
    mn_block_sums<MN_NPARAMS>(dot);
    double tdot = 0.0, tgg = 0.0;
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) tdot += dot[p], tgg += gg[p];
#endif
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long o = mn_goff(p);
        const int ne = (int)MN_NUMEL(p);
#if MN_CLIP_MODE == 1
        const double nrm = sqrt(MN_CLIP_TENSOR ? gg[p] : tgg), sc = mn_hook_clip_scale(nrm);
        const double through = nrm > 0 ? mn_ghook_clip_dscale(nrm) * (MN_CLIP_TENSOR ? dot[p] : tdot) / nrm : 0.0;
#endif
        for (int base = tid; base < ne; base += MN_FG_U * MN_FT) {
            float dGtv[MN_FG_U], Gv[MN_FG_U];
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT;
                dGtv[u] = e < ne ? g.dGt[o + e] : 0.0f;
                Gv[u] = e < ne ? G[o + e] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT;
                if (e >= ne) break;
                const float dGt = dGtv[u];
#if MN_CLIP_MODE == 1
                const float d = (float)(sc * (double)dGt + through * (double)Gv[u]);
#elif MN_CLIP_MODE == 2
                const float d = (float)((double)dGt * mn_ghook_clip_delem((double)Gv[u]));
#else
                const float d = dGt;
#endif
                *mn_pset_el(g.dGp, p, e) = d;
            }
            (void)Gv;
        }
    }
    __syncthreads();
    MN_PROF_MARK(5);
}

/* ---- the reverse of step s, block slot i (grad_kernel.cuh's mn_gstep_reverse) ---- */

/* refresh != step: dW += dA, dA = 0 at a refresh block's first step, where
 * the anchor is W^(s) (grad_cpu.c step_reverse). */
__device__ void mn_fg_join_anchor(const mn_fg_state &g, long long s)
{
    if (MN_P_AT_W || !mn_refresh_start(s)) return;
    for (long long e = threadIdx.x; e < g.P; e += MN_FT) {
        g.dW[e] += g.dA[e];
        g.dA[e] = 0.0f;
    }
    __syncthreads();
}

/* at_next: the slots hold W^(s+1) on entry (always, refresh = step).
 * Returns whether they hold W^(s) on return: step s - 1's at_next. */
__device__ bool mn_fg_step_reverse(const mn_grad_kargs &a, const mn_fg_state &g, const mn_pset &P, const mn_gbuf &gb,
                                   long long m, long long s, long long i, int code, bool at_next)
{
    const long long n = a.n, t0 = s * MN_STEP;
    const int rows = (int)mn_steps_rows(n, s), grows = (int)mn_real_rows(a, m, s);
    if (code == MN_STEP_PADDING) { /* the identity (W^(s) = W^(s+1)); y = 0 and loss = 0 are constants */
        mn_fg_join_anchor(g, s);
        return at_next;
    }
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV;
    const float *xq = a.q ? a.q + m * n * MN_DK : k;
    float *gk = a.gk + m * n * MN_DK, *gv = a.gv + m * n * MN_DV;
    float *gxq = a.q ? a.gq + m * n * MN_DK : gk;
    float *gtheta = a.gtheta + m * n;
    const float *dy = a.dy ? a.dy + m * n * MN_DV : 0, *dloss = a.dloss ? a.dloss + m * n : 0;
    const float *theta = a.theta + m * n;
    const long long st = g.stride;
    const float *Wnow = g.Wb + i * st, *Snow = g.Sb + i * st, *G = g.Gb + i * st;
    /* the gradient point is W^(s) (refresh = step, or a refresh block's first step) */
    const bool at_w = MN_P_AT_W || mn_refresh_start(s);

    MN_PROF_MARK(0);
    /* the retrieval of the step's last token at W^(s+1) (retrieve = after):
     * refresh = step, the slots hold it (step s + 1's point, or the block's
     * recompute's last W); else unless step s + 1 left it there, it comes in */
    if (dy && !MN_RETRIEVE_BEFORE && grows == rows) {
        const long long t = t0 + rows - 1;
        if (!MN_P_AT_W && !at_next) {
            mn_fg_load_w(P, g.Wg, g.Wb + (i + 1) * st);
            __syncthreads();
        }
        mn_fg_row_vjp(P, xq + t * MN_DK, dy + t * MN_DV, g.dW, gxq + t * MN_DK, gb);
    }
    MN_PROF_MARK(1);
    const bool skipped = code == MN_STEP_SKIPPED;
    if (!skipped) mn_fg_update_adjoint(a, g, m, s, G, Snow, Wnow);
    /* the gradient point padded into the workspace, then into the shared
     * slots: the products' weights */
    mn_fg_load_w(P, g.Wg, mn_fg_anchor_of(g, s, i));
    __syncthreads();
    MN_PROF_MARK(7);
    /* the chunks add the point's adjoint into dA (dW when refresh = step) */
    float *dAp[MN_NPARAMS];
    mn_gptrs(g.dA, dAp);

    /* the rows that see W^(s): with q = k and the point at W^(s) their
     * retrieval is the step's own forward */
    int before = MN_RETRIEVE_BEFORE ? rows : rows - 1;
    if (before > grows) before = grows; /* padding rows read y = 0 */
    const bool merged = dy && before > 0 && !a.q && at_w;
    if (!skipped || dloss || merged) {
        const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
        for (int r0 = 0; r0 < grows; r0 += MN_FR) {
            const int cr = grows - r0 < MN_FR ? grows - r0 : MN_FR;
            const long long t = t0 + r0;
            MN_PROF_MARK(0);
            mn_fg_load_rows(gb, k + t * MN_DK, cr);
            MN_PROF_MARK(8);
            mn_fg_chunk_args c;
            c.dG = skipped ? 0 : &g.dGp;
            c.loss = true;
            c.v = v + t * MN_DV;
            c.theta = theta + t;
            c.dloss = dloss ? dloss + t : 0;
            c.tscale = tscale;
            c.dyret = merged ? dy + t * MN_DV : 0;
            c.ret = before - r0 < 0 ? 0 : (before - r0 < cr ? before - r0 : cr);
            c.gx = gk + t * MN_DK;
            c.gv = gv + t * MN_DV;
            c.gtheta = gtheta + t;
            c.dA = dAp;
            c.first = false;
            mn_fg_chunk(P, g.Wg, gb, cr, c);
        }
    }
    if (dy && before > 0 && !merged) {
        /* the retrieval at W^(s), into dW: where the point is an anchor,
         * W^(s) comes into the slots */
        float *dWp[MN_NPARAMS];
        mn_gptrs(g.dW, dWp);
        if (!at_w) {
            mn_fg_load_w(P, g.Wg, Wnow);
            __syncthreads();
        }
        for (int r0 = 0; r0 < before; r0 += MN_FR) {
            const int cr = before - r0 < MN_FR ? before - r0 : MN_FR;
            const long long t = t0 + r0;
            mn_fg_load_rows(gb, xq + t * MN_DK, cr);
            mn_fg_chunk_args c;
            c.dG = 0;
            c.loss = false;
            c.v = c.theta = c.dloss = 0;
            c.tscale = 1.0;
            c.dyret = dy + t * MN_DV;
            c.ret = cr;
            c.gx = gxq + t * MN_DK;
            c.gv = c.gtheta = 0;
            c.dA = dWp;
            c.first = false;
            mn_fg_chunk(P, g.Wg, gb, cr, c);
        }
    }
    mn_fg_join_anchor(g, s);
    MN_PROF_MARK(16);
    return at_w || (dy && before > 0 && !merged);
}

/* One memory's backward (grad_kernel.cuh's mn_grad_kernel). */
extern "C" __global__ void __launch_bounds__(MN_FT, 1) mn_fused_grad_kernel(const mn_grad_kargs a)
{
    MN_DYNAMIC_SMEM(mn_smem4);
    const long long m = blockIdx.x, K = a.K;
    const int tid = threadIdx.x;
    MN_PROF_START();

    /* shared memory: W^(s) padded, then the chunk buffers (kernels/plan.c
     * mn_fused_grad_smem_bytes counts the same) */
    float *sp = (float *)mn_smem4;
    mn_pset P;
    sp = mn_pset_init(&P, sp);
    mn_gbuf gb;
    gb.x = sp;
    sp += MN_FR * MN_LDK;
#if MN_LAYERS == 2
    gb.z = sp;
    sp += MN_FR * MN_LDH;
    gb.h = sp;
    sp += MN_FR * MN_LDH;
    gb.zd = sp;
    sp += MN_FR * MN_LDH;
    gb.hd = sp;
    sp += MN_FR * MN_LDH;
#else
    gb.z = gb.h = gb.zd = gb.hd = 0;
#endif
    gb.y = sp;
    sp += MN_FR * MN_LDV;
    gb.u = sp;
    sp += MN_FR * MN_LDV;
    gb.dy = sp;
    sp += MN_FR * MN_LDV;
    gb.bad = sp;

    const long long Pn = mn_goff(MN_NPARAMS);
    mn_fgrad_layout lo;
    mn_fgrad_layout_init(&lo, Pn, mn_pset_floats(), K, a.nblocks, !MN_P_AT_W);
    mn_fgrad_layout_add_ns(&lo, MN_LAYERS, MN_DK, MN_DV, MN_DH, MN_PRECOND ? MN_NS_STEPS : 0);
    float *base = a.work + m * a.work_floats;
    mn_fg_state g;
    g.P = Pn;
    g.stride = (Pn + 3) & ~3LL;
    g.Wb = base + lo.Wb;
    g.Sb = base + lo.Sb;
    g.Gb = base + lo.Gb;
    g.dW = base + lo.dW;
    g.dS = base + lo.dS;
    g.dGt = base + lo.dGt;
    g.dA = MN_P_AT_W ? g.dW : base + lo.dA;
    g.Ack = 0;
    g.skip = base + lo.skip;
    g.tmp = lo.tmp ? base + lo.tmp : 0;
    g.ns = lo.ns ? (double *)(base + lo.ns) : 0;
    mn_pset_init(&g.dGp, base + lo.dGp);
    mn_pset_init(&g.Wg, base + lo.Wp);
    mn_vzero(base + lo.dGp, lo.Pp); /* the padding of dG is never written after */
    const long long P4 = g.stride, parts = MN_P_AT_W ? 2 : 3;
    float *ck = base + lo.ck;

    /* 1. from the initial state, the checkpoints at the first step of every
     * block (the last block is recomputed in 2 anyway). The slots hold the
     * gradient point: W (refresh = step), or the anchor, W0 until a refresh
     * block opens, with W flat in Wb's first slot (fused_step.cuh's Wp) */
    {
        float *w0[MN_NPARAMS];
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) w0[p] = (float *)a.W0[p] + m * MN_NUMEL(p);
        mn_pset_from(P, w0);
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            const long long ne = MN_NUMEL(p), o = mn_goff(p);
            for (long long e = tid; e < ne; e += MN_FT) {
                g.Sb[o + e] = a.S0[p][m * ne + e];
                if (!MN_P_AT_W) g.Wb[o + e] = a.W0[p][m * ne + e];
            }
        }
        __syncthreads();
    }
    MN_PROF_MARK(0);
    const long long last = (a.nblocks - 1) * K;
    for (long long s = 0; s <= last; s++) {
        if (s % K == 0) {
            /* (W, S, A) before step s's refresh, as grad_kernel.cuh keeps them */
            float *cw = ck + (s / K) * parts * P4, *cs = cw + P4, *cp[MN_NPARAMS];
            mn_gptrs(MN_P_AT_W ? cw : cw + 2 * P4, cp);
            mn_pset_to(cp, P);
            if (!MN_P_AT_W) mn_vcopy(cw, g.Wb, Pn);
            mn_vcopy(cs, g.Sb, Pn);
        }
        if (s == last) break;
        if (!MN_P_AT_W && mn_refresh_start(s)) { /* a new refresh block: the anchor becomes W^(s) */
            float *wp[MN_NPARAMS];
            mn_gptrs(g.Wb, wp);
            mn_pset_from(P, wp);
            __syncthreads();
        }
        mn_fg_step_forward(a, P, gb, m, s, g.Gb, g.Sb, g.Sb, g.Wb, MN_P_AT_W ? 0 : g.Wb, g.tmp, g.ns);
    }
    MN_PROF_MARK(17);
    /* adjoints of the final tensors */
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = tid; e < ne; e += MN_FT) {
            g.dW[o + e] = a.dWf[p] ? a.dWf[p][m * ne + e] : 0.0f;
            g.dS[o + e] = a.dSf[p] ? a.dSf[p][m * ne + e] : 0.0f;
            if (!MN_P_AT_W) g.dA[o + e] = 0.0f;
        }
    }
    __syncthreads();
    /* 2. blocks in reverse */
    for (long long b = a.nblocks - 1; b >= 0; b--) {
        const float *cw = ck + b * parts * P4, *cs = cw + P4;
        g.Ack = MN_P_AT_W ? 0 : cw + 2 * P4;
        mn_vcopy(g.Wb, cw, Pn);
        mn_vcopy(g.Sb, cs, Pn);
        {
            float *wp[MN_NPARAMS];
            mn_gptrs((float *)(MN_P_AT_W ? cw : g.Ack), wp);
            mn_pset_from(P, wp);
        }
        __syncthreads();
        const long long s0 = b * K, len = s0 + K <= a.nsteps ? K : a.nsteps - s0;
        for (long long i = 0; i < len; i++) {
            float *Sn = g.Sb + (i + 1) * P4, *Wn = g.Wb + (i + 1) * P4;
            if (!MN_P_AT_W && mn_refresh_start(s0 + i)) {
                float *wp[MN_NPARAMS];
                mn_gptrs(g.Wb + i * P4, wp);
                mn_pset_from(P, wp);
                __syncthreads();
            }
            const int code =
                mn_fg_step_forward(a, P, gb, m, s0 + i, g.Gb + i * P4, g.Sb + i * P4, Sn, g.Wb + i * P4, Wn, g.tmp,
                                   g.ns);
            if (code != MN_STEP_TAKEN) {
                for (long long e = tid; e < Pn; e += MN_FT) {
                    Sn[e] = g.Sb[i * P4 + e];
                    Wn[e] = g.Wb[i * P4 + e];
                }
            }
            if (tid == 0) g.skip[i] = (float)code;
            __syncthreads();
        }
        MN_PROF_MARK(18);
        MN_PROF_MARK(0);
        /* the recompute leaves W^(s0 + len) in the slots, or (refresh != step) an anchor */
        bool at_next = MN_P_AT_W;
        for (long long i = len - 1; i >= 0; i--)
            at_next = mn_fg_step_reverse(a, g, P, gb, m, s0 + i, i, (int)g.skip[i], at_next);
        MN_PROF_MARK(0);
    }
#ifdef MN_PROFILE
    mn_prof_print("MN_FG_PROFILE", NULL, MN_PROFILE_PHASES);
#endif
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = tid; e < ne; e += MN_FT) {
            /* refresh = 0: the anchor is W0 throughout, its adjoint never joined */
            a.gW[p][m * ne + e] = MN_P_AT_W ? g.dW[o + e] : g.dW[o + e] + g.dA[o + e];
            a.gS[p][m * ne + e] = g.dS[o + e];
        }
    }
}

#endif /* __CUDACC_RTC__ */
