/* grad_forward.c: a forward run that keeps the backward's checkpoints. The
 * engine runs the sequence as segments of K steps (a sequence fed in pieces
 * that are multiples of the step equals one run, engine.h), and the memory
 * state (W, S, anchor) is copied before each segment: that is exactly the
 * checkpoint pass of the backward (grad_cpu.c), which then has nothing to
 * recompute but the blocks. */
#include "grad.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int64_t mn_grad_block_steps(int64_t nsteps, int64_t block_steps)
{
    int64_t K = block_steps > 0 ? block_steps : (int64_t)ceil(sqrt((double)(nsteps > 0 ? nsteps : 1)));
    if (nsteps > 0 && K > nsteps) K = nsteps;
    return K;
}

int mn_grad_checkpoint_parts(const mn_rule *rule)
{
    return mn_rule_refresh(rule) == rule->step ? 2 : 3;
}

void mn_run_checkpoints_free(mn_run_checkpoints *ck)
{
    free(ck->data);
    memset(ck, 0, sizeof *ck);
}

/* Copy the state of every memory into checkpoint b: [b][memory][W, S(, A)]. */
static void save_state(const mn_memory_state *st, mn_run_checkpoints *ck, int64_t b)
{
    int64_t memories = ck->memories, P = ck->P;
    for (int64_t m = 0; m < memories; m++) {
        float *dst = ck->data + (b * memories + m) * ck->parts * P;
        const mn_tensor *src[3] = {st->params, st->momenta, st->anchor};
        for (int part = 0; part < ck->parts; part++)
            for (int p = 0; p < st->nparams; p++) {
                int64_t ne = mn_tensor_numel(&src[part][p]) / memories;
                memcpy(dst, (const float *)mn_tensor_data(&src[part][p]) + m * ne, sizeof(float) * ne);
                dst += ne;
            }
    }
}

/* A view of t's dim 2 from start to stop, t expanded to full first (gates
 * broadcast); empty stays empty. */
static mn_status slice_t(mn_tensor *out, const mn_tensor *t, int ndim, const int64_t *full, int64_t start,
                         int64_t stop)
{
    if (!t->storage) return MN_OK;
    mn_tensor e = {0};
    MN_TRY(mn_view_expand(&e, t, ndim, full));
    mn_status s = mn_view_slice(out, &e, 2, start, stop, 1);
    mn_tensor_release(&e);
    return s;
}

/* lengths counted from the start of the segment [t0, t1): the engine's
 * lengths are relative to the segment it runs (engine.h). */
static mn_status segment_lengths(mn_tensor *out, const mn_tensor *lengths, int64_t B, int64_t t0, int64_t t1)
{
    MN_TRY(mn_tensor_empty(out, MN_I64, 1, &B, MN_CPU));
    int64_t *o = mn_tensor_data(out);
    for (int64_t b = 0; b < B; b++) {
        double len = mn_tensor_get(lengths, &b) - (double)t0;
        o[b] = len < 0 ? 0 : len > (double)(t1 - t0) ? t1 - t0 : (int64_t)len;
    }
    return MN_OK;
}

