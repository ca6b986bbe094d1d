/* mlp_grad_cpu.c: the memory model's products that the backward of a run
 * needs (SPEC.md section 7), on the CPU: the plain adjoint of y = M(x; P)
 * for retrieval outputs, and the adjoint of one step's gradient
 * G = sum_t J_P(y_t)^T dyhat_t, a second-order product.
 *
 * <dG, G> is the directional derivative of sum_t <dyhat_t, M(x_t; P)> in
 * direction dG with dyhat held fixed, i.e. sum_t <dyhat_t, u_t> where u_t is
 * the forward-mode tangent of M in the parameters. Its gradient is the
 * reverse of (forward + tangent), layer by layer:
 *   forward  z_i = W_i h_{i-1} + b_i,           h_i = phi(z_i),     h_0 = x
 *   tangent  zd_i = dW_i h_{i-1} + W_i hd_{i-1} + db_i,  hd_i = phi'(z_i) zd_i,  hd_0 = 0
 *   reverse  gW_i += zbar_i h_{i-1}^T + zdbar_i hd_{i-1}^T,  gb_i += zbar_i
 *            hbar_{i-1} = W_i^T zbar_i + dW_i^T zdbar_i,     hdbar_{i-1} = W_i^T zdbar_i
 *            zbar_{i-1} = phi'(z) hbar + phi''(z) zd hdbar,  zdbar_{i-1} = phi'(z) hdbar
 * seeded with zdbar_L = dyhat and zbar_L = ybar = weight R f''(y, v) u (+ the
 * loss output's dloss R f'). With out_norm, y = g nhat(o) + beta (+ x): the
 * tangent of o goes through the norm's tangent (u = g J od), and the seeds
 * come back through it: zdbar_L = J^T (g ubar), zbar_L = J^T (g ybar) plus
 * the second-order term d/do <g ubar, J(o) od> (rownorm.h); g and beta get
 * ybar nhat + ubar J od and ybar. Row-major, x is rows x in, W is out x in. */
#include "grad.h"
#include "scalar_math.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* C[m x n] = beta C + A[m x k] B[n x k]^T */
static void mm_nt(int64_t m, int64_t n, int64_t k, const float *A, const float *B, float beta, float *C)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1.0f, A, (int)k, B, (int)k, beta,
                C, (int)n);
}

/* C[m x n] = beta C + A[m x k] B[k x n] */
static void mm_nn(int64_t m, int64_t n, int64_t k, const float *A, const float *B, float beta, float *C)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, A, (int)k, B, (int)n,
                beta, C, (int)n);
}

/* C[m x n] += A[k x m]^T B[k x n] */
static void mm_tn_acc(int64_t m, int64_t n, int64_t k, const float *A, const float *B, float *C)
{
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, A, (int)m, B, (int)n, 1.0f,
                C, (int)n);
}

static void colsum_acc(const float *A, int64_t rows, int64_t cols, float *out)
{
    for (int64_t o = 0; o < cols; o++) {
        double acc = 0;
        for (int64_t r = 0; r < rows; r++) acc += A[r * cols + o];
        out[o] += (float)acc;
    }
}

static int64_t widest(const mn_mlp_shape *s)
{
    int64_t w = 1;
    for (int i = 0; i < s->layers; i++) {
        if (s->in[i] > w) w = s->in[i];
        if (s->out[i] > w) w = s->out[i];
    }
    return w;
}

/* d/dy and d/dv of e(y, v, r) with r = y - v counted through. */
static mn_expr *total_diff(const mn_expr *e, const char *var, double dr_sign)
{
    mn_expr *a = mn_expr_diff(e, var), *b = mn_expr_diff(e, "r");
    mn_expr *sum = mn_expr_binary(dr_sign > 0 ? MN_EX_ADD : MN_EX_SUB, a, b);
    if (!sum) return NULL;
    mn_expr *out = mn_expr_simplify(sum);
    mn_expr_unref(sum);
    return out;
}

static mn_status compile_in(const mn_rule *r, mn_expr *e, const char *const *vars, int nvars,
                            mn_expr_program **out)
{
    if (!e) return MN_ERR_OOM;
    return mn_expr_compile(e, vars, nvars, (const char *const *)r->const_names, r->const_values, r->nconsts, out);
}

