/* fused_grad.cuh: the backward of a run (SPEC.md section 7) on the fused
 * per-memory path. The same algorithm as the general backward
 * (grad_kernel.cuh, whose arguments, flat-vector helpers and clip adjoint
 * it takes, and which model/grad_cpu.c states plainly): checkpoints of
 * (W, S) every K steps, each block of K steps recomputed from its
 * checkpoint keeping W^(s), S^(s) and G_s, then walked in reverse with the
 * adjoints dW, dS. What changes is where the work runs: as in the fused
 * forward (fused_kernel.cuh), one persistent block per memory holds the
 * weights W^(s) in shared memory, zero-padded to whole tensor-core tiles,
 * and every product of a chunk of token rows is an mma.sync product in the
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
 * point, which (refresh = step: the point is W^(s)) joins dW after the
 * step. The last token's retrieval at W^(s+1) (retrieve = after) is one
 * row, on the CUDA cores. Everything P-sized (checkpoints, the block's
 * states, G, the adjoints) is in a global workspace per memory; the chunk's
 * activations, tangents and adjoints are in shared memory.
 *
 * Covers (kernels/plan.c, mn_fused_grad_fit): the rules the fused forward
 * runs with refresh = step and neither out_norm, qk_norm nor
 * newton_schulz. Non-finite inputs are handled as grad_kernel.cuh does: a
 * row with a non-finite key is zeroed and its adjoints cut.
 *
 * Checked against the CPU by tests/lua/test_grad_cuda.lua on a GPU, and
 * without one by tests/unit/test_grad_emulated.c (tests/emu/cuda_shim.h,
 * where mn_gemm is a plain loop over the same tiles). */
#ifndef MN_FUSED_GRAD_ARGS
#define MN_FUSED_GRAD_ARGS

#define MN_FUSED_GRAD_KERNEL "mn_fused_grad_kernel"

/* Offsets (floats) within one memory's workspace slice: vectors of P floats
 * (one memory's parameters, flat, in parameter order) and one padded copy
 * (Pp floats, fused_kernel.cuh's mn_pset layout). */
typedef struct mn_fgrad_layout {
    long long P, Pp;
    long long ck;                /* nblocks x (W, S) */
    long long Wb, Sb;            /* (K + 1) x P: the block's W^(s), S^(s) */
    long long Gb;                /* K x P: the block's G_s */
    long long dW, dS, dA, dGt, dG; /* P each: adjoints */
    long long dGp, Wp;           /* Pp each: dG and W^(s) padded, whole layers copied into shared memory */
    long long skip;              /* K: what each step of the block did */
    long long total;
} mn_fgrad_layout;

MN_SHARED_FN void mn_fgrad_layout_init(mn_fgrad_layout *lo, long long P, long long Pp, long long K, long long nblocks)
{
    const long long P4 = (P + 3) & ~3LL; /* every vector 16-byte aligned: the products load by float4 */
    long long off = 0;
    lo->P = P;
    lo->Pp = Pp;
    lo->ck = off;
    off += nblocks * 2 * P4;
    lo->Wb = off;
    off += (K + 1) * P4;
    lo->Sb = off;
    off += (K + 1) * P4;
    lo->Gb = off;
    off += K * P4;
    long long *flat[] = {&lo->dW, &lo->dS, &lo->dA, &lo->dGt, &lo->dG};
    for (int i = 0; i < 5; i++) {
        *flat[i] = off;
        off += P4;
    }
    lo->dGp = off;
    off += (Pp + 3) & ~3LL;
    lo->Wp = off;
    off += (Pp + 3) & ~3LL;
    lo->skip = off;
    off += (K + 3) & ~3LL;
    lo->total = off;
}

#endif /* MN_FUSED_GRAD_ARGS */

#ifdef __CUDACC_RTC__

/* The dynamic shared memory (the emulation's shim gives its own). */
#ifndef MN_DYNAMIC_SMEM
#define MN_DYNAMIC_SMEM(name) extern __shared__ float4 name[]
#endif

/* MNEMO_FG_PROFILE=1 (plan.c adds MN_FG_PROFILE): block 0's thread 0 adds
 * the clock cycles between marks to the phase counters, printed at the end. */
#ifdef MN_FG_PROFILE
__device__ long long mn_fg_prof[24], mn_fg_last;
#define MN_FG_MARK(i)                                                                                                 \
    do {                                                                                                              \
        if (threadIdx.x == 0 && blockIdx.x == 0) {                                                                    \
            const long long now_ = clock64();                                                                         \
            mn_fg_prof[i] += now_ - mn_fg_last;                                                                       \
            mn_fg_last = now_;                                                                                        \
        }                                                                                                             \
    } while (0)
#else
#define MN_FG_MARK(i) ((void)0)
#endif

/* Floats of one padded parameter set (mn_pset_init's carve-up). */
__device__ __forceinline__ long long mn_pset_floats()
{
    long long f = 0;
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) f += (long long)MN_LPOUT(i) * MN_LLD(i) + (MN_BIAS ? MN_LPOUT(i) : 0);
    return f;
}

