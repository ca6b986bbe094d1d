/* cuda_module.c: a generated CUDA source to a loaded library (kernels/cuda_module.h). */
#include "cuda_module.h"
#include "cuda.h"
#include "cuda_check.h"
#include "nvrtc.h"
#include "codegen.h"
#include "compile_later.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static mn_cuda_module *modules;
static mn_cuda_compile_stats stats; /* pending is counted when asked */
static mn_compile_mode default_mode = MN_COMPILE_TIERED;

void mn_cuda_set_compile_default(mn_compile_mode mode) { default_mode = mode; }

/* MNEMO_COMPILE, else the process's default. */
static mn_status compile_mode(mn_compile_mode *mode)
{
    const char *v = getenv("MNEMO_COMPILE");
    if (!v || !v[0]) *mode = default_mode;
    else if (strcmp(v, "tiered") == 0) *mode = MN_COMPILE_TIERED;
    else if (strcmp(v, "full") == 0) *mode = MN_COMPILE_FULL;
    else if (strcmp(v, "fast") == 0) *mode = MN_COMPILE_FAST;
    else return mn_fail(MN_ERR_ARG, "MNEMO_COMPILE=%s: expected tiered, full or fast", v);
    return MN_OK;
}

double mn_cuda_run_work(const mn_rule *r, const mn_dims *d)
{
    double weights = r->layers <= 1 ? (double)d->dk * d->dv
                                    : (double)d->dk * d->dh + (r->layers - 2.0) * d->dh * d->dh + (double)d->dh * d->dv;
    return (double)d->B * d->H * d->T * weights;
}

/* Whether the caller's stream is capturing a CUDA graph: a library is not
 * loaded then, so the graph keeps what is loaded. */
static bool capturing(void)
{
    cudaStream_t stream = (cudaStream_t)mn_cuda_get_stream();
    enum cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
    if (!stream || cudaStreamIsCapturing(stream, &c) != cudaSuccess) return false;
    return c != cudaStreamCaptureStatusNone;
}

static mn_status load(const void *cubin, cudaLibrary_t *lib)
{
    return MN_CUDA_ST(cudaLibraryLoadData(lib, cubin, NULL, NULL, 0, NULL, NULL, 0));
}

/* src at tier compiled by NVRTC, or its CUBIN from the disk cache, loaded;
 * a cached CUBIN the driver refuses is compiled afresh and replaces it. */
static mn_status library_load(const char *src, mn_tier tier, cudaLibrary_t *lib)
{
    int arch = mn_cuda_arch();
    char k[33];
    void *cubin = NULL;
    size_t size = 0;
    mn_status s = mn_nvrtc_cubin(src, arch, tier, false, k, &cubin, &size);
    if (s == MN_OK && load(cubin, lib) != MN_OK) {
        /* a cached file this driver refuses: compile afresh and replace it */
        free(cubin);
        cubin = NULL;
        s = mn_nvrtc_cubin(src, arch, tier, true, k, &cubin, &size);
        if (s == MN_OK) s = load(cubin, lib);
    }
    free(cubin);
    return s;
}

/* The kernels names[] (and the constants' setter where has_setter) of lib. */
static mn_status kernels_of(cudaLibrary_t lib, const char *const *names, bool has_setter,
                            cudaKernel_t k[MN_MODULE_MAX_KERNELS], cudaKernel_t *set_constants)
{
    for (int i = 0; names[i]; i++) {
        if (i >= MN_MODULE_MAX_KERNELS)
            return mn_fail(MN_ERR_ARG, "cuda module: more than %d kernels", MN_MODULE_MAX_KERNELS);
        MN_TRY(MN_CUDA_ST(cudaLibraryGetKernel(&k[i], lib, names[i])));
    }
    *set_constants = NULL;
    if (has_setter) MN_TRY(MN_CUDA_ST(cudaLibraryGetKernel(set_constants, lib, MN_SET_CONSTANTS_KERNEL)));
    return MN_OK;
}