mn_status mn_loss_derivative_exprs(const mn_expr *f, mn_expr *out[4])
{
    out[0] = out[1] = out[2] = out[3] = NULL;
    if (!f) return MN_ERR_ARG;
    mn_expr *fy = total_diff(f, "y", 1), *fv = total_diff(f, "v", -1);
    mn_expr *fyy = fy ? total_diff(fy, "y", 1) : NULL, *fyv = fy ? total_diff(fy, "v", -1) : NULL;
    out[0] = fy;
    out[1] = fv;
    out[2] = fyy;
    out[3] = fyv;
    if (fy && fv && fyy && fyv) return MN_OK;
    for (int i = 0; i < 4; i++) {
        mn_expr_unref(out[i]);
        out[i] = NULL;
    }
    return mn_fail(MN_ERR_OOM, "out of memory differentiating the loss");
}

static mn_status loss_programs_init(mn_loss_programs *lp, const mn_rule *r, int64_t dv)
{
    static const char *const vars[] = {"y", "v", "r"};
    lp->feature_scale = r->feature_reduce == MN_REDUCE_MEAN ? 1.0 / (double)dv : 1.0;
    mn_expr *d[4];
    mn_expr *f = mn_rule_loss_expr(r);
    mn_status ds = mn_loss_derivative_exprs(f, d);
    mn_expr_unref(f);
    MN_TRY(ds);
    mn_status st = compile_in(r, d[0], vars, 3, &lp->fy);
    if (st == MN_OK) st = compile_in(r, d[1], vars, 3, &lp->fv);
    if (st == MN_OK) st = compile_in(r, d[2], vars, 3, &lp->fyy);
    if (st == MN_OK) st = compile_in(r, d[3], vars, 3, &lp->fyv);
    for (int i = 0; i < 4; i++) mn_expr_unref(d[i]);
    return st;
}

int64_t mn_mlp_grad_work_bytes(const mn_mlp_shape *s, int64_t max_rows)
{
    int64_t wide = widest(s), hidden = 0, dv = s->out[s->layers - 1];
    for (int i = 0; i + 1 < s->layers; i++) hidden += s->out[i];
    /* forward z, h, aux and dz, dh; tangents; four adjoints; y, u, ybar, ubar; doubles */
    int64_t floats = max_rows * (3 * hidden + 2 * wide) + max_rows * 2 * hidden + 4 * max_rows * wide +
                     4 * max_rows * dv;
    if (s->glu) floats += max_rows * 3 * hidden + 3 * max_rows * wide; /* a, g, gdot; dg, gbar, gdotbar */
    floats += max_rows * s->in[0]; /* xclean */
    if (s->out_norm.on) floats += 2 * max_rows * dv;
    int64_t doubles = (5 + MN_SHARED_MAX) * max_rows * wide + 2 * max_rows * hidden;
    return floats * 4 + doubles * 8 + 2 * max_rows;
}

