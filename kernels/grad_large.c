/* grad_large.c: the backward of a run on the large path (grad_large.h), the
 * statement of model/grad_cpu.c's walk with every memory in step: the
 * products of mlp_grad_cpu.c's passes are cuBLAS products batched over the
 * M memories (in the run's precision: fp32, or tf32 and bf16 tensor cores
 * on fp32 operands), the work between them kernels/large_grad.cuh's.
 *
 *   1. the forward from the initial state, the large path's own steps
 *      (engine_large.h's stepper), keeping (W, S, and the anchor unless
 *      refresh = step) of every memory at checkpoints every K steps;
 *   2. for each block of K steps, last block first: restore its
 *      checkpoint, recompute its steps keeping W^(s), S^(s), the anchor and
 *      G_s of each, then walk them in reverse with the adjoints dW, dS, dA
 *      (step_reverse in grad_cpu.c):
 *        retrieval at W^(s+1)   the step's last row (retrieve = after)
 *        update and clip        per slice of the parameters, then the
 *                               sums per memory, then the clip's adjoint
 *        step gradient          forward, tangent and reverse at the
 *                               gradient point, in chunks of rows
 *        retrieval at W^(s)     the other rows
 *        refresh                dW += dA at a refresh block's first step.
 *
 * The reverse of a block is the same launches for every full block: in
 * a captured block the kernels count steps and rows from the block's first
 * step, which the device holds, and the products touch only the block's
 * buffers. So one block's reverse is captured into a CUDA graph and
 * replayed for the others (walk_block); the recompute replays the forward's
 * own graph of a step. Direct launches (a run of few blocks, the first full
 * block, the last) take the step and row as arguments.
 *
 * A state "image" is one tensor of every memory, parameter after parameter
 * (large_grad.cuh). A skipped step (per memory) gets dG = 0, which makes its
 * update the identity and leaves only the loss output's terms, as the CPU's
 * dG = NULL. What this walk does not do is the CPU's cutting of rows with
 * non-finite inputs, and ragged batches: mn_cuda_large_backward declines
 * such runs (*declined), and the general backward takes them.
 *
 * Everything runs on the stepper's stream with its cuBLAS handle and
 * workspace; the backward's own device memory is one block, freed on every
 * path. */
#include "grad_large.h"
#include "engine_large.h"
#include "codegen.h"
#include "cuda.h"
#include "cuda_check.h"
#include "cuda_module.h"
#include "large_grad.cuh" /* its first part is C: the argument structs */
#include "../model/grad.h"

#include <cublas_v2.h>
#include <stdlib.h>
#include <string.h>

enum { LK_FINITE, LK_STAGE, LK_ADDROWS, LK_ACT, LK_TANGENT, LK_LOSS, LK_SEED, LK_COLPART, LK_COLSUM, LK_REVACT,
       LK_UPDATE, LK_CLIP, LK_DG, LK_REFRESH, LK_FINAL, LK_BASE, LK_COUNT };
const char *const mn_large_grad_kernel_names[] = {
    "mn_lgrad_finite_kernel", "mn_lgrad_stage_kernel",  "mn_lgrad_addrows_kernel", "mn_lgrad_act_kernel",
    "mn_lgrad_tangent_kernel", "mn_lgrad_loss_kernel",  "mn_lgrad_seed_kernel",    "mn_lgrad_colpart_kernel",
    "mn_lgrad_colsum_kernel", "mn_lgrad_reverse_act_kernel", "mn_lgrad_update_kernel", "mn_lgrad_clip_kernel",
    "mn_lgrad_dg_kernel", "mn_lgrad_refresh_kernel", "mn_lgrad_final_kernel", "mn_lgrad_base_kernel", NULL};

char *mn_cuda_large_grad_source(const mn_rule *r, const mn_dims *d, mn_precision p)
{
    static const char *const parts[] = {"large_common", "large_grad", NULL};
    return mn_cuda_grad_source_for(r, d, p, parts, NULL);
}

