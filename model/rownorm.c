/* rownorm.c: the row normalisations of out_norm and qk_norm (rownorm.h).
 * With c = x - mean x (layernorm) or x, s = (|c|^2/D + eps)^(-1/2), nhat = c s:
 *   tangent   nd = s (cd - nhat m),           m = <nhat, cd> / D
 *   adjoint   cbar = s (a - nhat <a, nhat> / D)
 *   second    d/dc <a, nd> = -s nhat F / D - s <a, nhat> nd / D - s^2 m a + s^2 m nhat <a, nhat> / D,
 *             F = <a, nd>
 * and centering, being linear and its own adjoint, is applied to cd on the way
 * in and to the result on the way out (checked against autograd by
 * tests/reference/test_reference_grads.py and the finite differences of
 * tests/unit/test_grad.c). */
#include "rownorm.h"
#include "ops.h"

#include <math.h>
#include <string.h>

mn_rownorm mn_rownorm_of(const mn_part *row)
{
    mn_rownorm nm = {false, false, false};
    if (!row || !(row->flags & (MN_PART_CENTER | MN_PART_SUMSQ | MN_PART_NORM))) return nm;
    nm.on = true;
    nm.center = (row->flags & MN_PART_CENTER) != 0;
    nm.sum = (row->flags & MN_PART_SUMSQ) != 0;
    return nm;
}

mn_rownorm mn_rule_out_norm(const mn_rule *r) { return mn_rownorm_of(mn_rule_part(r, &mn_norm_set, r->out_norm)); }
mn_rownorm mn_rule_qk_norm(const mn_rule *r) { return mn_rownorm_of(mn_rule_part(r, &mn_qknorm_set, r->qk_norm)); }

static double divisor(mn_rownorm nm, int64_t n) { return nm.sum ? 1.0 : (double)n; }

static double row_mean(const float *x, int64_t n)
{
    double acc = 0;
    for (int64_t j = 0; j < n; j++) acc += x[j];
    return acc / (double)n;
}

void mn_rownorm_forward(mn_rownorm nm, const float *x, int64_t rows, int64_t n, float *nhat, float *s)
{
    double D = divisor(nm, n);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = nhat + r * n;
        double mu = nm.center ? row_mean(xr, n) : 0.0, sq = 0;
        for (int64_t j = 0; j < n; j++) {
            double c = (double)xr[j] - mu;
            sq += c * c;
        }
        double sc = 1.0 / sqrt(sq / D + MN_ROWNORM_EPS);
        for (int64_t j = 0; j < n; j++) o[j] = (float)(((double)xr[j] - mu) * sc);
        if (s) s[r] = (float)sc;
    }
}

void mn_rownorm_jvp(mn_rownorm nm, const float *nhat, const float *s, const float *xd, int64_t rows, int64_t n,
                    float *nd)
{
    double D = divisor(nm, n);
    for (int64_t r = 0; r < rows; r++) {
        const float *h = nhat + r * n, *d = xd + r * n;
        float *o = nd + r * n;
        double mu = nm.center ? row_mean(d, n) : 0.0, m = 0;
        for (int64_t j = 0; j < n; j++) m += (double)h[j] * ((double)d[j] - mu);
        m /= D;
        for (int64_t j = 0; j < n; j++) o[j] = (float)(s[r] * (((double)d[j] - mu) - h[j] * m));
    }
}

void mn_rownorm_vjp(mn_rownorm nm, const float *nhat, const float *s, const float *a, int64_t rows, int64_t n,
                    float *xbar, bool accumulate)
{
    double D = divisor(nm, n);
    for (int64_t r = 0; r < rows; r++) {
        const float *h = nhat + r * n, *ar = a + r * n;
        float *o = xbar + r * n;
        double B = 0, sc = s[r];
        for (int64_t j = 0; j < n; j++) B += (double)ar[j] * h[j];
        double mean = 0;
        if (nm.center) {
            for (int64_t j = 0; j < n; j++) mean += sc * ((double)ar[j] - h[j] * B / D);
            mean /= (double)n;
        }
        for (int64_t j = 0; j < n; j++) {
            float v = (float)(sc * ((double)ar[j] - h[j] * B / D) - mean);
            o[j] = accumulate ? o[j] + v : v;
        }
    }
}