mn_status mn_mlp_grad_work_init(mn_mlp_grad_work *w, const mn_mlp_shape *s, const mn_rule *rule,
                                int64_t max_rows)
{
    memset(w, 0, sizeof *w);
    MN_TRY(mn_mlp_work_init(&w->fwd, s, rule, max_rows));
    w->max_rows = max_rows;
    int64_t wide = widest(s), dv = s->out[s->layers - 1];
    bool ok = true;
    for (int i = 0; i + 1 < s->layers; i++) {
        ok = ok && (w->zdot[i] = malloc(sizeof(float) * max_rows * s->out[i]));
        ok = ok && (w->hdot[i] = malloc(sizeof(float) * max_rows * s->out[i]));
        ok = ok && (w->dphi_at[i] = malloc(sizeof(double) * max_rows * s->out[i]));
        ok = ok && (w->ddphi_at[i] = malloc(sizeof(double) * max_rows * s->out[i]));
        if (s->glu) ok = ok && (w->gdot[i] = malloc(sizeof(float) * max_rows * s->out[i]));
    }
    if (s->glu) {
        ok = ok && (w->gbar = malloc(sizeof(float) * max_rows * wide));
        ok = ok && (w->gdotbar = malloc(sizeof(float) * max_rows * wide));
    }
    float **fl[] = {&w->zbar, &w->zdotbar, &w->hbar, &w->hdotbar};
    for (size_t i = 0; i < 4 && ok; i++) ok = (*fl[i] = malloc(sizeof(float) * max_rows * wide)) != NULL;
    float **fv[] = {&w->y, &w->u, &w->ybar, &w->ubar};
    for (size_t i = 0; i < 4 && ok; i++) ok = (*fv[i] = malloc(sizeof(float) * max_rows * dv)) != NULL;
    double **db[] = {&w->din, &w->dout, &w->dout2, &w->dv_in, &w->dr_in};
    for (size_t i = 0; i < 5 && ok; i++) ok = (*db[i] = malloc(sizeof(double) * max_rows * wide)) != NULL;
    ok = ok && (w->xclean = malloc(sizeof(float) * max_rows * s->in[0])) && (w->xbad = malloc((size_t)max_rows)) &&
         (w->cut = malloc((size_t)max_rows));
    if (ok && s->out_norm.on)
        ok = (w->od = malloc(sizeof(float) * max_rows * dv)) && (w->nd = malloc(sizeof(float) * max_rows * dv));
    if (!ok) {
        mn_mlp_grad_work_free(w);
        return mn_fail(MN_ERR_OOM, "out of memory for the backward's scratch (%lld rows)", (long long)max_rows);
    }
    mn_status st = loss_programs_init(&w->loss, rule, dv);
    if (st == MN_OK && s->layers > 1) {
        mn_expr *phi = mn_rule_activation_expr(rule);
        mn_expr *dphi = phi ? mn_expr_diff(phi, "z") : NULL;
        mn_expr *ddphi = dphi ? mn_expr_diff(dphi, "z") : NULL;
        const char *const *cn = (const char *const *)rule->const_names;
        st = dphi && ddphi ? MN_OK : MN_ERR_OOM;
        if (st == MN_OK) st = mn_shared_program_compile(dphi, "z", cn, rule->const_values, rule->nconsts, &w->dphi);
        if (st == MN_OK) st = mn_shared_program_compile(ddphi, "z", cn, rule->const_values, rule->nconsts, &w->ddphi);
        for (int i = 0; i < MN_SHARED_MAX && st == MN_OK; i++)
            if (!(w->shared_scratch[i] = malloc(sizeof(double) * max_rows * wide)))
                st = mn_fail(MN_ERR_OOM, "out of memory for the backward's scratch");
        mn_expr_unref(phi);
        mn_expr_unref(dphi);
        mn_expr_unref(ddphi);
    }
    if (st != MN_OK) mn_mlp_grad_work_free(w);
    return st;
}

void mn_mlp_grad_work_free(mn_mlp_grad_work *w)
{
    mn_mlp_work_free(&w->fwd);
    for (int i = 0; i < MN_MAX_LAYERS; i++) {
        free(w->zdot[i]);
        free(w->hdot[i]);
        free(w->dphi_at[i]);
        free(w->ddphi_at[i]);
        free(w->gdot[i]);
    }
    free(w->gbar);
    free(w->gdotbar);
    void *bufs[] = {w->zbar, w->zdotbar, w->hbar, w->hdotbar, w->y,      w->u,
                    w->ybar, w->ubar,    w->din,  w->dout,    w->dout2, w->dv_in, w->dr_in,
                    w->xclean, w->xbad, w->cut, w->od, w->nd};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    mn_shared_program_free(&w->dphi);
    mn_shared_program_free(&w->ddphi);
    for (int i = 0; i < MN_SHARED_MAX; i++) free(w->shared_scratch[i]);
    mn_expr_program *progs[] = {w->loss.fy, w->loss.fv, w->loss.fyy, w->loss.fyv};
    for (size_t i = 0; i < sizeof progs / sizeof *progs; i++) mn_expr_program_free(progs[i]);
    memset(w, 0, sizeof *w);
}

/* out[i] = prog(z[i]) over n elements (in double: the expression system's precision). */
static void run_in_z(mn_mlp_grad_work *w, const mn_shared_program *prog, const float *z, int64_t n, double *out)
{
    for (int64_t i = 0; i < n; i++) w->din[i] = z[i];
    mn_shared_program_run(prog, w->din, w->shared_scratch, out, n);
}

/* The shared scalar functions (scalar_math.h) in double, the precision of
 * the expression programs they stand in for. */
#define MN_SM_DOUBLE_NAME(name) mn_smd_##name
MN_SCALAR_MATH(static inline, double, MN_SM_DOUBLE, MN_SM_DOUBLE_NAME)

