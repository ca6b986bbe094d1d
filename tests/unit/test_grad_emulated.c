/* test_grad_emulated.c: the GPU's backward kernel (kernels/grad_kernel.cuh)
 * against the CPU's (model/grad_cpu.c) on a machine without a GPU. For each
 * case (rules across losses, activations, clip kinds and scopes, custom
 * expressions, depth 1-3, bias, residual, glu, q, steps longer than a chunk,
 * refresh 0 / c / k c, both retrieve modes, lengths, non-finite k, v and
 * theta, block sizes; the fused backward's too, refresh = step and not;
 * out_norm layernorm and rmsnorm with ln_g, ln_b, whose
 * gradients are compared too; qk_norm l2 and rms) it generates the rule's backward source as the CUDA
 * backend does (mn_cuda_grad_source), compiles it as C++ with
 * tests/emu/cuda_shim.h (threads as pthreads, barriers as barriers, warp
 * shuffles through a buffer) and runs tests/emu/grad_emu.cpp on the inputs
 * of a CPU backward it ran here, which compares every gradient. With
 * qk_norm the emulation does what kernels/grad_cuda.c does on a GPU: it
 * normalises the keys and queries (kernels/rownorm_warp.cuh, as ops.cu's
 * kernel), runs the kernel generated for the rule without qk_norm on them,
 * and takes the kernel's key and query gradients back through the
 * normalisation (the same file's adjoint), against the CPU's backward of the
 * rule with qk_norm. The same
 * algorithm in the same fp32 order (bar the sums of small products) agrees
 * to about 1e-7; the bound is 1e-5. Needs a C++ compiler (g++ or $CXX):
 * without one, SKIP. Run from the repository root (tests/run.sh does). */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "rule_cases.h"
#include "emu_case.h"
#include "grad.h"
#include "rownorm.h"
#include "../../kernels/codegen.h"
#include "../../kernels/plan.h"

#include <stdlib.h>

typedef struct {
    int rule;          /* index in rules[] */
    bool q;            /* a query input */
    int bad;           /* 1: a NaN key, 2: a NaN theta, 3: an Inf value */
    bool lengths;      /* ragged: lengths {T, 6} */
    int block;         /* K (0: about sqrt(S)) */
    bool fused;        /* the fused backward's kernel (kernels/fused_grad.cuh) instead of the general one */
} variant;

/* A variant with out_norm on its rule (layernorm, rmsnorm), ln_g, ln_b random [B,H,dv]. */
typedef struct {
    variant v;
    mn_norm out_norm;
} norm_variant;

/* The options a variant turns on over its rule case's own. */
typedef struct {
    mn_norm out_norm; /* with ln_g, ln_b random [B,H,dv] */
    bool glu;         /* gated hidden layers */
    mn_qknorm qk_norm;
    int ns_steps;     /* > 0: precondition = newton_schulz with these steps */
} emu_options;

