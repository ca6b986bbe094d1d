/* ops.c: the front end of tensor ops: the op table generated from ops.def,
 * dtype promotion, shape checks and broadcasting, allocation of results, the
 * backend registry and dispatch, and the creation functions (full, arange,
 * eye, linspace). No element loops live here: backends run them. */
#include "ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the op table ---- */

static const struct op_info {
    const char *name, *doc, *meta;
    mn_op_kind kind;
} op_table[MN_OP_COUNT] = {
#define MN_UNARY(name, doc) {#name, doc, NULL, MN_OPKIND_UNARY},
#define MN_BINARY(name, meta, doc) {#name, doc, meta, MN_OPKIND_BINARY},
#define MN_REDUCE(name, doc) {#name, doc, NULL, MN_OPKIND_REDUCE},
#include "ops.def"
};

static bool op_ok(mn_op op) { return (unsigned)op < MN_OP_COUNT; }

const char *mn_op_name(mn_op op) { return op_ok(op) ? op_table[op].name : "?"; }
const char *mn_op_doc(mn_op op) { return op_ok(op) ? op_table[op].doc : ""; }
const char *mn_op_metamethod(mn_op op) { return op_ok(op) ? op_table[op].meta : NULL; }
mn_op_kind mn_op_kind_of(mn_op op) { return op_ok(op) ? op_table[op].kind : MN_OPKIND_UNARY; }

int mn_op_lookup(const char *name)
{
    for (int i = 0; name && i < MN_OP_COUNT; i++)
        if (strcmp(op_table[i].name, name) == 0) return i;
    return -1;
}

static mn_status need_kind(const char *who, mn_op op, mn_op_kind kind)
{
    static const char *const kinds[] = {"unary", "binary", "reduction"};
    if (!op_ok(op)) return mn_fail(MN_ERR_ARG, "%s: unknown op %d", who, (int)op);
    if (op_table[op].kind != kind)
        return mn_fail(MN_ERR_ARG, "%s: '%s' is not a %s op", who, op_table[op].name, kinds[kind]);
    return MN_OK;
}

/* ---- dtypes ---- */

mn_dtype mn_promote(mn_op op, mn_dtype a, mn_dtype b)
{
    if (a == MN_F64 || b == MN_F64) return MN_F64;
    if (a == MN_F32 || b == MN_F32) return MN_F32;
    if (op == MN_OP_div || op == MN_OP_pow) return MN_F32;
    return MN_I64;
}

mn_dtype mn_unary_dtype(mn_op op, mn_dtype a)
{
    if (a != MN_I64) return a;
    switch (op) {
    case MN_OP_neg: case MN_OP_abs: case MN_OP_relu: case MN_OP_sign:
    case MN_OP_floor: case MN_OP_round: case MN_OP_isnan: case MN_OP_isfinite:
        return MN_I64;
    default:
        return op_ok(op) && op_table[op].kind == MN_OPKIND_UNARY ? MN_F32 : a;
    }
}

mn_dtype mn_reduce_dtype(mn_op op, mn_dtype a)
{
    return a == MN_I64 && (op == MN_OP_mean || op == MN_OP_norm) ? MN_F32 : a;
}

/* ---- backends ---- */

static const mn_backend *backends[2];

void mn_register_backend(mn_device dev, const mn_backend *b)
{
    if (dev == MN_CPU || dev == MN_CUDA) backends[dev] = b;
}

const mn_backend *mn_backend_for(mn_device dev)
{
    if (dev != MN_CPU && dev != MN_CUDA) {
        mn_fail(MN_ERR_ARG, "unknown device %d", (int)dev);
        return NULL;
    }
    /* Lazily, so that no init call is needed and the CPU backend is linked
     * in from a static library (a constructor in cpu.o would not pull it). */
    if (dev == MN_CPU && !backends[MN_CPU]) backends[MN_CPU] = mn_cpu_backend();
    if (!backends[dev]) {
        mn_fail(MN_ERR_DEVICE, "cuda: no CUDA device in this build");
        return NULL;
    }
    return backends[dev];
}