/* phi'(z) into d1 and, when d2 is not NULL, phi''(z) into d2, over n
 * elements: closed forms for the built-in activations (one exp or erfc per
 * element for both, where the programs of phi' and phi'' cost an
 * interpreter pass and an exp each), the compiled programs for a custom
 * one. relu' is 0 at 0 (SPEC.md section 7). */
static void act_derivs(const mn_mlp_shape *s, mn_mlp_grad_work *w, const float *z, int64_t n, double *d1,
                       double *d2)
{
    switch (s->activation) {
    case MN_ACT_SILU:
        /* silu' = sg (1 + z (1 - sg)), silu'' = sg (1 - sg) (2 + z (1 - 2 sg)) */
        for (int64_t i = 0; i < n; i++) {
            double x = z[i], sg = mn_smd_sigmoid(x);
            d1[i] = sg * (1.0 + x * (1.0 - sg));
            if (d2) d2[i] = sg * (1.0 - sg) * (2.0 + x * (1.0 - 2.0 * sg));
        }
        return;
    case MN_ACT_GELU:
        /* gelu' = Phi + z pdf, gelu'' = pdf (2 - z^2) */
        for (int64_t i = 0; i < n; i++) {
            double x = z[i], pdf = mn_smd_normpdf(x);
            d1[i] = mn_smd_normcdf(x) + x * pdf;
            if (d2) d2[i] = pdf * (2.0 - x * x);
        }
        return;
    case MN_ACT_TANH:
        for (int64_t i = 0; i < n; i++) {
            double t = mn_smd_tanh(z[i]);
            d1[i] = 1.0 - t * t;
            if (d2) d2[i] = -2.0 * t * d1[i];
        }
        return;
    case MN_ACT_RELU:
        for (int64_t i = 0; i < n; i++) {
            d1[i] = z[i] > 0 ? 1.0 : 0.0;
            if (d2) d2[i] = 0.0;
        }
        return;
    case MN_ACT_IDENTITY:
        for (int64_t i = 0; i < n; i++) {
            d1[i] = 1.0;
            if (d2) d2[i] = 0.0;
        }
        return;
    case MN_ACT_CUSTOM:
    case MN_ACT_COUNT: break;
    }
    run_in_z(w, &w->dphi, z, n, d1);
    if (d2) run_in_z(w, &w->ddphi, z, n, d2);
}

/* The loss programs' inputs y, v, r = y - v for rows x dv elements. */
static void load_loss_inputs(mn_mlp_grad_work *w, const float *y, const float *v, int64_t n)
{
    for (int64_t e = 0; e < n; e++) {
        w->din[e] = y[e];
        w->dv_in[e] = v[e];
        w->dr_in[e] = (double)y[e] - (double)v[e];
    }
}

static void run_loss(mn_mlp_grad_work *w, const mn_expr_program *prog, int64_t n, double *out)
{
    const double *in[3] = {w->din, w->dv_in, w->dr_in};
    mn_expr_program_run(prog, in, out, n);
}

void mn_loss_dyhat(mn_mlp_grad_work *w, const float *y, const float *v, const float *weight, int64_t rows,
                   int64_t dv, float *dyhat)
{
    double R = w->loss.feature_scale;
    load_loss_inputs(w, y, v, rows * dv);
    run_loss(w, w->loss.fy, rows * dv, w->dout);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t j = 0; j < dv; j++) dyhat[t * dv + j] = (float)(weight[t] * R * w->dout[t * dv + j]);
}

static void layer(const mn_mlp_shape *s, float *const *P, int i, float **W, float **b)
{
    mn_mlp_layer_params(s, P, i, false, W, b);
}

/* Layer i's gate U_i, c_i; NULL when layer i has none (no glu, or the last layer). */
static void gate(const mn_mlp_shape *s, float *const *P, int i, float **U, float **c)
{
    *U = *c = NULL;
    if (s->glu && i < s->layers - 1) mn_mlp_layer_params(s, P, i, true, U, c);
}

/* Kept per hidden layer: z, h, and with glu a = phi(z) and the gate g. */
static int kept_per_hidden(const mn_mlp_shape *s) { return s->glu ? 4 : 2; }

int64_t mn_mlp_kept_floats(const mn_mlp_shape *s, int64_t rows)
{
    int64_t f = rows * s->out[s->layers - 1];
    if (s->out_norm.on) f += rows * s->out[s->layers - 1] + rows; /* nhat, s */
    for (int i = 0; i + 1 < s->layers; i++) f += kept_per_hidden(s) * rows * s->out[i];
    return f;
}

