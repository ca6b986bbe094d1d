/* rownorm_warp.cuh: the row normalisation of model/rownorm.h (qk_norm's keys
 * and queries) and its adjoint, one warp a row, sums in double as rownorm.c's
 * loops (only their order differs). ops.cu launches them (k_rownorm,
 * k_rownorm_vjp); tests/emu/grad_emu.cpp runs the same code through the
 * emulation's shim, around the emulated backward kernel, so that the chain
 * a cuda run's qk_norm backward takes is checked against the CPU's on a
 * machine without a GPU. Every lane of the warp calls with its lane number;
 * a lane touches only the entries j = lane mod 32, so out may alias the input
 * it replaces. */
#ifndef MN_ROWNORM_WARP_CUH
#define MN_ROWNORM_WARP_CUH

__device__ __forceinline__ double mn_rownorm_warp_sum(double v)
{
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* o = nhat of the row x (n features); returns the row's scale s (every lane). */
__device__ __forceinline__ double mn_rownorm_warp_row(float *o, const float *x, long long n, int lane, bool center,
                                                      bool sum, double eps)
{
    double mu = 0.0;
    if (center) {
        double s = 0.0;
        for (long long j = lane; j < n; j += 32) s += x[j];
        mu = mn_rownorm_warp_sum(s) / (double)n;
    }
    double sq = 0.0;
    for (long long j = lane; j < n; j += 32) {
        const double c = (double)x[j] - mu;
        sq += c * c;
    }
    const double sc = 1.0 / sqrt(mn_rownorm_warp_sum(sq) / (sum ? 1.0 : (double)n) + eps);
    for (long long j = lane; j < n; j += 32) o[j] = (float)(((double)x[j] - mu) * sc);
    return sc;
}

/* xbar = J(x)^T a for the row whose forward gave nhat and the scale s (the
 * float the forward stored, as the CPU's backward keeps it): rownorm.c's
 * mn_rownorm_vjp, cbar = s (a - nhat <a, nhat> / D), less its mean where the
 * map centres. xbar may alias a. */
__device__ __forceinline__ void mn_rownorm_warp_vjp(float *xbar, const float *nhat, float s, const float *a,
                                                    long long n, int lane, bool center, bool sum)
{
    const double D = sum ? 1.0 : (double)n, sc = s;
    double B = 0.0;
    for (long long j = lane; j < n; j += 32) B += (double)a[j] * nhat[j];
    B = mn_rownorm_warp_sum(B);
    double mean = 0.0;
    if (center) {
        for (long long j = lane; j < n; j += 32) mean += sc * ((double)a[j] - nhat[j] * B / D);
        mean = mn_rownorm_warp_sum(mean) / (double)n;
    }
    for (long long j = lane; j < n; j += 32) xbar[j] = (float)(sc * ((double)a[j] - nhat[j] * B / D) - mean);
}

#endif
