/* compile_later.c: full-tier compiles in child processes (kernels/compile_later.h).
 *
 * Why a process and not a thread: NVRTC keeps C++ statics (and loads
 * libnvrtc-builtins) whose destructors run at exit; a thread still compiling
 * when the process exits then runs on destroyed state (seen on the H100
 * machine: tests that ended with a compile under way died with SIGSEGV after
 * their last check). A forked child shares nothing with the parent's exit:
 * it compiles, writes the CUBIN to the disk cache and leaves with _exit
 * (no atexit handlers, no destructors, no CUDA: it never calls the runtime).
 * The parent reaps it with waitpid and reads the CUBIN from the cache.
 *
 * One compile of a source at a time, across processes: the compiling
 * process is named in a marker file beside the CUBIN to be (KEY.pending in
 * the kernel cache, holding its pid), made with O_EXCL before the fork and
 * removed by the child once the CUBIN is in place (or it failed). A process
 * that finds a live marker for the same key (a sweep's other processes, or
 * this one's other module of the same source) watches that compile instead
 * of starting a second one: its job is done when the CUBIN appears or the
 * marker goes. A marker whose process is gone, or older than
 * STALE_MARKER_S, is taken over. */
#include "compile_later.h"
#include "nvrtc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A marker older than this names no compile still running: a full compile
 * takes seconds (P1's fused backward, the longest, 6-15 s), and a marker
 * left by a compile killed with its parent may name a pid reused since;
 * a watcher waits at most this long before it compiles itself (taking a
 * marker over too early costs a second compile, no more). */
#define STALE_MARKER_S 120
/* An empty marker (its pid not written yet) younger than this is live. */
#define FRESH_MARKER_S 10

struct mn_compile_job {
    char key[33]; /* the full tier's: where the child leaves the CUBIN */
    pid_t pid;    /* the child, or the process watched */
    bool watch;   /* another's compile: not our child, never waited for */
    bool done;
    int wait_status; /* waitpid's, once done */
};

static int pending;  /* children not yet reaped */
static int watching; /* other compiles watched, not yet finished */

static bool marker_path(const char key[33], char *path, size_t len)
{
    return mn_nvrtc_cache_file(key, "pending", path, len);
}

/* Whether the marker at path names a compile still under way; *pid: the
 * process it names (0 where not written yet). */
static bool marker_live(const char *path, pid_t *pid)
{
    *pid = 0;
    struct stat st;
    if (stat(path, &st) != 0) return false;
    const time_t age = time(NULL) - st.st_mtime;
    if (age > STALE_MARKER_S) return false;
    FILE *f = fopen(path, "r");
    long v = 0;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1) v = 0;
        fclose(f);
    }
    if (v <= 0) return age <= FRESH_MARKER_S; /* being written */
    *pid = (pid_t)v;
    return kill(*pid, 0) == 0 || errno == EPERM;
}

/* Claim the key's marker: an open descriptor to write the compiling pid
 * into, -1 where another live compile holds it (*other: its pid) or no
 * marker can be made (*other stays -1: compile without one). */
static int marker_claim(const char *path, pid_t *other)
{
    *other = -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0644);
        if (fd >= 0) return fd;
        if (errno != EEXIST) return -1;
        pid_t pid;
        if (marker_live(path, &pid)) {
            *other = pid;
            return -1;
        }
        (void)unlink(path); /* stale: its process is gone */
    }
    return -1;
}

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
    char marker[4200];
    pid_t other = -1;
    const int fd = marker_path(job->key, marker, sizeof marker) ? marker_claim(marker, &other) : -1;
    if (other >= 0) { /* another process compiles this source now: watch it */
        job->pid = other;
        job->watch = true;
        watching++;
        return job;
    }
    fflush(NULL); /* nothing buffered is written twice */
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
            (void)unlink(marker);
        }
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
        const bool ok = s == MN_OK && mn_nvrtc_in_cache(key);
        if (fd >= 0) (void)unlink(marker); /* after the CUBIN: a watcher that sees no marker looks there */
        _exit(ok ? 0 : 1);
    }
    if (fd >= 0) {
        char line[32];
        const int n = snprintf(line, sizeof line, "%ld\n", (long)pid);
        if (write(fd, line, (size_t)n) != n) (void)unlink(marker); /* unreadable: no marker rather than a wrong one */
        close(fd);
    }
    job->pid = pid;
    pending++;
    return job;
}

/* Whether the watched compile has ended: its CUBIN is in the cache, or its
 * marker is gone or names no live compile (it failed or died). */
static bool watched_ended(const mn_compile_job *job)
{
    if (mn_nvrtc_in_cache(job->key)) return true;
    char marker[4200];
    pid_t pid;
    return !marker_path(job->key, marker, sizeof marker) || !marker_live(marker, &pid);
}

/* Reap the child: without blocking (false when it still runs) or waiting;
 * a watched compile is polled. */
static bool reap(mn_compile_job *job, bool block)
{
    if (job->done) return true;
    if (job->watch) {
        const struct timespec tick = {0, 10 * 1000 * 1000};
        while (!watched_ended(job)) {
            if (!block) return false;
            nanosleep(&tick, NULL);
        }
        job->done = true;
        job->wait_status = -1; /* the cache tells */
        watching--;
        return true;
    }
    pid_t r;
    do r = waitpid(job->pid, &job->wait_status, block ? 0 : WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == 0) return false;
    if (r < 0) job->wait_status = -1; /* reaped elsewhere (a SIGCHLD handler): the cache tells */
    job->done = true;
    pending--;
    if (r > 0 && WIFSIGNALED(job->wait_status)) { /* killed before it could remove its marker */
        char marker[4200];
        pid_t pid;
        if (marker_path(job->key, marker, sizeof marker) && !marker_live(marker, &pid) && pid == job->pid)
            (void)unlink(marker);
    }
    return true;
}

bool mn_compile_job_done(mn_compile_job *job) { return reap(job, false); }

mn_status mn_compile_job_finish(mn_compile_job *job, void **cubin, size_t *size)
{
    reap(job, true);
    mn_status s;
    if (job->wait_status == -1 || (WIFEXITED(job->wait_status) && WEXITSTATUS(job->wait_status) == 0))
        s = mn_nvrtc_read_cached(job->key, cubin, size) ? MN_OK
            : job->watch ? mn_fail(MN_ERR_DEVICE,
                                   "background compile: process %ld's compile of the same source ended without a CUBIN",
                                   (long)job->pid)
                         : mn_fail(MN_ERR_DEVICE, "background compile: its CUBIN is not in the kernel cache");
    else if (WIFSIGNALED(job->wait_status))
        s = mn_fail(MN_ERR_DEVICE, "background compile: the compiling process died of signal %d",
                    WTERMSIG(job->wait_status));
    else /* NVRTC's message went with the child: rule:kernel_info compiles the full tier and says */
        s = mn_fail(MN_ERR_DEVICE, "background compile: the full tier did not compile (rule:kernel_info() says why)");
    free(job);
    return s;
}

bool mn_compile_job_watching(const mn_compile_job *job) { return job->watch; }

int mn_compile_pending(void) { return pending + watching; }
