/* engine_cpu.c: the CPU engine, the plain statement of SPEC.md section 2 and
 * the oracle every other engine is tested against. Memories are independent,
 * so they run in parallel (OpenMP) with single-threaded BLAS inside; a run
 * of fewer memories than threads gives BLAS the threads instead. */
#include "engine.h"
#include "mlp_cpu.h"
#include "precond.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* OpenBLAS's thread control (declared by its cblas.h; repeated so that the
 * file also builds against a cblas.h that lacks it). */
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);

typedef struct loss_ctx {
    double feature_scale;          /* 1/dv for mean, 1 for sum */
    mn_expr_program *f, *df;       /* the loss and df/dy, from its expression form */
    double *by, *bv, *br, *bout;   /* scratch: max_rows x dv */
} loss_ctx;

/* Everything one thread needs for one memory at a time. */
typedef struct thread_work {
    mn_mlp_work mlp;
    loss_ctx loss;
    float *y, *dy;                 /* max_rows x dv */
    float *weight;                 /* max_rows: theta_t over the token reduction */
    float *grads[MN_MAX_PARAMS];
    double *gbuf_in, *gbuf_out;    /* elementwise clips */
    mn_expr_program *clip_scale;   /* scale clips: the scale at n = |G| */
    mn_expr_program *clip_elem;    /* elementwise clips: g -> clip(g) */
    mn_precond_work precond;       /* newton_schulz's scratch */
} thread_work;

/* The expression e (a new reference, consumed) as a program over vars with
 * the rule's constants. */
static mn_status compile_part(const mn_rule *r, mn_expr *e, const char *const *vars, int nvars, mn_expr_program **out)
{
    if (!e) return MN_ERR_ARG; /* the builder recorded why */
    mn_status st = mn_expr_compile(e, vars, nvars, (const char *const *)r->const_names, r->const_values, r->nconsts, out);
    mn_expr_unref(e);
    return st;
}

/* ---- loss: l_t and dl/dy for the rows of one step ---- */

/* Every loss, built-in or custom, runs as the program of its expression form
 * (rule.def): the same expressions the CUDA hooks are generated from. */
static mn_status loss_init(loss_ctx *c, const mn_rule *r, int64_t dv, int64_t max_rows)
{
    memset(c, 0, sizeof *c);
    c->feature_scale = r->feature_reduce == MN_REDUCE_MEAN ? 1.0 / (double)dv : 1.0;
    int64_t n = max_rows * dv;
    c->by = malloc(sizeof(double) * n);
    c->bv = malloc(sizeof(double) * n);
    c->br = malloc(sizeof(double) * n);
    c->bout = malloc(sizeof(double) * n);
    if (!c->by || !c->bv || !c->br || !c->bout) return mn_fail(MN_ERR_OOM, "out of memory for the loss scratch");
    static const char *const vars[] = {"y", "v", "r"};
    MN_TRY(compile_part(r, mn_rule_loss_expr(r), vars, 3, &c->f));
    return compile_part(r, mn_rule_loss_grad_expr(r), vars, 3, &c->df);
}

static void loss_free(loss_ctx *c)
{
    free(c->by);
    free(c->bv);
    free(c->br);
    free(c->bout);
    mn_expr_program_free(c->f);
    mn_expr_program_free(c->df);
}

/* loss_out[t] = R_j f(y_tj, v_tj); dy[t,j] = weight_t * R * df/dy. */
static void loss_rows(loss_ctx *c, const float *y, const float *v, const float *weight, int64_t rows,
                      int64_t dv, float *loss_out, float *dy)
{
    double R = c->feature_scale;
    int64_t n = rows * dv;
    for (int64_t e = 0; e < n; e++) {
        c->by[e] = y[e];
        c->bv[e] = v[e];
        c->br[e] = (double)y[e] - (double)v[e];
    }
    const double *in[3] = {c->by, c->bv, c->br};
    mn_expr_program_run(c->f, in, c->bout, n);
    for (int64_t t = 0; t < rows; t++) {
        double acc = 0;
        for (int64_t j = 0; j < dv; j++) acc += c->bout[t * dv + j];
        loss_out[t] = (float)(R * acc);
    }
    mn_expr_program_run(c->df, in, c->bout, n);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t j = 0; j < dv; j++) dy[t * dv + j] = (float)(weight[t] * R * c->bout[t * dv + j]);
}

