/* cpu.c: the CPU backend of ops.h: plain strided loops over the scalar
 * definitions of op_math.h, double accumulation in reductions, OpenBLAS for
 * float matrix products. Every loop walks "lines": the innermost run of
 * elements after size-1 dims are dropped and mergeable dims are fused, so a
 * contiguous tensor is one line and needs no per-element index arithmetic. */
#include "ops.h"
#include "op_math.h"

#include <cblas.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* ---- the line iterator ---- */

enum { MAX_OPERANDS = 4 };

typedef struct line_iter {
    int nops, ndim;                          /* ndim >= 1 after fusing */
    int64_t shape[MN_MAX_DIMS];              /* shape[ndim-1]: the line length */
    int64_t stride[MAX_OPERANDS][MN_MAX_DIMS]; /* in bytes */
    int64_t index[MN_MAX_DIMS];
    char *ptr[MAX_OPERANDS];
    int64_t lines_left;
} line_iter;

/* Operands share shape (ndim, shape); strides in elements, one row each. */
static void iter_init(line_iter *it, int nops, int ndim, const int64_t *shape,
                      const int64_t *const *strides, char *const *base, const size_t *esize)
{
    memset(it, 0, sizeof *it);
    it->nops = nops;
    int64_t numel = 1;
    int nd = 0;
    for (int d = 0; d < ndim; d++) {
        numel *= shape[d];
        if (shape[d] == 1) continue;
        /* Fuse into the previous (outer) dim when every operand steps over
         * it as one run: outer stride == inner stride * inner size. */
        bool fuse = nd > 0;
        for (int k = 0; k < nops && fuse; k++)
            fuse = it->stride[k][nd - 1] == strides[k][d] * (int64_t)esize[k] * shape[d];
        if (fuse) {
            it->shape[nd - 1] *= shape[d];
            for (int k = 0; k < nops; k++) it->stride[k][nd - 1] = strides[k][d] * (int64_t)esize[k];
        } else {
            it->shape[nd] = shape[d];
            for (int k = 0; k < nops; k++) it->stride[k][nd] = strides[k][d] * (int64_t)esize[k];
            nd++;
        }
    }
    if (nd == 0) {
        it->shape[0] = 1;
        nd = 1;
    }
    it->ndim = nd;
    for (int k = 0; k < nops; k++) it->ptr[k] = base[k];
    it->lines_left = numel == 0 ? 0 : numel / it->shape[nd - 1];
}

static int64_t iter_len(const line_iter *it) { return it->shape[it->ndim - 1]; }
static int64_t iter_step(const line_iter *it, int k) { return it->stride[k][it->ndim - 1]; }

/* The next line's start pointers into p; false when done. */
static bool iter_next(line_iter *it, char **p)
{
    if (it->lines_left == 0) return false;
    for (int k = 0; k < it->nops; k++) p[k] = it->ptr[k];
    if (--it->lines_left > 0) {
        for (int d = it->ndim - 2; d >= 0; d--) {
            for (int k = 0; k < it->nops; k++) it->ptr[k] += it->stride[k][d];
            if (++it->index[d] < it->shape[d]) break;
            for (int k = 0; k < it->nops; k++) it->ptr[k] -= it->stride[k][d] * it->shape[d];
            it->index[d] = 0;
        }
    }
    return true;
}

/* An iterator over tensors of one shape. */
static void iter_tensors(line_iter *it, int nops, const mn_tensor *const *t)
{
    const int64_t *strides[MAX_OPERANDS];
    char *base[MAX_OPERANDS];
    size_t esize[MAX_OPERANDS];
    for (int k = 0; k < nops; k++) {
        strides[k] = t[k]->stride;
        base[k] = mn_tensor_data(t[k]);
        esize[k] = mn_dtype_size(t[k]->dtype);
    }
    iter_init(it, nops, t[0]->ndim, t[0]->shape, strides, base, esize);
}

static mn_status check_cpu(const char *who, int n, const mn_tensor *const *t)
{
    for (int k = 0; k < n; k++) {
        if (!t[k]->storage || t[k]->storage->device != MN_CPU)
            return mn_fail(MN_ERR_ARG, "cpu %s: operand %d is not a cpu tensor", who, k);
        if (k > 0 && !mn_tensor_same_shape(t[0], t[k]))
            return mn_fail(MN_ERR_ARG, "cpu %s: operand shapes differ", who);
    }
    return MN_OK;
}