/* ---- argument checks ---- */

static mn_status need_empty(const char *who, const mn_tensor *out)
{
    if (!out) return mn_fail(MN_ERR_ARG, "%s: no output tensor", who);
    if (out->storage) return mn_fail(MN_ERR_ARG, "%s: output tensor is not empty (release it or zero it first)", who);
    return MN_OK;
}

static mn_status need_live(const char *who, const mn_tensor *t)
{
    if (!t || !t->storage) return mn_fail(MN_ERR_ARG, "%s: tensor is empty (released)", who);
    return MN_OK;
}

static mn_device dev_of(const mn_tensor *t) { return t->storage->device; }

static mn_status same_device(const char *who, const mn_tensor *a, const mn_tensor *b)
{
    if (dev_of(a) != dev_of(b))
        return mn_fail(MN_ERR_ARG, "%s: operands on %s and %s", who, mn_device_name(dev_of(a)),
                       mn_device_name(dev_of(b)));
    return MN_OK;
}

static mn_status backend(const char *who, mn_device dev, const mn_backend **out)
{
    const mn_backend *be = mn_backend_for(dev);
    if (!be) return mn_fail_context(MN_ERR_DEVICE, "%s: ", who);
    *out = be;
    return MN_OK;
}

static mn_status missing(const char *who, const mn_backend *be)
{
    return mn_fail(MN_ERR_UNSUPPORTED, "%s: not implemented by the %s backend", who, be->name);
}

/* src converted to dt (a share when it already is), then broadcast to shape. */
static mn_status prepare(const char *who, mn_tensor *out, const mn_tensor *src, mn_dtype dt,
                         int ndim, const int64_t *shape)
{
    mn_tensor conv = {0};
    mn_status st = mn_tensor_to_dtype(&conv, src, dt);
    if (st == MN_OK) st = mn_view_expand(out, &conv, ndim, shape);
    mn_tensor_release(&conv);
    if (st != MN_OK) return mn_fail_context(st, "%s: ", who);
    return MN_OK;
}

/* ---- elementwise ---- */

mn_status mn_unary(mn_op op, mn_tensor *out, const mn_tensor *a)
{
    MN_TRY(need_kind("unary", op, MN_OPKIND_UNARY));
    const char *who = op_table[op].name;
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, a));
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (!be->unary) return missing(who, be);
    mn_dtype dt = mn_unary_dtype(op, a->dtype);
    mn_tensor src = {0}, res = {0};
    mn_status st = mn_tensor_to_dtype(&src, a, dt);
    if (st == MN_OK) st = mn_tensor_empty(&res, dt, a->ndim, a->shape, dev_of(a));
    if (st == MN_OK) st = be->unary(op, &res, &src);
    mn_tensor_release(&src);
    if (st != MN_OK) {
        mn_tensor_release(&res);
        return st;
    }
    *out = res;
    return MN_OK;
}

mn_status mn_binary(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    MN_TRY(need_kind("binary", op, MN_OPKIND_BINARY));
    const char *who = op_table[op].name;
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, a));
    MN_TRY(need_live(who, b));
    MN_TRY(same_device(who, a, b));
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (!be->binary) return missing(who, be);
    int ndim;
    int64_t shape[MN_MAX_DIMS];
    mn_status st = mn_broadcast_shapes(a->ndim, a->shape, b->ndim, b->shape, &ndim, shape);
    if (st != MN_OK) return mn_fail_context(st, "%s: ", who);
    mn_dtype dt = mn_promote(op, a->dtype, b->dtype);
    mn_tensor ea = {0}, eb = {0}, res = {0};
    st = prepare(who, &ea, a, dt, ndim, shape);
    if (st == MN_OK) st = prepare(who, &eb, b, dt, ndim, shape);
    if (st == MN_OK) st = mn_tensor_empty(&res, dt, ndim, shape, dev_of(a));
    if (st == MN_OK) st = be->binary(op, &res, &ea, &eb);
    mn_tensor_release(&ea);
    mn_tensor_release(&eb);
    if (st != MN_OK) {
        mn_tensor_release(&res);
        return st;
    }
    *out = res;
    return MN_OK;
}

