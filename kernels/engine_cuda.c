/* engine_cuda.c: the rule engine on the GPU (mn_engine_backend for MN_CUDA).
 * A segment is one launch of the generated step kernel (kernels/codegen.c,
 * kernels/rule_kernel.cuh): one thread block per memory walks every step,
 * with the state's W, S and anchor tensors in place and a workspace
 * allocated for the segment. Loaded modules stay in memory by cache key, so
 * a rule compiles (or loads from the disk cache) once per process.
 * Inspection (kernels/kernel_info.h): the driver's attributes and the
 * occupancy of a rule's loaded kernels, and, when profiling is on, each
 * launch timed with CUDA events. */
#include "cuda_check.h"
#include "codegen.h"
#include "kernel_info.h"
#include "cuda_module.h"
#include "module_memo.h"
#include "nvrtc.h"
#include "plan.h"
#include "engine_large.h"
#include "rule_kernel.cuh" /* its first part is C: the argument struct and the workspace layout */
#include "../model/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- modules: the kernels of a path, in this order ---- */

static const char *const general_kernels[] = {MN_RULE_STEP_KERNEL, MN_RULE_READ_KERNEL, NULL};
static const char *const fused_kernels[] = {MN_FUSED_STEP_KERNEL, NULL};
enum { K_STEP = 0, K_READ = 1 }; /* the fused module's K_STEP is its step kernel */

/* The plan for a rule on this device. */
static mn_status device_plan(const mn_rule *r, const mn_dims *d, mn_precision p, mn_cuda_plan *pl)
{
    MN_TRY(mn_cuda_ensure_device());
    return mn_cuda_plan_rule(r, d, p, d->B * d->H, mn_cuda_arch(), mn_cuda_smem_optin(), pl);
}

/* The module for a rule at the given dims and precision, on the plan's path
 * (NULL: the general path); work picks the compile's tier (kernels/cuda_module.h). */
static mn_status rule_module(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl, double work,
                             mn_cuda_module **out)
{
    mn_cuda_plan general = {0};
    general.path = MN_PATH_GENERAL;
    if (!pl || pl->path == MN_PATH_LARGE) pl = &general;
    char defs[512];
    const char *defines;
    const char *const *templates = mn_cuda_plan_parts(pl, defs, sizeof defs, &defines);
    bool fused = pl->path == MN_PATH_FUSED;
    MN_TRY(mn_cuda_module_for(r, d, p, templates, defines, fused ? fused_kernels : general_kernels, work, out));
    /* past 48 KB, dynamic shared memory must be asked for */
    if (fused) MN_TRY(mn_cuda_module_set_smem(*out, pl->smem_bytes));
    return MN_OK;
}

/* ---- inspection: attributes and occupancy of a rule's kernels ---- */

static mn_status kernel_occupancy(cudaKernel_t kernel, int threads, long smem, int cluster, mn_kernel_info *k)
{
    /* a cudaKernel_t passes for a function symbol in these two calls */
    struct cudaFuncAttributes fa;
    MN_CUDA_CHECK(cudaFuncGetAttributes(&fa, (const void *)kernel));
    int blocks = 0, threads_per_sm = 0;
    MN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, (const void *)kernel, threads, (size_t)smem));
    MN_CUDA_CHECK(cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, 0));
    k->on_device = true;
    k->device_registers = fa.numRegs;
    k->device_max_threads = fa.maxThreadsPerBlock;
    k->device_shared_bytes = (long)fa.sharedSizeBytes + smem;
    k->device_local_bytes = (long)fa.localSizeBytes;
    k->block_threads = threads;
    k->blocks_per_sm = blocks;
    k->warps_per_sm = blocks * ((threads + 31) / 32);
    k->max_warps_per_sm = threads_per_sm / 32;
    k->occupancy = k->max_warps_per_sm > 0 ? (double)k->warps_per_sm / k->max_warps_per_sm : 0.0;
    k->sms = mn_cuda_sm_count();
    k->active_clusters = 0;
    if (cluster > 1) {
        /* a cluster's blocks share a GPC: fewer than sms / cluster may fit at once */
        cudaLaunchConfig_t cfg = {0};
        cfg.gridDim = (dim3){(unsigned)cluster, 1, 1};
        cfg.blockDim = (dim3){(unsigned)threads, 1, 1};
        cfg.dynamicSmemBytes = (size_t)smem;
        MN_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&k->active_clusters, (const void *)kernel, &cfg));
    }
    return MN_OK;
}

