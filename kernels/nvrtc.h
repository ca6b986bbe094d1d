/* nvrtc.h: generated CUDA source to CUBIN: compile with NVRTC for the
 * device's own sm (no GPU needed), and the disk cache of CUBINs. The cache
 * key is a hash of the source, the compile options (and so the tier), the
 * arch and the NVRTC version. Disk cache: $MNEMO_CACHE/kernels, else
 * ~/.cache/mnemo/kernels; files <key>.cubin, and <key>.info with the
 * kernels' resources as ptxas reported them (kernels/kernel_info.h), each
 * written to a temporary name and renamed, so a reader never sees half a
 * file. Plain C. */
#ifndef MN_NVRTC_H
#define MN_NVRTC_H

#include "../model/mn.h"
#include "kernel_info.h"

/* NVRTC's version as 1000 * major + 10 * minor (13000 for 13.0). */
int mn_nvrtc_version(void);

/* How hard NVRTC optimises. MN_TIER_FULL: the kernels as they are meant to
 * run. MN_TIER_FAST: --Ofast-compile=mid, about a third of the compile time
 * for a kernel about 4x slower, with the same float operations (its outputs
 * equal the full tier's to the bit). A new rule's first run takes the fast
 * tier while the full one compiles in a background process
 * (kernels/compile_later.h, kernels/cuda_module.c). */
typedef enum { MN_TIER_FULL = 0, MN_TIER_FAST = 1 } mn_tier;

/* The options generated kernels are compiled with for arch (90 -> sm_90)
 * and tier, space-separated, into buf (at least 160 bytes). They include
 * --ptxas-options=-v, so every compile's log reports the kernels' resources. */
const char *mn_nvrtc_options(int arch, mn_tier tier, char *buf, size_t len);

/* 32 hex digits (128 bits) of src, options, arch and NVRTC version. */
void mn_cuda_cache_key(const char *src, const char *options, int arch, int nvrtc_version, char out[33]);

/* Compile only (no GPU needed). On failure MN_ERR_DEVICE with the start of
 * NVRTC's log in the message. *log, when log is not NULL, receives the
 * whole log (NULL when empty); the caller frees it. */
mn_status mn_cuda_compile_check(const char *src, int arch, char **log);

/* The cache key of src compiled for arch at tier. */
void mn_nvrtc_key(const char *src, int arch, mn_tier tier, char key[33]);

/* Whether the disk cache directory exists (made if missing) and is writable. */
bool mn_nvrtc_cache_writable(void);

/* Whether the disk cache holds the CUBIN of a key (mn_nvrtc_key). */
bool mn_nvrtc_in_cache(const char key[33]);

/* The path of the cache's file KEY.EXT in path[len] (the cache directory
 * made if missing); false where there is no cache or the path is too long. */
bool mn_nvrtc_cache_file(const char key[33], const char *ext, char *path, size_t len);

/* The CUBIN of a key from the disk cache (nothing compiled), or false; the
 * caller frees *cubin. */
bool mn_nvrtc_read_cached(const char key[33], void **cubin, size_t *size);

/* The CUBIN of src for arch and tier: from the disk cache (unless fresh: a
 * cached file that failed to load is replaced), else compiled now and
 * written to the disk cache. key receives the cache key; the caller frees
 * *cubin. Loading it is the engine's (kernels/cuda_module.c), which keeps
 * loaded modules in memory by key. A cache that cannot be written is
 * skipped. */
mn_status mn_nvrtc_cubin(const char *src, int arch, mn_tier tier, bool fresh, char key[33], void **cubin,
                         size_t *size);

/* The resources of the kernels of src for arch (registers, shared memory,
 * stack, spills, launch bounds; no device fields): remembered from an
 * earlier compile in this process, else from <key>.info in the disk cache
 * (out->cached true for both), else compiled now, which also writes the
 * CUBIN and its .info to the disk cache. out->key is the cache key. */
mn_status mn_nvrtc_kernel_info(const char *src, int arch, mn_kernel_set *out);

#endif