typedef struct lg {
    const mn_large_grad_io *io;
    mn_large_stepper *sp;
    cudaStream_t stream;
    cublasHandle_t blas;
    mn_cuda_module *mod;
    mn_lgrad_kargs a;
    mn_precision prec;
    int L, per, np, refresh, step;
    int parts; /* images a checkpoint keeps: W, S and, unless refresh = step, the anchor */
    bool clip_scales; /* a norm-type clip: its adjoint needs the update's sums first */
    long long M, dk, dv, dh, wide, CR, K, nblocks, n, nsteps;
    long long image; /* floats of an image: M times a memory's parameters */
    /* while a block is captured: its first step, which the launches' steps
     * and rows count from (a.base, the device's copy, is set); 0 otherwise */
    long long s0;
    long long *base; /* the device's first step of a replayed block */
    /* a whole block's reverse captured (walk_block), replayed for the blocks
     * of the same shape: full, and at the same place in the refresh blocks */
    cudaGraphExec_t graph;
    mn_large_grad_block_mode *modes; /* each block's, planned (mn_large_grad_block_modes) */
    float *ck, *Wb, *Sb, *Ab, *Gb;                /* checkpoints, the block's states */
    float *X, *Y, *U, *ZB, *ZDB, *HB, *HDB;      /* chunk buffers */
    float *Z[MN_MAX_LAYERS], *H[MN_MAX_LAYERS], *D1[MN_MAX_LAYERS], *D2[MN_MAX_LAYERS];
    float *ZD[MN_MAX_LAYERS], *HD[MN_MAX_LAYERS]; /* hidden layers' forward and tangent */
    void *work;
    size_t work_bytes;
} lg;

static float *f32(const mn_tensor *t) { return t->storage ? (float *)mn_tensor_data(t) : NULL; }

/* Parameter p of an image (memory 0's; memory m's numel[p] later). */
static float *at(const lg *G, const float *img, int p) { return (float *)img + G->a.ioff[p]; }
static int wparam(const lg *G, int i) { return i * G->per; }
static int bparam(const lg *G, int i) { return i * G->per + 1; }
static long long layer_in(const lg *G, int i) { return mn_layer_in(i, G->dk, G->dh); }
static long long layer_out(const lg *G, int i) { return mn_layer_out(i, G->L, G->dv, G->dh); }

static long long step_rows(const lg *G, long long s)
{
    return s * G->step + G->step <= G->n ? G->step : G->n - s * G->step;
}

static bool refresh_start(const lg *G, long long s)
{
    return G->refresh > 0 && s % (G->refresh / G->step) == 0;
}

/* ---- launches and products ---- */

static mn_status launch_block(const lg *G, int k, dim3 grid, dim3 block, const mn_lgrad_op *o)
{
    void *args[2] = {(void *)&G->a, (void *)o};
    return MN_CUDA_ST(cudaLaunchKernel((const void *)G->mod->k[k], grid, block, args, 0, G->stream));
}

static mn_status launch(const lg *G, int k, dim3 grid, const mn_lgrad_op *o)
{
    return launch_block(G, k, grid, (dim3){MN_LARGE_THREADS, 1, 1}, o);
}

/* Grid-stride over elems elements of each memory: (x, M). */
static dim3 grid_elems(const lg *G, long long elems)
{
    dim3 g = {mn_large_grid_blocks(elems, 1), (unsigned)G->M, 1};
    return g;
}

/* Grid-stride over elems elements in all (whole images, inputs): (x). */
static dim3 grid_flat(long long elems)
{
    dim3 g = {mn_large_grid_blocks(elems, 4), 1, 1};
    return g;
}

/* Row-major C [m x n] = op(A) [m x k] op(B) [k x n] + beta C for every
 * memory (strides sa, sb, sc between memories). cuBLAS is column-major,
 * where a row-major matrix is its transpose: it computes C^T = op(B)^T
 * op(A)^T, so the operands trade places (kernels/blas.c does the same).
 * fp32 operands; tf32 and bf16 let cuBLAS round them for its tensor cores. */
static mn_status mm(const lg *G, bool ta, bool tb, long long m, long long n, long long k, const float *A, long long lda,
                    long long sa, const float *B, long long ldb, long long sb, float beta, float *C, long long ldc,
                    long long sc)
{
    const float one = 1.0f;
    cublasComputeType_t ct = G->prec == MN_PREC_TF32   ? CUBLAS_COMPUTE_32F_FAST_TF32
                             : G->prec == MN_PREC_BF16 ? CUBLAS_COMPUTE_32F_FAST_16BF
                                                       : CUBLAS_COMPUTE_32F;
    return MN_CUBLAS_ST(cublasGemmStridedBatchedEx(
        G->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, B,
        CUDA_R_32F, (int)ldb, sb, A, CUDA_R_32F, (int)lda, sa, &beta, C, CUDA_R_32F, (int)ldc, sc, (int)G->M, ct,
        CUBLAS_GEMM_DEFAULT));
}

/* Chunk [cr x out] = in [cr x ni] times layer i's weights (of an image)
 * transposed, (+)= with beta. */
static mn_status mm_layer(const lg *G, int i, const float *in, const float *img, long long cr, float beta, float *out)
{
    const long long ni = layer_in(G, i), no = layer_out(G, i), ld = G->a.ld;
    return mm(G, false, true, cr, no, ni, in, ni, ld, at(G, img, wparam(G, i)), ni, no * ni, beta, out, no, ld);
}

