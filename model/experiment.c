/* experiment.c: experiment files in, result trees out (SPEC.md section 5).
 * Every error names the file and the group, dataset or attribute at fault. */
#include "experiment.h"
#include "h5.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    mn_rule_free(&e->rule);
    MN_TRY(mn_rule_from_tree(rule, where, &e->rule));
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
    /* /inputs/lengths (SPEC v2): integers or whole floats, [B] from 0 to T. */
    const mn_node *len = mn_node_find(root, "inputs/lengths");
    if (len) {
        if (len->kind != MN_NODE_TENSOR) return mn_fail(MN_ERR_ARG, "%s: /inputs/lengths must be a dataset", file);
        mn_tensor_share(&e->lengths, &len->tensor);
        mn_status ls = mn_lengths_check(&e->lengths, d->B, d->T);
        if (ls != MN_OK) return mn_fail_context(ls, "%s: /inputs/", file);
    }

    int np = mn_rule_param_count(&e->rule);
    for (int i = 0; i < np; i++) {
        char name[16], path[40];
        mn_rule_param_name(&e->rule, i, name, sizeof name);
        snprintf(path, sizeof path, "init/%s", name);
        MN_TRY(take_tensor(root, file, path, false, &e->init[i]));
        snprintf(path, sizeof path, "init/S_%s", name);
        MN_TRY(take_tensor(root, file, path, false, &e->init_momenta[i]));
    }
    int nouter = mn_rule_outer_count(&e->rule);
    for (int j = 0; j < nouter; j++) {
        char path[40];
        snprintf(path, sizeof path, "init/%s", mn_outer_name(j));
        MN_TRY(take_tensor(root, file, path, false, &e->init_outer[j]));
    }
    /* A dataset in /init that no parameter reads (W2 for a one-layer rule, a
     * misspelt name) means the file and the rule disagree: say so rather
     * than run with part of the file ignored. */
    const mn_node *init = mn_node_find(root, "init");
    for (int c = 0; init && init->kind == MN_NODE_GROUP && c < init->nchildren; c++) {
        const mn_node *n = init->children[c];
        if (n->kind != MN_NODE_TENSOR && n->kind != MN_NODE_GROUP) continue; /* attributes */
        bool known = false;
        for (int i = 0; i < np && !known; i++) {
            char name[16], momentum[24];
            mn_rule_param_name(&e->rule, i, name, sizeof name);
            snprintf(momentum, sizeof momentum, "S_%s", name);
            known = strcmp(n->name, name) == 0 || strcmp(n->name, momentum) == 0;
        }
        for (int j = 0; j < nouter && !known; j++) known = strcmp(n->name, mn_outer_name(j)) == 0;
        if (!known) {
            char names[200] = "";
            for (int i = 0; i < np; i++) {
                char name[16];
                mn_rule_param_name(&e->rule, i, name, sizeof name);
                size_t used = strlen(names);
                snprintf(names + used, sizeof names - used, "%s%s", i ? ", " : "", name);
            }
            return mn_fail(MN_ERR_ARG, "%s: dataset /init/%s is not a parameter of this rule (its parameters: %s, and S_ of each%s)",
                           file, n->name, names, nouter ? "; ln_g, ln_b" : "");
        }
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

bool mn_experiment_path_on_device(const char *path)
{
    static const char *const inputs[] = {"/inputs/k", "/inputs/v", "/inputs/q", "/gates/theta", "/gates/eta",
                                         "/gates/alpha"};
    for (size_t i = 0; i < sizeof inputs / sizeof *inputs; i++)
        if (strcmp(path, inputs[i]) == 0) return true;
    /* /init's datasets, which become parameters, momenta or ln_g, ln_b;
     * never /inputs/lengths, which the engine checks on the host. */
    return strncmp(path, "/init/", 6) == 0 && !strchr(path + 6, '/');
}

mn_status mn_experiment_load(const char *path, mn_experiment *out) { return mn_experiment_load_io(path, out, NULL); }

mn_status mn_experiment_load_io(const char *path, mn_experiment *out, mn_h5_io *io)
{
    mn_node *root = NULL;
    memset(out, 0, sizeof *out);
    MN_TRY(mn_h5_load_io(path, &root, io));
    mn_status s = mn_experiment_from_tree(root, path, out);
    mn_node_free(root); /* tensors keep their storage through their own references */
    return s;
}

/* Every tensor the run reads, but lengths (checked on the host). */
static int run_tensors(mn_experiment *e, mn_tensor **ts)
{
    int n = 0;
    mn_tensor *inputs[] = {&e->k, &e->v, &e->q, &e->theta, &e->eta, &e->alpha};
    for (size_t i = 0; i < sizeof inputs / sizeof *inputs; i++) ts[n++] = inputs[i];
    for (int i = 0; i < MN_MAX_PARAMS; i++) {
        ts[n++] = &e->init[i];
        ts[n++] = &e->init_momenta[i];
    }
    for (int j = 0; j < MN_OUTER_COUNT; j++) ts[n++] = &e->init_outer[j];
    return n;
}

mn_status mn_experiment_to_device(mn_experiment *e, mn_device dev, double *bytes)
{
    mn_tensor *ts[6 + 2 * MN_MAX_PARAMS + MN_OUTER_COUNT];
    int n = run_tensors(e, ts);
    for (int i = 0; i < n; i++) {
        mn_tensor *t = ts[i];
        if (!t->storage || t->storage->device == dev) continue;
        mn_tensor moved = {0};
        MN_TRY(mn_tensor_to_device(&moved, t, dev));
        if (bytes) *bytes += (double)mn_tensor_numel(t) * (double)mn_dtype_size(t->dtype);
        mn_tensor_release(t); /* the host copy is done with */
        *t = moved;
    }
    return MN_OK;
}

void mn_experiment_free(mn_experiment *e)
{
    mn_rule_free(&e->rule);
    mn_tensor *ts[] = {&e->k, &e->v, &e->q, &e->theta, &e->eta, &e->alpha, &e->lengths};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int i = 0; i < MN_MAX_PARAMS; i++) {
        mn_tensor_release(&e->init[i]);
        mn_tensor_release(&e->init_momenta[i]);
    }
    for (int j = 0; j < MN_OUTER_COUNT; j++) {
        mn_tensor_release(&e->init_outer[j]);
    }
    mn_node_free(e->rule_group);
    mn_node_free(e->upstream);
    memset(e, 0, sizeof *e);
}