static const rule_case rules[] = {
    {"linear_mse", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 1, 1,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 4, 0, false, false},
    {"linear_l1_norm", 1, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_L1, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 4, 0,
     MN_RETRIEVE_BEFORE, MN_PREC_FP32, 5, 3, 0, true, true},
    {"mlp2_gelu_huber_softnorm_tensor", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 3, 6, MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 7, 9, false, false},
    {"mlp2_relu_lp_value_residual", 2, 0, 1, MN_ACT_RELU, NULL, MN_LOSS_LP, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL,
     NULL, 2, 2, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 6, 6, 12, false, true},
    {"mlp3_tanh_dot_residual_refresh0", 3, 1, 1, MN_ACT_TANH, NULL, MN_LOSS_DOT, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL,
     NULL, 1, 0, MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 4, 16, true, false},
    {"mlp2_identity_custom_scale", 2, 1, 0, MN_ACT_IDENTITY, NULL, MN_LOSS_CUSTOM, "w*(y - v)^2 + c3*abs(r)^3",
     MN_CLIP_SCALE, MN_SCOPE_GLOBAL, "exp(-n/(n + m))", 5, 10, MN_RETRIEVE_AFTER, MN_PREC_FP32, 3, 2, 5, false,
     false},
    {"mlp3_custom_act_elementwise", 3, 0, 0, MN_ACT_CUSTOM, "max(z, a*z)", MN_LOSS_CUSTOM,
     "where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL,
     "m*tanh(g/m)", 1, 1, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 8, 3, 4, false, true},
    {"mlp2_custom_act_scale_tensor", 2, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_CUSTOM, "log(1 + r^2)",
     MN_CLIP_SCALE, MN_SCOPE_TENSOR, "where(n > m, m/n, 1)", 7, 0, MN_RETRIEVE_AFTER, MN_PREC_FP32, 2, 9, 3, true,
     false},
    {"linear_long_step_chunked", 1, 1, 1, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_TENSOR, NULL,
     70, 140, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 4, 4, 0, false, true},
    {"mlp2_silu_logcosh_softvalue", 2, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_LOGCOSH, NULL, MN_CLIP_SOFTVALUE,
     MN_SCOPE_GLOBAL, NULL, 4, 8, MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 5, 6, false, false},
    /* refresh = step: rules the fused backward takes */
    {"fused_linear_norm", 1, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 4, 4,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 6, 0, false, false},
    {"fused_mlp2_gelu_huber_softnorm_tensor_mean", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 3, 3, MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 7, 9, false, true},
    {"fused_mlp2_relu_lp_value_residual_before", 2, 0, 1, MN_ACT_RELU, NULL, MN_LOSS_LP, NULL, MN_CLIP_VALUE,
     MN_SCOPE_GLOBAL, NULL, 2, 2, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 6, 6, 12, false, false},
    {"fused_mlp2_custom_act_loss_scale_sum", 2, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_CUSTOM,
     "log(1 + r^2)", MN_CLIP_SCALE, MN_SCOPE_GLOBAL, "exp(-n/(n + m))", 5, 5, MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 5, 6,
     true, false},
    {"fused_mlp2_long_step_elementwise", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_ELEMENTWISE,
     MN_SCOPE_GLOBAL, "m*tanh(g/m)", 70, 70, MN_RETRIEVE_AFTER, MN_PREC_FP32, 8, 8, 20, false, false},
    /* for glu_variants: the gates' tangent and adjoints at depth 2 and 3 */
    {"glu2_silu_bias_norm", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 3, 6,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 4, 7, false, false},
    {"glu3_gelu_huber_softnorm_tensor_residual", 3, 0, 1, MN_ACT_GELU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 2, 0, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 6, 6, 8, false, false},
    {"glu2_tanh_dot_value", 2, 0, 0, MN_ACT_TANH, NULL, MN_LOSS_DOT, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL, NULL, 1, 4,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 5, 6, false, false},
    {"glu3_custom_act_loss_elementwise_bias_mean", 3, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_CUSTOM,
     "log(1 + r^2)", MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL, "m*tanh(g/m)", 4, 8, MN_RETRIEVE_AFTER, MN_PREC_FP32, 4, 3,
     5, true, true},
    {"glu2_long_step_chunked_bias_tensor", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM,
     MN_SCOPE_TENSOR, NULL, 70, 140, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 4, 4, 6, false, true},
    /* refresh != step: the fused backward takes the gradient at the refresh
     * block's anchor (refresh 2c, 4c, 0) */
    {"fused_mlp2_gelu_norm_refresh2c", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL,
     NULL, 3, 6, MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 7, 9, false, false},
    {"fused_mlp2_relu_huber_value_residual_before_refresh4c", 2, 0, 1, MN_ACT_RELU, NULL, MN_LOSS_HUBER, NULL,
     MN_CLIP_VALUE, MN_SCOPE_GLOBAL, NULL, 2, 8, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 6, 6, 12, false, false},
    {"fused_linear_softnorm_tensor_mean_refresh0", 1, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 2, 0, MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 6, 0, false, true},
    {"fused_mlp2_long_step_elementwise_refresh2c", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_ELEMENTWISE,
     MN_SCOPE_GLOBAL, "m*tanh(g/m)", 70, 140, MN_RETRIEVE_AFTER, MN_PREC_FP32, 8, 8, 20, false, false},
    {"fused_mlp2_custom_act_loss_scale_before_refresh0", 2, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))",
     MN_LOSS_CUSTOM, "log(1 + r^2)", MN_CLIP_SCALE, MN_SCOPE_GLOBAL, "exp(-n/(n + m))", 4, 0, MN_RETRIEVE_BEFORE,
     MN_PREC_FP32, 4, 5, 6, false, false},
};

