/* grad_cuda.c: the backward of a run (SPEC.md section 7) on the GPU: the
 * host side of kernels/fused_grad.cuh (the fused path's backward, where
 * mn_cuda_plan_backward takes the rule) and kernels/grad_kernel.cuh (the
 * general path's), or kernels/grad_large.c (the large path's: cuBLAS
 * products, for few big memories), registered with
 * model/grad_cpu.c's mn_run_backward_on as the MN_CUDA grad backend (model/
 * never calls kernels/). For a rule that mn_cuda_backward_covers (plan.c):
 * the initial state and the inputs go to the GPU as the forward's do
 * (mn_memory_create, mn_segment_inputs_materialize), the upstream too; one
 * launch of the generated kernel, one block per memory, computes every
 * gradient into zeroed device tensors, which the caller gets (grad.h: a
 * backend's gradients stay on its device). The workspace (checkpoints
 * and the block's states, per memory) is sized here by
 * mn_grad_layout_init, the kernel's own layout (newton_schulz's scratch
 * after it, mn_grad_layout_add_ns, then out_norm's rows; the fused one's
 * scratch by mn_fgrad_layout_add_ns). Every device allocation is
 * a tensor or the workspace, given back on every path out.
 * qk_norm: the kernels (general or fused) run on the normalised keys and
 * queries and never normalise (codegen gives them no qk_norm), as the CPU's
 * passes do: the keys are normalised here on the device with each row's
 * scale kept, and the kernel's gradients of them go back through the
 * normalisation on the device afterwards (rownorm.h's adjoint, the
 * backend's rownorm_vjp), as grad_cpu.c does at its end. */
#include "cuda_check.h"
#include "codegen.h"
#include "cuda_module.h"
#include "plan.h"
#include "cuda.h"
#include "grad_large.h"
#include "rule_kernel.cuh" /* its first part is C: MN_RULE_MAX_PARAMS, the forward's chunk layout */
#include "grad_common.cuh" /* its first part is C: the arguments and the workspace layout */
#include "fused_grad.cuh"  /* its first part is C: the fused backward's workspace layout */
#include "../model/grad.h"
#include "../model/rownorm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool cuda_grad_covers(const mn_rule *rule, char *why, size_t why_len)
{
    return mn_cuda_backward_covers(rule, why, why_len);
}

static float *f32(const mn_tensor *t) { return t->storage ? (float *)mn_tensor_data(t) : NULL; }

/* What one backward holds on the device, released in one place. */
typedef struct grad_run {
    mn_memory_state st;
    bool have_state;
    mn_segment_inputs in;
    mn_tensor dy, dloss, dW[MN_MAX_PARAMS], dS[MN_MAX_PARAMS];
    mn_tensor gk, gv, gq, gtheta, geta, galpha, gW[MN_MAX_PARAMS], gS[MN_MAX_PARAMS];
    mn_tensor gouter[MN_OUTER_COUNT]; /* out_norm: the gradients of ln_g, ln_b [B,H,dv] */
    mn_tensor kscale, qscale; /* qk_norm: each key's and query's row scale */
    void *work;
    size_t work_bytes;
} grad_run;

static void grad_run_free(grad_run *g)
{
    mn_tensor *ts[] = {&g->dy,    &g->dloss, &g->gk,     &g->gv,     &g->gq,
                       &g->gtheta, &g->geta, &g->galpha, &g->kscale, &g->qscale};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int j = 0; j < MN_OUTER_COUNT; j++) mn_tensor_release(&g->gouter[j]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&g->dW[p]);
        mn_tensor_release(&g->dS[p]);
        mn_tensor_release(&g->gW[p]);
        mn_tensor_release(&g->gS[p]);
    }
    mn_segment_inputs_release(&g->in);
    if (g->work) mn_cuda_free(g->work, g->work_bytes);
    if (g->have_state) mn_memory_free(&g->st);
    memset(g, 0, sizeof *g);
}

/* The launch on the layer's current stream, waited for: a fault inside the
 * kernel is reported here. */