/* Layer i's weight adjoint in an image += dz^T in, over the cr rows. */
static mn_status mm_grad(const lg *G, int i, const float *dz, const float *in, long long cr, float *img)
{
    const long long ni = layer_in(G, i), no = layer_out(G, i), ld = G->a.ld;
    return mm(G, true, false, no, ni, cr, dz, no, ld, in, ni, ld, 1.0f, at(G, img, wparam(G, i)), ni, no * ni);
}

/* dh [cr x ni] (+)= dz [cr x no] times layer i's weights (of an image). */
static mn_status mm_back(const lg *G, int i, const float *dz, const float *img, long long cr, float beta, float *dh)
{
    const long long ni = layer_in(G, i), no = layer_out(G, i), ld = G->a.ld;
    return mm(G, false, false, cr, ni, no, dz, no, ld, at(G, img, wparam(G, i)), ni, no * ni, beta, dh, ni, ld);
}

static mn_status stage(const lg *G, const float *x, long long t, long long cr)
{
    mn_lgrad_op o = {0};
    o.in = x;
    o.out = G->X;
    o.t = t - G->s0 * G->step;
    o.rows = cr;
    o.width = G->dk;
    return launch(G, LK_STAGE, grid_elems(G, cr * G->dk), &o);
}

static mn_status addrows(const lg *G, const float *src, float *g, long long t, long long cr)
{
    mn_lgrad_op o = {0};
    o.in = src;
    o.g = g;
    o.t = t - G->s0 * G->step;
    o.rows = cr;
    o.width = G->dk;
    return launch(G, LK_ADDROWS, grid_elems(G, cr * G->dk), &o);
}

static mn_status colsum(const lg *G, const float *src, long long cr, long long width, float *gb)
{
    mn_lgrad_op o = {0};
    o.in = src;
    o.g = gb;
    o.rows = cr;
    o.width = width;
    dim3 parts = {(unsigned)((width + 31) / 32), (unsigned)((cr + MN_LGRAD_COL_ROWS - 1) / MN_LGRAD_COL_ROWS),
                  (unsigned)G->M};
    MN_TRY(launch_block(G, LK_COLPART, parts, (dim3){32, 8, 1}, &o));
    dim3 grid = {(unsigned)((width + MN_LARGE_THREADS - 1) / MN_LARGE_THREADS), (unsigned)G->M, 1};
    return launch(G, LK_COLSUM, grid, &o);
}

/* The hidden layers at the weights of img on the cr rows in X: z, h,
 * phi'(z), and phi''(z) where second (the step gradient's tangent needs
 * it); the last layer's product into Y where last. */
static mn_status forward(const lg *G, const float *img, long long cr, bool second, bool last)
{
    const float *in = G->X;
    for (int i = 0; i < G->L; i++) {
        if (i == G->L - 1) return last ? mm_layer(G, i, in, img, cr, 0.0f, G->Y) : MN_OK;
        MN_TRY(mm_layer(G, i, in, img, cr, 0.0f, G->Z[i]));
        mn_lgrad_op o = {0};
        o.out = G->Z[i];
        o.out2 = G->H[i];
        o.out3 = G->D1[i];
        o.g = second ? G->D2[i] : NULL;
        o.bias = G->per == 2 ? at(G, img, bparam(G, i)) : NULL;
        o.rows = cr;
        o.width = G->dh;
        MN_TRY(launch(G, LK_ACT, grid_elems(G, cr * G->dh), &o));
        in = G->H[i];
    }
    return MN_OK;
}

/* A retrieval output's adjoint (mn_mlp_vjp) at the weights of img for rows
 * rb .. re - 1 of step s, read from xq (k or q), into dW and gxq. */
static mn_status vjp(const lg *G, const float *img, const float *xq, float *gxq, long long s, long long rb,
                     long long re)
{
    for (long long r0 = rb; r0 < re; r0 += G->CR) {
        const long long cr = re - r0 < G->CR ? re - r0 : G->CR, t = s * G->step + r0;
        MN_TRY(stage(G, xq, t, cr));
        MN_TRY(forward(G, img, cr, false, false));
        mn_lgrad_op o = {0};
        o.out = G->ZB;
        o.g = gxq;
        o.t = t - G->s0 * G->step;
        o.rows = cr;
        MN_TRY(launch(G, LK_SEED, grid_elems(G, cr * G->dv), &o));
        for (int i = G->L - 1; i >= 0; i--) {
            const long long ni = layer_in(G, i), no = layer_out(G, i);
            MN_TRY(mm_grad(G, i, G->ZB, i == 0 ? G->X : G->H[i - 1], cr, G->a.dW));
            if (G->per == 2) MN_TRY(colsum(G, G->ZB, cr, no, at(G, G->a.dW, bparam(G, i))));
            MN_TRY(mm_back(G, i, G->ZB, img, cr, 0.0f, G->HB));
            if (i == 0) {
                MN_TRY(addrows(G, G->HB, gxq, t, cr));
                break;
            }
            memset(&o, 0, sizeof o);
            o.in = G->HB;
            o.d1 = G->D1[i - 1];
            o.out = G->ZB;
            o.rows = cr;
            o.width = ni;
            MN_TRY(launch(G, LK_REVACT, grid_elems(G, cr * ni), &o));
        }
    }
    return MN_OK;
}