mn_status mn_binary_scalar(mn_op op, mn_tensor *out, const mn_tensor *a, double s, bool scalar_first)
{
    MN_TRY(need_kind("binary", op, MN_OPKIND_BINARY));
    MN_TRY(need_live(op_table[op].name, a));
    /* The scalar takes a's dtype, except that an i64 tensor with a number
     * that is no i64 value (0.5, NaN, 1e300) must not truncate it: f32. */
    mn_dtype sdt = a->dtype;
    if (sdt == MN_I64 && !(s == floor(s) && s >= -9223372036854775808.0 && s < 9223372036854775808.0))
        sdt = MN_F32;
    mn_tensor st_ = {0};
    MN_TRY(mn_tensor_full(&st_, sdt, 0, NULL, s, dev_of(a)));
    mn_status st = scalar_first ? mn_binary(op, out, &st_, a) : mn_binary(op, out, a, &st_);
    mn_tensor_release(&st_);
    return st;
}

/* where(c, a, b): c keeps its own dtype (converting it could turn 1e-300 or
 * NaN, both true, into 0); a and b are promoted as by add. */
mn_status mn_where(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b)
{
    const char *who = "where";
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, c));
    MN_TRY(need_live(who, a));
    MN_TRY(need_live(who, b));
    MN_TRY(same_device(who, c, a));
    MN_TRY(same_device(who, a, b));
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (!be->where) return missing(who, be);
    int n1, ndim;
    int64_t s1[MN_MAX_DIMS], shape[MN_MAX_DIMS];
    mn_status st = mn_broadcast_shapes(c->ndim, c->shape, a->ndim, a->shape, &n1, s1);
    if (st == MN_OK) st = mn_broadcast_shapes(n1, s1, b->ndim, b->shape, &ndim, shape);
    if (st != MN_OK) return mn_fail_context(st, "%s: ", who);
    mn_dtype dt = mn_promote(MN_OP_add, a->dtype, b->dtype);
    mn_tensor ec = {0}, ea = {0}, eb = {0}, res = {0};
    st = prepare(who, &ec, c, c->dtype, ndim, shape);
    if (st == MN_OK) st = prepare(who, &ea, a, dt, ndim, shape);
    if (st == MN_OK) st = prepare(who, &eb, b, dt, ndim, shape);
    if (st == MN_OK) st = mn_tensor_empty(&res, dt, ndim, shape, dev_of(a));
    if (st == MN_OK) st = be->where(&res, &ec, &ea, &eb);
    mn_tensor_release(&ec);
    mn_tensor_release(&ea);
    mn_tensor_release(&eb);
    if (st != MN_OK) {
        mn_tensor_release(&res);
        return st;
    }
    *out = res;
    return MN_OK;
}

/* ---- reductions ---- */

mn_status mn_reduce_all(mn_op op, const mn_tensor *a, double *result)
{
    MN_TRY(need_kind("reduce", op, MN_OPKIND_REDUCE));
    const char *who = op_table[op].name;
    MN_TRY(need_live(who, a));
    if (!result) return mn_fail(MN_ERR_ARG, "%s: no result pointer", who);
    if (mn_tensor_numel(a) == 0) {
        *result = op == MN_OP_sum || op == MN_OP_norm ? 0.0 : op == MN_OP_prod ? 1.0 : NAN;
        return MN_OK;
    }
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (!be->reduce_all) return missing(who, be);
    return be->reduce_all(op, a, result);
}

/* The result of reducing a along d: a new tensor (a's shape without d), then
 * a view with d kept as size 1 when asked. */
