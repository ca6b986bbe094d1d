/* grad_cpu.c: the backward of a run (SPEC.md section 7) on the CPU, the plain
 * statement of the adjoint like engine_cpu.c is of the forward. Per memory:
 *
 *   1. run the forward from the initial state, keeping (W, S, anchor) at
 *      checkpoints every K steps;
 *   2. for each block of K steps, last block first: recompute the block from
 *      its checkpoint, keeping W^(s), S^(s), the gradient point Wbar_s, the
 *      step gradient G_s and the memory model's activations at Wbar_s of
 *      every step, then walk the block's steps in
 *      reverse with the adjoints dW (of W^(s+1)), dS (of S^(s+1)) and dA (of
 *      the anchor of the current refresh block):
 *        retrieval at W^(s+1)   y_t = M(q_t; W^(s+1))      -> dW, dq
 *        update                 S' = eta S - Gt, W' = (1 - alpha) W + S'
 *                               -> deta, dalpha, dGt; dW, dS of step s
 *        clip                   dGt -> dG (through |G| for norm-type clips)
 *        step gradient          G = sum_t theta_t tscale grad l_t(Wbar) and
 *                               the loss output l_t(Wbar)  -> dA, dk, dv, dtheta
 *        retrieval at W^(s)     -> dW, dq
 *        refresh                at the first step of a refresh block the
 *                               anchor is W^(s): dW += dA, dA = 0.
 * A skipped step (non-finite G) is the identity: no update adjoint, no dG;
 * its tokens' loss outputs still pass dloss to the gradient point, except
 * tokens with non-finite inputs, which mlp_grad_cpu.c cuts as the reference
 * does (grad.h), so that nothing non-finite reaches dA and from there every
 * earlier step.
 * qk_norm: the passes run on the normalised keys and queries, whose
 * gradients go back through the normalisation at the end; out_norm is part
 * of the memory model (mlp_grad_cpu.c), its ln_g, ln_b gradients summed over
 * every pass of a memory.
 * Ragged batches: a step takes only its real tokens (those before lengths_b);
 * a step that starts in the padding is the identity and has no adjoint at
 * all. precondition: the clip's adjoint is preceded by the preconditioner's
 * (model/precond.c), which recomputes its own iterates.
 * Memory per worker: (S/K) checkpoints plus K steps of state, K ~ sqrt(S). */
#include "grad.h"
#include "precond.h"
#include "rownorm.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);

/* What every worker shares (read only): the rule, sizes, inputs, clip forms. */
typedef struct run_ctx {
    const mn_rule *rule;
    mn_mlp_shape shape;
    int64_t n, nsteps, c, dk, dv, K, nblocks, max_rows, kept_floats;
    int refresh;
    int parts;                       /* a checkpoint's parts (mn_grad_checkpoint_parts) */
    int64_t off[MN_MAX_PARAMS + 1];  /* flat layout of one memory's parameters */
    int64_t P;                       /* floats per memory */
    const mn_tensor *W0, *S0;        /* initial [B,H,...] */
    const float *k, *v, *q, *theta, *eta, *alpha;
    const float *ln_g, *ln_b;        /* out_norm's [B,H,dv], or NULL */
    const float *dy, *dloss;
    const int64_t *lengths;          /* [B] real tokens per sequence, or NULL */
    int64_t H;
    const float *dWf[MN_MAX_PARAMS], *dSf[MN_MAX_PARAMS];
    /* clip: the scale expression in n and its derivative (norm, softnorm,
     * scale), or programs of the elementwise expression in g and its
     * derivative (value, elementwise) */
    mn_expr *scale, *dscale;
    mn_expr_program *elem, *delem;
    mn_run_grads *out;
    const mn_run_checkpoints *ck;    /* the forward's checkpoints, or NULL */
} run_ctx;

typedef struct worker {
    mn_mlp_grad_work gw;
    float *ck;          /* nblocks x 3P: W, S, A at the first step of each block */
    float *Wb, *Sb;     /* (K+1) x P: W^(s), S^(s) of the block's steps, and after */
    float *Ab, *Gb;     /* K x P: gradient point and G of each step */
    char *skipped;      /* K */
    float *kept;        /* K x kept_floats: each step's forward activations at Wbar_s */
    float *W, *S, *A;   /* running state */
    float *dW, *dS, *dA, *dG, *dGt, *tmp;
    float *weight, *gweight, *dyhat;
    double *ebuf_in, *ebuf_out;
    mn_precond_work pw;
} worker;

/* What step_forward did (worker.skipped). */
enum { STEP_TAKEN = 0, STEP_SKIPPED = 1, STEP_PADDING = 2 };

static void ptrs(const run_ctx *x, float *base, float **out)
{
    for (int p = 0; p < x->shape.nparams; p++) out[p] = base + x->off[p];
}

static int64_t steps_rows(const run_ctx *x, int64_t s) { return s * x->c + x->c <= x->n ? x->c : x->n - s * x->c; }

/* Rows of step s that are real tokens of memory m's sequence (0: padding). */
static int64_t real_rows(const run_ctx *x, int64_t m, int64_t s)
{
    int64_t t0 = s * x->c, rows = steps_rows(x, s);
    if (!x->lengths) return rows;
    int64_t real = x->lengths[m / x->H];
    return t0 >= real ? 0 : (t0 + rows <= real ? rows : real - t0);
}

static bool refresh_block_start(const run_ctx *x, int64_t s)
{
    return x->refresh > 0 && s % (x->refresh / x->c) == 0;
}

