/* compile_later.c: the background compile's worker thread (kernels/compile_later.h). */
#include "compile_later.h"
#include "nvrtc.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct mn_compile_job {
    char *src;
    int arch;
    bool done; /* under lock */
    mn_status status;
    char error[1024]; /* the compile's message, set on the worker's thread */
    void *cubin;
    size_t size;
    mn_compile_job *next; /* the queue */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER; /* a job queued or finished, or exiting */
static mn_compile_job *head, *tail;                       /* not yet started */
static int pending;                                       /* queued or compiling */
static bool started, exiting, registered;
static pthread_t worker;

static void *work(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!head && !exiting) pthread_cond_wait(&changed, &lock);
        if (exiting) break; /* what is not started is dropped */
        mn_compile_job *job = head;
        head = job->next;
        if (!head) tail = NULL;
        pthread_mutex_unlock(&lock);
        char key[33];
        mn_status s = mn_nvrtc_cubin(job->src, job->arch, MN_TIER_FULL, false, key, &job->cubin, &job->size);
        if (s != MN_OK) snprintf(job->error, sizeof job->error, "%s", mn_last_error());
        pthread_mutex_lock(&lock);
        job->status = s;
        job->done = true;
        pending--;
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* At exit: the compile under way finishes (its CUBIN reaches the disk
 * cache), the queued ones are dropped (marked done with an error; their
 * owners may still hold them), the worker is joined, so NVRTC is idle when
 * the libraries' destructors run. */
static void stop_worker(void)
{
    pthread_mutex_lock(&lock);
    if (!started) {
        pthread_mutex_unlock(&lock);
        return;
    }
    exiting = true;
    for (mn_compile_job *job = head; job; job = job->next) {
        job->status = MN_ERR_INTERRUPTED;
        snprintf(job->error, sizeof job->error, "background compile: dropped, the process is exiting");
        job->done = true;
        pending--;
    }
    head = tail = NULL;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    pthread_join(worker, NULL);
    started = false;
}

/* A forked child has no worker (only the forking thread survives) and owns
 * none of the parent's jobs: it starts afresh. */
static void after_fork_in_child(void)
{
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&changed, NULL);
    head = tail = NULL;
    pending = 0;
    started = exiting = false;
}

mn_compile_job *mn_compile_later(const char *src, int arch)
{
    mn_compile_job *job = calloc(1, sizeof *job);
    if (job) job->src = strdup(src);
    if (!job || !job->src) {
        free(job);
        mn_fail(MN_ERR_OOM, "out of memory queueing a background compile");
        return NULL;
    }
    job->arch = arch;
    pthread_mutex_lock(&lock);
    if (!started) {
        if (exiting || pthread_create(&worker, NULL, work, NULL) != 0) {
            pthread_mutex_unlock(&lock);
            free(job->src);
            free(job);
            mn_fail(MN_ERR_DEVICE, "could not start the background compile's thread");
            return NULL;
        }
        started = true;
        if (!registered) {
            atexit(stop_worker);
            pthread_atfork(NULL, NULL, after_fork_in_child);
            registered = true;
        }
    }
    if (tail) tail->next = job;
    else head = job;
    tail = job;
    pending++;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return job;
}

bool mn_compile_job_done(mn_compile_job *job)
{
    pthread_mutex_lock(&lock);
    bool done = job->done;
    pthread_mutex_unlock(&lock);
    return done;
}

mn_status mn_compile_job_finish(mn_compile_job *job, void **cubin, size_t *size)
{
    pthread_mutex_lock(&lock);
    while (!job->done) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
    mn_status s = job->status;
    if (s == MN_OK) {
        *cubin = job->cubin;
        *size = job->size;
    } else {
        free(job->cubin);
        mn_fail(s, "%s", job->error);
    }
    free(job->src);
    free(job);
    return s;
}

int mn_compile_pending(void)
{
    pthread_mutex_lock(&lock);
    int n = pending;
    pthread_mutex_unlock(&lock);
    return n;
}
