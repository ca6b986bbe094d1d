/* rule.c: rule defaults, names, validation, parameter layout, and the
 * expression form of every part (SPEC.md sections 1, 2 and 4). */
#include "rule.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const activation_names[MN_ACT_COUNT] = {"silu", "gelu", "relu", "tanh", "identity", "custom"};
static const char *const loss_names[MN_LOSS_COUNT] = {"mse", "l1", "huber", "lp", "dot", "custom"};
static const char *const clip_names[MN_CLIP_COUNT] = {"none", "norm", "softnorm", "value", "scale", "elementwise"};

void mn_rule_init(mn_rule *r)
{
    memset(r, 0, sizeof *r);
    r->layers = 1;
    r->hidden = 0;
    r->activation = MN_ACT_SILU;
    r->bias = false; /* SPEC: default on for L >= 2; callers that set layers decide (see mn_rule_default_bias) */
    r->loss = MN_LOSS_MSE;
    r->loss_delta = 1.0;
    r->loss_p = 1.5;
    r->feature_reduce = MN_REDUCE_MEAN;
    r->token_reduce = MN_REDUCE_SUM;
    r->step = 1;
    r->refresh = -1;
    r->retrieve = MN_RETRIEVE_AFTER;
    r->clip = MN_CLIP_NONE;
    r->clip_max = 1.0;
    r->clip_scope = MN_SCOPE_GLOBAL;
}

void mn_rule_free(mn_rule *r)
{
    mn_expr_unref(r->activation_expr);
    mn_expr_unref(r->loss_expr);
    mn_expr_unref(r->clip_expr);
    for (int i = 0; i < r->nconsts; i++) free(r->const_names[i]);
    memset(r, 0, sizeof *r);
}

mn_status mn_rule_copy(mn_rule *dst, const mn_rule *src)
{
    *dst = *src;
    dst->activation_expr = mn_expr_ref(src->activation_expr);
    dst->loss_expr = mn_expr_ref(src->loss_expr);
    dst->clip_expr = mn_expr_ref(src->clip_expr);
    for (int i = 0; i < src->nconsts; i++) {
        dst->const_names[i] = mn_strdup(src->const_names[i]);
        if (!dst->const_names[i]) {
            dst->nconsts = i;
            mn_rule_free(dst);
            return MN_ERR_OOM;
        }
    }
    return MN_OK;
}

mn_status mn_rule_set_const(mn_rule *r, const char *name, double value)
{
    for (int i = 0; i < r->nconsts; i++)
        if (strcmp(r->const_names[i], name) == 0) {
            r->const_values[i] = value;
            return MN_OK;
        }
    if (r->nconsts == MN_MAX_CONSTS)
        return mn_fail(MN_ERR_ARG, "constant '%s': a rule holds at most %d constants", name, MN_MAX_CONSTS);
    static const char *const reserved[] = {"y", "v", "r", "z", "g", "n"};
    for (size_t i = 0; i < sizeof reserved / sizeof *reserved; i++)
        if (strcmp(name, reserved[i]) == 0)
            return mn_fail(MN_ERR_ARG, "constant '%s': the name is taken by an expression variable", name);
    if (mn_expr_func_lookup(name) >= 0)
        return mn_fail(MN_ERR_ARG, "constant '%s': the name is taken by a function", name);
    char *copy = mn_strdup(name);
    if (!copy) return MN_ERR_OOM;
    r->const_names[r->nconsts] = copy;
    r->const_values[r->nconsts++] = value;
    return MN_OK;
}

const char *mn_activation_name(mn_activation a) { return (unsigned)a < MN_ACT_COUNT ? activation_names[a] : "?"; }
const char *mn_loss_name(mn_loss l) { return (unsigned)l < MN_LOSS_COUNT ? loss_names[l] : "?"; }
const char *mn_clip_name(mn_clip c) { return (unsigned)c < MN_CLIP_COUNT ? clip_names[c] : "?"; }

