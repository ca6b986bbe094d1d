/* test_scalar_math.c: the accuracy of model/scalar_math.h's normal functions,
 * which gelu is made of, in ulps of the exact value, over a sweep of float
 * bit patterns (every 331st: 6.5 million points in [-13, 6]). Float Phi is
 * the Mills-ratio fit (tests/unit/fit_mills.py) and must stay within 6 ulp;
 * erfcf of a rounded x / sqrt 2, the definition before it, fails that by
 * far below x = -5. References: glibc's double erfc and exp, whose own errors
 * are a few double ulps, 2^-29 of a float ulp.
 *
 * The same sweep runs on the GPU, through the float prelude that generated
 * kernels include (model/expr_emit.c stringizes the same definition): CUDA's
 * expf and its contracted fmas give other roundings than the CPU's, within
 * the same bounds. Without a GPU only its NVRTC compile is checked. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

#include "check.h"
#include "expr.h"
#include "scalar_math.h"

#ifdef MN_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "../../kernels/cuda.h"
#include "../../kernels/nvrtc.h"
#endif

#define F_NAME(name) tf_##name
#define D_NAME(name) td_##name
MN_SCALAR_MATH(static inline, float, MN_SM_FLOAT, F_NAME)
MN_SCALAR_MATH(static inline, double, MN_SM_DOUBLE, D_NAME)

/* One float ulp at the exact value r (the spacing of the floats around it;
 * the smallest subnormal's below the normal range). */
static double float_ulp(double r)
{
    int e;
    if (fabs(r) < FLT_MIN) return ldexp(1, -149);
    frexp(fabs(r), &e);
    return ldexp(1, e - 24);
}

static double phi_exact(double x) { return 0.5 * erfc(-x / sqrt(2.0)); }
static double pdf_exact(double x) { return 0.39894228040143267794 * exp(-0.5 * x * x); }

typedef struct {
    double worst;
    float at;
} worst_ulp;

/* |got - want| in ulps of scale (want itself, or a larger term where want
 * cancels), kept in w where it is the worst so far */
static void note(worst_ulp *w, double got, double want, double scale, float x)
{
    double u = fabs(got - want) / float_ulp(scale);
    if (!(u <= w->worst)) w->worst = u, w->at = x; /* a NaN counts as the worst */
}

static void report(const char *name, const worst_ulp *w, double bound)
{
    char line[160];
    snprintf(line, sizeof line, "%s: worst %.2f ulp at x = %.9g (bound %g)", name, w->worst, (double)w->at, bound);
    CHECK(line, w->worst <= bound);
}

/* The sweep's points: every 331st float bit pattern in [-13, 6]. */
static float *sweep_points(size_t *n)
{
    size_t cap = 0xFFFFFFFFu / 331 + 1, k = 0;
    float *x = malloc(cap * sizeof *x);
    if (!x) return NULL;
    for (uint64_t b = 0; b <= 0xFFFFFFFFu; b += 331) {
        uint32_t bits = (uint32_t)b;
        float v;
        memcpy(&v, &bits, sizeof v);
        if (v >= -13.0f && v <= 6.0f) x[k++] = v;
    }
    *n = k;
    return x;
}

/* normcdf, normpdf, gelu and gelu_grad of n points, four arrays of n */
static void evaluate_cpu(const float *x, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++) {
        out[i] = tf_normcdf(x[i]);
        out[n + i] = tf_normpdf(x[i]);
        out[2 * n + i] = tf_gelu(x[i]);
        out[3 * n + i] = tf_gelu_grad(x[i]);
    }
}

