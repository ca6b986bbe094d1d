/* grad_files.c: gradients in files (SPEC.md section 5): an experiment's
 * /upstream group in, a result's /grads group out. */
#include "experiment.h"
#include "grad.h"
#include "grad_files.h"

#include <stdio.h>
#include <string.h>

/* Which upstream slot a name fills: dy, dloss, d<param>, dS_<param>. */
static mn_tensor *upstream_slot(const mn_rule *rule, mn_run_upstream *up, const char *name)
{
    if (strcmp(name, "dy") == 0) return &up->dy;
    if (strcmp(name, "dloss") == 0) return &up->dloss;
    for (int p = 0; p < mn_rule_param_count(rule); p++) {
        char pn[16], want[24];
        mn_rule_param_name(rule, p, pn, sizeof pn);
        snprintf(want, sizeof want, "d%s", pn);
        if (strcmp(name, want) == 0) return &up->dparams[p];
        snprintf(want, sizeof want, "dS_%s", pn);
        if (strcmp(name, want) == 0) return &up->dmomenta[p];
    }
    return NULL;
}

mn_status mn_upstream_names(const mn_rule *rule, char *buf, size_t len)
{
    int used = snprintf(buf, len, "dy, dloss");
    for (int p = 0; p < mn_rule_param_count(rule) && used > 0 && (size_t)used < len; p++) {
        char pn[16];
        mn_rule_param_name(rule, p, pn, sizeof pn);
        used += snprintf(buf + used, len - (size_t)used, ", d%s", pn);
    }
    for (int p = 0; p < mn_rule_param_count(rule) && used > 0 && (size_t)used < len; p++) {
        char pn[16];
        mn_rule_param_name(rule, p, pn, sizeof pn);
        used += snprintf(buf + used, len - (size_t)used, ", dS_%s", pn);
    }
    return MN_OK;
}

mn_status mn_upstream_set(const mn_rule *rule, mn_run_upstream *up, const char *name, const mn_tensor *t,
                          const char *where)
{
    mn_tensor *slot = upstream_slot(rule, up, name);
    if (!slot) {
        char names[512];
        mn_upstream_names(rule, names, sizeof names);
        return mn_fail(MN_ERR_ARG, "%s%s: unknown upstream gradient (one of: %s)", where, name, names);
    }
    mn_tensor_release(slot);
    mn_tensor_share(slot, t);
    return MN_OK;
}

void mn_upstream_free(mn_run_upstream *up)
{
    mn_tensor_release(&up->dy);
    mn_tensor_release(&up->dloss);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&up->dparams[p]);
        mn_tensor_release(&up->dmomenta[p]);
    }
}

static void experiment_inputs(const mn_experiment *e, mn_segment_inputs *in)
{
    memset(in, 0, sizeof *in);
    in->k = e->k;
    in->v = e->v;
    in->q = e->q;
    in->theta = e->theta;
    in->eta = e->eta;
    in->alpha = e->alpha;
    in->lengths = e->lengths;
}

mn_status mn_experiment_run_checkpointed(const mn_experiment *e, mn_memory_state *final, mn_segment_outputs *out,
                                         mn_run_checkpoints *ck)
{
    MN_TRY(mn_memory_create(final, &e->rule, &e->dims, e->init, e->init_momenta, MN_CPU));
    mn_status so = mn_memory_set_outer(final, e->init_outer);
    if (so != MN_OK) {
        mn_memory_free(final);
        return so;
    }
    mn_segment_inputs in;
    experiment_inputs(e, &in);
    in.want_y = true;
    mn_status s = mn_run_forward_checkpointed(final, &in, 0, out, ck);
    if (s != MN_OK) mn_memory_free(final);
    return s;
}

mn_status mn_experiment_backward(const mn_experiment *e, const char *file, mn_device dev, mn_precision prec,
                                 const mn_run_checkpoints *ck, mn_run_grads *g)
{
    memset(g, 0, sizeof *g);
    if (!e->upstream) return mn_fail(MN_ERR_ARG, "%s: no /upstream group", file);
    mn_run_upstream up = {0};
    char where[600];
    snprintf(where, sizeof where, "%s: /upstream/", file);
    mn_status s = MN_OK;
    for (int i = 0; i < e->upstream->nchildren && s == MN_OK; i++) {
        const mn_node *c = e->upstream->children[i];
        if (c->kind != MN_NODE_TENSOR) continue;
        s = mn_upstream_set(&e->rule, &up, c->name, &c->tensor, where);
    }
    mn_segment_inputs in;
    experiment_inputs(e, &in);
    if (s == MN_OK) {
        s = mn_run_backward_on(dev, prec, &e->rule, &e->dims, e->init, e->init_momenta, e->init_outer, &in, &up, 0, ck, g);
        if (s != MN_OK) mn_fail_context(s, "%s: backward: ", file);
    }
    mn_upstream_free(&up);
    return s;
}

mn_status mn_grads_to_tree(const mn_rule *rule, const mn_run_grads *g, mn_node *root)
{
    mn_node *gr = mn_node_add_group(root, "grads");
    bool ok = gr && mn_node_add_tensor(gr, "k", &g->k) && mn_node_add_tensor(gr, "v", &g->v) &&
              (!g->q.storage || mn_node_add_tensor(gr, "q", &g->q)) && mn_node_add_tensor(gr, "theta", &g->theta) &&
              mn_node_add_tensor(gr, "eta", &g->eta) && mn_node_add_tensor(gr, "alpha", &g->alpha);
    for (int p = 0; ok && p < g->nparams; p++) {
        char pn[16], sn[24];
        mn_rule_param_name(rule, p, pn, sizeof pn);
        snprintf(sn, sizeof sn, "S_%s", pn);
        ok = mn_node_add_tensor(gr, pn, &g->params[p]) && mn_node_add_tensor(gr, sn, &g->momenta[p]);
    }
    for (int j = 0; ok && j < MN_OUTER_COUNT; j++)
        if (g->outer[j].storage) ok = mn_node_add_tensor(gr, mn_outer_name(j), &g->outer[j]) != NULL;
    return ok ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory building /grads");
}
