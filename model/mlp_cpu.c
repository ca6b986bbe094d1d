/* mlp_cpu.c: forward and backward of the memory model on the CPU: plain
 * loops for the elementwise parts, OpenBLAS for the products. Row-major:
 * x is rows x in, W is out x in, so z = x W^T. */
#include "mlp_cpu.h"
#include "op_math.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

void mn_mlp_shape_init(mn_mlp_shape *s, const mn_rule *rule, const mn_dims *d)
{
    memset(s, 0, sizeof *s);
    s->layers = rule->layers;
    s->bias = rule->bias;
    s->residual = rule->residual;
    s->glu = rule->glu && rule->layers > 1;
    s->activation = rule->activation;
    s->out_norm = mn_rule_out_norm(rule);
    for (int i = 0; i < rule->layers; i++) {
        s->in[i] = mn_layer_in(i, d->dk, d->dh);
        s->out[i] = mn_layer_out(i, rule->layers, d->dv, d->dh);
    }
    mn_param_layout lo;
    mn_param_layout_init(&lo, rule->layers, rule->bias, rule->glu, d->dk, d->dv, d->dh);
    s->nparams = lo.nparams;
    for (int p = 0; p < s->nparams; p++) s->numel[p] = lo.numel[p];
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

mn_status mn_mlp_work_init(mn_mlp_work *w, const mn_mlp_shape *s, const mn_rule *rule, int64_t max_rows)
{
    memset(w, 0, sizeof *w);
    w->max_rows = max_rows;
    int64_t wide = widest(s);
    bool ok = true;
    for (int i = 0; i + 1 < s->layers; i++) {
        w->z[i] = malloc(sizeof(float) * max_rows * s->out[i]);
        w->h[i] = malloc(sizeof(float) * max_rows * s->out[i]);
        w->aux[i] = malloc(sizeof(float) * max_rows * s->out[i]);
        ok = ok && w->z[i] && w->h[i] && w->aux[i];
        if (s->glu) {
            w->a[i] = malloc(sizeof(float) * max_rows * s->out[i]);
            w->g[i] = malloc(sizeof(float) * max_rows * s->out[i]);
            ok = ok && w->a[i] && w->g[i];
        }
    }
    w->dz = malloc(sizeof(float) * max_rows * wide);
    w->dh = malloc(sizeof(float) * max_rows * wide);
    ok = ok && w->dz && w->dh;
    if (ok && s->out_norm.on) {
        int64_t dv = s->out[s->layers - 1];
        ok = (w->nhat = malloc(sizeof(float) * max_rows * dv)) && (w->ns = malloc(sizeof(float) * max_rows));
    }
    if (s->glu) ok = ok && (w->dg = malloc(sizeof(float) * max_rows * wide));
    if (ok && rule->activation == MN_ACT_CUSTOM && s->layers > 1) {
        w->dbuf_in = malloc(sizeof(double) * max_rows * wide);
        w->dbuf_out = malloc(sizeof(double) * max_rows * wide);
        ok = w->dbuf_in && w->dbuf_out;
        static const char *const zvar[] = {"z"};
        mn_expr *f = ok ? mn_rule_activation_expr(rule) : NULL;
        mn_expr *df = f ? mn_rule_activation_grad_expr(rule) : NULL;
        mn_status st = MN_ERR_OOM;
        if (f && df) {
            st = mn_expr_compile(f, zvar, 1, (const char *const *)rule->const_names, rule->const_values,
                                 rule->nconsts, &w->act);
            if (st == MN_OK)
                st = mn_expr_compile(df, zvar, 1, (const char *const *)rule->const_names,
                                     rule->const_values, rule->nconsts, &w->act_grad);
        }
        mn_expr_unref(f);
        mn_expr_unref(df);
        if (st != MN_OK) {
            mn_mlp_work_free(w);
            return st;
        }
    }
    if (!ok) {
        mn_mlp_work_free(w);
        return mn_fail(MN_ERR_OOM, "out of memory for the engine's scratch (%lld rows)", (long long)max_rows);
    }
    return MN_OK;
}

void mn_mlp_work_free(mn_mlp_work *w)
{
    for (int i = 0; i < MN_MAX_LAYERS; i++) {
        free(w->z[i]);
        free(w->h[i]);
        free(w->aux[i]);
        free(w->a[i]);
        free(w->g[i]);
    }
    free(w->dz);
    free(w->dh);
    free(w->dg);
    free(w->dbuf_in);
    free(w->dbuf_out);
    free(w->nhat);
    free(w->ns);
    mn_expr_program_free(w->act);
    mn_expr_program_free(w->act_grad);
    memset(w, 0, sizeof *w);
}

/* The shared scalar functions (scalar_math.h) in float: the fast path of the
 * built-in activations below, held equal to their expression forms by
 * tests/unit/test_engine.c for every row of the table. */
#define MN_SM_FLOAT_NAME(name) mn_smf_##name
MN_SCALAR_MATH(static inline, float, MN_SM_FLOAT, MN_SM_FLOAT_NAME)

/* h = phi(z) over n elements; aux keeps what phi' needs. The engine is fp32
 * (SPEC.md section 3), so the built-in activations compute in float. */
static void activate(const mn_mlp_shape *s, mn_mlp_work *w, const float *z, float *h, float *aux, int64_t n)
{
    switch (s->activation) {
    case MN_ACT_SILU:
        for (int64_t i = 0; i < n; i++) {
            float sg = mn_smf_sigmoid(z[i]);
            aux[i] = sg;
            h[i] = z[i] * sg;
        }
        break;
    case MN_ACT_GELU:
        for (int64_t i = 0; i < n; i++) {
            float cdf = mn_smf_normcdf(z[i]);
            aux[i] = cdf;
            h[i] = z[i] * cdf;
        }
        break;
    case MN_ACT_RELU: for (int64_t i = 0; i < n; i++) h[i] = mn_smf_relu(z[i]); break;
    case MN_ACT_TANH:
        for (int64_t i = 0; i < n; i++) h[i] = aux[i] = mn_smf_tanh(z[i]);
        break;
    case MN_ACT_IDENTITY: memcpy(h, z, sizeof(float) * n); break;
    case MN_ACT_CUSTOM: {
        for (int64_t i = 0; i < n; i++) w->dbuf_in[i] = z[i];
        const double *in[1] = {w->dbuf_in};
        mn_expr_program_run(w->act, in, w->dbuf_out, n);
        for (int64_t i = 0; i < n; i++) h[i] = (float)w->dbuf_out[i];
        break;
    }
    case MN_ACT_COUNT: break; /* not an activation */
    }
}

/* dz = dh * phi'(z) over n elements (dz may alias dh), from the forward's aux. */
static void activate_backward(const mn_mlp_shape *s, mn_mlp_work *w, const float *z, const float *aux,
                              const float *dh, float *dz, int64_t n)
{
    switch (s->activation) {
    case MN_ACT_SILU:
        /* silu' = s (1 + z (1 - s)) */
        for (int64_t i = 0; i < n; i++) dz[i] = dh[i] * aux[i] * (1.0f + z[i] * (1.0f - aux[i]));
        break;
    case MN_ACT_GELU:
        /* gelu' = Phi(z) + z phi(z) */
        for (int64_t i = 0; i < n; i++)
            dz[i] = dh[i] * (aux[i] + z[i] * mn_smf_normpdf(z[i]));
        break;
    case MN_ACT_RELU: for (int64_t i = 0; i < n; i++) dz[i] = z[i] > 0 ? dh[i] : 0.0f; break;
    case MN_ACT_TANH:
        for (int64_t i = 0; i < n; i++) dz[i] = dh[i] * (1.0f - aux[i] * aux[i]);
        break;
    case MN_ACT_IDENTITY:
        if (dz != dh) memcpy(dz, dh, sizeof(float) * n);
        break;
    case MN_ACT_CUSTOM: {
        for (int64_t i = 0; i < n; i++) w->dbuf_in[i] = z[i];
        const double *in[1] = {w->dbuf_in};
        mn_expr_program_run(w->act_grad, in, w->dbuf_out, n);
        for (int64_t i = 0; i < n; i++) dz[i] = (float)(dh[i] * w->dbuf_out[i]);
        break;
    }
    case MN_ACT_COUNT: break; /* not an activation */
    }
}

void mn_mlp_layer_params(const mn_mlp_shape *s, float *const *params, int i, bool gate, float **W, float **b)
{
    int k = mn_param_index(s->layers, s->bias, i, gate);
    *W = params[k];
    *b = s->bias ? params[k + 1] : NULL;
}

/* z[rows x out] = in[rows x inn] W^T + b (b may be NULL). */
static void affine(const float *in, const float *W, const float *b, int64_t rows, int64_t out, int64_t inn, float *z)
{
    if (b)
        for (int64_t r = 0; r < rows; r++) memcpy(z + r * out, b, sizeof(float) * out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)out, (int)inn, 1.0f, in, (int)inn, W,
                (int)inn, b ? 1.0f : 0.0f, z, (int)out);
}

