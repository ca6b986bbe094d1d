/* engine.c: what every engine backend shares: the memory state, checks of a
 * segment's inputs (shapes, gate broadcasting), materialising inputs and gates
 * as contiguous f32, allocating outputs, and dispatch to the backend. */
#include "engine.h"
#include "ops.h"
#include "random.h"
#include "random_counter.h"
#include "rownorm.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const mn_engine_backend *engines[2];
static mn_progress_fn progress_fn;
static void *progress_ctx;

void mn_set_progress(mn_progress_fn fn, void *ctx)
{
    progress_fn = fn;
    progress_ctx = ctx;
}

void mn_report_progress(int64_t done, int64_t total)
{
    if (progress_fn) progress_fn(progress_ctx, done, total);
}

void mn_register_engine(mn_device dev, const mn_engine_backend *b) { engines[dev] = b; }

static const mn_engine_backend *engine_for(mn_device dev)
{
    if (dev == MN_CPU && !engines[MN_CPU]) engines[MN_CPU] = mn_engine_cpu();
    if (!engines[dev]) mn_fail(MN_ERR_DEVICE, "no %s engine in this build", mn_device_name(dev));
    return engines[dev];
}

const char *mn_precision_name(mn_precision p)
{
    return p == MN_PREC_TF32 ? "tf32" : p == MN_PREC_BF16 ? "bf16" : "fp32";
}

mn_status mn_precision_lookup(const char *name, mn_precision *out)
{
    if (strcmp(name, "fp32") == 0) *out = MN_PREC_FP32;
    else if (strcmp(name, "tf32") == 0) *out = MN_PREC_TF32;
    else if (strcmp(name, "bf16") == 0) *out = MN_PREC_BF16;
    else return mn_fail(MN_ERR_ARG, "unknown precision '%s' (one of: fp32, tf32, bf16)", name);
    return MN_OK;
}

static const char *shape_str(const mn_tensor *t, char *buf)
{
    return mn_shape_string(t, buf, 128);
}

/* A copy of src as a contiguous f32 tensor on dev, broadcast to shape. The
 * broadcast and the dtype conversion happen on dev (copy_into moves the
 * unexpanded source there first), so a per-token gate or a CPU k never goes
 * through a full-size host copy on its way to the GPU. */