mn_status mn_cuda_rule_kernel_occupancy(const mn_rule *r, const mn_dims *d, mn_precision p, mn_kernel_set *set)
{
    mn_cuda_module *m;
    mn_cuda_plan pl;
    MN_TRY(device_plan(r, d, p, &pl));
    /* the full tier: the kernels runs are meant to use */
    MN_TRY(rule_module(r, d, p, &pl, MN_WORK_FULL, &m));
    mn_cuda_module *gm = m;
    if (pl.path == MN_PATH_FUSED) MN_TRY(rule_module(r, d, p, NULL, MN_WORK_FULL, &gm)); /* reads run the general module */
    const struct { const char *name; cudaKernel_t k; int threads; long smem; int cluster; } ks[] = {
        {MN_RULE_STEP_KERNEL, pl.path == MN_PATH_FUSED ? NULL : m->k[K_STEP], MN_RULE_THREADS, 0, 1},
        {MN_RULE_READ_KERNEL, gm->k[K_READ], MN_RULE_THREADS, 0, 1},
        {MN_FUSED_STEP_KERNEL, pl.path == MN_PATH_FUSED ? m->k[K_STEP] : NULL, pl.threads, pl.smem_bytes, pl.cluster}};
    for (size_t i = 0; i < sizeof ks / sizeof *ks; i++) {
        mn_kernel_info *k = mn_kernel_set_find(set, ks[i].name);
        if (k && ks[i].k) MN_TRY(kernel_occupancy(ks[i].k, ks[i].threads, ks[i].smem, ks[i].cluster, k));
    }
    return MN_OK;
}

/* ---- profiling: launches timed with two events, when switched on ---- */

static struct {
    bool on, events;
    cudaEvent_t start, stop;
    mn_kernel_launch ring[MN_PROFILE_RING];
    long long recorded;
    mn_kernel_total totals[MN_PROFILE_KERNELS];
    int ntotals;
} prof;

mn_status mn_cuda_profile_set(bool on)
{
    if (on && !prof.events) {
        MN_TRY(mn_cuda_ensure_device());
        MN_CUDA_CHECK(cudaEventCreate(&prof.start));
        mn_status s = MN_CUDA_ST(cudaEventCreate(&prof.stop));
        if (s != MN_OK) {
            (void)cudaEventDestroy(prof.start);
            return s;
        }
        prof.events = true;
    }
    prof.on = on;
    return MN_OK;
}

bool mn_cuda_profile_on(void) { return prof.on; }

static void profile_record(const char *name, double ms, dim3 grid, dim3 block)
{
    mn_kernel_launch *l = &prof.ring[prof.recorded % MN_PROFILE_RING];
    snprintf(l->name, sizeof l->name, "%s", name);
    l->ms = ms;
    l->grid[0] = grid.x, l->grid[1] = grid.y, l->grid[2] = grid.z;
    l->block[0] = block.x, l->block[1] = block.y, l->block[2] = block.z;
    prof.recorded++;
    int i = 0;
    while (i < prof.ntotals && strcmp(prof.totals[i].name, name) != 0) i++;
    if (i == MN_PROFILE_KERNELS) { /* full: the last slot takes the rest */
        i = MN_PROFILE_KERNELS - 1;
        snprintf(prof.totals[i].name, sizeof prof.totals[i].name, "(other kernels)");
    } else if (i == prof.ntotals) {
        prof.ntotals++;
        memset(&prof.totals[i], 0, sizeof prof.totals[i]);
        snprintf(prof.totals[i].name, sizeof prof.totals[i].name, "%s", name);
    }
    mn_kernel_total *t = &prof.totals[i];
    t->calls++;
    t->ms += ms;
    memcpy(t->grid, l->grid, sizeof t->grid);
    memcpy(t->block, l->block, sizeof t->block);
}

int mn_cuda_profile_recent(mn_kernel_launch *out, int max, long long *total)
{
    long long have = prof.recorded < MN_PROFILE_RING ? prof.recorded : MN_PROFILE_RING;
    if (have > max) have = max;
    for (long long i = 0; i < have; i++) out[i] = prof.ring[(prof.recorded - have + i) % MN_PROFILE_RING];
    if (total) *total = prof.recorded;
    return (int)have;
}