static double eval_n(const run_ctx *x, const mn_expr *e, double n)
{
    static const char *const nv[] = {"n"};
    const mn_rule *r = x->rule;
    return mn_expr_eval(e, nv, &n, 1, (const char *const *)r->const_names, r->const_values, r->nconsts);
}

/* <a, b> in double with eight partial sums: a single running sum is one
 * add's latency per element, and these reductions over all parameters run
 * several times a step. */
static double dot_d(const float *a, const float *b, int64_t n)
{
    double acc[8] = {0}, sum = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)a[i + j] * b[i + j];
    for (; i < n; i++) sum += (double)a[i] * b[i];
    for (int j = 0; j < 8; j++) sum += acc[j];
    return sum;
}

/* Norm of the group of parameters [p0, p1) of G. */
static double group_norm(const run_ctx *x, const float *G, int p0, int p1)
{
    const float *g = G + x->off[p0];
    int64_t n = x->off[p1] - x->off[p0];
    return sqrt(dot_d(g, g, n));
}

/* The groups a norm-type clip scales together: all parameters (global) or each one. */
static int clip_groups(const run_ctx *x) { return x->rule->clip_scope == MN_SCOPE_GLOBAL ? 1 : x->shape.nparams; }
static void group_range(const run_ctx *x, int g, int *p0, int *p1)
{
    if (x->rule->clip_scope == MN_SCOPE_GLOBAL) {
        *p0 = 0;
        *p1 = x->shape.nparams;
    } else {
        *p0 = g;
        *p1 = g + 1;
    }
}

/* Gt = clip(G) over the flat layout. */
static void clip_forward(const run_ctx *x, worker *w, const float *G, float *Gt)
{
    int64_t P = x->P;
    /* By the clip's kind (model/rule.def): a scale of G, per element, or none. */
    if (mn_rule_clip_scales(x->rule)) {
        for (int g = 0; g < clip_groups(x); g++) {
            int p0, p1;
            group_range(x, g, &p0, &p1);
            float sc = (float)eval_n(x, x->scale, group_norm(x, G, p0, p1));
            for (int64_t e = x->off[p0]; e < x->off[p1]; e++) Gt[e] = G[e] * sc;
        }
    } else if (mn_rule_clip_elementwise(x->rule)) {
        for (int64_t e = 0; e < P; e++) w->ebuf_in[e] = G[e];
        const double *in[1] = {w->ebuf_in};
        mn_expr_program_run(x->elem, in, w->ebuf_out, P);
        for (int64_t e = 0; e < P; e++) Gt[e] = (float)w->ebuf_out[e];
    } else memcpy(Gt, G, sizeof(float) * P);
}

/* dG from dGt: Gt = G sc(|G|) gives dG = sc dGt + sc'(n) <dGt, G> / n * G
 * (n = 0: the second term is 0); elementwise clips multiply by clip'(G). */
static void clip_adjoint(const run_ctx *x, worker *w, const float *G, const float *dGt, float *dG)
{
    int64_t P = x->P;
    if (mn_rule_clip_scales(x->rule)) {
        for (int g = 0; g < clip_groups(x); g++) {
            int p0, p1;
            group_range(x, g, &p0, &p1);
            double nrm = group_norm(x, G, p0, p1), sc = eval_n(x, x->scale, nrm);
            double dot = dot_d(dGt + x->off[p0], G + x->off[p0], x->off[p1] - x->off[p0]);
            double through = nrm > 0 ? eval_n(x, x->dscale, nrm) * dot / nrm : 0.0;
            for (int64_t e = x->off[p0]; e < x->off[p1]; e++) dG[e] = (float)(sc * dGt[e] + through * G[e]);
        }
    } else if (mn_rule_clip_elementwise(x->rule)) {
        for (int64_t e = 0; e < P; e++) w->ebuf_in[e] = G[e];
        const double *in[1] = {w->ebuf_in};
        mn_expr_program_run(x->delem, in, w->ebuf_out, P);
        for (int64_t e = 0; e < P; e++) dG[e] = (float)(dGt[e] * w->ebuf_out[e]);
    } else memcpy(dG, dGt, sizeof(float) * P);
}

/* theta_t tscale for the first rows rows (the real ones) of step s. */
static void step_weights(const run_ctx *x, const float *theta, int64_t s, int64_t rows, float *weight)
{
    int64_t t0 = s * x->c;
    double tscale = x->rule->token_reduce == MN_REDUCE_MEAN ? 1.0 / (double)rows : 1.0;
    for (int64_t t = 0; t < rows; t++) weight[t] = (float)(theta[t0 + t] * tscale);
}

/* Step s of the forward on the running state: G at the gradient point w->A
 * (the caller refreshed it), then clip and update unless G is non-finite.
 * G is left in G; returns whether the step was skipped. */
