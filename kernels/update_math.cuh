/* update_math.cuh: the arithmetic of a step's clip and update (SPEC.md
 * section 2), shared by the kernels of the three CUDA paths (rule_kernel,
 * fused_kernel, large_kernels) so that they compute it alike: the scales of
 * a norm-type clip, and one element's clip, momentum and decay. NVRTC only:
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

/* One element of a parameter: its gradient g clipped (times its tensor's
 * scale fs, or through the elementwise hook), then S = eta_s S - g into *s,
 * and the new W = (1 - alpha_s) W + S returned (keep = 1 - alpha_s). */
__device__ __forceinline__ float mn_update_elem(float g, float fs, float e_s, float keep, float *s, float w)
{
#if MN_CLIP_MODE == 1
    g *= fs;
#elif MN_CLIP_MODE == 2
    g = mn_hook_clip_elem(g);
#endif
    (void)fs;
    *s = e_s * *s - g;
    return keep * w + *s;
}

#endif /* __CUDACC_RTC__ */