static mn_status reduce_common(const char *who, mn_op op, mn_tensor *out, const mn_tensor *a,
                               int dim, bool keepdim, bool arg)
{
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, a));
    int d;
    mn_status st = mn_resolve_dim(dim, a->ndim, 0, &d);
    if (st != MN_OK) return mn_fail_context(st, "%s: ", who);
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (arg ? !be->argreduce_dim : !be->reduce_dim) return missing(who, be);
    int64_t shape[MN_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < a->ndim; i++)
        if (i != d) shape[nd++] = a->shape[i];
    int64_t outer = 1;
    for (int i = 0; i < nd; i++) outer *= shape[i];
    if (a->shape[d] == 0 && outer > 0 && (arg || op == MN_OP_max || op == MN_OP_min)) {
        char buf[160];
        return mn_fail(MN_ERR_ARG, "%s: cannot reduce dim %d of size 0 (%s)", who, d,
                       mn_shape_string(a, buf, sizeof buf));
    }
    mn_dtype dt = arg ? MN_I64 : mn_reduce_dtype(op, a->dtype);
    mn_tensor src = {0}, res = {0};
    st = arg ? (mn_tensor_share(&src, a), MN_OK) : mn_tensor_to_dtype(&src, a, dt);
    if (st == MN_OK) st = mn_tensor_empty(&res, dt, nd, shape, dev_of(a));
    if (st == MN_OK) st = arg ? be->argreduce_dim(op, &res, &src, d) : be->reduce_dim(op, &res, &src, d);
    mn_tensor_release(&src);
    if (st == MN_OK && keepdim) {
        mn_tensor kept = {0};
        st = mn_view_unsqueeze(&kept, &res, d);
        mn_tensor_release(&res);
        res = kept;
    }
    if (st != MN_OK) {
        mn_tensor_release(&res);
        return st;
    }
    *out = res;
    return MN_OK;
}

mn_status mn_reduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim, bool keepdim)
{
    MN_TRY(need_kind("reduce", op, MN_OPKIND_REDUCE));
    return reduce_common(op_table[op].name, op, out, a, dim, keepdim, false);
}

mn_status mn_argreduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim, bool keepdim)
{
    if (op != MN_OP_max && op != MN_OP_min)
        return mn_fail(MN_ERR_ARG, "argreduce: op must be max or min, got '%s'", mn_op_name(op));
    return reduce_common(op == MN_OP_max ? "argmax" : "argmin", op, out, a, dim, keepdim, true);
}

/* ---- matmul ---- */

/* t (at least 2-d) as [batch, rows, cols] after broadcasting its leading
 * dims to bshape: a view when the strides allow, else a copy. */
static mn_status as_batched(mn_tensor *out, const mn_tensor *t, int bnd, const int64_t *bshape, int64_t batch)
{
    int64_t shape[MN_MAX_DIMS];
    memcpy(shape, bshape, sizeof(int64_t) * (size_t)bnd);
    shape[bnd] = t->shape[t->ndim - 2];
    shape[bnd + 1] = t->shape[t->ndim - 1];
    mn_tensor wide = {0};
    MN_TRY(mn_view_expand(&wide, t, bnd + 2, shape));
    int64_t three[3] = {batch, shape[bnd], shape[bnd + 1]};
    mn_status st = mn_tensor_reshape(out, &wide, 3, three);
    mn_tensor_release(&wide);
    return st;
}