static const variant variants[] = {
    {0, false, 0, false, 0, false}, {1, false, 3, false, 0, false}, {2, true, 0, true, 0, false},
    {3, false, 1, false, 0, false}, {4, true, 0, false, 5, false},  {5, false, 2, false, 0, false},
    {6, false, 0, true, 0, false},  {7, true, 0, false, 0, false},  {8, true, 0, true, 0, false},
    {9, false, 0, false, 1, false},
    /* the fused backward: every part of its step (q, retrieve modes, clips,
     * lengths, non-finite inputs, steps of several chunks, blocks) */
    {0, false, 0, false, 0, true},  {3, true, 0, false, 0, true},  {10, true, 0, false, 0, true},
    {10, false, 1, false, 3, true}, {11, false, 0, true, 0, true}, {11, true, 3, false, 0, true},
    {12, true, 0, false, 0, true},  {12, false, 2, true, 0, true}, {13, false, 0, false, 1, true},
    {13, true, 0, true, 0, true},   {14, false, 0, true, 0, true}, {14, true, 1, false, 0, true},
    /* refresh != step on the fused backward: retrieve before and after, q,
     * lengths (refresh blocks opening in the padding), non-finite inputs,
     * steps of several chunks, blocks of K steps that divide the refresh
     * block (2 of 2, 2 of 4) and that do not (3 of 4, 3 of 2) */
    {20, false, 0, false, 0, true}, {20, true, 1, false, 0, true}, {20, false, 0, true, 2, true},
    {20, false, 0, false, 3, true}, {21, false, 0, false, 3, true}, {21, true, 2, true, 0, true},
    {21, false, 0, false, 2, true}, {22, false, 0, false, 0, true}, {22, true, 3, true, 0, true},
    {22, false, 0, false, 3, true}, {23, false, 0, true, 0, true},  {23, true, 1, false, 0, true},
    {24, false, 0, false, 0, true}, {24, true, 0, true, 2, true},
};

/* out_norm on the general backward: layernorm and rmsnorm, 1 to 3 layers,
 * bias on and off, residual, refresh = step and not, clips, q, lengths, a
 * NaN key or theta (a skipped step), steps of several chunks, blocks */
static const norm_variant norm_variants[] = {
    {{0, true, 0, false, 0, false}, MN_NORM_LAYERNORM}, {{1, true, 0, false, 0, false}, MN_NORM_RMSNORM},
    {{2, true, 0, true, 0, false}, MN_NORM_LAYERNORM},  {{2, false, 0, false, 2, false}, MN_NORM_RMSNORM},
    {{3, false, 1, false, 0, false}, MN_NORM_RMSNORM},  {{3, true, 0, false, 0, false}, MN_NORM_LAYERNORM},
    {{4, false, 0, false, 5, false}, MN_NORM_LAYERNORM}, {{5, false, 2, false, 0, false}, MN_NORM_RMSNORM},
    {{8, true, 0, true, 0, false}, MN_NORM_LAYERNORM},  {{9, false, 0, true, 0, false}, MN_NORM_RMSNORM},
};

/* The glu rules (15-19) with glu on, on the general backward: depth 2 and 3,
 * bias or not, refresh != step, clips, q, lengths, non-finite inputs, blocks */
static const variant glu_variants[] = {
    {15, false, 0, false, 0, false}, {15, true, 0, true, 0, false},  {15, false, 2, false, 0, false},
    {16, false, 0, false, 0, false}, {16, true, 1, false, 3, false},  {17, false, 0, true, 0, false},
    {17, true, 3, false, 0, false},  {18, false, 0, false, 0, false}, {18, true, 0, true, 1, false},
    {19, false, 0, false, 0, false}, {19, true, 0, true, 0, false},
};

/* qk_norm: the keys and queries normalised around either kernel; depth 1-3,
 * bias or not, refresh 0 / c / k c, clips, retrieve before, lengths, q, a
 * NaN key, blocks; l2 and rms */