/* The adjoint of step s's gradient at the gradient point (image A) in the
 * direction dG (mn_mlp_step_adjoint): into dA, gk, gv, gtheta. The step's
 * rows below merge_rows are retrievals whose outputs are this forward's (q
 * = k, A = W^(s)): their dy joins the loss's adjoint, as grad_cpu.c merges
 * them. */
static mn_status step_adjoint(const lg *G, const float *A, long long s, long long merge_rows)
{
    const float *dG = G->a.dG;
    /* the gradient point's adjoint: with refresh = step every step opens a
     * refresh block, where dA joins dW at once, so it goes there directly */
    float *dA = G->refresh == G->step ? G->a.dW : G->a.dA;
    const long long rows = step_rows(G, s);
    const int L = G->L;
    for (long long r0 = 0; r0 < rows; r0 += G->CR) {
        const long long cr = rows - r0 < G->CR ? rows - r0 : G->CR, t = s * G->step + r0;
        MN_TRY(stage(G, G->a.k, t, cr));
        MN_TRY(forward(G, A, cr, true, true));
        /* the tangent: zd_i = in dG_i^T + hd_(i-1) A_i^T + db_i, hd_i = phi'(z_i) zd_i */
        for (int i = 0; i < L; i++) {
            float *out = i == L - 1 ? G->U : G->ZD[i];
            MN_TRY(mm_layer(G, i, i == 0 ? G->X : G->H[i - 1], dG, cr, 0.0f, out));
            if (i > 0) MN_TRY(mm_layer(G, i, G->HD[i - 1], A, cr, 1.0f, out));
            if (i == L - 1) break;
            mn_lgrad_op o = {0};
            o.out = out;
            o.out2 = G->HD[i];
            o.d1 = G->D1[i];
            o.dbias = G->per == 2 ? at(G, dG, bparam(G, i)) : NULL;
            o.rows = cr;
            o.width = G->dh;
            MN_TRY(launch(G, LK_TANGENT, grid_elems(G, cr * G->dh), &o));
        }
        mn_lgrad_op o = {0};
        o.in = G->Y;
        o.in2 = G->U;
        o.bias = G->per == 2 ? at(G, A, bparam(G, L - 1)) : NULL;
        o.dbias = G->per == 2 ? at(G, dG, bparam(G, L - 1)) : NULL;
        o.out = G->ZB;
        o.out2 = G->ZDB;
        o.step = s - G->s0;
        o.t = t - G->s0 * G->step;
        o.rows = cr;
        o.count = rows;
        o.merge_rows = merge_rows;
        dim3 grid = {(unsigned)((cr + MN_LARGE_THREADS / 32 - 1) / (MN_LARGE_THREADS / 32)), (unsigned)G->M, 1};
        MN_TRY(launch(G, LK_LOSS, grid, &o));
        /* the reverse of forward + tangent, with zbar in ZB and zdbar in ZDB */
        for (int i = L - 1; i >= 0; i--) {
            const long long ni = layer_in(G, i), no = layer_out(G, i);
            MN_TRY(mm_grad(G, i, G->ZB, i == 0 ? G->X : G->H[i - 1], cr, dA));
            if (i > 0) MN_TRY(mm_grad(G, i, G->ZDB, G->HD[i - 1], cr, dA));
            if (G->per == 2) MN_TRY(colsum(G, G->ZB, cr, no, at(G, dA, bparam(G, i))));
            MN_TRY(mm_back(G, i, G->ZB, A, cr, 0.0f, G->HB));
            MN_TRY(mm_back(G, i, G->ZDB, dG, cr, 1.0f, G->HB));
            if (i == 0) {
                MN_TRY(addrows(G, G->HB, G->io->gk, t, cr));
                break;
            }
            MN_TRY(mm_back(G, i, G->ZDB, A, cr, 0.0f, G->HDB));
            memset(&o, 0, sizeof o);
            o.in = G->HB;
            o.in2 = G->HDB;
            o.d1 = G->D1[i - 1];
            o.d2 = G->D2[i - 1];
            o.zd = G->ZD[i - 1];
            o.out = G->ZB;
            o.out2 = G->ZDB;
            o.rows = cr;
            o.width = ni;
            o.flags = MN_LGRAD_TANGENT;
            MN_TRY(launch(G, LK_REVACT, grid_elems(G, cr * ni), &o));
        }
    }
    return MN_OK;
}

