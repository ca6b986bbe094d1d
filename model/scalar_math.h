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
 * them. Exact gelu through erfc, which keeps precision for x << 0. */
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
    FN T N(normcdf)(T x) { return (T)0.5 * M(erfc)(-x * (T)0.70710678118654752440); }                       \
    FN T N(normpdf)(T x) { return (T)0.39894228040143267794 * M(exp)((T)-0.5 * x * x); }                     \
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