/* m's kernels from lib, the full tier's, in place of the fast ones. */
static mn_status take_full(mn_cuda_module *m, cudaLibrary_t lib)
{
    cudaKernel_t k[MN_MODULE_MAX_KERNELS] = {0}, setter = NULL;
    mn_status s = kernels_of(lib, m->names, m->set_constants != NULL, k, &setter);
    if (s != MN_OK) {
        (void)cudaLibraryUnload(lib);
        return s;
    }
    m->lib = lib; /* the fast library stays loaded: a caller's CUDA graph may hold its kernels */
    memcpy(m->k, k, sizeof k);
    m->set_constants = setter;
    m->smem_set = 0; /* new kernels, a new library's constant memory: nothing set on them yet */
    m->constants_set = false;
    stats.upgraded++;
    return MN_OK;
}

/* m's full tier compiled in the foreground (or found in the disk cache) and taken up. */
static mn_status compile_full_now(mn_cuda_module *m)
{
    cudaLibrary_t full;
    mn_status s = library_load(m->src, MN_TIER_FULL, &full);
    return s == MN_OK ? take_full(m, full) : s;
}

/* Finish m's background compile (waiting if it is not done) and move m to
 * the full tier. On failure m keeps its fast kernels. */
static mn_status upgrade(mn_cuda_module *m)
{
    mn_compile_job *job = m->job;
    m->job = NULL;
    const bool watched = mn_compile_job_watching(job);
    void *cubin = NULL;
    size_t size = 0;
    cudaLibrary_t lib;
    mn_status s = mn_compile_job_finish(job, &cubin, &size);
    if (s != MN_OK && watched) {
        /* another process's compile of this source failed or died: ours,
         * in the foreground (where NVRTC's message, if any, comes back) */
        mn_clear_error();
        return compile_full_now(m);
    }
    if (s == MN_OK) s = load(cubin, &lib);
    free(cubin);
    if (s == MN_OK) s = take_full(m, lib);
    if (s == MN_OK && watched) stats.shared++;
    return s;
}

/* Bring m, on the fast tier and meant to move, towards the full one: take
 * up its finished compile, or wait for it (need_full); start it where none
 * runs yet (the compile slots were busy when m was loaded); compile in the
 * foreground where need_full and none runs, or where no child can be
 * started. A failure leaves m on the fast tier for good (counted). */
static mn_status move_on(mn_cuda_module *m, bool need_full)
{
    if (!m->job && !need_full && mn_compile_slot_free())
        m->job = mn_compile_later(m->src, mn_cuda_arch()); /* NULL: no child, the full tier below */
    if (!need_full && (m->job ? !mn_compile_job_done(m->job) : !mn_compile_slot_free()))
        return MN_OK; /* compiling, or waiting for a slot */
    mn_status s;
    if (m->job) s = upgrade(m);
    else s = compile_full_now(m);
    if (s != MN_OK) stats.failed++;
    m->moves = false;
    free(m->src);
    m->src = NULL;
    return s;
}

mn_status mn_cuda_module_touch(mn_cuda_module *m, double work)
{
    mn_compile_mode mode = default_mode;
    MN_TRY(compile_mode(&mode));
    /* a failed full compile leaves the fast kernels: the run goes on */
    if (m->moves && !capturing()) (void)move_on(m, mode == MN_COMPILE_FULL || work > MN_FAST_TIER_WORK);
    return MN_OK;
}