/* ---- the walk ---- */

/* An image from the state's tensors (params, momenta or anchor), or back. */
static mn_status save(const lg *G, float *img, const mn_tensor *ts)
{
    for (int p = 0; p < G->np; p++)
        MN_CUDA_CHECK(cudaMemcpyAsync(at(G, img, p), mn_tensor_data(&ts[p]), sizeof(float) * G->M * G->a.numel[p],
                                      cudaMemcpyDeviceToDevice, G->stream));
    return MN_OK;
}

static mn_status restore(const lg *G, const float *img, mn_tensor *ts)
{
    for (int p = 0; p < G->np; p++)
        MN_CUDA_CHECK(cudaMemcpyAsync(mn_tensor_data(&ts[p]), at(G, img, p), sizeof(float) * G->M * G->a.numel[p],
                                      cudaMemcpyDeviceToDevice, G->stream));
    return MN_OK;
}

/* An image from per-parameter [M, numel] tensors (the upstream), zeros where absent. */
static mn_status load_upstream(const lg *G, float *img, const float *const *src)
{
    for (int p = 0; p < G->np; p++) {
        size_t bytes = sizeof(float) * G->M * G->a.numel[p];
        if (src[p]) MN_CUDA_CHECK(cudaMemcpyAsync(at(G, img, p), src[p], bytes, cudaMemcpyDeviceToDevice, G->stream));
        else MN_CUDA_CHECK(cudaMemsetAsync(at(G, img, p), 0, bytes, G->stream));
    }
    return MN_OK;
}

static float *slot(float *base, long long i, long long image) { return base + i * image; }

/* Reverse of step s, block slot i. */
static mn_status step_reverse(const lg *G, long long s, long long i)
{
    const mn_large_grad_io *io = G->io;
    const long long rows = step_rows(G, s);
    const bool after = io->st->rule.retrieve == MN_RETRIEVE_AFTER;
    const float *xq = f32(&io->in->q) ? f32(&io->in->q) : G->a.k;
    float *gxq = f32(&io->in->q) ? io->gq : io->gk;
    float *W = slot(G->Wb, i, G->image);
    const float *A = G->refresh == G->step || refresh_start(G, s) ? W : slot(G->Ab, i, G->image);
    if (io->dy && after) MN_TRY(vjp(G, slot(G->Wb, i + 1, G->image), xq, gxq, s, rows - 1, rows));
    mn_lgrad_op o = {0};
    o.Wimg = W;
    o.Simg = slot(G->Sb, i, G->image);
    o.Gimg = slot(G->Gb, i, G->image);
    o.step = s - G->s0;
    dim3 slices = {(unsigned)G->a.nslices, (unsigned)G->M, 1};
    dim3 by_memory = {(unsigned)((G->M + MN_LARGE_THREADS / 32 - 1) / (MN_LARGE_THREADS / 32)), 1, 1};
    MN_TRY(launch(G, LK_UPDATE, slices, &o));
    MN_TRY(launch(G, LK_CLIP, by_memory, &o));
    if (G->clip_scales) MN_TRY(launch(G, LK_DG, slices, &o));
    const long long before = after ? rows - 1 : rows;
    const bool merged = io->dy && before > 0 && !f32(&io->in->q) && A == W;
    MN_TRY(step_adjoint(G, A, s, merged ? before : 0));
    if (io->dy && before > 0 && !merged) MN_TRY(vjp(G, W, xq, gxq, s, 0, before));
    if (refresh_start(G, s) && G->refresh != G->step) {
        memset(&o, 0, sizeof o);
        o.count = G->image;
        MN_TRY(launch(G, LK_REFRESH, grid_flat(G->image), &o));
    }
    return MN_OK;
}

/* Where step s lies in its refresh block (0 without an anchor that
 * refreshes): two full blocks whose first steps share it have the same
 * reverse but for the device's a.base. */
static long long phase_of(long long s, long long step, long long refresh)
{
    return refresh > 0 && refresh != step ? s % (refresh / step) : 0;
}

