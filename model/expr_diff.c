/* expr_diff.c: the symbolic algebra of expr.h: the simplifier
 * (mn_expr_simplify) and the derivative (mn_expr_diff), which builds its
 * result through the simplifying constructors below so that derivatives stay
 * readable (d/dr r^2 is "2 * r", not a tower of ones and zeros).
 *
 * Rules never change a value that the original computes as finite, with two
 * accepted exceptions where the original is finite but the sign of a zero may
 * differ (x + 0 -> x, 0 - x -> -x). x * 0 -> 0, 0 / x -> 0, x - x -> 0 and
 * x / x -> 1 do
 * change Inf or NaN inputs into 0: the derivative rules produce such products
 * constantly (a * db with db = 0), and keeping them would leave NaN where
 * the true derivative term is absent, so we accept the change. Constants are
 * reassociated only through a power of two, so no rounding moves; folding
 * computes exactly what evaluation would. Constant folding keeps
 * only finite results, so an expression like 1/0 stays visible as written. */
#include "expr.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------ predicates */

static bool is_num(const mn_expr *e, double v) { return e->kind == MN_EX_NUM && e->num == v; }
static bool is_const(const mn_expr *e) { return e->kind == MN_EX_NUM; }
static bool is_negative_const(const mn_expr *e) { return e->kind == MN_EX_NUM && e->num < 0; }
static bool is_comparison(const mn_expr *e) { return e->kind >= MN_EX_LT && e->kind <= MN_EX_GE; }

static bool expr_equal(const mn_expr *a, const mn_expr *b)
{
    if (a == b) return true;
    if (a->kind != b->kind || a->nargs != b->nargs) return false;
    if (a->kind == MN_EX_NUM) return a->num == b->num && signbit(a->num) == signbit(b->num);
    if (a->kind == MN_EX_VAR) return strcmp(a->name, b->name) == 0;
    if (a->kind == MN_EX_CALL && a->func != b->func) return false;
    for (int i = 0; i < a->nargs; i++)
        if (!expr_equal(a->args[i], b->args[i])) return false;
    return true;
}

/* Give up a node and keep one part of it. */
static mn_expr *take_arg(mn_expr *e, int i)
{
    mn_expr *part = mn_expr_ref(e->args[i]);
    mn_expr_unref(e);
    return part;
}

static mn_expr *drop2_keep(mn_expr *keep, mn_expr *drop)
{
    mn_expr_unref(drop);
    return keep;
}

static mn_expr *num_replacing(double v, mn_expr *a, mn_expr *b)
{
    mn_expr_unref(a);
    mn_expr_unref(b);
    return mn_expr_num(v);
}

/* Replace an all-constant node by its value when that value is finite. */
static mn_expr *fold(mn_expr *e)
{
    if (!e) return NULL;
    for (int i = 0; i < e->nargs; i++)
        if (!is_const(e->args[i])) return e;
    double v = mn_expr_eval(e, NULL, NULL, 0, NULL, NULL, 0);
    if (!isfinite(v)) return e;
    mn_expr_unref(e);
    return mn_expr_num(v);
}

/* --------------------------------------------- simplifying constructors */

/* Each takes ownership of already simplified operands (NULL propagates) and
 * returns a simplified node. */
static mn_expr *s_bin(mn_expr_kind kind, mn_expr *a, mn_expr *b);

static mn_expr *s_neg(mn_expr *a)
{
    if (!a) return NULL;
    if (is_const(a)) return num_replacing(-a->num, a, NULL);
    if (a->kind == MN_EX_NEG) return take_arg(a, 0);
    return mn_expr_unary(MN_EX_NEG, a);
}

static mn_expr *s_add(mn_expr *a, mn_expr *b)
{
    if (is_num(a, 0)) return drop2_keep(b, a);
    if (is_num(b, 0)) return drop2_keep(a, b);
    if (b->kind == MN_EX_NEG) return s_bin(MN_EX_SUB, a, take_arg(b, 0));
    if (is_negative_const(b)) return s_bin(MN_EX_SUB, a, num_replacing(-b->num, b, NULL));
    if (a->kind == MN_EX_NEG) return s_bin(MN_EX_SUB, b, take_arg(a, 0));
    return fold(mn_expr_binary(MN_EX_ADD, a, b));
}

static mn_expr *s_sub(mn_expr *a, mn_expr *b)
{
    if (is_num(b, 0)) return drop2_keep(a, b);
    if (is_num(a, 0)) return s_neg(drop2_keep(b, a));
    if (b->kind == MN_EX_NEG) return s_bin(MN_EX_ADD, a, take_arg(b, 0));
    if (is_negative_const(b)) return s_bin(MN_EX_ADD, a, num_replacing(-b->num, b, NULL));
    if (expr_equal(a, b)) return num_replacing(0, a, b);
    return fold(mn_expr_binary(MN_EX_SUB, a, b));
}