/* The backward's chunk buffers in shared memory, [MN_FR x ld] each. */
struct mn_gbuf {
    float *x;        /* the rows' inputs (a non-finite row zeroed) */
    float *z, *h;    /* forward; h then hbar, then zbar */
    float *zd, *hd;  /* tangent; hd then hdbar, then zdbar */
    float *y, *u;    /* y then ybar; the tangent's output */
    float *dy;       /* ubar = theta R f'(y, v) */
    float *bad;      /* [MN_FR]: 1 where the row's x is not finite */
};

/* The forward's chunk view of the same buffers (mn_fused_forward's). */
__device__ __forceinline__ mn_fbuf mn_gbuf_fwd(const mn_gbuf &gb)
{
    mn_fbuf fb;
    fb.x = gb.x;
    fb.z = gb.z;
    fb.h = gb.h;
    fb.y = gb.y;
    fb.dy = gb.dy;
    fb.xs = fb.hs = fb.ys = fb.lrow = 0;
    return fb;
}

/* Layer i's padded weights and bias (contiguous in a pset) from src into
 * dst by float4s: the shared slot of a layer takes W's or dG's in turn.
 * The caller's barriers fence it. */
__device__ __forceinline__ void mn_fg_copy_layer(const mn_pset &dst, const mn_pset &src, int i)
{
    const int n4 = (MN_LPOUT(i) * MN_LLD(i) + (MN_BIAS ? MN_LPOUT(i) : 0)) / 4;
    constexpr int U = 4; /* loads in flight per thread before their stores: the copy waits on latency, not bandwidth */
    float4 *d = reinterpret_cast<float4 *>(dst.w[i]);
    const float4 *sv = reinterpret_cast<const float4 *>(src.w[i]);
    for (int e0 = threadIdx.x; e0 < n4; e0 += U * MN_FT) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MN_FT < n4) v[u] = sv[e0 + u * MN_FT];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MN_FT < n4) d[e0 + u * MN_FT] = v[u];
    }
}

/* W^(s) from its flat copy (global) into the shared slots and the padded
 * global copy the slots take it back from, in one pass. */
__device__ void mn_fg_load_w(const mn_pset &P, const mn_pset &Wg, const float *Wflat)
{
    float *src[MN_NPARAMS];
    mn_gptrs((float *)Wflat, src);
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_LIN(i), no = MN_LOUT(i), ld = MN_LLD(i);
        const float *w = src[i * MN_PER];
        for (int e = threadIdx.x; e < MN_LPOUT(i) * ld; e += MN_FT) {
            const int o = e / ld, j = e % ld;
            const float v = (o < no && j < ni) ? w[o * ni + j] : 0.0f;
            P.w[i][e] = v;
            Wg.w[i][e] = v;
        }
        if (MN_BIAS) {
            const float *b = src[i * MN_PER + 1];
            for (int o = threadIdx.x; o < MN_LPOUT(i); o += MN_FT) {
                const float v = o < no ? b[o] : 0.0f;
                P.b[i][o] = v;
                Wg.b[i][o] = v;
            }
        }
    }
}

/* Rows [0, cr) of x (global, dk floats a row) into gb.x, zero beyond; a row
 * with a non-finite entry is zeroed and marked in gb.bad. Starts and ends
 * with a barrier. */
__device__ void mn_fg_load_rows(const mn_gbuf &gb, const float *x, int cr)
{
    float xr[MN_NX];
    mn_rows_fetch(xr, x, cr);
    __syncthreads();
    mn_rows_store(gb.x, xr, cr);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < MN_FR; r += MN_FWARPS) {
        bool bad = false;
        for (int j = lane; j < MN_DK; j += 32) bad = bad || !isfinite(gb.x[r * MN_LDK + j]);
        bad = __any_sync(0xffffffffu, bad);
        if (bad)
            for (int j = lane; j < MN_DK; j += 32) gb.x[r * MN_LDK + j] = 0.0f;
        if (lane == 0) gb.bad[r] = bad ? 1.0f : 0.0f;
    }
    __syncthreads();
}

/* ---- one step of the forward, recomputed (mn_fused_step_kernel's step) ---- */

/* Step s at the weights in P (shared: W^(s)): G into G (flat), then, unless
 * G is not finite, the clip and update: S from Sin to Sout (they may be the
 * same), W in P and, when Wout, flat into Wout. Returns MN_STEP_*; a step
 * not taken leaves P, Sin and Sout as they were. The same float operations
 * as the forward kernel, so the recomputed states are the run's. */
