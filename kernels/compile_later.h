/* compile_later.h: full-tier NVRTC compiles in the background, so that a
 * new rule's first run need not wait for them (it runs on the fast tier,
 * kernels/nvrtc.h). Each compile is a forked child process that goes through
 * mn_nvrtc_cubin, so its CUBIN lands in the disk cache as a compile in the
 * foreground would put it, and leaves with _exit; the parent reaps it and
 * reads the CUBIN from the cache. A compile outlives its parent: a process
 * that exits meanwhile leaves the CUBIN to the next one. Only NVRTC and
 * POSIX: no CUDA runtime here (loading the CUBIN is kernels/cuda_module.c's). */
#ifndef MN_COMPILE_LATER_H
#define MN_COMPILE_LATER_H

#include "../model/mn.h"

typedef struct mn_compile_job mn_compile_job;

/* Whether another compile may start now: at most half the CPUs (one on two
 * or fewer, eight at most) compile at once. */
bool mn_compile_slot_free(void);

/* Start the full-tier compile of src for arch in a child process, or, where
 * another process (or another job of this one) compiles the same source
 * now, watch that compile instead of starting a second (a marker file in the
 * kernel cache names the compiling process). NULL, with the error set, when
 * it cannot start (no writable kernel cache to hand the CUBIN over, no
 * memory, fork failed): the caller compiles in the foreground. */
mn_compile_job *mn_compile_later(const char *src, int arch);

/* Whether the job watches another's compile (it ends when that one does;
 * where that one fails, the caller compiles in the foreground). */
bool mn_compile_job_watching(const mn_compile_job *job);

/* Whether the job has finished (never blocks). */
bool mn_compile_job_done(mn_compile_job *job);

/* Wait for the job to finish, then hand over its CUBIN from the disk cache:
 * MN_OK with *cubin (the caller frees it) and *size, or an error that says
 * how the child failed (NVRTC's message stays with it: rule:kernel_info()
 * compiles the full tier in the foreground and shows it). The job is freed:
 * call once. */
mn_status mn_compile_job_finish(mn_compile_job *job, void **cubin, size_t *size);

/* Compiles started or watched and not yet finished. */
int mn_compile_pending(void);

#endif
