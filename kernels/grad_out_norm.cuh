/* grad_out_norm.cuh: out_norm (MN_OUT_NORM) in the general backward
 * (grad_kernel.cuh): the norm's tangent (mn_gnorm_tangent: model/rownorm.c's
 * jvp) and its part of the reverse (mn_gnorm_reverse: mlp_grad_cpu.c's
 * norm_reverse, rownorm.c's vjp and second-order term), one warp a row
 * with sums in double as the CPU's, on the forward's nhat and s that
 * mn_forward leaves in the workspace (mn_grad_layout_out_norm). A file of
 * its own, beside the rule kernel's forward norm (rule_kernel.cuh
 * mn_out_norm_forward) and the fused path's (fused_norm.cuh); it uses
 * grad_common.cuh's mn_gstate and comes after it and before grad_kernel.cuh
 * in the general backward's source (codegen.c mn_cuda_grad_source). The
 * fused backward does not run out_norm (kernels/plan.c), so its source
 * leaves this file out. NVRTC only (and tests/emu/cuda_shim.h), and only
 * with MN_OUT_NORM. */
#ifdef __CUDACC_RTC__

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

#endif /* __CUDACC_RTC__ */
