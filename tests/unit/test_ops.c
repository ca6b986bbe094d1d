/* test_ops.c: the ops of ops.def and the rest of ops.h on the CPU backend.
 * Every op in ops.def must have a known-value case in the tables below; the
 * coverage check walks ops.def itself, so a new op without a case fails.
 * Known values were computed independently (Python's math module). Then:
 * dtype promotion, broadcasting edge cases, scalar operands, reductions and
 * matmul against plain float64 loops, where, creation functions. */
#include "check.h"
#include "ops.h"
#include "random.h"

#include <stdint.h>
#include <stdlib.h>

#define NAN_ NAN
#define INF INFINITY

/* ---- known values ---- */

typedef struct { mn_op op; double x, want; } unary_case;
static const unary_case unary_cases[] = {
    {MN_OP_neg, 2, -2}, {MN_OP_neg, -0.5, 0.5}, {MN_OP_neg, INF, -INF},
    {MN_OP_exp, 0, 1}, {MN_OP_exp, 1, 2.718281828459045}, {MN_OP_exp, -INF, 0}, {MN_OP_exp, 1000, INF},
    {MN_OP_log, 1, 0}, {MN_OP_log, 2, 0.6931471805599453}, {MN_OP_log, 0, -INF}, {MN_OP_log, -1, NAN_},
    {MN_OP_sqrt, 4, 2}, {MN_OP_sqrt, 2, 1.4142135623730951}, {MN_OP_sqrt, -1, NAN_}, {MN_OP_sqrt, INF, INF},
    {MN_OP_abs, -3, 3}, {MN_OP_abs, -INF, INF}, {MN_OP_abs, NAN_, NAN_},
    {MN_OP_tanh, 0.5, 0.46211715726000974}, {MN_OP_tanh, 100, 1}, {MN_OP_tanh, -INF, -1},
    {MN_OP_sigmoid, 0, 0.5}, {MN_OP_sigmoid, 1, 0.7310585786300049}, {MN_OP_sigmoid, -1000, 0},
    {MN_OP_sigmoid, 1000, 1}, {MN_OP_sigmoid, NAN_, NAN_},
    {MN_OP_silu, 1, 0.7310585786300049}, {MN_OP_silu, -2, -0.2384058440442351}, {MN_OP_silu, 0, 0},
    {MN_OP_gelu, 1, 0.8413447460685429}, {MN_OP_gelu, -1, -0.15865525393145707}, {MN_OP_gelu, 0, 0},
    {MN_OP_gelu, 10, 10},
    {MN_OP_relu, 2, 2}, {MN_OP_relu, -2, 0}, {MN_OP_relu, NAN_, NAN_}, {MN_OP_relu, INF, INF},
    {MN_OP_relu, -INF, 0}, {MN_OP_relu, 0, 0},
    {MN_OP_softplus, 1, 1.3132616875182228}, {MN_OP_softplus, -1, 0.31326168751822286},
    {MN_OP_softplus, 1000, 1000}, {MN_OP_softplus, -1000, 0}, {MN_OP_softplus, 0, 0.6931471805599453},
    {MN_OP_sign, 3, 1}, {MN_OP_sign, -0.1, -1}, {MN_OP_sign, 0, 0}, {MN_OP_sign, NAN_, NAN_},
    {MN_OP_sign, -INF, -1}, {MN_OP_sign, INF, 1},
    {MN_OP_floor, 2.7, 2}, {MN_OP_floor, -2.1, -3}, {MN_OP_floor, INF, INF},
    {MN_OP_round, 2.5, 3}, {MN_OP_round, -2.5, -3}, {MN_OP_round, 0.4, 0}, {MN_OP_round, -0.6, -1},
    {MN_OP_isnan, NAN_, 1}, {MN_OP_isnan, INF, 0}, {MN_OP_isnan, 1, 0},
    {MN_OP_isfinite, 1, 1}, {MN_OP_isfinite, INF, 0}, {MN_OP_isfinite, -INF, 0}, {MN_OP_isfinite, NAN_, 0},
};

typedef struct { mn_op op; double a, b, want; } binary_case;
static const binary_case binary_cases[] = {
    {MN_OP_add, 1, 2, 3}, {MN_OP_add, INF, -INF, NAN_}, {MN_OP_add, -0.25, 0.25, 0},
    {MN_OP_sub, 5, 3, 2}, {MN_OP_sub, INF, INF, NAN_}, {MN_OP_sub, 1, -INF, INF},
    {MN_OP_mul, 3, -4, -12}, {MN_OP_mul, 0, INF, NAN_}, {MN_OP_mul, 0.5, 0.5, 0.25},
    {MN_OP_div, 1, 4, 0.25}, {MN_OP_div, 1, 0, INF}, {MN_OP_div, -1, 0, -INF}, {MN_OP_div, 0, 0, NAN_},
    {MN_OP_pow, 2, 10, 1024}, {MN_OP_pow, 4, 0.5, 2}, {MN_OP_pow, -8, 1.0 / 3, NAN_}, {MN_OP_pow, 0, 0, 1},
    {MN_OP_pow, NAN_, 0, 1}, {MN_OP_pow, 2, -1, 0.5},
    {MN_OP_maximum, 1, 2, 2}, {MN_OP_maximum, NAN_, 1, NAN_}, {MN_OP_maximum, 1, NAN_, NAN_},
    {MN_OP_maximum, -INF, 3, 3}, {MN_OP_maximum, INF, 3, INF}, {MN_OP_maximum, -1, -2, -1},
    {MN_OP_minimum, 1, 2, 1}, {MN_OP_minimum, NAN_, 1, NAN_}, {MN_OP_minimum, 1, NAN_, NAN_},
    {MN_OP_minimum, -INF, 3, -INF}, {MN_OP_minimum, -1, -2, -2},
    {MN_OP_lt, 1, 2, 1}, {MN_OP_lt, 2, 2, 0}, {MN_OP_lt, NAN_, 1, 0}, {MN_OP_lt, -INF, INF, 1},
    {MN_OP_le, 2, 2, 1}, {MN_OP_le, 3, 2, 0}, {MN_OP_le, NAN_, NAN_, 0},
    {MN_OP_gt, 3, 2, 1}, {MN_OP_gt, 2, 2, 0}, {MN_OP_gt, 1, NAN_, 0},
    {MN_OP_ge, 2, 2, 1}, {MN_OP_ge, 1, 2, 0}, {MN_OP_ge, NAN_, 1, 0},
    {MN_OP_eq, 2, 2, 1}, {MN_OP_eq, 1, 2, 0}, {MN_OP_eq, NAN_, NAN_, 0},
    {MN_OP_ne, 1, 2, 1}, {MN_OP_ne, 2, 2, 0}, {MN_OP_ne, NAN_, NAN_, 1},
};