mn_status mn_matmul(mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    const char *who = "matmul";
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, a));
    MN_TRY(need_live(who, b));
    MN_TRY(same_device(who, a, b));
    char sa[160], sb[160];
    if (a->ndim == 0 || b->ndim == 0)
        return mn_fail(MN_ERR_ARG, "matmul: both operands need at least 1 dim, got %s @ %s",
                       mn_shape_string(a, sa, sizeof sa), mn_shape_string(b, sb, sizeof sb));
    const mn_backend *be = NULL;
    MN_TRY(backend(who, dev_of(a), &be));
    if (!be->matmul) return missing(who, be);
    int64_t k = a->shape[a->ndim - 1], kb = b->shape[b->ndim == 1 ? 0 : b->ndim - 2];
    if (k != kb)
        return mn_fail(MN_ERR_ARG, "matmul: inner sizes differ: %s @ %s", mn_shape_string(a, sa, sizeof sa),
                       mn_shape_string(b, sb, sizeof sb));
    mn_dtype dt = mn_promote(MN_OP_mul, a->dtype, b->dtype);
    mn_tensor ca = {0}, cb = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0}, res = {0};
    mn_status st = mn_tensor_to_dtype(&ca, a, dt);
    if (st == MN_OK) st = mn_tensor_to_dtype(&cb, b, dt);
    /* 1-d operands become a row (a) or a column (b), dropped again below. */
    if (st == MN_OK) st = a->ndim == 1 ? mn_view_unsqueeze(&a2, &ca, 0) : (mn_tensor_share(&a2, &ca), MN_OK);
    if (st == MN_OK) st = b->ndim == 1 ? mn_view_unsqueeze(&b2, &cb, 1) : (mn_tensor_share(&b2, &cb), MN_OK);
    if (st != MN_OK) goto done;
    int64_t m = a2.shape[a2.ndim - 2], n = b2.shape[b2.ndim - 1];
    int bnd;
    int64_t bshape[MN_MAX_DIMS];
    st = mn_broadcast_shapes(a2.ndim - 2, a2.shape, b2.ndim - 2, b2.shape, &bnd, bshape);
    if (st != MN_OK) {
        st = mn_fail(MN_ERR_ARG, "matmul: batch dims do not broadcast: %s @ %s",
                     mn_shape_string(a, sa, sizeof sa), mn_shape_string(b, sb, sizeof sb));
        goto done;
    }
    if (bnd + 2 > MN_MAX_DIMS) {
        st = mn_fail(MN_ERR_ARG, "matmul: too many dims");
        goto done;
    }
    int64_t batch = 1;
    for (int i = 0; i < bnd; i++) batch *= bshape[i];
    /* The result's shape, without the dims that 1-d operands lacked. */
    int rnd = 0;
    int64_t rshape[MN_MAX_DIMS];
    for (int i = 0; i < bnd; i++) rshape[rnd++] = bshape[i];
    if (a->ndim > 1) rshape[rnd++] = m;
    if (b->ndim > 1) rshape[rnd++] = n;

    /* [..., m, k] @ [k, n]: one product of [(batch m), k] @ [k, n], as torch
     * folds it, when a's batch and row dims merge into one. */
    int64_t folded[2] = {batch * m, k};
    mn_tensor flat = {0};
    if (b2.ndim == 2 && a2.ndim > 2 && mn_view_reshape(&flat, &a2, 2, folded) == MN_OK) {
        st = mn_view_unsqueeze(&a3, &flat, 0);
        mn_tensor_release(&flat);
        if (st == MN_OK) st = mn_view_unsqueeze(&b3, &b2, 0);
    } else {
        mn_clear_error();
        st = as_batched(&a3, &a2, bnd, bshape, batch);
        if (st == MN_OK) st = as_batched(&b3, &b2, bnd, bshape, batch);
    }
    int64_t oshape[3] = {a3.shape[0], a3.shape[1], n};
    if (st == MN_OK) st = mn_tensor_empty(&res, dt, 3, oshape, dev_of(a));
    if (st == MN_OK) st = be->matmul(&res, &a3, &b3);
    if (st == MN_OK) st = mn_view_reshape(out, &res, rnd, rshape);
done:
    mn_tensor_release(&ca);
    mn_tensor_release(&cb);
    mn_tensor_release(&a2);
    mn_tensor_release(&b2);
    mn_tensor_release(&a3);
    mn_tensor_release(&b3);
    mn_tensor_release(&res);
    return st;
}

