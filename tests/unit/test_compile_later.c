/* test_compile_later.c: the background compile (kernels/compile_later.h)
 * with the real NVRTC, no GPU: a queued job compiles the full tier, writes
 * its CUBIN and .info to the disk cache under the full tier's key and hands
 * over the same bytes as a compile in the foreground; jobs finish in the
 * order queued; the foreground compiles the fast tier while the worker
 * compiles (NVRTC from two threads at once); a source that does not compile
 * comes back as its error with NVRTC's message, and the process goes on; an
 * exit with a job queued behind a running one is clean (a child process). */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "../../kernels/compile_later.h"
#include "../../kernels/nvrtc.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* A kernel with enough in it that a compile takes a while. */
static char *source_with(int terms)
{
    size_t cap = 256 + (size_t)terms * 64;
    char *src = malloc(cap);
    int n = snprintf(src, cap, "extern \"C\" __global__ void k(float *x) {\n  float a = x[threadIdx.x];\n");
    for (int i = 0; i < terms; i++)
        n += snprintf(src + n, cap - (size_t)n, "  a = sinf(a * %d.5f) + cosf(a + %d.25f);\n", i, i);
    snprintf(src + n, cap - (size_t)n, "  x[threadIdx.x] = a;\n}\n");
    return src;
}

static bool file_in(const char *dir, const char *key, const char *ext)
{
    char path[512];
    struct stat sb;
    snprintf(path, sizeof path, "%s/kernels/%s.%s", dir, key, ext);
    return stat(path, &sb) == 0 && sb.st_size > 0;
}

int main(void)
{
    char dir[] = "/tmp/mnemo-later-XXXXXX";
    if (!mkdtemp(dir)) {
        SKIP("compile_later", "no temporary directory");
        return CHECK_DONE();
    }
    setenv("MNEMO_CACHE", dir, 1);
    char *a = source_with(40), *b = source_with(41), *c = source_with(42);
    char ka[33], kb[33];
    mn_nvrtc_key(a, 90, MN_TIER_FULL, ka);
    mn_nvrtc_key(b, 90, MN_TIER_FULL, kb);

    CHECK("compile_later/none_pending", mn_compile_pending() == 0);
    mn_compile_job *ja = mn_compile_later(a, 90), *jb = mn_compile_later(b, 90);
    CHECK("compile_later/queued", ja && jb && mn_compile_pending() >= 1 && mn_compile_pending() <= 2);
    /* the foreground compiles the fast tier of c meanwhile */
    char kc[33];
    void *fast = NULL;
    size_t nfast = 0;
    mn_status s = mn_nvrtc_cubin(c, 90, MN_TIER_FAST, false, kc, &fast, &nfast);
    CHECK("compile_later/foreground_meanwhile", s == MN_OK && nfast > 0);
    free(fast);

    void *cubin_b = NULL, *cubin_a = NULL;
    size_t nb = 0, na = 0;
    /* b was queued after a: when b is done, so is a */
    s = ja && jb ? mn_compile_job_finish(jb, &cubin_b, &nb) : MN_ERR_ARG;
    CHECK("compile_later/b_compiled", s == MN_OK && nb > 0);
    CHECK("compile_later/in_order", ja && mn_compile_job_done(ja));
    s = ja ? mn_compile_job_finish(ja, &cubin_a, &na) : MN_ERR_ARG;
    CHECK("compile_later/a_compiled", s == MN_OK && na > 0);
    CHECK("compile_later/none_pending_after", mn_compile_pending() == 0);
    CHECK("compile_later/cached_under_full_key", file_in(dir, ka, "cubin") && file_in(dir, ka, "info") &&
                                                     file_in(dir, kb, "cubin") &&
                                                     mn_nvrtc_in_cache(a, 90, MN_TIER_FULL));
    /* the same bytes as the foreground's full compile (read from the cache) */
    void *again = NULL;
    size_t nagain = 0;
    char k2[33];
    s = mn_nvrtc_cubin(a, 90, MN_TIER_FULL, false, k2, &again, &nagain);
    CHECK("compile_later/same_cubin", s == MN_OK && nagain == na && memcmp(again, cubin_a, na) == 0 &&
                                          strcmp(k2, ka) == 0);
    free(again);
    free(cubin_a);
    free(cubin_b);

    const char *broken = "extern \"C\" __global__ void k(float *x) { x[0] = not_declared_anywhere; }\n";
    mn_compile_job *jx = mn_compile_later(broken, 90);
    void *none = NULL;
    size_t nnone = 0;
    s = jx ? mn_compile_job_finish(jx, &none, &nnone) : MN_OK;
    CHECK("compile_later/broken_fails", s == MN_ERR_DEVICE && none == NULL);
    CHECK_STR_CONTAINS("compile_later/broken_message", mn_last_error(), "not_declared_anywhere");

    /* exit with one compile running and one queued: the child exits 0 */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char *d = source_with(43), *e = source_with(44);
        (void)mn_compile_later(d, 90);
        (void)mn_compile_later(e, 90);
        exit(0);
    }
    int status = 0;
    CHECK("compile_later/exit_clean", pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                                          WEXITSTATUS(status) == 0);

    free(a);
    free(b);
    free(c);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("    (could not remove %s)\n", dir);
    return CHECK_DONE();
}

#else

int main(void)
{
    SKIP("compile_later", "built without CUDA (no NVRTC)");
    return CHECK_DONE();
}

#endif
