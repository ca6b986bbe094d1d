/* cuda_module.h: a generated CUDA source to a loaded library and its
 * kernels, for the rule paths (kernels/engine_cuda.c, kernels/engine_large.c),
 * kept by cache key for the process. */
#ifndef MN_CUDA_MODULE_H
#define MN_CUDA_MODULE_H

#include "../model/mn.h"
#include "../model/rule.h"
#include "codegen.h"
#include "cuda.h"
#include <cuda_runtime.h>

#define MN_MODULE_MAX_KERNELS 16

struct mn_compile_job;

/* A loaded library and the kernels asked of it, kept for the process. A
 * module loaded from the fast tier (kernels/nvrtc.h) holds the background
 * compile of its full tier (a child process, kernels/compile_later.h); a
 * later mn_cuda_module_get that finds it done loads the full library and
 * puts its kernels in place of the fast ones.
 * The fast library stays loaded: a caller's CUDA graph may hold its kernels. */
typedef struct mn_cuda_module {
    char key[33]; /* the full tier's cache key, whichever tier is loaded */
    cudaLibrary_t lib;
    cudaKernel_t k[MN_MODULE_MAX_KERNELS]; /* in the order of the names asked for */
    cudaKernel_t set_constants;            /* MN_SET_CONSTANTS_KERNEL where the source has it, else NULL */
    const char *names[MN_MODULE_MAX_KERNELS + 1];
    /* What a run set last, so that the next run with the same skips the
     * driver call (each one is microseconds of rule:run's host time): */
    long smem_set;               /* k[0]'s dynamic shared memory limit (0: not set on these kernels) */
    bool constants_set;          /* the constants below are in the library's constant memory */
    bool constants_uncached;     /* a run on a caller's stream (which a CUDA graph may replay later) set them */
    mn_rule_constants constants_last; /* as last set */
    bool moves;                 /* on the fast tier, to move to the full one (MNEMO_COMPILE=tiered) */
    char *src;                  /* the source, while it moves */
    struct mn_compile_job *job; /* the full tier's compile, once started */
    struct mn_cuda_module *next;
} mn_cuda_module;

/* A run's work for the tier choice: memories x tokens x the memory's
 * weights (B*H*T*(dk*dh + dh*dv) for two layers). */
double mn_cuda_run_work(const mn_rule *r, const mn_dims *d);
/* A work that always asks for the full tier (rule:kernel_info's occupancy). */
#define MN_WORK_FULL 1e300

/* The module of src with its kernels names[0..] (NULL-terminated, at most
 * MN_MODULE_MAX_KERNELS, string constants: the module keeps the pointers):
 * from the process's list by cache key, else loaded from the disk cache,
 * else compiled, loaded and added. The same source always asks for the same
 * names. MNEMO_COMPILE picks how a source missing from the disk cache is
 * compiled: "tiered" (the default) compiles the fast tier now and the full
 * one in the background when work is at most MN_FAST_TIER_WORK and no CUDA
 * graph is being captured, else the full one now; "full" always the full
 * one now; "fast" only the fast tier (for tests). A module still on the
 * fast tier moves to the full one at the first call that finds its
 * background compile done, or that needs the full tier (a larger work),
 * which waits for it; not during a CUDA-graph capture (no library is loaded
 * then: the graph holds the kernels loaded before it). */
mn_status mn_cuda_module_get(const char *src, const char *const *names, double work, mn_cuda_module **out);

/* What a later mn_cuda_module_get of m's source does to the m it finds:
 * m, still on the fast tier, moves towards the full one (its background
 * compile taken up where done; waited for where work asks for the full
 * tier). For callers that found m without its source (kernels/module_memo.h). */
mn_status mn_cuda_module_touch(mn_cuda_module *m, double work);

/* 16 x P1's work (B=4, H=32, T=4096, MLP 64-256-64): on an H100 the fast
 * tier costs P1 about 14 ms more than the full one, so up to this work it
 * saves more than it costs (the full compile takes 1.5-2 s). */
#define MN_FAST_TIER_WORK (16.0 * 4 * 32 * 4096 * (64.0 * 256 + 256.0 * 64))

/* The rule's constants (kernels/codegen.h: mn_cuda_rule_constants) written
 * into m's copy by its setter kernel, queued on stream before the run's
 * kernels; nothing where m's source reads none. A launch, not a copy from
 * the host, so that a caller's CUDA-graph capture records it with the
 * values. Every run of a module calls this first: modules are shared by
 * rules that differ only in their constants. */
mn_status mn_cuda_module_set_constants(mn_cuda_module *m, const mn_rule *r, cudaStream_t stream);
/* The largest dynamic shared memory k[0] may be launched with, set where it
 * differs from what is set. */
mn_status mn_cuda_module_set_smem(mn_cuda_module *m, long smem_bytes);

#endif