/* Whole-tensor values; n = 0 is the empty tensor. */
typedef struct { mn_op op; int n; double x[4]; double want; } reduce_case;
static const reduce_case reduce_cases[] = {
    {MN_OP_sum, 4, {1, -2, 3, 0.5}, 2.5}, {MN_OP_sum, 0, {0}, 0}, {MN_OP_sum, 2, {1, NAN_}, NAN_},
    {MN_OP_mean, 4, {1, -2, 3, 0.5}, 0.625}, {MN_OP_mean, 0, {0}, NAN_},
    {MN_OP_max, 4, {1, -2, 3, 0.5}, 3}, {MN_OP_max, 3, {1, NAN_, 3}, NAN_}, {MN_OP_max, 0, {0}, NAN_},
    {MN_OP_max, 2, {-INF, -INF}, -INF},
    {MN_OP_min, 4, {1, -2, 3, 0.5}, -2}, {MN_OP_min, 3, {1, 3, NAN_}, NAN_}, {MN_OP_min, 0, {0}, NAN_},
    {MN_OP_norm, 4, {1, -2, 3, 0.5}, 3.774917217635375}, {MN_OP_norm, 2, {3, 4}, 5}, {MN_OP_norm, 0, {0}, 0},
    {MN_OP_prod, 4, {1, -2, 3, 0.5}, -3}, {MN_OP_prod, 0, {0}, 1}, {MN_OP_prod, 2, {0, INF}, NAN_},
};

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* NaN matches NaN, infinities match exactly, the rest within tol. */
static bool same_value(double got, double want, double tol)
{
    if (isnan(want)) return isnan(got);
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol * fmax(1.0, fabs(want));
}

/* A 1-d tensor of n values, laid out with a stride (step >= 1) so that the
 * strided loops run too; the holder of the full storage is released. */
static mn_tensor vec(mn_dtype dt, int n, const double *x, int step)
{
    mn_tensor base = {0}, v = {0};
    int64_t len = (int64_t)n * step;
    if (mn_tensor_zeros(&base, dt, 1, &len, MN_CPU) != MN_OK) abort();
    for (int64_t i = 0; i < n; i++) {
        int64_t j = i * step;
        mn_tensor_set(&base, &j, x[i]);
    }
    if (mn_view_slice(&v, &base, 0, 0, len, step) != MN_OK) abort();
    mn_tensor_release(&base);
    return v;
}

static double at(const mn_tensor *t, int64_t i) { return mn_tensor_get(t, &i); }

/* ---- every op has a case ---- */

static void test_coverage(void)
{
    static const struct { const char *name; mn_op op; mn_op_kind kind; } all[] = {
#define MN_UNARY(name, doc) {#name, MN_OP_##name, MN_OPKIND_UNARY},
#define MN_BINARY(name, meta, doc) {#name, MN_OP_##name, MN_OPKIND_BINARY},
#define MN_REDUCE(name, doc) {#name, MN_OP_##name, MN_OPKIND_REDUCE},
#include "ops.def"
    };
    CHECK("ops/table_size", COUNT(all) == MN_OP_COUNT);
    for (int i = 0; i < COUNT(all); i++) {
        int n = 0;
        if (all[i].kind == MN_OPKIND_UNARY)
            for (int k = 0; k < COUNT(unary_cases); k++) n += unary_cases[k].op == all[i].op;
        if (all[i].kind == MN_OPKIND_BINARY)
            for (int k = 0; k < COUNT(binary_cases); k++) n += binary_cases[k].op == all[i].op;
        if (all[i].kind == MN_OPKIND_REDUCE)
            for (int k = 0; k < COUNT(reduce_cases); k++) n += reduce_cases[k].op == all[i].op;
        char name[96];
        snprintf(name, sizeof name, "ops/%s/has_known_value_case", all[i].name);
        CHECK(name, n > 0);
        snprintf(name, sizeof name, "ops/%s/metadata", all[i].name);
        CHECK(name, strcmp(mn_op_name(all[i].op), all[i].name) == 0 && mn_op_lookup(all[i].name) == (int)all[i].op &&
                        mn_op_kind_of(all[i].op) == all[i].kind && mn_op_doc(all[i].op)[0] != 0);
    }
    CHECK("ops/lookup_unknown", mn_op_lookup("frobnicate") == -1);
    CHECK("ops/metamethods", strcmp(mn_op_metamethod(MN_OP_add), "__add") == 0 &&
                                 strcmp(mn_op_metamethod(MN_OP_pow), "__pow") == 0 &&
                                 mn_op_metamethod(MN_OP_maximum) == NULL && mn_op_metamethod(MN_OP_exp) == NULL);
}

/* ---- unary, binary, reduce known values, each dtype, contiguous and strided ---- */