mn_status mn_cuda_module_get(const char *src, const char *const *names, double work, mn_cuda_module **out)
{
    MN_TRY(mn_cuda_ensure_device());
    mn_compile_mode mode = default_mode;
    MN_TRY(compile_mode(&mode));
    int arch = mn_cuda_arch();
    char key[33];
    mn_nvrtc_key(src, arch, MN_TIER_FULL, key);
    bool want_full = mode == MN_COMPILE_FULL || work > MN_FAST_TIER_WORK;
    for (mn_cuda_module *m = modules; m; m = m->next)
        if (strcmp(m->key, key) == 0) {
            *out = m;
            return mn_cuda_module_touch(m, work);
        }
    /* the fast tier for a source new to the disk cache, where a child can
     * hand the full one over through that cache */
    bool fast = mode == MN_COMPILE_FAST ||
                (mode == MN_COMPILE_TIERED && !want_full && !capturing() && mn_nvrtc_cache_writable() &&
                 !mn_nvrtc_in_cache(key));
    bool moves = fast && mode == MN_COMPILE_TIERED;
    /* started first, so that it compiles while this process compiles the
     * fast tier; where the slots are busy, a later call starts it; where no
     * child can start, the full tier now. A child whose source then fails
     * the fast compile fails too, and is reaped at no one's call. */
    mn_compile_job *job = NULL;
    if (moves && mn_compile_slot_free() && !(job = mn_compile_later(src, arch))) fast = moves = false;
    char *kept = moves ? strdup(src) : NULL;
    if (moves && !kept) return mn_fail(MN_ERR_OOM, "out of memory for a loaded kernel");
    cudaLibrary_t lib;
    mn_status s = library_load(src, fast ? MN_TIER_FAST : MN_TIER_FULL, &lib);
    mn_cuda_module *m = s == MN_OK ? calloc(1, sizeof *m) : NULL;
    if (s == MN_OK && !m) {
        (void)cudaLibraryUnload(lib);
        s = mn_fail(MN_ERR_OOM, "out of memory for a loaded kernel");
    }
    if (s != MN_OK) {
        free(kept);
        return s;
    }
    memcpy(m->key, key, sizeof m->key);
    m->lib = lib;
    m->moves = moves;
    m->job = job;
    m->src = kept;
    for (int i = 0; names[i] && i < MN_MODULE_MAX_KERNELS; i++) m->names[i] = names[i];
    s = kernels_of(lib, names, strstr(src, MN_SET_CONSTANTS_KERNEL "(") != NULL, m->k, &m->set_constants);
    if (s != MN_OK) {
        (void)cudaLibraryUnload(lib);
        free(kept);
        free(m);
        return s;
    }
    stats.fast += fast;
    m->next = modules;
    modules = m;
    *out = m;
    return MN_OK;
}

void mn_cuda_compile_stats_get(mn_cuda_compile_stats *out)
{
    *out = stats;
    out->pending = 0;
    for (mn_cuda_module *m = modules; m; m = m->next) out->pending += m->moves;
}

mn_status mn_cuda_compile_wait(int *moved)
{
    int before = stats.upgraded;
    mn_status first = MN_OK;
    char message[1024] = "";
    for (mn_cuda_module *m = modules; m; m = m->next) {
        if (!m->moves) continue;
        mn_status s = move_on(m, true);
        if (s != MN_OK && first == MN_OK) {
            first = s;
            snprintf(message, sizeof message, "%s", mn_last_error());
        }
    }
    if (moved) *moved = stats.upgraded - before;
    return first == MN_OK ? MN_OK : mn_fail(first, "%s", message);
}

/* A run on the legacy stream whose constants are those last set skips the
 * setter: nothing else writes a library's constant memory, and the legacy
 * stream cannot be captured. A caller's stream can: a CUDA graph holding
 * the setter may replay it later, so from the first such run on, m sets its
 * constants every run. */
mn_status mn_cuda_module_set_constants(mn_cuda_module *m, const mn_rule *r, cudaStream_t stream)
{
    if (!m->set_constants) return MN_OK;
    mn_rule_constants k;
    memset(&k, 0, sizeof k); /* padding too: compared as bytes */
    mn_cuda_rule_constants(r, &k);
    if (stream) m->constants_uncached = true;
    if (!m->constants_uncached && m->constants_set && memcmp(&k, &m->constants_last, sizeof k) == 0) return MN_OK;
    void *args[1] = {&k}; /* copied at the launch: k may go */
    dim3 one = {1, 1, 1};
    m->constants_set = false;
    MN_CUDA_CHECK(cudaLaunchKernel((const void *)m->set_constants, one, one, args, 0, stream));
    MN_CUDA_CHECK_LAUNCH();
    m->constants_last = k;
    m->constants_set = true;
    return MN_OK;
}

mn_status mn_cuda_module_set_smem(mn_cuda_module *m, long smem_bytes)
{
    if (m->smem_set == smem_bytes) return MN_OK;
    m->smem_set = 0;
    MN_CUDA_CHECK(cudaKernelSetAttributeForDevice(m->k[0], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  (int)smem_bytes, 0)); /* device 0: kernels/cuda.c */
    m->smem_set = smem_bytes;
    return MN_OK;
}
