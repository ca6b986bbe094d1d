/* fuzz_experiment.c: libFuzzer target for the experiment loader (SPEC
 * section 5): mn_h5_load (model/h5.c), mn_experiment_from_tree
 * (model/experiment.c, model/rule_io.c) and, when the file is valid and
 * small, a CPU run of it (the engine's own shape and gate checks).
 *
 * The first byte picks how the rest is read:
 *   even: the bytes are an HDF5 file, written to a temporary file and loaded
 *         (seeds: valid experiments in tests/fuzz/corpus_experiment/);
 *   odd:  the bytes describe a tree (attributes of any type and value, NaN
 *         and Inf included; datasets of any rank, size and dtype), which is
 *         saved with mn_h5_save and loaded back, or, every other time, given
 *         to mn_experiment_from_tree directly.
 * The message of every refusal must be one line. */
#include "experiment.h"
#include "h5.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static unsigned take(reader *r, unsigned range)
{
    if (!r->n || !range) return 0;
    unsigned v = *r->p++;
    r->n--;
    return v % range;
}

static double take_number(reader *r)
{
    static const double special[] = {0.0, 1.0, -1.0, 0.5, 2.0, 1e-3, 1e30, -1e30, NAN, INFINITY, -INFINITY,
                                     4.0, 16.0, 1e9, 3.5, 1e300};
    unsigned k = take(r, 20);
    if (k < 16) return special[k];
    double v = 0;
    if (r->n >= sizeof v) {
        memcpy(&v, r->p, sizeof v);
        r->p += sizeof v;
        r->n -= sizeof v;
    }
    return v;
}

static const char *const attr_names[] = {
    "layers", "hidden", "activation", "bias", "residual", "loss", "loss_delta", "loss_p",
    "feature_reduce", "token_reduce", "step", "refresh", "retrieve", "clip", "clip_max",
    "clip_scope", "loss_expr", "activation_expr", "clip_expr", "glu", "out_norm", "qk_norm",
    "precondition", "ns_steps", "bogus"};
static const char *const strings[] = {
    "mse", "l1", "huber", "lp", "dot", "logcosh", "custom", "silu", "gelu", "relu", "tanh",
    "identity", "mean", "sum", "after", "before", "none", "norm", "softnorm", "value",
    "softvalue", "scale", "elementwise", "global", "tensor", "abs(r)", "r^2 * (y - v)",
    "max(g, 1)", "", "r+", "((r))", "silu(z) * z"};
static const char *const datasets[] = {
    "inputs/k", "inputs/v", "inputs/q", "gates/theta", "gates/eta", "gates/alpha",
    "init/W1", "init/b1", "init/W2", "init/b2", "init/S_W1", "init/S_W2", "init/W3",
    "init/ln_g", "inputs/lengths", "upstream/dy"};

static mn_node *group_at(mn_node *root, const char *path)
{
    char name[32];
    const char *slash = strchr(path, '/');
    size_t len = (size_t)(slash - path);
    memcpy(name, path, len);
    name[len] = 0;
    mn_node *g = mn_node_find(root, name);
    if (!g) g = mn_node_add_group(root, name);
    return g && g->kind == MN_NODE_GROUP ? g : NULL;
}

/* A tree from the bytes: mostly the shape of an experiment, with every
 * part open to being wrong. */
