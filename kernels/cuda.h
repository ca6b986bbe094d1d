/* cuda.h: the CUDA layer as the rest of mnemo sees it. Plain C, no CUDA
 * types: only kernels/ includes CUDA headers. The layer plugs itself into the
 * engine's registries (tensor backend, allocator, device copies, rule engine)
 * from mn_cuda_register(); on a machine without a GPU (or driver) that call
 * records why and every CUDA request fails with that one clear message. */
#ifndef MN_CUDA_H
#define MN_CUDA_H

#include "../model/mn.h"

/* Called once at start-up (luaopen_mnemo, mnemo run). Never fails hard:
 * returns true when a device is usable. */
bool mn_cuda_register(void);
/* Whether a device is usable, and if not, the reason ("no CUDA driver",
 * "no CUDA device", the runtime's own message). */
bool mn_cuda_available(void);
const char *mn_cuda_unavailable_reason(void);
/* "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)" or the reason. */
const char *mn_cuda_describe(void);
/* The device made current and its context created (the first call does it:
 * device init is lazy; `mnemo run --timing` calls it to time it apart);
 * fails with "cuda: <reason>" without a usable device. */
mn_status mn_cuda_ensure_device(void);
/* Compute capability as 10*major+minor (90 for Hopper), 0 without a device. */
int mn_cuda_arch(void);
/* Shared memory a block may opt in to (bytes), 0 without a device. */
long mn_cuda_smem_optin(void);

/* Device memory through the caching allocator (also registered as the
 * MN_CUDA allocator of tensor.h). On out-of-memory the allocator first
 * returns its cache to the driver and retries; the Lua layer then runs a
 * full GC and retries once more before raising. */
mn_status mn_cuda_alloc(size_t nbytes, void **out);
void mn_cuda_free(void *ptr, size_t nbytes);
mn_status mn_cuda_empty_cache(void);
typedef struct mn_cuda_memory_stats {
    size_t allocated;       /* bytes held by live tensors */
    size_t cached;          /* bytes held by the cache, free for reuse */
    size_t peak_allocated;
    size_t kept;            /* of allocated: what the large path keeps between runs (engine_large.h) */
    size_t device_free, device_total;
    long long alloc_calls, cache_hits, cuda_mallocs;
} mn_cuda_memory_stats;
mn_status mn_cuda_memory(mn_cuda_memory_stats *out);
/* Bytes held by live tensors (stats.allocated, without the driver's query). */
size_t mn_cuda_allocated_bytes(void);
/* Called by mn_cuda_alloc when the driver is out of memory even after the
 * cache went back to it, before the last try: the Lua layer collects its
 * garbage there (dead tensors' blocks come back to the cache). NULL: none. */
void mn_cuda_set_oom_hook(void (*hook)(void *ctx), void *ctx);

/* The rule engine on the GPU (kernels/engine_cuda.c) registers itself with
 * mn_register_engine(MN_CUDA, ...); mn_cuda_register() calls this once a
 * device is known to be usable. */
void mn_cuda_engine_register(void);
/* The backward of a run on the GPU (kernels/grad_cuda.c) registers itself
 * with mn_register_grad_backend(MN_CUDA, ...) the same way. */
void mn_cuda_grad_register(void);

/* The stream the layer's tensor ops and the per-memory kernels (fused and
 * general paths) go to: NULL, the legacy default stream, unless a caller
 * sets one for the length of its call, as the PyTorch bridge does with
 * torch's current stream. The large path keeps its own stream. One stream
 * at a time: the caching allocator hands a freed block to the next request
 * without waiting, which is safe only while all work is ordered on one. */
void mn_cuda_set_stream(void *stream);
void *mn_cuda_get_stream(void);

/* rule:run's overlap (dsl/l_run.c): from mn_cuda_defer_begin on, a rule's
 * step kernel on the legacy stream returns at its launch; its wait, with
 * any fault it had and its profile record, comes at mn_cuda_defer_end (or
 * at the next launch), so that the host work between (the result table)
 * runs while the kernel does. What the run freed (its workspace) may go to
 * the next request meanwhile: on the one stream, after the kernel. A begin
 * finishes a wait a caller left pending (one that raised before its end). */
void mn_cuda_defer_begin(void);
mn_status mn_cuda_defer_end(void);

/* Surface an asynchronous error from earlier launches (the REPL calls this
 * after each statement); MN_OK when there is none. */
mn_status mn_cuda_check_pending(void);
mn_status mn_cuda_synchronize(void);

/* ---- the compile tiers of generated kernels (kernels/cuda_module.c) ---- */

/* How a source missing from the disk cache is compiled (MNEMO_COMPILE
 * overrides the process's default, tiered; the PyTorch bridge's is full,
 * so that a CUDA graph captured early holds the full kernels). */
typedef enum { MN_COMPILE_TIERED, MN_COMPILE_FULL, MN_COMPILE_FAST } mn_compile_mode;
void mn_cuda_set_compile_default(mn_compile_mode mode);

/* Counts for mnemo.compiles(): modules first loaded from the fast tier,
 * those moved to the full tier since, those still to move (their
 * compile waiting for a free slot, running, or done and waiting for the
 * next run), those whose full compile failed (they keep the fast one), and
 * of the moved, those whose full tier another process compiled while this
 * one needed it too (kernels/compile_later.h: one compile a source). */
typedef struct { int fast, upgraded, pending, failed, shared; } mn_cuda_compile_stats;
void mn_cuda_compile_stats_get(mn_cuda_compile_stats *s);

/* Wait for every background compile and move its module to the full tier
 * (mnemo.compile_wait(): before timing kernels). Returns the modules moved
 * through *moved; a failed compile's error is returned after the others
 * are taken up (the module keeps its fast kernels). */
mn_status mn_cuda_compile_wait(int *moved);

#endif