/* Look name up in names[0..n); on failure list them all in the message. */
static mn_status lookup_name(const char *what, const char *name, const char *const *names, int n, int *out)
{
    for (int i = 0; i < n; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = i;
            return MN_OK;
        }
    char list[256] = "";
    for (int i = 0; i < n; i++) {
        strncat(list, names[i], sizeof list - strlen(list) - 1);
        if (i + 1 < n) strncat(list, ", ", sizeof list - strlen(list) - 1);
    }
    return mn_fail(MN_ERR_ARG, "unknown %s '%s' (one of: %s)", what, name, list);
}

mn_status mn_activation_lookup(const char *name, mn_activation *out)
{
    int i;
    MN_TRY(lookup_name("activation", name, activation_names, MN_ACT_COUNT, &i));
    *out = (mn_activation)i;
    return MN_OK;
}

mn_status mn_loss_lookup(const char *name, mn_loss *out)
{
    int i;
    MN_TRY(lookup_name("loss", name, loss_names, MN_LOSS_COUNT, &i));
    *out = (mn_loss)i;
    return MN_OK;
}

mn_status mn_clip_lookup(const char *name, mn_clip *out)
{
    int i;
    MN_TRY(lookup_name("clip", name, clip_names, MN_CLIP_COUNT, &i));
    *out = (mn_clip)i;
    return MN_OK;
}

mn_status mn_clip_scope_lookup(const char *name, mn_clip_scope *out)
{
    static const char *const names[] = {"global", "tensor"};
    int i;
    MN_TRY(lookup_name("clip_scope", name, names, 2, &i));
    *out = (mn_clip_scope)i;
    return MN_OK;
}

mn_status mn_reduce_lookup(const char *what, const char *name, mn_reduce *out)
{
    static const char *const names[] = {"mean", "sum"};
    int i;
    MN_TRY(lookup_name(what, name, names, 2, &i));
    *out = (mn_reduce)i;
    return MN_OK;
}

mn_status mn_retrieve_lookup(const char *name, mn_retrieve *out)
{
    static const char *const names[] = {"after", "before"};
    int i;
    MN_TRY(lookup_name("retrieve", name, names, 2, &i));
    *out = (mn_retrieve)i;
    return MN_OK;
}

int mn_rule_refresh(const mn_rule *r) { return r->refresh < 0 ? r->step : r->refresh; }

/* Names each custom expression may use, besides the rule's constants. */
static const char *const loss_vars[] = {"y", "v", "r"};
static const char *const act_vars[] = {"z"};
static const char *const scale_vars[] = {"n"};
static const char *const elem_vars[] = {"g"};

static mn_status check_expr(const mn_rule *r, const char *part, const mn_expr *e,
                            const char *const *vars, int nvars)
{
    if (!e) return mn_fail(MN_ERR_ARG, "%s: the rule is custom but has no expression", part);
    if (mn_expr_check_names(e, vars, nvars, (const char *const *)r->const_names, r->nconsts) != MN_OK)
        return mn_fail_context(MN_ERR_ARG, "%s: ", part);
    return MN_OK;
}

