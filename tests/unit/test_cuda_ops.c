/* test_cuda_ops.c: the CUDA backend against the CPU backend. Every op of
 * ops.def on random inputs (with NaN, infinities, zeros and halves mixed in),
 * each dtype, contiguous, strided and broadcast operands; where; whole-tensor
 * and per-dim reductions, argmax/argmin; matmul; copies between the devices
 * with dtype conversion; tile_many's copies and fills in one launch; the
 * caching allocator (reuse, out of memory);
 * pending asynchronous errors. Tolerances: f64 1e-12 and f32 1e-6 relative
 * per element (both backends evaluate op_math.h in double), reductions 1e-9
 * (double accumulation on both), matmul relative L2 error f32 1e-5, f64
 * 1e-12; i64 exact. Without a GPU (or a CUDA build) every GPU check is
 * reported SKIP, and the machine's CPU path and the clear "cuda: <reason>"
 * error are checked instead. */
#include "check.h"
#include "engine.h"
#include "ops.h"
#include "random.h"
#include "rownorm.h"
#ifdef MN_HAVE_CUDA
#include "../../kernels/cuda.h"
#endif

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The inputs each op is tried on: uniform in [lo, hi), plus specials. */
typedef struct { mn_op op; double lo, hi; } op_case;
static const op_case op_cases[] = {
    {MN_OP_neg, -4, 4}, {MN_OP_exp, -90, 90}, {MN_OP_log, -1, 10}, {MN_OP_sqrt, -1, 10},
    {MN_OP_abs, -4, 4}, {MN_OP_tanh, -6, 6}, {MN_OP_sigmoid, -40, 40}, {MN_OP_silu, -10, 10},
    {MN_OP_gelu, -6, 6}, {MN_OP_relu, -4, 4}, {MN_OP_softplus, -40, 40}, {MN_OP_sign, -4, 4},
    {MN_OP_floor, -4, 4}, {MN_OP_round, -4, 4}, {MN_OP_isnan, -4, 4}, {MN_OP_isfinite, -4, 4},
    {MN_OP_add, -4, 4}, {MN_OP_sub, -4, 4}, {MN_OP_mul, -4, 4}, {MN_OP_div, -4, 4},
    {MN_OP_pow, -3, 3}, {MN_OP_maximum, -4, 4}, {MN_OP_minimum, -4, 4}, {MN_OP_lt, -2, 2},
    {MN_OP_le, -2, 2}, {MN_OP_gt, -2, 2}, {MN_OP_ge, -2, 2}, {MN_OP_eq, -2, 2}, {MN_OP_ne, -2, 2},
    {MN_OP_sum, -1, 1}, {MN_OP_mean, -1, 1}, {MN_OP_max, -1, 1}, {MN_OP_min, -1, 1},
    {MN_OP_norm, -1, 1}, {MN_OP_prod, 0.9, 1.1},
};

static const op_case *case_of(mn_op op)
{
    for (int i = 0; i < COUNT(op_cases); i++)
        if (op_cases[i].op == op) return &op_cases[i];
    return NULL;
}

/* Runs everywhere: an op added to ops.def without a case here fails. */
static void test_coverage(void)
{
    static const struct { const char *name; mn_op op; } all[] = {
#define MN_UNARY(name, doc) {#name, MN_OP_##name},
#define MN_BINARY(name, meta, doc) {#name, MN_OP_##name},
#define MN_REDUCE(name, doc) {#name, MN_OP_##name},
#include "ops.def"
    };
    for (int i = 0; i < COUNT(all); i++) {
        char name[96];
        snprintf(name, sizeof name, "cuda_ops/%s/has_case", all[i].name);
        CHECK(name, case_of(all[i].op) != NULL);
    }
}

#ifndef MN_HAVE_CUDA

int main(void)
{
    test_coverage();
    SKIP("cuda_ops/all", "this build has no CUDA (nvcc was not found)");
    return CHECK_DONE();
}

#else

static mn_rng rng;

/* A failed setup step is a failure of the test, not a crash. */
static void must(mn_status st, const char *what)
{
    if (st == MN_OK) return;
    printf("FAIL cuda_ops/setup: %s: %s\n", what, mn_last_error());
    exit(1);
}

static const double specials[] = {0.0, -0.0, NAN, INFINITY, -INFINITY, 0.5, -2.5, 1e30, -1e-30, 1.0};

/* A CPU tensor uniform in [lo, hi), every 7th element a special (floats). */
static mn_tensor rand_cpu(mn_dtype dt, int ndim, const int64_t *shape, double lo, double hi, bool with_specials)
{
    mn_tensor t = {0};
    must(mn_tensor_rand(&t, dt, ndim, shape, lo, hi, &rng), "rand");
    if (with_specials && dt != MN_I64) {
        int64_t n = mn_tensor_numel(&t);
        for (int64_t i = 0; i < n; i += 7) {
            double v = specials[(i / 7) % COUNT(specials)];
            if (dt == MN_F32) ((float *)mn_tensor_data(&t))[i] = (float)v;
            else ((double *)mn_tensor_data(&t))[i] = v;
        }
    }
    return t;
}

static mn_tensor to_dev(const mn_tensor *t, mn_device dev)
{
    mn_tensor o = {0};
    must(mn_tensor_to_device(&o, t, dev), "to_device");
    return o;
}

static mn_tensor transposed(const mn_tensor *t)
{
    mn_tensor o = {0};
    must(mn_view_transpose(&o, t, 0, t->ndim - 1), "transpose");
    return o;
}

static bool close_enough(double g, double w, double tol)
{
    if (isnan(w)) return isnan(g);
    if (isinf(w)) return g == w;
    return fabs(g - w) <= tol * fmax(1.0, fabs(w));
}