static const struct {
    variant v;
    mn_qknorm qk;
} qk_variants[] = {
    {{0, true, 0, false, 0, false}, MN_QKNORM_L2},  {{1, false, 1, false, 0, false}, MN_QKNORM_L2},
    {{2, true, 0, true, 0, false}, MN_QKNORM_RMS},  {{4, true, 0, false, 5, false}, MN_QKNORM_L2},
    {{7, true, 0, false, 0, false}, MN_QKNORM_RMS}, {{8, true, 0, true, 0, false}, MN_QKNORM_RMS},
    {{10, true, 0, false, 0, true}, MN_QKNORM_L2},  {{11, false, 0, true, 0, true}, MN_QKNORM_RMS},
    {{12, true, 1, false, 0, true}, MN_QKNORM_L2},  {{13, true, 0, false, 1, true}, MN_QKNORM_RMS},
    {{14, true, 0, true, 0, true}, MN_QKNORM_L2},
};

/* precondition = newton_schulz with ns_steps on a variant of the general
 * backward (with and without bias, depth 1-3, matrices wide, square and
 * tall (transposed), refresh = step, 0 and k c, every clip kind, q,
 * lengths, a NaN key and a skipped step, blocks, steps of several chunks)
 * and of the fused one (refresh = step) */
typedef struct {
    variant va;
    int ns_steps;
} ns_variant;

static const ns_variant ns_variants[] = {
    {{0, false, 0, false, 0, false}, 5}, {{1, true, 0, false, 0, false}, 3}, {{2, true, 0, true, 0, false}, 5},
    {{3, false, 1, false, 0, false}, 2}, {{4, true, 0, false, 5, false}, 1}, {{5, false, 0, false, 2, false}, 4},
    {{6, false, 0, true, 0, false}, 3}, {{7, true, 0, false, 0, false}, 5}, {{8, false, 0, true, 0, false}, 2},
    {{9, false, 2, false, 1, false}, 4},
    /* the fused backward's (refresh = step). One row a step (linear_mse)
     * gives G of rank one: the iteration multiplies the rounding in its
     * other directions by up to 3.4445 per step, and the fused products
     * round differently from the CPU's (ns 5: 2e-5 here, ns 3: 1e-6) */
    {{0, false, 0, false, 0, true}, 3},  {{10, true, 0, false, 0, true}, 3}, {{11, false, 0, true, 0, true}, 5},
    {{12, true, 1, false, 0, true}, 2},  {{13, false, 2, false, 3, true}, 4}, {{14, false, 0, true, 0, true}, 2},
};

/* The case's inputs, the CPU backward and the file grad_emu.cpp reads;
 * also the generated source. Returns false with why. */
