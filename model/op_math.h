/* op_math.h: the one scalar definition of every elementwise op, shared by the
 * CPU backend, the expression evaluator and (through MN_HD) CUDA kernels, so
 * that every engine computes the same function. Double precision in, out. */
#ifndef MN_OP_MATH_H
#define MN_OP_MATH_H

#include <math.h>

#include "scalar_math.h"

#if defined(__CUDACC__)
#define MN_HD __host__ __device__ __forceinline__
#else
#define MN_HD static inline
#endif

/* The functions rules share with the expression evaluator and generated
 * kernels: one definition (scalar_math.h), here in double as mn_sm_*. */
#define MN_SM_DOUBLE_NAME(name) mn_sm_##name
MN_SCALAR_MATH(MN_HD, double, MN_SM_DOUBLE, MN_SM_DOUBLE_NAME)

MN_HD double mn_op_neg(double x) { return -x; }
MN_HD double mn_op_exp(double x) { return exp(x); }
MN_HD double mn_op_log(double x) { return log(x); }
MN_HD double mn_op_sqrt(double x) { return sqrt(x); }
MN_HD double mn_op_abs(double x) { return fabs(x); }
MN_HD double mn_op_tanh(double x) { return tanh(x); }
MN_HD double mn_op_sigmoid(double x) { return mn_sm_sigmoid(x); }
MN_HD double mn_op_silu(double x) { return mn_sm_silu(x); }
MN_HD double mn_op_gelu(double x) { return mn_sm_gelu(x); }
MN_HD double mn_op_relu(double x) { return mn_sm_relu(x); }
MN_HD double mn_op_softplus(double x) { return mn_sm_softplus(x); }
MN_HD double mn_op_sign(double x) { return mn_sm_sign(x); }
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
MN_HD double mn_op_maximum(double a, double b) { return mn_sm_max(a, b); }
MN_HD double mn_op_minimum(double a, double b) { return mn_sm_min(a, b); }
MN_HD double mn_op_lt(double a, double b) { return a < b; }
MN_HD double mn_op_le(double a, double b) { return a <= b; }
MN_HD double mn_op_gt(double a, double b) { return a > b; }
MN_HD double mn_op_ge(double a, double b) { return a >= b; }
MN_HD double mn_op_eq(double a, double b) { return a == b; }
MN_HD double mn_op_ne(double a, double b) { return a != b; }

#endif