static int step_forward(const run_ctx *x, worker *w, int64_t m, int64_t s, float *G, float *kept)
{
    int64_t t0 = s * x->c, rows = real_rows(x, m, s);
    if (rows == 0) return STEP_PADDING;
    const float *k = x->k + m * x->n * x->dk, *v = x->v + m * x->n * x->dv, *theta = x->theta + m * x->n;
    float *A[MN_MAX_PARAMS], *Gp[MN_MAX_PARAMS];
    ptrs(x, w->A, A);
    ptrs(x, G, Gp);
    step_weights(x, theta, s, rows, w->weight);
    mn_mlp_forward(&x->shape, &w->gw.fwd, A, k + t0 * x->dk, rows, w->gw.y);
    if (kept) mn_mlp_keep_forward(&x->shape, &w->gw, rows, kept);
    mn_loss_dyhat(&w->gw, w->gw.y, v + t0 * x->dv, w->weight, rows, x->dv, w->dyhat);
    mn_mlp_backward(&x->shape, &w->gw.fwd, A, k + t0 * x->dk, rows, w->dyhat, Gp);
    if (!isfinite(dot_d(G, G, x->P))) return STEP_SKIPPED;
    clip_forward(x, w, G, w->tmp);
    float *Gt[MN_MAX_PARAMS];
    ptrs(x, w->tmp, Gt);
    mn_precond_apply(x->rule, &x->shape, &w->pw, Gt);
    float e_s = x->eta[m * x->nsteps + s], keep = 1.0f - x->alpha[m * x->nsteps + s];
    for (int64_t e = 0; e < x->P; e++) {
        w->S[e] = e_s * w->S[e] - w->tmp[e];
        w->W[e] = keep * w->W[e] + w->S[e];
    }
    return STEP_TAKEN;
}

static void refresh(const run_ctx *x, worker *w, int64_t s)
{
    if (refresh_block_start(x, s)) memcpy(w->A, w->W, sizeof(float) * x->P);
}

/* Reverse of step s, block slot i. */
static void step_reverse(const run_ctx *x, worker *w, int64_t m, int64_t s, int64_t i)
{
    const mn_run_grads *o = x->out;
    int64_t P = x->P, t0 = s * x->c, rows = steps_rows(x, s), n = x->n, dk = x->dk, dv = x->dv;
    const float *k = x->k + m * n * dk, *v = x->v + m * n * dv;
    const float *xq = x->q ? x->q + m * n * dk : k;
    float *gk = (float *)mn_tensor_data(&o->k) + m * n * dk, *gv = (float *)mn_tensor_data(&o->v) + m * n * dv;
    float *gxq = x->q ? (float *)mn_tensor_data(&o->q) + m * n * dk : gk;
    float *gtheta = (float *)mn_tensor_data(&o->theta) + m * n;
    const float *dy = x->dy ? x->dy + m * n * dv : NULL, *dloss = x->dloss ? x->dloss + m * n : NULL;
    float *Wnow = w->Wb + i * P, *Wnext = w->Wb + (i + 1) * P, *Snow = w->Sb + i * P;
    float *G = w->Gb + i * P, *Abar = w->Ab + i * P;
    float *pW[MN_MAX_PARAMS], *pdW[MN_MAX_PARAMS], *pdA[MN_MAX_PARAMS], *pdG[MN_MAX_PARAMS], *pA[MN_MAX_PARAMS];
    ptrs(x, w->dW, pdW);
    ptrs(x, w->dA, pdA);
    ptrs(x, w->dG, pdG);
    ptrs(x, Abar, pA);
    int64_t grows = real_rows(x, m, s);
    if (w->skipped[i] == STEP_PADDING) {
        /* the identity, and its outputs (y = 0, loss = 0) are constants */
        if (refresh_block_start(x, s)) {
            for (int64_t e = 0; e < P; e++) w->dW[e] += w->dA[e];
            memset(w->dA, 0, sizeof(float) * P);
        }
        return;
    }

    /* Retrieval of the step's last token at W^(s+1) (retrieve = after),
     * unless that token is padding. */
    if (dy && x->rule->retrieve == MN_RETRIEVE_AFTER && grows == rows) {
        int64_t t = t0 + rows - 1;
        ptrs(x, Wnext, pW);
        mn_mlp_vjp(&x->shape, &w->gw, pW, xq + t * dk, dy + t * dv, 1, pdW, gxq + t * dk);
    }
    bool skipped = w->skipped[i] == STEP_SKIPPED;
    if (!skipped) {
        float e_s = x->eta[m * x->nsteps + s], keep = 1.0f - x->alpha[m * x->nsteps + s];
        /* the adjoint of S^(s+1) is dS + dW (both uses) */
        double deta = dot_d(w->dS, Snow, P) + dot_d(w->dW, Snow, P), dalpha = -dot_d(w->dW, Wnow, P);
        for (int64_t e = 0; e < P; e++) {
            float dSt = w->dS[e] + w->dW[e];
            w->dGt[e] = -dSt;
            w->dW[e] *= keep;
            w->dS[e] = e_s * dSt;
        }
        ((float *)mn_tensor_data(&o->eta))[m * x->nsteps + s] = (float)deta;
        ((float *)mn_tensor_data(&o->alpha))[m * x->nsteps + s] = (float)dalpha;
        if (mn_precond_on(x->rule)) {
            /* the preconditioner's input is the clipped G */
            float *pGt[MN_MAX_PARAMS], *pdGt[MN_MAX_PARAMS];
            clip_forward(x, w, G, w->tmp);
            ptrs(x, w->tmp, pGt);
            ptrs(x, w->dGt, pdGt);
            mn_precond_adjoint(x->rule, &x->shape, &w->pw, pGt, pdGt);
        }
        clip_adjoint(x, w, G, w->dGt, w->dG);
    }
    /* Retrieval of the rows that see W^(s): with q = k and the gradient
     * point at W^(s) (the first step of a refresh block) those outputs are
     * the step's own M(k_t; Wbar_s), and the step's pass takes their dy. */
    int64_t before = x->rule->retrieve == MN_RETRIEVE_BEFORE ? rows : rows - 1;
    if (before > grows) before = grows; /* padding rows read y = 0 */
    bool merged = dy && before > 0 && !x->q && refresh_block_start(x, s);
    if (!skipped || dloss || merged) {
        step_weights(x, x->theta + m * n, s, grows, w->weight);
        memset(w->gweight, 0, sizeof(float) * grows);
        mn_mlp_step_adjoint(&x->shape, &w->gw, pA, skipped ? NULL : pdG, k + t0 * dk, v + t0 * dv, w->weight,
                            dloss ? dloss + t0 : NULL, merged ? dy + t0 * dv : NULL, before, grows,
                            w->kept + i * x->kept_floats, pdA, gk + t0 * dk, gv + t0 * dv, w->gweight);
        double tscale = x->rule->token_reduce == MN_REDUCE_MEAN ? 1.0 / (double)grows : 1.0;
        for (int64_t t = 0; t < grows; t++) gtheta[t0 + t] += (float)(tscale * w->gweight[t]);
    }
    if (dy && before > 0 && !merged) {
        ptrs(x, Wnow, pW);
        mn_mlp_vjp(&x->shape, &w->gw, pW, xq + t0 * dk, dy + t0 * dv, before, pdW, gxq + t0 * dk);
    }
    if (refresh_block_start(x, s)) {
        for (int64_t e = 0; e < P; e++) w->dW[e] += w->dA[e];
        memset(w->dA, 0, sizeof(float) * P);
    }
}

