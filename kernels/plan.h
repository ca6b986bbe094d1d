/* plan.h: which CUDA path runs a rule, and why (DESIGN.md, Fast paths).
 *   fused:   one persistent thread block per memory keeps the gradient
 *            point's weights in shared memory for the whole segment, the
 *            products on tensor cores (kernels/fused_kernel.cuh); layers 1
 *            and 2, dk, dv <= 128, hidden <= 4 max(dk, dv), and the weights
 *            plus one chunk's activations must fit in shared memory. On
 *            sm_90 a plain 2-layer memory that one block cannot hold is
 *            split by hidden units over a cluster of 2, 4 or 8 blocks
 *            (plan.cluster), which sum the output layer's parts through
 *            distributed shared memory (out_norm included, not glu or
 *            newton_schulz); its backward is the large one (the general
 *            one with out_norm).
 *   large:   one big memory (a dimension >= 256): cuBLAS products and fused
 *            elementwise kernels, each step replayed from a CUDA graph
 *            (kernels/engine_large.c).
 *   general: everything else (kernels/rule_kernel.cuh): glu below a
 *            dimension of 256 (the fused path cannot hold its gates), and
 *            out_norm where the rule does not fit the fused path (the large
 *            path does not run it). qk_norm, newton_schulz and lengths
 *            (ragged batches, an input read at run time) run on every path.
 * Plain C, no GPU needed: the REPL shows the plan (rule:plan) on any
 * machine. MNEMO_CUDA_PATH=general|fused|large|auto overrides the choice
 * (tests and benchmarks); a forced path that cannot run the rule is an error
 * that says why. */
#ifndef MN_PLAN_H
#define MN_PLAN_H

#include "../model/engine.h"

typedef enum { MN_PATH_GENERAL, MN_PATH_FUSED, MN_PATH_LARGE } mn_cuda_path;

typedef struct mn_cuda_plan {
    mn_cuda_path path;
    bool forced;          /* chosen by MNEMO_CUDA_PATH */
    int rows;             /* fused: token rows per chunk (a multiple of 16) */
    int threads;          /* fused: threads per block */
    long smem_bytes;      /* fused: dynamic shared memory per block */
    int pdk, pdv, pdh;    /* fused: dk, dv, dh padded to multiples of 16 (pdh: a block's slice, padded) */
    int cluster;          /* blocks a memory: fused over a cluster on sm_90 (split by hidden units), else 1 */
    int min_blocks;       /* fused: blocks an SM the forward is compiled to share (__launch_bounds__), 1 or 2 */
    int dh;               /* fused, cluster > 1: the whole memory's hidden width */
    bool g_shared;        /* fused: the step kernel keeps G in shared memory (counted in smem_bytes), not the workspace */
    bool g_swizzle;       /* fused, with g_shared: G's rows swizzled against the epilogue's bank conflicts (MN_G_SWZ) */
    bool z_pad;           /* fused, bf16: z's rows 4 floats wider (MN_ZPAD, counted in smem_bytes) where that fits */
    bool w16;             /* fused, bf16, W in the workspace: P's and W's weights as bf16 rows (MN_W16, counted) */
    int kunroll;          /* fused: the products' K-loop unroll (1, 2, 4, 8; 0 in the backward's: fused_gemm.cuh's 1) */
    bool with_q;          /* fused forward: the run gives q (set by the caller from its inputs; the plan leaves it false) */
    bool with_lengths;    /* fused forward: the run gives lengths (likewise) */
    char why[384];        /* one line: why this path */
} mn_cuda_plan;

const char *mn_cuda_path_name(mn_cuda_path p);

/* The shared memory a fused block needs (bytes) for the rule at the dims
 * with chunks of rows rows; its layout is kernels/fused_kernel.cuh's. */
long mn_fused_smem_bytes(const mn_rule *r, const mn_dims *d, int rows);

/* The plan for memories = B*H memories of the rule at the dims, on an sm
 * of compute capability arch (90 for sm_90; 0: sm_90). smem_limit: the
 * opt-in shared memory per block of the device (0: what that arch has).
 * Fails only when MNEMO_CUDA_PATH forces a path that cannot run the rule, or
 * names no path. */