/* gW = d^T in (out x inn), gb = column sums of d (when gb is not NULL). */
static void affine_grads(const float *d, const float *in, int64_t rows, int64_t out, int64_t inn, float *gW, float *gb)
{
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)out, (int)inn, (int)rows, 1.0f, d, (int)out, in,
                (int)inn, 0.0f, gW, (int)inn);
    if (gb)
        for (int64_t o = 0; o < out; o++) {
            double acc = 0;
            for (int64_t r = 0; r < rows; r++) acc += d[r * out + o];
            gb[o] = (float)acc;
        }
}

void mn_mlp_forward(const mn_mlp_shape *s, mn_mlp_work *w, float *const *params, const float *x,
                    int64_t rows, float *y)
{
    const float *in = x;
    for (int i = 0; i < s->layers; i++) {
        float *W, *b;
        mn_mlp_layer_params(s, params, i, false, &W, &b);
        bool last = i == s->layers - 1;
        float *z = last ? y : w->z[i];
        int64_t out = s->out[i], inn = s->in[i];
        affine(in, W, b, rows, out, inn, z);
        if (last) break;
        if (s->glu) {
            /* h = phi(z) * (U in + c) */
            float *U, *c;
            mn_mlp_layer_params(s, params, i, true, &U, &c);
            affine(in, U, c, rows, out, inn, w->g[i]);
            activate(s, w, z, w->a[i], w->aux[i], rows * out);
            for (int64_t e = 0; e < rows * out; e++) w->h[i][e] = w->a[i][e] * w->g[i][e];
        } else {
            activate(s, w, z, w->h[i], w->aux[i], rows * out);
        }
        in = w->h[i];
    }
    if (s->out_norm.on) {
        /* y = g nhat(o) + beta, o the last layer's output */
        int64_t dv = s->out[s->layers - 1];
        mn_rownorm_forward(s->out_norm, y, rows, dv, w->nhat, w->ns);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < dv; j++) y[r * dv + j] = w->ln_g[j] * w->nhat[r * dv + j] + w->ln_b[j];
    }
    if (s->residual)
        for (int64_t e = 0; e < rows * s->out[s->layers - 1]; e++) y[e] += x[e];
}