void mn_mlp_keep_forward(const mn_mlp_shape *s, const mn_mlp_grad_work *w, int64_t rows, float *kept)
{
    for (int i = 0; i + 1 < s->layers; i++) {
        float *const parts[4] = {w->fwd.z[i], w->fwd.h[i], w->fwd.a[i], w->fwd.g[i]};
        for (int k = 0; k < kept_per_hidden(s); k++) {
            memcpy(kept, parts[k], sizeof(float) * rows * s->out[i]);
            kept += rows * s->out[i];
        }
    }
    memcpy(kept, w->y, sizeof(float) * rows * s->out[s->layers - 1]);
    if (s->out_norm.on) {
        kept += rows * s->out[s->layers - 1];
        memcpy(kept, w->fwd.nhat, sizeof(float) * rows * s->out[s->layers - 1]);
        memcpy(kept + rows * s->out[s->layers - 1], w->fwd.ns, sizeof(float) * rows);
    }
}

/* The inverse of mn_mlp_keep_forward. */
static void restore_forward(const mn_mlp_shape *s, mn_mlp_grad_work *w, int64_t rows, const float *kept)
{
    for (int i = 0; i + 1 < s->layers; i++) {
        float *const parts[4] = {w->fwd.z[i], w->fwd.h[i], w->fwd.a[i], w->fwd.g[i]};
        for (int k = 0; k < kept_per_hidden(s); k++) {
            memcpy(parts[k], kept, sizeof(float) * rows * s->out[i]);
            kept += rows * s->out[i];
        }
    }
    memcpy(w->y, kept, sizeof(float) * rows * s->out[s->layers - 1]);
    if (s->out_norm.on) {
        kept += rows * s->out[s->layers - 1];
        memcpy(w->fwd.nhat, kept, sizeof(float) * rows * s->out[s->layers - 1]);
        memcpy(w->fwd.ns, kept + rows * s->out[s->layers - 1], sizeof(float) * rows);
    }
}

/* out_norm's part of the reverse: from the adjoints ybar (of y) and ubar (of
 * the tangent u, NULL without one) to those of o and od, in place (ybar
 * becomes obar, ubar odbar), with g's and beta's gradients accumulated.
 * Reads the forward's nhat, s and the tangents od, nd. */
static void norm_reverse(const mn_mlp_shape *s, mn_mlp_grad_work *w, int64_t rows, float *ybar, float *ubar)
{
    int64_t dv = s->out[s->layers - 1];
    const float *g = w->fwd.ln_g, *nhat = w->fwd.nhat, *ns = w->fwd.ns;
    for (int64_t t = 0; t < rows; t++)
        for (int64_t j = 0; j < dv; j++) {
            int64_t e = t * dv + j;
            if (w->gln_g) w->gln_g[j] += ybar[e] * nhat[e] + (ubar ? ubar[e] * w->nd[e] : 0.0f);
            if (w->gln_b) w->gln_b[j] += ybar[e];
            ybar[e] *= g[j];
            if (ubar) ubar[e] *= g[j];
        }
    mn_rownorm_vjp(s->out_norm, nhat, ns, ybar, rows, dv, ybar, false);
    if (ubar) {
        mn_rownorm_hvp_acc(s->out_norm, nhat, ns, w->od, ubar, rows, dv, ybar);
        mn_rownorm_vjp(s->out_norm, nhat, ns, ubar, rows, dv, ubar, false);
    }
}

static bool row_finite(const float *a, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(a[i])) return false;
    return true;
}

/* Marks the rows of x (rows x in) with a non-finite entry in w->xbad and,
 * when there is one, copies x to w->xclean with those rows zeroed: the
 * passes then run on finite numbers (0 * NaN would spread through the
 * products), and the callers drop those rows' upstream. Returns the x to use. */
static const float *clean_rows(mn_mlp_grad_work *w, const float *x, int64_t rows, int64_t in)
{
    bool any = false;
    for (int64_t t = 0; t < rows; t++) {
        w->xbad[t] = !row_finite(x + t * in, in);
        any = any || w->xbad[t];
    }
    if (!any) return x;
    for (int64_t t = 0; t < rows; t++) {
        if (w->xbad[t]) memset(w->xclean + t * in, 0, sizeof(float) * in);
        else memcpy(w->xclean + t * in, x + t * in, sizeof(float) * in);
    }
    return w->xclean;
}

