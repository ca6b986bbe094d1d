/* engine_large.c: the large-memory path of the CUDA rule engine
 * (kernels/engine_large.h). The same outputs as the general path
 * (kernels/engine_cuda.c, kernels/rule_kernel.cuh, SPEC.md section 2), made
 * differently: the products go to cuBLAS, batched over the M = B*H memories
 * (cublasGemmStridedBatchedEx, in the state's precision; the last layer's
 * weight gradient through cuBLASLt, kernels/large_bgrad.h), the work between
 * them to the generated kernels of kernels/large_kernels.cuh, and each step
 * is one CUDA graph replayed.
 *
 * One step s (rows = c, or fewer for a short last step; P is the gradient
 * point: W when refresh = c, else the anchor A):
 *
 *   params (REFRESH)     refresh neither 0 nor c: A = W at a refresh block's first step
 *   for each chunk of at most CR rows:
 *     stage              rows of k -> X, the first product's operand
 *     hidden layer i     GEMM Z = X_i P_i^T;  act: z = Z + b, H_i = phi(z), phi'(z) kept (glu: z)
 *                        glu: also GEMM U = X_i Q_i^T (Q_i the gate's U_i at P);
 *                        act: u = U + c kept, H_i = phi(z) u
 *     last layer         GEMM Y = H P_L^T
 *     loss               y = Y + b (+ k): loss[t], D = dL/dy, y copied out where it is retrieval
 *     layer i, L..1      GEMM G_Wi (+)= D^T X_i;  cols: G_bL (+)= column sums of D (last layer, bias;
 *                        a step's first chunk: from G_WL's cuBLASLt product, kernels/large_bgrad.h)
 *                        glu, hidden i: GEMM G_Ui (+)= DU^T X_i (DU = dL/du, in u's place)
 *                        GEMM D' = D P_i (glu, hidden i: + DU Q_i, beta 1);
 *                        cols: D' *= phi'(z), G_b(i-1) (+)= column sums
 *                        (glu: first DU = D' phi(z), D' *= u; G_c(i-1) (+)= DU's sums)
 *   norm                 |G| per parameter, non-finite guard, clip scales, grad_norm, skipped,
 *                        clip_scale, step_loss
 *   retrieval at W^(s)   y wanted and (q given or P is not W): stage, forward at W, out
 *   update               clip, S = eta S - G, W = (1 - alpha) W + S, weight_norm
 *   row, per layer       retrieve = after: the step's last row at W^(s+1)
 *
 * The step index lives on the device (large_kernels.cuh), so every full
 * step is the same sequence of launches: the first runs directly (cuBLAS
 * and the lazily loaded modules warm up outside a capture), the second is
 * captured on our stream into a graph, instantiated once and replayed for
 * it and the rest; a short last step runs directly. If capture or
 * instantiation fails, the steps run directly. The graph and the workspace
 * are kept for the next segment of the same shape, which replays the graph
 * from its first step (kernels/large_keep.c). A 2-layer MLP with biases,
 * q = k, refresh = c, retrieve = after and y wanted is 13 launches a step
 * (5 GEMMs, one with its bias-gradient epilogue; stage, act, loss, cols,
 * norm, update, 2 row), 11 without y;
 * the finite check, clip and momentum never wait for the host.
 *
 * Our own stream and cuBLAS handle (kernels/blas.c's stay untouched): the
 * stream waits for the legacy stream, where the inputs were made, and the
 * segment ends with a wait on the stream, so faults are reported by this
 * call and everything after sees the results. The workspace (chunk buffers,
 * gradients, partials, cuBLAS's workspace) is one block from the caching
 * allocator, allocated before any capture and freed on every path. */
#include "engine_large.h"
#include "codegen.h"
#include "cuda_check.h"
#include "large_bgrad.h"
#include "cuda_module.h"
#include "module_memo.h"
#include "nvrtc.h"
#include "large_run.h"

#include <cublas_v2.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Rows of all memories in one chunk, and the floats of one chunk buffer:
 * bound the activations of a long step (its gradient accumulates over
 * chunks). 16384 rows keep LaCT-sized steps (8 memories x 1024 rows) in one
 * chunk: half the launches, and products of twice the rows, which fill the
 * GPU better (issue 14's L1 on an H100: 5.1 -> 4.3 ms in tf32 against 4096
 * rows); a chunk buffer is then at most 64 MB at a width of 1024. */
#define CHUNK_ROWS 16384LL
#define CHUNK_FLOATS (1LL << 26)
/* Grid-stride kernels: at most this many blocks per SM. */
#define BLOCKS_PER_SM 16

const char *const mn_large_kernel_names[] = {
    "mn_large_params_kernel", "mn_large_stage_kernel",  "mn_large_act_kernel",
    "mn_large_loss_kernel",   "mn_large_cols_kernel",   "mn_large_norm_kernel",
    "mn_large_update_kernel", "mn_large_out_kernel",    "mn_large_row_kernel", "mn_large_ns_kernel",
    "mn_large_args_kernel",   NULL};

const char *const mn_large_templates[] = {"update_math", "large_common", "large_device", "large_kernels", NULL};

char *mn_cuda_large_source(const mn_rule *r, const mn_dims *d, mn_precision p)
{
    return mn_cuda_source_for(r, d, p, mn_large_templates, NULL);
}

