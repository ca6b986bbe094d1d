/* cuda_module.h: a generated CUDA source to a loaded library, for the rule
 * paths (kernels/engine_cuda.c, kernels/engine_large.c), which each keep
 * their loaded libraries by cache key. */
#ifndef MN_CUDA_MODULE_H
#define MN_CUDA_MODULE_H

#include "../model/mn.h"
#include <cuda_runtime.h>

/* The cache key of src for this device (kernels/nvrtc.h: source, options,
 * arch, NVRTC version). Needs a usable device. */
mn_status mn_cuda_source_key(const char *src, char key[33]);

/* src compiled by NVRTC, or its CUBIN from the disk cache, loaded by the
 * runtime into *lib; a cached CUBIN the driver refuses is compiled afresh
 * and replaces the cached one. */
mn_status mn_cuda_library_load(const char *src, cudaLibrary_t *lib);

#endif