__device__ int mn_fg_step_forward(const mn_grad_kargs &a, const mn_pset &P, const mn_gbuf &gb, long long m, long long s,
                                  float *G, const float *Sin, float *Sout, float *Wout)
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
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const float fs = (float)scale[p];
        const long long o = mn_goff(p);
        for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) {
            float *wp = mn_pset_el(P, p, e);
            float sv = Sin[o + e];
            const float w = mn_update_elem(Gp[p][e], fs, e_s, keep, &sv, *wp);
            Sout[o + e] = sv;
            *wp = w;
            if (Wout) Wout[o + e] = w;
        }
        (void)fs;
    }
    __syncthreads();
    return MN_STEP_TAKEN;
}

/* ---- the memory model's adjoints on one chunk (grad_kernel.cuh's mn_gstep_adjoint) ---- */

/* What one chunk pass computes. */
struct mn_fg_chunk_args {
    const mn_pset *dG;      /* the tangent's direction (padded, global), or NULL: none */
    bool loss;              /* the loss's terms (ubar, ybar from dloss and the tangent, gv, gtheta) */
    const float *v, *theta, *dloss; /* the chunk's rows (dloss may be NULL) */
    double tscale;
    const float *dyret;     /* upstream of outputs that read M(x; P) on the first ret rows, or NULL */
    int ret;
    float *gx, *gv, *gtheta; /* the rows' gradients (+=) */
    float *const *dA;       /* adjoint of P, flat per parameter: written (first) or added to */
    bool first;
};

/* Pairs of a product's output tile into an adjoint of P (flat [rows x cols]):
 * the value before (unless first) comes in through pre, the sum is stored. */
__device__ __forceinline__ mn_gacc mn_fg_acc(float *g, int rows, int cols, bool first)
{
    const mn_gacc acc = {g, rows, cols, first, false, 0};
    return acc;
}

/* Adds a product's tile into rows of a global gradient [rows x MN_DK]. */
struct mn_fg_add_rows {
    float *g;
    int rows;
    __device__ __forceinline__ void operator()(int r, int j, float a0, float a1) const
    {
        if (r >= rows) return;
        if (j < MN_DK) g[(long long)r * MN_DK + j] += a0;
        if (j + 1 < MN_DK) g[(long long)r * MN_DK + j + 1] += a1;
    }
};

/* The chunk's cr rows, x already in gb.x (mn_fg_load_rows): forward at P,
 * tangent with dG, the loss's seeds, and the reverse into dA and the rows'
 * gradients. P's shared slots hold W^(s) on entry and on return; with a
 * tangent, a layer's slot takes dG's copy of the layer (from c.dG, global)
 * while its products need it and W's back (from Wg, global) after: two
 * copies of each layer a chunk, in place of products that would read dG
 * from global memory at its latency. Ends with a barrier. */