mn_status mn_cuda_plan_rule(const mn_rule *r, const mn_dims *d, mn_precision p, int64_t memories, int arch,
                            long smem_limit, mn_cuda_plan *out);

/* Workspace floats per block of the plan's fused kernel (a memory's, or with
 * a cluster one block's slice): the step's gradient unless the plan keeps
 * it in shared memory, and W in the padded layout when the gradient point
 * is the anchor. */
long mn_fused_work_floats(const mn_rule *r, const mn_dims *d, const mn_cuda_plan *pl);

/* The CUDA source of the plan's path (caller frees; NULL with the error
 * set), and the name of the kernel that walks the steps in it. */
char *mn_cuda_plan_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl);
/* The parts of that source: it is mn_cuda_source_for(r, d, p, templates,
 * *defines) with the templates returned (a static list, the same address
 * for every call of a path) and *defines either defs (size bytes, filled
 * in) or NULL. The path's kernels are found by these (kernels/module_memo.h). */
const char *const *mn_cuda_plan_parts(const mn_cuda_plan *pl, char *defs, size_t size, const char **defines);
const char *mn_cuda_plan_step_kernel(const mn_cuda_plan *pl);
#define MN_FUSED_STEP_KERNEL "mn_fused_step_kernel"

/* Which CUDA path runs the backward of a run of the rule (SPEC.md section
 * 7), for a rule that mn_cuda_backward_covers: the fused backward
 * (kernels/fused_grad.cuh; plan.path MN_PATH_FUSED with its rows, threads
 * and shared memory) where the fused forward runs the rule (any refresh:
 * the slots hold the gradient point, W^(s) or the anchor) and the
 * backward's chunk buffers fit beside the weights; else the general
 * backward (kernels/grad_kernel.cuh), which alone runs the backward of
 * out_norm and glu (the reason names them). why says which and why in
 * one line. Where the forward takes the large path, the large backward
 * (kernels/grad_large.c: cuBLAS products batched over the memories; plan.path
 * MN_PATH_LARGE), unless the rule has out_norm, glu or newton_schulz, which
 * only the general backward runs. MNEMO_CUDA_BACKWARD=general|fused|large
 * forces one (fused and large: an error when it cannot); MNEMO_CUDA_PATH=
 * general sends the forward, and so the backward, to the general path,
 * MNEMO_CUDA_PATH=large to the large one. */
mn_status mn_cuda_plan_backward(const mn_rule *r, const mn_dims *d, mn_precision p, int arch, long smem_limit,
                                mn_cuda_plan *out);

/* The shared memory (bytes) of the fused backward's block for chunks of
 * rows rows: the padded weights and the chunk's buffers (fused_grad.cuh). */
long mn_fused_grad_smem_bytes(const mn_rule *r, const mn_dims *d, int rows);

/* Floats of one memory's parameters in the fused kernels' padded layout. */
long mn_fused_padded_floats(const mn_rule *r, const mn_dims *d);

/* The fused backward's CUDA source for the plan (caller frees; NULL with
 * the error set). */
char *mn_cuda_fused_grad_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl);
/* The source of the backward that plan (mn_cuda_plan_backward's) names:
 * fused, large or general, as mn_cuda_plan_source gives the forward's
 * (caller frees; NULL with the error set). */
char *mn_cuda_plan_backward_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl);
#define MN_FUSED_GRAD_KERNEL_NAME "mn_fused_grad_kernel"

/* Whether the backward of a run (SPEC.md section 7) of this rule runs on
 * the GPU, on the general path (kernels/grad_kernel.cuh), for a run on
 * cuda; if not, why (one line into why: the options that keep it on the
 * CPU, whose backward then runs such a run's, "out_norm layernorm: ..."), or when
 * MNEMO_CUDA_BACKWARD=cpu says to keep every backward there. Plain C. */
bool mn_cuda_backward_covers(const mn_rule *r, char *why, size_t len);
/* The same for the rule alone: MNEMO_CUDA_BACKWARD=cpu (tests and
 * comparisons: every backward on the cpu) is not asked. */
bool mn_cuda_backward_rule_covers(const mn_rule *r, char *why, size_t len);

/* The extra #define lines of the fused source (MN_FUSED_ROWS, ...). */
void mn_fused_defines(const mn_cuda_plan *pl, char *buf, size_t len);

#endif
