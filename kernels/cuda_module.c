/* cuda_module.c: a generated CUDA source to a loaded library (kernels/cuda_module.h). */
#include "cuda_module.h"
#include "cuda.h"
#include "cuda_check.h"
#include "nvrtc.h"

#include <stdlib.h>

mn_status mn_cuda_source_key(const char *src, char key[33])
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

mn_status mn_cuda_library_load(const char *src, cudaLibrary_t *lib)
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