long long mn_large_chunk_rows(long long memories, long long widest, long long rows)
{
    /* an experiment's knob: MNEMO_LARGE_CHUNK_ROWS=N rows of all memories a chunk */
    const char *knob = getenv("MNEMO_LARGE_CHUNK_ROWS");
    const long long all = knob && atoll(knob) > 0 ? atoll(knob) : CHUNK_ROWS;
    long long cr = all / memories;
    if (cr * memories * widest > CHUNK_FLOATS) cr = CHUNK_FLOATS / (memories * widest);
    if (cr < 1) cr = 1;
    return rows < cr ? rows : cr;
}

unsigned mn_large_grid_blocks(long long elems, int scale)
{
    const long long b = (elems + MN_LARGE_THREADS - 1) / MN_LARGE_THREADS;
    const long long cap = (long long)mn_cuda_sm_count() * BLOCKS_PER_SM * scale;
    return (unsigned)(b > cap ? cap : b < 1 ? 1 : b);
}

static mn_status module_for(const mn_rule *r, const mn_dims *d, mn_precision p, mn_cuda_module **out)
{
    return mn_cuda_module_for(r, d, p, mn_large_templates, NULL, mn_large_kernel_names, mn_cuda_run_work(r, d), out);
}

/* ---- the stream, the event and the cuBLAS handle, created once ---- */

static struct {
    bool ready;
    cudaStream_t stream;
    cudaEvent_t inputs_ready;
    cublasHandle_t blas;
    size_t total_bytes; /* the device's memory */
} dev;

