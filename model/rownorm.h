/* rownorm.h: the row normalisations of SPEC.md section 1 (v2): out_norm
 * (layernorm, rmsnorm) and qk_norm (l2, rms), all one map applied to each
 * row x of n features:
 *     c = x - mean(x)   (layernorm only; else c = x)
 *     nhat = c s,  s = 1 / sqrt(|c|^2 / D + 1e-6),  D = n (mean) or 1 (sum, l2)
 * The row of the rule table (rule.def) says which: MN_PART_CENTER and
 * MN_PART_SUMSQ. Here: the map, its tangent, its adjoint and the second-order
 * term the backward of a step's gradient needs; float data, double inside. */
#ifndef MN_ROWNORM_H
#define MN_ROWNORM_H

#include "rule.h"

#define MN_ROWNORM_EPS 1e-6

typedef struct mn_rownorm {
    bool on, center, sum;
} mn_rownorm;

/* From a row of MN_NORMS or MN_QKNORMS (the "none" row: off). */
mn_rownorm mn_rownorm_of(const mn_part *row);
mn_rownorm mn_rule_out_norm(const mn_rule *r);
mn_rownorm mn_rule_qk_norm(const mn_rule *r);

/* nhat (rows x n) and s (rows) of x; nhat may alias x. */
void mn_rownorm_forward(mn_rownorm nm, const float *x, int64_t rows, int64_t n, float *nhat, float *s);
/* The tangent: nd = J(x) xd, from the forward's nhat and s (nd may alias xd). */
void mn_rownorm_jvp(mn_rownorm nm, const float *nhat, const float *s, const float *xd, int64_t rows, int64_t n,
                    float *nd);
/* The adjoint: xbar (+)= J(x)^T a (accumulate: add to xbar, else overwrite; xbar may alias a when not accumulating). */
void mn_rownorm_vjp(mn_rownorm nm, const float *nhat, const float *s, const float *a, int64_t rows, int64_t n,
                    float *xbar, bool accumulate);
/* The second-order term: xbar += d/dx <a, J(x) xd> with xd held fixed. */
void mn_rownorm_hvp_acc(mn_rownorm nm, const float *nhat, const float *s, const float *xd, const float *a,
                        int64_t rows, int64_t n, float *xbar);

/* out = the map on the rows of x (last dimension), a new f32 tensor on x's
 * device: on the CPU the loops above, elsewhere the device backend's rownorm
 * kernel (model/ops.h), so a CUDA run's keys and queries are normalised
 * where they live. */
mn_status mn_rownorm_tensor(mn_rownorm nm, const mn_tensor *x, mn_tensor *out);
/* As mn_rownorm_tensor, and scale = each row's s, a new f32 tensor of x's
 * shape less its last dimension on x's device (nm must be on): what the
 * adjoint below needs, so that a device's backward takes its keys' and
 * queries' gradients back through qk_norm where they live. */
mn_status mn_rownorm_tensor_scaled(mn_rownorm nm, const mn_tensor *x, mn_tensor *out, mn_tensor *scale);
/* a = J(x)^T a in place, from the forward's out (nhat) and scale, all
 * contiguous f32 on one device: mn_rownorm_vjp's loops on the CPU, the
 * device backend's rownorm_vjp elsewhere. */
mn_status mn_rownorm_vjp_tensor(mn_rownorm nm, const mn_tensor *nhat, const mn_tensor *scale, mn_tensor *a);

#endif