/* One memory's backward; poll: this thread polls Ctrl-C (between steps). */
static mn_status run_memory(const run_ctx *x, worker *w, int64_t m, bool poll)
{
    int64_t P = x->P, K = x->K;
    const mn_run_grads *o = x->out;
    /* initial state */
    for (int p = 0; p < x->shape.nparams; p++) {
        int64_t ne = x->shape.numel[p];
        memcpy(w->W + x->off[p], (const float *)mn_tensor_data(&x->W0[p]) + m * ne, sizeof(float) * ne);
        memcpy(w->S + x->off[p], (const float *)mn_tensor_data(&x->S0[p]) + m * ne, sizeof(float) * ne);
    }
    memcpy(w->A, w->W, sizeof(float) * P);
    if (x->ln_g) {
        w->gw.fwd.ln_g = x->ln_g + m * x->dv;
        w->gw.fwd.ln_b = x->ln_b + m * x->dv;
        w->gw.gln_g = (float *)mn_tensor_data(&o->outer[0]) + m * x->dv;
        w->gw.gln_b = (float *)mn_tensor_data(&o->outer[1]) + m * x->dv;
    }
    /* 1. checkpoints at the first step of every block (unless the forward
     * kept them); the last block is recomputed in 2 anyway, so this forward
     * stops at its start. */
    int64_t last = x->ck ? -1 : (x->nblocks - 1) * K;
    for (int64_t s = 0; s <= last; s++) {
        if (s % K == 0) {
            float *ck = w->ck + (s / K) * x->parts * P;
            memcpy(ck, w->W, sizeof(float) * P);
            memcpy(ck + P, w->S, sizeof(float) * P);
            if (x->parts == 3) memcpy(ck + 2 * P, w->A, sizeof(float) * P);
        }
        if (s == last) break;
        if (poll && mn_check_interrupt() != MN_OK) return MN_ERR_INTERRUPTED;
        refresh(x, w, s);
        step_forward(x, w, m, s, w->dG, NULL); /* dG is free here: scratch for G */
    }
    /* adjoints of the final tensors */
    for (int p = 0; p < x->shape.nparams; p++) {
        int64_t ne = x->shape.numel[p];
        for (int64_t e = 0; e < ne; e++) {
            w->dW[x->off[p] + e] = x->dWf[p] ? x->dWf[p][m * ne + e] : 0.0f;
            w->dS[x->off[p] + e] = x->dSf[p] ? x->dSf[p][m * ne + e] : 0.0f;
        }
    }
    memset(w->dA, 0, sizeof(float) * P);
    /* 2. blocks in reverse */
    for (int64_t b = x->nblocks - 1; b >= 0; b--) {
        const float *ck = x->ck ? x->ck->data + (b * x->ck->memories + m) * x->parts * P : w->ck + b * x->parts * P;
        memcpy(w->W, ck, sizeof(float) * P);
        memcpy(w->S, ck + P, sizeof(float) * P);
        /* without a stored anchor, the block's first step opens a refresh block */
        memcpy(w->A, x->parts == 3 ? ck + 2 * P : ck, sizeof(float) * P);
        int64_t s0 = b * K, len = s0 + K <= x->nsteps ? K : x->nsteps - s0;
        for (int64_t i = 0; i < len; i++) {
            memcpy(w->Wb + i * P, w->W, sizeof(float) * P);
            memcpy(w->Sb + i * P, w->S, sizeof(float) * P);
            refresh(x, w, s0 + i);
            memcpy(w->Ab + i * P, w->A, sizeof(float) * P);
            w->skipped[i] = step_forward(x, w, m, s0 + i, w->Gb + i * P, w->kept + i * x->kept_floats);
        }
        memcpy(w->Wb + len * P, w->W, sizeof(float) * P);
        memcpy(w->Sb + len * P, w->S, sizeof(float) * P);
        if (poll && mn_check_interrupt() != MN_OK) return MN_ERR_INTERRUPTED;
        for (int64_t i = len - 1; i >= 0; i--) step_reverse(x, w, m, s0 + i, i);
    }
    for (int p = 0; p < x->shape.nparams; p++) {
        int64_t ne = x->shape.numel[p];
        float *gW = (float *)mn_tensor_data(&o->params[p]) + m * ne;
        float *gS = (float *)mn_tensor_data(&o->momenta[p]) + m * ne;
        for (int64_t e = 0; e < ne; e++) {
            gW[e] = w->dW[x->off[p] + e] + w->dA[x->off[p] + e];
            gS[e] = w->dS[x->off[p] + e];
        }
    }
    return MN_OK;
}