void mn_mlp_step_adjoint(const mn_mlp_shape *s, mn_mlp_grad_work *w, float *const *P, float *const *dG,
                         const float *x, const float *v, const float *weight, const float *dloss,
                         const float *dyret, int64_t ret_rows, int64_t rows, const float *kept,
                         float *const *gP, float *gx, float *gv, float *gweight)
{
    int L = s->layers;
    int64_t dv = s->out[L - 1], n = rows * dv;
    double R = w->loss.feature_scale;
    const float *xin = clean_rows(w, x, rows, s->in[0]);
    if (xin != x) kept = NULL; /* the kept activations are those of the non-finite rows */
    x = xin;
    if (kept) restore_forward(s, w, rows, kept);
    else mn_mlp_forward(s, &w->fwd, P, x, rows, w->y);

    /* Tangent u = J_P(y) dG, layer by layer. */
    if (dG) {
        for (int i = 0; i < L; i++) {
            float *W, *b, *dW, *db;
            layer(s, P, i, &W, &b);
            layer(s, dG, i, &dW, &db);
            const float *in = i == 0 ? x : w->fwd.h[i - 1];
            float *zd = i == L - 1 ? (s->out_norm.on ? w->od : w->u) : w->zdot[i];
            int64_t out = s->out[i], inn = s->in[i];
            if (db)
                for (int64_t r = 0; r < rows; r++) memcpy(zd + r * out, db, sizeof(float) * out);
            mm_nt(rows, out, inn, in, dW, db ? 1.0f : 0.0f, zd);
            if (i > 0) mm_nt(rows, out, inn, w->hdot[i - 1], W, 1.0f, zd);
            if (i < L - 1) {
                act_derivs(s, w, w->fwd.z[i], rows * out, w->dphi_at[i], w->ddphi_at[i]);
                float *U, *c, *dU, *dc;
                gate(s, P, i, &U, &c);
                if (U) {
                    /* gd = dU in + U hd + dc; hd = phi' zd g + a gd */
                    gate(s, dG, i, &dU, &dc);
                    float *gd = w->gdot[i];
                    const float *a = w->fwd.a[i], *g = w->fwd.g[i];
                    if (dc)
                        for (int64_t r = 0; r < rows; r++) memcpy(gd + r * out, dc, sizeof(float) * out);
                    mm_nt(rows, out, inn, in, dU, dc ? 1.0f : 0.0f, gd);
                    if (i > 0) mm_nt(rows, out, inn, w->hdot[i - 1], U, 1.0f, gd);
                    for (int64_t e = 0; e < rows * out; e++)
                        w->hdot[i][e] = (float)(w->dphi_at[i][e] * zd[e] * g[e] + (double)a[e] * gd[e]);
                } else {
                    for (int64_t e = 0; e < rows * out; e++) w->hdot[i][e] = (float)(w->dphi_at[i][e] * zd[e]);
                }
            }
        }
        if (s->out_norm.on) {
            /* u = g J(o) od */
            mn_rownorm_jvp(s->out_norm, w->fwd.nhat, w->fwd.ns, w->od, rows, dv, w->nd);
            for (int64_t t = 0; t < rows; t++)
                for (int64_t j = 0; j < dv; j++) w->u[t * dv + j] = w->fwd.ln_g[j] * w->nd[t * dv + j];
        }
    } else {
        memset(w->u, 0, sizeof(float) * n);
    }

    /* The loss's pointwise terms: ubar = dyhat; ybar, gv, gweight. Without
     * dG (a skipped step) only the loss output's terms, and weight is not
     * read (it may be the non-finite theta that made the step skip). */
    load_loss_inputs(w, w->y, v, n);
    run_loss(w, w->loss.fy, n, w->dout);
    /* Cut rows (grad.h): a non-finite x, or a non-finite v where f' is not
     * finite either. They get zero adjoints from the loss and no v, weight
     * terms. */
    for (int64_t t = 0; t < rows; t++) {
        w->cut[t] = w->xbad[t];
        if (!w->cut[t] && !row_finite(v + t * dv, dv))
            for (int64_t j = 0; j < dv && !w->cut[t]; j++) w->cut[t] = !isfinite(w->dout[t * dv + j]);
    }
    for (int64_t t = 0; t < rows; t++) {
        double acc = 0, dl = dloss ? dloss[t] : 0.0;
        if (w->cut[t]) {
            memset(w->ybar + t * dv, 0, sizeof(float) * dv);
            if (dG) memset(w->ubar + t * dv, 0, sizeof(float) * dv);
            continue;
        }
        for (int64_t j = 0; j < dv; j++) {
            int64_t e = t * dv + j;
            if (dG) w->ubar[e] = (float)(weight[t] * R * w->dout[e]);
            w->ybar[e] = (float)(dl * R * w->dout[e]);
            acc += w->dout[e] * w->u[e];
        }
        if (dG) gweight[t] += (float)(R * acc);
    }
    if (dG) {
        run_loss(w, w->loss.fyy, n, w->dout);
        run_loss(w, w->loss.fyv, n, w->dout2);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t j = 0; j < dv && !w->cut[t]; j++) {
                int64_t e = t * dv + j;
                w->ybar[e] += (float)(weight[t] * R * w->dout[e] * w->u[e]);
                gv[e] += (float)(weight[t] * R * w->dout2[e] * w->u[e]);
            }
    }
    if (dloss) {
        run_loss(w, w->loss.fv, n, w->dout);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t j = 0; j < dv && !w->cut[t]; j++) gv[t * dv + j] += (float)(dloss[t] * R * w->dout[t * dv + j]);
    }

    /* Retrieval outputs read x as the query: a non-finite one is cut. */
    if (dyret)
        for (int64_t t = 0; t < ret_rows; t++)
            for (int64_t j = 0; j < dv && !w->xbad[t]; j++) w->ybar[t * dv + j] += dyret[t * dv + j];

    /* Reverse of forward + tangent. */
    if (s->residual)
        for (int64_t e = 0; e < n; e++) gx[e] += w->ybar[e];
    if (s->out_norm.on) norm_reverse(s, w, rows, w->ybar, dG ? w->ubar : NULL);
    memcpy(w->zbar, w->ybar, sizeof(float) * n);
    if (dG) memcpy(w->zdotbar, w->ubar, sizeof(float) * n);
    for (int i = L - 1; i >= 0; i--) {
        float *W, *b, *dW = NULL, *db = NULL, *gW, *gb, *U, *c, *dU = NULL, *dc = NULL, *gU, *gc;
        layer(s, P, i, &W, &b);
        layer(s, gP, i, &gW, &gb);
        gate(s, P, i, &U, &c);
        gate(s, gP, i, &gU, &gc);
        if (dG) {
            layer(s, dG, i, &dW, &db);
            gate(s, dG, i, &dU, &dc);
        }
        int64_t out = s->out[i], inn = s->in[i];
        const float *in = i == 0 ? x : w->fwd.h[i - 1];
        mm_tn_acc(out, inn, rows, w->zbar, in, gW);
        if (dG && i > 0) mm_tn_acc(out, inn, rows, w->zdotbar, w->hdot[i - 1], gW);
        if (gb) colsum_acc(w->zbar, rows, out, gb);
        if (U) {
            mm_tn_acc(out, inn, rows, w->gbar, in, gU);
            if (dG && i > 0) mm_tn_acc(out, inn, rows, w->gdotbar, w->hdot[i - 1], gU);
            if (gc) colsum_acc(w->gbar, rows, out, gc);
        }
        /* hbar = zbar W + zdbar dW (+ gbar U + gdbar dU); hdbar = zdbar W (+ gdbar U) */
        mm_nn(rows, inn, out, w->zbar, W, 0.0f, w->hbar);
        if (dG) mm_nn(rows, inn, out, w->zdotbar, dW, 1.0f, w->hbar);
        if (U) {
            mm_nn(rows, inn, out, w->gbar, U, 1.0f, w->hbar);
            if (dG) mm_nn(rows, inn, out, w->gdotbar, dU, 1.0f, w->hbar);
        }
        if (i == 0) {
            /* gx is a strided block of the caller's: added from scratch */
            for (int64_t e = 0; e < rows * inn; e++) gx[e] += w->hbar[e];
            break;
        }
        if (dG) {
            mm_nn(rows, inn, out, w->zdotbar, W, 0.0f, w->hdotbar);
            if (U) mm_nn(rows, inn, out, w->gdotbar, U, 1.0f, w->hdotbar);
        }
        int64_t m = rows * inn;
        if (s->glu) {
            const float *a = w->fwd.a[i - 1], *g = w->fwd.g[i - 1];
            if (dG) {
                const double *d1 = w->dphi_at[i - 1], *d2 = w->ddphi_at[i - 1];
                const float *zd = w->zdot[i - 1], *gd = w->gdot[i - 1];
                for (int64_t e = 0; e < m; e++) {
                    double hb = w->hbar[e], hdb = w->hdotbar[e];
                    w->zbar[e] = (float)(d1[e] * (hb * g[e] + hdb * gd[e]) + d2[e] * zd[e] * g[e] * hdb);
                    w->gbar[e] = (float)(hb * a[e] + hdb * d1[e] * zd[e]);
                    w->zdotbar[e] = (float)(d1[e] * g[e] * hdb);
                    w->gdotbar[e] = (float)(a[e] * hdb);
                }
            } else {
                act_derivs(s, w, w->fwd.z[i - 1], m, w->dout, NULL);
                for (int64_t e = 0; e < m; e++) {
                    w->zbar[e] = (float)(w->dout[e] * w->hbar[e] * g[e]);
                    w->gbar[e] = w->hbar[e] * a[e];
                }
            }
        } else if (dG) {
            const double *d1 = w->dphi_at[i - 1], *d2 = w->ddphi_at[i - 1];
            for (int64_t e = 0; e < m; e++) {
                w->zbar[e] = (float)(d1[e] * w->hbar[e] + d2[e] * w->zdot[i - 1][e] * w->hdotbar[e]);
                w->zdotbar[e] = (float)(d1[e] * w->hdotbar[e]);
            }
        } else {
            act_derivs(s, w, w->fwd.z[i - 1], m, w->dout, NULL);
            for (int64_t e = 0; e < m; e++) w->zbar[e] = (float)(w->dout[e] * w->hbar[e]);
        }
    }
}

