/* scalar_math.h: the one definition of the scalar functions that rules use
 * (SPEC.md section 4's functions and the activations), written once over a
 * type. MN_SCALAR_MATH(FN, T, M, N) defines each function as `FN T N(name)`,
 * with M(f) naming the C math function for T (exp or expf):
 *   model/op_math.h instantiates it in double (mn_sm_*), for the expression
 *   evaluator and the tensor ops on both backends;
 *   model/mlp_cpu.c in float (mn_smf_*), for the CPU engine's activations;
 *   model/expr_emit.c stringizes it, in float and double, as the prelude of
 *   generated CUDA source (mn_f_*, overloaded).
 * NaN in gives NaN out wherever PyTorch's function propagates it (relu, sign,
 * min, max), because SPEC.md section 3 wants NaNs where the reference has
 * them.
 *
 * Exact gelu, x Phi(x), with Phi the normal distribution function. In double
 * Phi is libm's erfc. In float, the precision of the engines and of gelu in
 * every generated kernel, Phi's lower tail is Phi(-u) = R(u) phi(u) (u =
 * |x|), with R the Mills ratio fitted as t S(s), t = 1 / (1 + 0.32 u),
 * s = 1 - t, S of degree 9 in s (relative error 3.2e-8 over all u >= 0;
 * tests/unit/fit_mills.py makes the fit, with 1/sqrt(2 pi) folded into S,
 * and says why s). phi's exponential is then the one that gelu's
 * derivative needs anyway, so a kernel that computes both computes it
 * once: gelu and gelu' take about 50 instructions on sm_90, where erfcf
 * and a second exponential took 65 (erfcf was 17% of P1's fused forward's
 * instructions; Nsight Compute, tests/bench/RESULTS.md). phi's
 * exp(-x^2 / 2) takes x^2 as a float and its rounding error (an fma gives
 * it exactly), so that the exponent's rounding does not grow with x^2.
 * Float Phi is within 6 ulp of the exact value for x in [-13, 6] and phi
 * within 4, on the CPU and on the GPU (tests/unit/test_scalar_math.c);
 * erfcf of a rounded x / sqrt 2 was off by up to 193 ulp at x = -12.9. */
#ifndef MN_SCALAR_MATH_H
#define MN_SCALAR_MATH_H

#define MN_SCALAR_MATH(FN, T, M, N)                                                                          \
    FN T N(abs)(T x) { return M(fabs)(x); }                                                                  \
    FN T N(sqrt)(T x) { return M(sqrt)(x); }                                                                 \
    FN T N(exp)(T x) { return M(exp)(x); }                                                                   \
    FN T N(log)(T x) { return M(log)(x); }                                                                   \
    FN T N(tanh)(T x) { return M(tanh)(x); }                                                                 \
    FN T N(sigmoid)(T x)                                                                                     \
    {                                                                                                        \
        T e = M(exp)(-M(fabs)(x)), r = (T)1 / ((T)1 + e);                                                    \
        return x >= (T)0 ? r : e * r;                                                                        \
    }                                                                                                        \
    FN T N(softplus)(T x) { return M(fmax)(x, (T)0) + M(log1p)(M(exp)(-M(fabs)(x))); }                       \
    FN T N(sign)(T x) { return x > (T)0 ? (T)1 : x < (T)0 ? (T)-1 : x; }                                     \
    FN T N(relu)(T x) { return x > (T)0 ? x : x != x ? x : (T)0; }                                           \
    FN T N(silu)(T x) { return x * N(sigmoid)(x); }                                                          \
    FN T N(gauss)(T x) /* exp(-x^2 / 2), x^2 = h + l exactly; where e underflows, l may be -inf */           \
    {                                                                                                        \
        T h = x * x, l = M(fma)(x, x, -h), e = M(exp)((T)-0.5 * h);                                          \
        return e > (T)0 ? e - (T)0.5 * l * e : e;                                                            \
    }                                                                                                        \
    FN T N(normpdf)(T x) { return (T)0.39894228040143267794 * N(gauss)(x); }                                 \
    FN T N(normcdf)(T x)                                                                                     \
    {                                                                                                        \
        if (sizeof(T) != sizeof(float)) return (T)0.5 * M(erfc)(-x * (T)0.70710678118654752440);             \
        /* pu capped so that s = pu t stays finite at x = +-inf (a NaN x still gives NaN, by gauss) */       \
        T pu = M(fmin)((T)0.32f * M(fabs)(x), (T)1e30f), t = (T)1 / ((T)1 + pu), s = pu * t;                 \
        T p = (T)0.0210782271f;                                                                              \
        p = p * s + (T)-0.0942965224f;                                                                       \
        p = p * s + (T)0.142263949f;                                                                         \
        p = p * s + (T)-0.0607876219f;                                                                       \
        p = p * s + (T)0.0113091636f;                                                                        \
        p = p * s + (T)-0.120415866f;                                                                        \
        p = p * s + (T)0.0272910055f;                                                                        \
        p = p * s + (T)0.447910696f;                                                                         \
        p = p * s + (T)-0.746691465f;                                                                        \
        p = p * s + (T)0.49999997f;                                                                          \
        T tail = t * p * N(gauss)(x); /* Phi(-|x|) */                                                        \
        return x < (T)0 ? tail : (T)1 - tail;                                                                \
    }                                                                                                        \
    FN T N(gelu)(T x) { return x * N(normcdf)(x); }                                                          \
    FN T N(gelu_grad)(T x) { return N(normcdf)(x) + x * N(normpdf)(x); }                                     \
    FN T N(min)(T a, T b) { return (a != a || b != b) ? a + b : a <= b ? a : b; }                            \
    FN T N(max)(T a, T b) { return (a != a || b != b) ? a + b : a >= b ? a : b; }                            \
    FN T N(where)(T c, T a, T b) { return c != (T)0 ? a : b; }                                               \
    FN T N(pow)(T a, T b) { return b == (T)2 ? a * a : M(pow)(a, b); } /* x^2: exact, and the commonest */  \
    FN T N(lt)(T a, T b) { return a < b ? (T)1 : (T)0; }                                                     \
    FN T N(le)(T a, T b) { return a <= b ? (T)1 : (T)0; }                                                    \
    FN T N(gt)(T a, T b) { return a > b ? (T)1 : (T)0; }                                                     \
    FN T N(ge)(T a, T b) { return a >= b ? (T)1 : (T)0; }

/* The C math names for double and for float. */
#define MN_SM_DOUBLE(fn) fn
#define MN_SM_FLOAT(fn) fn##f

#endif