/* Constants in [2^-64, 2^64]: c1 * (c2 * x) == (c1 c2) * x exactly when c1
 * or c2 is a power of two and nothing leaves the normal range, which for
 * such constants takes an operand beyond 2^900 or below 2^-900. */
static bool is_moderate(const mn_expr *e)
{
    double m = fabs(e->num);
    return is_const(e) && m >= 0x1p-64 && m <= 0x1p64;
}

static bool is_moderate_power_of_two(const mn_expr *e)
{
    int exponent;
    return is_moderate(e) && frexp(fabs(e->num), &exponent) == 0.5;
}

static mn_expr *s_mul(mn_expr *a, mn_expr *b)
{
    if (is_num(a, 0) || is_num(b, 0)) return num_replacing(0, a, b);
    if (is_num(a, 1)) return drop2_keep(b, a);
    if (is_num(b, 1)) return drop2_keep(a, b);
    if (is_num(a, -1)) return s_neg(drop2_keep(b, a));
    if (is_num(b, -1)) return s_neg(drop2_keep(a, b));
    if (is_const(b) && !is_const(a)) return s_mul(b, a); /* "2 * r", not "r * 2" */
    if (a->kind == MN_EX_NEG && b->kind == MN_EX_NEG)
        return s_bin(MN_EX_MUL, take_arg(a, 0), take_arg(b, 0));
    if (a->kind == MN_EX_NEG) return s_neg(s_bin(MN_EX_MUL, take_arg(a, 0), b));
    if (b->kind == MN_EX_NEG) return s_neg(s_bin(MN_EX_MUL, a, take_arg(b, 0)));
    /* c1 * (c2 * x) -> (c1 c2) * x, only where that moves no rounding: one
     * factor a power of two ("0.5 * (2 * r)" from a derivative becomes "r") */
    if (b->kind == MN_EX_MUL && is_moderate(a) && is_moderate(b->args[0]) &&
        (is_moderate_power_of_two(a) || is_moderate_power_of_two(b->args[0]))) {
        mn_expr *x = mn_expr_ref(b->args[1]);
        return s_bin(MN_EX_MUL, num_replacing(a->num * b->args[0]->num, a, b), x);
    }
    return fold(mn_expr_binary(MN_EX_MUL, a, b));
}

static mn_expr *s_div(mn_expr *a, mn_expr *b)
{
    if (is_num(b, 1)) return drop2_keep(a, b);
    if (is_num(b, -1)) return s_neg(drop2_keep(a, b));
    if (is_num(a, 0) && !is_const(b)) return num_replacing(0, a, b);
    if (!is_const(a) && expr_equal(a, b)) return num_replacing(1, a, b); /* x / x */
    if (a->kind == MN_EX_NEG) return s_neg(s_bin(MN_EX_DIV, take_arg(a, 0), b));
    if (b->kind == MN_EX_NEG) return s_neg(s_bin(MN_EX_DIV, a, take_arg(b, 0)));
    return fold(mn_expr_binary(MN_EX_DIV, a, b));
}

static mn_expr *s_pow(mn_expr *a, mn_expr *b)
{
    if (is_num(b, 1)) return drop2_keep(a, b);
    /* pow(x, 0) and pow(1, y) are 1 for every x and y, NaN included */
    if (is_num(b, 0) || is_num(a, 1)) return num_replacing(1, a, b);
    return fold(mn_expr_binary(MN_EX_POW, a, b));
}

static mn_expr *s_bin(mn_expr_kind kind, mn_expr *a, mn_expr *b)
{
    if (!a || !b) {
        mn_expr_unref(a);
        mn_expr_unref(b);
        return NULL;
    }
    switch (kind) {
    case MN_EX_ADD: return s_add(a, b);
    case MN_EX_SUB: return s_sub(a, b);
    case MN_EX_MUL: return s_mul(a, b);
    case MN_EX_DIV: return s_div(a, b);
    case MN_EX_POW: return s_pow(a, b);
    default: return fold(mn_expr_binary(kind, a, b));
    }
}