/* ---- clip: by its kind (rule.def), through its expression ---- */

static double clip_scale_at(const thread_work *tw, double n)
{
    double scale;
    const double *in[1] = {&n};
    mn_expr_program_run(tw->clip_scale, in, &scale, 1);
    return scale;
}

/* Clip the gradients in place; returns the clip_scale output of the step. */
static double clip_grads(const mn_rule *r, thread_work *tw, const mn_mlp_shape *s, const double *sumsq,
                         double global_norm)
{
    if (tw->clip_scale) {
        double smallest = INFINITY;
        for (int p = 0; p < s->nparams; p++) {
            double scale = clip_scale_at(tw, r->clip_scope == MN_SCOPE_GLOBAL ? global_norm : sqrt(sumsq[p]));
            if (scale < smallest || scale != scale) smallest = scale;
            float fs = (float)scale;
            for (int64_t e = 0; e < s->numel[p]; e++) tw->grads[p][e] *= fs;
        }
        return s->nparams ? smallest : 1.0;
    }
    if (tw->clip_elem) {
        for (int p = 0; p < s->nparams; p++) {
            for (int64_t e = 0; e < s->numel[p]; e++) tw->gbuf_in[e] = tw->grads[p][e];
            const double *in[1] = {tw->gbuf_in};
            mn_expr_program_run(tw->clip_elem, in, tw->gbuf_out, s->numel[p]);
            for (int64_t e = 0; e < s->numel[p]; e++) tw->grads[p][e] = (float)tw->gbuf_out[e];
        }
    }
    return 1.0;
}

static void thread_work_free(thread_work *tw)
{
    mn_mlp_work_free(&tw->mlp);
    loss_free(&tw->loss);
    free(tw->y);
    free(tw->dy);
    free(tw->weight);
    for (int p = 0; p < MN_MAX_PARAMS; p++) free(tw->grads[p]);
    free(tw->gbuf_in);
    free(tw->gbuf_out);
    mn_expr_program_free(tw->clip_scale);
    mn_expr_program_free(tw->clip_elem);
    mn_precond_work_free(&tw->precond);
    memset(tw, 0, sizeof *tw);
}

static mn_status thread_work_init(thread_work *tw, const mn_rule *r, const mn_mlp_shape *s, const mn_dims *d,
                                  int64_t max_rows)
{
    memset(tw, 0, sizeof *tw);
    mn_status st = mn_mlp_work_init(&tw->mlp, s, r, max_rows);
    if (st == MN_OK) st = loss_init(&tw->loss, r, d->dv, max_rows);
    if (st == MN_OK) st = mn_precond_work_init(&tw->precond, r, s, false);
    if (st != MN_OK) {
        thread_work_free(tw);
        return st;
    }
    bool ok = (tw->y = malloc(sizeof(float) * max_rows * d->dv)) && (tw->dy = malloc(sizeof(float) * max_rows * d->dv)) &&
              (tw->weight = malloc(sizeof(float) * max_rows));
    int64_t biggest = 1;
    for (int p = 0; p < s->nparams && ok; p++) {
        ok = (tw->grads[p] = malloc(sizeof(float) * s->numel[p])) != NULL;
        if (s->numel[p] > biggest) biggest = s->numel[p];
    }
    if (ok && mn_rule_clip_scales(r)) {
        static const char *const nv[] = {"n"};
        st = compile_part(r, mn_rule_clip_expr(r), nv, 1, &tw->clip_scale);
    } else if (ok && mn_rule_clip_elementwise(r)) {
        ok = (tw->gbuf_in = malloc(sizeof(double) * biggest)) && (tw->gbuf_out = malloc(sizeof(double) * biggest));
        static const char *const gv[] = {"g"};
        if (ok) st = compile_part(r, mn_rule_clip_expr(r), gv, 1, &tw->clip_elem);
    }
    if (!ok) st = mn_fail(MN_ERR_OOM, "out of memory for the engine's scratch");
    if (st != MN_OK) thread_work_free(tw);
    return st;
}

