/* cuda_module.h: a generated CUDA source to a loaded library and its
 * kernels, for the rule paths (kernels/engine_cuda.c, kernels/engine_large.c),
 * kept by cache key for the process. */
#ifndef MN_CUDA_MODULE_H
#define MN_CUDA_MODULE_H

#include "../model/mn.h"
#include "../model/rule.h"
#include <cuda_runtime.h>

#define MN_MODULE_MAX_KERNELS 16

/* A loaded library and the kernels asked of it, kept for the process. */
typedef struct mn_cuda_module {
    char key[33];
    cudaLibrary_t lib;
    cudaKernel_t k[MN_MODULE_MAX_KERNELS]; /* in the order of the names asked for */
    cudaKernel_t set_constants;            /* MN_SET_CONSTANTS_KERNEL where the source has it, else NULL */
    struct mn_cuda_module *next;
} mn_cuda_module;

/* The module of src with its kernels names[0..] (NULL-terminated, at most
 * MN_MODULE_MAX_KERNELS): from the process's list by cache key, else
 * compiled (or read from the disk cache), loaded and added. The same source
 * always asks for the same names. */
mn_status mn_cuda_module_get(const char *src, const char *const *names, mn_cuda_module **out);

/* The rule's constants (kernels/codegen.h: mn_cuda_rule_constants) written
 * into m's copy by its setter kernel, queued on stream before the run's
 * kernels; nothing where m's source reads none. A launch, not a copy from
 * the host, so that a caller's CUDA-graph capture records it with the
 * values. Every run of a module calls this first: modules are shared by
 * rules that differ only in their constants. */
mn_status mn_cuda_module_set_constants(const mn_cuda_module *m, const mn_rule *r, cudaStream_t stream);

#endif