static mn_status materialize(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape,
                             mn_device dev)
{
    MN_TRY(mn_tensor_empty(out, MN_F32, ndim, shape, dev));
    mn_status st = mn_tensor_copy_into(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

/* src as a new contiguous CPU tensor of dtype dt (lengths: i64). */
static mn_status materialize_as(mn_tensor *out, const mn_tensor *src, mn_dtype dt, int ndim, const int64_t *shape)
{
    MN_TRY(mn_tensor_empty(out, dt, ndim, shape, MN_CPU));
    mn_status st = mn_tensor_copy_into(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

/* lengths (a CPU tensor, mn_lengths_check) as the backends read them: i64
 * [B] on dev. Made on the CPU and uploaded in one copy, straight into the
 * device tensor, so that no device-side copy on another stream follows the
 * upload (kernels/engine_cuda.c waits for it before its launch). */
static mn_status lengths_view(mn_tensor *out, const mn_tensor *src, int64_t B, mn_device dev)
{
    if (dev == MN_CPU) return materialize_as(out, src, MN_I64, 1, &B);
    mn_tensor host = {0};
    MN_TRY(materialize_as(&host, src, MN_I64, 1, &B));
    mn_status st = mn_tensor_to_device(out, &host, dev);
    mn_tensor_release(&host);
    return st;
}

/* A segment input as the engines read it (they never write their inputs):
 * src itself when it already is a contiguous f32 tensor of the full shape
 * on dev, which for resident k and v saves two passes over them; else a
 * materialized copy. Never for parameters, which the engines update. */
static mn_status input_view(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape, mn_device dev)
{
    bool same = src->storage && src->storage->device == dev && src->dtype == MN_F32 && src->ndim == ndim &&
                mn_tensor_is_contiguous(src);
    for (int i = 0; same && i < ndim; i++) same = src->shape[i] == shape[i];
    if (!same) return materialize(out, src, ndim, shape, dev);
    mn_tensor_share(out, src);
    return MN_OK;
}

/* A key or query input: as input_view, but with qk_norm a normalised copy
 * on dev, so every backend (and every CUDA path) sees the keys the rule uses. */
static mn_status key_view(mn_tensor *out, const mn_tensor *src, const int64_t *shape, mn_device dev, const mn_rule *r)
{
    mn_rownorm nm = mn_rule_qk_norm(r);
    if (!nm.on) return input_view(out, src, 4, shape, dev);
    mn_tensor full = {0};
    MN_TRY(input_view(&full, src, 4, shape, dev));
    mn_status st = mn_rownorm_tensor(nm, &full, out);
    mn_tensor_release(&full);
    return st;
}

/* Initial parameter or momentum i: [...], [H,...] or [B,H,...]. */
static mn_status check_param_shape(const mn_tensor *given, const char *name, const mn_dims *d, int pdim,
                                   const int64_t *pshape)
{
    char buf[128], want[128];
    int g = given->ndim;
    bool fits = g == pdim || g == pdim + 1 || g == pdim + 2;
    if (fits) {
        int lead = g - pdim;
        for (int i = 0; i < pdim && fits; i++) fits = given->shape[lead + i] == pshape[i];
        if (lead >= 1 && given->shape[0] != (lead == 1 ? d->H : d->B)) fits = false;
        if (lead == 2 && given->shape[1] != d->H) fits = false;
    }
    if (!fits) {
        mn_tensor tmp = {0};
        tmp.ndim = pdim;
        memcpy(tmp.shape, pshape, sizeof(int64_t) * pdim);
        return mn_fail(MN_ERR_ARG, "initial %s has shape %s; expected %s, Hx%s or BxHx%s (B=%lld, H=%lld)",
                       name, shape_str(given, buf), shape_str(&tmp, want), want, want,
                       (long long)d->B, (long long)d->H);
    }
    return MN_OK;
}

/* Such a tensor into out, a place made for it (the state's block) where out
 * has storage, else a new tensor. */
static mn_status broadcast_param(mn_tensor *out, const mn_tensor *given, const char *name,
                                 const mn_dims *d, int pdim, const int64_t *pshape, mn_device dev)
{
    MN_TRY(check_param_shape(given, name, d, pdim, pshape));
    if (out->storage) return mn_tensor_copy_into(out, given);
    int64_t full[MN_MAX_DIMS] = {d->B, d->H};
    memcpy(full + 2, pshape, sizeof(int64_t) * pdim);
    return materialize(out, given, pdim + 2, full, dev);
}

/* Copies gathered for one launch (the backend's tile_many), where the
 * device has it: a run's several small copies and fills each cost a driver
 * call of microseconds, in rule:run's wall time. */
typedef struct copy_batch {
    const mn_backend *be; /* NULL: each at once */
    int n;
    mn_tensor *dst[MN_TILE_MANY];
    const mn_tensor *src[MN_TILE_MANY];
} copy_batch;

static void batch_init(copy_batch *c, mn_device dev)
{
    memset(c, 0, sizeof *c);
    const mn_backend *be = mn_backend_for(dev);
    c->be = be && be->tile_many ? be : NULL;
}

static mn_status batch_run(copy_batch *c)
{
    if (c->n == 0) return MN_OK;
    mn_status s = c->be->tile_many(c->n, c->dst, c->src);
    c->n = 0;
    return s;
}

/* The state's initial tensor given into its place: a given already on the
 * device, contiguous and f32, joins the batch (a [B,H,...] tensor's layout
 * is its place's, and an [H,...] or [...] one repeats every H or B x H
 * memories: element e of the place is element e % numel of the given);
 * anything else is copied at once. */
static mn_status state_copy(copy_batch *c, mn_tensor *place, const mn_tensor *given, const char *name,
                            const mn_dims *d, int pdim, const int64_t *pshape)
{
    MN_TRY(check_param_shape(given, name, d, pdim, pshape));
    if (!c->be || c->n == MN_TILE_MANY || given->storage->device != place->storage->device ||
        given->dtype != MN_F32 || !mn_tensor_is_contiguous(given))
        return mn_tensor_copy_into(place, given);
    c->dst[c->n] = place;
    c->src[c->n++] = given;
    return MN_OK;
}

/* A gate as the engines read it (input_view), where one given as a single
 * f32 value (a number: a CPU scalar; or a scalar already on the device, as
 * a resident experiment's) becomes a fill in the batch on a device. */
static mn_status gate_view(copy_batch *c, mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape,
                           mn_device dev)
{
    const bool one_value = src->storage && (src->storage->device == MN_CPU || src->storage->device == dev) &&
                           src->dtype == MN_F32 && mn_tensor_numel(src) == 1;
    if (!c->be || c->n == MN_TILE_MANY || !one_value || dev == MN_CPU) return input_view(out, src, ndim, shape, dev);
    MN_TRY(mn_tensor_empty(out, MN_F32, ndim, shape, dev));
    c->dst[c->n] = out;
    c->src[c->n++] = src;
    return MN_OK;
}

/* The memory state's tensors, W, then the anchors, then the momenta, each
 * parameter at a multiple of 64 floats (256 bytes, as cudaMalloc aligns: the
 * kernels' vector loads need 16), in one storage: one allocation, the
 * parameters written in, the anchors copied from them in one copy, and
 * zeros in one fill a run of what nothing writes (the momenta and biases
 * not given, and the gaps, so that no copy reads unset memory), where per
 * tensor it was three allocations and three copies or fills (P2's rule:run
 * spent about 90 us here on an H100). A caller who keeps only W keeps the
 * block alive, as a view of any tensor does.
 *
 * Where refresh = step, every step opens a refresh block and sets its
 * anchor to W before anything reads it: the anchor is W itself there (the
 * same view), and the block has no anchors' region. On M1 (512 memories of
 * 16.6 k floats) the zeros over the whole block and the anchors' copy were
 * about 50 us of GPU work queued before the step kernel. */
#define MN_STATE_ALIGN 64

/* Zeros over floats [from, to) of block: one fill (a memset on the GPU). */
static mn_status zero_range(const mn_tensor *block, int64_t from, int64_t to)
{
    if (from >= to) return MN_OK;
    mn_tensor run = {0};
    MN_TRY(mn_view_slice(&run, block, 0, from, to, 1));
    mn_status s = mn_tensor_fill(&run, 0.0);
    mn_tensor_release(&run);
    return s;
}

/* sets_n x n tensors of the shapes full[i] (ndim[i] dims) as views of one
 * block in that order (sets[k][i]), each at a multiple of MN_STATE_ALIGN
 * floats. Where written[k][i], the caller writes tensor i of set k in full
 * next; everything else (the other tensors, every gap) is made zero, each
 * run of them in one fill. */
static mn_status state_block(int n, int sets_n, const int64_t (*full)[4], const int *ndim, mn_tensor *const *sets,
                             const bool (*written)[MN_MAX_PARAMS], mn_device dev)
{
    int64_t off[MN_MAX_PARAMS + 1] = {0}, numel[MN_MAX_PARAMS];
    for (int i = 0; i < n; i++) {
        numel[i] = 1;
        for (int j = 0; j < ndim[i]; j++) numel[i] *= full[i][j];
        off[i + 1] = off[i] + (numel[i] + MN_STATE_ALIGN - 1) / MN_STATE_ALIGN * MN_STATE_ALIGN;
    }
    const int64_t span = off[n], total = sets_n * span;
    mn_tensor block = {0};
    MN_TRY(mn_tensor_empty(&block, MN_F32, 1, &total, dev));
    mn_status s = MN_OK;
    int64_t z0 = 0, z1 = 0; /* the run of zeros being gathered */
    for (int k = 0; k < sets_n && s == MN_OK; k++)
        for (int i = 0; i < n && s == MN_OK; i++) {
            mn_tensor flat = {0};
            const int64_t at = k * span + off[i], end = k * span + off[i + 1];
            s = mn_view_slice(&flat, &block, 0, at, at + numel[i], 1);
            if (s == MN_OK) s = mn_view_reshape(&sets[k][i], &flat, ndim[i], full[i]);
            mn_tensor_release(&flat);
            const int64_t from = written[k][i] ? at + numel[i] : at; /* a written tensor's gap only */
            if (s != MN_OK || from == end) continue;
            if (from != z1) {
                s = zero_range(&block, z0, z1);
                z0 = from;
            }
            z1 = end;
        }
    if (s == MN_OK) s = zero_range(&block, z0, z1);
    mn_tensor_release(&block);
    return s;
}

/* Each parameter's full shape [B, H, ...] (ndim[i] dims), for the blocks above. */
static void param_full_shapes(const mn_rule *rule, const mn_dims *dims, int np, int64_t (*full)[4], int *ndim)
{
    for (int i = 0; i < np; i++) {
        full[i][0] = dims->B;
        full[i][1] = dims->H;
        ndim[i] = mn_rule_param_shape(rule, dims, i, full[i] + 2) + 2;
    }
}

/* The anchors' region of the block from the parameters' (mn_memory_create's
 * layout: W, then the anchors in the same order; the gaps' zeros with them):
 * one copy. */
static mn_status anchors_from_params(mn_memory_state *st)
{
    const mn_tensor *w0 = &st->params[0], *wl = &st->params[st->nparams - 1];
    const int64_t used = wl->offset - w0->offset + mn_tensor_numel(wl);
    mn_tensor from = {0}, to = {0};
    mn_tensor_share(&from, w0);
    mn_tensor_share(&to, &st->anchor[0]);
    from.ndim = to.ndim = 1;
    from.shape[0] = to.shape[0] = used;
    from.stride[0] = to.stride[0] = 1;
    mn_status s = mn_tensor_copy_into(&to, &from);
    mn_tensor_release(&from);
    mn_tensor_release(&to);
    return s;
}

mn_status mn_memory_create(mn_memory_state *st, const mn_rule *rule, const mn_dims *dims,
                           const mn_tensor *init_params, const mn_tensor *init_momenta,
                           mn_device dev)
{
    memset(st, 0, sizeof *st);
    MN_TRY(mn_rule_validate(rule));
    MN_TRY(mn_rule_device_check(rule, dev));
    if (rule->residual && dims->dk != dims->dv)
        return mn_fail(MN_ERR_ARG, "residual needs dk = dv, got dk=%lld, dv=%lld",
                       (long long)dims->dk, (long long)dims->dv);
    MN_TRY(mn_rule_copy(&st->rule, rule));
    st->dims = *dims;
    st->device = dev;
    st->nparams = mn_rule_param_count(rule);
    int64_t full[MN_MAX_PARAMS][4] = {{0}};
    int ndim[MN_MAX_PARAMS] = {0};
    param_full_shapes(rule, dims, st->nparams, full, ndim);
    /* which tensors come written: the parameters given, the anchors (copied
     * from W below), the momenta given; the rest of the block is zeros */
    const bool own_anchor = mn_rule_refresh(rule) != rule->step;
    mn_tensor *const sets[3] = {st->params, own_anchor ? st->anchor : st->momenta, st->momenta};
    const int sets_n = own_anchor ? 3 : 2; /* anchors_from_params reads this order */
    bool written[3][MN_MAX_PARAMS] = {{false}};
    for (int i = 0; i < st->nparams; i++) {
        written[0][i] = init_params && init_params[i].storage;
        written[1][i] = own_anchor || (init_momenta && init_momenta[i].storage);
        written[2][i] = init_momenta && init_momenta[i].storage;
    }
    mn_status s = state_block(st->nparams, sets_n, (const int64_t(*)[4])full, ndim, sets,
                              (const bool(*)[MN_MAX_PARAMS])written, dev);
    copy_batch copies;
    batch_init(&copies, dev);
    for (int i = 0; i < st->nparams && s == MN_OK; i++) {
        char name[16], sname[20];
        const int pdim = ndim[i] - 2;
        const int64_t *pshape = full[i] + 2;
        int layer;
        bool is_bias;
        mn_rule_param_role(rule, i, &layer, &is_bias);
        mn_rule_param_name(rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        const mn_tensor *p = init_params ? &init_params[i] : NULL;
        if (p && p->storage) s = state_copy(&copies, &st->params[i], p, name, dims, pdim, pshape);
        else if (!is_bias) s = mn_fail(MN_ERR_ARG, "initial weight %s is missing", name);
        /* biases not given stay the block's zeros, as momenta not given do */
        const mn_tensor *m = init_momenta ? &init_momenta[i] : NULL;
        if (s == MN_OK && m && m->storage) s = state_copy(&copies, &st->momenta[i], m, sname, dims, pdim, pshape);
        if (s == MN_OK && !own_anchor) mn_tensor_share(&st->anchor[i], &st->params[i]);
    }
    if (s == MN_OK) s = batch_run(&copies);
    if (s == MN_OK && st->nparams > 0 && own_anchor) s = anchors_from_params(st);
    if (s == MN_OK) s = mn_memory_set_outer(st, NULL);
    if (s != MN_OK) mn_memory_free(st);
    return s;
}

mn_status mn_rule_device_check(const mn_rule *rule, mn_device dev)
{
    if (dev == MN_CPU) return MN_OK;
    for (int f = 0; f < mn_rule_field_count; f++) {
        const mn_field *fd = &mn_rule_fields[f];
        if (fd->type != MN_FIELD_CHOICE) continue;
        const mn_part *part = mn_rule_part(rule, fd->set, (int)mn_rule_field_get(rule, f));
        if (part && (part->flags & MN_PART_CPU_ONLY))
            return mn_fail(MN_ERR_UNSUPPORTED, "%s '%s' is run by the cpu engine only in this version: use device cpu",
                           fd->name, part->name);
    }
    return MN_OK;
}

mn_status mn_memory_set_outer(mn_memory_state *st, const mn_tensor *outer)
{
    const mn_dims *d = &st->dims;
    int count = mn_rule_outer_count(&st->rule);
    for (int j = 0; j < MN_OUTER_COUNT; j++) {
        const mn_tensor *given = outer && outer[j].storage ? &outer[j] : NULL;
        if (j >= count) {
            if (given)
                return mn_fail(MN_ERR_ARG, "initial %s is given but the rule has out_norm none", mn_outer_name(j));
            continue;
        }
        mn_tensor t = {0};
        int64_t full[3] = {d->B, d->H, d->dv};
        mn_status s;
        if (given) s = broadcast_param(&t, given, mn_outer_name(j), d, 1, &d->dv, st->device);
        else {
            s = mn_tensor_empty(&t, MN_F32, 3, full, st->device);
            if (s == MN_OK) s = mn_tensor_fill(&t, mn_outer_default(j));
        }
        if (s != MN_OK) return s;
        mn_tensor_release(&st->outer[j]);
        st->outer[j] = t;
    }
    return MN_OK;
}

void mn_memory_free(mn_memory_state *st)
{
    /* the slots that hold storage (the memset below clears the rest) */
    mn_tensor_release_held(st->params, MN_MAX_PARAMS);
    mn_tensor_release_held(st->momenta, MN_MAX_PARAMS);
    mn_tensor_release_held(st->anchor, MN_MAX_PARAMS);
    mn_tensor_release_held(st->outer, MN_OUTER_COUNT);
    mn_rule_free(&st->rule);
    memset(st, 0, sizeof *st);
}

static mn_status check_gate(const char *name, const mn_tensor *g, const int64_t *shape, const char *dims_name)
{
    if (!g->storage) return MN_OK;
    int nd;
    int64_t out[MN_MAX_DIMS];
    char buf[128];
    if (g->ndim > 3 || mn_broadcast_shapes(g->ndim, g->shape, 3, shape, &nd, out) != MN_OK || nd != 3 ||
        out[0] != shape[0] || out[1] != shape[1] || out[2] != shape[2])
        return mn_fail(MN_ERR_ARG, "gate %s of shape %s does not broadcast to %s = %lldx%lldx%lld", name,
                       shape_str(g, buf), dims_name, (long long)shape[0], (long long)shape[1],
                       (long long)shape[2]);
    return MN_OK;
}

mn_status mn_lengths_check(const mn_tensor *lengths, int64_t B, int64_t T)
{
    char buf[128];
    if (lengths->storage->device != MN_CPU)
        return mn_fail(MN_ERR_ARG, "lengths must be a cpu tensor (it is on %s)", mn_device_name(lengths->storage->device));
    if (lengths->ndim != 1 || lengths->shape[0] != B)
        return mn_fail(MN_ERR_ARG, "lengths has shape [%s]; expected [B] = [%lld], one length per sequence",
                       shape_str(lengths, buf), (long long)B);
    for (int64_t b = 0; b < B; b++) {
        double x = mn_tensor_get(lengths, &b);
        if (!(x >= 0 && x <= (double)T && x == floor(x)))
            return mn_fail(MN_ERR_ARG, "lengths: sequence %lld of %lld has length %g; each must be an integer from 0 to T = %lld",
                           (long long)b + 1, (long long)B, x, (long long)T);
    }
    return MN_OK;
}

mn_status mn_segment_check(const mn_memory_state *st, const mn_segment_inputs *in, int64_t *ntokens,
                           int64_t *nsteps)
{
    const mn_dims *d = &st->dims;
    char buf[128];
    if (!in->k.storage || in->k.ndim != 4)
        return mn_fail(MN_ERR_ARG, "k must be a 4-d tensor [B,H,T,dk], got %s",
                       in->k.storage ? shape_str(&in->k, buf) : "nothing");
    int64_t n = in->k.shape[2];
    if (in->k.shape[0] != d->B || in->k.shape[1] != d->H || in->k.shape[3] != d->dk)
        return mn_fail(MN_ERR_ARG, "k has shape %s; the memory expects %lldx%lldxTx%lld [B,H,T,dk]",
                       shape_str(&in->k, buf), (long long)d->B, (long long)d->H, (long long)d->dk);
    if (!in->v.storage || in->v.ndim != 4 || in->v.shape[0] != d->B || in->v.shape[1] != d->H ||
        in->v.shape[2] != n || in->v.shape[3] != d->dv)
        return mn_fail(MN_ERR_ARG, "v has shape %s; expected %lldx%lldx%lldx%lld [B,H,T,dv]",
                       in->v.storage ? shape_str(&in->v, buf) : "nothing", (long long)d->B,
                       (long long)d->H, (long long)n, (long long)d->dv);
    if (in->q.storage && (in->q.ndim != 4 || in->q.shape[0] != d->B || in->q.shape[1] != d->H ||
                          in->q.shape[2] != n || in->q.shape[3] != d->dk))
        return mn_fail(MN_ERR_ARG, "q has shape %s; expected %lldx%lldx%lldx%lld [B,H,T,dk]",
                       shape_str(&in->q, buf), (long long)d->B, (long long)d->H, (long long)n,
                       (long long)d->dk);
    int64_t c = st->rule.step;
    int64_t S = (n + c - 1) / c;
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    if (!in->theta.storage) return mn_fail(MN_ERR_ARG, "gate theta is missing");
    MN_TRY(check_gate("theta", &in->theta, tshape, "[B,H,T]"));
    MN_TRY(check_gate("eta", &in->eta, sshape, "[B,H,S]"));
    MN_TRY(check_gate("alpha", &in->alpha, sshape, "[B,H,S]"));
    if (in->lengths.storage) MN_TRY(mn_lengths_check(&in->lengths, d->B, n));
    *ntokens = n;
    *nsteps = S;
    return MN_OK;
}

#define OUTPUT_ROW(name, group, shape) {#name, #group},
const mn_output_row mn_segment_output_rows[] = {MN_SEGMENT_OUTPUTS(OUTPUT_ROW)};
#undef OUTPUT_ROW
const int mn_segment_output_count = (int)(sizeof mn_segment_output_rows / sizeof *mn_segment_output_rows);

mn_tensor *mn_segment_output(mn_segment_outputs *out, int i)
{
    mn_tensor *members[] = {
#define OUTPUT_MEMBER(name, group, shape) &out->name,
        MN_SEGMENT_OUTPUTS(OUTPUT_MEMBER)
#undef OUTPUT_MEMBER
    };
    return (i >= 0 && i < mn_segment_output_count) ? members[i] : NULL;
}

void mn_segment_outputs_free(mn_segment_outputs *out)
{
    for (int i = 0; i < mn_segment_output_count; i++) mn_tensor_release(mn_segment_output(out, i));
}

mn_status mn_segment_run(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out)
{
    memset(out, 0, sizeof *out);
    int64_t n, S;
    MN_TRY(mn_segment_check(st, in, &n, &S));
    const mn_engine_backend *eng = engine_for(st->device);
    if (!eng) return MN_ERR_DEVICE;
    if (st->device == MN_CPU && st->precision != MN_PREC_FP32)
        return mn_fail(MN_ERR_UNSUPPORTED, "precision %s: the cpu engine computes in fp32 only",
                       mn_precision_name(st->precision));
    const mn_dims *d = &st->dims;
    mn_device dev = st->device;

    /* The backend sees contiguous f32 inputs with gates already broadcast. */
    mn_segment_inputs mat;
    int64_t vshape[4] = {d->B, d->H, n, d->dv};
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    mn_status s = mn_segment_inputs_materialize(st, in, n, S, &mat);
    /* Every output row at its shape (MN_SEGMENT_OUTPUTS); y only when wanted. */
#define ALLOC_TOKEN_DV(t) (in->want_y ? mn_tensor_empty((t), MN_F32, 4, vshape, dev) : MN_OK)
#define ALLOC_TOKEN(t) mn_tensor_empty((t), MN_F32, 3, tshape, dev)
#define ALLOC_STEP(t) mn_tensor_empty((t), MN_F32, 3, sshape, dev)
#define ALLOC_OUTPUT(name, group, shape) if (s == MN_OK) s = ALLOC_##shape(&out->name);
    MN_SEGMENT_OUTPUTS(ALLOC_OUTPUT)
#undef ALLOC_OUTPUT
#undef ALLOC_TOKEN_DV
#undef ALLOC_TOKEN
#undef ALLOC_STEP
    if (s == MN_OK) s = eng->segment_run(st, &mat, out, n, S);
    mn_segment_inputs_release(&mat);
    if (s != MN_OK) mn_segment_outputs_free(out);
    return s;
}

void mn_segment_inputs_release(mn_segment_inputs *mat)
{
    mn_tensor_release(&mat->k);
    mn_tensor_release(&mat->v);
    mn_tensor_release(&mat->q);
    mn_tensor_release(&mat->theta);
    mn_tensor_release(&mat->eta);
    mn_tensor_release(&mat->alpha);
    mn_tensor_release(&mat->lengths);
}

mn_status mn_segment_inputs_materialize(const mn_memory_state *st, const mn_segment_inputs *in, int64_t n, int64_t S,
                                        mn_segment_inputs *out)
{
    const mn_dims *d = &st->dims;
    mn_device dev = st->device;
    mn_segment_inputs mat = {0};
    mat.want_y = in->want_y;
    int64_t kshape[4] = {d->B, d->H, n, d->dk}, vshape[4] = {d->B, d->H, n, d->dv};
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    mn_status s = key_view(&mat.k, &in->k, kshape, dev, &st->rule);
    if (s == MN_OK) s = input_view(&mat.v, &in->v, 4, vshape, dev);
    if (s == MN_OK && in->q.storage) s = key_view(&mat.q, &in->q, kshape, dev, &st->rule);
    copy_batch fills;
    batch_init(&fills, dev);
    if (s == MN_OK) s = gate_view(&fills, &mat.theta, &in->theta, 3, tshape, dev);
    if (s == MN_OK) {
        if (in->eta.storage) s = gate_view(&fills, &mat.eta, &in->eta, 3, sshape, dev);
        else s = mn_tensor_zeros(&mat.eta, MN_F32, 3, sshape, dev);
    }
    if (s == MN_OK) {
        if (in->alpha.storage) s = gate_view(&fills, &mat.alpha, &in->alpha, 3, sshape, dev);
        else s = mn_tensor_zeros(&mat.alpha, MN_F32, 3, sshape, dev);
    }
    if (s == MN_OK) s = batch_run(&fills);
    if (s == MN_OK && in->lengths.storage) s = lengths_view(&mat.lengths, &in->lengths, d->B, dev);
    if (s != MN_OK) mn_segment_inputs_release(&mat);
    *out = mat;
    return s;
}

mn_status mn_memory_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y)
{
    const mn_dims *d = &st->dims;
    char buf[128];
    if (q->ndim != 4 || q->shape[0] != d->B || q->shape[1] != d->H || q->shape[3] != d->dk)
        return mn_fail(MN_ERR_ARG, "q has shape %s; the memory expects %lldx%lldxTx%lld [B,H,T,dk]",
                       shape_str(q, buf), (long long)d->B, (long long)d->H, (long long)d->dk);
    const mn_engine_backend *eng = engine_for(st->device);
    if (!eng) return MN_ERR_DEVICE;
    mn_tensor mat = {0};
    int64_t qshape[4] = {d->B, d->H, q->shape[2], d->dk};
    MN_TRY(key_view(&mat, q, qshape, st->device, &st->rule));
    int64_t yshape[4] = {d->B, d->H, q->shape[2], d->dv};
    mn_status s = mn_tensor_empty(y, MN_F32, 4, yshape, st->device);
    if (s == MN_OK) s = eng->read(st, &mat, y);
    if (s != MN_OK) mn_tensor_release(y);
    mn_tensor_release(&mat);
    return s;
}

mn_status mn_init_params(const mn_rule *rule, const mn_dims *dims, const char *scheme, uint64_t seed,
                         bool shared_across_memories, mn_tensor *params, mn_device dev)
{
    enum { NORMAL, XAVIER, ZEROS } kind;
    if (strcmp(scheme, "normal") == 0) kind = NORMAL;
    else if (strcmp(scheme, "xavier") == 0) kind = XAVIER;
    else if (strcmp(scheme, "zeros") == 0) kind = ZEROS;
    else return mn_fail(MN_ERR_ARG, "unknown init '%s' (one of: normal, xavier, zeros)", scheme);
    const mn_backend *be = dev == MN_CPU ? NULL : mn_backend_for(dev);
    if (dev != MN_CPU && !be) return MN_ERR_UNSUPPORTED; /* mn_backend_for said why */
    int np = mn_rule_param_count(rule);
    /* every parameter a view of one block (as the memory state's, above):
     * one allocation; the weights drawn below are written in full, the
     * biases (and every tensor under zeros) are the block's zeros */
    int64_t full[MN_MAX_PARAMS][4] = {{0}};
    int ndim[MN_MAX_PARAMS] = {0};
    param_full_shapes(rule, dims, np, full, ndim);
    mn_tensor *const sets[1] = {params};
    bool drawn[1][MN_MAX_PARAMS] = {{false}};
    for (int i = 0; i < np; i++) {
        int layer;
        bool is_bias;
        mn_rule_param_role(rule, i, &layer, &is_bias);
        drawn[0][i] = !is_bias && kind != ZEROS;
    }
    mn_status s = state_block(np, 1, (const int64_t(*)[4])full, ndim, sets, (const bool(*)[MN_MAX_PARAMS])drawn, dev);
    for (int i = 0; i < np && s == MN_OK; i++) {
        const int pdim = ndim[i] - 2;
        const int64_t *pshape = full[i] + 2;
        int layer;
        bool is_bias;
        mn_rule_param_role(rule, i, &layer, &is_bias);
        if (is_bias || kind == ZEROS) continue;
        int64_t per = pdim == 2 ? pshape[0] * pshape[1] : pshape[0];
        int rk = kind == NORMAL ? MN_RC_NORMAL : MN_RC_UNIFORM;
        double scale = kind == NORMAL ? 0.02 : sqrt(6.0 / (double)(pshape[0] + pshape[1]));
        int64_t period = shared_across_memories ? per : 0;
        if (be && be->init_fill) {
            s = be->init_fill(&params[i], rk, scale, seed, (uint64_t)i, period);
            continue;
        }
        /* drawn on the host: in place on the CPU, else uploaded into the view */
        mn_tensor host = {0};
        if (dev == MN_CPU) mn_tensor_share(&host, &params[i]);
        else s = mn_tensor_empty(&host, MN_F32, ndim[i], full[i], MN_CPU);
        if (s == MN_OK) {
            float *data = mn_tensor_data(&host);
            int64_t n = mn_tensor_numel(&host);
#pragma omp parallel for schedule(static) if (n > 65536)
            for (int64_t e = 0; e < n; e++)
                data[e] = mn_rc_init_value(rk, scale, seed, (uint64_t)i, (uint64_t)(period > 0 ? e % period : e));
        }
        if (s == MN_OK && dev != MN_CPU) s = mn_tensor_copy_into(&params[i], &host);
        mn_tensor_release(&host);
    }
    if (s != MN_OK)
        for (int j = 0; j < np; j++) mn_tensor_release(&params[j]);
    return s;
}