static mn_status shared_init(void)
{
    if (dev.ready) return MN_OK;
    MN_TRY(mn_cuda_ensure_device());
    cudaStream_t stream = NULL;
    cudaEvent_t ev = NULL;
    cublasHandle_t h = NULL;
    /* Non-blocking: the legacy stream never syncs with it implicitly, which
     * would be an error while a step is being captured; ordering with the
     * legacy stream is explicit (an event at the start, a wait at the end). */
    mn_status s = MN_CUDA_ST(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (s == MN_OK) s = MN_CUDA_ST(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    if (s == MN_OK) s = MN_CUBLAS_ST(cublasCreate(&h));
    /* fp32 means fp32: no tf32 unless the precision asks (SPEC.md section 3) */
    if (s == MN_OK) s = MN_CUBLAS_ST(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    size_t free_bytes = 0;
    if (s == MN_OK) s = MN_CUDA_ST(cudaMemGetInfo(&free_bytes, &dev.total_bytes));
    if (s != MN_OK) {
        if (h) (void)cublasDestroy(h);
        if (ev) (void)cudaEventDestroy(ev);
        if (stream) (void)cudaStreamDestroy(stream);
        return s;
    }
    dev.stream = stream;
    dev.inputs_ready = ev;
    dev.blas = h;
    dev.ready = true;
    return MN_OK;
}

/* ---- one segment or read: sizes, workspace, weights (the run: large_run.h) ---- */

static float *f32(const mn_tensor *t) { return t->storage ? (float *)mn_tensor_data(t) : NULL; }

static mn_status check_state(const mn_memory_state *st)
{
    for (int p = 0; p < st->nparams; p++) {
        const mn_tensor *ts[3] = {&st->params[p], &st->momenta[p], &st->anchor[p]};
        for (int j = 0; j < 3; j++)
            if (!ts[j]->storage || ts[j]->storage->device != MN_CUDA || !mn_tensor_is_contiguous(ts[j]))
                return mn_fail(MN_ERR_ARG, "cuda engine: the memory state is not contiguous on cuda");
    }
    return MN_OK;
}

/* Sizes, the module, and the state's pointers; rows: the most rows one step
 * (or the read) has. */
static mn_status run_init(run *R, const mn_memory_state *st, long long rows, bool training)
{
    const mn_rule *r = &st->rule;
    const mn_dims *d = &st->dims;
    memset(R, 0, sizeof *R);
    R->M = d->B * d->H;
    if (R->M > 65535)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda large path: %lld memories (B x H) exceed a grid's 65535",
                       (long long)R->M);
    if (st->nparams > MN_LARGE_MAX_PARAMS)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda large path: %d parameters (at most %d)", st->nparams,
                       MN_LARGE_MAX_PARAMS);
    MN_TRY(check_state(st));
    R->L = r->layers;
    R->per = r->bias ? 2 : 1;
    R->np = st->nparams;
    R->nl = mn_param_count(r->layers, r->bias);
    R->glu = r->glu && r->layers > 1;
    if (R->np != mn_param_count_glu(r->layers, r->bias, R->glu))
        return mn_fail(MN_ERR_ARG, "cuda large path: the state has %d parameters, the rule %d", R->np,
                       mn_param_count_glu(r->layers, r->bias, R->glu));
    R->refresh = mn_rule_refresh(r);
    R->ns = r->precondition == MN_PRECOND_NEWTON_SCHULZ;
    R->step = r->step;
    R->dk = d->dk;
    R->dv = d->dv;
    R->dh = r->layers > 1 ? d->dh : 0;
    R->wide = R->dv > R->dh ? R->dv : R->dh;
    R->prec = st->precision;
    R->training = training;
    long long widest = R->dk > R->wide ? R->dk : R->wide;
    if (widest > INT_MAX / 2)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda large path: a dimension of %lld is too large for cuBLAS", widest);
    R->CR = mn_large_chunk_rows(R->M, widest, rows);

    mn_large_kargs *a = &R->a;
    for (int p = 0; p < R->np; p++) {
        int64_t shape[2];
        int nd = mn_rule_param_shape(r, d, p, shape);
        a->numel[p] = nd == 2 ? shape[0] * shape[1] : shape[0];
        a->W[p] = f32(&st->params[p]);
        a->S[p] = f32(&st->momenta[p]);
        a->A[p] = f32(&st->anchor[p]);
    }
    const long long slices = mn_large_slices(a->numel, R->np, MN_LARGE_MAX_PARAMS, a->slice_start);
    if (slices > INT_MAX)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda large path: %lld parameter slices exceed a grid", slices);
    a->nslices = slices;
    a->memories = R->M;
    a->steps_done = st->steps_done;
    MN_TRY(module_for(r, d, R->prec, &R->mod));
    MN_TRY(shared_init());
    return mn_cuda_module_set_constants(R->mod, r, dev.stream);
}

static mn_status alloc_work(run *R)
{
    R->work_bytes = mn_large_carve(R, NULL);
    MN_TRY(mn_cuda_alloc(R->work_bytes, &R->work));
    mn_large_carve(R, R->work);
    mn_large_point_weights(R);
    return MN_OK;
}

void mn_cuda_large_release(void)
{
    if (mn_large_kept_bytes() == 0) return;
    /* no segment is running (each waits for its stream), but a failed one may have left work queued */
    if (cudaStreamSynchronize(dev.stream) != cudaSuccess) (void)cudaGetLastError();
    mn_large_kept_drop_all();
}

size_t mn_cuda_large_kept_bytes(void) { return mn_large_kept_bytes(); }

/* Waits for the stream (always: the workspace must not be handed out while
 * kernels still use it), frees everything; keeps the first error. A kept
 * segment's workspace and graph stay for the next, unless it failed. */
static mn_status finish(run *R, mn_status s)
{
    if (s == MN_OK) s = MN_CUDA_ST(cudaStreamSynchronize(dev.stream));
    else if (cudaStreamSynchronize(dev.stream) != cudaSuccess) (void)cudaGetLastError(); /* already failing */
    if (R->kept) {
        if (s != MN_OK) mn_large_kept_forget(R->kept);
        R->kept = NULL;
        R->work = NULL;
        return s;
    }
    if (R->graph) (void)cudaGraphExecDestroy(R->graph);
    R->graph = NULL;
    mn_cuda_free(R->work, R->work_bytes);
    R->work = NULL;
    return s;
}

/* ---- launches ---- */

static const dim3 block1 = {MN_LARGE_THREADS, 1, 1};

/* In a captured step, each kernel a programmatic dependent of the kernel
 * ahead of it on sm_90 and later (large_kernels.cuh, mn_lg_after_prior): it
 * launches when every block of that kernel has exited, not after its
 * completion. L1 on an H200: 0.5-3% a run (tests/bench/RESULTS.md,
 * 2026-11-29). Not in the steps launched directly: P2, one step, was 10%
 * slower so. MNEMO_LARGE_PDL=0 (an experiment's knob) turns it off. */
static bool pdl_on(void)
{
    static int on = -1;
    if (on < 0) {
        const char *knob = getenv("MNEMO_LARGE_PDL");
        on = mn_cuda_arch() >= 90 && !(knob && strcmp(knob, "0") == 0);
    }
    return on;
}

static mn_status launch(const run *R, int k, dim3 grid, dim3 block, const mn_large_op *o)
{
    void *args[2] = {(void *)&R->dargs, (void *)o}; /* copied by the launch */
    if (!R->capturing || !pdl_on())
        return MN_CUDA_ST(cudaLaunchKernel((const void *)R->mod->k[k], grid, block, args, 0, dev.stream));
    cudaLaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.stream = dev.stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return MN_CUDA_ST(cudaLaunchKernelExC(&cfg, (const void *)R->mod->k[k], args));
}

/* Grid-stride over elems elements of each memory: (x, M). */
static dim3 grid_elems(const run *R, long long elems)
{
    dim3 g = {mn_large_grid_blocks(elems, 1), (unsigned)R->M, 1};
    return g;
}

/* The same for rows x width elements, which the elementwise kernels take
 * four at a time where width is a multiple of 4: a thread for each four,
 * not for each element (three quarters of the blocks would find no work).
 * A kernel that takes one at a time after all (a caller's view at an odd
 * address) still covers every element: its loop strides over the grid. */
static dim3 grid_rows(const run *R, long long rows, long long width)
{
    return grid_elems(R, width % 4 == 0 ? rows * width / 4 : rows * width);
}

static dim3 grid_slices(const run *R)
{
    dim3 g = {(unsigned)R->a.nslices, (unsigned)R->M, 1};
    return g;
}

/* A row-major product for every memory as cuBLAS (column-major) sees it:
 * a row-major [r, c] matrix is the column-major [c, r] one (kernels/blas.c),
 * so each call below computes C^T. Operands in the precision's type, C fp32. */
static cudaDataType_t operand_type(const run *R) { return R->prec == MN_PREC_BF16 ? CUDA_R_16BF : CUDA_R_32F; }
static cublasComputeType_t compute_type(const run *R)
{
    return R->prec == MN_PREC_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

static mn_status gemm(const run *R, cublasOperation_t ta, cublasOperation_t tb, long long m, long long n,
                      long long k, const void *A, long long lda, long long sa, const void *B, long long ldb,
                      long long sb, float beta, float *C, long long ldc, long long sc)
{
    const float one = 1.0f;
    const cudaDataType_t t = operand_type(R);
    return MN_CUBLAS_ST(cublasGemmStridedBatchedEx(dev.blas, ta, tb, (int)m, (int)n, (int)k, &one, A, t, (int)lda,
                                                   sa, B, t, (int)ldb, sb, &beta, C, CUDA_R_32F, (int)ldc, sc,
                                                   (int)R->M, compute_type(R), CUBLAS_GEMM_DEFAULT));
}

/* Rows r0 .. r0 + cr - 1 of the step (of k, or q where from_q) into X;
 * step_rows: the step's rows (those past a sequence's length become zeros). */
static mn_status stage(const run *R, bool from_q, long long r0, long long cr, long long step_rows)
{
    mn_large_op o = {0};
    o.flags = from_q ? MN_LARGE_FROM_Q : 0;
    o.out_op = R->X;
    o.r0 = r0;
    o.rows = cr;
    o.step_rows = step_rows;
    o.ld = R->CR;
    return launch(R, K_STAGE, grid_rows(R, cr, R->dk), block1, &o);
}

/* The model on the cr rows in X at the weights params (fp32: biases) and
 * ops (operands): z (train without glu: phi'(z), the backward's) and h of
 * the hidden layers kept, the last product in Y (its bias and the residual
 * are added by the consumer: loss or out). */
static mn_status forward(const run *R, float *const *params, const void *const *ops, long long cr, bool train)
{
    const void *in = R->X;
    for (int i = 0; i < R->L; i++) {
        const bool last = i == R->L - 1;
        const long long ni = mn_layer_in(i, R->dk, R->dh), no = mn_layer_out(i, R->L, R->dv, R->dh);
        float *out = last ? R->Y : R->Z[i];
        /* Z [cr, no] = in [cr, ni] W^T, W [no, ni]: Z^T = op_T(W^T) in^T */
        MN_TRY(gemm(R, CUBLAS_OP_T, CUBLAS_OP_N, no, cr, ni, ops[i * R->per], ni, no * ni, in, ni, R->CR * ni, 0.0f,
                    out, no, R->CR * no));
        if (last) break;
        mn_large_op o = {0};
        if (R->glu) {
            /* the gate, U [cr, no] = in Q^T with Q = U_i [no, ni], as Z above */
            const int q = mn_param_index(R->L, R->per == 2, i, 1);
            MN_TRY(gemm(R, CUBLAS_OP_T, CUBLAS_OP_N, no, cr, ni, ops[q], ni, no * ni, in, ni, R->CR * ni, 0.0f,
                        R->U[i], no, R->CR * no));
            o.gate = R->U[i];
            o.gate_bias = R->per == 2 ? params[q + 1] : NULL;
        }
        o.out = out;
        o.flags = train && !R->glu ? MN_LARGE_KEEP_GRAD : 0; /* phi'(z) kept for the backward's cols */
        o.out_op = R->H[i];
        o.bias = R->per == 2 ? params[i * 2 + 1] : NULL;
        o.rows = cr;
        o.ld = R->CR;
        MN_TRY(launch(R, K_ACT, grid_rows(R, cr, R->dh), block1, &o));
        in = R->H[i];
    }
    return MN_OK;
}

static mn_status cols(const run *R, float *d, const float *z, void *dop, float *gb, long long ncols, long long cr,
                      int flags, float *u, void *uop, float *gc)
{
    mn_large_op o = {0};
    o.gate = u;
    o.gate_op = uop;
    o.gc = gc;
    o.out = d;
    o.in = z;
    o.out_op = dop;
    o.gb = gb;
    o.rows = cr;
    o.ld = R->CR;
    o.cols = (int)ncols;
    o.flags = flags;
    dim3 grid = {(unsigned)((ncols + 31) / 32), (unsigned)((cr + MN_LARGE_COL_ROWS - 1) / MN_LARGE_COL_ROWS),
                 (unsigned)R->M};
    dim3 block = {32, 8, 1};
    return launch(R, K_COLS, grid, block, &o);
}

/* The plan of G_W's product with the bias gradient (large_bgrad.h) for
 * layer ni -> no over cr rows, or NULL: the column kernel sums them. */
static mn_status bias_plan(const run *R, long long ni, long long no, long long cr, const mn_bgrad_plan **out)
{
    mn_bgrad_shape sh;
    memset(&sh, 0, sizeof sh); /* compared byte for byte, padding too */
    sh.type = operand_type(R); /* gemm()'s, whose product this one replaces */
    sh.compute = compute_type(R);
    sh.m = ni;
    sh.n = no;
    sh.k = cr;
    sh.lda = ni;
    sh.sa = R->CR * ni;
    sh.ldb = no;
    sh.sb = R->CR * no;
    sh.ldc = ni;
    sh.sc = no * ni;
    sh.bias_stride = no;
    sh.batch = (int)R->M;
    return mn_bgrad_plan_for(&sh, MN_LARGE_BLAS_WORKSPACE, out);
}

/* The gradients of the cr rows whose dL/dy the loss kernel left in D[0]
 * (and Db), added to G for a later chunk of the step (accum). With glu, a
 * hidden layer i's dL/du is in U[i] (and DUb), left there by the cols
 * launch of layer i + 1. */
static mn_status backward(const run *R, long long cr, bool accum)
{
    const bool bf16 = R->prec == MN_PREC_BF16;
    const int acc = accum ? MN_LARGE_ACCUM : 0;
    int cur = 0; /* D[cur]: dL/dz of layer i */
    for (int i = R->L - 1; i >= 0; i--) {
        const long long ni = mn_layer_in(i, R->dk, R->dh), no = mn_layer_out(i, R->L, R->dv, R->dh);
        const void *in = i == 0 ? R->X : R->H[i - 1];
        const void *dz = bf16 ? R->Db : R->D[cur];
        const bool gated = R->glu && i < R->L - 1;
        const int q = gated ? mn_param_index(R->L, R->per == 2, i, 1) : -1; /* U_i */
        const void *du = gated ? (bf16 ? R->DUb : (const void *)R->U[i]) : NULL;
        /* the last layer's bias: its gradient from G_W's product where cuBLASLt
         * can (a step's first chunk: the epilogue writes, never adds) */
        const mn_bgrad_plan *bg = NULL;
        if (R->per == 2 && i == R->L - 1 && !accum) MN_TRY(bias_plan(R, ni, no, cr, &bg));
        /* G_W [no, ni] (+)= dz^T in: G^T = in^T op_T(dz^T) */
        if (bg)
            MN_TRY(mn_bgrad_run(bg, in, dz, R->a.G[i * R->per], R->a.G[i * 2 + 1], R->blas_ws, MN_LARGE_BLAS_WORKSPACE,
                                dev.stream));
        else
            MN_TRY(gemm(R, CUBLAS_OP_N, CUBLAS_OP_T, ni, no, cr, in, ni, R->CR * ni, dz, no, R->CR * no,
                        accum ? 1.0f : 0.0f, R->a.G[i * R->per], ni, no * ni));
        /* the gate's G_U [no, ni] (+)= du^T in, as G_W */
        if (gated)
            MN_TRY(gemm(R, CUBLAS_OP_N, CUBLAS_OP_T, ni, no, cr, in, ni, R->CR * ni, du, no, R->CR * no,
                        accum ? 1.0f : 0.0f, R->a.G[q], ni, no * ni));
        /* the last layer's bias (unless its product summed it); hidden layers'
         * (and gates') come with their dz below */
        if (R->per == 2 && i == R->L - 1 && !bg)
            MN_TRY(cols(R, R->D[cur], NULL, NULL, R->a.G[i * 2 + 1], no, cr, MN_LARGE_BIAS | acc, NULL, NULL, NULL));
        if (i == 0) break;
        /* dh [cr, ni] = dz W: dh^T = W^T dz^T */
        MN_TRY(gemm(R, CUBLAS_OP_N, CUBLAS_OP_N, ni, cr, no, R->Pop[i * R->per], ni, no * ni, dz, no, R->CR * no,
                    0.0f, R->D[cur ^ 1], ni, R->CR * ni));
        /* ... + du U: dh^T += U^T du^T */
        if (gated)
            MN_TRY(gemm(R, CUBLAS_OP_N, CUBLAS_OP_N, ni, cr, no, R->Pop[q], ni, no * ni, du, no, R->CR * no, 1.0f,
                        R->D[cur ^ 1], ni, R->CR * ni));
        int flags = MN_LARGE_ACT | (R->per == 2 ? MN_LARGE_BIAS | acc : 0) | (R->glu ? 0 : MN_LARGE_KEEP_GRAD);
        /* layer i - 1 is hidden: with glu, gated */
        const int qp = R->glu ? mn_param_index(R->L, R->per == 2, i - 1, 1) : -1;
        MN_TRY(cols(R, R->D[cur ^ 1], R->Z[i - 1], bf16 ? R->Db : NULL, R->per == 2 ? R->a.G[(i - 1) * 2 + 1] : NULL,
                    ni, cr, flags, R->glu ? R->U[i - 1] : NULL, R->glu && bf16 ? R->DUb : NULL,
                    R->glu && R->per == 2 ? R->a.G[qp + 1] : NULL));
        cur ^= 1;
    }
    return MN_OK;
}

/* Retrieval rows r0 .. r0 + cr - 1 at the weights W (after stage + forward)
 * of a step of step_rows rows (y 0 on a sequence's padding). */
static mn_status out_rows(const run *R, bool from_q, long long r0, long long cr, long long step_rows)
{
    mn_large_op o = {0};
    o.step_rows = step_rows;
    o.in = R->Y;
    o.bias = R->per == 2 ? R->a.W[R->nl - 1] : NULL; /* b_L (glu's gates follow it) */
    o.flags = from_q ? MN_LARGE_FROM_Q : 0;
    o.r0 = r0;
    o.rows = cr;
    o.ld = R->CR;
    return launch(R, K_OUT, grid_rows(R, cr, R->dv), block1, &o);
}

/* Every launch of one step of rows rows, in order (the header comment). */
static mn_status enqueue_step(const run *R, long long rows)
{
    const long long before = R->after ? rows - 1 : rows; /* rows retrieved at W^(s) */
    const bool bf16 = R->prec == MN_PREC_BF16;
    mn_large_op o;
    if (R->refresh > 0 && R->refresh != R->step) {
        memset(&o, 0, sizeof o);
        o.flags = MN_LARGE_REFRESH;
        MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
    }
    for (long long r0 = 0; r0 < rows; r0 += R->CR) {
        const long long cr = rows - r0 < R->CR ? rows - r0 : R->CR;
        MN_TRY(stage(R, false, r0, cr, rows));
        MN_TRY(forward(R, R->P, R->Pop, cr, true));
        memset(&o, 0, sizeof o);
        o.in = R->Y;
        o.bias = R->per == 2 ? R->P[R->nl - 1] : NULL; /* b_L */
        o.out = R->D[0];
        o.out_op = bf16 ? R->Db : NULL;
        o.flags = R->copy_y ? MN_LARGE_COPY_Y : 0;
        o.copy_rows = before;
        o.r0 = r0;
        o.rows = cr;
        o.step_rows = rows;
        o.ld = R->CR;
        dim3 grid = {(unsigned)((cr + MN_LARGE_THREADS / 32 - 1) / (MN_LARGE_THREADS / 32)), (unsigned)R->M, 1};
        MN_TRY(launch(R, K_LOSS, grid, block1, &o));
        MN_TRY(backward(R, cr, r0 > 0));
    }
    memset(&o, 0, sizeof o);
    o.step_rows = rows;
    MN_TRY(launch(R, K_NORM, grid_slices(R), block1, &o));
    if (R->retrieve) {
        const bool from_q = R->q != NULL;
        for (long long r0 = 0; r0 < before; r0 += R->CR) {
            const long long cr = before - r0 < R->CR ? before - r0 : R->CR;
            MN_TRY(stage(R, from_q, r0, cr, rows));
            MN_TRY(forward(R, R->a.W, R->Wop, cr, false));
            MN_TRY(out_rows(R, from_q, r0, cr, rows));
        }
    }
    if (R->ns) {
        memset(&o, 0, sizeof o);
        dim3 grid = {(unsigned)R->np, (unsigned)R->M, 1};
        MN_TRY(launch(R, K_NS, grid, block1, &o));
    }
    const bool last_row = R->y && R->after;
    memset(&o, 0, sizeof o);
    o.flags = last_row ? 0 : MN_LARGE_ADVANCE;
    MN_TRY(launch(R, K_UPDATE, grid_slices(R), block1, &o));
    for (int i = 0; last_row && i < R->L; i++) {
        const long long no = mn_layer_out(i, R->L, R->dv, R->dh);
        memset(&o, 0, sizeof o);
        o.layer = i;
        o.step_rows = rows;
        o.flags = (R->q ? MN_LARGE_FROM_Q : 0) | (i == R->L - 1 ? MN_LARGE_ADVANCE : 0);
        dim3 grid = {(unsigned)((no + MN_LARGE_THREADS / 32 - 1) / (MN_LARGE_THREADS / 32)), (unsigned)R->M, 1};
        MN_TRY(launch(R, K_ROW, grid, block1, &o));
    }
    return MN_OK;
}

static mn_status enqueue_full_step(void *ctx)
{
    const run *R = ctx;
    return enqueue_step(R, R->step);
}

/* One full step captured into *graph; false (and no graph) when the
 * capture or the instantiation fails: the caller then launches directly. */
static bool capture_step(run *R, cudaGraphExec_t *graph)
{
    R->capturing = true;
    const bool ok = mn_cuda_capture_graph(dev.stream, enqueue_full_step, R, graph);
    R->capturing = false;
    return ok;
}

/* Our stream after the legacy stream's work (inputs, outputs and state were
 * made there), cuBLAS on our stream and workspace, and the bf16 operand
 * copies of the weights. */
static mn_status begin(run *R)
{
    MN_CUDA_CHECK(cudaEventRecord(dev.inputs_ready, 0));
    MN_CUDA_CHECK(cudaStreamWaitEvent(dev.stream, dev.inputs_ready, 0));
    /* SetStream drops the workspace, so it comes first */
    MN_CUBLAS_CHECK(cublasSetStream(dev.blas, dev.stream));
    MN_CUBLAS_CHECK(cublasSetWorkspace(dev.blas, R->blas_ws, MN_LARGE_BLAS_WORKSPACE));
    /* the arguments, where every kernel after this one reads them */
    const dim3 one = {1, 1, 1};
    void *args[2] = {(void *)&R->a, (void *)&R->dargs};
    MN_CUDA_CHECK(cudaLaunchKernel((const void *)R->mod->k[K_ARGS], one, block1, args, 0, dev.stream));
    if (R->training) {
        MN_CUDA_CHECK(cudaMemsetAsync(R->a.counter, 0, sizeof(long long), dev.stream));
        size_t ntiles = (size_t)((R->wide + 31) / 32);
        MN_CUDA_CHECK(cudaMemsetAsync(R->a.tickets, 0, (1 + (size_t)R->M * ntiles) * sizeof(unsigned), dev.stream));
    }
    if (R->own) {
        /* the caller's W (and A) into the path's copies, with their operand copies */
        mn_large_op o = {0};
        o.flags = MN_LARGE_LOAD;
        MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
    } else if (R->prec == MN_PREC_BF16) {
        mn_large_op o = {0};
        o.flags = MN_LARGE_CONVERT_W;
        MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
        if (R->training && R->refresh != R->step) {
            o.flags = MN_LARGE_CONVERT_A;
            MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
        }
    }
    return MN_OK;
}

/* Whether full step sl is the one to capture. The first step of a shape
 * runs directly: cuBLAS picks its kernels and the modules load outside a
 * capture. Within one segment a graph pays off from two replays on; a kept
 * one serves later segments too, so it is captured as soon as a step of
 * its shape has run. */
static bool capture_now(const run *R, long long sl, long long full)
{
    const kept *E = R->kept;
    if (E) return !E->graph && !E->no_graph && (sl >= 1 || E->warm);
    return !R->graph && sl == 1 && full - 1 >= 2;
}

static mn_status run_steps(run *R, long long n)
{
    MN_TRY(begin(R));
    const long long c = R->step, full = n / c, tail = n % c;
    kept *E = R->kept;
    cudaGraphExec_t *graph = E ? &E->graph : &R->graph;
    for (long long sl = 0; sl < full; sl++) {
        if (capture_now(R, sl, full) && !capture_step(R, graph) && E) E->no_graph = true;
        if (*graph) {
            MN_CUDA_CHECK(cudaGraphLaunch(*graph, dev.stream));
        } else {
            MN_TRY(enqueue_step(R, c));
            if (E) E->warm = true;
        }
    }
    if (tail > 0) MN_TRY(enqueue_step(R, tail));
    return MN_OK;
}

/* A kept segment's end: the path's W (and A) back into the caller's. */
static mn_status store(const run *R)
{
    if (!R->own) return MN_OK;
    mn_large_op o = {0};
    o.flags = MN_LARGE_STORE;
    return launch(R, K_PARAMS, grid_slices(R), block1, &o);
}

mn_status mn_cuda_large_segment_run(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out,
                                    int64_t n, int64_t nsteps)
{
    int64_t memories = st->dims.B * st->dims.H;
    if (n == 0 || memories == 0) {
        st->steps_done += nsteps;
        return MN_OK;
    }
    run R;
    MN_TRY(run_init(&R, st, st->rule.step < n ? st->rule.step : n, true));
    mn_large_kargs *a = &R.a;
    R.k = f32(&in->k);
    R.q = a->q = f32(&in->q);
    R.y = a->y = in->want_y ? f32(&out->y) : NULL;
    R.after = st->rule.retrieve == MN_RETRIEVE_AFTER;
    R.copy_y = R.y && !R.q && R.refresh == R.step;
    R.retrieve = R.y && !R.copy_y;
    a->k = R.k;
    a->v = f32(&in->v);
    a->theta = f32(&in->theta);
    a->eta = f32(&in->eta);
    a->alpha = f32(&in->alpha);
    a->loss = f32(&out->loss);
    a->grad_norm = f32(&out->grad_norm);
    a->clip_scale = f32(&out->clip_scale);
    a->skipped = f32(&out->skipped);
    a->step_loss = f32(&out->step_loss);
    a->weight_norm = f32(&out->weight_norm);
    a->n = n;
    a->nsteps = nsteps;
    /* ragged batches: the engine gives lengths as i64 on this device
     * (model/engine.c), uploaded on the legacy stream, which begin() waits for */
    if (in->lengths.storage) {
        if (in->lengths.dtype != MN_I64 || in->lengths.storage->device != MN_CUDA)
            return mn_fail(MN_ERR_ARG, "cuda engine: lengths must come as i64 on cuda");
        a->lengths = (const long long *)mn_tensor_data(&in->lengths);
        a->heads = st->dims.H;
    }
    /* kept where there is a full step to replay (else alloc_work) */
    if (n >= R.step) MN_TRY(mn_large_kept_attach(&R, dev.total_bytes));
    if (!R.kept) MN_TRY(alloc_work(&R));
    mn_status s = run_steps(&R, n);
    if (s == MN_OK) s = store(&R);
    s = finish(&R, s);
    if (s != MN_OK) return s;
    st->steps_done += nsteps;
    mn_report_progress(memories * nsteps, memories * nsteps);
    return MN_OK;
}

mn_status mn_cuda_large_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y)
{
    int64_t memories = st->dims.B * st->dims.H, rows = q->shape[2];
    if (rows == 0 || memories == 0) return MN_OK;
    run R;
    MN_TRY(run_init(&R, st, rows, false));
    R.a.n = rows; /* counter NULL: the rows start at 0 */
    R.y = R.a.y = f32(y);
    R.q = R.a.q = f32(q);
    MN_TRY(alloc_work(&R));
    mn_status s = begin(&R);
    for (long long r0 = 0; s == MN_OK && r0 < rows; r0 += R.CR) {
        const long long cr = rows - r0 < R.CR ? rows - r0 : R.CR;
        /* every row real: the read has no lengths, and its rows are one "step" */
        s = stage(&R, true, r0, cr, rows);
        if (s == MN_OK) s = forward(&R, R.a.W, R.Wop, cr, false);
        if (s == MN_OK) s = out_rows(&R, true, r0, cr, rows);
    }
    return finish(&R, s);
}

/* ---- the backward's recompute (kernels/grad_large.c) ---- */

struct mn_large_stepper {
    run R;
    mn_memory_state *st;
    long long next;
    int64_t n, nsteps;
    int full_runs;        /* full steps run so far: the second is captured */
    float *outs;          /* the forward's outputs, [M, n] loss then 5 x [M, nsteps] */
    size_t outs_bytes;
};

mn_status mn_large_stepper_open(mn_memory_state *st, const mn_segment_inputs *in, int64_t n, int64_t nsteps,
                                mn_large_stepper **out)
{
    *out = NULL;
    mn_large_stepper *sp = calloc(1, sizeof *sp);
    if (!sp) return mn_fail(MN_ERR_OOM, "cuda large backward: out of memory");
    run *R = &sp->R;
    mn_status s = run_init(R, st, st->rule.step < n ? st->rule.step : n, true);
    if (s != MN_OK) {
        free(sp);
        return s;
    }
    sp->st = st;
    sp->n = n;
    sp->nsteps = nsteps;
    const long long M = R->M;
    sp->outs_bytes = sizeof(float) * (size_t)(M * n + 5 * M * nsteps);
    s = mn_cuda_alloc(sp->outs_bytes, (void **)&sp->outs);
    if (s != MN_OK) {
        free(sp);
        return s;
    }
    mn_large_kargs *a = &R->a;
    R->k = f32(&in->k);
    R->q = a->q = f32(&in->q);
    a->k = R->k;
    a->v = f32(&in->v);
    a->theta = f32(&in->theta);
    a->eta = f32(&in->eta);
    a->alpha = f32(&in->alpha);
    /* no retrieval: the backward wants the state, the gradient and skipped */
    a->loss = sp->outs;
    float **steps[5] = {&a->grad_norm, &a->clip_scale, &a->skipped, &a->step_loss, &a->weight_norm};
    for (int i = 0; i < 5; i++) *steps[i] = sp->outs + M * n + i * M * nsteps;
    a->n = n;
    a->nsteps = nsteps;
    s = alloc_work(R);
    if (s == MN_OK) s = begin(R);
    if (s != MN_OK) {
        mn_large_stepper_close(sp, s);
        return s;
    }
    *out = sp;
    return MN_OK;
}

/* A state that the caller rewrote (a checkpoint restored): its bf16 operand
 * copies follow it. */
mn_status mn_large_stepper_state_set(mn_large_stepper *sp)
{
    run *R = &sp->R;
    if (R->prec != MN_PREC_BF16) return MN_OK;
    mn_large_op o = {0};
    o.flags = MN_LARGE_CONVERT_W;
    MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
    if (R->refresh != R->step) {
        o.flags = MN_LARGE_CONVERT_A;
        MN_TRY(launch(R, K_PARAMS, grid_slices(R), block1, &o));
    }
    return MN_OK;
}

mn_status mn_large_stepper_run(mn_large_stepper *sp, int64_t s)
{
    run *R = &sp->R;
    if (s != sp->next) {
        /* a kernel argument would change the captured graph: the counter is set by a copy */
        sp->next = s;
        MN_CUDA_CHECK(cudaMemcpyAsync(R->a.counter, &sp->next, sizeof(long long), cudaMemcpyHostToDevice, dev.stream));
        /* the copy reads sp->next when the stream gets there: wait before it changes */
        MN_CUDA_CHECK(cudaStreamSynchronize(dev.stream));
    }
    const long long c = R->step, rows = s * c + c <= sp->n ? c : sp->n - s * c;
    if (rows == c) {
        if (++sp->full_runs == 2 && !R->graph) (void)capture_step(R, &R->graph);
        if (R->graph) MN_CUDA_CHECK(cudaGraphLaunch(R->graph, dev.stream));
        else MN_TRY(enqueue_step(R, c));
    } else {
        MN_TRY(enqueue_step(R, rows));
    }
    sp->next = s + 1; /* the step's last kernel advanced the counter */
    return MN_OK;
}

float *mn_large_stepper_grad(const mn_large_stepper *sp, int p) { return sp->R.a.G[p]; }
const float *mn_large_stepper_skipped(const mn_large_stepper *sp) { return sp->R.a.skipped; }
void *mn_large_stepper_stream(const mn_large_stepper *sp)
{
    (void)sp;
    return dev.stream;
}
void *mn_large_stepper_blas(const mn_large_stepper *sp)
{
    (void)sp;
    return dev.blas;
}

mn_status mn_large_stepper_close(mn_large_stepper *sp, mn_status s)
{
    if (!sp) return s;
    s = finish(&sp->R, s);
    mn_cuda_free(sp->outs, sp->outs_bytes);
    free(sp);
    return s;
}