static mn_status launch(const mn_cuda_module *mod, int64_t memories, int threads, long smem, mn_grad_kargs *a)
{
    dim3 grid = {(unsigned)memories, 1, 1}, block = {(unsigned)threads, 1, 1};
    void *args[1] = {a};
    cudaStream_t stream = (cudaStream_t)mn_cuda_get_stream();
    /* lengths came up with a cudaMemcpy on the legacy stream (model/engine.c):
     * a caller's stream must not start the kernel before it lands */
    if (stream) MN_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    MN_CUDA_CHECK(cudaLaunchKernel((const void *)mod->k[0], grid, block, args, (size_t)smem, stream));
    MN_CUDA_CHECK_LAUNCH();
    MN_CUDA_CHECK(cudaStreamSynchronize(stream));
    return MN_OK;
}

/* A reference to the device tensor src in *dst (none where src is empty). */
static void keep(mn_tensor *dst, const mn_tensor *src)
{
    if (src->storage) mn_tensor_share(dst, src);
}

/* The backward's kernel for the plan's path, its workspace floats per
 * memory, and its launch shape. */
typedef struct grad_kernel {
    mn_cuda_module *mod;
    long long work_floats;
    int threads;
    long smem;
} grad_kernel;

static mn_status kernel_for(const mn_rule *r, const mn_dims *d, mn_precision prec, const mn_cuda_plan *pl,
                            long long P, int64_t K, int64_t nblocks, grad_kernel *gk)
{
    char *src;
    const char *name;
    if (pl->path == MN_PATH_FUSED) {
        mn_fgrad_layout lo;
        mn_fgrad_layout_init(&lo, P, mn_fused_padded_floats(r, d), K, nblocks, mn_rule_refresh(r) != r->step);
        mn_fgrad_layout_add_ns(&lo, r->layers, d->dk, d->dv, r->layers > 1 ? d->dh : 0,
                               r->precondition == MN_PRECOND_NEWTON_SCHULZ ? r->ns_steps : 0);
        gk->work_floats = lo.total;
        gk->threads = pl->threads;
        gk->smem = pl->smem_bytes;
        src = mn_cuda_fused_grad_source(r, d, prec, pl);
        name = MN_FUSED_GRAD_KERNEL;
    } else {
        mn_grad_layout lo;
        mn_grad_layout_init(&lo, r->layers, r->bias, r->glu && r->layers > 1, d->dk, d->dv,
                            r->layers > 1 ? d->dh : 0, mn_rule_chunk_rows(r->step), K, nblocks);
        /* the kernel's order: newton_schulz's scratch, then out_norm's rows */
        mn_grad_layout_add_ns(&lo, r->layers, d->dk, d->dv, r->layers > 1 ? d->dh : 0,
                              r->precondition == MN_PRECOND_NEWTON_SCHULZ ? r->ns_steps : 0);
        if (r->out_norm != MN_NORM_NONE) mn_grad_layout_out_norm(&lo, d->dv, mn_rule_chunk_rows(r->step));
        gk->work_floats = lo.total;
        gk->threads = MN_RULE_THREADS;
        gk->smem = 0;
        src = mn_cuda_grad_source(r, d);
        name = MN_GRAD_KERNEL;
    }
    if (!src) return MN_ERR_ARG;
    const char *names[] = {name, NULL};
    mn_status s = mn_cuda_module_get(src, names, mn_cuda_run_work(r, d), &gk->mod);
    free(src);
    MN_TRY(s);
    MN_TRY(mn_cuda_module_set_constants(gk->mod, r, (cudaStream_t)mn_cuda_get_stream()));
    if (gk->smem > 48 * 1024) MN_TRY(mn_cuda_module_set_smem(gk->mod, gk->smem));
    return MN_OK;
}