int mn_cuda_profile_totals(mn_kernel_total *out, int max)
{
    int n = prof.ntotals < max ? prof.ntotals : max;
    memcpy(out, prof.totals, sizeof *out * (size_t)n);
    return n;
}

/* ---- launching ---- */

static float *f32(const mn_tensor *t) { return t->storage ? (float *)mn_tensor_data(t) : NULL; }

/* Arguments common to both kernels, and a workspace for memories blocks. */
static mn_status prepare(const mn_memory_state *st, int64_t memories, const mn_cuda_plan *pl, mn_rule_kargs *a,
                         void **work, size_t *work_bytes)
{
    const mn_rule *r = &st->rule;
    const mn_dims *d = &st->dims;
    const int64_t blocks = memories * (pl ? pl->cluster : 1); /* the launch's */
    if (blocks > 2147483647LL)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda engine: %lld memories (B x H) exceed one launch's grid",
                       (long long)memories);
    memset(a, 0, sizeof *a);
    if (st->nparams > MN_RULE_MAX_PARAMS)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda engine: %d parameters, the kernel takes at most %d", st->nparams,
                       MN_RULE_MAX_PARAMS);
    for (int p = 0; p < st->nparams; p++) {
        const mn_tensor *ts[3] = {&st->params[p], &st->momenta[p], &st->anchor[p]};
        for (int j = 0; j < 3; j++)
            if (!ts[j]->storage || ts[j]->storage->device != MN_CUDA || !mn_tensor_is_contiguous(ts[j]))
                return mn_fail(MN_ERR_ARG, "cuda engine: the memory state is not contiguous on cuda");
        a->W[p] = f32(&st->params[p]);
        a->S[p] = f32(&st->momenta[p]);
        a->A[p] = f32(&st->anchor[p]);
    }
    mn_rule_layout lo;
    mn_rule_layout_init(&lo, r->layers, r->bias, r->glu && r->layers > 1, d->dk, d->dv, r->layers > 1 ? d->dh : 0,
                        mn_rule_chunk_rows(r->step));
    /* out_norm: its gain and shift (the state's outer tensors, never updated) and its rows in the workspace */
    if (mn_rule_outer_count(r) > 0) {
        for (int j = 0; j < MN_OUTER_COUNT; j++)
            if (!st->outer[j].storage || st->outer[j].storage->device != MN_CUDA ||
                !mn_tensor_is_contiguous(&st->outer[j]))
                return mn_fail(MN_ERR_ARG, "cuda engine: the memory state's %s is not contiguous on cuda",
                               mn_outer_name(j));
        a->ln_g = f32(&st->outer[0]);
        a->ln_b = f32(&st->outer[1]);
        mn_rule_layout_out_norm(&lo, d->dv, mn_rule_chunk_rows(r->step));
    }
    /* a workspace per block: in a cluster, of the block's slice */
    a->work_floats = pl && pl->path == MN_PATH_FUSED ? mn_fused_work_floats(r, d, pl) : lo.total;
    *work_bytes = sizeof(float) * (size_t)a->work_floats * (size_t)blocks;
    return mn_cuda_alloc(*work_bytes, work);
}

/* A launch's wait, deferred (mn_cuda_defer_begin, kernels/cuda.h): the
 * launch that waits, and what its profile record needs. */
static struct {
    bool on, pending, timed;
    char name[48];
    dim3 grid, block;
} deferred;

/* The wait of the launch that went before, with its fault and its profile record. */
static mn_status finish_launch(cudaStream_t stream, bool timed, const char *name, dim3 grid, dim3 block)
{
    MN_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (timed) {
        float ms = 0;
        MN_CUDA_CHECK(cudaEventElapsedTime(&ms, prof.start, prof.stop));
        profile_record(name, ms, grid, block);
    }
    return MN_OK;
}

static mn_status finish_deferred(void)
{
    if (!deferred.pending) return MN_OK;
    deferred.pending = false;
    return finish_launch(NULL, deferred.timed, deferred.name, deferred.grid, deferred.block);
}

void mn_cuda_defer_begin(void)
{
    (void)finish_deferred(); /* one left by a caller that raised before its end: its fault shows on the next call */
    deferred.on = true;
}