__device__ void mn_fg_chunk(const mn_pset &P, const mn_pset &Wg, const mn_gbuf &gb, int cr, const mn_fg_chunk_args &c)
{
    const int tid = threadIdx.x, lane = tid & 31;
    const double R = MN_FEATURE_SCALE;
    const bool tangent = c.dG != 0;
    const mn_fbuf fb = mn_gbuf_fwd(gb);
    MN_FG_MARK(9);
    /* z stays z: the adjoint's phi' and phi'' take it in double */
    mn_fused_forward<false>(P, fb, cr, [&](int r, int j, float y0, float y1) {
        *reinterpret_cast<float2 *>(gb.y + r * MN_LDV + j) = make_float2(y0, y1);
    });
    MN_FG_MARK(10);

    /* the tangent u = J_P(y) dG; the slots end as (dG1, dG2) */
    if (tangent) {
        mn_fg_copy_layer(P, *c.dG, 0);
        __syncthreads();
#if MN_LAYERS == 2
        mn_gemm<MN_FR, MN_PDH, MN_PDK, false, false>(gb.x, MN_LDK, P.w[0], MN_LLD(0),
                                                     [&](int r, int j, float a0, float a1) {
            const float zd[2] = {MN_BIAS ? __fadd_rn(P.b[0][j], a0) : a0, MN_BIAS ? __fadd_rn(P.b[0][j + 1], a1) : a1};
            float hd[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                hd[i] = r < cr && j + i < MN_DH
                            ? (float)(mn_ghook_act_d((double)gb.z[r * MN_LDH + j + i]) * (double)zd[i])
                            : 0.0f;
            *reinterpret_cast<float2 *>(gb.zd + r * MN_LDH + j) = make_float2(zd[0], zd[1]);
            *reinterpret_cast<float2 *>(gb.hd + r * MN_LDH + j) = make_float2(hd[0], hd[1]);
        });
        __syncthreads();
        MN_FG_MARK(19);
        /* u = hd W2^T, then + h dG2^T + db2: the same tiles, so the second
         * product's pre reads what this thread stored */
        mn_gemm<MN_FR, MN_PDV, MN_PDH, false, false>(gb.hd, MN_LDH, P.w[1], MN_LLD(1),
                                                     [&](int r, int j, float a0, float a1) {
            *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
        });
        __syncthreads();
        mn_fg_copy_layer(P, *c.dG, 1);
        __syncthreads();
        MN_FG_MARK(20);
        mn_gemm<MN_FR, MN_PDV, MN_PDH, false, false>(
            gb.h, MN_LDH, P.w[1], MN_LLD(1),
            [&](int r, int j, float a0, float a1) {
                if (MN_BIAS) a0 = __fadd_rn(a0, P.b[1][j]), a1 = __fadd_rn(a1, P.b[1][j + 1]);
                *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
            },
            [&](int r, int j) { return *reinterpret_cast<const float2 *>(gb.u + r * MN_LDV + j); });
#else
        mn_gemm<MN_FR, MN_PDV, MN_PDK, false, false>(gb.x, MN_LDK, P.w[0], MN_LLD(0),
                                                     [&](int r, int j, float a0, float a1) {
            if (MN_BIAS) a0 = __fadd_rn(P.b[0][j], a0), a1 = __fadd_rn(P.b[0][j + 1], a1);
            *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
        });
#endif
        __syncthreads();
    }
    MN_FG_MARK(11);

    /* the seeds, a warp per row (grad_kernel.cuh's loss loop, term for term):
     * ybar into gb.y, ubar into gb.dy, zero on rows past cr and cut rows */
    for (int r = tid >> 5; r < MN_FR; r += MN_FWARPS) {
        float *yr = gb.y + r * MN_LDV, *ur = gb.dy + r * MN_LDV;
        const float *u = gb.u + r * MN_LDV;
        if (r >= cr) {
            for (int j = lane; j < MN_PDV; j += 32) yr[j] = ur[j] = 0.0f;
            continue;
        }
        const bool xbad = gb.bad[r] != 0.0f;
        bool cut = xbad;
        if (c.loss && !cut) {
            const float *vr = c.v + (long long)r * MN_DV;
            bool vfinite = true;
            for (int j = lane; j < MN_DV; j += 32) vfinite = vfinite && isfinite(vr[j]);
            vfinite = __all_sync(0xffffffffu, vfinite);
            if (!vfinite) {
                bool dbad = false;
                for (int j = lane; j < MN_DV; j += 32) {
                    const double yy = yr[j], vv = vr[j];
                    dbad = dbad || !isfinite(mn_ghook_loss_dy(yy, vv, yy - vv));
                }
                cut = __any_sync(0xffffffffu, dbad);
            }
        }
        const float *dyr = c.dyret && r < c.ret && !xbad ? c.dyret + (long long)r * MN_DV : 0;
        if (!c.loss || cut) {
            for (int j = lane; j < MN_PDV; j += 32) {
                const float yb = dyr && j < MN_DV ? dyr[j] : 0.0f;
                if (MN_RESIDUAL && j < MN_DV) c.gx[(long long)r * MN_DK + j] += yb; /* dk = dv */
                yr[j] = yb;
                ur[j] = 0.0f;
            }
            continue;
        }
        const float *vr = c.v + (long long)r * MN_DV;
        const float wt = tangent ? (float)((double)c.theta[r] * c.tscale) : 0.0f;
        const double dl = c.dloss ? (double)c.dloss[r] : 0.0;
        double acc = 0.0;
        float ybv[(MN_PDV + 31) / 32], ubv[(MN_PDV + 31) / 32];
#pragma unroll
        for (int q = 0; q < (MN_PDV + 31) / 32; q++) {
            const int j = lane + 32 * q;
            ybv[q] = ubv[q] = 0.0f;
            if (j < MN_DV) {
                const double yy = yr[j], vv = vr[j], d = mn_ghook_loss_dy(yy, vv, yy - vv);
                if (tangent) ubv[q] = (float)((double)wt * R * d);
                ybv[q] = (float)(dl * R * d);
                if (tangent) acc += d * (double)u[j];
            }
        }
        if (tangent) {
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            const float gweight = (float)(R * acc);
            if (lane == 0) c.gtheta[r] += (float)(c.tscale * (double)gweight);
        }
#pragma unroll
        for (int q = 0; q < (MN_PDV + 31) / 32; q++) {
            const int j = lane + 32 * q;
            if (j < MN_DV) {
                const double yy = yr[j], vv = vr[j];
                float *gvj = c.gv + (long long)r * MN_DV + j;
                if (tangent) {
                    ybv[q] += (float)((double)wt * R * mn_ghook_loss_dyy(yy, vv, yy - vv) * (double)u[j]);
                    *gvj += (float)((double)wt * R * mn_ghook_loss_dyv(yy, vv, yy - vv) * (double)u[j]);
                }
                if (c.dloss) *gvj += (float)(dl * R * mn_ghook_loss_dv(yy, vv, yy - vv));
                if (dyr) ybv[q] += dyr[j];
                if (MN_RESIDUAL) c.gx[(long long)r * MN_DK + j] += ybv[q];
            }
            if (j < MN_PDV) {
                yr[j] = ybv[q];
                ur[j] = ubv[q];
            }
        }
    }
    __syncthreads();
    MN_FG_MARK(12);

    /* the reverse; with a tangent the slots hold (dG1, dG2) here */
#if MN_LAYERS == 2
    float *const *dA = c.dA;
    {
        const mn_gacc a2 = mn_fg_acc(dA[1 * MN_PER], MN_DV, MN_DH, c.first);
        mn_gemm<MN_PDV, MN_PDH, MN_FR, true, true>(gb.y, MN_LDV, gb.h, MN_LDH, a2, a2.pre());
        if (tangent) {
            const mn_gacc a2t = mn_fg_acc(dA[1 * MN_PER], MN_DV, MN_DH, false);
            mn_gemm<MN_PDV, MN_PDH, MN_FR, true, true>(gb.dy, MN_LDV, gb.hd, MN_LDH, a2t, a2t.pre());
        }
        if (MN_BIAS) mn_bias_grad<MN_DV>(dA[1 * MN_PER + 1], gb.y, MN_LDV, cr, c.first, false, 0);
    }
    __syncthreads(); /* h and hd are read: now they take hbar and hdbar */
    /* hbar = ubar dG2 (+ ybar W2, the slot back to W2 between) and hdbar = ubar W2 */
    auto into_h = [&](int r, int j, float a0, float a1) {
        *reinterpret_cast<float2 *>(gb.h + r * MN_LDH + j) = make_float2(a0, a1);
    };
    if (tangent) {
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[1], MN_LLD(1), into_h);
        __syncthreads();
        mn_fg_copy_layer(P, Wg, 1);
        __syncthreads();
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.y, MN_LDV, P.w[1], MN_LLD(1), into_h,
            [&](int r, int j) { return *reinterpret_cast<const float2 *>(gb.h + r * MN_LDH + j); });
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[1], MN_LLD(1),
                                                    [&](int r, int j, float a0, float a1) {
            *reinterpret_cast<float2 *>(gb.hd + r * MN_LDH + j) = make_float2(a0, a1);
        });
    } else {
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.y, MN_LDV, P.w[1], MN_LLD(1), into_h);
    }
    __syncthreads();
    MN_FG_MARK(13);
    /* through the activation: zbar into gb.h, zdbar into gb.hd */
    for (int e = tid; e < MN_FR * MN_PDH; e += MN_FT) {
        const int r = e / MN_PDH, j = e % MN_PDH, i = r * MN_LDH + j;
        if (r >= cr || j >= MN_DH) {
            gb.h[i] = 0.0f;
            if (tangent) gb.hd[i] = 0.0f;
            continue;
        }
        const double d1 = mn_ghook_act_d((double)gb.z[i]);
        if (tangent) {
            const double d2 = mn_ghook_act_dd((double)gb.z[i]), hdb = gb.hd[i];
            gb.h[i] = (float)(d1 * (double)gb.h[i] + d2 * (double)gb.zd[i] * hdb);
            gb.hd[i] = (float)(d1 * hdb);
        } else {
            gb.h[i] = (float)(d1 * (double)gb.h[i]);
        }
    }
    __syncthreads();
    MN_FG_MARK(14);
    {
        const mn_gacc a1 = mn_fg_acc(dA[0], MN_DH, MN_DK, c.first);
        mn_gemm<MN_PDH, MN_PDK, MN_FR, true, true>(gb.h, MN_LDH, gb.x, MN_LDK, a1, a1.pre());
        if (MN_BIAS) mn_bias_grad<MN_DH>(dA[1], gb.h, MN_LDH, cr, c.first, false, 0);
    }
    MN_FG_MARK(21);
    /* dx += zdbar dG1 (the slot still dG1), then W1 back and dx += zbar W1 */
    {
        const mn_fg_add_rows add = {c.gx, cr};
        if (tangent) {
            mn_gemm<MN_FR, MN_PDK, MN_PDH, false, true>(gb.hd, MN_LDH, P.w[0], MN_LLD(0), add);
            __syncthreads();
            mn_fg_copy_layer(P, Wg, 0);
            __syncthreads();
        }
        MN_FG_MARK(22);
        mn_gemm<MN_FR, MN_PDK, MN_PDH, false, true>(gb.h, MN_LDH, P.w[0], MN_LLD(0), add);
    }
