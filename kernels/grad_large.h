/* grad_large.h: the backward of a run (SPEC.md section 7) on the large path
 * (kernels/plan.h MN_PATH_LARGE): few, big memories, where one thread
 * block per memory (the general backward) leaves the GPU idle. The memory
 * model's products go to cuBLAS, batched over the memories, the work
 * between them to kernels/large_grad.cuh; the recompute is the large
 * forward's own steps (engine_large.h's stepper). kernels/grad_cuda.c
 * calls it where mn_cuda_plan_backward says large. */
#ifndef MN_GRAD_LARGE_H
#define MN_GRAD_LARGE_H

#include "../model/engine.h"

/* What one backward reads and writes, all on the device: the state st at
 * the initial weights (the recompute walks it: its tensors hold garbage
 * after), its materialised inputs in (f32 [B,H,n,...], gates at full
 * shape), the upstream (NULL where absent) and the zeroed gradients. */
typedef struct mn_large_grad_io {
    mn_memory_state *st;
    const mn_segment_inputs *in;
    int64_t n, nsteps, K; /* tokens, steps, steps per checkpoint block */
    const float *dy, *dloss;
    const float *dWf[MN_MAX_PARAMS], *dSf[MN_MAX_PARAMS];
    float *gk, *gv, *gq, *gtheta, *geta, *galpha;
    float *gW[MN_MAX_PARAMS], *gS[MN_MAX_PARAMS];
} mn_large_grad_io;

/* The backward; *bytes: the device memory it took (checkpoints, block
 * states, chunk buffers). Waits for the device before returning. Declines
 * (*declined, nothing done) a run with lengths or with a non-finite number
 * in k, v, q, theta, eta or alpha: the CPU's backward cuts the rows of
 * non-finite inputs one by one (grad.h), which this one does not, and the
 * general backward takes such runs. */
mn_status mn_cuda_large_backward(const mn_large_grad_io *io, mn_precision prec, int64_t *bytes, bool *declined);

/* How the reverse of each checkpoint block runs (walk_block): directly, or
 * captured into a CUDA graph and launched, or the graph replayed. Blocks go
 * last first; every block but the last is full (K steps of step rows). The
 * first full block walked runs directly (cuBLAS and the module warm up
 * outside a capture); the next full one is captured when another block
 * follows it; the later ones replay it where they start at the same place
 * in a refresh block (refresh neither 0 nor step: interval refresh / step
 * steps), else run directly. modes[b] for each of the ceil(nsteps / K)
 * blocks; n: the tokens (a short last step makes its block not full). As
 * planned: a capture that fails at run time leaves every block direct. No
 * GPU needed. */
typedef enum { MN_LG_DIRECT, MN_LG_CAPTURE, MN_LG_REPLAY } mn_large_grad_block_mode;
void mn_large_grad_block_modes(int64_t n, int64_t nsteps, int64_t step, int64_t refresh, int64_t K,
                               mn_large_grad_block_mode *modes);

/* Its kernels' source for a rule at the dims (rule:source, the CI compile
 * test), or NULL with the error set. Caller frees. No GPU needed. */
char *mn_cuda_large_grad_source(const mn_rule *r, const mn_dims *d, mn_precision p);
extern const char *const mn_large_grad_kernel_names[];

#endif
