/* grad_ns_adjoint.cuh: precondition = newton_schulz in the GPU's backward:
 * mn_gprecond_forward recomputes a step's orthogonalised update with the
 * forward's own mn_newton_schulz (update_math.cuh), and mn_ns_adjoint,
 * mn_gprecond_adjoint send the update's adjoint back through the iteration
 * (model/precond.c's adjoint, the same steps in double, every iterate kept
 * in the memory's scratch, grad_common.cuh's mn_grad_ns_doubles). Both
 * backward kernels call these, the general one (grad_kernel.cuh) and the
 * fused one (fused_grad.cuh), so the adjoint is a file of its own between
 * grad_common.cuh (MN_GNP, mn_goff), whose helpers it uses, and either
 * kernel in the source (codegen.c mn_cuda_grad_source, plan.c
 * mn_cuda_fused_grad_source). NVRTC only (and tests/emu/cuda_shim.h),
 * and only with MN_PRECOND. */
#ifdef __CUDACC_RTC__

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

#endif /* __CUDACC_RTC__ */
