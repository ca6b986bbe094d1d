/* experiment.c: experiment files in, result trees out (SPEC.md section 5).
 * Every error names the file and the group, dataset or attribute at fault. */
#include "experiment.h"
#include "h5.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reading attributes ---- */

static mn_status attr_number(const mn_node *g, const char *where, const char *name, double *out, bool *found)
{
    const mn_node *n = mn_node_find(g, name);
    *found = n != NULL;
    if (!n) return MN_OK;
    if (n->kind == MN_NODE_NUMBER) *out = n->number;
    else if (n->kind == MN_NODE_INTEGER) *out = (double)n->integer;
    else if (n->kind == MN_NODE_TENSOR && mn_tensor_numel(&n->tensor) == 1 && n->tensor.storage) {
        int64_t zero[MN_MAX_DIMS] = {0};
        *out = mn_tensor_get(&n->tensor, zero);
    } else return mn_fail(MN_ERR_ARG, "%s: attribute '%s' must be a number", where, name);
    return MN_OK;
}

static mn_status attr_int(const mn_node *g, const char *where, const char *name, int *out, bool *found)
{
    double x;
    MN_TRY(attr_number(g, where, name, &x, found));
    if (!*found) return MN_OK;
    if (x != floor(x) || fabs(x) > 1e9)
        return mn_fail(MN_ERR_ARG, "%s: attribute '%s' must be an integer, got %g", where, name, x);
    *out = (int)x;
    return MN_OK;
}

static mn_status attr_string(const mn_node *g, const char *where, const char *name, const char **out)
{
    const mn_node *n = mn_node_find(g, name);
    *out = NULL;
    if (!n) return MN_OK;
    if (n->kind != MN_NODE_STRING) return mn_fail(MN_ERR_ARG, "%s: attribute '%s' must be a string", where, name);
    *out = n->string;
    return MN_OK;
}