mn_status mn_rule_validate(const mn_rule *r)
{
    if (r->layers < 1 || r->layers > MN_MAX_LAYERS)
        return mn_fail(MN_ERR_ARG, "layers must be between 1 and %d, got %d", MN_MAX_LAYERS, r->layers);
    if (r->hidden < 0) return mn_fail(MN_ERR_ARG, "hidden must be positive, got %d", r->hidden);
    if (r->step < 1) return mn_fail(MN_ERR_ARG, "step must be >= 1, got %d", r->step);
    int refresh = mn_rule_refresh(r);
    if (refresh < 0 || (refresh > 0 && refresh % r->step != 0))
        return mn_fail(MN_ERR_ARG, "refresh %d is not 0 or a multiple of step %d", refresh, r->step);
    if (r->loss == MN_LOSS_HUBER && !(r->loss_delta > 0))
        return mn_fail(MN_ERR_ARG, "loss_delta must be > 0 for huber, got %g", r->loss_delta);
    if (r->loss == MN_LOSS_LP && !(r->loss_p > 1))
        return mn_fail(MN_ERR_ARG, "loss_p must be > 1 for lp, got %g", r->loss_p);
    if ((r->clip == MN_CLIP_NORM || r->clip == MN_CLIP_SOFTNORM || r->clip == MN_CLIP_VALUE) &&
        !(r->clip_max > 0))
        return mn_fail(MN_ERR_ARG, "clip_max must be > 0 for clip %s, got %g", mn_clip_name(r->clip), r->clip_max);
    if (r->activation == MN_ACT_CUSTOM) MN_TRY(check_expr(r, "activation_expr", r->activation_expr, act_vars, 1));
    if (r->loss == MN_LOSS_CUSTOM) MN_TRY(check_expr(r, "loss_expr", r->loss_expr, loss_vars, 3));
    if (r->clip == MN_CLIP_SCALE) MN_TRY(check_expr(r, "clip_expr", r->clip_expr, scale_vars, 1));
    if (r->clip == MN_CLIP_ELEMENTWISE) MN_TRY(check_expr(r, "clip_expr", r->clip_expr, elem_vars, 1));
    return MN_OK;
}

int mn_rule_param_count(const mn_rule *r) { return r->layers * (r->bias ? 2 : 1); }

void mn_rule_param_role(const mn_rule *r, int i, int *layer, bool *is_bias)
{
    int per = r->bias ? 2 : 1;
    *layer = i / per;
    *is_bias = r->bias && (i % 2 == 1);
}

const char *mn_rule_param_name(const mn_rule *r, int i, char *buf, size_t len)
{
    int layer;
    bool is_bias;
    mn_rule_param_role(r, i, &layer, &is_bias);
    snprintf(buf, len, "%c%d", is_bias ? 'b' : 'W', layer + 1);
    return buf;
}

int mn_rule_param_shape(const mn_rule *r, const mn_dims *d, int i, int64_t *shape)
{
    int layer;
    bool is_bias;
    mn_rule_param_role(r, i, &layer, &is_bias);
    int64_t in = layer == 0 ? d->dk : d->dh;
    int64_t out = layer == r->layers - 1 ? d->dv : d->dh;
    if (is_bias) {
        shape[0] = out;
        return 1;
    }
    shape[0] = out;
    shape[1] = in;
    return 2;
}

/* ---- expression forms ---- */

static mn_expr *var(const char *name) { return mn_expr_var(name); }
static mn_expr *num(double x) { return mn_expr_num(x); }
static mn_expr *bin(mn_expr_kind k, mn_expr *a, mn_expr *b) { return mn_expr_binary(k, a, b); }
static mn_expr *call1(mn_expr_func f, mn_expr *a)
{
    mn_expr *args[1] = {a};
    return mn_expr_call(f, 1, args);
}
static mn_expr *call2(mn_expr_func f, mn_expr *a, mn_expr *b)
{
    mn_expr *args[2] = {a, b};
    return mn_expr_call(f, 2, args);
}
static mn_expr *call3(mn_expr_func f, mn_expr *a, mn_expr *b, mn_expr *c)
{
    mn_expr *args[3] = {a, b, c};
    return mn_expr_call(f, 3, args);
}