/* got (either device) equals want (cpu): dtype, shape, and every value. */
static void check_same(const char *name, const mn_tensor *got, const mn_tensor *want, double tol)
{
    if (!got->storage) {
        printf("FAIL %s: no result: %s\n", name, mn_last_error());
        check_failures_++;
        return;
    }
    char a[160], b[160];
    if (got->dtype != want->dtype || !mn_tensor_same_shape(got, want)) {
        printf("FAIL %s: %s %s, want %s %s\n", name, mn_dtype_name(got->dtype), mn_shape_string(got, a, sizeof a),
               mn_dtype_name(want->dtype), mn_shape_string(want, b, sizeof b));
        check_failures_++;
        return;
    }
    mn_tensor h = {0}, gc = {0}, wc = {0};
    must(mn_tensor_to_device(&h, got, MN_CPU), "download");
    must(mn_tensor_contiguous(&gc, &h), "contiguous");
    must(mn_tensor_contiguous(&wc, want), "contiguous");
    int64_t n = mn_tensor_numel(want), bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++) {
        bool ok;
        if (want->dtype == MN_I64) ok = ((int64_t *)mn_tensor_data(&gc))[i] == ((int64_t *)mn_tensor_data(&wc))[i];
        else if (want->dtype == MN_F32)
            ok = close_enough(((float *)mn_tensor_data(&gc))[i], ((float *)mn_tensor_data(&wc))[i], tol);
        else ok = close_enough(((double *)mn_tensor_data(&gc))[i], ((double *)mn_tensor_data(&wc))[i], tol);
        if (!ok) bad = i;
    }
    if (bad < 0) printf("PASS %s\n", name);
    else {
        int64_t i = bad;
        mn_tensor fg = {0}, fw = {0};
        int64_t m1 = -1;
        must(mn_view_reshape(&fg, &gc, 1, &m1), "reshape");
        must(mn_view_reshape(&fw, &wc, 1, &m1), "reshape");
        printf("FAIL %s: element %lld: got %.17g want %.17g\n", name, (long long)i, mn_tensor_get(&fg, &i),
               mn_tensor_get(&fw, &i));
        check_failures_++;
        mn_tensor_release(&fg);
        mn_tensor_release(&fw);
    }
    mn_tensor_release(&h);
    mn_tensor_release(&gc);
    mn_tensor_release(&wc);
}

static double tol_of(mn_dtype dt) { return dt == MN_F64 ? 1e-12 : 1e-6; }

/* ---- elementwise ---- */