static mn_status check_dtypes(const char *who, int n, const mn_tensor *const *t)
{
    for (int k = 1; k < n; k++)
        if (t[k]->dtype != t[0]->dtype)
            return mn_fail(MN_ERR_ARG, "cpu %s: operand dtypes differ (%s, %s)", who,
                           mn_dtype_name(t[0]->dtype), mn_dtype_name(t[k]->dtype));
    return MN_OK;
}

/* ---- unary ---- */

#define AS_F32(x) ((float)(x))
#define AS_F64(x) ((double)(x))

/* One op over a line: a unit-stride loop the compiler can vectorise, and the
 * strided one. */
#define UNARY_LINE(T, CONV, F)                                                 \
    if (unit) {                                                                \
        T *restrict po = (T *)o;                                               \
        const T *restrict pa = (const T *)a;                                   \
        for (int64_t i = 0; i < n; i++) po[i] = CONV(F((double)pa[i]));        \
    } else {                                                                   \
        for (int64_t i = 0; i < n; i++)                                        \
            *(T *)(o + i * os) = CONV(F((double)*(const T *)(a + i * as)));    \
    }

static void unary_f32(mn_op op, int64_t n, char *o, int64_t os, const char *a, int64_t as)
{
    bool unit = os == 4 && as == 4;
    switch (op) {
#define MN_UNARY(name, doc) case MN_OP_##name: UNARY_LINE(float, AS_F32, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

static void unary_f64(mn_op op, int64_t n, char *o, int64_t os, const char *a, int64_t as)
{
    bool unit = os == 8 && as == 8;
    switch (op) {
#define MN_UNARY(name, doc) case MN_OP_##name: UNARY_LINE(double, AS_F64, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

/* Integer ops on integers stay exact (a trip through double is not, past
 * 2^53); the others go through double and mn_to_i64. */
static bool unary_i64_exact(mn_op op, int64_t n, char *o, int64_t os, const char *a, int64_t as)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t x = *(const int64_t *)(a + i * as), r;
        switch (op) {
        case MN_OP_neg: r = (int64_t)(0u - (uint64_t)x); break; /* wraps, as torch */
        case MN_OP_abs: r = x < 0 ? (int64_t)(0u - (uint64_t)x) : x; break;
        case MN_OP_relu: r = x > 0 ? x : 0; break;
        case MN_OP_sign: r = (x > 0) - (x < 0); break;
        case MN_OP_floor: case MN_OP_round: r = x; break;
        case MN_OP_isnan: r = 0; break;
        case MN_OP_isfinite: r = 1; break;
        default: return false;
        }
        *(int64_t *)(o + i * os) = r;
    }
    return true;
}

static void unary_i64(mn_op op, int64_t n, char *o, int64_t os, const char *a, int64_t as)
{
    if (unary_i64_exact(op, n, o, os, a, as)) return;
    bool unit = os == 8 && as == 8;
    switch (op) {
#define MN_UNARY(name, doc) case MN_OP_##name: UNARY_LINE(int64_t, mn_to_i64, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

static mn_status cpu_unary(mn_op op, mn_tensor *out, const mn_tensor *a)
{
    const mn_tensor *t[2] = {out, a};
    MN_TRY(check_cpu("unary", 2, t));
    MN_TRY(check_dtypes("unary", 2, t));
    line_iter it;
    char *p[2];
    iter_tensors(&it, 2, t);
    int64_t n = iter_len(&it), os = iter_step(&it, 0), as = iter_step(&it, 1);
    while (iter_next(&it, p)) {
        switch (out->dtype) {
        case MN_F32: unary_f32(op, n, p[0], os, p[1], as); break;
        case MN_F64: unary_f64(op, n, p[0], os, p[1], as); break;
        case MN_I64: unary_i64(op, n, p[0], os, p[1], as); break;
        }
    }
    return MN_OK;
}

/* ---- binary ---- */

#define BINARY_LINE(T, CONV, F)                                                \
    if (unit) {                                                                \
        T *restrict po = (T *)o;                                               \
        const T *restrict pa = (const T *)a, *restrict pb = (const T *)b;      \
        for (int64_t i = 0; i < n; i++) po[i] = CONV(F((double)pa[i], (double)pb[i])); \
    } else {                                                                   \
        for (int64_t i = 0; i < n; i++)                                        \
            *(T *)(o + i * os) = CONV(F((double)*(const T *)(a + i * as),      \
                                        (double)*(const T *)(b + i * bs)));    \
    }

#define BINARY_ARGS int64_t n, char *o, int64_t os, const char *a, int64_t as, const char *b, int64_t bs

static void binary_f32(mn_op op, BINARY_ARGS)
{
    bool unit = os == 4 && as == 4 && bs == 4;
    switch (op) {
#define MN_BINARY(name, meta, doc) case MN_OP_##name: BINARY_LINE(float, AS_F32, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

static void binary_f64(mn_op op, BINARY_ARGS)
{
    bool unit = os == 8 && as == 8 && bs == 8;
    switch (op) {
#define MN_BINARY(name, meta, doc) case MN_OP_##name: BINARY_LINE(double, AS_F64, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

static bool binary_i64_exact(mn_op op, BINARY_ARGS)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t x = *(const int64_t *)(a + i * as), y = *(const int64_t *)(b + i * bs), r;
        switch (op) {
        /* Unsigned arithmetic wraps instead of overflowing (undefined). */
        case MN_OP_add: r = (int64_t)((uint64_t)x + (uint64_t)y); break;
        case MN_OP_sub: r = (int64_t)((uint64_t)x - (uint64_t)y); break;
        case MN_OP_mul: r = (int64_t)((uint64_t)x * (uint64_t)y); break;
        case MN_OP_maximum: r = x > y ? x : y; break;
        case MN_OP_minimum: r = x < y ? x : y; break;
        case MN_OP_lt: r = x < y; break;
        case MN_OP_le: r = x <= y; break;
        case MN_OP_gt: r = x > y; break;
        case MN_OP_ge: r = x >= y; break;
        case MN_OP_eq: r = x == y; break;
        case MN_OP_ne: r = x != y; break;
        default: return false;
        }
        *(int64_t *)(o + i * os) = r;
    }
    return true;
}

static void binary_i64(mn_op op, BINARY_ARGS)
{
    if (binary_i64_exact(op, n, o, os, a, as, b, bs)) return;
    bool unit = os == 8 && as == 8 && bs == 8;
    switch (op) {
#define MN_BINARY(name, meta, doc) case MN_OP_##name: BINARY_LINE(int64_t, mn_to_i64, mn_op_##name) break;
#include "ops.def"
    default: break;
    }
}

static mn_status cpu_binary(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[3] = {out, a, b};
    MN_TRY(check_cpu("binary", 3, t));
    MN_TRY(check_dtypes("binary", 3, t));
    line_iter it;
    char *p[3];
    iter_tensors(&it, 3, t);
    int64_t n = iter_len(&it), os = iter_step(&it, 0), as = iter_step(&it, 1), bs = iter_step(&it, 2);
    while (iter_next(&it, p)) {
        switch (out->dtype) {
        case MN_F32: binary_f32(op, n, p[0], os, p[1], as, p[2], bs); break;
        case MN_F64: binary_f64(op, n, p[0], os, p[1], as, p[2], bs); break;
        case MN_I64: binary_i64(op, n, p[0], os, p[1], as, p[2], bs); break;
        }
    }
    return MN_OK;
}

/* ---- where: the selected value is moved as bits, so only its size matters ---- */

#define WHERE_LINE(TV, TC)                                                     \
    for (int64_t i = 0; i < n; i++)                                            \
        *(TV *)(po + i * os) = *(const TC *)(pc + i * cs) != 0 ? *(const TV *)(pa + i * as) \
                                                                : *(const TV *)(pb + i * bs);

static mn_status cpu_where(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[4] = {out, a, b, c};
    MN_TRY(check_cpu("where", 4, t));
    MN_TRY(check_dtypes("where", 3, t));
    line_iter it;
    char *p[4];
    iter_tensors(&it, 4, t);
    int64_t n = iter_len(&it), os = iter_step(&it, 0), as = iter_step(&it, 1), bs = iter_step(&it, 2),
            cs = iter_step(&it, 3);
    bool wide = mn_dtype_size(out->dtype) == 8;
    while (iter_next(&it, p)) {
        char *po = p[0];
        const char *pa = p[1], *pb = p[2], *pc = p[3];
        switch (c->dtype) {
        case MN_F32: if (wide) { WHERE_LINE(uint64_t, float) } else { WHERE_LINE(uint32_t, float) } break;
        case MN_F64: if (wide) { WHERE_LINE(uint64_t, double) } else { WHERE_LINE(uint32_t, double) } break;
        case MN_I64: if (wide) { WHERE_LINE(uint64_t, int64_t) } else { WHERE_LINE(uint32_t, int64_t) } break;
        }
    }
    return MN_OK;
}

/* ---- copy and fill ---- */

#define COPY_LINE(TD, TS, CONV)                                                \
    if (unit) {                                                                \
        TD *restrict pd = (TD *)d;                                             \
        const TS *restrict ps = (const TS *)s;                                 \
        for (int64_t i = 0; i < n; i++) pd[i] = CONV(ps[i]);                   \
    } else {                                                                   \
        for (int64_t i = 0; i < n; i++) *(TD *)(d + i * ds) = CONV(*(const TS *)(s + i * ss)); \
    }

#define KEEP(x) (x)
#define TO_I64(x) mn_to_i64((double)(x))

static void copy_line(mn_dtype dd, mn_dtype sd, int64_t n, char *d, int64_t ds, const char *s, int64_t ss)
{
    int64_t dsz = (int64_t)mn_dtype_size(dd), ssz = (int64_t)mn_dtype_size(sd);
    bool unit = ds == dsz && ss == ssz;
    if (dd == sd && unit) {
        memcpy(d, s, (size_t)(n * dsz));
        return;
    }
    switch (dd * 3 + sd) {
    case MN_F32 * 3 + MN_F32: COPY_LINE(float, float, KEEP) break;
    case MN_F32 * 3 + MN_F64: COPY_LINE(float, double, AS_F32) break;
    case MN_F32 * 3 + MN_I64: COPY_LINE(float, int64_t, AS_F32) break;
    case MN_F64 * 3 + MN_F32: COPY_LINE(double, float, AS_F64) break;
    case MN_F64 * 3 + MN_F64: COPY_LINE(double, double, KEEP) break;
    case MN_F64 * 3 + MN_I64: COPY_LINE(double, int64_t, AS_F64) break;
    case MN_I64 * 3 + MN_F32: COPY_LINE(int64_t, float, TO_I64) break;
    case MN_I64 * 3 + MN_F64: COPY_LINE(int64_t, double, TO_I64) break;
    case MN_I64 * 3 + MN_I64: COPY_LINE(int64_t, int64_t, KEEP) break;
    }
}

static mn_status cpu_copy(mn_tensor *dst, const mn_tensor *src)
{
    const mn_tensor *t[2] = {dst, src};
    MN_TRY(check_cpu("copy", 2, t));
    line_iter it;
    char *p[2];
    iter_tensors(&it, 2, t);
    int64_t n = iter_len(&it), ds = iter_step(&it, 0), ss = iter_step(&it, 1);
    while (iter_next(&it, p)) copy_line(dst->dtype, src->dtype, n, p[0], ds, p[1], ss);
    return MN_OK;
}

#define FILL_LINE(T, v)                                                        \
    if (unit) { T *pd = (T *)d; for (int64_t i = 0; i < n; i++) pd[i] = (v); } \
    else for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = (v);

static mn_status cpu_fill(mn_tensor *dst, double value)
{
    const mn_tensor *t[1] = {dst};
    MN_TRY(check_cpu("fill", 1, t));
    line_iter it;
    char *p[1];
    iter_tensors(&it, 1, t);
    int64_t n = iter_len(&it), ds = iter_step(&it, 0);
    bool unit = ds == (int64_t)mn_dtype_size(dst->dtype);
    /* All three dtypes store +0 as zero bytes. */
    bool zero = value == 0 && !signbit(value);
    float f = (float)value;
    int64_t iv = mn_to_i64(value);
    while (iter_next(&it, p)) {
        char *d = p[0];
        if (zero && unit) {
            memset(d, 0, (size_t)(n * ds));
            continue;
        }
        switch (dst->dtype) {
        case MN_F32: FILL_LINE(float, f) break;
        case MN_F64: FILL_LINE(double, value) break;
        case MN_I64: FILL_LINE(int64_t, iv) break;
        }
    }
    return MN_OK;
}

/* ---- reductions ---- */

/* Partial results that combine across runs: sum for sum and mean, sum of
 * squares for norm, product, or the running max / min (NaN sticks). */
#define RUN_LOOP(T, BODY)                                                      \
    do {                                                                       \
        const T *x = (const T *)p;                                             \
        int64_t s = st / (int64_t)sizeof(T);                                   \
        if (s == 1) { for (int64_t i = 0; i < n; i++) { double v = (double)x[i]; BODY; } } \
        else { for (int64_t i = 0; i < n; i++) { double v = (double)x[i * s]; BODY; } } \
    } while (0)

#define DEFINE_RUN(SUF, T)                                                     \
    static double run_##SUF(mn_op op, const char *p, int64_t n, int64_t st)   \
    {                                                                          \
        double acc;                                                            \
        switch (op) {                                                          \
        case MN_OP_sum: case MN_OP_mean:                                       \
            acc = 0; RUN_LOOP(T, acc += v); return acc;                        \
        case MN_OP_norm:                                                       \
            acc = 0; RUN_LOOP(T, acc += v * v); return acc;                    \
        case MN_OP_prod:                                                       \
            acc = 1; RUN_LOOP(T, acc *= v); return acc;                        \
        case MN_OP_max:                                                        \
            acc = -INFINITY; RUN_LOOP(T, if (v != v) return v; if (v > acc) acc = v); return acc; \
        case MN_OP_min:                                                        \
            acc = INFINITY; RUN_LOOP(T, if (v != v) return v; if (v < acc) acc = v); return acc; \
        default: return NAN;                                                   \
        }                                                                      \
    }

DEFINE_RUN(f32, float)
DEFINE_RUN(f64, double)
DEFINE_RUN(i64, int64_t)

static double run(mn_op op, mn_dtype dt, const char *p, int64_t n, int64_t st)
{
    switch (dt) {
    case MN_F32: return run_f32(op, p, n, st);
    case MN_F64: return run_f64(op, p, n, st);
    case MN_I64: return run_i64(op, p, n, st);
    }
    return NAN;
}

static double combine(mn_op op, double acc, double part)
{
    switch (op) {
    case MN_OP_prod: return acc * part;
    case MN_OP_max: return mn_op_maximum(acc, part);
    case MN_OP_min: return mn_op_minimum(acc, part);
    default: return acc + part;
    }
}

static double identity(mn_op op)
{
    return op == MN_OP_prod ? 1.0 : op == MN_OP_max ? -INFINITY : op == MN_OP_min ? INFINITY : 0.0;
}

static double finish(mn_op op, double acc, int64_t n)
{
    if (op == MN_OP_mean) return acc / (double)n;
    if (op == MN_OP_norm) return sqrt(acc);
    if ((op == MN_OP_max || op == MN_OP_min) && n == 0) return NAN;
    return acc;
}

/* i64 sums, products, max and min stay in integers (wrapping as torch does);
 * a double accumulator would round past 2^53. */
static int64_t run_i64_exact(mn_op op, const char *p, int64_t n, int64_t st)
{
    const int64_t *x = (const int64_t *)p;
    int64_t s = st / 8;
    uint64_t acc = op == MN_OP_prod ? 1 : 0;
    int64_t best = n > 0 ? x[0] : 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = x[i * s];
        switch (op) {
        case MN_OP_sum: acc += (uint64_t)v; break;
        case MN_OP_prod: acc *= (uint64_t)v; break;
        case MN_OP_max: if (v > best) best = v; break;
        case MN_OP_min: if (v < best) best = v; break;
        default: break;
        }
    }
    return op == MN_OP_max || op == MN_OP_min ? best : (int64_t)acc;
}

static void store(mn_dtype dt, char *p, double v)
{
    switch (dt) {
    case MN_F32: *(float *)p = (float)v; break;
    case MN_F64: *(double *)p = v; break;
    case MN_I64: *(int64_t *)p = mn_to_i64(v); break;
    }
}

static mn_status cpu_reduce_all(mn_op op, const mn_tensor *a, double *result)
{
    const mn_tensor *t[1] = {a};
    MN_TRY(check_cpu("reduce", 1, t));
    line_iter it;
    char *p[1];
    iter_tensors(&it, 1, t);
    int64_t n = iter_len(&it), st = iter_step(&it, 0);
    double acc = identity(op);
    while (iter_next(&it, p)) {
        acc = combine(op, acc, run(op, a->dtype, p[0], n, st));
        if (acc != acc) break; /* NaN: nothing can change it */
    }
    *result = finish(op, acc, mn_tensor_numel(a));
    return MN_OK;
}

/* a without dim d: the shape and strides of one output element's position. */
static void drop_dim(const mn_tensor *a, int d, mn_tensor *v)
{
    *v = *a;
    for (int i = d; i < a->ndim - 1; i++) {
        v->shape[i] = a->shape[i + 1];
        v->stride[i] = a->stride[i + 1];
    }
    v->ndim = a->ndim - 1;
}

/* Reducing along a dim that is not the innermost, when a line of outputs
 * lies at consecutive elements of a: walk the reduced dim outside and the
 * line inside, accumulating in doubles, so memory is read in order rather
 * than with the reduced dim's large stride. */
#define ACC_ROWS(T)                                                            \
    for (int64_t l = 0; l < len; l++) {                                        \
        const T *restrict x = (const T *)(src + l * rs);                       \
        switch (op) {                                                          \
        case MN_OP_sum: case MN_OP_mean: for (int64_t i = 0; i < n; i++) acc[i] += (double)x[i]; break; \
        case MN_OP_norm: for (int64_t i = 0; i < n; i++) acc[i] += (double)x[i] * (double)x[i]; break; \
        case MN_OP_prod: for (int64_t i = 0; i < n; i++) acc[i] *= (double)x[i]; break; \
        case MN_OP_max: for (int64_t i = 0; i < n; i++) acc[i] = mn_op_maximum(acc[i], (double)x[i]); break; \
        case MN_OP_min: for (int64_t i = 0; i < n; i++) acc[i] = mn_op_minimum(acc[i], (double)x[i]); break; \
        default: break;                                                        \
        }                                                                      \
    }

static void reduce_rows(mn_op op, mn_dtype dt, double *restrict acc, const char *src, int64_t n, int64_t len,
                        int64_t rs)
{
    for (int64_t i = 0; i < n; i++) acc[i] = identity(op);
    switch (dt) {
    case MN_F32: ACC_ROWS(float) break;
    case MN_F64: ACC_ROWS(double) break;
    case MN_I64: ACC_ROWS(int64_t) break;
    }
}

/* Walks out and a-without-d together; each output element reduces the run of
 * len elements of a along d. For a contiguous a reduced along its last dim,
 * the walk is one line and each run is unit-stride. */
static mn_status cpu_reduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int d)
{
    mn_tensor rest;
    drop_dim(a, d, &rest);
    const mn_tensor *t[2] = {out, &rest};
    MN_TRY(check_cpu("reduce", 2, t));
    line_iter it;
    char *p[2];
    iter_tensors(&it, 2, t);
    int64_t n = iter_len(&it), os = iter_step(&it, 0), as = iter_step(&it, 1);
    int64_t esize = (int64_t)mn_dtype_size(a->dtype), len = a->shape[d], rs = a->stride[d] * esize;
    bool exact = out->dtype == MN_I64 && a->dtype == MN_I64 &&
                 (op == MN_OP_sum || op == MN_OP_prod || op == MN_OP_max || op == MN_OP_min);
    double *acc = NULL;
    if (!exact && len > 1 && rs != esize && as == esize && n > 1) {
        acc = mn_malloc((size_t)n * sizeof *acc, "reduction accumulators");
        if (!acc) return MN_ERR_OOM;
    }
    while (iter_next(&it, p)) {
        if (acc) {
            reduce_rows(op, a->dtype, acc, p[1], n, len, rs);
            for (int64_t i = 0; i < n; i++) store(out->dtype, p[0] + i * os, finish(op, acc[i], len));
            continue;
        }
        for (int64_t i = 0; i < n; i++) {
            char *o = p[0] + i * os;
            const char *src = p[1] + i * as;
            if (exact) *(int64_t *)o = run_i64_exact(op, src, len, rs);
            else store(out->dtype, o, finish(op, len ? run(op, a->dtype, src, len, rs) : identity(op), len));
        }
    }
    free(acc);
    return MN_OK;
}

/* First index of the max (min); a NaN counts as larger (smaller) than
 * everything, as in torch, so the first NaN wins. */
#define DEFINE_ARG(SUF, T)                                                     \
    static int64_t arg_##SUF(bool want_max, const char *p, int64_t n, int64_t st) \
    {                                                                          \
        const T *x = (const T *)p;                                             \
        int64_t s = st / (int64_t)sizeof(T), best = 0;                         \
        T bv = x[0];                                                           \
        if (bv != bv) return 0;                                                \
        for (int64_t i = 1; i < n; i++) {                                      \
            T v = x[i * s];                                                    \
            if (v != v) return i;                                              \
            if (want_max ? v > bv : v < bv) { bv = v; best = i; }              \
        }                                                                      \
        return best;                                                           \
    }

DEFINE_ARG(f32, float)
DEFINE_ARG(f64, double)
DEFINE_ARG(i64, int64_t)

static mn_status cpu_argreduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int d)
{
    if (out->dtype != MN_I64) return mn_fail(MN_ERR_ARG, "cpu argreduce: output must be i64");
    mn_tensor rest;
    drop_dim(a, d, &rest);
    const mn_tensor *t[2] = {out, &rest};
    MN_TRY(check_cpu("argreduce", 2, t));
    int64_t len = a->shape[d], rs = a->stride[d] * (int64_t)mn_dtype_size(a->dtype);
    if (len == 0) return mn_tensor_numel(out) ? mn_fail(MN_ERR_ARG, "cpu argreduce: empty dim") : MN_OK;
    line_iter it;
    char *p[2];
    iter_tensors(&it, 2, t);
    int64_t n = iter_len(&it), os = iter_step(&it, 0), as = iter_step(&it, 1);
    bool want_max = op == MN_OP_max;
    while (iter_next(&it, p)) {
        for (int64_t i = 0; i < n; i++) {
            const char *src = p[1] + i * as;
            int64_t r = 0;
            switch (a->dtype) {
            case MN_F32: r = arg_f32(want_max, src, len, rs); break;
            case MN_F64: r = arg_f64(want_max, src, len, rs); break;
            case MN_I64: r = arg_i64(want_max, src, len, rs); break;
            }
            *(int64_t *)(p[0] + i * os) = r;
        }
    }
    return MN_OK;
}

/* ---- matmul ---- */

/* How BLAS can read one [rows, cols] matrix of a batch with these strides
 * (in elements): row-major (no transpose) or column-major (transpose), each
 * with its leading dimension; false when neither fits and a copy is needed. */
static bool blas_layout(const mn_tensor *t, enum CBLAS_TRANSPOSE *trans, int64_t *ld)
{
    int64_t rows = t->shape[1], cols = t->shape[2], rs = t->stride[1], cs = t->stride[2];
    int64_t mincols = cols > 1 ? cols : 1, minrows = rows > 1 ? rows : 1;
    if ((cols == 1 || cs == 1) && (rows == 1 || rs >= mincols)) {
        *trans = CblasNoTrans;
        *ld = rows == 1 ? mincols : rs;
        return true;
    }
    if ((rows == 1 || rs == 1) && (cols == 1 || cs >= minrows)) {
        *trans = CblasTrans;
        *ld = cols == 1 ? minrows : cs;
        return true;
    }
    return false;
}

static mn_status matmul_i64(mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    int64_t batch = out->shape[0], m = out->shape[1], n = out->shape[2], k = a->shape[2];
    const int64_t *pa = mn_tensor_data(a), *pb = mn_tensor_data(b);
    int64_t *pc = mn_tensor_data(out);
    for (int64_t q = 0; q < batch; q++) {
        MN_TRY(mn_check_interrupt());
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                uint64_t acc = 0; /* wraps instead of overflowing */
                for (int64_t l = 0; l < k; l++)
                    acc += (uint64_t)pa[q * a->stride[0] + i * a->stride[1] + l * a->stride[2]] *
                           (uint64_t)pb[q * b->stride[0] + l * b->stride[1] + j * b->stride[2]];
                pc[(q * m + i) * n + j] = (int64_t)acc;
            }
    }
    return MN_OK;
}

static mn_status cpu_matmul(mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[3] = {out, a, b};
    MN_TRY(check_dtypes("matmul", 3, t));
    for (int i = 0; i < 3; i++)
        if (t[i]->ndim != 3 || t[i]->storage->device != MN_CPU)
            return mn_fail(MN_ERR_ARG, "cpu matmul: operands must be 3-d cpu tensors");
    int64_t batch = out->shape[0], m = out->shape[1], n = out->shape[2], k = a->shape[2];
    if (a->shape[0] != batch || b->shape[0] != batch || a->shape[1] != m || b->shape[1] != k ||
        b->shape[2] != n || !mn_tensor_is_contiguous(out))
        return mn_fail(MN_ERR_ARG, "cpu matmul: operand shapes do not fit");
    if (batch == 0 || m == 0 || n == 0) return MN_OK;
    if (k == 0) return cpu_fill(out, 0.0);
    if (out->dtype == MN_I64) return matmul_i64(out, a, b);

    mn_tensor ca = {0}, cb = {0};
    enum CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
    int64_t lda = 1, ldb = 1;
    mn_status st = MN_OK;
    const mn_tensor *A = a, *B = b;
    if (!blas_layout(A, &ta, &lda)) {
        if ((st = mn_tensor_clone(&ca, a)) != MN_OK) goto done;
        A = &ca;
        blas_layout(A, &ta, &lda);
    }
    if (!blas_layout(B, &tb, &ldb)) {
        if ((st = mn_tensor_clone(&cb, b)) != MN_OK) goto done;
        B = &cb;
        blas_layout(B, &tb, &ldb);
    }
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX) {
        st = mn_fail(MN_ERR_UNSUPPORTED, "matmul: %lldx%lld @ %lldx%lld is too large for BLAS",
                     (long long)m, (long long)k, (long long)k, (long long)n);
        goto done;
    }
    size_t esz = mn_dtype_size(out->dtype);
    char *pa = mn_tensor_data(A), *pb = mn_tensor_data(B), *pc = mn_tensor_data(out);
    for (int64_t q = 0; q < batch; q++) {
        if ((st = mn_check_interrupt()) != MN_OK) goto done;
        char *qa = pa + q * A->stride[0] * (int64_t)esz, *qb = pb + q * B->stride[0] * (int64_t)esz;
        char *qc = pc + q * m * n * (int64_t)esz;
        if (out->dtype == MN_F32)
            cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0f, (const float *)qa, (int)lda,
                        (const float *)qb, (int)ldb, 0.0f, (float *)qc, (int)n);
        else
            cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0, (const double *)qa, (int)lda,
                        (const double *)qb, (int)ldb, 0.0, (double *)qc, (int)n);
    }