void mn_large_grad_block_modes(int64_t n, int64_t nsteps, int64_t step, int64_t refresh, int64_t K,
                               mn_large_grad_block_mode *modes)
{
    const long long nblocks = K > 0 ? (nsteps + K - 1) / K : 0;
    bool walked = false, captured = false;
    long long phase = 0;
    for (long long b = nblocks - 1; b >= 0; b--) {
        const long long s0 = b * K, len = s0 + K <= nsteps ? K : nsteps - s0;
        const bool full = len == K && (s0 + len) * step <= n; /* the block's last step has step rows */
        modes[b] = MN_LG_DIRECT;
        if (!full) continue;
        if (captured) {
            if (phase_of(s0, step, refresh) == phase) modes[b] = MN_LG_REPLAY;
        } else if (walked && b >= 1) {
            modes[b] = MN_LG_CAPTURE;
            captured = true;
            phase = phase_of(s0, step, refresh);
        }
        walked = true;
    }
}

/* The device's first step of the block that a graph replays next. */
static mn_status set_base(lg *G, long long s0)
{
    mn_lgrad_op o = {0};
    o.step = s0;
    G->a.base = G->base; /* the launch copies its arguments */
    mn_status s = launch_block(G, LK_BASE, (dim3){1, 1, 1}, (dim3){1, 1, 1}, &o);
    G->a.base = NULL;
    return s;
}

static mn_status reverse_block(const lg *G, long long s0, long long len)
{
    for (long long i = len - 1; i >= 0; i--) MN_TRY(step_reverse(G, s0 + i, i));
    return MN_OK;
}

static mn_status enqueue_block(void *ctx)
{
    const lg *G = ctx;
    return reverse_block(G, G->s0, G->K);
}

/* A full block's reverse captured into G->graph; false (and no graph) when
 * the capture or the instantiation fails: the caller then launches
 * directly. */
static bool capture_block(lg *G, long long s0)
{
    /* the launches count from the block's first step, read on the device */
    G->a.base = G->base;
    G->s0 = s0;
    bool ok = mn_cuda_capture_graph(G->stream, enqueue_block, G, &G->graph);
    G->a.base = NULL;
    G->s0 = 0;
    return ok;
}

/* Block b's reverse, as mn_large_grad_block_modes planned it (G->modes):
 * a capture that fails leaves the block, and those that would replay it,
 * to direct launches. */
static mn_status walk_block(lg *G, long long b, long long len)
{
    const long long s0 = b * G->K;
    if (G->modes[b] == MN_LG_CAPTURE) (void)capture_block(G, s0);
    if (G->modes[b] != MN_LG_DIRECT && G->graph) {
        MN_TRY(set_base(G, s0));
        return MN_CUDA_ST(cudaGraphLaunch(G->graph, G->stream));
    }
    return reverse_block(G, s0, len);
}

static mn_status walk(lg *G)
{
    mn_memory_state *st = G->io->st;
    const long long K = G->K, image = G->image;
    const bool anchor = G->parts == 3; /* refresh = step: no step reads the anchor */
    /* 1. checkpoints at the first step of every block; the last block is
     * recomputed in 2 anyway, so this forward stops at its start */
    const long long last = (G->nblocks - 1) * K;
    for (long long s = 0; s <= last; s++) {
        if (s % K == 0) {
            float *ck = slot(G->ck, G->parts * (s / K), image);
            MN_TRY(save(G, ck, st->params));
            MN_TRY(save(G, ck + image, st->momenta));
            if (anchor) MN_TRY(save(G, ck + 2 * image, st->anchor));
        }
        if (s == last) break;
        MN_TRY(mn_large_stepper_run(G->sp, s));
    }
    MN_TRY(load_upstream(G, G->a.dW, G->io->dWf));
    MN_TRY(load_upstream(G, G->a.dS, G->io->dSf));
    MN_CUDA_CHECK(cudaMemsetAsync(G->a.dA, 0, sizeof(float) * image, G->stream));
    /* 2. blocks in reverse */
    for (long long b = G->nblocks - 1; b >= 0; b--) {
        const float *ck = slot(G->ck, G->parts * b, image);
        MN_TRY(restore(G, ck, st->params));
        MN_TRY(restore(G, ck + image, st->momenta));
        if (anchor) MN_TRY(restore(G, ck + 2 * image, st->anchor));
        MN_TRY(mn_large_stepper_state_set(G->sp));
        const long long s0 = b * K, len = s0 + K <= G->nsteps ? K : G->nsteps - s0;
        for (long long i = 0; i < len; i++) {
            MN_TRY(save(G, slot(G->Wb, i, image), st->params));
            MN_TRY(save(G, slot(G->Sb, i, image), st->momenta));
            if (anchor && !refresh_start(G, s0 + i)) MN_TRY(save(G, slot(G->Ab, i, image), st->anchor));
            MN_TRY(mn_large_stepper_run(G->sp, s0 + i));
            for (int p = 0; p < G->np; p++)
                MN_CUDA_CHECK(cudaMemcpyAsync(at(G, slot(G->Gb, i, image), p), mn_large_stepper_grad(G->sp, p),
                                              sizeof(float) * G->M * G->a.numel[p], cudaMemcpyDeviceToDevice,
                                              G->stream));
        }
        MN_TRY(save(G, slot(G->Wb, len, image), st->params));
        MN_TRY(save(G, slot(G->Sb, len, image), st->momenta));
        MN_TRY(walk_block(G, b, len));
        if (mn_check_interrupt() != MN_OK) return MN_ERR_INTERRUPTED;
    }
    mn_lgrad_op o = {0};
    long long most = 0;
    for (int p = 0; p < G->np; p++)
        if (G->a.numel[p] > most) most = G->a.numel[p];
    return launch(G, LK_FINAL, grid_elems(G, most), &o);
}