#else
    {
        const mn_gacc a1 = mn_fg_acc(c.dA[0], MN_DV, MN_DK, c.first);
        mn_gemm<MN_PDV, MN_PDK, MN_FR, true, true>(gb.y, MN_LDV, gb.x, MN_LDK, a1, a1.pre());
        if (MN_BIAS) mn_bias_grad<MN_DV>(c.dA[1], gb.y, MN_LDV, cr, c.first, false, 0);
    }
    {
        const mn_fg_add_rows add = {c.gx, cr};
        if (tangent) {
            mn_gemm<MN_FR, MN_PDK, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[0], MN_LLD(0), add);
            __syncthreads();
            mn_fg_copy_layer(P, Wg, 0);
            __syncthreads();
        }
        mn_gemm<MN_FR, MN_PDK, MN_PDV, false, true>(gb.y, MN_LDV, P.w[0], MN_LLD(0), add);
    }
#endif
    __syncthreads();
    MN_FG_MARK(15);
}

/* ---- one row's retrieval at W^(s+1) and its vector-Jacobian product ---- */

/* y = M(x; W) with W = P (shared: the slots hold W^(s+1) when step s's
 * reverse begins), given dy: adds into gW (flat, global) and gx (dk
 * floats). The row buffers are the first rows of the chunk buffers. A
 * non-finite x contributes nothing (its output is cut). */
