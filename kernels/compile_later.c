/* compile_later.c: full-tier compiles in child processes (kernels/compile_later.h).
 *
 * Why a process and not a thread: NVRTC keeps C++ statics (and loads
 * libnvrtc-builtins) whose destructors run at exit; a thread still compiling
 * when the process exits then runs on destroyed state (seen on the H100
 * machine: tests that ended with a compile under way died with SIGSEGV after
 * their last check). A forked child shares nothing with the parent's exit:
 * it compiles, writes the CUBIN to the disk cache and leaves with _exit
 * (no atexit handlers, no destructors, no CUDA: it never calls the runtime).
 * The parent reaps it with waitpid and reads the CUBIN from the cache. */
#include "compile_later.h"
#include "nvrtc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

struct mn_compile_job {
    char key[33]; /* the full tier's: where the child leaves the CUBIN */
    pid_t pid;
    bool done;
    int wait_status; /* waitpid's, once done */
};

static int pending; /* children not yet reaped */

bool mn_compile_slot_free(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    long cap = cpus > 2 ? cpus / 2 : 1; /* the foreground keeps cores of its own */
    return pending < (cap > 8 ? 8 : cap);
}

mn_compile_job *mn_compile_later(const char *src, int arch)
{
    if (!mn_nvrtc_cache_writable()) {
        mn_fail(MN_ERR_DEVICE, "background compile: no writable kernel cache to hand the CUBIN over");
        return NULL;
    }
    mn_compile_job *job = calloc(1, sizeof *job);
    if (!job) {
        mn_fail(MN_ERR_OOM, "out of memory queueing a background compile");
        return NULL;
    }
    mn_nvrtc_key(src, arch, MN_TIER_FULL, job->key);
    fflush(NULL); /* nothing buffered is written twice */
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        free(job);
        mn_fail(MN_ERR_DEVICE, "background compile: fork failed (%s)", strerror(e));
        return NULL;
    }
    if (pid == 0) {
        /* the child: off the terminal and the parent's pipes (a harness
         * reading them would wait for it), the compile, and out */
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            (void)dup2(null, STDIN_FILENO);
            (void)dup2(null, STDOUT_FILENO);
            (void)dup2(null, STDERR_FILENO);
        }
        char key[33];
        void *cubin = NULL;
        size_t size = 0;
        mn_status s = mn_nvrtc_cubin(src, arch, MN_TIER_FULL, false, key, &cubin, &size);
        _exit(s == MN_OK && mn_nvrtc_in_cache(key) ? 0 : 1);
    }
    job->pid = pid;
    pending++;
    return job;
}

/* Reap the child: without blocking (false when it still runs) or waiting. */
static bool reap(mn_compile_job *job, bool block)
{
    if (job->done) return true;
    pid_t r;
    do r = waitpid(job->pid, &job->wait_status, block ? 0 : WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == 0) return false;
    if (r < 0) job->wait_status = -1; /* reaped elsewhere (a SIGCHLD handler): the cache tells */
    job->done = true;
    pending--;
    return true;
}

bool mn_compile_job_done(mn_compile_job *job) { return reap(job, false); }

mn_status mn_compile_job_finish(mn_compile_job *job, void **cubin, size_t *size)
{
    reap(job, true);
    mn_status s;
    if (job->wait_status == -1 || (WIFEXITED(job->wait_status) && WEXITSTATUS(job->wait_status) == 0))
        s = mn_nvrtc_read_cached(job->key, cubin, size)
                ? MN_OK
                : mn_fail(MN_ERR_DEVICE, "background compile: its CUBIN is not in the kernel cache");
    else if (WIFSIGNALED(job->wait_status))
        s = mn_fail(MN_ERR_DEVICE, "background compile: the compiling process died of signal %d",
                    WTERMSIG(job->wait_status));
    else /* NVRTC's message went with the child: rule:kernel_info compiles the full tier and says */
        s = mn_fail(MN_ERR_DEVICE, "background compile: the full tier did not compile (rule:kernel_info() says why)");
    free(job);
    return s;
}

int mn_compile_pending(void) { return pending; }