void mn_rownorm_hvp_acc(mn_rownorm nm, const float *nhat, const float *s, const float *xd, const float *a,
                        int64_t rows, int64_t n, float *xbar)
{
    double D = divisor(nm, n);
    for (int64_t r = 0; r < rows; r++) {
        const float *h = nhat + r * n, *d = xd + r * n, *ar = a + r * n;
        float *o = xbar + r * n;
        double sc = s[r], mu = nm.center ? row_mean(d, n) : 0.0, m = 0, B = 0, F = 0;
        for (int64_t j = 0; j < n; j++) {
            m += (double)h[j] * ((double)d[j] - mu);
            B += (double)ar[j] * h[j];
        }
        m /= D;
        for (int64_t j = 0; j < n; j++) F += (double)ar[j] * sc * (((double)d[j] - mu) - h[j] * m);
        double mean = 0;
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t j = 0; j < n; j++) {
                double nd = sc * (((double)d[j] - mu) - h[j] * m);
                double g = -sc * h[j] * F / D - sc * B * nd / D - sc * sc * m * ar[j] + sc * sc * m * h[j] * B / D;
                if (pass == 0) mean += g;
                else o[j] += (float)(g - mean);
            }
            if (!nm.center) mean = 0;
            else if (pass == 0) mean /= (double)n;
        }
    }
}

/* The rows of a contiguous f32 tensor of at least one dimension. */
static int64_t rows_of(const mn_tensor *x)
{
    int64_t n = x->shape[x->ndim - 1];
    return n > 0 ? mn_tensor_numel(x) / n : 0;
}

static mn_status normalise(mn_rownorm nm, const mn_tensor *x, mn_tensor *out, mn_tensor *scale)
{
    int64_t n = x->shape[x->ndim - 1];
    mn_device dev = x->storage->device;
    const mn_backend *be = dev == MN_CPU ? NULL : mn_backend_for(dev);
    if (nm.on && dev != MN_CPU) {
        /* the backend's one-pass kernel: one read of x, one write of out */
        if (!be || !be->rownorm || !mn_tensor_is_contiguous(x) || x->dtype != MN_F32)
            return mn_fail(MN_ERR_UNSUPPORTED, "row normalisation: the %s backend takes contiguous f32 tensors only",
                           mn_device_name(dev));
        return be->rownorm(out, scale, x, nm.center, nm.sum, MN_ROWNORM_EPS);
    }
    MN_TRY(mn_tensor_copy_into(out, x));
    if (nm.on)
        mn_rownorm_forward(nm, mn_tensor_data(out), rows_of(out), n, mn_tensor_data(out),
                           scale ? mn_tensor_data(scale) : NULL);
    return MN_OK;
}

mn_status mn_rownorm_tensor(mn_rownorm nm, const mn_tensor *x, mn_tensor *out)
{
    MN_TRY(mn_tensor_empty(out, MN_F32, x->ndim, x->shape, x->storage->device));
    mn_status st = normalise(nm, x, out, NULL);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

mn_status mn_rownorm_tensor_scaled(mn_rownorm nm, const mn_tensor *x, mn_tensor *out, mn_tensor *scale)
{
    if (!nm.on || x->ndim < 1) return mn_fail(MN_ERR_ARG, "row normalisation with scales: no normalisation, or no rows");
    mn_device dev = x->storage->device;
    MN_TRY(mn_tensor_empty(out, MN_F32, x->ndim, x->shape, dev));
    mn_status st = x->ndim > 1 ? mn_tensor_empty(scale, MN_F32, x->ndim - 1, x->shape, dev)
                               : mn_tensor_empty(scale, MN_F32, 1, (const int64_t[]){1}, dev);
    if (st == MN_OK) st = normalise(nm, x, out, scale);
    if (st != MN_OK) {
        mn_tensor_release(out);
        mn_tensor_release(scale);
    }
    return st;
}

mn_status mn_rownorm_vjp_tensor(mn_rownorm nm, const mn_tensor *nhat, const mn_tensor *scale, mn_tensor *a)
{
    if (!nm.on) return MN_OK;
    mn_device dev = a->storage->device;
    const mn_tensor *all[3] = {nhat, scale, a};
    for (int i = 0; i < 3; i++)
        if (!all[i]->storage || all[i]->storage->device != dev || all[i]->dtype != MN_F32 ||
            !mn_tensor_is_contiguous(all[i]) || all[i]->ndim < 1)
            return mn_fail(MN_ERR_ARG, "row normalisation's adjoint: needs contiguous f32 tensors on one device");
    int64_t n = a->shape[a->ndim - 1];
    if (!mn_tensor_same_shape(nhat, a) || mn_tensor_numel(scale) != rows_of(a))
        return mn_fail(MN_ERR_ARG, "row normalisation's adjoint: the gradient, the rows and their scales do not match");
    if (dev == MN_CPU) {
        mn_rownorm_vjp(nm, mn_tensor_data(nhat), mn_tensor_data(scale), mn_tensor_data(a), rows_of(a), n,
                       mn_tensor_data(a), false);
        return MN_OK;
    }
    const mn_backend *be = mn_backend_for(dev);
    if (!be) return MN_ERR_DEVICE;
    if (!be->rownorm_vjp)
        return mn_fail(MN_ERR_UNSUPPORTED, "row normalisation's adjoint: the %s backend has none", mn_device_name(dev));
    return be->rownorm_vjp(a, nhat, scale, a, nm.center, nm.sum);
}