static bool prepare(const variant *va, const emu_options *o, const char *dir, char *why, size_t wlen)
{
    const rule_case *c = &rules[va->rule];
    mn_rule r;
    mn_status made = make_rule(c, &r);
    if (made == MN_OK && (o->out_norm != MN_NORM_NONE || o->glu || o->ns_steps > 0)) {
        r.out_norm = o->out_norm;
        r.glu = o->glu;
        if (o->ns_steps > 0) {
            r.precondition = MN_PRECOND_NEWTON_SCHULZ;
            r.ns_steps = o->ns_steps;
        }
        made = mn_rule_validate(&r);
    }
    if (made != MN_OK) {
        snprintf(why, wlen, "the rule is invalid: %s", mn_last_error());
        mn_rule_free(&r);
        return false;
    }
    int64_t B = 2, H = 2, n = c->step >= 64 ? 150 : 13, S = (n + c->step - 1) / c->step;
    mn_dims d = {B, H, n, c->dk, c->dv, c->dh, S};
    char path[512];
    char *src = NULL;
    /* the kernel's rule, as grad_cuda.c hands it the keys normalised: without
     * qk_norm (r itself has it, for the CPU's backward) */
    r.qk_norm = MN_QKNORM_NONE;
    if (va->fused) {
        mn_cuda_plan bp;
        if (mn_cuda_plan_backward(&r, &d, MN_PREC_FP32, 90, 0, &bp) != MN_OK || bp.path != MN_PATH_FUSED) {
            snprintf(why, wlen, "the fused backward does not take it: %s", bp.why);
            mn_rule_free(&r);
            return false;
        }
        src = mn_cuda_fused_grad_source(&r, &d, MN_PREC_FP32, &bp);
    } else {
        src = mn_cuda_grad_source(&r, &d);
    }
    r.qk_norm = o->qk_norm;
    mn_rownorm qk = mn_rule_qk_norm(&r);
    snprintf(path, sizeof path, "%s/grad.cu", dir);
    bool ok = write_emu_source(path, src, &r);
    free(src);
    if (!ok) {
        snprintf(why, wlen, "no source: %s", mn_last_error());
        mn_rule_free(&r);
        return false;
    }
    int64_t ks[4] = {B, H, n, c->dk}, vs[4] = {B, H, n, c->dv}, ts[3] = {B, H, n}, ss[3] = {B, H, S};
    mn_segment_inputs in = {0};
    mn_tensor init[MN_MAX_PARAMS] = {{0}}, mom[MN_MAX_PARAMS] = {{0}}, outer[MN_OUTER_COUNT] = {{0}};
    mn_run_upstream up;
    memset(&up, 0, sizeof up);
    mn_run_grads g = {0};
    mn_status s = random_tensor(&in.k, 4, ks, 0.5, 0);
    if (s == MN_OK) s = random_tensor(&in.v, 4, vs, 0.5, 0);
    if (s == MN_OK && va->q) s = random_tensor(&in.q, 4, ks, 0.5, 0);
    if (s == MN_OK) s = random_tensor(&in.theta, 3, ts, 0.03, 0.1);
    if (s == MN_OK) s = random_tensor(&in.eta, 3, ss, 0.05, 0.5);
    if (s == MN_OK) s = random_tensor(&in.alpha, 3, ss, 0.005, 0.01);
    if (s == MN_OK && va->bad == 1) ((float *)mn_tensor_data(&in.k))[(1 * H * n + 0 * n + 5) * c->dk] = NAN;
    if (s == MN_OK && va->bad == 2) ((float *)mn_tensor_data(&in.theta))[0 * H * n + 1 * n + 4] = NAN;
    if (s == MN_OK && va->bad == 3) ((float *)mn_tensor_data(&in.v))[(0 * H * n + 1 * n + 3) * c->dv] = INFINITY;
    long long lengths[2] = {(long long)n, 6};
    if (s == MN_OK && va->lengths) {
        s = mn_tensor_empty(&in.lengths, MN_I64, 1, &B, MN_CPU);
        if (s == MN_OK) memcpy(mn_tensor_data(&in.lengths), lengths, sizeof lengths);
    }
    int np = mn_rule_param_count(&r);
    for (int p = 0; p < np && s == MN_OK; p++) {
        int64_t sh[4] = {B, H};
        int pd = mn_rule_param_shape(&r, &d, p, sh + 2);
        s = random_tensor(&init[p], pd + 2, sh, 0.4, 0);
        if (s == MN_OK) s = random_tensor(&mom[p], pd + 2, sh, 0.05, 0);
        if (s == MN_OK) s = random_tensor(&up.dparams[p], pd + 2, sh, 1, 0);
        if (s == MN_OK) s = random_tensor(&up.dmomenta[p], pd + 2, sh, 0.5, 0);
    }
    /* ln_g, ln_b away from their defaults (1, 0), different per memory */
    int64_t os[3] = {B, H, c->dv};
    int nouter = mn_rule_outer_count(&r);
    if (s == MN_OK && nouter) s = random_tensor(&outer[0], 3, os, 0.3, 1.0);
    if (s == MN_OK && nouter) s = random_tensor(&outer[1], 3, os, 0.2, 0);
    if (s == MN_OK) s = random_tensor(&up.dy, 4, vs, 1, 0);
    if (s == MN_OK) s = random_tensor(&up.dloss, 3, ts, 1, 0);
    if (s == MN_OK) s = mn_run_backward(&r, &d, init, mom, nouter ? outer : NULL, &in, &up, va->block, NULL, &g);
    snprintf(path, sizeof path, "%s/case.bin", dir);
    FILE *f = s == MN_OK ? fopen(path, "wb") : NULL;
    ok = f != NULL;
    if (ok) {
        /* h[7]: ln_g, ln_b to read (0 or 2); h[8]: qk_norm, 1 + 2 center + 4 sum (0: none) */
        long long h[9] = {B, H, n, S, np, g.block, va->lengths ? B : 0, nouter,
                          qk.on ? 1 + 2 * qk.center + 4 * qk.sum : 0};
        ok = fwrite(h, 8, 9, f) == 9 && (!va->lengths || fwrite(lengths, 8, 2, f) == 2);
        const mn_tensor *ins[] = {&in.k, &in.v, &in.q, &in.theta, &in.eta, &in.alpha, &up.dy, &up.dloss};
        for (int i = 0; i < 8 && ok; i++) ok = write_tensor(f, ins[i]);
        for (int p = 0; p < np && ok; p++)
            ok = write_tensor(f, &init[p]) && write_tensor(f, &mom[p]) && write_tensor(f, &up.dparams[p]) &&
                 write_tensor(f, &up.dmomenta[p]);
        for (int j = 0; j < nouter && ok; j++) ok = write_tensor(f, &outer[j]);
        const mn_tensor *outs[] = {&g.k, &g.v, &g.q, &g.theta, &g.eta, &g.alpha};
        for (int i = 0; i < 6 && ok; i++) ok = write_tensor(f, outs[i]);
        for (int p = 0; p < np && ok; p++) ok = write_tensor(f, &g.params[p]) && write_tensor(f, &g.momenta[p]);
        for (int j = 0; j < nouter && ok; j++) ok = write_tensor(f, &g.outer[j]);
        ok = fclose(f) == 0 && ok;
    }
    if (!ok) snprintf(why, wlen, "%s", s != MN_OK ? mn_last_error() : "cannot write the case file");
    mn_tensor *ts_[] = {&in.k, &in.v, &in.q, &in.theta, &in.eta, &in.alpha, &in.lengths, &up.dy, &up.dloss};
    for (size_t i = 0; i < sizeof ts_ / sizeof *ts_; i++) mn_tensor_release(ts_[i]);
    for (int j = 0; j < MN_OUTER_COUNT; j++) mn_tensor_release(&outer[j]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&init[p]);
        mn_tensor_release(&mom[p]);
        mn_tensor_release(&up.dparams[p]);
        mn_tensor_release(&up.dmomenta[p]);
    }
    mn_run_grads_free(&g);
    mn_rule_free(&r);
    return ok;
}