void mn_mlp_vjp(const mn_mlp_shape *s, mn_mlp_grad_work *w, float *const *P, const float *x,
                const float *dy, int64_t rows, float *const *gP, float *gx)
{
    int L = s->layers;
    int64_t dv = s->out[L - 1], n = rows * dv;
    x = clean_rows(w, x, rows, s->in[0]); /* a non-finite query's output is cut */
    mn_mlp_forward(s, &w->fwd, P, x, rows, w->y);
    memcpy(w->zbar, dy, sizeof(float) * n);
    for (int64_t t = 0; t < rows; t++)
        if (w->xbad[t]) memset(w->zbar + t * dv, 0, sizeof(float) * dv);
    if (s->residual)
        for (int64_t e = 0; e < n; e++) gx[e] += w->zbar[e];
    if (s->out_norm.on) norm_reverse(s, w, rows, w->zbar, NULL);
    for (int i = L - 1; i >= 0; i--) {
        float *W, *b, *gW, *gb, *U, *c, *gU, *gc;
        layer(s, P, i, &W, &b);
        layer(s, gP, i, &gW, &gb);
        gate(s, P, i, &U, &c);
        gate(s, gP, i, &gU, &gc);
        int64_t out = s->out[i], inn = s->in[i];
        const float *in = i == 0 ? x : w->fwd.h[i - 1];
        mm_tn_acc(out, inn, rows, w->zbar, in, gW);
        if (gb) colsum_acc(w->zbar, rows, out, gb);
        mm_nn(rows, inn, out, w->zbar, W, 0.0f, w->hbar);
        if (U) {
            mm_tn_acc(out, inn, rows, w->gbar, in, gU);
            if (gc) colsum_acc(w->gbar, rows, out, gc);
            mm_nn(rows, inn, out, w->gbar, U, 1.0f, w->hbar);
        }
        if (i == 0) {
            for (int64_t e = 0; e < rows * inn; e++) gx[e] += w->hbar[e];
            break;
        }
        int64_t m = rows * inn;
        act_derivs(s, w, w->fwd.z[i - 1], m, w->dout, NULL);
        if (s->glu) {
            const float *a = w->fwd.a[i - 1], *g = w->fwd.g[i - 1];
            for (int64_t e = 0; e < m; e++) {
                w->zbar[e] = (float)(w->dout[e] * w->hbar[e] * g[e]);
                w->gbar[e] = w->hbar[e] * a[e];
            }
        } else {
            for (int64_t e = 0; e < m; e++) w->zbar[e] = (float)(w->dout[e] * w->hbar[e]);
        }
    }
}