/* ---- sizes and memory ---- */

static void *take(char *base, size_t *off, size_t floats)
{
    void *p = base ? base + *off : NULL;
    *off += (floats * sizeof(float) + 255) & ~(size_t)255;
    return p;
}

static size_t carve(lg *G, char *base)
{
    size_t off = 0;
    const size_t img = (size_t)G->image, chunk = (size_t)(G->M * G->a.ld);
    float **imgs[] = {&G->a.dW, &G->a.dS, &G->a.dA, &G->a.dG, &G->a.dGt};
    for (size_t i = 0; i < sizeof imgs / sizeof *imgs; i++) *imgs[i] = take(base, &off, img);
    G->ck = take(base, &off, (size_t)(G->nblocks * G->parts) * img);
    G->Wb = take(base, &off, (size_t)(G->K + 1) * img);
    G->Sb = take(base, &off, (size_t)(G->K + 1) * img);
    G->Ab = G->refresh != G->step ? take(base, &off, (size_t)G->K * img) : NULL;
    G->Gb = take(base, &off, (size_t)G->K * img);
    float **chunks[] = {&G->X, &G->Y, &G->U, &G->ZB, &G->ZDB, &G->HB, &G->HDB};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) *chunks[i] = take(base, &off, chunk);
    for (int i = 0; i + 1 < G->L; i++) {
        float **hidden[] = {&G->Z[i], &G->H[i], &G->D1[i], &G->D2[i], &G->ZD[i], &G->HD[i]};
        for (size_t j = 0; j < sizeof hidden / sizeof *hidden; j++) *hidden[j] = take(base, &off, chunk);
    }
    G->a.flag = take(base, &off, 1);
    G->base = take(base, &off, 2); /* a long long */
    G->a.part = take(base, &off, (size_t)(G->M * G->a.nslices * 4 * 2));
    G->a.coef = take(base, &off, (size_t)(G->M * G->np * 2 * 2));
    G->a.colpart = take(base, &off, (size_t)(G->M * ((G->CR + MN_LGRAD_COL_ROWS - 1) / MN_LGRAD_COL_ROWS) * G->wide * 2));
    return off;
}

static mn_status setup(lg *G, const mn_large_grad_io *io, mn_precision prec)
{
    const mn_memory_state *st = io->st;
    const mn_rule *r = &st->rule;
    const mn_dims *d = &st->dims;
    memset(G, 0, sizeof *G);
    G->io = io;
    G->prec = prec;
    G->M = d->B * d->H;
    G->L = r->layers;
    G->per = r->bias ? 2 : 1;
    G->np = st->nparams;
    if (G->np > MN_LGRAD_MAX_PARAMS || G->np != mn_param_count(r->layers, r->bias))
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda large backward: %d parameters (glu has no large backward)", G->np);
    G->refresh = mn_rule_refresh(r);
    G->step = r->step;
    G->dk = d->dk;
    G->dv = d->dv;
    G->dh = r->layers > 1 ? d->dh : 0;
    G->wide = G->dk > G->dv ? G->dk : G->dv;
    if (G->dh > G->wide) G->wide = G->dh;
    G->n = io->n;
    G->nsteps = io->nsteps;
    G->K = io->K;
    G->nblocks = (io->nsteps + io->K - 1) / io->K;
    G->CR = mn_large_chunk_rows(G->M, G->wide, G->step);
    mn_lgrad_kargs *a = &G->a;
    long long off = 0;
    for (int p = 0; p < G->np; p++) {
        a->numel[p] = mn_tensor_numel(&st->params[p]) / G->M;
        a->ioff[p] = off;
        off += G->M * a->numel[p];
    }
    G->image = off;
    a->nslices = mn_large_slices(a->numel, G->np, MN_LGRAD_MAX_PARAMS, a->slice_start);
    G->clip_scales = mn_rule_clip_scales(r);
    G->parts = mn_grad_checkpoint_parts(r);
    a->memories = G->M;
    a->n = io->n;
    a->nsteps = io->nsteps;
    a->ld = G->CR * G->wide;
    a->k = f32(&io->in->k);
    a->v = f32(&io->in->v);
    a->theta = f32(&io->in->theta);
    a->eta = f32(&io->in->eta);
    a->alpha = f32(&io->in->alpha);
    a->dy = io->dy;
    a->dloss = io->dloss;
    a->gk = io->gk;
    a->gv = io->gv;
    a->gtheta = io->gtheta;
    a->geta = io->geta;
    a->galpha = io->galpha;
    for (int p = 0; p < G->np; p++) {
        a->gW[p] = io->gW[p];
        a->gS[p] = io->gS[p];
    }
    char *src = mn_cuda_large_grad_source(r, d, prec);
    if (!src) return MN_ERR_ARG;
    mn_status s = mn_cuda_module_get(src, mn_large_grad_kernel_names, mn_cuda_run_work(r, d), &G->mod);
    free(src);
    return s;
}

