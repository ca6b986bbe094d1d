/* test_engine.c: the CPU engine against hand-derived cases (SPEC.md section 2):
 * a linear memory with mse and c = 1 against its closed form in double; one
 * run equals the same sequence fed piece by piece; injected NaN skips exactly
 * the affected steps; every gate shape broadcasts like the full tensor;
 * built-in losses, activations and clips equal their expression forms run as
 * custom parts; every derivative against finite differences in float64; the
 * memory state as mn_memory_create lays it out (one block: W, anchors,
 * momenta, each at 64 floats, gaps zero, the anchors W's values or, where
 * refresh = step, W's own views, given momenta kept);
 * and the errors that must come before anything runs. */
#include "check.h"
#include "engine.h"
#include "ops.h"
#include "random.h"

#include <stdlib.h>
#include <string.h>

static mn_tensor randn4(int64_t a, int64_t b, int64_t c, int64_t d, double std, mn_rng *rng)
{
    mn_tensor t = {0};
    int64_t shape[4] = {a, b, c, d};
    mn_tensor_randn(&t, MN_F32, 4, shape, 0, std, rng);
    return t;
}

static mn_tensor scalar(double x)
{
    mn_tensor t = {0};
    mn_tensor_full(&t, MN_F32, 0, NULL, x, MN_CPU);
    return t;
}

static double rel_err(const mn_tensor *a, const mn_tensor *b)
{
    mn_tensor d = {0};
    double nd, nb;
    if (mn_binary(MN_OP_sub, &d, a, b) != MN_OK) return INFINITY;
    mn_reduce_all(MN_OP_norm, &d, &nd);
    mn_reduce_all(MN_OP_norm, b, &nb);
    mn_tensor_release(&d);
    return nb > 0 ? nd / nb : nd;
}

typedef struct run_case {
    mn_rule rule;
    mn_dims dims;
    mn_tensor k, v, q, theta, eta, alpha;
    mn_tensor init[MN_MAX_PARAMS];
} run_case;

static void case_free(run_case *c)
{
    mn_rule_free(&c->rule);
    mn_tensor *ts[] = {&c->k, &c->v, &c->q, &c->theta, &c->eta, &c->alpha};
    for (int i = 0; i < 6; i++) mn_tensor_release(ts[i]);
    for (int i = 0; i < MN_MAX_PARAMS; i++) mn_tensor_release(&c->init[i]);
}

/* A small random case: B=2, H=2, T tokens, d=4, MLP of hidden 6 when layers 2. */
static void case_make(run_case *c, int layers, int64_t T, int step, uint64_t seed)
{
    memset(c, 0, sizeof *c);
    mn_rule_init(&c->rule);
    c->rule.layers = layers;
    c->rule.bias = layers >= 2;
    c->rule.hidden = layers >= 2 ? 6 : 0;
    c->rule.step = step;
    c->dims = (mn_dims){.B = 2, .H = 2, .T = T, .dk = 4, .dv = 4, .dh = layers >= 2 ? 6 : 0};
    mn_rng rng;
    mn_rng_seed(&rng, seed);
    c->k = randn4(2, 2, T, 4, 0.5, &rng);
    c->v = randn4(2, 2, T, 4, 0.5, &rng);
    c->theta = scalar(0.1);
    c->eta = scalar(0.5);
    c->alpha = scalar(0.05);
    mn_init_params(&c->rule, &c->dims, "normal", seed + 1, false, c->init, MN_CPU);
    /* larger weights so the MLP is not nearly linear */
    for (int i = 0; i < mn_rule_param_count(&c->rule); i++) {
        mn_tensor scaled = {0};
        mn_binary_scalar(MN_OP_mul, &scaled, &c->init[i], 20.0, false);
        mn_tensor_release(&c->init[i]);
        c->init[i] = scaled;
    }
}

static mn_status case_run(const run_case *c, mn_memory_state *st, mn_segment_outputs *out)
{
    MN_TRY(mn_memory_create(st, &c->rule, &c->dims, c->init, NULL, MN_CPU));
    mn_segment_inputs in = {c->k, c->v, c->q, c->theta, c->eta, c->alpha, true, {0}};
    mn_status s = mn_segment_run(st, &in, out);
    if (s != MN_OK) mn_memory_free(st);
    return s;
}