/* Pointers to memory m's parameters within [B,H,...] tensors. */
static void memory_params(const mn_tensor *t, const mn_mlp_shape *s, int64_t m, float **out)
{
    for (int p = 0; p < s->nparams; p++) out[p] = (float *)mn_tensor_data(&t[p]) + m * s->numel[p];
}

/* One memory through all steps of a segment. */
/* For progress reports: the workers and the total steps of the segment. */
static int64_t progress_workers = 1, progress_total = 0;

static mn_status run_memory(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out,
                            int64_t n, int64_t nsteps, int64_t m, const mn_mlp_shape *s, thread_work *tw,
                            bool check_interrupt)
{
    const mn_rule *r = &st->rule;
    const mn_dims *d = &st->dims;
    int64_t c = r->step, dk = d->dk, dv = d->dv;
    int refresh = mn_rule_refresh(r);
    float *W[MN_MAX_PARAMS], *Sm[MN_MAX_PARAMS], *A[MN_MAX_PARAMS];
    memory_params(st->params, s, m, W);
    memory_params(st->momenta, s, m, Sm);
    memory_params(st->anchor, s, m, A);
    const float *k = (const float *)mn_tensor_data(&in->k) + m * n * dk;
    const float *v = (const float *)mn_tensor_data(&in->v) + m * n * dv;
    const float *q = in->q.storage ? (const float *)mn_tensor_data(&in->q) + m * n * dk : NULL;
    const float *theta = (const float *)mn_tensor_data(&in->theta) + m * n;
    const float *eta = (const float *)mn_tensor_data(&in->eta) + m * nsteps;
    const float *alpha = (const float *)mn_tensor_data(&in->alpha) + m * nsteps;
    float *y_out = in->want_y ? (float *)mn_tensor_data(&out->y) + m * n * dv : NULL;
    float *loss_out = (float *)mn_tensor_data(&out->loss) + m * n;
    float *gn_out = (float *)mn_tensor_data(&out->grad_norm) + m * nsteps;
    float *cs_out = (float *)mn_tensor_data(&out->clip_scale) + m * nsteps;
    float *sk_out = (float *)mn_tensor_data(&out->skipped) + m * nsteps;
    float *sl_out = (float *)mn_tensor_data(&out->step_loss) + m * nsteps;
    float *wn_out = (float *)mn_tensor_data(&out->weight_norm) + m * nsteps;
    float *weight = tw->weight;
    if (s->out_norm.on) {
        tw->mlp.ln_g = (const float *)mn_tensor_data(&st->outer[0]) + m * dv;
        tw->mlp.ln_b = (const float *)mn_tensor_data(&st->outer[1]) + m * dv;
    }
    /* Ragged batches: tokens at and after real are padding (SPEC.md section 2). */
    int64_t real = n;
    if (in->lengths.storage) real = ((const int64_t *)mn_tensor_data(&in->lengths))[m / d->H];

    for (int64_t sl = 0; sl < nsteps; sl++) {
        if (check_interrupt && mn_check_interrupt() != MN_OK) return MN_ERR_INTERRUPTED;
        /* Memories run in waves of one per worker: memory m's step sl means
         * about m * nsteps + sl * workers steps are done over all memories. */
        if (check_interrupt) mn_report_progress(m * nsteps + sl * progress_workers, progress_total);
        int64_t s_global = st->steps_done + sl;
        int64_t t0 = sl * c, rows = (t0 + c <= n) ? c : n - t0;
        /* Gradient point: the weights at the start of this step's refresh block. */
        float *const *P;
        bool at_current = refresh == c;
        if (refresh == c) P = W;
        else {
            if (refresh > 0 && s_global % (refresh / c) == 0) {
                for (int p = 0; p < s->nparams; p++) memcpy(A[p], W[p], sizeof(float) * s->numel[p]);
                at_current = true;
            }
            P = A;
        }
        /* A step that starts in the padding leaves S and W as they are. */
        int64_t grows = t0 >= real ? 0 : (t0 + rows <= real ? rows : real - t0);
        if (grows == 0) {
            memset(loss_out + t0, 0, sizeof(float) * rows);
            if (y_out) memset(y_out + t0 * dv, 0, sizeof(float) * rows * dv);
            gn_out[sl] = 0;
            cs_out[sl] = 1;
            sk_out[sl] = 0;
            sl_out[sl] = 0;
            double wsq = 0;
            for (int p = 0; p < s->nparams; p++)
                for (int64_t e = 0; e < s->numel[p]; e++) wsq += (double)W[p][e] * W[p][e];
            wn_out[sl] = (float)sqrt(wsq);
            continue;
        }
        /* The step's gradient and loss take its grows real tokens; retrieval all rows. */
        double tscale = r->token_reduce == MN_REDUCE_MEAN ? 1.0 / (double)grows : 1.0;
        for (int64_t t = 0; t < grows; t++) weight[t] = (float)(theta[t0 + t] * tscale);

        mn_mlp_forward(s, &tw->mlp, P, k + t0 * dk, rows, tw->y);
        /* Retrieval at W^(s) for the rows that see the weights before this
         * step: all of them for "before", all but the step's last for "after".
         * With q = k and the gradient point at W^(s) that is the forward above. */
        int64_t before_rows = r->retrieve == MN_RETRIEVE_BEFORE ? rows : rows - 1;
        if (y_out && before_rows > 0) {
            if (!q && at_current) memcpy(y_out + t0 * dv, tw->y, sizeof(float) * before_rows * dv);
        }
        loss_rows(&tw->loss, tw->y, v + t0 * dv, weight, grows, dv, loss_out + t0, tw->dy);
        double lsum = 0;
        for (int64_t t = 0; t < grows; t++) lsum += loss_out[t0 + t];
        for (int64_t t = grows; t < rows; t++) loss_out[t0 + t] = 0;
        sl_out[sl] = (float)(lsum / (double)grows);
        mn_mlp_backward(s, &tw->mlp, P, k + t0 * dk, grows, tw->dy, tw->grads);

        double sumsq[MN_MAX_PARAMS], total = 0;
        for (int p = 0; p < s->nparams; p++) {
            double acc = 0;
            for (int64_t e = 0; e < s->numel[p]; e++) acc += (double)tw->grads[p][e] * tw->grads[p][e];
            sumsq[p] = acc;
            total += acc;
        }
        double gnorm = sqrt(total);
        gn_out[sl] = (float)gnorm;
        if (y_out && before_rows > 0 && (q || !at_current))
            mn_mlp_forward(s, &tw->mlp, W, (q ? q : k) + t0 * dk, before_rows, y_out + t0 * dv);
        if (!isfinite(total)) {
            /* Non-finite guard: skip the step, keep S and W. */
            sk_out[sl] = 1;
            cs_out[sl] = 0;
        } else {
            sk_out[sl] = 0;
            cs_out[sl] = (float)clip_grads(r, tw, s, sumsq, gnorm);
            mn_precond_apply(r, s, &tw->precond, tw->grads);
            float e_s = eta[sl], keep = 1.0f - alpha[sl];
            for (int p = 0; p < s->nparams; p++)
                for (int64_t e = 0; e < s->numel[p]; e++) {
                    Sm[p][e] = e_s * Sm[p][e] - tw->grads[p][e];
                    W[p][e] = keep * W[p][e] + Sm[p][e];
                }
        }
        double wsq = 0;
        for (int p = 0; p < s->nparams; p++)
            for (int64_t e = 0; e < s->numel[p]; e++) wsq += (double)W[p][e] * W[p][e];
        wn_out[sl] = (float)sqrt(wsq);
        if (y_out && r->retrieve == MN_RETRIEVE_AFTER) {
            int64_t last = t0 + rows - 1;
            mn_mlp_forward(s, &tw->mlp, W, (q ? q : k) + last * dk, 1, y_out + last * dv);
        }
        if (y_out && grows < rows) memset(y_out + (t0 + grows) * dv, 0, sizeof(float) * (rows - grows) * dv);
    }
    return MN_OK;
}