mn_status mn_run_forward_checkpointed(mn_memory_state *st, const mn_segment_inputs *in, int64_t block_steps,
                                      mn_segment_outputs *out, mn_run_checkpoints *ck)
{
    memset(out, 0, sizeof *out);
    memset(ck, 0, sizeof *ck);
    if (st->device != MN_CPU || st->steps_done != 0)
        return mn_fail(MN_ERR_UNSUPPORTED, "checkpointed forward: a cpu memory at its initial state only");
    int64_t n, S;
    MN_TRY(mn_segment_check(st, in, &n, &S));
    const mn_dims *d = &st->dims;
    int64_t c = st->rule.step, memories = d->B * d->H;
    ck->K = mn_grad_block_steps(S, block_steps);
    ck->nblocks = S > 0 ? (S + ck->K - 1) / ck->K : 0;
    ck->memories = memories;
    ck->parts = mn_grad_checkpoint_parts(&st->rule);
    for (int p = 0; p < st->nparams; p++) ck->P += mn_tensor_numel(&st->params[p]) / memories;
    if (ck->nblocks == 0) return mn_segment_run(st, in, out);
    ck->data = mn_malloc(sizeof(float) * (size_t)(ck->nblocks * memories * ck->parts * ck->P), "the backward's checkpoints");
    if (!ck->data) return MN_ERR_OOM;

    int64_t kshape[4] = {d->B, d->H, n, d->dk}, vshape[4] = {d->B, d->H, n, d->dv};
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    mn_segment_outputs *parts = calloc((size_t)ck->nblocks, sizeof *parts);
    mn_status s = parts ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory for the forward's segments");
    for (int64_t b = 0; b < ck->nblocks && s == MN_OK; b++) {
        save_state(st, ck, b);
        int64_t s0 = b * ck->K, s1 = s0 + ck->K < S ? s0 + ck->K : S;
        int64_t t0 = s0 * c, t1 = s1 * c < n ? s1 * c : n;
        mn_segment_inputs seg = {0};
        seg.want_y = in->want_y;
        s = slice_t(&seg.k, &in->k, 4, kshape, t0, t1);
        if (s == MN_OK) s = slice_t(&seg.v, &in->v, 4, vshape, t0, t1);
        if (s == MN_OK) s = slice_t(&seg.q, &in->q, 4, kshape, t0, t1);
        if (s == MN_OK) s = slice_t(&seg.theta, &in->theta, 3, tshape, t0, t1);
        if (s == MN_OK) s = slice_t(&seg.eta, &in->eta, 3, sshape, s0, s1);
        if (s == MN_OK) s = slice_t(&seg.alpha, &in->alpha, 3, sshape, s0, s1);
        if (s == MN_OK && in->lengths.storage) s = segment_lengths(&seg.lengths, &in->lengths, d->B, t0, t1);
        if (s == MN_OK) s = mn_segment_run(st, &seg, &parts[b]);
        mn_tensor *views[] = {&seg.k, &seg.v, &seg.q, &seg.theta, &seg.eta, &seg.alpha, &seg.lengths};
        for (size_t i = 0; i < sizeof views / sizeof *views; i++) mn_tensor_release(views[i]);
    }
    /* the outputs of the segments, joined along T (or S) */
    size_t offsets[] = {offsetof(mn_segment_outputs, y),          offsetof(mn_segment_outputs, loss),
                        offsetof(mn_segment_outputs, grad_norm),  offsetof(mn_segment_outputs, clip_scale),
                        offsetof(mn_segment_outputs, skipped),    offsetof(mn_segment_outputs, step_loss),
                        offsetof(mn_segment_outputs, weight_norm)};
    const mn_tensor **ptrs = s == MN_OK ? malloc(sizeof *ptrs * (size_t)ck->nblocks) : NULL;
    if (s == MN_OK && !ptrs) s = mn_fail(MN_ERR_OOM, "out of memory joining the forward's segments");
    for (size_t o = 0; o < sizeof offsets / sizeof *offsets && s == MN_OK; o++) {
        if (!((mn_tensor *)((char *)&parts[0] + offsets[o]))->storage) continue; /* y when not wanted */
        for (int64_t b = 0; b < ck->nblocks; b++) ptrs[b] = (const mn_tensor *)((const char *)&parts[b] + offsets[o]);
        s = mn_tensor_cat((mn_tensor *)((char *)out + offsets[o]), ptrs, (int)ck->nblocks, 2);
    }
    free(ptrs);
    for (int64_t b = 0; parts && b < ck->nblocks; b++) mn_segment_outputs_free(&parts[b]);
    free(parts);
    if (s != MN_OK) {
        mn_segment_outputs_free(out);
        mn_run_checkpoints_free(ck);
    }
    return s;
}
