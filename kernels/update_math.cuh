/* update_math.cuh: the per-step epilogue of SPEC.md section 2, shared by the
 * kernels of the three CUDA paths (rule_kernel, fused_kernel, large_kernels)
 * so that they compute it alike: the step's control from the gradient's
 * per-parameter sums of squares (global norm, non-finite guard, the scales
 * of a norm-type clip), one element's clip, momentum and decay, and the
 * step's outputs, and newton_schulz's orthogonalisation of a matrix's
 * clipped gradient. Each path gathers the sums its own way. NVRTC only:
 * it needs the rule's hooks and MN_* constants, which kernels/codegen.c puts
 * in front of the templates. */
#ifdef __CUDACC_RTC__

/* The clip scale of each of NP parameters, from its own norm (scope tensor)
 * or the global one, into scale; returns the smallest (the clip_scale
 * output; a NaN wins). Without a norm-type clip every scale is 1. */
template <int NP> __device__ __forceinline__ double mn_clip_scales(const double *sumsq, double gnorm, double *scale)
{
#if MN_CLIP_MODE == 1
    double smallest = __longlong_as_double(0x7ff0000000000000LL); /* +Inf */
#pragma unroll
    for (int p = 0; p < NP; p++) {
        scale[p] = mn_hook_clip_scale(MN_CLIP_TENSOR ? sqrt(sumsq[p]) : gnorm);
        if (scale[p] < smallest || scale[p] != scale[p]) smallest = scale[p];
    }
    return smallest;
#else
    (void)sumsq;
    (void)gnorm;
#pragma unroll
    for (int p = 0; p < NP; p++) scale[p] = 1.0;
    return 1.0;
#endif
}

/* The step's control: global norm |G| (before clipping), whether the step
 * runs (every sum finite; false for NaN and Inf), and the clip_scale output
 * (0 for a skipped step; a running step sets it from mn_clip_scales, inside
 * its update, where the per-parameter scales live). */
typedef struct mn_step_control {
    double gnorm, clip_scale;
    bool finite;
} mn_step_control;

template <int NP> __device__ __forceinline__ mn_step_control mn_step_control_of(const double *sumsq)
{
    double total = 0.0;
#pragma unroll
    for (int p = 0; p < NP; p++) total += sumsq[p];
    mn_step_control c;
    c.gnorm = sqrt(total);
    c.finite = total <= 1.7976931348623157e308;
    c.clip_scale = 0.0;
    return c;
}

/* The step's outputs at index o (memory m's step s): its mean loss over the
 * step's rows, grad_norm, skipped and clip_scale. */
__device__ __forceinline__ void mn_step_outputs(float *step_loss, float *grad_norm, float *skipped, float *clip_scale,
                                                long long o, double loss_sum, long long rows, const mn_step_control &c)
{
    step_loss[o] = (float)(loss_sum / (double)rows);
    grad_norm[o] = (float)c.gnorm;
    skipped[o] = c.finite ? 0.0f : 1.0f;
    clip_scale[o] = (float)c.clip_scale;
}

/* The outputs of a step that starts in a sequence's padding (ragged
 * batches, SPEC.md section 2): it changes nothing, and says so: loss 0,
 * grad_norm 0, not skipped, clip_scale 1. */
__device__ __forceinline__ void mn_padding_step_outputs(float *step_loss, float *grad_norm, float *skipped,
                                                        float *clip_scale, long long o)
{
    step_loss[o] = 0.0f;
    grad_norm[o] = 0.0f;
    skipped[o] = 0.0f;
    clip_scale[o] = 1.0f;
}

/* One element's gradient g clipped: times its tensor's scale fs, or
 * through the elementwise hook. */
__device__ __forceinline__ float mn_clip_elem(float g, float fs)
{
#if MN_CLIP_MODE == 1
    g *= fs;
#elif MN_CLIP_MODE == 2
    g = mn_hook_clip_elem(g);
#endif
    (void)fs;
    return g;
}

/* S = eta_s S - g into *s, and the new W = (1 - alpha_s) W + S returned
 * (keep = 1 - alpha_s), for an already clipped (and preconditioned) g. */
__device__ __forceinline__ float mn_momentum_elem(float g, float e_s, float keep, float *s, float w)
{
    *s = e_s * *s - g;
    return keep * w + *s;
}