mn_expr *mn_rule_loss_expr(const mn_rule *r)
{
    double d = r->loss_delta;
    switch (r->loss) {
    case MN_LOSS_MSE: return bin(MN_EX_POW, var("r"), num(2));
    case MN_LOSS_L1: return call1(MN_FN_ABS, var("r"));
    case MN_LOSS_HUBER:
        /* where(|r| <= delta, 0.5 r^2, delta (|r| - 0.5 delta)) */
        return call3(MN_FN_WHERE, bin(MN_EX_LE, call1(MN_FN_ABS, var("r")), num(d)),
                     bin(MN_EX_MUL, num(0.5), bin(MN_EX_POW, var("r"), num(2))),
                     bin(MN_EX_MUL, num(d), bin(MN_EX_SUB, call1(MN_FN_ABS, var("r")), num(0.5 * d))));
    case MN_LOSS_LP: return bin(MN_EX_POW, call1(MN_FN_ABS, var("r")), num(r->loss_p));
    case MN_LOSS_DOT: return mn_expr_unary(MN_EX_NEG, bin(MN_EX_MUL, var("y"), var("v")));
    case MN_LOSS_CUSTOM: return mn_expr_ref(r->loss_expr);
    default: break;
    }
    mn_fail(MN_ERR_ARG, "unknown loss %d", (int)r->loss);
    return NULL;
}

/* df/dy with r = y - v: the partial in y plus the partial in r. */
mn_expr *mn_rule_loss_grad_expr(const mn_rule *r)
{
    mn_expr *f = mn_rule_loss_expr(r);
    if (!f) return NULL;
    mn_expr *dy = mn_expr_diff(f, "y");
    mn_expr *dr = mn_expr_diff(f, "r");
    mn_expr_unref(f);
    mn_expr *sum = bin(MN_EX_ADD, dy, dr);
    if (!sum) return NULL;
    mn_expr *simple = mn_expr_simplify(sum);
    mn_expr_unref(sum);
    return simple;
}

mn_expr *mn_rule_activation_expr(const mn_rule *r)
{
    switch (r->activation) {
    case MN_ACT_SILU: return call1(MN_FN_SILU, var("z"));
    case MN_ACT_GELU: return call1(MN_FN_GELU, var("z"));
    case MN_ACT_RELU: return call1(MN_FN_RELU, var("z"));
    case MN_ACT_TANH: return call1(MN_FN_TANH, var("z"));
    case MN_ACT_IDENTITY: return var("z");
    case MN_ACT_CUSTOM: return mn_expr_ref(r->activation_expr);
    default: break;
    }
    mn_fail(MN_ERR_ARG, "unknown activation %d", (int)r->activation);
    return NULL;
}

mn_expr *mn_rule_activation_grad_expr(const mn_rule *r)
{
    mn_expr *f = mn_rule_activation_expr(r);
    if (!f) return NULL;
    mn_expr *d = mn_expr_diff(f, "z");
    mn_expr_unref(f);
    return d;
}

mn_expr *mn_rule_clip_expr(const mn_rule *r)
{
    double m = r->clip_max;
    switch (r->clip) {
    case MN_CLIP_NONE: return NULL;
    case MN_CLIP_NORM:
        /* min(1, m / n); n = 0 gives m/0 = inf and so scale 1 */
        return call2(MN_FN_MIN, num(1), bin(MN_EX_DIV, num(m), var("n")));
    case MN_CLIP_SOFTNORM:
        /* m tanh(n/m) / n, and 1 at n = 0 */
        return call3(MN_FN_WHERE, bin(MN_EX_GT, var("n"), num(0)),
                     bin(MN_EX_DIV, bin(MN_EX_MUL, num(m), call1(MN_FN_TANH, bin(MN_EX_DIV, var("n"), num(m)))),
                         var("n")),
                     num(1));
    case MN_CLIP_VALUE: return call2(MN_FN_MIN, call2(MN_FN_MAX, var("g"), num(-m)), num(m));
    case MN_CLIP_SCALE:
    case MN_CLIP_ELEMENTWISE: return mn_expr_ref(r->clip_expr);
    default: break;
    }
    mn_fail(MN_ERR_ARG, "unknown clip %d", (int)r->clip);
    return NULL;
}