static mn_node *tree_from(reader *r)
{
    mn_node *root = mn_node_group("");
    if (!root) return NULL;
    if (take(r, 8)) mn_node_add_integer(root, "mnemo_schema", take(r, 4) ? 1 : (int64_t)take(r, 256) - 128);
    mn_node *rule = mn_node_add_group(root, "rule");
    unsigned nattrs = take(r, 8);
    for (unsigned i = 0; rule && i < nattrs; i++) {
        const char *name = attr_names[take(r, sizeof attr_names / sizeof *attr_names)];
        if (mn_node_find(rule, name)) continue;
        switch (take(r, 3)) {
        case 0: mn_node_add_integer(rule, name, (int64_t)take(r, 256) - 16); break;
        case 1: mn_node_add_number(rule, name, take_number(r)); break;
        default: mn_node_add_string(rule, name, strings[take(r, sizeof strings / sizeof *strings)]); break;
        }
    }
    unsigned ndatasets = take(r, 12);
    for (unsigned i = 0; i < ndatasets; i++) {
        const char *path = datasets[take(r, sizeof datasets / sizeof *datasets)];
        mn_node *g = group_at(root, path);
        const char *name = strchr(path, '/') + 1;
        if (!g || mn_node_find(g, name)) continue;
        int ndim = (int)take(r, 6);
        int64_t shape[5] = {1, 1, 1, 1, 1}, numel = 1;
        for (int d = 0; d < ndim; d++) {
            shape[d] = take(r, 6);
            numel *= shape[d];
        }
        static const mn_dtype dts[] = {MN_F32, MN_F32, MN_F64, MN_I64};
        mn_tensor t = {0};
        if (mn_tensor_empty(&t, dts[take(r, 4)], ndim, shape, MN_CPU) != MN_OK) continue;
        int64_t index[5] = {0};
        for (int64_t e = 0; e < numel; e++) {
            int64_t rest = e;
            for (int d = ndim - 1; d >= 0; d--) {
                index[d] = shape[d] ? rest % shape[d] : 0;
                rest = shape[d] ? rest / shape[d] : 0;
            }
            mn_tensor_set(&t, index, take(r, 4) ? (double)take(r, 16) / 8 - 1 : take_number(r));
        }
        mn_node_add_tensor(g, name, &t);
        mn_tensor_release(&t);
    }
    return root;
}

static void check_message(void)
{
    const char *m = mn_last_error();
    if (!m || !*m || strchr(m, '\n')) {
        fprintf(stderr, "a refusal without a one-line message: '%s'\n", m ? m : "(null)");
        abort();
    }
}

/* A small valid experiment runs on the CPU (big ones would only be slow). */
static void try_run(const mn_experiment *e)
{
    const mn_dims *d = &e->dims;
    if (d->B * d->H * d->T * (d->dk + d->dv) > 4096 || d->dh > 64) return;
    mn_memory_state final;
    mn_segment_outputs out;
    memset(&final, 0, sizeof final);
    memset(&out, 0, sizeof out);
    if (mn_experiment_run(e, MN_CPU, MN_PREC_FP32, &final, &out) != MN_OK) {
        check_message();
        return;
    }
    mn_node *res = NULL;
    if (mn_result_tree(&e->rule, e->rule_group, &final, &out, "cpu", "fp32", true, &res) == MN_OK) mn_node_free(res);
    mn_segment_outputs_free(&out);
    mn_memory_free(&final);
}

static char tmp_path[64];

static void from_tree(const mn_node *root)
{
    mn_experiment e;
    if (mn_experiment_from_tree(root, "fuzz.h5", &e) != MN_OK) {
        check_message();
        return;
    }
    try_run(&e);
    mn_experiment_free(&e);
}

static void from_file(void)
{
    mn_experiment e;
    if (mn_experiment_load(tmp_path, &e) != MN_OK) {
        check_message();
        if (getenv("MN_FUZZ_VERBOSE")) fprintf(stderr, "load: %s\n", mn_last_error());
        return;
    }
    try_run(&e);
    mn_experiment_free(&e);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!tmp_path[0]) snprintf(tmp_path, sizeof tmp_path, "/tmp/mnemo-fuzz-%d.h5", (int)getpid());
    if (size < 1) return 0;
    /* MN_FUZZ_TREE_ONLY=1: trees only (to look for leaks of our own with
     * leak detection on, away from libhdf5's own on corrupt files) */
    static int tree_only = -1;
    if (tree_only < 0) tree_only = getenv("MN_FUZZ_TREE_ONLY") != NULL;
    if ((data[0] & 1) == 0 && !tree_only) {
        FILE *f = fopen(tmp_path, "wb");
        if (!f) return 0;
        size_t wrote = fwrite(data + 1, 1, size - 1, f);
        fclose(f);
        if (wrote == size - 1) from_file();
    } else {
        reader r = {data + 1, size - 1};
        mn_node *root = tree_from(&r);
        if (!root) return 0;
        if (data[0] & 2) {
            from_tree(root);
        } else if (mn_h5_save(tmp_path, root) == MN_OK) {
            from_file();
        } else {
            check_message();
            if (getenv("MN_FUZZ_VERBOSE")) fprintf(stderr, "save: %s\n", mn_last_error());
        }
        mn_node_free(root);
    }
    unlink(tmp_path);
    return 0;
}