/* Linear memory, mse, c = 1, no momentum or decay:
 * W <- W - theta (2/dv) (W k - v) k^T, retrieval after = W^(t+1) q_t. */
static void test_closed_form(void)
{
    run_case c;
    case_make(&c, 1, 12, 1, 7);
    mn_tensor_release(&c.eta);
    mn_tensor_release(&c.alpha);
    mn_memory_state st;
    mn_segment_outputs out;
    CHECK("closed form: run", case_run(&c, &st, &out) == MN_OK);
    double worst_w = 0, worst_y = 0, worst_l = 0;
    int64_t d = 4, T = 12;
    for (int64_t m = 0; m < 4; m++) {
        double W[16];
        const float *w0 = (const float *)mn_tensor_data(&c.init[0]) + m * 16;
        for (int i = 0; i < 16; i++) W[i] = w0[i];
        const float *k = (const float *)mn_tensor_data(&c.k) + m * T * d;
        const float *v = (const float *)mn_tensor_data(&c.v) + m * T * d;
        for (int64_t t = 0; t < T; t++) {
            double r[4], loss = 0;
            for (int i = 0; i < 4; i++) {
                double y = 0;
                for (int j = 0; j < 4; j++) y += W[i * 4 + j] * k[t * d + j];
                r[i] = y - v[t * d + i];
                loss += r[i] * r[i] / 4;
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) W[i * 4 + j] -= 0.1 * (2.0 / 4) * r[i] * k[t * d + j];
            double got_l = ((const float *)mn_tensor_data(&out.loss))[m * T + t];
            worst_l = fmax(worst_l, fabs(got_l - loss) / fmax(1e-3, fabs(loss)));
            for (int i = 0; i < 4; i++) {
                double y = 0;
                for (int j = 0; j < 4; j++) y += W[i * 4 + j] * k[t * d + j];
                double got = ((const float *)mn_tensor_data(&out.y))[(m * T + t) * d + i];
                /* y is O(1): an entry near 0 is held to an absolute 1e-7, not to a relative 1e-5 of itself */
                worst_y = fmax(worst_y, fabs(got - y) / fmax(1e-2, fabs(y)));
            }
        }
        const float *wf = (const float *)mn_tensor_data(&st.params[0]) + m * 16;
        for (int i = 0; i < 16; i++) worst_w = fmax(worst_w, fabs(wf[i] - W[i]) / fmax(1e-3, fabs(W[i])));
    }
    CHECK_NEAR("closed form: final W", worst_w, 0, 1e-5);
    CHECK_NEAR("closed form: y after", worst_y, 0, 1e-5);
    CHECK_NEAR("closed form: loss", worst_l, 0, 1e-5);
    mn_segment_outputs_free(&out);
    mn_memory_free(&st);
    case_free(&c);
}

/* Feeding a sequence in pieces that are multiples of the step equals one run. */
static void test_piecewise(int layers, int step, int refresh, const char *name)
{
    run_case c;
    case_make(&c, layers, 24, step, 11);
    c.rule.refresh = refresh;
    mn_memory_state whole, parts;
    mn_segment_outputs out_whole, out_a, out_b;
    CHECK(name, case_run(&c, &whole, &out_whole) == MN_OK);
    mn_memory_create(&parts, &c.rule, &c.dims, c.init, NULL, MN_CPU);
    int64_t split = 2 * step * (refresh > step ? refresh / step : 1);
    if (split >= 24) split = step;
    mn_tensor ka = {0}, kb = {0}, va = {0}, vb = {0};
    mn_view_slice(&ka, &c.k, 2, 0, split, 1);
    mn_view_slice(&kb, &c.k, 2, split, 24, 1);
    mn_view_slice(&va, &c.v, 2, 0, split, 1);
    mn_view_slice(&vb, &c.v, 2, split, 24, 1);
    mn_segment_inputs a = {ka, va, {0}, c.theta, c.eta, c.alpha, true, {0}};
    mn_segment_inputs b = {kb, vb, {0}, c.theta, c.eta, c.alpha, true, {0}};
    bool ok = mn_segment_run(&parts, &a, &out_a) == MN_OK && mn_segment_run(&parts, &b, &out_b) == MN_OK;
    char label[128];
    snprintf(label, sizeof label, "%s: pieces run", name);
    CHECK(label, ok);
    double worst = 0;
    for (int i = 0; i < whole.nparams; i++) worst = fmax(worst, rel_err(&parts.params[i], &whole.params[i]));
    for (int i = 0; i < whole.nparams; i++) worst = fmax(worst, rel_err(&parts.momenta[i], &whole.momenta[i]));
    mn_tensor y_cat = {0};
    const mn_tensor *ys[2] = {&out_a.y, &out_b.y};
    mn_tensor_cat(&y_cat, ys, 2, 2);
    worst = fmax(worst, rel_err(&y_cat, &out_whole.y));
    snprintf(label, sizeof label, "%s: equals one run", name);
    CHECK_NEAR(label, worst, 0, 1e-6);
    mn_tensor_release(&y_cat);
    mn_tensor_release(&ka);
    mn_tensor_release(&kb);
    mn_tensor_release(&va);
    mn_tensor_release(&vb);
    mn_segment_outputs_free(&out_whole);
    mn_segment_outputs_free(&out_a);
    mn_segment_outputs_free(&out_b);
    mn_memory_free(&whole);
    mn_memory_free(&parts);
    case_free(&c);
}