static int64_t worker_bytes(const run_ctx *x)
{
    int64_t P = x->P, K = x->K;
    int64_t floats = (x->ck ? 0 : x->nblocks * x->parts * P) + 2 * (K + 1) * P + 2 * K * P + 9 * P + 2 * x->max_rows +
                     x->max_rows * x->dv + K * x->kept_floats;
    int64_t extra = mn_rule_clip_elementwise(x->rule) ? 2 * P * 8 : 0;
    return floats * 4 + K + extra + mn_mlp_grad_work_bytes(&x->shape, x->max_rows) +
           mn_precond_work_bytes(x->rule, &x->shape, true);
}

static void worker_free(worker *w)
{
    mn_mlp_grad_work_free(&w->gw);
    mn_precond_work_free(&w->pw);
    void *bufs[] = {w->ck, w->Wb, w->Sb, w->Ab, w->Gb, w->skipped, w->kept, w->W, w->S, w->A, w->dW, w->dS,
                    w->dA, w->dG, w->dGt, w->tmp, w->weight, w->gweight, w->dyhat, w->ebuf_in, w->ebuf_out};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    memset(w, 0, sizeof *w);
}

static mn_status worker_init(worker *w, const run_ctx *x)
{
    memset(w, 0, sizeof *w);
    MN_TRY(mn_mlp_grad_work_init(&w->gw, &x->shape, x->rule, x->max_rows));
    mn_status pst = mn_precond_work_init(&w->pw, x->rule, &x->shape, true);
    if (pst != MN_OK) {
        mn_mlp_grad_work_free(&w->gw);
        return pst;
    }
    int64_t P = x->P, K = x->K;
    bool ok = (x->ck || (w->ck = malloc(sizeof(float) * x->nblocks * x->parts * P))) && (w->Wb = malloc(sizeof(float) * (K + 1) * P)) &&
              (w->Sb = malloc(sizeof(float) * (K + 1) * P)) && (w->Ab = malloc(sizeof(float) * K * P)) &&
              (w->Gb = malloc(sizeof(float) * K * P)) && (w->skipped = malloc((size_t)K)) &&
              (w->kept = malloc(sizeof(float) * K * x->kept_floats)) &&
              (w->weight = malloc(sizeof(float) * x->max_rows)) && (w->gweight = malloc(sizeof(float) * x->max_rows)) &&
              (w->dyhat = malloc(sizeof(float) * x->max_rows * x->dv));
    float **flat[] = {&w->W, &w->S, &w->A, &w->dW, &w->dS, &w->dA, &w->dG, &w->dGt, &w->tmp};
    for (size_t i = 0; i < sizeof flat / sizeof *flat && ok; i++) ok = (*flat[i] = malloc(sizeof(float) * P)) != NULL;
    if (ok && (mn_rule_clip_elementwise(x->rule)))
        ok = (w->ebuf_in = malloc(sizeof(double) * P)) && (w->ebuf_out = malloc(sizeof(double) * P));
    if (!ok) {
        worker_free(w);
        return mn_fail(MN_ERR_OOM, "out of memory for the backward's checkpoints (%lld steps per block)",
                       (long long)K);
    }
    return MN_OK;
}

/* ---- setup: shapes, materialised inputs, the clip's forms ---- */