mn_status mn_cuda_defer_end(void)
{
    deferred.on = false;
    return finish_deferred();
}

/* Launch on the layer's current stream (the legacy default stream unless a
 * caller set one: mn_cuda_set_stream) and wait: a fault inside the kernel is
 * reported by this call, not by whatever runs next; or, between
 * mn_cuda_defer_begin and mn_cuda_defer_end on the legacy stream, by the
 * end. Under stream capture (a CUDA graph) there is nothing to wait for:
 * the launch is recorded, not run. With profiling on, events either side
 * time it (the wait is there anyway). */
static mn_status launch(const mn_cuda_module *m, cudaKernel_t kernel, const char *kname, int threads, long smem,
                        int64_t blocks, mn_rule_kargs *a)
{
    MN_TRY(finish_deferred()); /* the profile's events are one pair: the last launch's */
    /* a cluster kernel's cluster size is compiled in (__cluster_dims__): blocks is a multiple of it */
    dim3 grid = {(unsigned)blocks, 1, 1}, block = {(unsigned)threads, 1, 1};
    void *args[1] = {a};
    cudaStream_t stream = (cudaStream_t)mn_cuda_get_stream();
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (stream) MN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    bool captured = capture != cudaStreamCaptureStatusNone;
    bool timed = prof.on && prof.events && !captured;
    if (timed) MN_CUDA_CHECK(cudaEventRecord(prof.start, stream));
    MN_CUDA_CHECK(cudaLaunchKernel((const void *)kernel, grid, block, args, (size_t)smem, stream));
    MN_CUDA_CHECK_LAUNCH();
    if (captured) return MN_OK;
    if (timed) MN_CUDA_CHECK(cudaEventRecord(prof.stop, stream));
    char name[48];
    snprintf(name, sizeof name, "%s [%.8s]", kname, m->key);
    if (deferred.on && !stream) {
        deferred.pending = true;
        deferred.timed = timed;
        memcpy(deferred.name, name, sizeof name);
        deferred.grid = grid;
        deferred.block = block;
        return MN_OK;
    }
    return finish_launch(stream, timed, name, grid, block);
}