__device__ void mn_fg_row_vjp(const mn_pset &P, const float *x, const float *dyr, float *gWf, float *gx,
                              const mn_gbuf &gb)
{
    const int tid = threadIdx.x;
    float *xs = gb.x, *ys = gb.y;
    __syncthreads();
    for (int j = tid; j < MN_DK; j += MN_FT) xs[j] = x[j];
    for (int o = tid; o < MN_DV; o += MN_FT) ys[o] = dyr[o];
    double nbad = 0.0;
    for (int j = tid; j < MN_DK; j += MN_FT) nbad += isfinite(x[j]) ? 0.0 : 1.0;
    if (mn_block_sum(nbad) != 0.0) return; /* its barriers publish xs and ys */
    float *gW[MN_NPARAMS];
    mn_gptrs(gWf, gW);
#if MN_LAYERS == 2
    float *zs = gb.z, *hs = gb.h;
    const float *W1 = P.w[0], *W2 = P.w[1];
    for (int o = tid; o < MN_DH; o += MN_FT) {
        float acc = 0.0f;
        for (int j = 0; j < MN_DK; j++) acc += W1[o * MN_LLD(0) + j] * xs[j];
        if (MN_BIAS) acc += P.b[0][o];
        zs[o] = acc;
        hs[o] = mn_hook_act(acc);
    }
    __syncthreads();
    for (int e = tid; e < MN_DV * MN_DH; e += MN_FT) gW[MN_PER][e] += ys[e / MN_DH] * hs[e % MN_DH];
    if (MN_BIAS)
        for (int o = tid; o < MN_DV; o += MN_FT) gW[MN_PER + 1][o] += ys[o];
    for (int j = tid; j < MN_DH; j += MN_FT) {
        float hb = 0.0f;
        for (int o = 0; o < MN_DV; o++) hb += ys[o] * W2[o * MN_LLD(1) + j];
        zs[j] = (float)(mn_ghook_act_d((double)zs[j]) * (double)hb); /* zbar: each thread its own j */
    }
    __syncthreads();
    for (int e = tid; e < MN_DH * MN_DK; e += MN_FT) gW[0][e] += zs[e / MN_DK] * xs[e % MN_DK];
    if (MN_BIAS)
        for (int o = tid; o < MN_DH; o += MN_FT) gW[1][o] += zs[o];
    for (int j = tid; j < MN_DK; j += MN_FT) {
        float acc = 0.0f;
        for (int o = 0; o < MN_DH; o++) acc += zs[o] * W1[o * MN_LLD(0) + j];
        if (MN_RESIDUAL) acc += ys[j];
        gx[j] += acc;
    }
#else
    const float *W1 = P.w[0];
    for (int e = tid; e < MN_DV * MN_DK; e += MN_FT) gW[0][e] += ys[e / MN_DK] * xs[e % MN_DK];
    if (MN_BIAS)
        for (int o = tid; o < MN_DV; o += MN_FT) gW[1][o] += ys[o];
    for (int j = tid; j < MN_DK; j += MN_FT) {
        float acc = 0.0f;
        for (int o = 0; o < MN_DV; o++) acc += ys[o] * W1[o * MN_LLD(0) + j];
        if (MN_RESIDUAL) acc += ys[j];
        gx[j] += acc;
    }
#endif
    __syncthreads();
}

/* This block's pieces of the workspace. */
struct mn_fg_state {
    long long P, stride; /* floats of one memory's parameters; of a slot (P rounded up to 4) */
    float *Wb, *Sb, *Gb, *dW, *dS, *dA, *dGt, *dG, *skip;
    mn_pset dGp, Wg; /* dG and W^(s) padded (global): what a shared slot copies */
};

/* ---- the update's and the clip's adjoints ---- */