/* The large path's backward (grad_large.h) on the run's device tensors. */
static mn_status run_large(grad_run *g, mn_precision prec, int64_t n, int64_t S, int64_t K, mn_run_grads *out,
                           bool *declined)
{
    mn_large_grad_io io;
    memset(&io, 0, sizeof io);
    io.st = &g->st;
    io.in = &g->in;
    io.n = n;
    io.nsteps = S;
    io.K = K;
    io.dy = f32(&g->dy);
    io.dloss = f32(&g->dloss);
    for (int p = 0; p < g->st.nparams; p++) {
        io.dWf[p] = f32(&g->dW[p]);
        io.dSf[p] = f32(&g->dS[p]);
        io.gW[p] = f32(&g->gW[p]);
        io.gS[p] = f32(&g->gS[p]);
    }
    io.gk = f32(&g->gk);
    io.gv = f32(&g->gv);
    io.gq = f32(&g->gq);
    io.gtheta = f32(&g->gtheta);
    io.geta = f32(&g->geta);
    io.galpha = f32(&g->galpha);
    int64_t bytes = 0;
    MN_TRY(mn_cuda_large_backward(&io, prec, &bytes, declined));
    out->backward_bytes = bytes;
    return MN_OK;
}

static mn_status run_kernel(grad_run *g, mn_precision prec, int64_t n, int64_t S, int64_t block_steps,
                            mn_run_grads *out)
{
    const mn_rule *r = &g->st.rule;
    const mn_dims *d = &g->st.dims;
    int64_t memories = d->B * d->H;
    int64_t K = mn_grad_block_steps(S, block_steps), nblocks = S > 0 ? (S + K - 1) / K : 0;
    mn_cuda_plan pl;
    MN_TRY(mn_cuda_plan_backward(r, d, prec, mn_cuda_arch(), mn_cuda_smem_optin(), &pl));
    mn_grad_layout flat;
    mn_grad_layout_init(&flat, r->layers, r->bias, r->glu && r->layers > 1, d->dk, d->dv, r->layers > 1 ? d->dh : 0,
                        16, 1, 1);
    out->block = K;
    out->forward_bytes = memories * 3 * flat.P * 4;
    if (n == 0 || memories == 0) return MN_OK;
    if (memories > 2147483647LL)
        return mn_fail(MN_ERR_UNSUPPORTED, "cuda backward: %lld memories (B x H) exceed one launch's grid",
                       (long long)memories);
    if (pl.path == MN_PATH_LARGE) {
        bool declined = false;
        MN_TRY(run_large(g, prec, n, S, K, out, &declined));
        if (!declined) return MN_OK;
        /* lengths or a non-finite input: the general backward cuts such rows as the CPU's does */
        pl.path = MN_PATH_GENERAL;
    }
    grad_kernel gk;
    MN_TRY(kernel_for(r, d, prec, &pl, flat.P, K, nblocks, &gk));
    out->backward_bytes = (int64_t)sizeof(float) * gk.work_floats * memories;
    g->work_bytes = sizeof(float) * (size_t)gk.work_floats * (size_t)memories;
    mn_status s = mn_cuda_alloc(g->work_bytes, &g->work);
    if (s != MN_OK) {
        g->work = NULL;
        return mn_fail_context(s, "cuda backward: workspace of %.1f MB (checkpoints every %lld steps): ",
                               (double)g->work_bytes / 1e6, (long long)K);
    }
    mn_grad_kargs a;
    memset(&a, 0, sizeof a);
    for (int p = 0; p < g->st.nparams; p++) {
        a.W0[p] = f32(&g->st.params[p]);
        a.S0[p] = f32(&g->st.momenta[p]);
        a.dWf[p] = f32(&g->dW[p]);
        a.dSf[p] = f32(&g->dS[p]);
        a.gW[p] = f32(&g->gW[p]);
        a.gS[p] = f32(&g->gS[p]);
    }
    a.k = f32(&g->in.k);
    a.v = f32(&g->in.v);
    a.q = f32(&g->in.q);
    a.theta = f32(&g->in.theta);
    a.eta = f32(&g->in.eta);
    a.alpha = f32(&g->in.alpha);
    a.dy = f32(&g->dy);
    a.dloss = f32(&g->dloss);
    a.gk = f32(&g->gk);
    a.gv = f32(&g->gv);
    a.gq = f32(&g->gq);
    a.gtheta = f32(&g->gtheta);
    a.geta = f32(&g->geta);
    a.galpha = f32(&g->galpha);
    /* out_norm: the state's ln_g, ln_b (on the device, mn_memory_set_outer) and their gradients */
    a.ln_g = f32(&g->st.outer[0]);
    a.ln_b = f32(&g->st.outer[1]);
    a.gln_g = f32(&g->gouter[0]);
    a.gln_b = f32(&g->gouter[1]);
    if (r->out_norm != MN_NORM_NONE && !(a.ln_g && a.ln_b && a.gln_g && a.gln_b))
        return mn_fail(MN_ERR_ARG, "cuda backward: out_norm without ln_g, ln_b on the device");
    if (g->in.lengths.storage) {
        if (g->in.lengths.dtype != MN_I64 || g->in.lengths.storage->device != MN_CUDA)
            return mn_fail(MN_ERR_ARG, "cuda backward: lengths must come as i64 on cuda");
        a.lengths = (const long long *)mn_tensor_data(&g->in.lengths);
    }
    a.heads = d->H;
    a.work = g->work;
    a.work_floats = gk.work_floats;
    a.n = n;
    a.nsteps = S;
    a.K = K;
    a.nblocks = nblocks;
    return launch(gk.mod, memories, gk.threads, gk.smem, &a);
}

