/* mnemo_torch.c: the C side of the PyTorch bridge (python/mnemo_torch).
 * A thin layer over the engine library, called through ctypes, so that it
 * needs neither Python.h nor torch's C++ headers: tensors arrive as
 * (pointer, shape, strides, device) descriptors of torch tensors' own memory
 * and are wrapped, not copied (mn_tensor_wrap). Every entry point returns an
 * mn_status; the message is mnt_last_error(), which Python raises. */
#include "../../model/engine.h"
#include "../../model/grad.h"
#include "../../model/h5.h"
#include "../../model/rule_io.h"
#ifdef MN_HAVE_CUDA
#include "../../kernels/cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One tensor as Python describes it; data NULL means "not given". dtype and
 * device are mn_dtype and mn_device values. */
typedef struct mnt_arg {
    void *data;
    int64_t ndim;
    int64_t shape[MN_MAX_DIMS];
    int64_t stride[MN_MAX_DIMS];
    int64_t dtype, device;
} mnt_arg;

const char *mnt_last_error(void) { return mn_last_error(); }
const char *mnt_version(void) { return MN_VERSION; }

/* Whether CUDA tensors can run here (the CUDA layer registers once). */
int mnt_cuda_available(void)
{
#ifdef MN_HAVE_CUDA
    static int registered = -1;
    if (registered < 0) {
        registered = mn_cuda_register() ? 1 : 0;
        /* training captures CUDA graphs early and runs long: the full
         * compile from the first call (MNEMO_COMPILE still overrides) */
        mn_cuda_set_compile_default(MN_COMPILE_FULL);
    }
    return registered;
#else
    return 0;
#endif
}

/* ---- rules: from a dict (built as a tree) or a file ---- */