static mn_expr *s_call(mn_expr_func f, int nargs, mn_expr **args)
{
    for (int i = 0; i < nargs; i++)
        if (!args[i]) {
            for (int k = 0; k < nargs; k++) mn_expr_unref(args[k]);
            return NULL;
        }
    if (f == MN_FN_WHERE) {
        mn_expr *c = args[0], *a = args[1], *b = args[2];
        if (is_const(c)) { /* c != 0 ? a : b, NaN counting as true */
            mn_expr *keep = c->num != 0 ? a : b;
            mn_expr_unref(c);
            return drop2_keep(keep, keep == a ? b : a);
        }
        if (expr_equal(a, b)) return drop2_keep(a, drop2_keep(b, c));
        if (is_comparison(c) && is_num(a, 1) && is_num(b, 0)) { /* c is already 1 or 0 */
            mn_expr_unref(a);
            return drop2_keep(c, b);
        }
    }
    if ((f == MN_FN_MIN || f == MN_FN_MAX) && expr_equal(args[0], args[1]))
        return drop2_keep(args[0], args[1]);
    if (f == MN_FN_ABS && (args[0]->kind == MN_EX_NEG ||
                           (args[0]->kind == MN_EX_CALL && args[0]->func == MN_FN_ABS))) {
        mn_expr *inner = take_arg(args[0], 0);
        return s_call(MN_FN_ABS, 1, &inner);
    }
    return fold(mn_expr_call(f, nargs, args));
}

static mn_expr *s_call1(mn_expr_func f, mn_expr *a) { return s_call(f, 1, &a); }

static mn_expr *s_call3(mn_expr_func f, mn_expr *a, mn_expr *b, mn_expr *c)
{
    mn_expr *args[3] = {a, b, c};
    return s_call(f, 3, args);
}

/* ------------------------------------------------------------ simplify */

/* Rebuild bottom-up through the simplifying constructors, substituting
 * constants on the way (simplify is bind with no constants). */
mn_expr *mn_expr_bind(const mn_expr *e, const char *const *consts, const double *const_values,
                      int nconsts)
{
    if (!e) {
        mn_fail(MN_ERR_ARG, "expression is NULL");
        return NULL;
    }
    if (e->kind == MN_EX_VAR) {
        for (int i = 0; i < nconsts; i++)
            if (consts[i] && strcmp(consts[i], e->name) == 0) return mn_expr_num(const_values[i]);
        return mn_expr_ref((mn_expr *)e);
    }
    if (e->kind == MN_EX_NUM) return mn_expr_ref((mn_expr *)e);
    mn_expr *args[3] = {NULL, NULL, NULL};
    bool failed = false;
    for (int i = 0; i < e->nargs; i++) {
        args[i] = mn_expr_bind(e->args[i], consts, const_values, nconsts);
        failed |= args[i] == NULL;
    }
    if (failed) {
        for (int i = 0; i < e->nargs; i++) mn_expr_unref(args[i]);
        return NULL;
    }
    if (e->kind == MN_EX_NEG) return s_neg(args[0]);
    if (e->kind == MN_EX_CALL) return s_call(e->func, e->nargs, args);
    return s_bin(e->kind, args[0], args[1]);
}

mn_expr *mn_expr_simplify(const mn_expr *e) { return mn_expr_bind(e, NULL, NULL, 0); }

/* ----------------------------------------------------------- derivative */

static mn_expr *num(double v) { return mn_expr_num(v); }
static mn_expr *ref(const mn_expr *e) { return mn_expr_ref((mn_expr *)e); }
static mn_expr *add(mn_expr *a, mn_expr *b) { return s_bin(MN_EX_ADD, a, b); }
static mn_expr *sub(mn_expr *a, mn_expr *b) { return s_bin(MN_EX_SUB, a, b); }
static mn_expr *mul(mn_expr *a, mn_expr *b) { return s_bin(MN_EX_MUL, a, b); }
static mn_expr *dvd(mn_expr *a, mn_expr *b) { return s_bin(MN_EX_DIV, a, b); }
static mn_expr *pw(mn_expr *a, mn_expr *b) { return s_bin(MN_EX_POW, a, b); }

static mn_expr *diff_rec(const mn_expr *e, const char *var);