static void run_variant(const variant *va, const emu_options *o, const char *cxx, const char *dir)
{
    const rule_case *c = &rules[va->rule];
    char name[192], why[512] = "", ns[16] = "", block[24] = "";
    if (o->ns_steps > 0) snprintf(ns, sizeof ns, "ns%d/", o->ns_steps);
    if (va->block) snprintf(block, sizeof block, "/block%d", va->block);
    snprintf(name, sizeof name, "grad_emulated/%s%s%s%s%s%s%s%s%s%s%s", va->fused ? "fused/" : "", ns, c->name,
             o->out_norm == MN_NORM_LAYERNORM ? "/layernorm" : o->out_norm == MN_NORM_RMSNORM ? "/rmsnorm" : "",
             o->glu ? "/glu" : "", va->q ? "/q" : "",
             va->bad == 1 ? "/nan_k" : va->bad == 2 ? "/nan_theta" : va->bad == 3 ? "/inf_v" : "",
             va->lengths ? "/lengths" : "", block, o->qk_norm ? "/qk_norm_" : "",
             o->qk_norm ? mn_part_name(&mn_qknorm_set, o->qk_norm) : "");
    /* MNEMO_EMU_ONLY=TEXT: only the variants whose name holds TEXT (a quicker look: "ns3/", "/glu") */
    const char *only = getenv("MNEMO_EMU_ONLY");
    if (only && *only && !strstr(name, only)) return;
    if (!prepare(va, o, dir, why, sizeof why)) {
        printf("FAIL %s: %s\n", name, why);
        check_failures_++;
        return;
    }
    char source[512], extra[64], all[2048], worst_name[64] = "";
    double worst;
    snprintf(source, sizeof source, "%s/grad.cu", dir);
    snprintf(extra, sizeof extra, "-DMN_EMU_ROWNORM_EPS=%.17g", MN_ROWNORM_EPS);
    if (!emulate(cxx, dir, "grad_emu", source, extra, &worst, worst_name, all, sizeof all, NULL, why, sizeof why)) {
        printf("FAIL %s: %s\n", name, why);
        check_failures_++;
    } else {
        check_worst(name, worst, worst_name, "gradient", all);
    }
}