void mn_mlp_backward(const mn_mlp_shape *s, mn_mlp_work *w, float *const *params, const float *x,
                     int64_t rows, float *dy, float *const *grads)
{
    float *dz = dy; /* gradient at the current layer's pre-activation */
    if (s->out_norm.on) {
        /* through N: do = J_nhat^T (g dy) */
        int64_t dv = s->out[s->layers - 1];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < dv; j++) dy[r * dv + j] *= w->ln_g[j];
        mn_rownorm_vjp(s->out_norm, w->nhat, w->ns, dy, rows, dv, dy, false);
    }
    for (int i = s->layers - 1; i >= 0; i--) {
        float *W, *b, *U = NULL, *c = NULL, *gW, *gb, *gU, *gc;
        bool gated = s->glu && i < s->layers - 1;
        mn_mlp_layer_params(s, params, i, false, &W, &b);
        mn_mlp_layer_params(s, grads, i, false, &gW, &gb);
        int64_t out = s->out[i], inn = s->in[i];
        const float *in = i == 0 ? x : w->h[i - 1];
        affine_grads(dz, in, rows, out, inn, gW, gb);
        if (gated) {
            /* w->dg holds the gate's gradient of this layer */
            mn_mlp_layer_params(s, params, i, true, &U, &c);
            mn_mlp_layer_params(s, grads, i, true, &gU, &gc);
            affine_grads(w->dg, in, rows, out, inn, gU, gc);
        }
        if (i == 0) break;
        /* dh = dz W (+ dg U) (rows x inn), then through the activation of layer i-1 */
        float *dh = dz == w->dh ? w->dz : w->dh;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)inn, (int)out, 1.0f, dz,
                    (int)out, W, (int)inn, 0.0f, dh, (int)inn);
        if (gated)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)inn, (int)out, 1.0f, w->dg,
                        (int)out, U, (int)inn, 1.0f, dh, (int)inn);
        if (s->glu) {
            /* h = a g: dg = dh a, da = dh g, then dz = da phi'(z) */
            const float *a = w->a[i - 1], *g = w->g[i - 1];
            for (int64_t e = 0; e < rows * inn; e++) {
                w->dg[e] = dh[e] * a[e];
                dh[e] *= g[e];
            }
        }
        activate_backward(s, w, w->z[i - 1], w->aux[i - 1], dh, dh, rows * inn);
        dz = dh;
    }
}
