/* nvrtc_cubin.h: a CUDA source compiled by NVRTC to a cubin, for the unit
 * tests that run a probe kernel of their own (test_wgmma, test_scalar_math).
 * Include after nvrtc.h, in a build with CUDA. */
#ifndef MN_TEST_NVRTC_CUBIN_H
#define MN_TEST_NVRTC_CUBIN_H

#include <stdio.h>
#include <stdlib.h>

/* The cubin of src (malloc'd, its length in *size), or NULL with the reason
 * in why. Where log is not NULL, *log gets NVRTC's log (malloc'd, or NULL
 * where it is empty), for the caller to read ptxas's remarks. */
static void *test_nvrtc_cubin(const char *src, const char *name, const char *const *opts, int nopts, size_t *size,
                              char **log, char *why, size_t wlen)
{
    nvrtcProgram prog;
    nvrtcResult r = nvrtcCreateProgram(&prog, src, name, 0, NULL, NULL);
    if (log) *log = NULL;
    if (r != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcCreateProgram: %s", nvrtcGetErrorString(r));
        return NULL;
    }
    r = nvrtcCompileProgram(prog, nopts, opts);
    size_t loglen = 0;
    char *text = NULL;
    if (nvrtcGetProgramLogSize(prog, &loglen) == NVRTC_SUCCESS && loglen > 1 && (text = malloc(loglen))) {
        if (nvrtcGetProgramLog(prog, text) != NVRTC_SUCCESS) text[0] = 0;
    }
    void *cubin = NULL;
    if (r != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcCompileProgram: %s: %.400s", nvrtcGetErrorString(r), text ? text : "");
    } else if (nvrtcGetCUBINSize(prog, size) != NVRTC_SUCCESS || !(cubin = malloc(*size)) ||
               nvrtcGetCUBIN(prog, cubin) != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcGetCUBIN failed");
        free(cubin);
        cubin = NULL;
    }
    nvrtcDestroyProgram(&prog);
    if (log) *log = text;
    else free(text);
    return cubin;
}

#endif