/* NaN in one token of one memory skips exactly that step of that memory. */
static void test_nan_skips(void)
{
    run_case c;
    case_make(&c, 2, 16, 4, 5);
    float *k = mn_tensor_data(&c.k);
    /* memory 1 (b=0, h=1), token 9 -> step 2 */
    k[(1 * 16 + 9) * 4 + 2] = NAN;
    mn_memory_state st, ref;
    mn_segment_outputs out, out_ref;
    CHECK("nan: run", case_run(&c, &st, &out) == MN_OK);
    const float *sk = mn_tensor_data(&out.skipped), *cs = mn_tensor_data(&out.clip_scale);
    int wrong = 0;
    for (int m = 0; m < 4; m++)
        for (int s = 0; s < 4; s++) {
            bool expect = m == 1 && s == 2;
            if ((sk[m * 4 + s] != 0) != expect) wrong++;
            if (expect && cs[m * 4 + s] != 0) wrong++;
        }
    CHECK("nan: exactly the affected step is skipped", wrong == 0);
    /* Weights over the skipped step are unchanged: run steps 0-1 and 0-2 of
     * the same memory without the NaN-token step and compare. */
    mn_memory_create(&ref, &c.rule, &c.dims, c.init, NULL, MN_CPU);
    mn_tensor k8 = {0}, v8 = {0};
    mn_view_slice(&k8, &c.k, 2, 0, 8, 1);
    mn_view_slice(&v8, &c.v, 2, 0, 8, 1);
    mn_segment_inputs in8 = {k8, v8, {0}, c.theta, c.eta, c.alpha, false, {0}};
    mn_segment_run(&ref, &in8, &out_ref);
    const float *wn = mn_tensor_data(&out.weight_norm), *wn_ref = mn_tensor_data(&out_ref.weight_norm);
    CHECK_NEAR("nan: weights unchanged over the skipped step", wn[1 * 4 + 2], wn_ref[1 * 2 + 1], 1e-6);
    const float *loss = mn_tensor_data(&out.loss);
    CHECK("nan: loss is NaN at the NaN token only", isnan(loss[1 * 16 + 9]) && !isnan(loss[1 * 16 + 8]));
    mn_tensor_release(&k8);
    mn_tensor_release(&v8);
    mn_segment_outputs_free(&out);
    mn_segment_outputs_free(&out_ref);
    mn_memory_free(&st);
    mn_memory_free(&ref);
    case_free(&c);
}

