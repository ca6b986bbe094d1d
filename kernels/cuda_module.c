/* cuda_module.c: a generated CUDA source to a loaded library (kernels/cuda_module.h). */
#include "cuda_module.h"
#include "cuda.h"
#include "cuda_check.h"
#include "nvrtc.h"
#include "codegen.h"

#include <stdlib.h>
#include <string.h>

static mn_cuda_module *modules;

/* The cache key of src for this device (kernels/nvrtc.h). */
static mn_status source_key(const char *src, char key[33])
{
    MN_TRY(mn_cuda_ensure_device());
    int arch = mn_cuda_arch();
    char opts[256];
    mn_cuda_cache_key(src, mn_nvrtc_options(arch, opts, sizeof opts), arch, mn_nvrtc_version(), key);
    return MN_OK;
}

static mn_status load(const void *cubin, cudaLibrary_t *lib)
{
    return MN_CUDA_ST(cudaLibraryLoadData(lib, cubin, NULL, NULL, 0, NULL, NULL, 0));
}

/* src compiled by NVRTC, or its CUBIN from the disk cache, loaded; a
 * cached CUBIN the driver refuses is compiled afresh and replaces it. */
static mn_status library_load(const char *src, cudaLibrary_t *lib)
{
    int arch = mn_cuda_arch();
    char k[33]; /* mn_nvrtc_cubin's key: the same as mn_cuda_source_key's */
    void *cubin = NULL;
    size_t size = 0;
    mn_status s = mn_nvrtc_cubin(src, arch, false, k, &cubin, &size);
    if (s == MN_OK && load(cubin, lib) != MN_OK) {
        /* a cached file this driver refuses: compile afresh and replace it */
        free(cubin);
        cubin = NULL;
        s = mn_nvrtc_cubin(src, arch, true, k, &cubin, &size);
        if (s == MN_OK) s = load(cubin, lib);
    }
    free(cubin);
    return s;
}

mn_status mn_cuda_module_get(const char *src, const char *const *names, mn_cuda_module **out)
{
    char key[33];
    MN_TRY(source_key(src, key));
    for (mn_cuda_module *m = modules; m; m = m->next)
        if (strcmp(m->key, key) == 0) {
            *out = m;
            return MN_OK;
        }
    cudaLibrary_t lib;
    MN_TRY(library_load(src, &lib));
    mn_cuda_module *m = calloc(1, sizeof *m);
    if (!m) {
        (void)cudaLibraryUnload(lib);
        return mn_fail(MN_ERR_OOM, "out of memory for a loaded kernel");
    }
    memcpy(m->key, key, sizeof m->key);
    m->lib = lib;
    mn_status s = MN_OK;
    for (int i = 0; names[i] && s == MN_OK; i++)
        s = i < MN_MODULE_MAX_KERNELS ? MN_CUDA_ST(cudaLibraryGetKernel(&m->k[i], lib, names[i]))
                                      : mn_fail(MN_ERR_ARG, "cuda module: more than %d kernels", MN_MODULE_MAX_KERNELS);
    if (s == MN_OK && strstr(src, MN_SET_CONSTANTS_KERNEL "("))
        s = MN_CUDA_ST(cudaLibraryGetKernel(&m->set_constants, lib, MN_SET_CONSTANTS_KERNEL));
    if (s != MN_OK) {
        (void)cudaLibraryUnload(lib);
        free(m);
        return s;
    }
    m->next = modules;
    modules = m;
    *out = m;
    return MN_OK;
}

mn_status mn_cuda_module_set_constants(const mn_cuda_module *m, const mn_rule *r, cudaStream_t stream)
{
    if (!m->set_constants) return MN_OK;
    mn_rule_constants k;
    mn_cuda_rule_constants(r, &k);
    void *args[1] = {&k}; /* copied at the launch: k may go */
    dim3 one = {1, 1, 1};
    MN_CUDA_CHECK(cudaLaunchKernel((const void *)m->set_constants, one, one, args, 0, stream));
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}