/* ---- creation ---- */

mn_status mn_tensor_full(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                         double value, mn_device dev)
{
    MN_TRY(mn_tensor_empty(out, dt, ndim, shape, dev));
    mn_status st = mn_tensor_fill(out, value);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

/* Values computed on the host in double, then stored in dt. */
static void put(mn_tensor *t, int64_t i, double v)
{
    void *p = mn_tensor_data(t);
    switch (t->dtype) {
    case MN_F32: ((float *)p)[i] = (float)v; break;
    case MN_F64: ((double *)p)[i] = v; break;
    case MN_I64: ((int64_t *)p)[i] = mn_to_i64(v); break;
    }
}

/* numpy's count, ceil((stop - start) / step); a negative count is empty. */
mn_status mn_tensor_arange(mn_tensor *out, mn_dtype dt, double start, double stop, double step)
{
    MN_TRY(need_empty("arange", out));
    if (!isfinite(start) || !isfinite(stop) || !isfinite(step))
        return mn_fail(MN_ERR_ARG, "arange: start %g, stop %g and step %g must be finite", start, stop, step);
    if (step == 0) return mn_fail(MN_ERR_ARG, "arange: step must not be 0");
    double count = ceil((stop - start) / step);
    if (!(count >= 0)) count = 0;
    if (count > 4e18) return mn_fail(MN_ERR_ARG, "arange: %g elements is too many", count);
    int64_t n = (int64_t)count;
    MN_TRY(mn_tensor_empty(out, dt, 1, &n, MN_CPU));
    for (int64_t i = 0; i < n; i++) put(out, i, start + (double)i * step);
    return MN_OK;
}

mn_status mn_tensor_eye(mn_tensor *out, mn_dtype dt, int64_t n, int64_t m)
{
    MN_TRY(need_empty("eye", out));
    if (n < 0 || m < 0) return mn_fail(MN_ERR_ARG, "eye: sizes must be >= 0, got %lldx%lld", (long long)n, (long long)m);
    int64_t shape[2] = {n, m};
    MN_TRY(mn_tensor_zeros(out, dt, 2, shape, MN_CPU));
    for (int64_t i = 0; i < n && i < m; i++) put(out, i * m + i, 1.0);
    return MN_OK;
}

/* numpy's formula: start + i * step, and the last value exactly stop. */
mn_status mn_tensor_linspace(mn_tensor *out, mn_dtype dt, double start, double stop, int64_t n)
{
    MN_TRY(need_empty("linspace", out));
    if (n < 0) return mn_fail(MN_ERR_ARG, "linspace: count %lld must be >= 0", (long long)n);
    MN_TRY(mn_tensor_empty(out, dt, 1, &n, MN_CPU));
    double step = n > 1 ? (stop - start) / (double)(n - 1) : 0.0;
    for (int64_t i = 0; i < n; i++) put(out, i, i == n - 1 && n > 1 ? stop : start + (double)i * step);
    return MN_OK;
}

mn_status mn_tile_many_check(int n, mn_tensor *const *dst, const mn_tensor *const *src)
{
    if (n < 0 || n > MN_TILE_MANY) return mn_fail(MN_ERR_ARG, "tile_many: %d copies, at most %d", n, MN_TILE_MANY);
    for (int i = 0; i < n; i++) {
        const int64_t dn = mn_tensor_numel(dst[i]), sn = mn_tensor_numel(src[i]);
        if (dst[i]->dtype != MN_F32 || src[i]->dtype != MN_F32 || !mn_tensor_is_contiguous(dst[i]) ||
            !mn_tensor_is_contiguous(src[i]) || (dn > 0 && (sn == 0 || dn % sn != 0)))
            return mn_fail(MN_ERR_ARG, "tile_many: copy %d needs contiguous f32 tensors, the source's size "
                                       "dividing the destination's (%lld into %lld)",
                           i, (long long)sn, (long long)dn);
    }
    return MN_OK;
}