/* Each accepted gate shape gives the same run as its full materialisation. */
static void test_gate_shapes(void)
{
    int64_t T = 12, S = 3;
    struct { const char *name; int ndim; int64_t shape[3]; bool per_step; } shapes[] = {
        {"theta [T]", 1, {T}, false},     {"theta [H,T]", 2, {2, T}, false}, {"theta [H,1]", 2, {2, 1}, false},
        {"theta [B,H,T]", 3, {2, 2, T}, false}, {"theta [B,1,1]", 3, {2, 1, 1}, false},
        {"eta [S]", 1, {S}, true},        {"eta [H,S]", 2, {2, S}, true},   {"eta [B,H,S]", 3, {2, 2, S}, true},
        {"eta [H,1]", 2, {2, 1}, true}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        run_case c;
        case_make(&c, 2, T, 4, 21 + i);
        mn_rng rng;
        mn_rng_seed(&rng, 99 + i);
        mn_tensor g = {0}, full = {0}, view = {0};
        mn_tensor_rand(&g, MN_F32, shapes[i].ndim, shapes[i].shape, 0.05, 0.5, &rng);
        int64_t fshape[3] = {2, 2, shapes[i].per_step ? S : T};
        mn_view_expand(&view, &g, 3, fshape);
        mn_tensor_contiguous(&full, &view);
        mn_tensor *slot = shapes[i].per_step ? &c.eta : &c.theta;
        mn_tensor_release(slot);
        *slot = g;
        mn_memory_state st1, st2;
        mn_segment_outputs o1, o2;
        bool ok = case_run(&c, &st1, &o1) == MN_OK;
        mn_tensor_release(slot);
        *slot = full;
        ok = ok && case_run(&c, &st2, &o2) == MN_OK;
        CHECK(shapes[i].name, ok && rel_err(&o1.y, &o2.y) == 0 && rel_err(&st1.params[0], &st2.params[0]) == 0);
        mn_tensor_release(&view);
        if (ok) {
            mn_segment_outputs_free(&o1);
            mn_segment_outputs_free(&o2);
            mn_memory_free(&st1);
            mn_memory_free(&st2);
        }
        case_free(&c);
    }
    /* a shape that does not broadcast is an error naming the gate */
    run_case c;
    case_make(&c, 1, T, 4, 3);
    mn_tensor_release(&c.eta);
    int64_t bad[1] = {T};
    mn_tensor_full(&c.eta, MN_F32, 1, bad, 0.5, MN_CPU);
    mn_memory_state st;
    mn_segment_outputs o;
    CHECK("gate error: eta given per token", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("gate error names eta", mn_last_error(), "gate eta of shape 12");
    case_free(&c);
}

/* A built-in part and the same part written as a custom expression give the same run. */
static void compare_with_custom(const char *name, run_case *builtin, run_case *custom)
{
    mn_memory_state a, b;
    mn_segment_outputs oa, ob;
    bool ok = case_run(builtin, &a, &oa) == MN_OK && case_run(custom, &b, &ob) == MN_OK;
    double worst = ok ? fmax(rel_err(&oa.y, &ob.y), rel_err(&a.params[0], &b.params[0])) : INFINITY;
    if (ok) worst = fmax(worst, rel_err(&oa.clip_scale, &ob.clip_scale));
    CHECK_NEAR(name, worst, 0, 2e-6);
    if (ok) {
        mn_segment_outputs_free(&oa);
        mn_segment_outputs_free(&ob);
        mn_memory_free(&a);
        mn_memory_free(&b);
    }
}

static void test_builtin_equals_custom(void)
{
    for (int l = 0; l < MN_LOSS_COUNT; l++) {
        if (mn_loss_set.parts[l].flags & MN_PART_CUSTOM) continue;
        run_case a, b;
        case_make(&a, 2, 16, 4, 31);
        case_make(&b, 2, 16, 4, 31);
        a.rule.loss = (mn_loss)l;
        a.rule.loss_delta = 0.05;
        b.rule.loss = MN_LOSS_CUSTOM;
        b.rule.loss_delta = 0.05;
        b.rule.loss_expr = mn_rule_loss_expr(&a.rule);
        char name[64];
        snprintf(name, sizeof name, "loss %s equals its expression form", mn_loss_name((mn_loss)l));
        compare_with_custom(name, &a, &b);
        case_free(&a);
        case_free(&b);
    }
    for (int act = 0; act < MN_ACT_COUNT; act++) {
        if (mn_activation_set.parts[act].flags & MN_PART_CUSTOM) continue;
        run_case a, b;
        case_make(&a, 2, 16, 4, 41);
        case_make(&b, 2, 16, 4, 41);
        a.rule.activation = (mn_activation)act;
        b.rule.activation = MN_ACT_CUSTOM;
        b.rule.activation_expr = mn_rule_activation_expr(&a.rule);
        char name[64];
        snprintf(name, sizeof name, "activation %s equals its expression form", mn_activation_name((mn_activation)act));
        compare_with_custom(name, &a, &b);
        case_free(&a);
        case_free(&b);
    }
    /* every built-in clip of the table as the custom clip of its kind */
    for (int scope = 0; scope < 2; scope++)
        for (int i = 0; i < MN_CLIP_COUNT; i++) {
            unsigned flags = mn_clip_set.parts[i].flags;
            if ((flags & MN_PART_CUSTOM) || !(flags & (MN_PART_SCALE | MN_PART_ELEM))) continue;
            run_case a, b;
            case_make(&a, 2, 16, 4, 51);
            case_make(&b, 2, 16, 4, 51);
            a.rule.clip = (mn_clip)i;
            a.rule.clip_max = 0.01;
            a.rule.clip_scope = (mn_clip_scope)scope;
            b.rule.clip = (flags & MN_PART_ELEM) ? MN_CLIP_ELEMENTWISE : MN_CLIP_SCALE;
            b.rule.clip_scope = (mn_clip_scope)scope;
            b.rule.clip_expr = mn_rule_clip_expr(&a.rule);
            char name[80];
            snprintf(name, sizeof name, "clip %s (scope %s) equals its expression form", mn_clip_name((mn_clip)i),
                     scope ? "tensor" : "global");
            compare_with_custom(name, &a, &b);
            case_free(&a);
            case_free(&b);
        }
}

/* Derivatives of every loss and activation (and custom ones) against
 * central differences in float64. */
static void test_derivatives(void)
{
    static const char *const lv[] = {"y", "v", "r"};
    static const char *const zv[] = {"z"};
    const char *custom_losses[] = {"abs(r)^1.5 + 0.1 * y * v", "log(1 + r^2)", "softplus(r) - sigmoid(y) * v"};
    for (int l = 0; l <= MN_LOSS_CUSTOM + 2; l++) {
        mn_rule r;
        mn_rule_init(&r);
        r.loss_delta = 0.9; /* no probe point sits on the kink |r| = delta */
        r.loss_p = 1.7;
        char name[96];
        if (l < MN_LOSS_CUSTOM) {
            r.loss = (mn_loss)l;
            snprintf(name, sizeof name, "d loss %s / dy vs finite differences", mn_loss_name(r.loss));
        } else {
            r.loss = MN_LOSS_CUSTOM;
            mn_expr_parse(custom_losses[l - MN_LOSS_CUSTOM], &r.loss_expr);
            snprintf(name, sizeof name, "d (%s) / dy vs finite differences", custom_losses[l - MN_LOSS_CUSTOM]);
        }
        mn_expr *f = mn_rule_loss_expr(&r), *df = mn_rule_loss_grad_expr(&r);
        double worst = 0;
        double pts[][2] = {{0.3, -0.4}, {1.9, 0.2}, {-1.3, 0.5}, {0.05, 2.0}};
        for (int p = 0; p < 4; p++) {
            double y = pts[p][0], v = pts[p][1], h = 1e-6;
            double a[3] = {y + h, v, y + h - v}, b[3] = {y - h, v, y - h - v}, c[3] = {y, v, y - v};
            double fd = (mn_expr_eval(f, lv, a, 3, NULL, NULL, 0) - mn_expr_eval(f, lv, b, 3, NULL, NULL, 0)) / (2 * h);
            double an = mn_expr_eval(df, lv, c, 3, NULL, NULL, 0);
            worst = fmax(worst, fabs(fd - an) / fmax(1, fabs(an)));
        }
        CHECK_NEAR(name, worst, 0, 1e-7);
        mn_expr_unref(f);
        mn_expr_unref(df);
        mn_rule_free(&r);
    }
    const char *custom_acts[] = {"z * tanh(softplus(z))", "where(z > 0, z, 0.1 * z)"};
    for (int a = 0; a <= MN_ACT_CUSTOM + 1; a++) {
        mn_rule r;
        mn_rule_init(&r);
        char name[96];
        if (a < MN_ACT_CUSTOM) {
            r.activation = (mn_activation)a;
            snprintf(name, sizeof name, "d act %s / dz vs finite differences", mn_activation_name(r.activation));
        } else {
            r.activation = MN_ACT_CUSTOM;
            mn_expr_parse(custom_acts[a - MN_ACT_CUSTOM], &r.activation_expr);
            snprintf(name, sizeof name, "d (%s) / dz vs finite differences", custom_acts[a - MN_ACT_CUSTOM]);
        }
        mn_expr *f = mn_rule_activation_expr(&r), *df = mn_rule_activation_grad_expr(&r);
        double worst = 0, pts[] = {-2.1, -0.3, 0.4, 1.7};
        for (int p = 0; p < 4; p++) {
            double h = 1e-6, zp = pts[p] + h, zm = pts[p] - h;
            double fd = (mn_expr_eval(f, zv, &zp, 1, NULL, NULL, 0) - mn_expr_eval(f, zv, &zm, 1, NULL, NULL, 0)) / (2 * h);
            double an = mn_expr_eval(df, zv, &pts[p], 1, NULL, NULL, 0);
            worst = fmax(worst, fabs(fd - an) / fmax(1, fabs(an)));
        }
        CHECK_NEAR(name, worst, 0, 1e-7);
        mn_expr_unref(f);
        mn_expr_unref(df);
        mn_rule_free(&r);
    }
}

/* The gradient of the whole memory model (the engine's backward) against
 * central differences of the step loss, in the engine's float32. */
static void test_backward_fd(int layers, mn_activation act, const char *name)
{
    run_case c;
    case_make(&c, layers, 4, 4, 61);
    c.rule.activation = act;
    mn_tensor_release(&c.eta);
    mn_tensor_release(&c.alpha);
    /* One step, theta 1, no momentum: S^(1) = -G. */
    mn_tensor_release(&c.theta);
    c.theta = scalar(1.0);
    mn_memory_state st;
    mn_segment_outputs out;
    case_run(&c, &st, &out);
    /* loss of the step at perturbed W1[0,0]..: sum of token losses */
    double worst = 0;
    for (int probe = 0; probe < 4; probe++) {
        int p = probe % mn_rule_param_count(&c.rule);
        int64_t e = probe;
        double h = 1e-2, f[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            mn_tensor w = {0};
            mn_tensor_clone(&w, &c.init[p]);
            ((float *)mn_tensor_data(&w))[e] += (float)(sgn ? -h : h);
            mn_tensor saved = c.init[p];
            c.init[p] = w;
            mn_memory_state s2;
            mn_segment_outputs o2;
            case_run(&c, &s2, &o2);
            double sum = 0;
            for (int t = 0; t < 4; t++) sum += ((float *)mn_tensor_data(&o2.loss))[t];
            f[sgn] = sum;
            mn_segment_outputs_free(&o2);
            mn_memory_free(&s2);
            mn_tensor_release(&c.init[p]);
            c.init[p] = saved;
        }
        double fd = (f[0] - f[1]) / (2 * h);
        double g = -((float *)mn_tensor_data(&st.momenta[p]))[e];
        worst = fmax(worst, fabs(fd - g) / fmax(0.1, fabs(g)));
    }
    CHECK_NEAR(name, worst, 0, 2e-2);
    mn_segment_outputs_free(&out);
    mn_memory_free(&st);
    case_free(&c);
}

static void test_errors(void)
{
    run_case c;
    case_make(&c, 1, 8, 4, 3);
    c.rule.refresh = 6;
    mn_memory_state st;
    mn_segment_outputs o;
    CHECK("error: refresh not a multiple of step", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: refresh", mn_last_error(), "refresh 6 is not 0 or a multiple of step 4");
    c.rule.refresh = -1;
    c.rule.residual = true;
    c.dims.dv = 3;
    CHECK("error: residual with dk != dv", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: residual", mn_last_error(), "residual needs dk = dv");
    c.rule.residual = false;
    c.dims.dv = 4;
    mn_rng rng;
    mn_rng_seed(&rng, 1);
    mn_tensor_release(&c.v);
    c.v = randn4(2, 2, 8, 3, 1.0, &rng);
    CHECK("error: v does not fit dv", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: v shape", mn_last_error(), "v has shape 2x2x8x3");
    mn_tensor_release(&c.init[0]);
    CHECK("error: missing W1", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: W1", mn_last_error(), "initial weight W1 is missing");
    int64_t wrong[2] = {3, 4};
    mn_tensor_zeros(&c.init[0], MN_F32, 2, wrong, MN_CPU);
    CHECK("error: W1 of the wrong shape", case_run(&c, &st, &o) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: W1 shape", mn_last_error(), "initial W1 has shape 3x4");
    mn_loss l;
    CHECK("error: unknown loss", mn_loss_lookup("hubr", &l) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: loss names", mn_last_error(), "unknown loss 'hubr' (one of: mse, l1, huber");
    mn_rule r;
    mn_rule_init(&r);
    r.loss = MN_LOSS_CUSTOM;
    mn_expr_parse("abs(q - v)", &r.loss_expr);
    CHECK("error: unknown name in a loss", mn_rule_validate(&r) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("error text: unknown name", mn_last_error(), "'q'");
    mn_rule_free(&r);
    case_free(&c);
}


/* mn_memory_create's one block (model/engine.c, state_block): every tensor
 * its own 64-float-aligned, non-overlapping part; W the initial weights
 * broadcast, biases not given and momenta not given zero, every gap zero
 * (the block is made where junk was, so unset memory would show), given
 * momenta kept; the anchor W's values in its own memory where refresh !=
 * step (a write to W reaches neither it nor the momenta), and W itself (the
 * same view, no region of its own) where refresh = step. */
static void test_state_layout(int refresh_steps)
{
    char label[160];
    run_case c;
    case_make(&c, 2, 8, 4, 11);
    c.rule.refresh = refresh_steps * c.rule.step;
    const bool own_anchor = refresh_steps != 1;
    mn_tensor_release(&c.init[1]); /* b1 not given: zeros */
    mn_tensor mom[MN_MAX_PARAMS] = {{0}};
    mn_rng rng;
    mn_rng_seed(&rng, 5);
    int64_t wshape[2] = {6, 4};
    mn_tensor_randn(&mom[0], MN_F32, 2, wshape, 0, 1.0, &rng); /* S_W1 given as [dh, dk] */
    /* junk where the block will be (a small block: malloc reuses the chunk) */
    size_t junk_bytes = 3 * 4 * (128 + 64 + 64 + 64) * sizeof(float);
    unsigned char *junk = malloc(junk_bytes);
    if (junk) memset(junk, 0x7f, junk_bytes);
    free(junk);
    mn_memory_state st;
    bool made = mn_memory_create(&st, &c.rule, &c.dims, c.init, mom, MN_CPU) == MN_OK;
    snprintf(label, sizeof label, "state (refresh = %d steps): created", refresh_steps);
    CHECK(label, made);
    if (!made) {
        mn_tensor_release(&mom[0]);
        case_free(&c);
        return;
    }
    bool aligned = true, one_block = true, disjoint = true, anchor_is_w = true, zeros = true, given = true;
    bool anchor_view = true;
    const mn_tensor *all[3 * MN_MAX_PARAMS] = {0};
    int n = 0;
    for (int p = 0; p < st.nparams; p++) {
        all[n++] = &st.params[p];
        all[n++] = &st.momenta[p];
        if (own_anchor) all[n++] = &st.anchor[p];
        else anchor_view = anchor_view && st.anchor[p].storage == st.params[p].storage &&
                           st.anchor[p].offset == st.params[p].offset &&
                           mn_tensor_numel(&st.anchor[p]) == mn_tensor_numel(&st.params[p]);
    }
    int64_t covered = 0, gaps_nonzero = 0;
    for (int i = 0; i < n; i++) {
        aligned = aligned && all[i]->offset % 64 == 0 && mn_tensor_is_contiguous(all[i]);
        one_block = one_block && all[i]->storage == all[0]->storage;
        covered += mn_tensor_numel(all[i]);
        for (int j = 0; j < i; j++) {
            const int64_t a0 = all[i]->offset, a1 = a0 + mn_tensor_numel(all[i]);
            const int64_t b0 = all[j]->offset, b1 = b0 + mn_tensor_numel(all[j]);
            disjoint = disjoint && (a1 <= b0 || b1 <= a0);
        }
    }
    /* every float of the block that no tensor covers */
    const int64_t block_floats = (int64_t)(all[0]->storage->nbytes / sizeof(float));
    const float *base = (const float *)all[0]->storage->data;
    for (int64_t e = 0; e < block_floats; e++) {
        bool inside = false;
        for (int i = 0; i < n && !inside; i++)
            inside = e >= all[i]->offset && e < all[i]->offset + mn_tensor_numel(all[i]);
        if (!inside && base[e] != 0.0f) gaps_nonzero++;
    }
    for (int p = 0; p < st.nparams; p++) {
        const float *w = mn_tensor_data(&st.params[p]), *a = mn_tensor_data(&st.anchor[p]);
        const float *m = mn_tensor_data(&st.momenta[p]);
        const int64_t ne = mn_tensor_numel(&st.params[p]), per = ne / 4; /* B x H = 4 memories: S_W1's period */
        const float *init = c.init[p].storage ? mn_tensor_data(&c.init[p]) : NULL;
        const int64_t init_ne = init ? mn_tensor_numel(&c.init[p]) : 1; /* [B,H,...] or one memory's */
        for (int64_t e = 0; e < ne; e++) {
            anchor_is_w = anchor_is_w && a[e] == w[e] && (init ? w[e] == init[e % init_ne] : w[e] == 0.0f);
            if (p == 0) given = given && m[e] == ((const float *)mn_tensor_data(&mom[0]))[e % per];
            else zeros = zeros && m[e] == 0.0f;
        }
    }
#define CHECK_STATE(what, cond)                                                                                        \
    do {                                                                                                               \
        snprintf(label, sizeof label, "state (refresh = %d steps): %s", refresh_steps, what);                          \
        CHECK(label, cond);                                                                                            \
    } while (0)
    CHECK_STATE("one block", one_block);
    CHECK_STATE("every tensor contiguous at a multiple of 64 floats", aligned);
    CHECK_STATE("no two tensors overlap", disjoint);
    CHECK_STATE("W the initial weights broadcast (b1 not given: 0), the anchor equal", anchor_is_w);
    CHECK_STATE("momenta not given are 0", zeros);
    CHECK_STATE("S_W1 given [dh, dk] is broadcast over B x H", given);
    CHECK_STATE("the gaps between tensors are 0", gaps_nonzero == 0 && block_floats > covered);
    const float before = ((const float *)mn_tensor_data(&st.params[0]))[0];
    ((float *)mn_tensor_data(&st.params[0]))[0] = before + 1.0f;
    const float anchor_now = ((const float *)mn_tensor_data(&st.anchor[0]))[0];
    int64_t span = 0; /* one set's floats: each parameter at a multiple of 64 */
    for (int p = 0; p < st.nparams; p++) span += (mn_tensor_numel(&st.params[p]) + 63) / 64 * 64;
    CHECK_STATE("the block is W's, the momenta's and (refresh != step) the anchors' sets",
                block_floats == (own_anchor ? 3 : 2) * span);
    if (own_anchor) {
        CHECK_STATE("a write to W leaves the anchor", anchor_now == before);
    } else {
        CHECK_STATE("the anchor is W's view (a write to W is the anchor's)", anchor_view && anchor_now == before + 1.0f);
    }
#undef CHECK_STATE
    mn_memory_free(&st);
    mn_tensor_release(&mom[0]);
    case_free(&c);
}

int main(void)
{
    test_closed_form();
    test_piecewise(1, 1, -1, "piecewise linear c=1");
    test_piecewise(2, 4, -1, "piecewise MLP c=4");
    test_piecewise(2, 2, 4, "piecewise MLP c=2 r=4");
    test_piecewise(2, 3, 0, "piecewise MLP c=3 r=0");
    test_nan_skips();
    test_gate_shapes();
    test_builtin_equals_custom();
    test_derivatives();
    test_backward_fd(1, MN_ACT_SILU, "backward linear vs finite differences");
    test_backward_fd(2, MN_ACT_SILU, "backward MLP silu vs finite differences");
    test_backward_fd(2, MN_ACT_TANH, "backward MLP tanh vs finite differences");
    test_backward_fd(3, MN_ACT_GELU, "backward 3-layer gelu vs finite differences");
    test_state_layout(1);
    test_state_layout(2);
    test_errors();
    return CHECK_DONE();
}