static void test_unary_values(void)
{
    for (int op = 0; op < MN_OP_COUNT; op++) {
        if (mn_op_kind_of(op) != MN_OPKIND_UNARY) continue;
        double x[32], want[32];
        int n = 0;
        for (int k = 0; k < COUNT(unary_cases); k++)
            if (unary_cases[k].op == (mn_op)op) {
                x[n] = unary_cases[k].x;
                want[n++] = unary_cases[k].want;
            }
        if (!n) continue;
        for (int dt = MN_F32; dt <= MN_F64; dt++)
            for (int step = 1; step <= 2; step++) {
                mn_tensor in = vec(dt, n, x, step), out = {0};
                mn_status st = mn_unary(op, &out, &in);
                bool ok = st == MN_OK && out.dtype == (mn_dtype)dt && out.shape[0] == n;
                for (int i = 0; ok && i < n; i++) {
                    double w = dt == MN_F32 ? (double)(float)want[i] : want[i];
                    ok = same_value(at(&out, i), w, dt == MN_F32 ? 1e-6 : 1e-15);
                    if (!ok) printf("  %s(%g) = %.17g, want %.17g\n", mn_op_name(op), x[i], at(&out, i), w);
                }
                char name[96];
                snprintf(name, sizeof name, "unary/%s/%s%s", mn_op_name(op), mn_dtype_name(dt), step > 1 ? "_strided" : "");
                CHECK(name, ok);
                mn_tensor_release(&in);
                mn_tensor_release(&out);
            }
    }

    /* i64: integer ops stay i64 and exact past 2^53; the others give f32. */
    int64_t three = 3;
    mn_tensor i = {0}, o = {0};
    mn_tensor_empty(&i, MN_I64, 1, &three, MN_CPU);
    int64_t *p = mn_tensor_data(&i);
    p[0] = (INT64_C(1) << 53) + 1;
    p[1] = -7;
    p[2] = 0;
    CHECK("unary/neg/i64_exact", mn_unary(MN_OP_neg, &o, &i) == MN_OK && o.dtype == MN_I64 &&
                                     ((int64_t *)mn_tensor_data(&o))[0] == -((INT64_C(1) << 53) + 1));
    mn_tensor_release(&o);
    CHECK("unary/abs/i64", mn_unary(MN_OP_abs, &o, &i) == MN_OK && o.dtype == MN_I64 && at(&o, 1) == 7);
    mn_tensor_release(&o);
    CHECK("unary/relu/i64", mn_unary(MN_OP_relu, &o, &i) == MN_OK && at(&o, 1) == 0 && at(&o, 0) > 0);
    mn_tensor_release(&o);
    CHECK("unary/sign/i64", mn_unary(MN_OP_sign, &o, &i) == MN_OK && at(&o, 0) == 1 && at(&o, 1) == -1 && at(&o, 2) == 0);
    mn_tensor_release(&o);
    CHECK("unary/isfinite/i64", mn_unary(MN_OP_isfinite, &o, &i) == MN_OK && o.dtype == MN_I64 && at(&o, 2) == 1);
    mn_tensor_release(&o);
    CHECK("unary/exp/i64_to_f32", mn_unary(MN_OP_exp, &o, &i) == MN_OK && o.dtype == MN_F32 && at(&o, 2) == 1.0);
    mn_tensor_release(&o);
    CHECK("unary/not_unary_refused", mn_unary(MN_OP_add, &o, &i) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("unary/not_unary_message", mn_last_error(), "'add' is not a unary op");
    mn_tensor_release(&i);
}

static void test_binary_values(void)
{
    for (int op = 0; op < MN_OP_COUNT; op++) {
        if (mn_op_kind_of(op) != MN_OPKIND_BINARY) continue;
        double a[32], b[32], want[32];
        int n = 0;
        for (int k = 0; k < COUNT(binary_cases); k++)
            if (binary_cases[k].op == (mn_op)op) {
                a[n] = binary_cases[k].a;
                b[n] = binary_cases[k].b;
                want[n++] = binary_cases[k].want;
            }
        if (!n) continue;
        for (int dt = MN_F32; dt <= MN_F64; dt++)
            for (int step = 1; step <= 2; step++) {
                mn_tensor ta = vec(dt, n, a, step), tb = vec(dt, n, b, 1), out = {0};
                mn_status st = mn_binary(op, &out, &ta, &tb);
                bool ok = st == MN_OK && out.dtype == (mn_dtype)dt && out.shape[0] == n;
                for (int i = 0; ok && i < n; i++) {
                    double w = dt == MN_F32 ? (double)(float)want[i] : want[i];
                    ok = same_value(at(&out, i), w, dt == MN_F32 ? 1e-6 : 1e-15);
                    if (!ok) printf("  %s(%g, %g) = %.17g, want %.17g\n", mn_op_name(op), a[i], b[i], at(&out, i), w);
                }
                char name[96];
                snprintf(name, sizeof name, "binary/%s/%s%s", mn_op_name(op), mn_dtype_name(dt), step > 1 ? "_strided" : "");
                CHECK(name, ok);
                mn_tensor_release(&ta);
                mn_tensor_release(&tb);
                mn_tensor_release(&out);
            }
    }

    /* i64 arithmetic is exact integer arithmetic. */
    int64_t two = 2;
    mn_tensor x = {0}, y = {0}, o = {0};
    mn_tensor_empty(&x, MN_I64, 1, &two, MN_CPU);
    mn_tensor_empty(&y, MN_I64, 1, &two, MN_CPU);
    int64_t *px = mn_tensor_data(&x), *py = mn_tensor_data(&y);
    px[0] = (INT64_C(1) << 53) + 1;
    px[1] = 7;
    py[0] = 1;
    py[1] = 2;
    CHECK("binary/add/i64_exact", mn_binary(MN_OP_add, &o, &x, &y) == MN_OK && o.dtype == MN_I64 &&
                                      ((int64_t *)mn_tensor_data(&o))[0] == (INT64_C(1) << 53) + 2);
    mn_tensor_release(&o);
    CHECK("binary/ne/i64_exact", mn_binary(MN_OP_ne, &o, &x, &y) == MN_OK && o.dtype == MN_I64 && at(&o, 0) == 1);
    mn_tensor_release(&o);
    px[0] = INT64_MAX;
    CHECK("binary/add/i64_wraps", mn_binary(MN_OP_add, &o, &x, &y) == MN_OK &&
                                      ((int64_t *)mn_tensor_data(&o))[0] == INT64_MIN);
    mn_tensor_release(&o);
    CHECK("binary/div/i64_true_division", mn_binary(MN_OP_div, &o, &x, &y) == MN_OK && o.dtype == MN_F32 && at(&o, 1) == 3.5);
    mn_tensor_release(&o);
    CHECK("binary/pow/i64_to_f32", mn_binary(MN_OP_pow, &o, &y, &y) == MN_OK && o.dtype == MN_F32 && at(&o, 1) == 4.0);
    mn_tensor_release(&o);
    CHECK("binary/maximum/i64", mn_binary(MN_OP_maximum, &o, &x, &y) == MN_OK && o.dtype == MN_I64 && at(&o, 1) == 7);
    mn_tensor_release(&o);
    mn_tensor_release(&x);
    mn_tensor_release(&y);
}

static void test_reduce_values(void)
{
    for (int k = 0; k < COUNT(reduce_cases); k++) {
        const reduce_case *c = &reduce_cases[k];
        for (int dt = MN_F32; dt <= MN_F64; dt++) {
            mn_tensor t = vec(dt, c->n, c->x, 2), out = {0};
            double r = -12345;
            mn_status st = mn_reduce_all(c->op, &t, &r);
            char name[96];
            snprintf(name, sizeof name, "reduce/%s/case%d_%s", mn_op_name(c->op), k, mn_dtype_name(dt));
            CHECK(name, st == MN_OK && same_value(r, c->want, 1e-6));
            /* Along the only dim, the same value as a 0-d tensor. */
            st = mn_reduce_dim(c->op, &out, &t, 0, false);
            bool arg_empty_err = c->n == 0 && (c->op == MN_OP_max || c->op == MN_OP_min);
            snprintf(name, sizeof name, "reduce/%s/case%d_%s_dim", mn_op_name(c->op), k, mn_dtype_name(dt));
            if (arg_empty_err) CHECK(name, st == MN_ERR_ARG && out.storage == NULL);
            else CHECK(name, st == MN_OK && out.ndim == 0 && same_value(mn_tensor_get(&out, NULL), c->want, 1e-6));
            mn_tensor_release(&out);
            mn_tensor_release(&t);
        }
    }
    mn_tensor t = {0}, o = {0};
    int64_t zero = 0;
    mn_tensor_zeros(&t, MN_F64, 1, &zero, MN_CPU);
    CHECK("reduce/empty_max", mn_reduce_dim(MN_OP_max, &o, &t, 0, false) == MN_ERR_ARG && o.storage == NULL);
    CHECK_STR_CONTAINS("reduce/empty_max_message", mn_last_error(), "max: cannot reduce dim 0 of size 0 (0)");
    mn_tensor_release(&t);
    int64_t sh[2] = {3, 0};
    mn_tensor_zeros(&t, MN_F32, 2, sh, MN_CPU);
    CHECK("reduce/sum_over_empty_dim", mn_reduce_dim(MN_OP_sum, &o, &t, 1, true) == MN_OK && o.ndim == 2 &&
                                           o.shape[0] == 3 && o.shape[1] == 1 && mn_tensor_get(&o, (int64_t[]){2, 0}) == 0);
    mn_tensor_release(&o);
    CHECK("reduce/max_over_empty_dim", mn_reduce_dim(MN_OP_max, &o, &t, 1, false) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("reduce/max_over_empty_dim_message", mn_last_error(), "max: cannot reduce dim 1 of size 0 (3x0)");
    CHECK("reduce/max_along_dim_of_empty_rows", mn_reduce_dim(MN_OP_max, &o, &t, 0, false) == MN_OK && o.shape[0] == 0);
    mn_tensor_release(&o);
    CHECK("reduce/bad_dim", mn_reduce_dim(MN_OP_sum, &o, &t, 2, false) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("reduce/bad_dim_message", mn_last_error(), "sum: dim 2 out of range for a 2-d tensor");
    CHECK("reduce/not_a_reduction", mn_reduce_dim(MN_OP_add, &o, &t, 0, false) == MN_ERR_ARG);
    mn_tensor_release(&t);

    /* i64: sums stay exact integers; mean gives f32. */
    int64_t two = 2;
    mn_tensor_empty(&t, MN_I64, 1, &two, MN_CPU);
    ((int64_t *)mn_tensor_data(&t))[0] = (INT64_C(1) << 53) + 1;
    ((int64_t *)mn_tensor_data(&t))[1] = 2;
    CHECK("reduce/sum/i64_exact", mn_reduce_dim(MN_OP_sum, &o, &t, 0, false) == MN_OK && o.dtype == MN_I64 &&
                                      *(int64_t *)mn_tensor_data(&o) == (INT64_C(1) << 53) + 3);
    mn_tensor_release(&o);
    CHECK("reduce/mean/i64_to_f32", mn_reduce_dim(MN_OP_mean, &o, &t, -1, false) == MN_OK && o.dtype == MN_F32);
    mn_tensor_release(&o);
    mn_tensor_release(&t);
}

/* ---- dtype promotion ---- */

static void test_promotion(void)
{
    static const mn_dtype dts[3] = {MN_F32, MN_F64, MN_I64};
    /* want[op][a][b] for add, div, lt (comparisons take the promoted dtype). */
    static const mn_dtype want_add[3][3] = {{MN_F32, MN_F64, MN_F32}, {MN_F64, MN_F64, MN_F64}, {MN_F32, MN_F64, MN_I64}};
    static const mn_dtype want_div[3][3] = {{MN_F32, MN_F64, MN_F32}, {MN_F64, MN_F64, MN_F64}, {MN_F32, MN_F64, MN_F32}};
    static const mn_op ops[4] = {MN_OP_add, MN_OP_div, MN_OP_lt, MN_OP_pow};
    bool table_ok = true, actual_ok = true;
    double one = 3;
    for (int o = 0; o < 4; o++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) {
                bool divlike = ops[o] == MN_OP_div || ops[o] == MN_OP_pow;
                mn_dtype w = divlike ? want_div[i][j] : want_add[i][j];
                if (mn_promote(ops[o], dts[i], dts[j]) != w) {
                    table_ok = false;
                    printf("  promote(%s, %s, %s) wrong\n", mn_op_name(ops[o]), mn_dtype_name(dts[i]), mn_dtype_name(dts[j]));
                }
                mn_tensor a = vec(dts[i], 1, &one, 1), b = vec(dts[j], 1, &one, 1), r = {0};
                if (mn_binary(ops[o], &r, &a, &b) != MN_OK || r.dtype != w) actual_ok = false;
                double got = at(&r, 0), expect = ops[o] == MN_OP_add ? 6 : ops[o] == MN_OP_div ? 1 : ops[o] == MN_OP_lt ? 0 : 27;
                if (got != expect) actual_ok = false;
                mn_tensor_release(&a);
                mn_tensor_release(&b);
                mn_tensor_release(&r);
            }
    CHECK("promote/table", table_ok);
    CHECK("promote/results_have_promoted_dtype", actual_ok);
    CHECK("promote/unary_dtype", mn_unary_dtype(MN_OP_exp, MN_I64) == MN_F32 && mn_unary_dtype(MN_OP_abs, MN_I64) == MN_I64 &&
                                     mn_unary_dtype(MN_OP_exp, MN_F64) == MN_F64);
    CHECK("promote/reduce_dtype", mn_reduce_dtype(MN_OP_mean, MN_I64) == MN_F32 && mn_reduce_dtype(MN_OP_sum, MN_I64) == MN_I64);
}

/* ---- broadcasting ---- */

static mn_tensor ramp(mn_dtype dt, int ndim, const int64_t *shape, double scale)
{
    mn_tensor t = {0};
    if (mn_tensor_empty(&t, dt, ndim, shape, MN_CPU) != MN_OK) abort();
    int64_t n = mn_tensor_numel(&t);
    mn_tensor flat = {0};
    int64_t m1 = -1;
    mn_view_reshape(&flat, &t, 1, &m1);
    for (int64_t i = 0; i < n; i++) mn_tensor_set(&flat, &i, scale * (double)(i + 1));
    mn_tensor_release(&flat);
    return t;
}

static void test_broadcasting(void)
{
    mn_tensor s = {0}, a, b, o = {0};
    mn_tensor_full(&s, MN_F64, 0, NULL, 2.0, MN_CPU);
    int64_t s23[2] = {2, 3}, s31[2] = {3, 1}, s14[2] = {1, 4}, s4[1] = {4}, s03[2] = {0, 3}, s3[1] = {3};
    a = ramp(MN_F32, 2, s23, 1);
    CHECK("bcast/scalar_tensor", mn_binary(MN_OP_mul, &o, &s, &a) == MN_OK && o.ndim == 2 && o.dtype == MN_F64 &&
                                     mn_tensor_get(&o, (int64_t[]){1, 2}) == 12.0);
    mn_tensor_release(&o);
    CHECK("bcast/scalar_scalar", mn_binary(MN_OP_add, &o, &s, &s) == MN_OK && o.ndim == 0 && mn_tensor_get(&o, NULL) == 4.0);
    mn_tensor_release(&o);
    b = ramp(MN_F32, 1, s4, 1);
    CHECK("bcast/incompatible", mn_binary(MN_OP_add, &o, &a, &b) == MN_ERR_ARG && o.storage == NULL);
    CHECK_STR_CONTAINS("bcast/incompatible_message", mn_last_error(), "add: shapes 2x3 and 4 do not broadcast");
    mn_tensor_release(&b);
    mn_tensor_release(&a);

    a = ramp(MN_F64, 2, s31, 1);
    b = ramp(MN_F64, 2, s14, 10);
    CHECK("bcast/outer", mn_binary(MN_OP_sub, &o, &a, &b) == MN_OK && o.shape[0] == 3 && o.shape[1] == 4);
    bool ok = true;
    for (int64_t i = 0; i < 3; i++)
        for (int64_t j = 0; j < 4; j++) ok = ok && mn_tensor_get(&o, (int64_t[]){i, j}) == (double)(i + 1) - 10.0 * (double)(j + 1);
    CHECK("bcast/outer_values", ok);
    mn_tensor_release(&o);
    mn_tensor_release(&a);
    mn_tensor_release(&b);

    /* A middle dim broadcast: [2,1,3] * [4,1] -> [2,4,3]. */
    int64_t s213[3] = {2, 1, 3}, s41[2] = {4, 1};
    a = ramp(MN_F32, 3, s213, 1);
    b = ramp(MN_F32, 2, s41, 1);
    CHECK("bcast/middle", mn_binary(MN_OP_mul, &o, &a, &b) == MN_OK && o.ndim == 3 && o.shape[1] == 4);
    CHECK("bcast/middle_value", mn_tensor_get(&o, (int64_t[]){1, 3, 2}) == 6.0 * 4.0);
    mn_tensor_release(&o);
    mn_tensor_release(&a);
    mn_tensor_release(&b);

    /* Zero-size dims broadcast with 1 and with equal sizes, not with others. */
    mn_tensor_zeros(&a, MN_F32, 2, s03, MN_CPU);
    b = ramp(MN_F32, 1, s3, 1);
    CHECK("bcast/zero_size", mn_binary(MN_OP_add, &o, &a, &b) == MN_OK && o.shape[0] == 0 && o.shape[1] == 3);
    mn_tensor_release(&o);
    CHECK("bcast/zero_size_scalar", mn_binary(MN_OP_add, &o, &s, &a) == MN_OK && mn_tensor_numel(&o) == 0);
    mn_tensor_release(&o);
    mn_tensor c = ramp(MN_F32, 2, s23, 1);
    CHECK("bcast/zero_vs_two", mn_binary(MN_OP_add, &o, &a, &c) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("bcast/zero_vs_two_message", mn_last_error(), "add: shapes 0x3 and 2x3 do not broadcast");
    mn_tensor_release(&a);
    mn_tensor_release(&b);
    mn_tensor_release(&c);
    mn_tensor_release(&s);

    /* The strided path agrees with the contiguous one, element for element. */
    int64_t big[2] = {37, 53}, bigt[2] = {53, 37};
    mn_rng rng;
    mn_rng_seed(&rng, 3);
    mn_tensor x = {0}, y = {0}, yt = {0}, yc = {0}, r1 = {0}, r2 = {0};
    mn_tensor_randn(&x, MN_F32, 2, big, 0, 1, &rng);
    mn_tensor_randn(&y, MN_F32, 2, bigt, 0, 1, &rng);
    mn_view_transpose(&yt, &y, 0, 1);
    mn_tensor_contiguous(&yc, &yt);
    bool same = mn_binary(MN_OP_maximum, &r1, &x, &yt) == MN_OK && mn_binary(MN_OP_maximum, &r2, &x, &yc) == MN_OK &&
                memcmp(mn_tensor_data(&r1), mn_tensor_data(&r2), sizeof(float) * 37 * 53) == 0;
    CHECK("bcast/strided_equals_contiguous", same);
    mn_tensor_release(&r1);
    mn_tensor_release(&r2);
    CHECK("bcast/unary_strided", mn_unary(MN_OP_tanh, &r1, &yt) == MN_OK && mn_unary(MN_OP_tanh, &r2, &yc) == MN_OK &&
                                     memcmp(mn_tensor_data(&r1), mn_tensor_data(&r2), sizeof(float) * 37 * 53) == 0);
    mn_tensor_release(&r1);
    mn_tensor_release(&r2);
    mn_tensor_release(&x);
    mn_tensor_release(&y);
    mn_tensor_release(&yt);
    mn_tensor_release(&yc);
}

static void test_scalars(void)
{
    double v[3] = {1, 2, 3};
    mn_tensor f = vec(MN_F32, 3, v, 1), i = vec(MN_I64, 3, v, 1), o = {0};
    CHECK("scalar/f32_stays_f32", mn_binary_scalar(MN_OP_mul, &o, &f, 0.5, false) == MN_OK && o.dtype == MN_F32 &&
                                      at(&o, 2) == 1.5);
    mn_tensor_release(&o);
    CHECK("scalar/f32_scalar_rounded_to_f32", mn_binary_scalar(MN_OP_add, &o, &f, 0.1, false) == MN_OK &&
                                                  at(&o, 0) == (double)(1.0f + 0.1f));
    mn_tensor_release(&o);
    CHECK("scalar/i64_int_stays_i64", mn_binary_scalar(MN_OP_mul, &o, &i, 2, false) == MN_OK && o.dtype == MN_I64 &&
                                          at(&o, 2) == 6);
    mn_tensor_release(&o);
    CHECK("scalar/i64_half_promotes", mn_binary_scalar(MN_OP_mul, &o, &i, 0.5, false) == MN_OK && o.dtype == MN_F32 &&
                                          at(&o, 0) == 0.5 && at(&o, 2) == 1.5);
    mn_tensor_release(&o);
    CHECK("scalar/i64_nan_promotes", mn_binary_scalar(MN_OP_add, &o, &i, NAN, false) == MN_OK && o.dtype == MN_F32 &&
                                         isnan(at(&o, 1)));
    mn_tensor_release(&o);
    CHECK("scalar/i64_div", mn_binary_scalar(MN_OP_div, &o, &i, 2, false) == MN_OK && o.dtype == MN_F32 && at(&o, 2) == 1.5);
    mn_tensor_release(&o);
    CHECK("scalar/scalar_first", mn_binary_scalar(MN_OP_sub, &o, &f, 10, true) == MN_OK && at(&o, 0) == 9 && at(&o, 2) == 7);
    mn_tensor_release(&o);
    CHECK("scalar/pow_scalar_first", mn_binary_scalar(MN_OP_pow, &o, &f, 2, true) == MN_OK && at(&o, 2) == 8);
    mn_tensor_release(&o);
    CHECK("scalar/compare", mn_binary_scalar(MN_OP_ge, &o, &f, 2, false) == MN_OK && o.dtype == MN_F32 &&
                                at(&o, 0) == 0 && at(&o, 1) == 1 && at(&o, 2) == 1);
    mn_tensor_release(&o);
    mn_tensor_release(&f);
    mn_tensor_release(&i);
}

/* ---- reductions against float64 loops ---- */

static void test_reduce_random(void)
{
    mn_rng rng;
    mn_rng_seed(&rng, 17);
    int64_t shape[3] = {7, 13, 5};
    mn_tensor base = {0}, view = {0};
    mn_tensor_rand(&base, MN_F32, 3, shape, 0.5, 1.5, &rng);
    int perm[3] = {2, 0, 1}; /* a non-contiguous view: [5, 7, 13] */
    mn_view_permute(&view, &base, perm);
    const mn_op ops[6] = {MN_OP_sum, MN_OP_mean, MN_OP_max, MN_OP_min, MN_OP_norm, MN_OP_prod};
    for (int pass = 0; pass < 2; pass++) {
        const mn_tensor *t = pass ? &view : &base;
        const char *tag = pass ? "permuted" : "contiguous";
        for (int k = 0; k < 6; k++) {
            mn_op op = ops[k];
            /* Whole tensor. */
            double ref = op == MN_OP_prod ? 1 : op == MN_OP_max ? -INFINITY : op == MN_OP_min ? INFINITY : 0;
            int64_t n = 0;
            for (int64_t i = 0; i < t->shape[0]; i++)
                for (int64_t j = 0; j < t->shape[1]; j++)
                    for (int64_t l = 0; l < t->shape[2]; l++) {
                        double v = mn_tensor_get(t, (int64_t[]){i, j, l});
                        n++;
                        if (op == MN_OP_sum || op == MN_OP_mean) ref += v;
                        if (op == MN_OP_norm) ref += v * v;
                        if (op == MN_OP_prod) ref *= v;
                        if (op == MN_OP_max) ref = fmax(ref, v);
                        if (op == MN_OP_min) ref = fmin(ref, v);
                    }
            if (op == MN_OP_mean) ref /= (double)n;
            if (op == MN_OP_norm) ref = sqrt(ref);
            double got;
            char name[96];
            snprintf(name, sizeof name, "reduce_all/%s/%s", mn_op_name(op), tag);
            CHECK_NEAR(name, mn_reduce_all(op, t, &got) == MN_OK ? got : NAN, ref, 1e-12);
            /* Along each dim, with and without keepdim. */
            for (int d = 0; d < 3; d++) {
                mn_tensor o = {0}, ok_ = {0};
                bool ok = mn_reduce_dim(op, &o, t, d, false) == MN_OK && mn_reduce_dim(op, &ok_, t, d, true) == MN_OK &&
                          o.ndim == 2 && ok_.ndim == 3 && ok_.shape[d] == 1 && o.dtype == MN_F32;
                double worst = 0;
                int o0 = d == 0 ? 1 : 0, o1 = d == 2 ? 1 : 2; /* the kept dims, in order */
                for (int64_t i = 0; ok && i < t->shape[o0]; i++)
                    for (int64_t j = 0; j < t->shape[o1]; j++) {
                        double r = op == MN_OP_prod ? 1 : op == MN_OP_max ? -INFINITY : op == MN_OP_min ? INFINITY : 0;
                        for (int64_t l = 0; l < t->shape[d]; l++) {
                            int64_t idx[3];
                            idx[d] = l;
                            idx[o0] = i;
                            idx[o1] = j;
                            double v = mn_tensor_get(t, idx);
                            if (op == MN_OP_sum || op == MN_OP_mean) r += v;
                            if (op == MN_OP_norm) r += v * v;
                            if (op == MN_OP_prod) r *= v;
                            if (op == MN_OP_max) r = fmax(r, v);
                            if (op == MN_OP_min) r = fmin(r, v);
                        }
                        if (op == MN_OP_mean) r /= (double)t->shape[d];
                        if (op == MN_OP_norm) r = sqrt(r);
                        int64_t kidx[3];
                        kidx[d] = 0;
                        kidx[o0] = i;
                        kidx[o1] = j;
                        double g = mn_tensor_get(&o, (int64_t[]){i, j}), gk = mn_tensor_get(&ok_, kidx);
                        double e = fabs(g - (double)(float)r) / fmax(1.0, fabs(r));
                        if (gk != g) e = INFINITY;
                        if (e > worst) worst = e;
                    }
                snprintf(name, sizeof name, "reduce_dim/%s/dim%d/%s", mn_op_name(op), d, tag);
                /* f32 output: the double result rounded once. */
                CHECK(name, ok && worst <= 1e-7);
                mn_tensor_release(&o);
                mn_tensor_release(&ok_);
            }
        }
    }
    mn_tensor_release(&view);
    mn_tensor_release(&base);

    /* A large contiguous sum through the fast path against a double loop. */
    int64_t big = 100003;
    mn_tensor_randn(&base, MN_F32, 1, &big, 0, 1, &rng);
    const float *p = mn_tensor_data(&base);
    double ref = 0, got = 0;
    for (int64_t i = 0; i < big; i++) ref += p[i];
    CHECK("reduce_all/sum/large_exact_order", mn_reduce_all(MN_OP_sum, &base, &got) == MN_OK && got == ref);
    mn_tensor_release(&base);
}

static void test_argreduce(void)
{
    double v[9] = {1, 5, 5, NAN, 2, 0, -1, -1, -3};
    mn_tensor flat = vec(MN_F64, 9, v, 1), t = {0}, o = {0};
    int64_t s33[2] = {3, 3};
    mn_view_reshape(&t, &flat, 2, s33);
    CHECK("argmax/dim1", mn_argreduce_dim(MN_OP_max, &o, &t, 1, false) == MN_OK && o.dtype == MN_I64 && o.ndim == 1 &&
                             at(&o, 0) == 1 && at(&o, 1) == 0 && at(&o, 2) == 0);
    mn_tensor_release(&o);
    CHECK("argmin/dim1", mn_argreduce_dim(MN_OP_min, &o, &t, -1, false) == MN_OK && at(&o, 0) == 0 && at(&o, 1) == 0 &&
                             at(&o, 2) == 2);
    mn_tensor_release(&o);
    CHECK("argmax/dim0_keepdim", mn_argreduce_dim(MN_OP_max, &o, &t, 0, true) == MN_OK && o.ndim == 2 && o.shape[0] == 1 &&
                                     mn_tensor_get(&o, (int64_t[]){0, 0}) == 1 && mn_tensor_get(&o, (int64_t[]){0, 1}) == 0 &&
                                     mn_tensor_get(&o, (int64_t[]){0, 2}) == 0);
    mn_tensor_release(&o);
    /* max / min along dim 0 (rows accumulated in order): NaN propagates. */
    CHECK("reduce_dim/max_dim0_nan", mn_reduce_dim(MN_OP_max, &o, &t, 0, false) == MN_OK && isnan(at(&o, 0)) &&
                                         at(&o, 1) == 5 && at(&o, 2) == 5);
    mn_tensor_release(&o);
    CHECK("reduce_dim/min_dim0_nan", mn_reduce_dim(MN_OP_min, &o, &t, 0, false) == MN_OK && isnan(at(&o, 0)) &&
                                         at(&o, 1) == -1 && at(&o, 2) == -3);
    mn_tensor_release(&o);
    CHECK("reduce_dim/max_dim1_nan", mn_reduce_dim(MN_OP_max, &o, &t, 1, false) == MN_OK && at(&o, 0) == 5 &&
                                         isnan(at(&o, 1)) && at(&o, 2) == -1);
    mn_tensor_release(&o);
    mn_tensor i64 = {0};
    mn_tensor_to_dtype(&i64, &t, MN_I64); /* the NaN becomes 0 */
    CHECK("argmin/i64_dim0", mn_argreduce_dim(MN_OP_min, &o, &i64, 0, false) == MN_OK && at(&o, 0) == 2 && at(&o, 1) == 2 &&
                                 at(&o, 2) == 2);
    mn_tensor_release(&o);
    CHECK("argreduce/sum_refused", mn_argreduce_dim(MN_OP_sum, &o, &t, 0, false) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("argreduce/sum_refused_message", mn_last_error(), "op must be max or min");
    mn_tensor e = {0};
    int64_t s20[2] = {2, 0};
    mn_tensor_zeros(&e, MN_F32, 2, s20, MN_CPU);
    CHECK("argmax/empty_dim", mn_argreduce_dim(MN_OP_max, &o, &e, 1, false) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("argmax/empty_dim_message", mn_last_error(), "argmax: cannot reduce dim 1 of size 0");
    mn_tensor_release(&e);
    mn_tensor_release(&i64);
    mn_tensor_release(&t);
    mn_tensor_release(&flat);
}

/* ---- matmul against a naive float64 triple loop ---- */

/* torch.matmul written out independently of ops.c: 1-d operands become a
 * row / column, batch dims broadcast from the right. Returns the relative L2
 * error of got, or INFINITY on a shape mismatch. */
static double matmul_error(const mn_tensor *a, const mn_tensor *b, const mn_tensor *got)
{
    int na = a->ndim, nb = b->ndim;
    int64_t m = na == 1 ? 1 : a->shape[na - 2], k = a->shape[na - 1], n = nb == 1 ? 1 : b->shape[nb - 1];
    int ba = na > 2 ? na - 2 : 0, bb = nb > 2 ? nb - 2 : 0, bn = ba > bb ? ba : bb;
    int64_t bshape[MN_MAX_DIMS], batch = 1;
    for (int i = 0; i < bn; i++) {
        int ia = i - (bn - ba), ib = i - (bn - bb);
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        bshape[i] = sa > sb ? sa : sb;
        batch *= bshape[i];
    }
    int want_ndim = bn + (na > 1) + (nb > 1);
    if (got->ndim != want_ndim) return INFINITY;
    for (int i = 0; i < bn; i++)
        if (got->shape[i] != bshape[i]) return INFINITY;
    double num = 0, den = 0;
    for (int64_t q = 0; q < batch; q++) {
        int64_t bi[MN_MAX_DIMS], rem = q;
        for (int i = bn - 1; i >= 0; i--) {
            bi[i] = rem % bshape[i];
            rem /= bshape[i];
        }
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double ref = 0;
                for (int64_t l = 0; l < k; l++) {
                    int64_t ia[MN_MAX_DIMS], ib[MN_MAX_DIMS];
                    for (int d = 0; d < ba; d++) ia[d] = a->shape[d] == 1 ? 0 : bi[d + bn - ba];
                    for (int d = 0; d < bb; d++) ib[d] = b->shape[d] == 1 ? 0 : bi[d + bn - bb];
                    if (na == 1) ia[0] = l;
                    else { ia[na - 2] = i; ia[na - 1] = l; }
                    if (nb == 1) ib[0] = l;
                    else { ib[nb - 2] = l; ib[nb - 1] = j; }
                    ref += mn_tensor_get(a, ia) * mn_tensor_get(b, ib);
                }
                int64_t io[MN_MAX_DIMS];
                int d = 0;
                for (; d < bn; d++) io[d] = bi[d];
                if (na > 1) io[d++] = i;
                if (nb > 1) io[d++] = j;
                double g = mn_tensor_get(got, io);
                num += (g - ref) * (g - ref);
                den += ref * ref;
            }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static mn_tensor rnd(mn_rng *rng, mn_dtype dt, int ndim, const int64_t *shape)
{
    mn_tensor t = {0};
    if (dt == MN_I64) mn_tensor_rand(&t, dt, ndim, shape, -5, 6, rng);
    else mn_tensor_randn(&t, dt, ndim, shape, 0, 1, rng);
    return t;
}

static void check_matmul(const char *label, const mn_tensor *a, const mn_tensor *b, mn_dtype want_dt)
{
    mn_tensor o = {0};
    mn_status st = mn_matmul(&o, a, b);
    double err = st == MN_OK && o.dtype == want_dt ? matmul_error(a, b, &o) : INFINITY;
    double tol = want_dt == MN_F32 ? 1e-5 : want_dt == MN_F64 ? 1e-13 : 0;
    if (!(err <= tol)) printf("  %s: status %d (%s), error %g\n", label, st, st ? mn_last_error() : "", err);
    CHECK(label, err <= tol);
    mn_tensor_release(&o);
}

static void test_matmul(void)
{
    mn_rng rng;
    mn_rng_seed(&rng, 99);
    static const struct { int na; int64_t a[4]; int nb; int64_t b[4]; } cases[] = {
        {1, {5}, 1, {5}},
        {1, {5}, 2, {5, 3}},
        {2, {4, 5}, 1, {5}},
        {2, {4, 5}, 2, {5, 3}},
        {3, {2, 4, 5}, 3, {2, 5, 3}},
        {4, {2, 1, 4, 5}, 3, {3, 5, 3}},
        {3, {6, 4, 5}, 2, {5, 3}},   /* folded into one product */
        {1, {5}, 3, {2, 5, 3}},
        {3, {2, 4, 5}, 1, {5}},
        {3, {3, 1, 5}, 3, {3, 5, 1}},
        {2, {1, 1}, 2, {1, 1}},
        {2, {0, 5}, 2, {5, 3}},
        {2, {4, 0}, 2, {0, 3}},     /* k = 0: zeros */
        {3, {1, 4, 5}, 3, {3, 5, 2}},
    };
    static const mn_dtype dts[3] = {MN_F32, MN_F64, MN_I64};
    for (int c = 0; c < COUNT(cases); c++)
        for (int d = 0; d < 3; d++) {
            mn_tensor a = rnd(&rng, dts[d], cases[c].na, cases[c].a), b = rnd(&rng, dts[d], cases[c].nb, cases[c].b);
            char label[96];
            snprintf(label, sizeof label, "matmul/case%d_%s", c, mn_dtype_name(dts[d]));
            check_matmul(label, &a, &b, dts[d]);
            mn_tensor_release(&a);
            mn_tensor_release(&b);
        }

    /* Random shapes, including batch broadcast and random 1-d operands. */
    for (int trial = 0; trial < 40; trial++) {
        int64_t m = 1 + (int64_t)(mn_rng_u64(&rng) % 9), k = 1 + (int64_t)(mn_rng_u64(&rng) % 9),
                n = 1 + (int64_t)(mn_rng_u64(&rng) % 9);
        int na = 1 + (int)(mn_rng_u64(&rng) % 4), nb = 1 + (int)(mn_rng_u64(&rng) % 4);
        int64_t as[4], bs[4];
        for (int i = 0; i < 4; i++) {
            int64_t s = 1 + (int64_t)(mn_rng_u64(&rng) % 3);
            as[i] = (mn_rng_u64(&rng) % 3) ? s : 1;
            bs[i] = (mn_rng_u64(&rng) % 3) ? s : 1;
        }
        if (na == 1) as[0] = k;
        else { as[na - 2] = m; as[na - 1] = k; }
        if (nb == 1) bs[0] = k;
        else { bs[nb - 2] = k; bs[nb - 1] = n; }
        mn_dtype dt = dts[trial % 2];
        mn_tensor a = rnd(&rng, dt, na, as), b = rnd(&rng, dt, nb, bs);
        char label[96];
        snprintf(label, sizeof label, "matmul/random%d_%dd_%dd_%s", trial, na, nb, mn_dtype_name(dt));
        check_matmul(label, &a, &b, dt);
        mn_tensor_release(&a);
        mn_tensor_release(&b);
    }

    /* Layouts: a transposed operand (BLAS reads it transposed), strided
     * batches, a step-2 slice and a stride-0 (expanded) operand (copied
     * first), mixed dtypes (promoted). */
    int64_t s54[2] = {5, 4}, s56[2] = {5, 6}, s386[3] = {3, 8, 6}, s62[2] = {6, 2}, s43[2] = {4, 3}, s52[2] = {5, 2},
            s15[2] = {1, 5}, s45[2] = {4, 5};
    mn_tensor a = rnd(&rng, MN_F32, 2, s54), at_ = {0}, b = rnd(&rng, MN_F32, 2, s56), c = rnd(&rng, MN_F64, 3, s386),
              cs = {0}, cst = {0}, d = rnd(&rng, MN_F64, 2, s62), e = rnd(&rng, MN_F64, 2, s43), sl = {0},
              f = rnd(&rng, MN_F64, 2, s52), r = rnd(&rng, MN_F32, 2, s15), rx = {0};
    mn_view_transpose(&at_, &a, 0, 1);         /* [4, 5], column-major */
    check_matmul("matmul/transposed_a", &at_, &b, MN_F32);
    mn_view_slice(&cs, &c, 1, 0, 8, 2);       /* [3, 4, 6], row stride 12 */
    check_matmul("matmul/strided_rows_batched", &cs, &d, MN_F64);
    mn_view_transpose(&cst, &cs, 1, 2);       /* [3, 6, 4], column stride 12 */
    check_matmul("matmul/strided_cols_batched", &cst, &e, MN_F64);
    mn_view_slice(&sl, &b, 1, 0, 6, 2);       /* [5, 3], column stride 2 */
    check_matmul("matmul/step2_slice", &at_, &sl, MN_F32);
    mn_view_expand(&rx, &r, 2, s45);          /* [4, 5], row stride 0 */
    check_matmul("matmul/expanded_rows", &rx, &f, MN_F64);
    check_matmul("matmul/mixed_f32_f64", &at_, &f, MN_F64);
    mn_tensor o = {0};
    CHECK("matmul/inner_mismatch", mn_matmul(&o, &a, &b) == MN_ERR_ARG && o.storage == NULL);
    CHECK_STR_CONTAINS("matmul/inner_mismatch_message", mn_last_error(), "matmul: inner sizes differ: 5x4 @ 5x6");
    int64_t s23[2] = {2, 3}, s45b[2] = {4, 5}, s234[3] = {2, 3, 4}, s345[3] = {3, 4, 5};
    mn_tensor g = rnd(&rng, MN_F32, 2, s23), h = rnd(&rng, MN_F32, 2, s45b), sc = {0};
    CHECK("matmul/inner_mismatch_2", mn_matmul(&o, &g, &h) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("matmul/inner_mismatch_2_message", mn_last_error(), "matmul: inner sizes differ: 2x3 @ 4x5");
    mn_tensor_full(&sc, MN_F32, 0, NULL, 1, MN_CPU);
    CHECK("matmul/scalar_refused", mn_matmul(&o, &sc, &g) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("matmul/scalar_refused_message", mn_last_error(), "at least 1 dim");
    mn_tensor p = rnd(&rng, MN_F32, 3, s234), q = rnd(&rng, MN_F32, 3, s345);
    CHECK("matmul/batch_mismatch", mn_matmul(&o, &p, &q) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("matmul/batch_mismatch_message", mn_last_error(), "batch dims do not broadcast: 2x3x4 @ 3x4x5");
    mn_tensor *all[] = {&a, &at_, &b, &c, &cs, &cst, &d, &e, &sl, &f, &r, &rx, &g, &h, &sc, &p, &q};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

static void test_where(void)
{
    double cv[4] = {1, 0, NAN, 1e-300}, av[4] = {1, 2, 3, 4};
    mn_tensor c = vec(MN_F64, 4, cv, 1), a = vec(MN_F32, 4, av, 2), b = {0}, o = {0};
    mn_tensor_full(&b, MN_I64, 0, NULL, 9, MN_CPU);
    CHECK("where/values", mn_where(&o, &c, &a, &b) == MN_OK && o.dtype == MN_F32 && at(&o, 0) == 1 && at(&o, 1) == 9 &&
                              at(&o, 2) == 3 && at(&o, 3) == 4);
    mn_tensor_release(&o);
    /* c [3,1] (i64) with a [1,4] and b [4] -> [3,4]. */
    double ci[3] = {0, 1, 0};
    mn_tensor c3 = vec(MN_I64, 3, ci, 1), c31 = {0}, a14 = {0}, b4 = vec(MN_F64, 4, av, 1);
    mn_view_unsqueeze(&c31, &c3, 1);
    mn_view_unsqueeze(&a14, &a, 0);
    CHECK("where/broadcast", mn_where(&o, &c31, &a14, &b4) == MN_OK && o.ndim == 2 && o.shape[0] == 3 && o.shape[1] == 4 &&
                                 o.dtype == MN_F64 && mn_tensor_get(&o, (int64_t[]){1, 2}) == 3 &&
                                 mn_tensor_get(&o, (int64_t[]){2, 2}) == 3 && mn_tensor_get(&o, (int64_t[]){0, 3}) == 4);
    mn_tensor_release(&o);
    double two[2] = {1, 2};
    mn_tensor bad = vec(MN_F32, 2, two, 1);
    CHECK("where/bad_shapes", mn_where(&o, &c, &a, &bad) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("where/bad_shapes_message", mn_last_error(), "where: shapes 4 and 2 do not broadcast");
    mn_tensor *all[] = {&c, &a, &b, &c3, &c31, &a14, &b4, &bad};
    for (int i = 0; i < COUNT(all); i++) mn_tensor_release(all[i]);
}

static void test_creation(void)
{
    mn_tensor t = {0};
    int64_t s22[2] = {2, 2};
    CHECK("create/full", mn_tensor_full(&t, MN_F32, 2, s22, 3.5, MN_CPU) == MN_OK &&
                             mn_tensor_get(&t, (int64_t[]){1, 1}) == 3.5);
    mn_tensor_release(&t);
    CHECK("create/arange_tenths", mn_tensor_arange(&t, MN_F64, 0, 1, 0.1) == MN_OK && t.shape[0] == 10 &&
                                      fabs(at(&t, 9) - 0.9) < 1e-15);
    mn_tensor_release(&t);
    CHECK("create/arange_thirds", mn_tensor_arange(&t, MN_F64, 0, 0.3, 0.1) == MN_OK && t.shape[0] == 3);
    mn_tensor_release(&t);
    CHECK("create/arange_i64", mn_tensor_arange(&t, MN_I64, 0, 5, 1) == MN_OK && t.dtype == MN_I64 && t.shape[0] == 5 &&
                                   at(&t, 4) == 4);
    mn_tensor_release(&t);
    CHECK("create/arange_down", mn_tensor_arange(&t, MN_F32, 5, 0, -1.5) == MN_OK && t.shape[0] == 4 && at(&t, 3) == 0.5);
    mn_tensor_release(&t);
    CHECK("create/arange_wrong_sign_is_empty", mn_tensor_arange(&t, MN_F32, 5, 0, 1) == MN_OK && t.shape[0] == 0);
    mn_tensor_release(&t);
    CHECK("create/arange_step0", mn_tensor_arange(&t, MN_F32, 0, 1, 0) == MN_ERR_ARG && t.storage == NULL);
    CHECK_STR_CONTAINS("create/arange_step0_message", mn_last_error(), "arange: step must not be 0");
    CHECK("create/arange_nan", mn_tensor_arange(&t, MN_F32, 0, NAN, 1) == MN_ERR_ARG);
    CHECK("create/eye", mn_tensor_eye(&t, MN_F64, 2, 3) == MN_OK && t.shape[0] == 2 && t.shape[1] == 3 &&
                            mn_tensor_get(&t, (int64_t[]){1, 1}) == 1 && mn_tensor_get(&t, (int64_t[]){1, 2}) == 0 &&
                            mn_tensor_get(&t, (int64_t[]){0, 0}) == 1 && mn_tensor_get(&t, (int64_t[]){1, 0}) == 0);
    mn_tensor_release(&t);
    CHECK("create/eye_bad", mn_tensor_eye(&t, MN_F64, -1, 3) == MN_ERR_ARG);
    CHECK("create/linspace", mn_tensor_linspace(&t, MN_F64, 0, 1, 5) == MN_OK && t.shape[0] == 5 && at(&t, 1) == 0.25 &&
                                 at(&t, 4) == 1.0);
    mn_tensor_release(&t);
    CHECK("create/linspace_last_exact", mn_tensor_linspace(&t, MN_F64, 0.1, 0.7, 7) == MN_OK && at(&t, 6) == 0.7);
    mn_tensor_release(&t);
    CHECK("create/linspace_one", mn_tensor_linspace(&t, MN_F32, 2, 3, 1) == MN_OK && t.shape[0] == 1 && at(&t, 0) == 2);
    mn_tensor_release(&t);
    CHECK("create/linspace_zero", mn_tensor_linspace(&t, MN_F32, 2, 3, 0) == MN_OK && t.shape[0] == 0);
    mn_tensor_release(&t);
    CHECK("create/linspace_negative", mn_tensor_linspace(&t, MN_F32, 2, 3, -1) == MN_ERR_ARG);
}

int main(void)
{
    test_coverage();
    test_unary_values();
    test_binary_values();
    test_reduce_values();
    test_promotion();
    test_broadcasting();
    test_scalars();
    test_reduce_random();
    test_argreduce();
    test_matmul();
    test_where();
    test_creation();
    return CHECK_DONE();
}