static void check_sweep(const char *where, const float *x, size_t n, const float *out)
{
    worst_ulp cdf = {0, 0}, cdf_tail = {0, 0}, pdf = {0, 0}, gelu = {0, 0}, grad = {0, 0};
    for (size_t i = 0; i < n; i++) {
        const double xd = x[i], P = phi_exact(xd), p = pdf_exact(xd);
        note(x[i] < -5.0f ? &cdf_tail : &cdf, out[i], P, P, x[i]);
        note(&pdf, out[n + i], p, p, x[i]);
        note(&gelu, out[2 * n + i], xd * P, xd * P, x[i]);
        /* gelu' = Phi + x phi cancels near x = -0.75: measured in ulps of
         * the larger of its two terms */
        note(&grad, out[3 * n + i], P + xd * p, fmax(P, fabs(xd * p)), x[i]);
    }
    char name[120];
    snprintf(name, sizeof name, "%s float normcdf on [-5, 6]", where);
    report(name, &cdf, 6);
    snprintf(name, sizeof name, "%s float normcdf on [-13, -5] (the tail, relative)", where);
    report(name, &cdf_tail, 6);
    snprintf(name, sizeof name, "%s float normpdf on [-13, 6]", where);
    report(name, &pdf, 4);
    snprintf(name, sizeof name, "%s float gelu on [-13, 6]", where);
    report(name, &gelu, 7);
    snprintf(name, sizeof name, "%s float gelu_grad on [-13, 6] (ulps of its larger term)", where);
    report(name, &grad, 8);
}

#ifdef MN_HAVE_CUDA
static const char *sweep_kernel =
    "extern \"C\" __global__ void mn_sweep(const float *x, float *out, long long n)\n"
    "{\n"
    "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i >= n) return;\n"
    "    const float v = x[i];\n"
    "    out[i] = mn_f_normcdf(v);\n"
    "    out[n + i] = mn_f_normpdf(v);\n"
    "    out[2 * n + i] = mn_f_gelu(v);\n"
    "    out[3 * n + i] = mn_f_gelu_grad(v);\n"
    "}\n";

/* The float prelude and the sweep kernel as a cubin for arch (90: sm_90),
 * compiled as the engine compiles generated kernels (kernels/nvrtc.c's
 * options, so the same contractions), or NULL with the reason in why. */
static void *compile_sweep(int arch, size_t *size, char *why, size_t wlen)
{
    const char *prelude = mn_expr_c_prelude(true);
    const size_t n = prelude ? strlen(prelude) + strlen(sweep_kernel) + 2 : 0;
    char *src = prelude ? malloc(n) : NULL;
    if (!src) {
        snprintf(why, wlen, "no prelude or out of memory");
        return NULL;
    }
    snprintf(src, n, "%s\n%s", prelude, sweep_kernel);
    void *cubin = NULL;
    char key[33];
    if (mn_nvrtc_cubin(src, arch, MN_TIER_FULL, false, key, &cubin, size) != MN_OK)
        snprintf(why, wlen, "%s", mn_last_error());
    free(src);
    return cubin;
}

/* Runs the sweep on the GPU into out (4 n floats); false with why set. */
static bool evaluate_gpu(const void *cubin, const float *x, size_t n, float *out, char *why, size_t wlen)
{
    cudaLibrary_t lib = NULL;
    cudaKernel_t k;
    float *dx = NULL, *dout = NULL;
    long long count = (long long)n;
    cudaError_t e = cudaLibraryLoadData(&lib, cubin, NULL, NULL, 0, NULL, NULL, 0);
    if (e == cudaSuccess) e = cudaLibraryGetKernel(&k, lib, "mn_sweep");
    if (e == cudaSuccess) e = cudaMalloc((void **)&dx, n * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&dout, 4 * n * sizeof(float));
    if (e == cudaSuccess) e = cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice);
    void *args[] = {&dx, &dout, &count};
    const dim3 grid = {(unsigned)((n + 255) / 256), 1, 1}, block = {256, 1, 1};
    if (e == cudaSuccess) e = cudaLaunchKernel((const void *)k, grid, block, args, 0, 0);
    if (e == cudaSuccess) e = cudaMemcpy(out, dout, 4 * n * sizeof(float), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        snprintf(why, wlen, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        (void)cudaGetLastError();
    }
    cudaFree(dx);
    cudaFree(dout);
    if (lib) cudaLibraryUnload(lib);
    return e == cudaSuccess;
}
#endif

