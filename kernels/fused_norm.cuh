/* fused_norm.cuh: SPEC v2's out_norm on the fused path (kernels/plan.h),
 * the row math that fused_step.cuh's step kernel calls: the norm of an
 * output row, its y, and its backward, in the registers of the warp that
 * takes the row. Put between rule_kernel.cuh (mn_warp_sum, and the general
 * path's mn_out_norm_forward and mn_out_norm_backward, whose formulas and
 * order of rounding these follow) and fused_kernel.cuh in the fused
 * source (kernels/plan.c); compiled by NVRTC only, and only with out_norm. */
#if defined(__CUDACC_RTC__) && MN_OUT_NORM

/* out_norm (SPEC.md section 1) on the fused path. One warp per row, lane l
 * holding the row's columns l, l + 32, ... (MN_NCW of them), with the sums
 * in double in mn_out_norm_forward's order (rule_kernel.cuh), so nhat and s
 * are the general path's. nhat stays in registers: the warp that normalises
 * a row also forms its loss and takes dL/dy back through the norm, so the
 * fused path keeps no norm statistics in shared memory. */
#define MN_NCW ((MN_PDV + 31) / 32)

/* nhat of the output row o (its dv real columns; 0 in this lane's padded
 * ones) into nh; returns s. */
__device__ __forceinline__ double mn_fused_norm_row(const float *o, float (&nh)[MN_NCW])
{
    const int lane = threadIdx.x & 31;
    double mu = 0.0, sq = 0.0;
    if (MN_OUT_NORM == 1) {
#pragma unroll
        for (int u = 0; u < MN_NCW; u++)
            if (lane + 32 * u < MN_DV) mu += o[lane + 32 * u];
        mu = mn_warp_sum(mu) / (double)MN_DV;
    }
#pragma unroll
    for (int u = 0; u < MN_NCW; u++) {
        if (lane + 32 * u < MN_DV) {
            const double c = (double)o[lane + 32 * u] - mu;
            sq += c * c;
        }
    }
    const double sc = 1.0 / sqrt(mn_warp_sum(sq) / (double)MN_DV + 1e-6);
#pragma unroll
    for (int u = 0; u < MN_NCW; u++) {
        const int j = lane + 32 * u;
        nh[u] = j < MN_DV ? (float)(((double)o[j] - mu) * sc) : 0.0f;
    }
    return sc;
}

/* Column j (< dv) of y = g nhat + beta (+ x), rounded as mn_out_norm_forward rounds it. */
__device__ __forceinline__ float mn_fused_norm_y(const float *ln_g, const float *ln_b, int j, float nh, const float *xr)
{
    float y = __fadd_rn(__fmul_rn(ln_g[j], nh), ln_b[j]);
    if (MN_RESIDUAL) y = __fadd_rn(y, xr[j]);
    return y;
}

/* dL/do of a row, from this lane's columns of dL/dy (d), nhat (nh) and s
 * (mn_fused_norm_row), in mn_out_norm_backward's formulas and order: with a
 * = g dL/dy, do = s (a - nhat <a, nhat> / dv), centred for layernorm. Into
 * dyr, the row's pdv floats (padded columns 0). */
__device__ __forceinline__ void mn_fused_norm_vjp(const float (&d)[MN_NCW], const float (&nh)[MN_NCW], double sc,
                                                  const float *ln_g, float *dyr)
{
    const int lane = threadIdx.x & 31;
    const double D = (double)MN_DV;
    double B = 0.0, mean = 0.0;
#pragma unroll
    for (int u = 0; u < MN_NCW; u++)
        if (lane + 32 * u < MN_DV) B += (double)__fmul_rn(ln_g[lane + 32 * u], d[u]) * nh[u];
    B = mn_warp_sum(B);
    if (MN_OUT_NORM == 1) {
#pragma unroll
        for (int u = 0; u < MN_NCW; u++)
            if (lane + 32 * u < MN_DV) mean += sc * ((double)__fmul_rn(ln_g[lane + 32 * u], d[u]) - nh[u] * B / D);
        mean = mn_warp_sum(mean) / D;
    }
#pragma unroll
    for (int u = 0; u < MN_NCW; u++) {
        const int j = lane + 32 * u;
        if (j < MN_PDV)
            dyr[j] = j < MN_DV ? (float)(sc * ((double)__fmul_rn(ln_g[j], d[u]) - nh[u] * B / D) - mean) : 0.0f;
    }
}

#endif