/* f'(a) * da for a one-argument function f */
static mn_expr *diff_call1(const mn_expr *e, const char *var)
{
    const mn_expr *a = e->args[0];
    mn_expr *outer = NULL; /* f'(a) */
    switch (e->func) {
    case MN_FN_ABS: outer = s_call1(MN_FN_SIGN, ref(a)); break;
    case MN_FN_SQRT: outer = dvd(num(0.5), ref(e)); break;
    case MN_FN_EXP: outer = ref(e); break;
    case MN_FN_LOG: return dvd(diff_rec(a, var), ref(a));
    case MN_FN_TANH: outer = sub(num(1), pw(ref(e), num(2))); break;
    case MN_FN_SIGMOID: outer = mul(ref(e), sub(num(1), ref(e))); break;
    case MN_FN_SOFTPLUS: outer = s_call1(MN_FN_SIGMOID, ref(a)); break;
    case MN_FN_SIGN: return num(0);
    case MN_FN_RELU: outer = s_bin(MN_EX_GT, ref(a), num(0)); break;
    case MN_FN_SILU: { /* s (1 + a (1 - s)), s = sigmoid(a) */
        mn_expr *s = s_call1(MN_FN_SIGMOID, ref(a));
        outer = mul(ref(s), add(num(1), mul(ref(a), sub(num(1), ref(s)))));
        mn_expr_unref(s);
        break;
    }
    case MN_FN_GELU: outer = s_call1(MN_FN_GELU_GRAD, ref(a)); break;
    case MN_FN_GELU_GRAD: /* d/dx (Phi + x phi) = phi (2 - x^2) */
        outer = mul(mul(num(0.39894228040143267794),
                        s_call1(MN_FN_EXP, mul(num(-0.5), pw(ref(a), num(2))))),
                    sub(num(2), pw(ref(a), num(2))));
        break;
    default:
        mn_fail(MN_ERR_ARG, "no derivative for function %s", mn_expr_func_name(e->func));
        return NULL;
    }
    return mul(outer, diff_rec(a, var));
}

static mn_expr *diff_pow(const mn_expr *e, const char *var)
{
    const mn_expr *a = e->args[0], *b = e->args[1];
    if (!mn_expr_uses(b, var)) /* b a^(b-1) a' */
        return mul(mul(ref(b), pw(ref(a), sub(ref(b), num(1)))), diff_rec(a, var));
    mn_expr *log_a = s_call1(MN_FN_LOG, ref(a));
    if (!mn_expr_uses(a, var)) /* a^b log(a) b' */
        return mul(mul(ref(e), log_a), diff_rec(b, var));
    /* a^b (b' log a + b a' / a) */
    return mul(ref(e), add(mul(diff_rec(b, var), log_a),
                           dvd(mul(ref(b), diff_rec(a, var)), ref(a))));
}

static mn_expr *diff_rec(const mn_expr *e, const char *var)
{
    if (!mn_expr_uses(e, var)) return num(0);
    const mn_expr *a = e->args[0], *b = e->args[1];
    switch (e->kind) {
    case MN_EX_NUM: return num(0);
    case MN_EX_VAR: return num(1);
    case MN_EX_NEG: return s_neg(diff_rec(a, var));
    case MN_EX_ADD: return add(diff_rec(a, var), diff_rec(b, var));
    case MN_EX_SUB: return sub(diff_rec(a, var), diff_rec(b, var));
    case MN_EX_MUL: return add(mul(diff_rec(a, var), ref(b)), mul(ref(a), diff_rec(b, var)));
    case MN_EX_DIV:
        if (!mn_expr_uses(b, var)) return dvd(diff_rec(a, var), ref(b));
        /* (a' b - a b') / b^2 */
        return dvd(sub(mul(diff_rec(a, var), ref(b)), mul(ref(a), diff_rec(b, var))),
                   pw(ref(b), num(2)));
    case MN_EX_POW: return diff_pow(e, var);
    case MN_EX_LT: case MN_EX_LE: case MN_EX_GT: case MN_EX_GE: return num(0);
    case MN_EX_CALL:
        switch (e->func) {
        case MN_FN_MIN:
            return s_call3(MN_FN_WHERE, s_bin(MN_EX_LE, ref(a), ref(b)), diff_rec(a, var),
                           diff_rec(b, var));
        case MN_FN_MAX:
            return s_call3(MN_FN_WHERE, s_bin(MN_EX_GE, ref(a), ref(b)), diff_rec(a, var),
                           diff_rec(b, var));
        case MN_FN_WHERE:
            return s_call3(MN_FN_WHERE, ref(a), diff_rec(b, var), diff_rec(e->args[2], var));
        default: return diff_call1(e, var);
        }
    }
    return NULL;
}

mn_expr *mn_expr_diff(const mn_expr *e, const char *var)
{
    if (!e || !var) {
        mn_fail(MN_ERR_ARG, "expression derivative: %s is NULL", e ? "variable" : "expression");
        return NULL;
    }
    /* Differentiate the simplified form: the derivative reuses its parts, and
     * the simplifying constructors expect simplified operands. */
    mn_expr *s = mn_expr_simplify(e);
    if (!s) return NULL;
    mn_expr *d = diff_rec(s, var);
    mn_expr_unref(s);
    return d;
}