/* The sweep on the CPU, then on the GPU where there is one. */
static void float_sweeps(void)
{
    size_t n = 0;
    float *x = sweep_points(&n), *out = x ? malloc(4 * n * sizeof(float)) : NULL;
    if (!out) {
        printf("FAIL sweep: out of memory\n");
        check_failures_++;
        free(x);
        return;
    }
    evaluate_cpu(x, n, out);
    check_sweep("cpu", x, n, out);
#ifndef MN_HAVE_CUDA
    SKIP("gpu float sweep", "this build has no CUDA (nvcc was not found)");
#else
    /* the GPU's own architecture (the engine's, as its kernels get); without
     * one, sm_90's compile alone */
    const bool gpu = mn_cuda_register();
    char why[600] = "";
    size_t size = 0;
    void *cubin = compile_sweep(gpu ? mn_cuda_arch() : 90, &size, why, sizeof why);
    if (!cubin) printf("FAIL gpu float prelude compiles: %s\n", why), check_failures_++;
    else printf("PASS gpu float prelude compiles\n");
    if (!cubin || !gpu) {
        SKIP("gpu float sweep", cubin ? "no GPU" : "the sweep did not compile");
    } else if (!evaluate_gpu(cubin, x, n, out, why, sizeof why)) {
        printf("FAIL gpu float sweep: %s\n", why), check_failures_++;
    } else {
        check_sweep("gpu", x, n, out);
    }
    free(cubin);
#endif
    free(x);
    free(out);
}

/* double: Phi stays libm's erfc; phi's split square keeps its exponent exact
 * (checked against long double, good to 2^-64 here) */
static void double_sweep(void)
{
    double worst = 0, at = 0;
    for (int i = -120000; i <= 120000; i++) {
        double x = i * 1e-4 + 1e-9 * (i % 7); /* [-12, 12], low bits set */
        long double want = 0.39894228040143267794L * expl(-0.5L * (long double)x * (long double)x);
        double rel = (double)fabsl((td_normpdf(x) - want) / want);
        if (rel > worst) worst = rel, at = x;
    }
    char line[160];
    snprintf(line, sizeof line, "double normpdf on [-12, 12]: worst relative error %.3g at %.6g (bound 4 ulp)", worst, at);
    CHECK(line, worst <= 4 * DBL_EPSILON);
    CHECK("double normcdf is libm's erfc", td_normcdf(-3.0) == 0.5 * erfc(3.0 * 0.70710678118654752440));
}

static void specials(void)
{
    const float inf = INFINITY, nan = NAN;
    CHECK("float normcdf(NaN) is NaN", isnan(tf_normcdf(nan)));
    CHECK("float gelu(NaN) is NaN", isnan(tf_gelu(nan)));
    CHECK("float gelu_grad(NaN) is NaN", isnan(tf_gelu_grad(nan)));
    CHECK("float normpdf(NaN) is NaN", isnan(tf_normpdf(nan)));
    CHECK("float normcdf(-inf) = 0, (+inf) = 1", tf_normcdf(-inf) == 0.0f && tf_normcdf(inf) == 1.0f);
    CHECK("float normpdf(+-inf) = 0", tf_normpdf(inf) == 0.0f && tf_normpdf(-inf) == 0.0f);
    /* x^2 overflows: the square's error term is -inf there, and must not
     * turn exp's 0 into a NaN */
    CHECK("float normpdf(1e30) = 0", tf_normpdf(1e30f) == 0.0f && tf_normpdf(-3e38f) == 0.0f);
    CHECK("float gelu(1e30) = 1e30, gelu(-1e30) = -0", tf_gelu(1e30f) == 1e30f && tf_gelu(-1e30f) == 0.0f);
    CHECK("float gelu_grad(+-1e30) = 1, 0", tf_gelu_grad(1e30f) == 1.0f && tf_gelu_grad(-1e30f) == 0.0f);
    CHECK("float normcdf(0) = 0.5", tf_normcdf(0.0f) == 0.5f && tf_normcdf(-0.0f) == 0.5f);
    CHECK("float normcdf(-14) is subnormal and > 0", tf_normcdf(-14.0f) > 0.0f && tf_normcdf(-14.0f) < FLT_MIN);
    CHECK("double normpdf(1e200) = 0", td_normpdf(1e200) == 0.0 && isnan(td_normpdf(NAN)));
}

int main(void)
{
    specials();
    double_sweep();
    float_sweeps();
    return check_failures_ ? 1 : 0;
}