/* qk_norm: *x (a raw key or query input on the device, perhaps the
 * caller's own tensor) becomes its normalised copy, and *scale its rows'
 * scales. */
static mn_status normalise_keys(mn_rownorm qk, mn_tensor *x, mn_tensor *scale)
{
    mn_tensor nhat = {0};
    MN_TRY(mn_rownorm_tensor_scaled(qk, x, &nhat, scale));
    mn_tensor_release(x);
    *x = nhat;
    return MN_OK;
}

/* qk_norm: the kernel's gradients of the normalised keys and queries,
 * taken back through the normalisation in place, waited for (a fault is
 * reported here, and the scales are released after). */
static mn_status keys_backward(grad_run *g, mn_rownorm qk)
{
    MN_TRY(mn_rownorm_vjp_tensor(qk, &g->in.k, &g->kscale, &g->gk));
    if (g->gq.storage) MN_TRY(mn_rownorm_vjp_tensor(qk, &g->in.q, &g->qscale, &g->gq));
    MN_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)mn_cuda_get_stream()));
    return MN_OK;
}

static mn_status cuda_grad_run(const mn_rule *rule, mn_precision precision, const mn_dims *dims, const mn_tensor *init_params,
                               const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                               const mn_run_upstream *up, int64_t block_steps, mn_run_grads *out)
{
    memset(out, 0, sizeof *out);
    MN_TRY(mn_cuda_ensure_device());
    grad_run *g = calloc(1, sizeof *g);
    if (!g) return mn_fail(MN_ERR_OOM, "cuda backward: out of memory");
    mn_status s = mn_memory_create(&g->st, rule, dims, init_params, init_momenta, MN_CUDA);
    g->have_state = s == MN_OK;
    /* qk_norm: the state's copy of the rule goes without it, so that the
     * inputs come up as given (normalise_keys keeps the scales the
     * forward's normalisation drops); the kernels never read it */
    const mn_rownorm qk = mn_rule_qk_norm(rule);
    if (s == MN_OK) g->st.rule.qk_norm = MN_QKNORM_NONE;
    int64_t n = 0, S = 0;
    if (s == MN_OK) s = mn_memory_set_outer(&g->st, init_outer);
    if (s == MN_OK) s = mn_segment_check(&g->st, in, &n, &S);
    if (s == MN_OK) s = mn_segment_inputs_materialize(&g->st, in, n, S, &g->in);
    if (s == MN_OK && qk.on) s = normalise_keys(qk, &g->in.k, &g->kscale);
    if (s == MN_OK && qk.on && g->in.q.storage) s = normalise_keys(qk, &g->in.q, &g->qscale);
    const mn_dims *d = &g->st.dims;
    int np = g->st.nparams;
    int64_t kshape[4] = {d->B, d->H, n, d->dk}, vshape[4] = {d->B, d->H, n, d->dv};
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    /* the upstream, checked as the CPU's backward checks it */
    if (s == MN_OK) s = mn_grad_upstream_input(&g->dy, &up->dy, "dy", 4, vshape, true, MN_CUDA);
    if (s == MN_OK) s = mn_grad_upstream_input(&g->dloss, &up->dloss, "dloss", 3, tshape, true, MN_CUDA);
    for (int p = 0; p < np && s == MN_OK; p++) {
        char name[16], dname[24];
        mn_rule_param_name(&g->st.rule, p, name, sizeof name);
        const mn_tensor *pt = &g->st.params[p];
        snprintf(dname, sizeof dname, "d%s", name);
        s = mn_grad_upstream_input(&g->dW[p], &up->dparams[p], dname, pt->ndim, pt->shape, false, MN_CUDA);
        snprintf(dname, sizeof dname, "dS_%s", name);
        if (s == MN_OK)
            s = mn_grad_upstream_input(&g->dS[p], &up->dmomenta[p], dname, pt->ndim, pt->shape, false, MN_CUDA);
    }
    /* the gradients, zeroed: the kernel's passes accumulate into them */
    if (s == MN_OK) s = mn_tensor_zeros(&g->gk, MN_F32, 4, kshape, MN_CUDA);
    if (s == MN_OK) s = mn_tensor_zeros(&g->gv, MN_F32, 4, vshape, MN_CUDA);
    if (s == MN_OK && in->q.storage) s = mn_tensor_zeros(&g->gq, MN_F32, 4, kshape, MN_CUDA);
    if (s == MN_OK) s = mn_tensor_zeros(&g->gtheta, MN_F32, 3, tshape, MN_CUDA);
    if (s == MN_OK) s = mn_tensor_zeros(&g->geta, MN_F32, 3, sshape, MN_CUDA);
    if (s == MN_OK) s = mn_tensor_zeros(&g->galpha, MN_F32, 3, sshape, MN_CUDA);
    /* ln_g's and ln_b's, summed over every pass of a memory as grad_cpu.c's */
    int64_t oshape[3] = {d->B, d->H, d->dv};
    for (int j = 0; j < mn_rule_outer_count(&g->st.rule) && s == MN_OK; j++)
        s = mn_tensor_zeros(&g->gouter[j], MN_F32, 3, oshape, MN_CUDA);
    for (int p = 0; p < np && s == MN_OK; p++) {
        const mn_tensor *pt = &g->st.params[p];
        s = mn_tensor_zeros(&g->gW[p], MN_F32, pt->ndim, pt->shape, MN_CUDA);
        if (s == MN_OK) s = mn_tensor_zeros(&g->gS[p], MN_F32, pt->ndim, pt->shape, MN_CUDA);
    }
    if (s == MN_OK) s = run_kernel(g, precision, n, S, block_steps, out);
    if (s == MN_OK && qk.on) s = keys_backward(g, qk);
    /* the gradients stay on the GPU (grad.h): out takes references */
    out->nparams = np;
    if (s == MN_OK) {
        keep(&out->k, &g->gk);
        keep(&out->v, &g->gv);
        keep(&out->q, &g->gq);
        keep(&out->theta, &g->gtheta);
        keep(&out->eta, &g->geta);
        keep(&out->alpha, &g->galpha);
        for (int p = 0; p < np; p++) {
            keep(&out->params[p], &g->gW[p]);
            keep(&out->momenta[p], &g->gS[p]);
        }
        for (int j = 0; j < MN_OUTER_COUNT; j++) keep(&out->outer[j], &g->gouter[j]);
    }
    grad_run_free(g);
    free(g);
    if (s != MN_OK) mn_run_grads_free(out);
    return s;
}

static const mn_grad_backend cuda_grad = {"cuda", cuda_grad_covers, cuda_grad_run};

void mn_cuda_grad_register(void) { mn_register_grad_backend(MN_CUDA, &cuda_grad); }