/* grad_kernel.cuh's update adjoint, its mn_vdot's and mn_gclip_adjoint, in
 * two passes over the parameters instead of eight: the first forms dGt =
 * -(dS + dW), the new dW = (1 - alpha) dW and dS = eta (dS + dW), and the
 * sums deta, dalpha and per parameter <dGt, G>, <G, G>; the second writes
 * dG (sc dGt + sc'(n) <dGt, G> / n G for a scale clip, clip'(G) dGt for an
 * elementwise one) straight into the padded dGp, whose padding stays 0. */
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
        for (long long e = o + tid; e < o + ne; e += MN_FT) {
            const float dS = g.dS[e], dW = g.dW[e], Sv = Snow[e], Gv = G[e];
            /* the adjoint of S^(s+1) is dS + dW (both uses) */
            deta += (double)dS * (double)Sv + (double)dW * (double)Sv;
            dalpha -= (double)dW * (double)Wnow[e];
            const float dSt = __fadd_rn(dS, dW);
            g.dGt[e] = -dSt;
            g.dW[e] = __fmul_rn(dW, keep);
            g.dS[e] = __fmul_rn(e_s, dSt);
            dp += -(double)dSt * (double)Gv;
            gp += (double)Gv * (double)Gv;
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
    MN_FG_MARK(4);
#if MN_CLIP_MODE == 1
    mn_block_sums<MN_NPARAMS>(dot);
    mn_block_sums<MN_NPARAMS>(gg);
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
        for (int e = tid; e < ne; e += MN_FT) {
            const float dGt = g.dGt[o + e];
#if MN_CLIP_MODE == 1
            const float d = (float)(sc * (double)dGt + through * (double)G[o + e]);
#elif MN_CLIP_MODE == 2
            const float d = (float)((double)dGt * mn_ghook_clip_delem((double)G[o + e]));
#else
            const float d = dGt;
#endif
            *mn_pset_el(g.dGp, p, e) = d;
        }
    }
    __syncthreads();
    MN_FG_MARK(5);
}

/* ---- the reverse of step s, block slot i (grad_kernel.cuh's mn_gstep_reverse, refresh = step) ---- */


__device__ void mn_fg_step_reverse(const mn_grad_kargs &a, const mn_fg_state &g, const mn_pset &P, const mn_gbuf &gb,
                                   long long m, long long s, long long i, int code)
{
    const long long Pn = g.P, n = a.n, t0 = s * MN_STEP;
    const int rows = (int)mn_steps_rows(n, s), grows = (int)mn_real_rows(a, m, s);
    if (code == MN_STEP_PADDING) return; /* the identity; y = 0 and loss = 0 are constants */
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV;
    const float *xq = a.q ? a.q + m * n * MN_DK : k;
    float *gk = a.gk + m * n * MN_DK, *gv = a.gv + m * n * MN_DV;
    float *gxq = a.q ? a.gq + m * n * MN_DK : gk;
    float *gtheta = a.gtheta + m * n;
    const float *dy = a.dy ? a.dy + m * n * MN_DV : 0, *dloss = a.dloss ? a.dloss + m * n : 0;
    const float *theta = a.theta + m * n;
    const long long st = g.stride;
    const float *Wnow = g.Wb + i * st, *Snow = g.Sb + i * st, *G = g.Gb + i * st;
    const int tid = threadIdx.x;

    MN_FG_MARK(0);
    /* the retrieval of the step's last token at W^(s+1) (retrieve = after) */
    if (dy && !MN_RETRIEVE_BEFORE && grows == rows) {
        const long long t = t0 + rows - 1;
        mn_fg_row_vjp(P, xq + t * MN_DK, dy + t * MN_DV, g.dW, gxq + t * MN_DK, gb);
    }
    MN_FG_MARK(1);
    MN_FG_MARK(3);
    const bool skipped = code == MN_STEP_SKIPPED;
    if (!skipped) mn_fg_update_adjoint(a, g, m, s, G, Snow, Wnow);
    MN_FG_MARK(6);
    /* W^(s) padded into the workspace, then into the shared slots: the products' weights */
    mn_fg_load_w(P, g.Wg, Wnow);
    __syncthreads();
    MN_FG_MARK(7);
    float *dAp[MN_NPARAMS];
    mn_gptrs(g.dA, dAp);
    bool fresh = true; /* dA not yet written in this step */

    /* the rows that see W^(s): with q = k their retrieval is the step's own forward */
    int before = MN_RETRIEVE_BEFORE ? rows : rows - 1;
    if (before > grows) before = grows; /* padding rows read y = 0 */
    const bool merged = dy && before > 0 && !a.q;
    if (!skipped || dloss || merged) {
        const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
        for (int r0 = 0; r0 < grows; r0 += MN_FR) {
            const int cr = grows - r0 < MN_FR ? grows - r0 : MN_FR;
            const long long t = t0 + r0;
            MN_FG_MARK(0);
            mn_fg_load_rows(gb, k + t * MN_DK, cr);
            MN_FG_MARK(8);
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
            c.first = fresh;
            mn_fg_chunk(P, g.Wg, gb, cr, c);
            fresh = false;
        }
    }
    if (dy && before > 0 && !merged) {
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
            c.dA = dAp;
            c.first = fresh;
            mn_fg_chunk(P, g.Wg, gb, cr, c);
            fresh = false;
        }
    }
    MN_FG_MARK(0);
    /* the gradient point is W^(s): its adjoint joins dW */
    if (!fresh) {
        for (long long e = tid; e < Pn; e += MN_FT) g.dW[e] += g.dA[e];
        __syncthreads();
    }
    MN_FG_MARK(16);
}