/* Any non-finite number among the inputs (the finite kernel), waited for. */
static mn_status inputs_finite(lg *G, bool *ok)
{
    const mn_segment_inputs *in = G->io->in;
    const mn_tensor *ts[] = {&in->k, &in->v, &in->q, &in->theta, &in->eta, &in->alpha};
    MN_CUDA_CHECK(cudaMemsetAsync(G->a.flag, 0, sizeof(int), G->stream));
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) {
        if (!ts[i]->storage) continue;
        mn_lgrad_op o = {0};
        o.in = f32(ts[i]);
        o.count = mn_tensor_numel(ts[i]);
        MN_TRY(launch(G, LK_FINITE, grid_flat(o.count), &o));
    }
    int flag = 1;
    MN_CUDA_CHECK(cudaMemcpyAsync(&flag, G->a.flag, sizeof flag, cudaMemcpyDeviceToHost, G->stream));
    MN_CUDA_CHECK(cudaStreamSynchronize(G->stream));
    *ok = flag == 0;
    return MN_OK;
}

mn_status mn_cuda_large_backward(const mn_large_grad_io *io, mn_precision prec, int64_t *bytes, bool *declined)
{
    *declined = false;
    *bytes = 0;
    if (io->in->lengths.storage) {
        *declined = true;
        return MN_OK;
    }
    lg G;
    MN_TRY(setup(&G, io, prec));
    if (io->n == 0 || G.M == 0) return MN_OK;
    io->st->precision = prec; /* the recompute is the forward's, in its precision */
    G.modes = malloc(sizeof *G.modes * (size_t)(G.nblocks > 0 ? G.nblocks : 1));
    if (!G.modes) return mn_fail(MN_ERR_OOM, "cuda large backward: out of memory for %lld blocks", G.nblocks);
    mn_large_grad_block_modes(G.n, G.nsteps, G.step, G.refresh, G.K, G.modes);
    mn_status s = mn_large_stepper_open(io->st, io->in, io->n, io->nsteps, &G.sp);
    if (s != MN_OK) {
        free(G.modes);
        return s;
    }
    G.stream = (cudaStream_t)mn_large_stepper_stream(G.sp);
    G.blas = (cublasHandle_t)mn_large_stepper_blas(G.sp);
    G.a.skipped = mn_large_stepper_skipped(G.sp);
    G.work_bytes = carve(&G, NULL);
    G.work = NULL;
    s = mn_cuda_module_set_constants(G.mod, &io->st->rule, G.stream);
    if (s == MN_OK) {
        s = mn_cuda_alloc(G.work_bytes, &G.work);
        if (s != MN_OK) {
            G.work = NULL;
            s = mn_fail_context(s, "cuda large backward: %.1f MB of checkpoints and buffers (checkpoints every %lld steps): ",
                                (double)G.work_bytes / 1e6, G.K);
        }
    }
    if (s == MN_OK) {
        carve(&G, G.work);
        *bytes = (int64_t)G.work_bytes;
        bool ok = false;
        s = inputs_finite(&G, &ok);
        if (s == MN_OK && !ok) *declined = true;
        else if (s == MN_OK) s = walk(&G);
    }
    s = mn_large_stepper_close(G.sp, s); /* waits for the stream */
    if (G.graph) (void)cudaGraphExecDestroy(G.graph);
    if (G.work) mn_cuda_free(G.work, G.work_bytes);
    free(G.modes);
    return s;
}