mn_status mn_experiment_run(const mn_experiment *e, mn_device dev, mn_precision prec, mn_memory_state *final,
                            mn_segment_outputs *out)
{
    MN_TRY(mn_memory_create(final, &e->rule, &e->dims, e->init, e->init_momenta, dev));
    mn_status so = mn_memory_set_outer(final, e->init_outer);
    if (so != MN_OK) {
        mn_memory_free(final);
        return so;
    }
    final->precision = prec; /* read by the engine at run time */
    mn_segment_inputs in = {0};
    in.k = e->k;
    in.v = e->v;
    in.q = e->q;
    in.theta = e->theta;
    in.eta = e->eta;
    in.alpha = e->alpha;
    in.lengths = e->lengths;
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
    /* /outputs and (with trace) /trace, from the rows of MN_SEGMENT_OUTPUTS. */
    mn_node *outputs = ok ? mn_node_add_group(root, "outputs") : NULL;
    mn_node *tr = ok && trace ? mn_node_add_group(root, "trace") : NULL;
    ok = outputs && (tr || !trace);
    for (int i = 0; ok && i < mn_segment_output_count; i++) {
        const mn_output_row *row = &mn_segment_output_rows[i];
        mn_node *g = strcmp(row->group, "outputs") == 0 ? outputs : tr;
        const mn_tensor *t = mn_segment_output((mn_segment_outputs *)out, i);
        if (g && t->storage) ok = mn_node_add_tensor(g, row->name, t) != NULL;
    }
    mn_node *fin = ok ? mn_node_add_group(root, "final") : NULL;
    ok = fin != NULL;
    for (int i = 0; ok && i < final->nparams; i++) {
        char name[16], sname[20];
        mn_rule_param_name(rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        ok = mn_node_add_tensor(fin, name, &final->params[i]) && mn_node_add_tensor(fin, sname, &final->momenta[i]);
    }
    if (!ok) {
        mn_node_free(root);
        return mn_fail(MN_ERR_OOM, "out of memory building the result");
    }
    *root_out = root;
    return MN_OK;
}