static mn_status attr_expr(const mn_node *g, const char *where, const char *name, mn_expr **out)
{
    const char *src;
    MN_TRY(attr_string(g, where, name, &src));
    if (!src) return mn_fail(MN_ERR_ARG, "%s: attribute '%s' is missing (the part is custom)", where, name);
    if (mn_expr_parse(src, out) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: attribute '%s': ", where, name);
    return MN_OK;
}

/* Every attribute name /rule may hold. */
static const char *const rule_attrs[] = {
    "layers", "hidden", "activation", "bias", "residual", "loss", "loss_delta", "loss_p",
    "feature_reduce", "token_reduce", "step", "refresh", "retrieve", "clip", "clip_max",
    "clip_scope", "loss_expr", "activation_expr", "clip_expr", NULL};

static mn_status rule_from_tree(const mn_node *g, const char *where, mn_rule *r)
{
    bool found;
    const char *s;
    for (int i = 0; i < g->nchildren; i++) {
        const mn_node *c = g->children[i];
        if (c->kind == MN_NODE_GROUP) {
            if (strcmp(c->name, "constants") != 0)
                return mn_fail(MN_ERR_ARG, "%s: unexpected group '%s' (only 'constants')", where, c->name);
            continue;
        }
        bool known = false;
        for (int j = 0; rule_attrs[j]; j++) known = known || strcmp(c->name, rule_attrs[j]) == 0;
        if (!known) return mn_fail(MN_ERR_ARG, "%s: unknown attribute '%s'", where, c->name);
    }
    MN_TRY(attr_int(g, where, "layers", &r->layers, &found));
    MN_TRY(attr_int(g, where, "hidden", &r->hidden, &found));
    int flag = r->layers >= 2;
    MN_TRY(attr_int(g, where, "bias", &flag, &found));
    r->bias = flag != 0;
    flag = 0;
    MN_TRY(attr_int(g, where, "residual", &flag, &found));
    r->residual = flag != 0;
    MN_TRY(attr_string(g, where, "activation", &s));
    if (s && mn_activation_lookup(s, &r->activation) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_string(g, where, "loss", &s));
    if (s && mn_loss_lookup(s, &r->loss) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_number(g, where, "loss_delta", &r->loss_delta, &found));
    MN_TRY(attr_number(g, where, "loss_p", &r->loss_p, &found));
    MN_TRY(attr_string(g, where, "feature_reduce", &s));
    if (s && mn_reduce_lookup("feature_reduce", s, &r->feature_reduce) != MN_OK)
        return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_string(g, where, "token_reduce", &s));
    if (s && mn_reduce_lookup("token_reduce", s, &r->token_reduce) != MN_OK)
        return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_int(g, where, "step", &r->step, &found));
    MN_TRY(attr_int(g, where, "refresh", &r->refresh, &found));
    if (!found) r->refresh = -1;
    else if (r->refresh < 0) return mn_fail(MN_ERR_ARG, "%s: attribute 'refresh' must be >= 0, got %d", where, r->refresh);
    MN_TRY(attr_string(g, where, "retrieve", &s));
    if (s && mn_retrieve_lookup(s, &r->retrieve) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_string(g, where, "clip", &s));
    if (s && mn_clip_lookup(s, &r->clip) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    MN_TRY(attr_number(g, where, "clip_max", &r->clip_max, &found));
    MN_TRY(attr_string(g, where, "clip_scope", &s));
    if (s && mn_clip_scope_lookup(s, &r->clip_scope) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    const mn_node *consts = mn_node_find(g, "constants");
    for (int i = 0; consts && i < consts->nchildren; i++) {
        const mn_node *c = consts->children[i];
        double value;
        MN_TRY(attr_number(consts, where, c->name, &value, &found));
        MN_TRY(mn_rule_set_const(r, c->name, value));
    }
    if (r->activation == MN_ACT_CUSTOM) MN_TRY(attr_expr(g, where, "activation_expr", &r->activation_expr));
    if (r->loss == MN_LOSS_CUSTOM) MN_TRY(attr_expr(g, where, "loss_expr", &r->loss_expr));
    if (r->clip == MN_CLIP_SCALE || r->clip == MN_CLIP_ELEMENTWISE)
        MN_TRY(attr_expr(g, where, "clip_expr", &r->clip_expr));
    if (mn_rule_validate(r) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    return MN_OK;
}

mn_status mn_rule_from_tree(const mn_node *group, const char *where, mn_rule *out)
{
    mn_rule_init(out);
    mn_status s = rule_from_tree(group, where, out);
    if (s != MN_OK) mn_rule_free(out);
    return s;
}

mn_status mn_rule_to_tree(const mn_rule *r, mn_node *g)
{
    static const char *const reduce_names[] = {"mean", "sum"};
    bool ok = mn_node_add_integer(g, "layers", r->layers) && mn_node_add_integer(g, "hidden", r->hidden) &&
              mn_node_add_string(g, "activation", mn_activation_name(r->activation)) &&
              mn_node_add_integer(g, "bias", r->bias) && mn_node_add_integer(g, "residual", r->residual) &&
              mn_node_add_string(g, "loss", mn_loss_name(r->loss)) &&
              mn_node_add_number(g, "loss_delta", r->loss_delta) && mn_node_add_number(g, "loss_p", r->loss_p) &&
              mn_node_add_string(g, "feature_reduce", reduce_names[r->feature_reduce]) &&
              mn_node_add_string(g, "token_reduce", reduce_names[r->token_reduce]) &&
              mn_node_add_integer(g, "step", r->step) && mn_node_add_integer(g, "refresh", mn_rule_refresh(r)) &&
              mn_node_add_string(g, "retrieve", r->retrieve == MN_RETRIEVE_AFTER ? "after" : "before") &&
              mn_node_add_string(g, "clip", mn_clip_name(r->clip)) &&
              mn_node_add_number(g, "clip_max", r->clip_max) &&
              mn_node_add_string(g, "clip_scope", r->clip_scope == MN_SCOPE_GLOBAL ? "global" : "tensor");
    const struct { const char *name; const mn_expr *e; } exprs[] = {
        {"loss_expr", r->loss_expr}, {"activation_expr", r->activation_expr}, {"clip_expr", r->clip_expr}};
    for (size_t i = 0; ok && i < sizeof exprs / sizeof *exprs; i++) {
        if (!exprs[i].e) continue;
        char *src = mn_expr_to_string(exprs[i].e);
        ok = src && mn_node_add_string(g, exprs[i].name, src);
        free(src);
    }
    if (ok && r->nconsts) {
        mn_node *c = mn_node_add_group(g, "constants");
        ok = c != NULL;
        for (int i = 0; ok && i < r->nconsts; i++) ok = mn_node_add_number(c, r->const_names[i], r->const_values[i]) != NULL;
    }
    return ok ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory writing the rule");
}

/* Copy src's attributes and subgroups (not datasets) into dst. */
static bool copy_attr_group(mn_node *dst, const mn_node *src)
{
    for (int i = 0; i < src->nchildren; i++) {
        const mn_node *c = src->children[i];
        bool ok = true;
        if (c->kind == MN_NODE_INTEGER) ok = mn_node_add_integer(dst, c->name, c->integer) != NULL;
        else if (c->kind == MN_NODE_NUMBER) ok = mn_node_add_number(dst, c->name, c->number) != NULL;
        else if (c->kind == MN_NODE_STRING) ok = mn_node_add_string(dst, c->name, c->string) != NULL;
        else if (c->kind == MN_NODE_GROUP) {
            mn_node *g = mn_node_add_group(dst, c->name);
            ok = g && copy_attr_group(g, c);
        }
        if (!ok) return false;
    }
    return true;
}

/* ---- datasets ---- */

static mn_status take_tensor(const mn_node *root, const char *file, const char *path, bool required, mn_tensor *out)
{
    const mn_node *n = mn_node_find(root, path);
    if (!n) return required ? mn_fail(MN_ERR_ARG, "%s: dataset /%s is missing", file, path) : MN_OK;
    if (n->kind != MN_NODE_TENSOR)
        return mn_fail(MN_ERR_ARG, "%s: /%s must be a dataset", file, path);
    if (n->tensor.dtype == MN_I64)
        return mn_fail(MN_ERR_ARG, "%s: dataset /%s must hold floats, not integers", file, path);
    mn_tensor_share(out, &n->tensor);
    return MN_OK;
}

static mn_status experiment_from_tree(const mn_node *root, const char *file, mn_experiment *e)
{
    char where[600];
    const mn_node *schema = mn_node_find(root, "mnemo_schema");
    if (!schema) return mn_fail(MN_ERR_ARG, "%s: attribute /mnemo_schema is missing (not a mnemo experiment file)", file);
    if (schema->kind != MN_NODE_INTEGER || schema->integer != 1)
        return mn_fail(MN_ERR_ARG, "%s: attribute /mnemo_schema must be 1", file);
    const mn_node *rule = mn_node_find(root, "rule");
    if (!rule || rule->kind != MN_NODE_GROUP) return mn_fail(MN_ERR_ARG, "%s: group /rule is missing", file);
    snprintf(where, sizeof where, "%s: /rule", file);
    MN_TRY(rule_from_tree(rule, where, &e->rule));
    e->rule_group = mn_node_group("rule");
    if (!e->rule_group || !copy_attr_group(e->rule_group, rule))
        return mn_fail(MN_ERR_OOM, "%s: out of memory copying /rule", file);

    MN_TRY(take_tensor(root, file, "inputs/k", true, &e->k));
    MN_TRY(take_tensor(root, file, "inputs/v", true, &e->v));
    MN_TRY(take_tensor(root, file, "inputs/q", false, &e->q));
    MN_TRY(take_tensor(root, file, "gates/theta", true, &e->theta));
    MN_TRY(take_tensor(root, file, "gates/eta", false, &e->eta));
    MN_TRY(take_tensor(root, file, "gates/alpha", false, &e->alpha));
    char buf[128];
    if (e->k.ndim != 4) return mn_fail(MN_ERR_ARG, "%s: dataset /inputs/k must be [B,H,T,dk], got %s", file, mn_shape_string(&e->k, buf, sizeof buf));
    if (e->v.ndim != 4) return mn_fail(MN_ERR_ARG, "%s: dataset /inputs/v must be [B,H,T,dv], got %s", file, mn_shape_string(&e->v, buf, sizeof buf));
    mn_dims *d = &e->dims;
    d->B = e->k.shape[0];
    d->H = e->k.shape[1];
    d->T = e->k.shape[2];
    d->dk = e->k.shape[3];
    d->dv = e->v.shape[3];
    d->S = (d->T + e->rule.step - 1) / e->rule.step;

    int np = mn_rule_param_count(&e->rule);
    for (int i = 0; i < np; i++) {
        char name[16], path[40];
        mn_rule_param_name(&e->rule, i, name, sizeof name);
        snprintf(path, sizeof path, "init/%s", name);
        MN_TRY(take_tensor(root, file, path, false, &e->init[i]));
        snprintf(path, sizeof path, "init/S_%s", name);
        MN_TRY(take_tensor(root, file, path, false, &e->init_momenta[i]));
    }
    /* hidden: from the attribute, or read off W1 ([dh, dk] when L >= 2). */
    if (e->rule.layers >= 2) {
        int64_t from_w1 = e->init[0].storage && e->init[0].ndim >= 2 ? e->init[0].shape[e->init[0].ndim - 2] : 0;
        if (e->rule.hidden == 0) e->rule.hidden = (int)from_w1;
        if (e->rule.hidden <= 0)
            return mn_fail(MN_ERR_ARG, "%s: /rule: attribute 'hidden' is missing and /init/W1 does not give it", file);
        d->dh = e->rule.hidden;
    } else d->dh = 0;
    /* /upstream (SPEC section 7): its datasets, named and checked by grad_files.c. */
    const mn_node *up = mn_node_find(root, "upstream");
    if (up) {
        if (up->kind != MN_NODE_GROUP) return mn_fail(MN_ERR_ARG, "%s: /upstream must be a group", file);
        e->upstream = mn_node_group("upstream");
        for (int i = 0; e->upstream && i < up->nchildren; i++)
            if (up->children[i]->kind == MN_NODE_TENSOR &&
                !mn_node_add_tensor(e->upstream, up->children[i]->name, &up->children[i]->tensor))
                return mn_fail(MN_ERR_OOM, "%s: out of memory reading /upstream", file);
        if (!e->upstream) return mn_fail(MN_ERR_OOM, "%s: out of memory reading /upstream", file);
    }
    /* The remaining checks (shapes of inputs, gates and parameters) are the
     * engine's; give them the file name. */
    return MN_OK;
}

mn_status mn_experiment_from_tree(const mn_node *root, const char *file, mn_experiment *out)
{
    memset(out, 0, sizeof *out);
    mn_rule_init(&out->rule);
    mn_status s = experiment_from_tree(root, file, out);
    if (s != MN_OK) mn_experiment_free(out);
    return s;
}

mn_status mn_experiment_load(const char *path, mn_experiment *out)
{
    mn_node *root = NULL;
    memset(out, 0, sizeof *out);
    MN_TRY(mn_h5_load(path, &root));
    mn_status s = mn_experiment_from_tree(root, path, out);
    mn_node_free(root); /* tensors keep their storage through their own references */
    return s;
}

void mn_experiment_free(mn_experiment *e)
{
    mn_rule_free(&e->rule);
    mn_tensor *ts[] = {&e->k, &e->v, &e->q, &e->theta, &e->eta, &e->alpha};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int i = 0; i < MN_MAX_PARAMS; i++) {
        mn_tensor_release(&e->init[i]);
        mn_tensor_release(&e->init_momenta[i]);
    }
    mn_node_free(e->rule_group);
    mn_node_free(e->upstream);
    memset(e, 0, sizeof *e);
}

mn_status mn_experiment_run(const mn_experiment *e, mn_device dev, mn_precision prec, mn_memory_state *final,
                            mn_segment_outputs *out)
{
    MN_TRY(mn_memory_create(final, &e->rule, &e->dims, e->init, e->init_momenta, dev));
    final->precision = prec; /* read by the engine at run time */
    mn_segment_inputs in = {0};
    in.k = e->k;
    in.v = e->v;
    in.q = e->q;
    in.theta = e->theta;
    in.eta = e->eta;
    in.alpha = e->alpha;
    in.want_y = true;
    mn_status s = mn_segment_run(final, &in, out);
    if (s != MN_OK) mn_memory_free(final);
    return s;
}

mn_status mn_result_tree(const mn_rule *rule, const mn_node *rule_group, const mn_memory_state *final,
                         const mn_segment_outputs *out, const char *device, const char *precision, bool trace,
                         mn_node **root_out)
{
    mn_node *root = mn_node_group("/");
    bool ok = root && mn_node_add_integer(root, "mnemo_schema", 1) &&
              mn_node_add_string(root, "engine", "mnemo " MN_VERSION) && mn_node_add_string(root, "device", device) &&
              mn_node_add_string(root, "precision", precision);
    mn_node *rg = ok ? mn_node_add_group(root, "rule") : NULL;
    ok = rg != NULL;
    if (ok) {
        if (rule_group) ok = copy_attr_group(rg, rule_group);
        else ok = mn_rule_to_tree(rule, rg) == MN_OK;
    }
    mn_node *outputs = ok ? mn_node_add_group(root, "outputs") : NULL;
    ok = outputs && mn_node_add_tensor(outputs, "y", &out->y) && mn_node_add_tensor(outputs, "loss", &out->loss) &&
         mn_node_add_tensor(outputs, "grad_norm", &out->grad_norm) &&
         mn_node_add_tensor(outputs, "clip_scale", &out->clip_scale) &&
         mn_node_add_tensor(outputs, "skipped", &out->skipped);
    mn_node *fin = ok ? mn_node_add_group(root, "final") : NULL;
    ok = fin != NULL;
    for (int i = 0; ok && i < final->nparams; i++) {
        char name[16], sname[20];
        mn_rule_param_name(rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        ok = mn_node_add_tensor(fin, name, &final->params[i]) && mn_node_add_tensor(fin, sname, &final->momenta[i]);
    }
    if (ok && trace) {
        mn_node *tr = mn_node_add_group(root, "trace");
        ok = tr && mn_node_add_tensor(tr, "step_loss", &out->step_loss) &&
             mn_node_add_tensor(tr, "weight_norm", &out->weight_norm);
    }
    if (!ok) {
        mn_node_free(root);
        return mn_fail(MN_ERR_OOM, "out of memory building the result");
    }
    *root_out = root;
    return MN_OK;
}