static mn_status materialize(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape)
{
    MN_TRY(mn_tensor_empty(out, MN_F32, ndim, shape, MN_CPU));
    mn_status st = mn_tensor_copy_into(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

mn_status mn_grad_upstream_input(mn_tensor *out, const mn_tensor *src, const char *name, int ndim,
                                 const int64_t *shape, bool exact, mn_device dev)
{
    if (!src->storage) return MN_OK;
    int nd;
    int64_t bshape[MN_MAX_DIMS];
    bool fits = src->ndim <= ndim && mn_broadcast_shapes(src->ndim, src->shape, ndim, shape, &nd, bshape) == MN_OK;
    for (int i = 0; fits && i < ndim; i++) fits = bshape[i] == shape[i];
    if (fits && exact) fits = src->ndim == ndim;
    if (!fits) {
        char got[128], want[128];
        mn_shape_string(src, got, sizeof got);
        mn_shape_string_of(ndim, shape, want, sizeof want);
        return mn_fail(MN_ERR_ARG, "upstream %s has shape %s; expected %s", name, got, want);
    }
    MN_TRY(mn_tensor_empty(out, MN_F32, ndim, shape, dev));
    mn_status st = mn_tensor_copy_into(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

static mn_status upstream_input(mn_tensor *out, const mn_tensor *src, const char *name, int ndim,
                                const int64_t *shape, bool exact)
{
    return mn_grad_upstream_input(out, src, name, ndim, shape, exact, MN_CPU);
}

void mn_run_grads_free(mn_run_grads *g)
{
    mn_tensor *ts[] = {&g->k, &g->v, &g->q, &g->theta, &g->eta, &g->alpha, &g->outer[0], &g->outer[1]};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&g->params[p]);
        mn_tensor_release(&g->momenta[p]);
    }
    memset(g, 0, sizeof *g);
}

static mn_status clip_forms(run_ctx *x)
{
    const mn_rule *r = x->rule;
    if (r->clip == MN_CLIP_NONE) return MN_OK;
    mn_expr *e = mn_rule_clip_expr(r);
    if (!e) return MN_ERR_ARG;
    const char *const *cn = (const char *const *)r->const_names;
    mn_status st = MN_OK;
    if (mn_rule_clip_elementwise(r)) {
        static const char *const gv[] = {"g"};
        mn_expr *de = mn_expr_diff(e, "g");
        st = de ? mn_expr_compile(e, gv, 1, cn, r->const_values, r->nconsts, &x->elem) : MN_ERR_OOM;
        if (st == MN_OK) st = mn_expr_compile(de, gv, 1, cn, r->const_values, r->nconsts, &x->delem);
        mn_expr_unref(de);
        mn_expr_unref(e);
        return st;
    }
    x->scale = e;
    x->dscale = mn_expr_diff(e, "n");
    return x->dscale ? MN_OK : MN_ERR_OOM;
}

/* ---- where the backward runs ---- */

static const mn_grad_backend *grad_backends[2];

void mn_register_grad_backend(mn_device dev, const mn_grad_backend *b) { grad_backends[dev] = b; }

const mn_grad_backend *mn_grad_backend_for(mn_device dev)
{
    return (unsigned)dev < sizeof grad_backends / sizeof *grad_backends ? grad_backends[dev] : NULL;
}

static mn_status cpu_backward(const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                              const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                              const mn_run_upstream *up, int64_t block_steps, const mn_run_checkpoints *ck,
                              mn_run_grads *out);

mn_status mn_run_backward_on(mn_device dev, mn_precision precision, const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                             const mn_tensor *init_momenta, const mn_tensor *init_outer,
                             const mn_segment_inputs *in, const mn_run_upstream *up, int64_t block_steps,
                             const mn_run_checkpoints *ck, mn_run_grads *out)
{
    const mn_grad_backend *b = dev == MN_CPU ? NULL : mn_grad_backend_for(dev);
    char why[256];
    if (b && b->covers(rule, why, sizeof why)) {
        memset(out, 0, sizeof *out);
        return b->run(rule, precision, dims, init_params, init_momenta, init_outer, in, up, block_steps, out);
    }
    return cpu_backward(rule, dims, init_params, init_momenta, init_outer, in, up, block_steps, ck, out);
}

mn_status mn_run_backward(const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                          const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                          const mn_run_upstream *up, int64_t block_steps, const mn_run_checkpoints *ck,
                          mn_run_grads *out)
{
    mn_device dev = in->k.storage ? in->k.storage->device : MN_CPU;
    return mn_run_backward_on(dev, MN_PREC_FP32, rule, dims, init_params, init_momenta, init_outer, in, up, block_steps, ck, out);
}

/* The CPU's backward (the contract of mn_run_backward). */
static mn_status cpu_backward(const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                              const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                              const mn_run_upstream *up, int64_t block_steps, const mn_run_checkpoints *ck,
                              mn_run_grads *out)
{
    memset(out, 0, sizeof *out);
    mn_memory_state st;
    MN_TRY(mn_memory_create(&st, rule, dims, init_params, init_momenta, MN_CPU));
    int64_t n = 0, S = 0;
    mn_status s = mn_memory_set_outer(&st, init_outer);
    if (s == MN_OK) s = mn_segment_check(&st, in, &n, &S);
    run_ctx x;
    memset(&x, 0, sizeof x);
    x.rule = &st.rule;
    mn_mlp_shape_init(&x.shape, &st.rule, &st.dims);
    const mn_dims *d = &st.dims;
    int64_t memories = d->B * d->H;
    x.n = n;
    x.nsteps = S;
    x.c = st.rule.step;
    x.dk = d->dk;
    x.dv = d->dv;
    x.refresh = mn_rule_refresh(&st.rule);
    x.parts = mn_grad_checkpoint_parts(&st.rule);
    x.max_rows = x.c < n ? x.c : (n > 0 ? n : 1);
    x.K = ck ? ck->K : mn_grad_block_steps(S, block_steps);
    x.nblocks = S > 0 ? (S + x.K - 1) / x.K : 0;
    for (int p = 0; p < x.shape.nparams; p++) x.off[p + 1] = x.off[p] + x.shape.numel[p];
    x.P = x.off[x.shape.nparams];
    x.kept_floats = mn_mlp_kept_floats(&x.shape, x.max_rows);
    x.ck = ck;
    if (s == MN_OK && ck && (ck->nblocks != x.nblocks || ck->P != x.P || ck->memories != memories || ck->parts != x.parts ||
                           !ck->data))
        s = mn_fail(MN_ERR_ARG, "backward: the forward's checkpoints do not fit this run");
    x.W0 = st.params;
    x.S0 = st.momenta;
    x.out = out;

    mn_tensor mk = {0}, mv = {0}, mq = {0}, mtheta = {0}, meta = {0}, malpha = {0}, mdy = {0}, mdloss = {0};
    mn_tensor mlen = {0};
    x.H = d->H;
    mn_tensor mdW[MN_MAX_PARAMS] = {{0}}, mdS[MN_MAX_PARAMS] = {{0}};
    int64_t kshape[4] = {d->B, d->H, n, d->dk}, vshape[4] = {d->B, d->H, n, d->dv};
    int64_t tshape[3] = {d->B, d->H, n}, sshape[3] = {d->B, d->H, S};
    if (s == MN_OK) s = materialize(&mk, &in->k, 4, kshape);
    if (s == MN_OK) s = materialize(&mv, &in->v, 4, vshape);
    if (s == MN_OK && in->q.storage) s = materialize(&mq, &in->q, 4, kshape);
    /* qk_norm: the keys and queries the rule uses, and their scales for the
     * chain at the end */
    mn_rownorm qk = mn_rule_qk_norm(&st.rule);
    int64_t krows = d->B * d->H * n;
    float *kscale = NULL, *qscale = NULL;
    if (s == MN_OK && qk.on) {
        kscale = mn_malloc(sizeof(float) * (size_t)(krows > 0 ? krows : 1), "qk_norm's scales");
        qscale = mq.storage ? mn_malloc(sizeof(float) * (size_t)(krows > 0 ? krows : 1), "qk_norm's scales") : NULL;
        if (!kscale || (mq.storage && !qscale)) s = MN_ERR_OOM;
        if (s == MN_OK) mn_rownorm_forward(qk, mn_tensor_data(&mk), krows, d->dk, mn_tensor_data(&mk), kscale);
        if (s == MN_OK && mq.storage)
            mn_rownorm_forward(qk, mn_tensor_data(&mq), krows, d->dk, mn_tensor_data(&mq), qscale);
    }
    if (s == MN_OK) s = materialize(&mtheta, &in->theta, 3, tshape);
    if (s == MN_OK)
        s = in->eta.storage ? materialize(&meta, &in->eta, 3, sshape) : mn_tensor_zeros(&meta, MN_F32, 3, sshape, MN_CPU);
    if (s == MN_OK)
        s = in->alpha.storage ? materialize(&malpha, &in->alpha, 3, sshape)
                              : mn_tensor_zeros(&malpha, MN_F32, 3, sshape, MN_CPU);
    if (s == MN_OK && in->lengths.storage) {
        s = mn_tensor_empty(&mlen, MN_I64, 1, &d->B, MN_CPU);
        if (s == MN_OK) s = mn_tensor_copy_into(&mlen, &in->lengths);
        if (s == MN_OK) x.lengths = mn_tensor_data(&mlen);
    }
    if (s == MN_OK) s = upstream_input(&mdy, &up->dy, "dy", 4, vshape, true);
    if (s == MN_OK) s = upstream_input(&mdloss, &up->dloss, "dloss", 3, tshape, true);
    for (int p = 0; p < x.shape.nparams && s == MN_OK; p++) {
        char name[16], dname[24];
        int64_t full[4] = {d->B, d->H};
        int pdim = mn_rule_param_shape(&st.rule, d, p, full + 2);
        mn_rule_param_name(&st.rule, p, name, sizeof name);
        snprintf(dname, sizeof dname, "d%s", name);
        s = upstream_input(&mdW[p], &up->dparams[p], dname, pdim + 2, full, false);
        snprintf(dname, sizeof dname, "dS_%s", name);
        if (s == MN_OK) s = upstream_input(&mdS[p], &up->dmomenta[p], dname, pdim + 2, full, false);
        x.dWf[p] = mdW[p].storage ? mn_tensor_data(&mdW[p]) : NULL;
        x.dSf[p] = mdS[p].storage ? mn_tensor_data(&mdS[p]) : NULL;
    }
    if (s == MN_OK) s = clip_forms(&x);
    /* outputs, zeroed: several passes accumulate into them */
    out->nparams = x.shape.nparams;
    if (s == MN_OK) s = mn_tensor_zeros(&out->k, MN_F32, 4, kshape, MN_CPU);
    if (s == MN_OK) s = mn_tensor_zeros(&out->v, MN_F32, 4, vshape, MN_CPU);
    if (s == MN_OK && in->q.storage) s = mn_tensor_zeros(&out->q, MN_F32, 4, kshape, MN_CPU);
    if (s == MN_OK) s = mn_tensor_zeros(&out->theta, MN_F32, 3, tshape, MN_CPU);
    if (s == MN_OK) s = mn_tensor_zeros(&out->eta, MN_F32, 3, sshape, MN_CPU);
    if (s == MN_OK) s = mn_tensor_zeros(&out->alpha, MN_F32, 3, sshape, MN_CPU);
    for (int p = 0; p < x.shape.nparams && s == MN_OK; p++) {
        s = mn_tensor_zeros(&out->params[p], MN_F32, st.params[p].ndim, st.params[p].shape, MN_CPU);
        if (s == MN_OK) s = mn_tensor_zeros(&out->momenta[p], MN_F32, st.params[p].ndim, st.params[p].shape, MN_CPU);
    }
    int64_t oshape[3] = {d->B, d->H, d->dv};
    for (int j = 0; j < mn_rule_outer_count(&st.rule) && s == MN_OK; j++)
        s = mn_tensor_zeros(&out->outer[j], MN_F32, 3, oshape, MN_CPU);
    if (s == MN_OK && st.outer[0].storage) {
        x.ln_g = mn_tensor_data(&st.outer[0]);
        x.ln_b = mn_tensor_data(&st.outer[1]);
    }
    if (s == MN_OK) {
        x.k = mn_tensor_data(&mk);
        x.v = mn_tensor_data(&mv);
        x.q = mq.storage ? mn_tensor_data(&mq) : NULL;
        x.theta = mn_tensor_data(&mtheta);
        x.eta = mn_tensor_data(&meta);
        x.alpha = mn_tensor_data(&malpha);
        x.dy = mdy.storage ? mn_tensor_data(&mdy) : NULL;
        x.dloss = mdloss.storage ? mn_tensor_data(&mdloss) : NULL;
    }
    int workers = mn_cpu_worker_count(memories);
    worker *ws = NULL;
    if (s == MN_OK && n > 0 && memories > 0) {
        ws = calloc((size_t)workers, sizeof *ws);
        if (!ws) s = mn_fail(MN_ERR_OOM, "out of memory for the backward's workers");
        for (int i = 0; i < workers && s == MN_OK; i++) s = worker_init(&ws[i], &x);
    }
    out->block = x.K;
    out->backward_bytes = (int64_t)workers * worker_bytes(&x) + (ck ? ck->nblocks * ck->memories * ck->parts * ck->P * 4 : 0);
    out->forward_bytes = memories * 3 * x.P * 4;
    if (s == MN_OK && ws) {
        int blas_threads = openblas_get_num_threads();
        if (workers > 1) openblas_set_num_threads(1);
        volatile int interrupted = 0;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1)
        for (int64_t m = 0; m < memories; m++) {
            if (interrupted) continue;
#ifdef _OPENMP
            int me = omp_get_thread_num();
#else
            int me = 0;
#endif
            /* Only the thread that owns the error buffer polls Ctrl-C. */
            if (run_memory(&x, &ws[me], m, me == 0) != MN_OK) interrupted = 1;
        }
        if (workers > 1) openblas_set_num_threads(blas_threads);
        if (interrupted) s = mn_fail(MN_ERR_INTERRUPTED, "interrupted");
    }
    for (int i = 0; ws && i < workers; i++) worker_free(&ws[i]);
    free(ws);
    if (s == MN_OK && qk.on) {
        /* back through the normalisation: its output is the stored key */
        mn_rownorm_vjp(qk, mn_tensor_data(&mk), kscale, mn_tensor_data(&out->k), krows, d->dk, mn_tensor_data(&out->k),
                       false);
        if (out->q.storage)
            mn_rownorm_vjp(qk, mn_tensor_data(&mq), qscale, mn_tensor_data(&out->q), krows, d->dk,
                           mn_tensor_data(&out->q), false);
    }
    free(kscale);
    free(qscale);
    mn_tensor *tmp[] = {&mk, &mv, &mq, &mtheta, &meta, &malpha, &mdy, &mdloss, &mlen};
    for (size_t i = 0; i < sizeof tmp / sizeof *tmp; i++) mn_tensor_release(tmp[i]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&mdW[p]);
        mn_tensor_release(&mdS[p]);
    }
    mn_expr_unref(x.scale);
    mn_expr_unref(x.dscale);
    mn_expr_program_free(x.elem);
    mn_expr_program_free(x.delem);
    mn_memory_free(&st);
    if (s != MN_OK) mn_run_grads_free(out);
    return s;
}