int main(int argc, char **argv)
{
    (void)print_log; /* rule_cases.h's, for the NVRTC tests */
    /* The CPU backward's products go through OpenBLAS, whose kernel for
     * the machine's core sets the order of their sums and whether they fuse
     * multiply-adds; the emulated kernel adds in order without fusing
     * (-ffp-contract=off). On an AMD EPYC VM (OpenBLAS's Haswell kernels)
     * two Newton-Schulz and layernorm cases then differed by 1.7-2.3e-5,
     * which passed on an earlier Xeon VM; with OpenBLAS's plain SSE3 kernels
     * they agree to the bit. What this test compares is the kernel's
     * algorithm with the CPU's, not two BLAS builds: it runs itself again
     * with that core type, unless OPENBLAS_CORETYPE is set (the caller's
     * choice) or the library ignores it (a build for one core). */
    if (argc > 0 && !getenv("OPENBLAS_CORETYPE")) {
        setenv("OPENBLAS_CORETYPE", "Prescott", 1);
        fflush(stdout);
        execv("/proc/self/exe", argv);
        /* no re-exec: on with the machine's kernels */
    }
    char dir[] = "/tmp/mnemo_grad_emu_XXXXXX";
    const char *cxx = emu_setup("grad_emulated", "grad_emu", dir);
    if (!cxx) return CHECK_DONE();
    const emu_options none = {MN_NORM_NONE, false, MN_QKNORM_NONE, 0};
    for (size_t i = 0; i < sizeof variants / sizeof *variants; i++) run_variant(&variants[i], &none, cxx, dir);
    for (size_t i = 0; i < sizeof norm_variants / sizeof *norm_variants; i++) {
        const emu_options o = {norm_variants[i].out_norm, false, MN_QKNORM_NONE, 0};
        run_variant(&norm_variants[i].v, &o, cxx, dir);
    }
    for (size_t i = 0; i < sizeof glu_variants / sizeof *glu_variants; i++) {
        const emu_options o = {MN_NORM_NONE, true, MN_QKNORM_NONE, 0};
        run_variant(&glu_variants[i], &o, cxx, dir);
    }
    /* out_norm and glu together: the norm after the gated layers */
    for (size_t i = 0; i < 4; i++) {
        const emu_options o = {i % 2 ? MN_NORM_RMSNORM : MN_NORM_LAYERNORM, true, MN_QKNORM_NONE, 0};
        run_variant(&glu_variants[3 * i], &o, cxx, dir);
    }
    for (size_t i = 0; i < sizeof qk_variants / sizeof *qk_variants; i++) {
        const emu_options o = {MN_NORM_NONE, false, qk_variants[i].qk, 0};
        run_variant(&qk_variants[i].v, &o, cxx, dir);
    }
    for (size_t i = 0; i < sizeof ns_variants / sizeof *ns_variants; i++) {
        const emu_options o = {MN_NORM_NONE, false, MN_QKNORM_NONE, ns_variants[i].ns_steps};
        run_variant(&ns_variants[i].va, &o, cxx, dir);
    }
    /* newton_schulz with glu (the gates are matrices too) and with out_norm */
    const emu_options ns_glu = {MN_NORM_NONE, true, MN_QKNORM_NONE, 3};
    const emu_options ns_norm = {MN_NORM_LAYERNORM, false, MN_QKNORM_NONE, 2};
    run_variant(&glu_variants[0], &ns_glu, cxx, dir);
    run_variant(&glu_variants[4], &ns_glu, cxx, dir);
    run_variant(&norm_variants[2].v, &ns_norm, cxx, dir);
    /* newton_schulz on the fused backward with refresh != step (70-row
     * steps: G of full rank, see ns_variants) */
    const variant ns_anchor[] = {{23, false, 0, false, 0, true}, {23, true, 0, true, 0, true}};
    for (size_t i = 0; i < sizeof ns_anchor / sizeof *ns_anchor; i++) {
        const emu_options o = {MN_NORM_NONE, false, MN_QKNORM_NONE, 3 - (int)i};
        run_variant(&ns_anchor[i], &o, cxx, dir);
    }
    return emu_finish(dir);
}

#else

int main(void)
{
    SKIP("grad_emulated", "built without CUDA (no code generator)");
    return CHECK_DONE();
}

#endif
