/* op_math.h: the one scalar definition of every elementwise op, shared by the
 * CPU backend, the expression evaluator and (through MN_HD) CUDA kernels, so
 * that every engine computes the same function. Double precision in, out. */
#ifndef MN_OP_MATH_H
#define MN_OP_MATH_H

#include <math.h>

#if defined(__CUDACC__)
#define MN_HD __host__ __device__ __forceinline__
#else
#define MN_HD static inline
#endif

MN_HD double mn_op_neg(double x) { return -x; }
MN_HD double mn_op_exp(double x) { return exp(x); }
MN_HD double mn_op_log(double x) { return log(x); }
MN_HD double mn_op_sqrt(double x) { return sqrt(x); }
MN_HD double mn_op_abs(double x) { return fabs(x); }
MN_HD double mn_op_tanh(double x) { return tanh(x); }
/* Split by sign so neither branch overflows exp(). */
MN_HD double mn_op_sigmoid(double x)
{
    if (x >= 0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}
MN_HD double mn_op_silu(double x) { return x * mn_op_sigmoid(x); }
/* Exact gelu (erf), as torch's default and SPEC.md section 1. */
MN_HD double mn_op_gelu(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440)); }
MN_HD double mn_op_relu(double x) { return x > 0 ? x : (x == x ? 0.0 : x); }
/* log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|). */
MN_HD double mn_op_softplus(double x) { return (x > 0 ? x : 0.0) + log1p(exp(-fabs(x))); }
MN_HD double mn_op_sign(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : (x == x ? 0.0 : x)); }
MN_HD double mn_op_floor(double x) { return floor(x); }
MN_HD double mn_op_round(double x) { return round(x); }
MN_HD double mn_op_isnan(double x) { return x != x ? 1.0 : 0.0; }
MN_HD double mn_op_isfinite(double x) { return isfinite(x) ? 1.0 : 0.0; }

MN_HD double mn_op_add(double a, double b) { return a + b; }
MN_HD double mn_op_sub(double a, double b) { return a - b; }
MN_HD double mn_op_mul(double a, double b) { return a * b; }
MN_HD double mn_op_div(double a, double b) { return a / b; }
MN_HD double mn_op_pow(double a, double b) { return pow(a, b); }
/* NaN-propagating, unlike fmax/fmin, so a NaN is never hidden. */
MN_HD double mn_op_maximum(double a, double b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
MN_HD double mn_op_minimum(double a, double b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
MN_HD double mn_op_lt(double a, double b) { return a < b; }
MN_HD double mn_op_le(double a, double b) { return a <= b; }
MN_HD double mn_op_gt(double a, double b) { return a > b; }
MN_HD double mn_op_ge(double a, double b) { return a >= b; }
MN_HD double mn_op_eq(double a, double b) { return a == b; }
MN_HD double mn_op_ne(double a, double b) { return a != b; }

#endif
