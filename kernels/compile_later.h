/* compile_later.h: full-tier NVRTC compiles on a background thread, so a
 * new rule's first run need not wait for them (it runs on the fast tier,
 * kernels/nvrtc.h). One worker thread takes the jobs in the order given;
 * each compile goes through mn_nvrtc_cubin, so its CUBIN lands in the disk
 * cache as a compile in the foreground would, and a later process finds it
 * there. At exit the process waits for the compile under way (its CUBIN is
 * then cached) and drops the ones not started. Only NVRTC and pthreads: no
 * CUDA runtime here (loading the CUBIN is kernels/cuda_module.c's). */
#ifndef MN_COMPILE_LATER_H
#define MN_COMPILE_LATER_H

#include "../model/mn.h"

typedef struct mn_compile_job mn_compile_job;

/* Queue the full-tier compile of src (copied) for arch. NULL, with the
 * error set, when it cannot be queued (out of memory, no thread): the
 * caller then compiles in the foreground. */
mn_compile_job *mn_compile_later(const char *src, int arch);

/* Whether the job has finished (never blocks). */
bool mn_compile_job_done(mn_compile_job *job);

/* Wait for the job to finish, then hand over its result: MN_OK with *cubin
 * (the caller frees it) and *size, or the compile's error, set as the
 * thread's error. The job is freed: call once. */
mn_status mn_compile_job_finish(mn_compile_job *job, void **cubin, size_t *size);

/* Jobs queued or compiling now. */
int mn_compile_pending(void);

#endif
