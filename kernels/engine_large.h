/* engine_large.h: the large-memory path of the CUDA rule engine (DESIGN.md,
 * Fast paths; kernels/plan.h MN_PATH_LARGE): for memories with a dimension
 * of 256 or more, the products through cuBLAS in the state's precision, the
 * elementwise work in a few generated kernels (kernels/large_kernels.cuh),
 * and each step replayed from a CUDA graph. Any rule of SPEC.md runs here
 * (of the v2 options glu and qk_norm; newton_schulz, out_norm and lengths
 * only on the general path: kernels/plan.c), with the outputs of the
 * general path (kernels/engine_cuda.c), so tests can force it
 * (MNEMO_CUDA_PATH=large) on rules of any size. */
#ifndef MN_ENGINE_LARGE_H
#define MN_ENGINE_LARGE_H

#include "../model/engine.h"

/* One segment, as the engine backend's segment_run (model/engine.h): inputs
 * materialised by model/engine.c (f32, contiguous, on the device: k, v, q or
 * empty for q = k, theta [B,H,n], eta and alpha [B,H,nsteps]), outputs
 * allocated (y only when in->want_y). Advances st->steps_done by nsteps.
 * Waits for the device before returning, so a fault is reported here. */
mn_status mn_cuda_large_segment_run(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out,
                                    int64_t n, int64_t nsteps);

/* Retrieval only: y [B,H,rows,dv] = M(q; W) with the current weights. */
mn_status mn_cuda_large_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y);

/* Segments with a full step keep their workspace and their step's CUDA
 * graph for the next segment of the same shape and rule module
 * (kernels/large_keep.c). These give them back
 * (mn_cuda_empty_cache, the allocator's out-of-memory path) and say how
 * many bytes they hold. */
void mn_cuda_large_release(void);
size_t mn_cuda_large_kept_bytes(void);

/* The NVRTC source of the path's kernels for a rule at the dims and
 * precision (rule:source, the CI compile test), or NULL with
 * mn_last_error() set. Caller frees. No GPU needed. */
char *mn_cuda_large_source(const mn_rule *r, const mn_dims *d, mn_precision p);

/* The names of the kernels in that source (extern "C"), NULL-terminated,
 * and the templates it is made of (mn_cuda_source_for's, no defines). */
extern const char *const mn_large_kernel_names[];
extern const char *const mn_large_templates[];

/* The path's sizing, which its backward (kernels/grad_large.c) shares:
 * the rows of each memory in one chunk of a step of rows rows (all
 * memories' chunk rows, and one chunk buffer of the widest layer, bounded),
 * and the blocks of a grid-stride launch over elems elements (a memory's),
 * at most scale times 16 a multiprocessor. */
long long mn_large_chunk_rows(long long memories, long long widest, long long rows);
unsigned mn_large_grid_blocks(long long elems, int scale);

/* The backward's recompute (kernels/grad_large.c): this path's forward, one
 * step at a time, on a device memory state st that the caller reads and
 * rewrites between steps (checkpoints): the same launches as a segment's,
 * so the recomputed states are the forward's own. The state's precision
 * is the forward's. in as for mn_cuda_large_segment_run, n tokens and
 * nsteps steps; no retrieval outputs. Everything runs on the stepper's
 * stream, after the legacy stream's work at open; close waits for it and
 * frees everything (it returns s, or the first error of its own). */
typedef struct mn_large_stepper mn_large_stepper;
mn_status mn_large_stepper_open(mn_memory_state *st, const mn_segment_inputs *in, int64_t n, int64_t nsteps,
                                mn_large_stepper **out);
/* Step s on the state: W, S (and A) become the state after it, its
 * gradient G (unclipped) stays in mn_large_stepper_grad. */
mn_status mn_large_stepper_run(mn_large_stepper *sp, int64_t s);
/* After the caller rewrote the state's tensors (bf16: the operand copies). */
mn_status mn_large_stepper_state_set(mn_large_stepper *sp);
float *mn_large_stepper_grad(const mn_large_stepper *sp, int p); /* [M, numel_p] */
const float *mn_large_stepper_skipped(const mn_large_stepper *sp); /* [M, nsteps]: 1 where a step was skipped */
void *mn_large_stepper_stream(const mn_large_stepper *sp);       /* cudaStream_t */
void *mn_large_stepper_blas(const mn_large_stepper *sp);         /* cublasHandle_t, on that stream */
mn_status mn_large_stepper_close(mn_large_stepper *sp, mn_status s);

#endif