/* ---- summing a full-shape gradient back to the shape the user gave ---- */

mn_status mn_sum_to_shape(mn_tensor *out, const mn_tensor *full, int ndim, const int64_t *shape)
{
    int fd = full->ndim;
    if (ndim > fd) return mn_fail(MN_ERR_ARG, "cannot sum a %d-d gradient to %d dims", fd, ndim);
    for (int i = 0; i < ndim; i++) {
        int64_t want = shape[i], have = full->shape[fd - ndim + i];
        if (want != have && want != 1) {
            char a[128], b[128];
            return mn_fail(MN_ERR_ARG, "gradient of shape %s does not sum to %s", mn_shape_string(full, a, sizeof a),
                           mn_shape_string_of(ndim, shape, b, sizeof b));
        }
    }
    /* nothing to sum (the call gave the full shape): the gradient itself,
     * not a pass over it (k and v of a long run are hundreds of MB) */
    bool same = ndim == fd;
    for (int i = 0; i < ndim && same; i++) same = shape[i] == full->shape[i];
    if (same && full->dtype == MN_F32 && mn_tensor_is_contiguous(full)) return mn_tensor_contiguous(out, full);
    MN_TRY(mn_tensor_zeros(out, MN_F32, ndim, shape, MN_CPU));
    mn_tensor src = {0};
    mn_status st = full->storage && full->storage->device != MN_CPU ? mn_tensor_to_device(&src, full, MN_CPU)
                                                                    : mn_tensor_contiguous(&src, full);
    if (st != MN_OK) {
        mn_tensor_release(out);
        return st;
    }
    const float *a = mn_tensor_data(&src);
    float *o = mn_tensor_data(out);
    int64_t total = mn_tensor_numel(&src), idx[MN_MAX_DIMS] = {0};
    /* out strides, with 0 where out has size 1 (summed) */
    int64_t ostride[MN_MAX_DIMS] = {0}, acc = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        ostride[fd - ndim + i] = shape[i] == 1 ? 0 : acc;
        acc *= shape[i];
    }
    for (int64_t e = 0; e < total; e++) {
        int64_t oe = 0;
        for (int i = 0; i < fd; i++) oe += idx[i] * ostride[i];
        o[oe] += a[e];
        for (int i = fd - 1; i >= 0; i--) {
            if (++idx[i] < full->shape[i]) break;
            idx[i] = 0;
        }
    }
    mn_tensor_release(&src);
    return MN_OK;
}