static mn_status cuda_segment_run(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out,
                                  int64_t n, int64_t nsteps)
{
    int64_t memories = st->dims.B * st->dims.H;
    if (n == 0 || memories == 0) {
        st->steps_done += nsteps;
        return MN_OK;
    }
    mn_cuda_plan pl;
    MN_TRY(device_plan(&st->rule, &st->dims, st->precision, &pl));
    /* it keeps the step count and reports progress itself */
    if (pl.path == MN_PATH_LARGE) {
        MN_TRY(finish_deferred()); /* its stream is not ordered after a launch left waiting */
        /* the large path runs on a stream of its own and waits for it:
         * what a caller queued on its stream (the inputs) must be done */
        cudaStream_t caller = (cudaStream_t)mn_cuda_get_stream();
        if (caller) {
            enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
            MN_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
            if (capture != cudaStreamCaptureStatusNone)
                return mn_fail(MN_ERR_UNSUPPORTED, "cuda engine: the large path (cuBLAS on a stream of its own) "
                                                   "cannot be captured in a caller's CUDA graph");
            MN_CUDA_CHECK(cudaStreamSynchronize(caller));
        }
        return mn_cuda_large_segment_run(st, in, out, n, nsteps);
    }
    /* the fused kernel's code for q and lengths where this run gives them */
    pl.with_q = in->q.storage != NULL;
    pl.with_lengths = in->lengths.storage != NULL;
    mn_cuda_module *mod;
    MN_TRY(rule_module(&st->rule, &st->dims, st->precision, &pl, mn_cuda_run_work(&st->rule, &st->dims), &mod));
    MN_TRY(mn_cuda_module_set_constants(mod, &st->rule, (cudaStream_t)mn_cuda_get_stream()));
    mn_rule_kargs a;
    void *work = NULL;
    size_t work_bytes = 0;
    MN_TRY(prepare(st, memories, &pl, &a, &work, &work_bytes));
    a.k = f32(&in->k);
    a.v = f32(&in->v);
    a.q = f32(&in->q);
    a.theta = f32(&in->theta);
    a.eta = f32(&in->eta);
    a.alpha = f32(&in->alpha);
    a.y = in->want_y ? f32(&out->y) : NULL;
    a.loss = f32(&out->loss);
    a.grad_norm = f32(&out->grad_norm);
    a.clip_scale = f32(&out->clip_scale);
    a.skipped = f32(&out->skipped);
    a.step_loss = f32(&out->step_loss);
    a.weight_norm = f32(&out->weight_norm);
    a.work = work;
    a.n = n;
    a.nsteps = nsteps;
    a.steps_done = st->steps_done;
    /* ragged batches: the engine gives lengths as i64 on this device (model/engine.c) */
    if (in->lengths.storage) {
        if (in->lengths.dtype != MN_I64 || in->lengths.storage->device != MN_CUDA) {
            mn_cuda_free(work, work_bytes);
            return mn_fail(MN_ERR_ARG, "cuda engine: lengths must come as i64 on cuda");
        }
        a.lengths = (const long long *)mn_tensor_data(&in->lengths);
        a.heads = st->dims.H;
        /* They came up from the CPU with one cudaMemcpy on the legacy
         * stream (model/engine.c), which may return before its DMA lands: a
         * caller's stream (the PyTorch bridge's, often non-blocking) must
         * not start the kernel before it does. */
        if (mn_cuda_get_stream()) {
            mn_status ls = MN_CUDA_ST(cudaStreamSynchronize(cudaStreamLegacy));
            if (ls != MN_OK) {
                mn_cuda_free(work, work_bytes);
                return ls;
            }
        }
    }
    /* newton_schulz's iterates (the general path: kernels/plan.c) */
    void *ns_work = NULL;
    size_t ns_bytes = 0;
    mn_status s = MN_OK;
    if (st->rule.precondition != MN_PRECOND_NONE) {
        const mn_rule *r = &st->rule;
        a.ns_doubles = mn_rule_ns_doubles(r->layers, r->bias, st->dims.dk, st->dims.dv, r->layers > 1 ? st->dims.dh : 0);
        ns_bytes = sizeof(double) * (size_t)a.ns_doubles * (size_t)memories;
        s = mn_cuda_alloc(ns_bytes, &ns_work);
        a.ns_work = ns_work;
    }
    if (s == MN_OK)
        s = pl.path == MN_PATH_FUSED
                ? launch(mod, mod->k[K_STEP], MN_FUSED_STEP_KERNEL, pl.threads, pl.smem_bytes,
                         memories * pl.cluster, &a)
                : launch(mod, mod->k[K_STEP], MN_RULE_STEP_KERNEL, MN_RULE_THREADS, 0, memories, &a);
    if (ns_work) mn_cuda_free(ns_work, ns_bytes);
    mn_cuda_free(work, work_bytes);
    if (s != MN_OK) return s;
    st->steps_done += nsteps;
    mn_report_progress(memories * nsteps, memories * nsteps);
    return MN_OK;
}

static mn_status cuda_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y)
{
    int64_t memories = st->dims.B * st->dims.H, rows = q->shape[2];
    if (rows == 0 || memories == 0) return MN_OK;
    mn_cuda_plan pl;
    MN_TRY(device_plan(&st->rule, &st->dims, st->precision, &pl));
    if (pl.path == MN_PATH_LARGE) return mn_cuda_large_read(st, q, y);
    mn_cuda_module *mod;
    MN_TRY(rule_module(&st->rule, &st->dims, st->precision, NULL, mn_cuda_run_work(&st->rule, &st->dims), &mod));
    MN_TRY(mn_cuda_module_set_constants(mod, &st->rule, (cudaStream_t)mn_cuda_get_stream()));
    mn_rule_kargs a;
    void *work = NULL;
    size_t work_bytes = 0;
    MN_TRY(prepare(st, memories, NULL, &a, &work, &work_bytes));
    a.q = f32(q);
    a.y = f32(y);
    a.work = work;
    a.n = rows;
    mn_status s = launch(mod, mod->k[K_READ], MN_RULE_READ_KERNEL, MN_RULE_THREADS, 0, memories, &a);
    mn_cuda_free(work, work_bytes);
    return s;
}

static const mn_engine_backend cuda_engine = {"cuda", cuda_segment_run, cuda_read};

void mn_cuda_engine_register(void) { mn_register_engine(MN_CUDA, &cuda_engine); }
