/* update_math.cuh: the per-step epilogue of SPEC.md section 2, shared by the
 * kernels of the three CUDA paths (rule_kernel, fused_kernel, large_kernels)
 * so that they compute it alike: the step's control from the gradient's
 * per-parameter sums of squares (global norm, non-finite guard, the scales
 * of a norm-type clip), one element's clip, momentum and decay, and the
 * step's outputs. Each path gathers the sums its own way. NVRTC only:
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

#endif /* __CUDACC_RTC__ */