/* One element of a parameter: clip, then momentum and decay. */
__device__ __forceinline__ float mn_update_elem(float g, float fs, float e_s, float keep, float *s, float w)
{
    return mn_momentum_elem(mn_clip_elem(g, fs), e_s, keep, s, w);
}

#if MN_PRECOND
/* Sum of v over a 1-d block, to every thread, in a fixed order. Starts with
 * a barrier, so back-to-back calls never overwrite partials still being read. */
__device__ double mn_ns_block_sum(double v)
{
    __shared__ double part[32];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warps = (blockDim.x + 31) / 32;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < warps; w++) t += part[w];
    return t;
}

/* A = X X^T and Bm = b A + c A^2 for X [m x n] (model/precond.c's
 * coefficients): one Newton-Schulz iteration's products, which the
 * backward's adjoint (grad_ns_adjoint.cuh) recomputes the same way. The
 * block's threads share them; ends with a barrier. */
__device__ void mn_ns_products(const double *X, int m, int n, double *A, double *Bm)
{
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int e = tid; e < m * m; e += nt) {
        const double *xi = X + (long long)(e / m) * n, *xj = X + (long long)(e % m) * n;
        double s = 0.0;
        for (int l = 0; l < n; l++) s += xi[l] * xj[l];
        A[e] = s;
    }
    __syncthreads();
    for (int e = tid; e < m * m; e += nt) {
        const int i = e / m, j = e % m;
        double s = 0.0;
        for (int l = 0; l < m; l++) s += A[i * m + l] * A[l * m + j];
        Bm[e] = -4.7750 * A[e] + 2.0315 * s;
    }
    __syncthreads();
}

/* SPEC.md section 2's newton_schulz on one matrix's clipped gradient g
 * [rows x cols], in place, as model/precond.c computes it (double): X_0 =
 * Gt / (|Gt| + 1e-7), transposed to wide; MN_NS_STEPS times X <- a X +
 * (b A + c A^2) X with A = X X^T; then Gt = X |Gt| / |X|; a zero Gt stays 0.
 * ns: the block's 2 m n + 2 m^2 doubles. The block's threads (1-d, any
 * count) share the products; ends with a barrier. The three paths call it
 * from their step kernels (general, fused) or a kernel of its own (large). */
__device__ void mn_newton_schulz(float *g, int rows, int cols, double *ns)
{
    const bool wide = rows <= cols;
    const int m = wide ? rows : cols, n = wide ? cols : rows, tid = threadIdx.x, nt = blockDim.x;
    double *X = ns, *Xn = ns + (long long)m * n, *A = Xn + (long long)m * n, *Bm = A + (long long)m * m;
    double acc = 0.0;
    for (int e = tid; e < m * n; e += nt) {
        const int a = e / n, b = e % n;
        const double x = wide ? g[e] : g[(long long)b * cols + a];
        X[e] = x;
        acc += x * x;
    }
    const double nu = sqrt(mn_ns_block_sum(acc));
    if (!(nu > 0.0)) return; /* every thread sees the same nu */
    for (int e = tid; e < m * n; e += nt) X[e] /= nu + 1e-7;
    __syncthreads();
    for (int it = 0; it < MN_NS_STEPS; it++) {
        mn_ns_products(X, m, n, A, Bm);
        for (int e = tid; e < m * n; e += nt) {
            const int i = e / n, j = e % n;
            double s = 0.0;
            for (int l = 0; l < m; l++) s += Bm[i * m + l] * X[(long long)l * n + j];
            Xn[e] = 3.4445 * X[e] + s;
        }
        __syncthreads();
        double *t = X;
        X = Xn;
        Xn = t;
    }
    acc = 0.0;
    for (int e = tid; e < m * n; e += nt) acc += X[e] * X[e];
    const double rho = sqrt(mn_ns_block_sum(acc)), scale = rho > 0.0 ? nu / rho : 0.0;
    for (int e = tid; e < m * n; e += nt) {
        const int a = e / n, b = e % n;
        g[wide ? e : (long long)b * cols + a] = (float)(X[e] * scale);
    }
    __syncthreads();
}
#endif

#endif /* __CUDACC_RTC__ */
