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
 * memory (sized on the host, kernels/grad_cuda.c, by grad_common.cuh's
 * mn_grad_layout_init): one memory's parameters are a flat vector of P
 * floats in parameter order (param_layout.h), as the CPU's. The memory
 * model's passes take a step's rows in chunks of MN_ROWS (the forward
 * kernel's), each chunk's activations recomputed; the CPU takes a step's
 * rows at once, and since every part of the adjoint is a sum over rows,
 * chunks only change the order of float sums. Vector ops give each thread
 * elements e = tid, tid + threads, ...; every phase ends with a barrier
 * (plain and correct first). Reductions that decide control flow are block
 * sums, so every thread takes the same branch.
 *
 * out_norm (MN_OUT_NORM) is part of the memory model, as on the CPU: the
 * forward's passes take the rule kernel's norm (mn_forward), the tangent
 * and the reverse go through it (grad_out_norm.cuh), and ln_g's and ln_b's
 * gradients add up over every pass of a memory.
 *
 * glu's gates (U_i, c_i of the hidden layers) join the flat parameters
 * after the layers' W_i, b_i (param_layout.h), their tangents gdot and
 * adjoints gbar, gdotbar the slice; the fused backward (fused_grad.cuh)
 * does not run glu.
 *
 * precondition = newton_schulz: the recompute orthogonalises the clipped G
 * with the forward's own mn_newton_schulz, and the reverse walk runs its
 * adjoint between the update's adjoint and the clip's (both in
 * grad_ns_adjoint.cuh); its scratch follows the workspace slice
 * (mn_grad_layout_add_ns), out_norm's rows after it (mn_grad_layout_out_norm).
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
 * The source (kernels/codegen.c mn_cuda_grad_source) is rule_kernel.cuh
 * (mn_forward, mn_backward, mn_block_sum) and the hooks of kernels/codegen.c,
 * which for this source adds the adjoint's: mn_ghook_loss_dy, _dv, _dyy,
 * _dyv (in y, v, r), mn_ghook_act_d, _dd (phi', phi''),
 * mn_ghook_clip_dscale(n), mn_ghook_clip_elem(g), mn_ghook_clip_delem(g),
 * all in double as the CPU's expression programs; then grad_common.cuh
 * (the arguments and the workspace layout, plain C shared with the host,
 * and the device helpers the fused backward takes too), grad_ns_adjoint.cuh
 * and grad_out_norm.cuh, and last this file, the general path's kernel,
 * which the fused backward (fused_grad.cuh, its own kernel) leaves out.
 * NVRTC only. */
#ifdef __CUDACC_RTC__

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

#endif /* __CUDACC_RTC__ */