done:
    mn_tensor_release(&ca);
    mn_tensor_release(&cb);
    return st;
}

/* tile_many (ops.h): the same loop as the CUDA kernel's, so that the CPU
 * engine's state is laid in as a device's is (tests/unit/test_engine.c) */
static mn_status cpu_tile_many(int n, mn_tensor *const *dst, const mn_tensor *const *src)
{
    MN_TRY(mn_tile_many_check(n, dst, src));
    for (int i = 0; i < n; i++) {
        float *d = mn_tensor_data(dst[i]);
        const float *s = mn_tensor_data(src[i]);
        const int64_t dn = mn_tensor_numel(dst[i]), sn = mn_tensor_numel(src[i]);
        if (sn == 1)
            for (int64_t e = 0; e < dn; e++) d[e] = s[0];
        else
            for (int64_t at = 0; at < dn; at += sn) memcpy(d + at, s, sizeof(float) * (size_t)sn);
    }
    return MN_OK;
}

static const mn_backend cpu_backend = {
    .name = "cpu",
    .unary = cpu_unary,
    .binary = cpu_binary,
    .where = cpu_where,
    .reduce_dim = cpu_reduce_dim,
    .argreduce_dim = cpu_argreduce_dim,
    .reduce_all = cpu_reduce_all,
    .matmul = cpu_matmul,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .tile_many = cpu_tile_many,
};

const mn_backend *mn_cpu_backend(void) { return &cpu_backend; }