/* One memory's backward (grad_kernel.cuh's mn_grad_kernel). */
extern "C" __global__ void __launch_bounds__(MN_FT, 1) mn_fused_grad_kernel(const mn_grad_kargs a)
{
    MN_DYNAMIC_SMEM(mn_smem4);
    const long long m = blockIdx.x, K = a.K;
    const int tid = threadIdx.x;
#ifdef MN_FG_PROFILE
    if (tid == 0 && m == 0) mn_fg_last = clock64();
#endif

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
    mn_fgrad_layout_init(&lo, Pn, mn_pset_floats(), K, a.nblocks);
    float *base = a.work + m * a.work_floats;
    mn_fg_state g;
    g.P = Pn;
    g.stride = (Pn + 3) & ~3LL;
    g.Wb = base + lo.Wb;
    g.Sb = base + lo.Sb;
    g.Gb = base + lo.Gb;
    g.dW = base + lo.dW;
    g.dS = base + lo.dS;
    g.dA = base + lo.dA;
    g.dGt = base + lo.dGt;
    g.dG = base + lo.dG;
    g.skip = base + lo.skip;
    mn_pset_init(&g.dGp, base + lo.dGp);
    mn_pset_init(&g.Wg, base + lo.Wp);
    mn_vzero(base + lo.dGp, lo.Pp); /* the padding of dG is never written after */
    const long long P4 = g.stride;
    float *ck = base + lo.ck;

    /* 1. from the initial state, the checkpoints at the first step of every
     * block (the last block is recomputed in 2 anyway) */
    {
        float *w0[MN_NPARAMS];
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) w0[p] = (float *)a.W0[p] + m * MN_NUMEL(p);
        mn_pset_from(P, w0);
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            const long long ne = MN_NUMEL(p), o = mn_goff(p);
            for (long long e = tid; e < ne; e += MN_FT) g.Sb[o + e] = a.S0[p][m * ne + e];
        }
        __syncthreads();
    }
    MN_FG_MARK(0);
    const long long last = (a.nblocks - 1) * K;
    for (long long s = 0; s <= last; s++) {
        if (s % K == 0) {
            float *cw = ck + (s / K) * 2 * P4, *cs = cw + P4, *cwp[MN_NPARAMS];
            mn_gptrs(cw, cwp);
            mn_pset_to(cwp, P);
            mn_vcopy(cs, g.Sb, Pn);
        }
        if (s == last) break;
        mn_fg_step_forward(a, P, gb, m, s, g.Gb, g.Sb, g.Sb, 0);
    }
    MN_FG_MARK(17);
    /* adjoints of the final tensors */
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = tid; e < ne; e += MN_FT) {
            g.dW[o + e] = a.dWf[p] ? a.dWf[p][m * ne + e] : 0.0f;
            g.dS[o + e] = a.dSf[p] ? a.dSf[p][m * ne + e] : 0.0f;
        }
    }
    __syncthreads();
    /* 2. blocks in reverse */
    for (long long b = a.nblocks - 1; b >= 0; b--) {
        const float *cw = ck + b * 2 * P4, *cs = cw + P4;
        mn_vcopy(g.Wb, cw, Pn);
        mn_vcopy(g.Sb, cs, Pn);
        {
            float *wp[MN_NPARAMS];
            mn_gptrs((float *)cw, wp);
            mn_pset_from(P, wp);
        }
        __syncthreads();
        const long long s0 = b * K, len = s0 + K <= a.nsteps ? K : a.nsteps - s0;
        for (long long i = 0; i < len; i++) {
            float *Sn = g.Sb + (i + 1) * P4, *Wn = g.Wb + (i + 1) * P4;
            const int code = mn_fg_step_forward(a, P, gb, m, s0 + i, g.Gb + i * P4, g.Sb + i * P4, Sn, Wn);
            if (code != MN_STEP_TAKEN) {
                for (long long e = tid; e < Pn; e += MN_FT) {
                    Sn[e] = g.Sb[i * P4 + e];
                    Wn[e] = g.Wb[i * P4 + e];
                }
            }
            if (tid == 0) g.skip[i] = (float)code;
            __syncthreads();
        }
        MN_FG_MARK(18);
        MN_FG_MARK(0);
        for (long long i = len - 1; i >= 0; i--) mn_fg_step_reverse(a, g, P, gb, m, s0 + i, i, (int)g.skip[i]);
        MN_FG_MARK(0);
    }
#ifdef MN_FG_PROFILE
    if (tid == 0 && m == 0)
        for (int i = 1; i < 24; i++)
            if (mn_fg_prof[i]) printf("MN_FG_PROFILE phase %d: %lld cycles\n", i, mn_fg_prof[i]);
#endif
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++) {
        const long long ne = MN_NUMEL(p), o = mn_goff(p);
        for (long long e = tid; e < ne; e += MN_FT) {
            a.gW[p][m * ne + e] = g.dW[o + e];
            a.gS[p][m * ne + e] = g.dS[o + e];
        }
    }
}

#endif /* __CUDACC_RTC__ */