static void test_unary(mn_op op, mn_dtype dt)
{
    const op_case *c = case_of(op);
    int64_t shape[2] = {70, 33};
    mn_tensor x = rand_cpu(dt, 2, shape, dt == MN_I64 ? -50 : c->lo, dt == MN_I64 ? 50 : c->hi, true);
    mn_tensor gx = to_dev(&x, MN_CUDA), xt = transposed(&x), gxt = transposed(&gx);
    mn_tensor want = {0}, got = {0}, want_t = {0}, got_t = {0};
    char name[128];
    must(mn_unary(op, &want, &x), "cpu unary");
    mn_unary(op, &got, &gx);
    snprintf(name, sizeof name, "cuda_ops/unary/%s/%s", mn_op_name(op), mn_dtype_name(dt));
    check_same(name, &got, &want, tol_of(want.dtype));
    must(mn_unary(op, &want_t, &xt), "cpu unary");
    mn_unary(op, &got_t, &gxt);
    snprintf(name, sizeof name, "cuda_ops/unary/%s/%s_strided", mn_op_name(op), mn_dtype_name(dt));
    check_same(name, &got_t, &want_t, tol_of(want.dtype));
    mn_tensor *all[] = {&x, &gx, &xt, &gxt, &want, &got, &want_t, &got_t};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

static void test_binary(mn_op op, mn_dtype dt)
{
    const op_case *c = case_of(op);
    double lo = dt == MN_I64 ? -6 : c->lo, hi = dt == MN_I64 ? 6 : c->hi;
    int64_t shape[2] = {70, 33}, row[1] = {70};
    mn_tensor a = rand_cpu(dt, 2, shape, lo, hi, true), b = rand_cpu(dt, 2, shape, lo, hi, true);
    mn_tensor r = rand_cpu(dt, 1, row, lo, hi, true);
    mn_tensor ga = to_dev(&a, MN_CUDA), gb = to_dev(&b, MN_CUDA), gr = to_dev(&r, MN_CUDA);
    mn_tensor at = transposed(&a), gat = transposed(&ga);
    mn_tensor w1 = {0}, g1 = {0}, w2 = {0}, g2 = {0}, w3 = {0}, g3 = {0}, w4 = {0}, g4 = {0};
    char name[128];
    const char *op_name = mn_op_name(op), *dn = mn_dtype_name(dt);
    must(mn_binary(op, &w1, &a, &b), "cpu binary");
    mn_binary(op, &g1, &ga, &gb);
    snprintf(name, sizeof name, "cuda_ops/binary/%s/%s", op_name, dn);
    check_same(name, &g1, &w1, tol_of(w1.dtype));
    /* a transposed view with a broadcast row (stride 0 along dim 0) */
    must(mn_binary(op, &w2, &at, &r), "cpu binary");
    mn_binary(op, &g2, &gat, &gr);
    snprintf(name, sizeof name, "cuda_ops/binary/%s/%s_strided_broadcast", op_name, dn);
    check_same(name, &g2, &w2, tol_of(w2.dtype));
    must(mn_binary_scalar(op, &w3, &a, 1.5, false), "cpu scalar");
    mn_binary_scalar(op, &g3, &ga, 1.5, false);
    snprintf(name, sizeof name, "cuda_ops/binary/%s/%s_scalar", op_name, dn);
    check_same(name, &g3, &w3, tol_of(w3.dtype));
    must(mn_binary_scalar(op, &w4, &at, -2.0, true), "cpu scalar");
    mn_binary_scalar(op, &g4, &gat, -2.0, true);
    snprintf(name, sizeof name, "cuda_ops/binary/%s/%s_scalar_first_strided", op_name, dn);
    check_same(name, &g4, &w4, tol_of(w4.dtype));
    mn_tensor *all[] = {&a, &b, &r, &ga, &gb, &gr, &at, &gat, &w1, &g1, &w2, &g2, &w3, &g3, &w4, &g4};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

static void test_elementwise(void)
{
    for (int op = 0; op < MN_OP_COUNT; op++) {
        if (!case_of(op)) continue;
        for (int dt = MN_F32; dt <= MN_I64; dt++) {
            if (mn_op_kind_of(op) == MN_OPKIND_UNARY) test_unary(op, dt);
            if (mn_op_kind_of(op) == MN_OPKIND_BINARY) test_binary(op, dt);
        }
    }
    /* Broadcasting both ways at once: [3,1,5] op [4,1] -> [3,4,5], and a 0-d operand. */
    int64_t s315[3] = {3, 1, 5}, s41[2] = {4, 1};
    mn_tensor a = rand_cpu(MN_F32, 3, s315, -2, 2, false), b = rand_cpu(MN_F64, 2, s41, -2, 2, false);
    mn_tensor s = {0}, gs = {0};
    must(mn_tensor_full(&s, MN_F32, 0, NULL, 0.25, MN_CPU), "full");
    must(mn_tensor_full(&gs, MN_F32, 0, NULL, 0.25, MN_CUDA), "full on cuda");
    mn_tensor ga = to_dev(&a, MN_CUDA), gb = to_dev(&b, MN_CUDA), w = {0}, g = {0}, w2 = {0}, g2 = {0};
    must(mn_binary(MN_OP_mul, &w, &a, &b), "cpu mul");
    mn_binary(MN_OP_mul, &g, &ga, &gb);
    check_same("cuda_ops/broadcast/both_sides_promoted", &g, &w, 1e-12);
    must(mn_binary(MN_OP_sub, &w2, &s, &a), "cpu sub");
    mn_binary(MN_OP_sub, &g2, &gs, &ga);
    check_same("cuda_ops/broadcast/scalar_tensor", &g2, &w2, 1e-6);
    mn_tensor *all[] = {&a, &b, &s, &gs, &ga, &gb, &w, &g, &w2, &g2};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

static void test_where(void)
{
    int64_t shape[2] = {40, 9}, col[2] = {40, 1};
    mn_tensor c = rand_cpu(MN_F64, 2, shape, -1, 1, true), a = rand_cpu(MN_F32, 2, shape, -5, 5, true);
    mn_tensor b = rand_cpu(MN_I64, 2, col, -5, 5, false);
    mn_tensor gc = to_dev(&c, MN_CUDA), ga = to_dev(&a, MN_CUDA), gb = to_dev(&b, MN_CUDA);
    mn_tensor w = {0}, g = {0};
    must(mn_where(&w, &c, &a, &b), "cpu where");
    mn_where(&g, &gc, &ga, &gb);
    check_same("cuda_ops/where/mixed_dtypes_broadcast", &g, &w, 0);
    mn_tensor ci = rand_cpu(MN_I64, 2, shape, 0, 2, false), gci = to_dev(&ci, MN_CUDA), w2 = {0}, g2 = {0};
    must(mn_where(&w2, &ci, &b, &b), "cpu where");
    mn_where(&g2, &gci, &gb, &gb);
    check_same("cuda_ops/where/i64", &g2, &w2, 0);
    mn_tensor *all[] = {&c, &a, &b, &gc, &ga, &gb, &w, &g, &ci, &gci, &w2, &g2};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

/* ---- reductions ---- */

static void test_reduce_all(void)
{
    int64_t shape[2] = {1000, 37}, small[2] = {20, 10};
    for (int op = 0; op < MN_OP_COUNT; op++) {
        if (mn_op_kind_of(op) != MN_OPKIND_REDUCE) continue;
        const op_case *c = case_of(op);
        for (int dt = MN_F32; dt <= MN_I64; dt++) {
            bool prod = op == MN_OP_prod;
            double lo = dt == MN_I64 ? (prod ? -2 : -1000) : c->lo, hi = dt == MN_I64 ? (prod ? 3 : 1000) : c->hi;
            mn_tensor x = rand_cpu(dt, 2, prod ? small : shape, lo, hi, false);
            mn_tensor gx = to_dev(&x, MN_CUDA), xt = transposed(&x), gxt = transposed(&gx);
            double w = 0, g = -12345, wt = 0, gt = -12345;
            must(mn_reduce_all(op, &x, &w), "cpu reduce");
            mn_status st = mn_reduce_all(op, &gx, &g);
            must(mn_reduce_all(op, &xt, &wt), "cpu reduce");
            mn_status st2 = mn_reduce_all(op, &gxt, &gt);
            char name[128];
            snprintf(name, sizeof name, "cuda_ops/reduce_all/%s/%s", mn_op_name(op), mn_dtype_name(dt));
            CHECK_NEAR(name, st == MN_OK ? g : NAN, w, 1e-9);
            snprintf(name, sizeof name, "cuda_ops/reduce_all/%s/%s_strided", mn_op_name(op), mn_dtype_name(dt));
            CHECK_NEAR(name, st2 == MN_OK ? gt : NAN, wt, 1e-9);
            mn_tensor *all[] = {&x, &gx, &xt, &gxt};
            for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
        }
    }
    /* NaN anywhere makes max, min and sum NaN. */
    int64_t n = 5000;
    mn_tensor x = rand_cpu(MN_F32, 1, &n, -1, 1, false);
    ((float *)mn_tensor_data(&x))[4321] = NAN;
    mn_tensor gx = to_dev(&x, MN_CUDA);
    double v = 0;
    CHECK("cuda_ops/reduce_all/max_nan", mn_reduce_all(MN_OP_max, &gx, &v) == MN_OK && isnan(v));
    CHECK("cuda_ops/reduce_all/min_nan", mn_reduce_all(MN_OP_min, &gx, &v) == MN_OK && isnan(v));
    CHECK("cuda_ops/reduce_all/sum_nan", mn_reduce_all(MN_OP_sum, &gx, &v) == MN_OK && isnan(v));
    mn_tensor_release(&x);
    mn_tensor_release(&gx);
}

static void test_reduce_dim(void)
{
    int64_t s3[3] = {13, 70, 9}, rows[2] = {40, 300};
    for (int op = 0; op < MN_OP_COUNT; op++) {
        if (mn_op_kind_of(op) != MN_OPKIND_REDUCE) continue;
        const op_case *c = case_of(op);
        for (int dt = MN_F32; dt <= MN_I64; dt++) {
            bool prod = op == MN_OP_prod;
            double lo = dt == MN_I64 ? (prod ? -2 : -1000) : c->lo, hi = dt == MN_I64 ? (prod ? 3 : 1000) : c->hi;
            mn_tensor x = rand_cpu(dt, 3, s3, lo, hi, false), y = rand_cpu(dt, 2, rows, lo, hi, false);
            mn_tensor gx = to_dev(&x, MN_CUDA), gy = to_dev(&y, MN_CUDA), xt = transposed(&x), gxt = transposed(&gx);
            char name[128];
            for (int d = 0; d < 3; d++) {
                mn_tensor w = {0}, g = {0}, wt = {0}, gt = {0};
                must(mn_reduce_dim(op, &w, &x, d, d == 1), "cpu reduce_dim");
                mn_reduce_dim(op, &g, &gx, d, d == 1);
                snprintf(name, sizeof name, "cuda_ops/reduce_dim/%s/%s_dim%d", mn_op_name(op), mn_dtype_name(dt), d);
                check_same(name, &g, &w, dt == MN_F64 ? 1e-12 : 1e-6);
                must(mn_reduce_dim(op, &wt, &xt, d, false), "cpu reduce_dim");
                mn_reduce_dim(op, &gt, &gxt, d, false);
                snprintf(name, sizeof name, "cuda_ops/reduce_dim/%s/%s_strided_dim%d", mn_op_name(op), mn_dtype_name(dt), d);
                check_same(name, &gt, &wt, dt == MN_F64 ? 1e-12 : 1e-6);
                mn_tensor *all[] = {&w, &g, &wt, &gt};
                for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
            }
            /* long unit-stride rows: one warp per output */
            mn_tensor w = {0}, g = {0};
            must(mn_reduce_dim(op, &w, &y, 1, false), "cpu reduce_dim");
            mn_reduce_dim(op, &g, &gy, -1, false);
            snprintf(name, sizeof name, "cuda_ops/reduce_dim/%s/%s_long_rows", mn_op_name(op), mn_dtype_name(dt));
            check_same(name, &g, &w, dt == MN_F64 ? 1e-12 : 1e-6);
            mn_tensor *all[] = {&x, &y, &gx, &gy, &xt, &gxt, &w, &g};
            for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
        }
    }
    /* A dim of size 0: sum 0, mean NaN, prod 1. */
    int64_t s30[2] = {3, 0};
    mn_tensor e = {0};
    must(mn_tensor_zeros(&e, MN_F32, 2, s30, MN_CUDA), "zeros on cuda");
    static const mn_op ops[3] = {MN_OP_sum, MN_OP_mean, MN_OP_prod};
    for (int i = 0; i < 3; i++) {
        mn_tensor ce = {0}, w = {0}, g = {0};
        must(mn_tensor_zeros(&ce, MN_F32, 2, s30, MN_CPU), "zeros");
        must(mn_reduce_dim(ops[i], &w, &ce, 1, false), "cpu reduce");
        mn_reduce_dim(ops[i], &g, &e, 1, false);
        char name[96];
        snprintf(name, sizeof name, "cuda_ops/reduce_dim/%s/empty_dim", mn_op_name(ops[i]));
        check_same(name, &g, &w, 0);
        mn_tensor_release(&ce);
        mn_tensor_release(&w);
        mn_tensor_release(&g);
    }
    mn_tensor_release(&e);
}

static void test_argreduce(void)
{
    int64_t s3[3] = {11, 80, 7};
    for (int dt = MN_F32; dt <= MN_I64; dt++) {
        /* i64 in [0, 4): many ties, so "first index" is tested */
        mn_tensor x = rand_cpu(dt, 3, s3, dt == MN_I64 ? 0 : -1, dt == MN_I64 ? 4 : 1, true);
        mn_tensor gx = to_dev(&x, MN_CUDA), xt = transposed(&x), gxt = transposed(&gx);
        for (int k = 0; k < 2; k++) {
            mn_op op = k ? MN_OP_min : MN_OP_max;
            for (int d = 0; d < 3; d++) {
                mn_tensor w = {0}, g = {0}, wt = {0}, gt = {0};
                char name[128];
                must(mn_argreduce_dim(op, &w, &x, d, false), "cpu argreduce");
                mn_argreduce_dim(op, &g, &gx, d, false);
                snprintf(name, sizeof name, "cuda_ops/arg%s/%s_dim%d", mn_op_name(op), mn_dtype_name(dt), d);
                check_same(name, &g, &w, 0);
                must(mn_argreduce_dim(op, &wt, &xt, d, true), "cpu argreduce");
                mn_argreduce_dim(op, &gt, &gxt, d, true);
                snprintf(name, sizeof name, "cuda_ops/arg%s/%s_strided_dim%d", mn_op_name(op), mn_dtype_name(dt), d);
                check_same(name, &gt, &wt, 0);
                mn_tensor *all[] = {&w, &g, &wt, &gt};
                for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
            }
        }
        mn_tensor *all[] = {&x, &gx, &xt, &gxt};
        for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
    }
}

/* ---- matmul ---- */

/* ||got - want|| / ||want|| (L2 over every element), got downloaded. */
static double rel_l2(const mn_tensor *got, const mn_tensor *want)
{
    if (!got->storage || !mn_tensor_same_shape(got, want) || got->dtype != want->dtype) return INFINITY;
    mn_tensor h = {0}, d = {0};
    must(mn_tensor_to_device(&h, got, MN_CPU), "download");
    double num = 0, den = 0, r = INFINITY;
    if (mn_binary(MN_OP_sub, &d, &h, want) == MN_OK && mn_reduce_all(MN_OP_norm, &d, &num) == MN_OK &&
        mn_reduce_all(MN_OP_norm, want, &den) == MN_OK)
        r = den > 0 ? num / den : num;
    mn_tensor_release(&h);
    mn_tensor_release(&d);
    return r;
}

static mn_tensor inner_t(const mn_tensor *t)
{
    mn_tensor o = {0};
    must(mn_view_transpose(&o, t, t->ndim - 2, t->ndim - 1), "transpose");
    return o;
}

static mn_tensor shared(const mn_tensor *t)
{
    mn_tensor o = {0};
    mn_tensor_share(&o, t);
    return o;
}

typedef struct { const char *name; int and_; int64_t as[4]; int bnd; int64_t bs[4]; int ta, tb; } mm_case;
static const mm_case mm_cases[] = {
    {"2d", 2, {64, 48}, 2, {48, 80}, 0, 0},
    {"batched", 3, {3, 17, 33}, 3, {3, 33, 9}, 0, 0},
    {"broadcast_batch", 4, {2, 1, 5, 7}, 3, {4, 7, 3}, 0, 0},
    {"a_transposed", 2, {48, 64}, 2, {48, 80}, 1, 0},
    {"b_transposed", 2, {64, 48}, 2, {80, 48}, 0, 1},
    {"both_transposed_batched", 3, {2, 33, 17}, 3, {2, 9, 33}, 1, 1},
    {"folded_batch", 3, {4, 6, 5}, 2, {5, 7}, 0, 0},
    {"vector_matrix", 1, {48}, 2, {48, 80}, 0, 0},
    {"dot", 1, {300}, 1, {300}, 0, 0},
    {"k_zero", 2, {5, 0}, 2, {0, 6}, 0, 0},
};

static void test_matmul(void)
{
    for (int k = 0; k < COUNT(mm_cases); k++) {
        const mm_case *c = &mm_cases[k];
        for (int dt = MN_F32; dt <= MN_I64; dt++) {
            double lo = dt == MN_I64 ? -20 : -1, hi = dt == MN_I64 ? 20 : 1;
            mn_tensor a = rand_cpu(dt, c->and_, c->as, lo, hi, false), b = rand_cpu(dt, c->bnd, c->bs, lo, hi, false);
            mn_tensor ga = to_dev(&a, MN_CUDA), gb = to_dev(&b, MN_CUDA);
            /* a "transposed" case stores the operand as its transpose and multiplies by a
             * view of it that swaps the last two dims back (column-major for cuBLAS) */
            mn_tensor A = c->ta ? inner_t(&a) : shared(&a), gA = c->ta ? inner_t(&ga) : shared(&ga);
            mn_tensor B = c->tb ? inner_t(&b) : shared(&b), gB = c->tb ? inner_t(&gb) : shared(&gb);
            mn_tensor w = {0}, g = {0};
            must(mn_matmul(&w, &A, &B), "cpu matmul");
            mn_matmul(&g, &gA, &gB);
            char name[128];
            snprintf(name, sizeof name, "cuda_ops/matmul/%s/%s", c->name, mn_dtype_name(dt));
            if (dt == MN_I64) check_same(name, &g, &w, 0);
            else {
                double r = rel_l2(&g, &w);
                if (r <= (dt == MN_F32 ? 1e-5 : 1e-12)) printf("PASS %s\n", name);
                else { printf("FAIL %s: relative L2 error %.3g (%s)\n", name, r, g.storage ? "" : mn_last_error()); check_failures_++; }
            }
            mn_tensor *all[] = {&a, &b, &ga, &gb, &A, &B, &gA, &gB, &w, &g};
            for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
        }
    }
    /* A product big enough for cuBLAS to tile (and to differ from a naive sum order). */
    int64_t sa[2] = {300, 500}, sb[2] = {500, 200};
    mn_tensor a = rand_cpu(MN_F32, 2, sa, -1, 1, false), b = rand_cpu(MN_F32, 2, sb, -1, 1, false);
    mn_tensor ga = to_dev(&a, MN_CUDA), gb = to_dev(&b, MN_CUDA), w = {0}, g = {0};
    must(mn_matmul(&w, &a, &b), "cpu matmul");
    mn_matmul(&g, &ga, &gb);
    double r = rel_l2(&g, &w);
    if (r <= 1e-5) printf("PASS cuda_ops/matmul/300x500x200/f32\n");
    else { printf("FAIL cuda_ops/matmul/300x500x200/f32: relative L2 error %.3g\n", r); check_failures_++; }
    mn_tensor *all[] = {&a, &b, &ga, &gb, &w, &g};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

/* ---- copies between devices, with dtype conversion ---- */

static void test_copies(void)
{
    int64_t shape[2] = {37, 21};
    for (int sd = MN_F32; sd <= MN_I64; sd++)
        for (int dd = MN_F32; dd <= MN_I64; dd++) {
            /* NaN and infinities converted to i64 go through mn_to_i64 on both sides */
            mn_tensor x = rand_cpu(sd, 2, shape, -1e3, 1e3, true);
            mn_tensor gx = to_dev(&x, MN_CUDA), want = {0}, gconv = {0};
            must(mn_tensor_to_dtype(&want, &x, dd), "cpu to_dtype");
            mn_tensor_to_dtype(&gconv, &gx, dd);
            char name[128];
            snprintf(name, sizeof name, "cuda_ops/copy/%s_to_%s/on_device", mn_dtype_name(sd), mn_dtype_name(dd));
            check_same(name, &gconv, &want, 0);
            /* host -> strided device view, converting */
            int64_t tshape[2] = {21, 37};
            mn_tensor gdst = {0}, gview = {0}, wdst = {0}, wview = {0};
            must(mn_tensor_zeros(&gdst, dd, 2, tshape, MN_CUDA), "zeros on cuda");
            must(mn_tensor_zeros(&wdst, dd, 2, tshape, MN_CPU), "zeros");
            gview = transposed(&gdst);
            wview = transposed(&wdst);
            mn_status st = mn_tensor_copy_into(&gview, &x);
            must(mn_tensor_copy_into(&wview, &x), "cpu copy_into");
            snprintf(name, sizeof name, "cuda_ops/copy/%s_to_%s/host_to_strided_device", mn_dtype_name(sd), mn_dtype_name(dd));
            if (st != MN_OK) { printf("FAIL %s: %s\n", name, mn_last_error()); check_failures_++; }
            else check_same(name, &gdst, &wdst, 0);
            /* strided device -> strided host, converting */
            mn_tensor hdst = {0}, hview = {0}, gxt = transposed(&gx), xt = transposed(&x), w2 = {0}, w2v = {0};
            must(mn_tensor_zeros(&hdst, dd, 2, shape, MN_CPU), "zeros");
            must(mn_tensor_zeros(&w2, dd, 2, shape, MN_CPU), "zeros");
            hview = transposed(&hdst);
            w2v = transposed(&w2);
            st = mn_tensor_copy_into(&hview, &gxt);
            must(mn_tensor_copy_into(&w2v, &xt), "cpu copy_into");
            snprintf(name, sizeof name, "cuda_ops/copy/%s_to_%s/strided_device_to_host", mn_dtype_name(sd), mn_dtype_name(dd));
            if (st != MN_OK) { printf("FAIL %s: %s\n", name, mn_last_error()); check_failures_++; }
            else check_same(name, &hdst, &w2, 0);
            mn_tensor *all[] = {&x, &gx, &want, &gconv, &gdst, &gview, &wdst, &wview, &hdst, &hview, &gxt, &xt, &w2, &w2v};
            for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
        }
    /* The plain round trip is bit-exact, and fill writes through strided views. */
    int64_t n[1] = {1000};
    mn_tensor x = rand_cpu(MN_F64, 1, n, -1, 1, true), g = to_dev(&x, MN_CUDA), back = to_dev(&g, MN_CPU);
    CHECK("cuda_ops/copy/round_trip_bitwise", memcmp(mn_tensor_data(&x), mn_tensor_data(&back), 8000) == 0);
    mn_tensor sl = {0}, hsl = {0};
    must(mn_view_slice(&sl, &g, 0, 1, 1000, 3), "slice");
    must(mn_view_slice(&hsl, &x, 0, 1, 1000, 3), "slice");
    must(mn_tensor_fill(&hsl, -7.5), "cpu fill");
    CHECK("cuda_ops/fill/strided", mn_tensor_fill(&sl, -7.5) == MN_OK);
    check_same("cuda_ops/fill/strided_values", &g, &x, 0);
    mn_tensor *all[] = {&x, &g, &back, &sl, &hsl};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

/* tile_many (ops.h): several copies and fills in one launch, against the
 * CPU backend's loops: a whole copy, a source repeated (its numel divides
 * the destination's, as an [H,...] initial weight fills [B,H,...]), a value
 * from the host (a gate given as a number), an empty destination; and the
 * refusal of a source that does not divide. */
static void test_tile_many(void)
{
    const mn_backend *gpu = mn_backend_for(MN_CUDA), *cpu = mn_cpu_backend();
    if (!gpu->tile_many || !cpu->tile_many) {
        CHECK("cuda_ops/tile_many: both backends have it", false);
        return;
    }
    int64_t whole[1] = {3000}, part[1] = {40}, one_shape[1] = {1}, none[1] = {0}, dst_n[1] = {120 * 40};
    mn_tensor src_full = rand_cpu(MN_F32, 1, whole, -1, 1, true), src_part = rand_cpu(MN_F32, 1, part, -1, 1, true);
    mn_tensor value = {0};
    must(mn_tensor_full(&value, MN_F32, 1, one_shape, -3.25, MN_CPU), "full");
    mn_tensor g_full = to_dev(&src_full, MN_CUDA), g_part = to_dev(&src_part, MN_CUDA);
    mn_tensor cd[4] = {{0}}, gd[4] = {{0}};
    const int64_t *shapes[4] = {whole, dst_n, dst_n, none};
    for (int i = 0; i < 4; i++) {
        must(mn_tensor_zeros(&cd[i], MN_F32, 1, shapes[i], MN_CPU), "zeros");
        must(mn_tensor_full(&gd[i], MN_F32, 1, shapes[i], 9.0, MN_CUDA), "full on cuda");
    }
    mn_tensor *cdst[4] = {&cd[0], &cd[1], &cd[2], &cd[3]}, *gdst[4] = {&gd[0], &gd[1], &gd[2], &gd[3]};
    const mn_tensor *csrc[4] = {&src_full, &src_part, &value, &src_part}, *gsrc[4] = {&g_full, &g_part, &value, &g_part};
    must(cpu->tile_many(4, cdst, csrc), "cpu tile_many");
    CHECK("cuda_ops/tile_many: runs", gpu->tile_many(4, gdst, gsrc) == MN_OK);
    check_same("cuda_ops/tile_many/whole", &gd[0], &cd[0], 0);
    check_same("cuda_ops/tile_many/repeated", &gd[1], &cd[1], 0);
    check_same("cuda_ops/tile_many/value", &gd[2], &cd[2], 0);
    CHECK("cuda_ops/tile_many/repeated: element 40 * 7 + 5 is the source's 5",
          ((const float *)mn_tensor_data(&cd[1]))[40 * 7 + 5] == ((const float *)mn_tensor_data(&src_part))[5]);
    mn_tensor *bad_dst[1] = {&gd[1]};
    const mn_tensor *bad_src[1] = {&g_full}; /* 3000 does not divide 4800 */
    CHECK("cuda_ops/tile_many: a source that does not divide is refused",
          gpu->tile_many(1, bad_dst, bad_src) == MN_ERR_ARG && strstr(mn_last_error(), "dividing") != NULL);
    mn_tensor *all[] = {&src_full, &src_part, &value, &g_full, &g_part};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
    for (int i = 0; i < 4; i++) {
        mn_tensor_release(&cd[i]);
        mn_tensor_release(&gd[i]);
    }
}

/* ---- the allocator ---- */

static void test_allocator(void)
{
    mn_cuda_memory_stats s0, s1, s2;
    must(mn_cuda_memory(&s0), "memory");
    int64_t n = 12345;
    for (int i = 0; i < 5; i++) {
        mn_tensor t = {0};
        must(mn_tensor_empty(&t, MN_F32, 1, &n, MN_CUDA), "empty on cuda");
        mn_tensor_release(&t);
    }
    must(mn_cuda_memory(&s1), "memory");
    CHECK("cuda_ops/alloc/cache_hits_grow", s1.cache_hits >= s0.cache_hits + 4);
    CHECK("cuda_ops/alloc/calls_counted", s1.alloc_calls == s0.alloc_calls + 5);
    CHECK("cuda_ops/alloc/nothing_held", s1.allocated == s0.allocated);
    CHECK("cuda_ops/alloc/cached_kept", s1.cached >= 49664 && s1.peak_allocated >= s1.allocated);
    CHECK("cuda_ops/alloc/device_sizes", s1.device_total > 0 && s1.device_free <= s1.device_total);
    CHECK("cuda_ops/alloc/empty_cache", mn_cuda_empty_cache() == MN_OK);
    must(mn_cuda_memory(&s2), "memory");
    CHECK("cuda_ops/alloc/cache_emptied", s2.cached == 0 && s2.allocated == s1.allocated);

    /* Out of memory: a clean error, nothing held, and the next request works. */
    int64_t huge = (int64_t)1 << 45; /* 128 TiB of f32 */
    mn_tensor t = {0};
    mn_status st = mn_tensor_empty(&t, MN_F32, 1, &huge, MN_CUDA);
    CHECK("cuda_ops/oom/status", st == MN_ERR_OOM && t.storage == NULL);
    CHECK_STR_CONTAINS("cuda_ops/oom/message", mn_last_error(), "cuda: out of memory allocating 140737488355328 bytes (allocated");
    mn_cuda_memory_stats s3;
    must(mn_cuda_memory(&s3), "memory");
    CHECK("cuda_ops/oom/nothing_leaked", s3.allocated == s2.allocated);
    CHECK("cuda_ops/oom/no_pending_error", mn_cuda_check_pending() == MN_OK);
    int64_t m = 1000;
    CHECK("cuda_ops/oom/later_allocations_work", mn_tensor_zeros(&t, MN_F32, 1, &m, MN_CUDA) == MN_OK);
    mn_tensor_release(&t);
}

/* Last: a write far outside any allocation faults on the device after the
 * launch returned; check_pending must report it (the context is lost after). */
static void test_pending_fault(void)
{
    CHECK("cuda_ops/pending/none_after_good_work", mn_cuda_check_pending() == MN_OK && mn_cuda_synchronize() == MN_OK);
    int64_t n = 4;
    mn_tensor t = {0}, bad = {0};
    must(mn_tensor_zeros(&t, MN_F32, 1, &n, MN_CUDA), "zeros on cuda");
    mn_tensor_share(&bad, &t);
    bad.offset = (int64_t)1 << 42;
    bad.stride[0] = 3; /* strided: a kernel, not cudaMemset */
    mn_status launch = mn_tensor_fill(&bad, 1.0);
    mn_status st = MN_OK;
    for (int i = 0; i < 500 && st == MN_OK; i++) {
        st = mn_cuda_check_pending();
        if (st == MN_OK) nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    CHECK("cuda_ops/pending/launch_returns", launch == MN_OK);
    CHECK("cuda_ops/pending/fault_reported", st == MN_ERR_DEVICE);
    CHECK_STR_CONTAINS("cuda_ops/pending/message", mn_last_error(), "cuda: asynchronous error");
    mn_tensor_release(&bad);
    mn_tensor_release(&t);
}

static void test_unavailable(void)
{
    const char *why = mn_cuda_unavailable_reason();
    CHECK("cuda_ops/unavailable/reason", !mn_cuda_available() && why && why[0]);
    int64_t n = 3;
    mn_tensor t = {0}, c = {0}, o = {0};
    CHECK("cuda_ops/unavailable/alloc_fails", mn_tensor_empty(&t, MN_F32, 1, &n, MN_CUDA) == MN_ERR_DEVICE && !t.storage);
    CHECK_STR_CONTAINS("cuda_ops/unavailable/alloc_message", mn_last_error(), "cuda: ");
    CHECK_STR_CONTAINS("cuda_ops/unavailable/alloc_message_reason", mn_last_error(), why);
    must(mn_tensor_full(&c, MN_F32, 1, &n, 2.0, MN_CPU), "cpu full");
    CHECK("cuda_ops/unavailable/to_device_fails", mn_tensor_to_device(&t, &c, MN_CUDA) == MN_ERR_DEVICE && !t.storage);
    CHECK_STR_CONTAINS("cuda_ops/unavailable/to_device_message", mn_last_error(), "cuda: ");
    mn_cuda_memory_stats s;
    CHECK("cuda_ops/unavailable/memory_fails", mn_cuda_memory(&s) == MN_ERR_DEVICE);
    CHECK("cuda_ops/unavailable/no_pending", mn_cuda_check_pending() == MN_OK);
    CHECK("cuda_ops/unavailable/cpu_still_works", mn_binary(MN_OP_mul, &o, &c, &c) == MN_OK &&
                                                      ((float *)mn_tensor_data(&o))[2] == 4.0f);
    mn_tensor_release(&c);
    mn_tensor_release(&o);
}

/* The rows both rownorm tests take: l2, rms and layernorm, at widths below
 * and above a warp. */
static const mn_rownorm rownorm_kinds[] = {{true, false, true}, {true, false, false}, {true, true, false}};
static const char *const rownorm_names[] = {"l2", "rms", "layernorm"};
static const int64_t rownorm_widths[] = {1, 7, 64, 133};

/* qk_norm's row normalisation (model/rownorm.h) on the device against the
 * CPU's loops: l2, rms and layernorm rows of odd widths (a width below and
 * above a warp), and a zero row (c = 0: the eps keeps it 0). */
static void test_rownorm(void)
{
    for (int k = 0; k < COUNT(rownorm_kinds); k++)
        for (int w = 0; w < COUNT(rownorm_widths); w++) {
            int64_t shape[3] = {3, 37, rownorm_widths[w]};
            mn_tensor x = rand_cpu(MN_F32, 3, shape, -3, 3, false), want = {0}, got = {0};
            memset(mn_tensor_data(&x), 0, sizeof(float) * (size_t)rownorm_widths[w]); /* row 0 all zero */
            mn_tensor dx = to_dev(&x, MN_CUDA);
            must(mn_rownorm_tensor(rownorm_kinds[k], &x, &want), "cpu rownorm");
            mn_status st = mn_rownorm_tensor(rownorm_kinds[k], &dx, &got);
            char name[96];
            snprintf(name, sizeof name, "cuda_ops/rownorm/%s/width%lld", rownorm_names[k],
                     (long long)rownorm_widths[w]);
            if (st != MN_OK) {
                printf("FAIL %s: %s\n", name, mn_last_error());
                check_failures_++;
            } else {
                check_same(name, &got, &want, 1e-6);
            }
            mn_tensor *ts[] = {&x, &want, &got, &dx};
            for (int i = 0; i < COUNT(ts); i++) mn_tensor_release(ts[i]);
        }
}

/* qk_norm's backward on a device (kernels/grad_cuda.c): the normalisation
 * with each row's scale, and its adjoint (rownorm_vjp, in place as the
 * backward runs it) on the CPU's nhat and scales, against rownorm.c's loops;
 * the rows above (rownorm_kinds, rownorm_widths), the zero row (s = 1/sqrt(eps))
 * included. */
static void test_rownorm_adjoint(void)
{
    for (int k = 0; k < COUNT(rownorm_kinds); k++)
        for (int w = 0; w < COUNT(rownorm_widths); w++) {
            int64_t shape[3] = {3, 37, rownorm_widths[w]};
            mn_tensor x = rand_cpu(MN_F32, 3, shape, -3, 3, false), a = rand_cpu(MN_F32, 3, shape, -2, 2, false);
            memset(mn_tensor_data(&x), 0, sizeof(float) * (size_t)rownorm_widths[w]);
            mn_tensor nhat = {0}, scale = {0}, dnhat = {0}, dscale = {0};
            must(mn_rownorm_tensor_scaled(rownorm_kinds[k], &x, &nhat, &scale), "cpu rownorm with scales");
            mn_tensor dx = to_dev(&x, MN_CUDA), da = to_dev(&a, MN_CUDA), up_nhat = to_dev(&nhat, MN_CUDA),
                      up_scale = to_dev(&scale, MN_CUDA);
            char name[96];
            snprintf(name, sizeof name, "cuda_ops/rownorm_scaled/%s/width%lld", rownorm_names[k],
                     (long long)rownorm_widths[w]);
            if (mn_rownorm_tensor_scaled(rownorm_kinds[k], &dx, &dnhat, &dscale) != MN_OK) {
                printf("FAIL %s: %s\n", name, mn_last_error());
                check_failures_++;
            } else {
                check_same(name, &dnhat, &nhat, 1e-6);
                strcat(name, "/scale");
                check_same(name, &dscale, &scale, 1e-6);
            }
            must(mn_rownorm_vjp_tensor(rownorm_kinds[k], &nhat, &scale, &a), "cpu rownorm adjoint");
            snprintf(name, sizeof name, "cuda_ops/rownorm_vjp/%s/width%lld", rownorm_names[k],
                     (long long)rownorm_widths[w]);
            if (mn_rownorm_vjp_tensor(rownorm_kinds[k], &up_nhat, &up_scale, &da) != MN_OK) {
                printf("FAIL %s: %s\n", name, mn_last_error());
                check_failures_++;
            } else {
                check_same(name, &da, &a, 1e-6);
            }
            mn_tensor *ts[] = {&x, &a, &nhat, &scale, &dnhat, &dscale, &dx, &da, &up_nhat, &up_scale};
            for (int i = 0; i < COUNT(ts); i++) mn_tensor_release(ts[i]);
        }
}

/* Initial weights drawn on the device equal the CPU's draws for the same
 * seed (model/random_counter.h): xavier to the bit (integer hashing and one
 * multiply), normal to float rounding (the device's log and cos). */
static void test_init_on_device(void)
{
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.bias = true;
    mn_dims d = {.B = 3, .H = 5, .T = 1, .dk = 16, .dv = 8, .dh = 33, .S = 1};
    static const char *const schemes[] = {"xavier", "normal"};
    for (int k = 0; k < 2; k++)
        for (int shared = 0; shared < 2; shared++) {
            mn_tensor cpu[MN_MAX_PARAMS] = {{0}}, gpu[MN_MAX_PARAMS] = {{0}};
            char name[96];
            snprintf(name, sizeof name, "cuda_ops/init/%s%s", schemes[k], shared ? "/shared" : "");
            bool made = mn_init_params(&r, &d, schemes[k], 77, shared, cpu, MN_CPU) == MN_OK &&
                        mn_init_params(&r, &d, schemes[k], 77, shared, gpu, MN_CUDA) == MN_OK;
            if (!made) {
                printf("FAIL %s: %s\n", name, mn_last_error());
                check_failures_++;
            } else {
                for (int p = 0; p < mn_rule_param_count(&r); p++) {
                    char pname[128];
                    snprintf(pname, sizeof pname, "%s/param%d", name, p);
                    CHECK(pname, gpu[p].storage && gpu[p].storage->device == MN_CUDA);
                    check_same(pname, &gpu[p], &cpu[p], k == 0 ? 0.0 : 1e-7);
                }
            }
            for (int p = 0; p < MN_MAX_PARAMS; p++) {
                mn_tensor_release(&cpu[p]);
                mn_tensor_release(&gpu[p]);
            }
        }
    mn_rule_free(&r);
}

int main(void)
{
    test_coverage();
    mn_rng_seed(&rng, 20251121);
    if (!mn_cuda_register()) {
        test_unavailable();
        char why[512];
        snprintf(why, sizeof why, "no usable CUDA device: %s", mn_cuda_unavailable_reason());
        static const char *const groups[] = {"elementwise", "where", "reduce_all", "reduce_dim", "argreduce",
                                             "matmul", "copy", "alloc", "oom", "pending", "rownorm", "rownorm_adjoint",
                                             "init"};
        for (int i = 0; i < COUNT(groups); i++) {
            char name[64];
            snprintf(name, sizeof name, "cuda_ops/%s", groups[i]);
            SKIP(name, why);
        }
        return CHECK_DONE();
    }
    printf("# device: %s\n", mn_cuda_describe());
    test_elementwise();
    test_where();
    test_reduce_all();
    test_reduce_dim();
    test_argreduce();
    test_matmul();
    test_copies();
    test_tile_many();
    test_allocator();
    test_rownorm();
    test_rownorm_adjoint();
    test_init_on_device();
    test_pending_fault(); /* last: the fault it provokes leaves the context unusable */
    return CHECK_DONE();
}

#endif