mn_node *mnt_group_new(const char *name) { return mn_node_group(name); }
mn_node *mnt_group_add_group(mn_node *g, const char *name) { return mn_node_add_group(g, name); }
int mnt_group_add_integer(mn_node *g, const char *name, int64_t v) { return mn_node_add_integer(g, name, v) ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory"); }
int mnt_group_add_number(mn_node *g, const char *name, double v) { return mn_node_add_number(g, name, v) ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory"); }
int mnt_group_add_string(mn_node *g, const char *name, const char *v) { return mn_node_add_string(g, name, v) ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory"); }
void mnt_node_free(mn_node *g) { mn_node_free(g); }

static int rule_from_group(const mn_node *g, const char *where, const char *noun, mn_rule **out)
{
    mn_rule *r = mn_calloc(1, sizeof *r, "a rule");
    if (!r) return MN_ERR_OOM;
    mn_rule_init(r);
    mn_status st = mn_rule_from_tree_as(g, where, noun, r);
    if (st == MN_OK) st = mn_rule_validate(r);
    if (st != MN_OK) {
        mn_rule_free(r);
        free(r);
        return st;
    }
    *out = r;
    return MN_OK;
}

/* A rule from the attributes of a dict (keys named as in /rule). */
int mnt_rule_from_group(const mn_node *g, const char *where, mn_rule **out)
{
    return rule_from_group(g, where, "key", out);
}

/* A rule from a file's /rule group: rule:save's file or an experiment file. */
int mnt_rule_load(const char *path, mn_rule **out)
{
    mn_node *root = NULL;
    MN_TRY(mn_h5_load(path, &root));
    const mn_node *g = mn_node_find(root, "rule");
    mn_status st = MN_OK;
    if (!g || g->kind != MN_NODE_GROUP) st = mn_fail(MN_ERR_ARG, "%s: group /rule is missing (save one with rule:save(path))", path);
    char where[1100];
    snprintf(where, sizeof where, "%s: /rule", path);
    if (st == MN_OK) st = rule_from_group(g, where, "attribute", out);
    mn_node_free(root);
    return st;
}

void mnt_rule_free(mn_rule *r)
{
    if (!r) return;
    mn_rule_free(r);
    free(r);
}

/* Facts Python needs to shape the tensors: layers, hidden, step, bias. */
void mnt_rule_info(const mn_rule *r, int64_t *layers, int64_t *hidden, int64_t *step, int64_t *nparams)
{
    *layers = r->layers;
    *hidden = r->hidden;
    *step = r->step;
    *nparams = mn_rule_param_count(r);
}

/* The /rule attributes back as a tree (for printing and saving). */
int mnt_rule_attrs(const mn_rule *r, mn_node **out)
{
    mn_node *g = mn_node_group("rule");
    if (!g) return mn_fail(MN_ERR_OOM, "out of memory");
    mn_status st = mn_rule_to_tree(r, g);
    if (st != MN_OK) {
        mn_node_free(g);
        return st;
    }
    *out = g;
    return MN_OK;
}

/* Walk a tree from Python: child i's name, kind and value. */
int mnt_node_count(const mn_node *g) { return g->nchildren; }
const char *mnt_node_child(const mn_node *g, int i, int *kind, int64_t *integer, double *number, const char **string,
                           const mn_node **child)
{
    const mn_node *c = g->children[i];
    *kind = (int)c->kind;
    *integer = c->integer;
    *number = c->number;
    *string = c->string;
    *child = c;
    return c->name;
}

/* Parameter i's name and shape for one memory (dims: B, H, T, dk, dv, dh). */
int mnt_param_info(const mn_rule *r, const int64_t *dims6, int i, char *name, int64_t *shape)
{
    mn_dims d = {.B = dims6[0], .H = dims6[1], .T = dims6[2], .dk = dims6[3], .dv = dims6[4], .dh = dims6[5]};
    mn_rule_param_name(r, i, name, 16);
    return mn_rule_param_shape(r, &d, i, shape);
}

/* ---- tensors ---- */

static mn_status wrap(mn_tensor *t, const mnt_arg *a, const char *what)
{
    memset(t, 0, sizeof *t);
    if (!a || !a->data) return MN_OK; /* empty: not given */
    mn_status st = mn_tensor_wrap(t, a->data, (mn_dtype)a->dtype, (int)a->ndim, a->shape, a->stride, (mn_device)a->device);
    if (st != MN_OK) mn_fail_context(st, "%s: ", what);
    return st;
}

/* dst (a caller's tensor, given) = src, same number of elements. */
static mn_status copy_out(const mnt_arg *dst, const mn_tensor *src, const char *what)
{
    if (!dst || !dst->data) return MN_OK;
    if (!src->storage) return mn_fail(MN_ERR_ARG, "%s: the engine gave no tensor", what);
    mn_tensor d;
    MN_TRY(wrap(&d, dst, what));
    mn_status st = MN_OK;
    if (mn_tensor_numel(&d) != mn_tensor_numel(src)) {
        char a[128], b[128];
        st = mn_fail(MN_ERR_ARG, "%s: output holds %s, the engine gave %s", what, mn_shape_string(&d, a, sizeof a),
                     mn_shape_string(src, b, sizeof b));
    } else if (mn_tensor_same_shape(&d, src)) {
        st = mn_tensor_copy_into(&d, src);
    } else {
        mn_tensor view = {0};
        st = mn_tensor_reshape(&view, src, d.ndim, d.shape);
        if (st == MN_OK) st = mn_tensor_copy_into(&d, &view);
        mn_tensor_release(&view);
    }
    mn_tensor_release(&d);
    if (st != MN_OK) mn_fail_context(st, "%s: ", what);
    return st;
}

/* The rule for one call: hidden read off W1 when the rule leaves it 0. */
static mn_status rule_for_call(const mn_rule *r, const int64_t *dims6, mn_rule *out, mn_dims *d)
{
    MN_TRY(mn_rule_copy(out, r));
    if (out->layers >= 2 && out->hidden == 0) out->hidden = (int)dims6[5];
    *d = (mn_dims){.B = dims6[0], .H = dims6[1], .T = dims6[2], .dk = dims6[3], .dv = dims6[4],
                   .dh = out->layers >= 2 ? out->hidden : 0};
    d->S = (d->T + out->step - 1) / out->step;
    return MN_OK;
}

typedef struct call {
    mn_rule rule;
    mn_dims dims;
    int np;
    mn_segment_inputs in;
    mn_tensor params[MN_MAX_PARAMS], momenta[MN_MAX_PARAMS];
    mn_tensor outer[MN_OUTER_COUNT]; /* out_norm's ln_g, ln_b as given (empty: defaults) */
} call;

static void call_free(call *c)
{
    mn_tensor *ts[] = {&c->in.k, &c->in.v, &c->in.q, &c->in.theta, &c->in.eta, &c->in.alpha, &c->in.lengths};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&c->params[p]);
        mn_tensor_release(&c->momenta[p]);
    }
    for (int j = 0; j < MN_OUTER_COUNT; j++) mn_tensor_release(&c->outer[j]);
    mn_rule_free(&c->rule);
}

/* inputs: k, v, q, theta, eta, alpha, lengths (q, eta, alpha, lengths may
 * be absent; lengths is an int64 cpu tensor [B]); outer: ln_g, ln_b (absent:
 * the defaults 1 and 0 of an out_norm rule). */
static mn_status call_init(call *c, const mn_rule *r, const int64_t *dims6, const mnt_arg *inputs,
                           const mnt_arg *params, const mnt_arg *momenta, const mnt_arg *outer)
{
    memset(c, 0, sizeof *c);
    MN_TRY(rule_for_call(r, dims6, &c->rule, &c->dims));
    c->np = mn_rule_param_count(&c->rule);
    static const char *const names[] = {"k", "v", "q", "theta", "eta", "alpha", "lengths"};
    mn_tensor *slots[] = {&c->in.k, &c->in.v, &c->in.q, &c->in.theta, &c->in.eta, &c->in.alpha, &c->in.lengths};
    for (int i = 0; i < 7; i++) MN_TRY(wrap(slots[i], &inputs[i], names[i]));
    for (int j = 0; j < MN_OUTER_COUNT; j++) MN_TRY(wrap(&c->outer[j], &outer[j], mn_outer_name(j)));
    c->in.want_y = true;
    for (int p = 0; p < c->np; p++) {
        char name[16], what[24];
        mn_rule_param_name(&c->rule, p, name, sizeof name);
        MN_TRY(wrap(&c->params[p], &params[p], name));
        snprintf(what, sizeof what, "S_%s", name);
        if (momenta) MN_TRY(wrap(&c->momenta[p], &momenta[p], what));
    }
    return MN_OK;
}


/* For a call on cuda: the engine's CUDA work (tensor ops, the per-memory
 * kernels, the backward's) goes to the caller's stream (a cudaStream_t, or
 * NULL), so it is ordered after what the caller queued there and before
 * what it queues next, and a CUDA graph capturing that stream records it.
 * The large path runs on a stream of its own after waiting for the
 * caller's (kernels/engine_cuda.c). A cpu call needs nothing. */
static mn_status use_device(int device, void *stream)
{
    if (device != MN_CUDA) return MN_OK;
#ifdef MN_HAVE_CUDA
    if (!mnt_cuda_available()) return mn_fail(MN_ERR_DEVICE, "cuda: %s", mn_cuda_unavailable_reason());
    mn_cuda_set_stream(stream);
    return MN_OK;
#else
    (void)stream;
    return mn_fail(MN_ERR_UNSUPPORTED, "cuda: this build of mnemo has no CUDA (make CUDA=1)");
#endif
}

/* After a call: the default stream again, the REPL's and every other caller's. */
static void release_device(void)
{
#ifdef MN_HAVE_CUDA
    mn_cuda_set_stream(NULL);
#endif
}

/* Forward of one run from the initial state. inputs, outer: as for
 * call_init (ln_g, ln_b set after the state is made: mn_memory_set_outer
 * names one given to a rule without out_norm). outputs: y, loss, grad_norm,
 * clip_scale, skipped (given tensors of the engine's shapes, filled);
 * final_params / final_momenta: [B,H,...] tensors filled with W^(S), S^(S).
 * device: the inputs' device; stream: the caller's cudaStream_t (or NULL). */
int mnt_forward(const mn_rule *r, const int64_t *dims6, int device, void *stream, const mnt_arg *inputs,
                const mnt_arg *params, const mnt_arg *momenta, const mnt_arg *outer, const mnt_arg *outputs,
                const mnt_arg *final_params, const mnt_arg *final_momenta)
{
    mn_clear_error();
    call c;
    mn_memory_state st;
    memset(&st, 0, sizeof st);
    mn_segment_outputs out;
    memset(&out, 0, sizeof out);
    bool have_state = false;
    mn_status s = call_init(&c, r, dims6, inputs, params, momenta, outer);
    if (s == MN_OK) s = use_device(device, stream);
    if (s == MN_OK) {
        s = mn_memory_create(&st, &c.rule, &c.dims, c.params, c.momenta, (mn_device)device);
        have_state = s == MN_OK;
    }
    if (s == MN_OK) s = mn_memory_set_outer(&st, c.outer);
    if (s == MN_OK) s = mn_segment_run(&st, &c.in, &out);
    static const char *const onames[] = {"y", "loss", "grad_norm", "clip_scale", "skipped"};
    mn_tensor *otensors[] = {&out.y, &out.loss, &out.grad_norm, &out.clip_scale, &out.skipped};
    for (int i = 0; i < 5 && s == MN_OK; i++) s = copy_out(&outputs[i], otensors[i], onames[i]);
    for (int p = 0; p < c.np && s == MN_OK; p++) {
        char name[16], what[24];
        mn_rule_param_name(&c.rule, p, name, sizeof name);
        s = copy_out(&final_params[p], &st.params[p], name);
        snprintf(what, sizeof what, "S_%s", name);
        if (s == MN_OK) s = copy_out(&final_momenta[p], &st.momenta[p], what);
    }
    mn_segment_outputs_free(&out);
    if (have_state) mn_memory_free(&st);
    call_free(&c);
    release_device();
    return s;
}

/* Backward (SPEC.md section 7) of a run on device (mn_run_backward_on: on
 * the GPU for the rules its backward covers, else on the cpu; stream: the
 * caller's cudaStream_t or NULL, as for mnt_forward). inputs, outer as for
 * mnt_forward. upstream: dy, dloss, then dparams[np], dmomenta[np] (absent:
 * zero). grads (cpu tensors): k, v, q, theta, eta, alpha, then params[np],
 * momenta[np], then ln_g, ln_b: each given tensor is filled with the
 * gradient summed to its shape (that of the matching input). */
int mnt_backward(const mn_rule *r, const int64_t *dims6, int device, void *stream, const mnt_arg *inputs,
                 const mnt_arg *params, const mnt_arg *momenta, const mnt_arg *outer, const mnt_arg *upstream,
                 const mnt_arg *grads)
{
    mn_clear_error();
    call c;
    mn_run_upstream up;
    memset(&up, 0, sizeof up);
    mn_run_grads g;
    memset(&g, 0, sizeof g);
    bool have_grads = false;
    mn_status s = call_init(&c, r, dims6, inputs, params, momenta, outer);
    if (s == MN_OK) s = use_device(device, stream); /* the backward's GPU work too */
    if (s == MN_OK) s = wrap(&up.dy, &upstream[0], "dy");
    if (s == MN_OK) s = wrap(&up.dloss, &upstream[1], "dloss");
    for (int p = 0; p < c.np && s == MN_OK; p++) {
        s = wrap(&up.dparams[p], &upstream[2 + p], "dparams");
        if (s == MN_OK) s = wrap(&up.dmomenta[p], &upstream[2 + c.np + p], "dmomenta");
    }
    if (s == MN_OK) {
        s = mn_run_backward_on((mn_device)device, MN_PREC_FP32, &c.rule, &c.dims, c.params, c.momenta, c.outer, &c.in, &up, 0, NULL,
                               &g);
        have_grads = s == MN_OK;
        if (s != MN_OK) mn_fail_context(s, "backward: ");
    }
    static const char *const names[] = {"k", "v", "q", "theta", "eta", "alpha"};
    const mn_tensor *full[] = {&g.k, &g.v, &g.q, &g.theta, &g.eta, &g.alpha};
    for (int i = 0; i < 6 + 2 * c.np + MN_OUTER_COUNT && s == MN_OK; i++) {
        const mnt_arg *dst = &grads[i];
        if (!dst->data) continue;
        const mn_tensor *src = i < 6 ? full[i] : i < 6 + c.np ? &g.params[i - 6]
                             : i < 6 + 2 * c.np ? &g.momenta[i - 6 - c.np] : &g.outer[i - 6 - 2 * c.np];
        char what[32];
        if (i < 6) snprintf(what, sizeof what, "grad of %s", names[i]);
        else if (i >= 6 + 2 * c.np) snprintf(what, sizeof what, "grad of %s", mn_outer_name(i - 6 - 2 * c.np));
        else {
            char name[16];
            mn_rule_param_name(&c.rule, (i - 6) % c.np, name, sizeof name);
            snprintf(what, sizeof what, "grad of %s%s", i < 6 + c.np ? "" : "S_", name);
        }
        if (!src->storage) {
            s = mn_fail(MN_ERR_ARG, "%s: the engine gave no gradient", what);
            break;
        }
        mn_tensor reduced = {0};
        s = mn_sum_to_shape(&reduced, src, (int)dst->ndim, dst->shape);
        if (s == MN_OK) s = copy_out(dst, &reduced, what);
        mn_tensor_release(&reduced);
    }
    mn_tensor_release(&up.dy);
    mn_tensor_release(&up.dloss);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&up.dparams[p]);
        mn_tensor_release(&up.dmomenta[p]);
    }
    if (have_grads) mn_run_grads_free(&g);
    call_free(&c);
    release_device();
    return s;
}