/* One OpenMP worker per memory, at most the threads OpenMP gives: the
 * forward and the backward (grad_cpu.c) split memories the same way. */
int mn_cpu_worker_count(int64_t memories)
{
#ifdef _OPENMP
    int t = omp_get_max_threads();
    return memories < t ? (int)memories : t;
#else
    (void)memories;
    return 1;
#endif
}

static mn_status cpu_segment_run(mn_memory_state *st, const mn_segment_inputs *in, mn_segment_outputs *out,
                                 int64_t n, int64_t nsteps)
{
    mn_mlp_shape s;
    mn_mlp_shape_init(&s, &st->rule, &st->dims);
    int64_t memories = st->dims.B * st->dims.H;
    int64_t max_rows = st->rule.step < n ? st->rule.step : n;
    if (max_rows < 1) max_rows = 1;
    int workers = mn_cpu_worker_count(memories);
    /* Parallel memories with serial BLAS, or one memory with parallel BLAS. */
    int blas_threads = openblas_get_num_threads();
    if (workers > 1) openblas_set_num_threads(1);
    thread_work *tws = calloc((size_t)workers, sizeof *tws);
    mn_status status = tws ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory for engine workers");
    for (int w = 0; w < workers && status == MN_OK; w++)
        status = thread_work_init(&tws[w], &st->rule, &s, &st->dims, max_rows);
    progress_workers = workers;
    progress_total = memories * nsteps;
    if (status == MN_OK && n > 0) {
        volatile int failed = 0;
        mn_status first_error = MN_OK;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1)
        for (int64_t m = 0; m < memories; m++) {
            if (failed) continue;
#ifdef _OPENMP
            int me = omp_get_thread_num();
#else
            int me = 0;
#endif
            /* Only the thread that owns the error buffer polls Ctrl-C. */
            mn_status ms = run_memory(st, in, out, n, nsteps, m, &s, &tws[me], me == 0);
            if (ms != MN_OK) {
#pragma omp critical
                if (!failed) {
                    failed = 1;
                    first_error = ms;
                }
            }
        }
        if (failed) {
            status = first_error;
            if (status == MN_ERR_INTERRUPTED) mn_fail(status, "interrupted");
        }
    }
    if (status == MN_OK) {
        st->steps_done += nsteps;
        mn_report_progress(progress_total, progress_total);
    }
    for (int w = 0; w < workers && tws; w++) thread_work_free(&tws[w]);
    free(tws);
    if (workers > 1) openblas_set_num_threads(blas_threads);
    return status;
}

static mn_status cpu_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y)
{
    mn_mlp_shape s;
    mn_mlp_shape_init(&s, &st->rule, &st->dims);
    int64_t rows = q->shape[2], memories = st->dims.B * st->dims.H;
    mn_mlp_work w;
    MN_TRY(mn_mlp_work_init(&w, &s, &st->rule, rows > 0 ? rows : 1));
    float *W[MN_MAX_PARAMS];
    for (int64_t m = 0; m < memories && rows > 0; m++) {
        memory_params(st->params, &s, m, W);
        if (s.out_norm.on) {
            w.ln_g = (const float *)mn_tensor_data(&st->outer[0]) + m * st->dims.dv;
            w.ln_b = (const float *)mn_tensor_data(&st->outer[1]) + m * st->dims.dv;
        }
        mn_mlp_forward(&s, &w, W, (const float *)mn_tensor_data(q) + m * rows * st->dims.dk, rows,
                       (float *)mn_tensor_data(y) + m * rows * st->dims.dv);
    }
    mn_mlp_work_free(&w);
    return MN_OK;
}

static const mn_engine_backend cpu_engine = {"cpu", cpu_segment_run, cpu_read};

const mn_engine_backend *mn_engine_cpu(void) { return &cpu_engine; }
