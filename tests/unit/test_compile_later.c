/* test_compile_later.c: the background compile (kernels/compile_later.h)
 * with the real NVRTC, no GPU: a job compiles the full tier in a child
 * process, which writes its CUBIN and .info to the disk cache under the full
 * tier's key, and hands over the same bytes as a compile in the foreground;
 * the foreground compiles the fast tier meanwhile; a source that does not
 * compile comes back as an error, and the process goes on; a compile
 * outlives the process that started it (its CUBIN reaches the cache after
 * that process has exited); with SIGCHLD ignored a job still ends with its
 * CUBIN; a second job of a source under compile watches the first (its
 * marker file names the compiling process) and ends with the same CUBIN; a
 * marker whose process is gone is taken over; a watched compile that ends
 * without a CUBIN is an error naming its process; no writable cache: no job. */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "../../kernels/compile_later.h"
#include "../../kernels/nvrtc.h"

#include <signal.h>
#include <stdbool.h>
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

    CHECK("compile_later/none_pending", mn_compile_pending() == 0 && mn_compile_slot_free());
    mn_compile_job *ja = mn_compile_later(a, 90), *jb = mn_compile_later(b, 90);
    CHECK("compile_later/started", ja && jb && mn_compile_pending() == 2);
    /* the foreground compiles the fast tier of c meanwhile */
    char kc[33];
    void *fast = NULL;
    size_t nfast = 0;
    mn_status s = mn_nvrtc_cubin(c, 90, MN_TIER_FAST, false, kc, &fast, &nfast);
    CHECK("compile_later/foreground_meanwhile", s == MN_OK && nfast > 0);
    free(fast);

    void *cubin_b = NULL, *cubin_a = NULL;
    size_t nb = 0, na = 0;
    s = jb ? mn_compile_job_finish(jb, &cubin_b, &nb) : MN_ERR_ARG;
    CHECK("compile_later/b_compiled", s == MN_OK && nb > 0);
    s = ja ? mn_compile_job_finish(ja, &cubin_a, &na) : MN_ERR_ARG;
    CHECK("compile_later/a_compiled", s == MN_OK && na > 0);
    CHECK("compile_later/none_pending_after", mn_compile_pending() == 0);
    CHECK("compile_later/cached_under_full_key", file_in(dir, ka, "cubin") && file_in(dir, ka, "info") &&
                                                     file_in(dir, kb, "cubin") &&
                                                     mn_nvrtc_in_cache(ka));
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
    CHECK_STR_CONTAINS("compile_later/broken_message", mn_last_error(), "did not compile");
    CHECK("compile_later/none_pending_at_end", mn_compile_pending() == 0);

    /* a process that starts a compile and exits at once: the CUBIN reaches
     * the cache afterwards */
    char *d = source_with(43), kd[33];
    mn_nvrtc_key(d, 90, MN_TIER_FULL, kd);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) exit(mn_compile_later(d, 90) ? 0 : 1);
    int status = 0;
    bool exited = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    CHECK("compile_later/exit_at_once", exited && !file_in(dir, kd, "cubin"));
    for (int i = 0; i < 600 && !file_in(dir, kd, "cubin"); i++) usleep(100000); /* up to a minute */
    CHECK("compile_later/outlives_its_process", exited && file_in(dir, kd, "cubin") && file_in(dir, kd, "info"));
    free(d);

    /* SIGCHLD ignored (a host program's choice): the child cannot be waited
     * for, and the job still ends with its CUBIN, once the child is gone */
    char *e = source_with(44), ke[33];
    mn_nvrtc_key(e, 90, MN_TIER_FULL, ke);
    signal(SIGCHLD, SIG_IGN);
    mn_compile_job *je = mn_compile_later(e, 90);
    void *cubin_e = NULL;
    size_t ne = 0;
    s = je ? mn_compile_job_finish(je, &cubin_e, &ne) : MN_ERR_ARG;
    signal(SIGCHLD, SIG_DFL);
    CHECK("compile_later/sigchld_ignored", s == MN_OK && ne > 0 && mn_nvrtc_in_cache(ke));
    free(cubin_e);
    free(e);

    /* the same source twice while the first compiles: the second job
     * watches the first's compile (no second child) and gets its CUBIN */
    char *f = source_with(45), kf[33];
    mn_nvrtc_key(f, 90, MN_TIER_FULL, kf);
    mn_compile_job *j1 = mn_compile_later(f, 90), *j2 = mn_compile_later(f, 90);
    CHECK("compile_later/marker_while_compiling", j1 && file_in(dir, kf, "pending"));
    CHECK("compile_later/second_watches", j1 && j2 && !mn_compile_job_watching(j1) && mn_compile_job_watching(j2) &&
                                              mn_compile_pending() == 2);
    void *c1 = NULL, *c2 = NULL;
    size_t n1 = 0, n2 = 0;
    mn_status s2 = j2 ? mn_compile_job_finish(j2, &c2, &n2) : MN_ERR_ARG;
    mn_status s1 = j1 ? mn_compile_job_finish(j1, &c1, &n1) : MN_ERR_ARG;
    CHECK("compile_later/watch_gets_cubin", s1 == MN_OK && s2 == MN_OK && n2 > 0 && n1 == n2 &&
                                                memcmp(c1, c2, n1) == 0);
    CHECK("compile_later/marker_removed", !file_in(dir, kf, "pending") && mn_compile_pending() == 0);
    free(c1);
    free(c2);
    free(f);

    /* a marker left by a process that is gone: taken over */
    char *g = source_with(46), kg[33], marker[600];
    mn_nvrtc_key(g, 90, MN_TIER_FULL, kg);
    fflush(stdout);
    pid_t gone = fork();
    if (gone == 0) _exit(0);
    if (gone > 0) waitpid(gone, &status, 0);
    snprintf(marker, sizeof marker, "%s/kernels/%s.pending", dir, kg);
    FILE *mf = fopen(marker, "w");
    if (mf) {
        fprintf(mf, "%ld\n", (long)gone);
        fclose(mf);
    }
    mn_compile_job *jg = mn_compile_later(g, 90);
    CHECK("compile_later/stale_marker_taken_over", mf && jg && !mn_compile_job_watching(jg));
    void *cg = NULL;
    size_t ng = 0;
    s = jg ? mn_compile_job_finish(jg, &cg, &ng) : MN_ERR_ARG;
    CHECK("compile_later/stale_marker_compiled", s == MN_OK && ng > 0 && !file_in(dir, kg, "pending"));
    free(cg);
    free(g);

    /* a live process's marker whose compile never delivers: the job watches
     * it, and once that process is gone, fails naming it */
    char *h = source_with(47), kh[33];
    mn_nvrtc_key(h, 90, MN_TIER_FULL, kh);
    fflush(stdout);
    pid_t sleeper = fork();
    if (sleeper == 0) {
        sleep(60);
        _exit(0);
    }
    snprintf(marker, sizeof marker, "%s/kernels/%s.pending", dir, kh);
    mf = fopen(marker, "w");
    if (mf) {
        fprintf(mf, "%ld\n", (long)sleeper);
        fclose(mf);
    }
    mn_compile_job *jh = mn_compile_later(h, 90);
    CHECK("compile_later/live_marker_watched", mf && jh && mn_compile_job_watching(jh) && !mn_compile_job_done(jh));
    if (sleeper > 0) {
        kill(sleeper, SIGKILL);
        waitpid(sleeper, &status, 0);
    }
    void *ch = NULL;
    size_t nh = 0;
    s = jh ? mn_compile_job_finish(jh, &ch, &nh) : MN_OK;
    CHECK("compile_later/watched_failure", s == MN_ERR_DEVICE && ch == NULL && mn_compile_pending() == 0);
    char who[64];
    snprintf(who, sizeof who, "process %ld's compile", (long)sleeper);
    CHECK_STR_CONTAINS("compile_later/watched_failure_message", mn_last_error(), who);
    free(h);

    /* a cache that cannot be written: no job, and the error says so */
    setenv("MNEMO_CACHE", "/proc/mnemo-no-cache-here", 1);
    mn_compile_job *jn = mn_compile_later(a, 90);
    CHECK("compile_later/no_cache_no_job", jn == NULL);
    CHECK_STR_CONTAINS("compile_later/no_cache_message", mn_last_error(), "no writable kernel cache");

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
