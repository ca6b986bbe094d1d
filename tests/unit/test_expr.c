/* test_expr.c: unit tests of the expression IR (model/expr*.c): parser
 * precedence and errors, string round trips, simplifier, derivatives against
 * finite differences, the compiled program, name checks, and the generated C
 * compiled by the system compiler. */
#include "check.h"
#include "expr.h"

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

/* ------------------------------------------------------------- helpers */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}
static double rng_uniform(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }
static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }

static const char *const XYZ[] = {"x", "y", "z"};

static mn_expr *parse_or_null(const char *src)
{
    mn_expr *e = NULL;
    if (mn_expr_parse(src, &e) != MN_OK) {
        printf("# parse of '%s' failed: %s\n", src, mn_last_error());
        return NULL;
    }
    return e;
}

static double eval_xyz(const mn_expr *e, double x, double y, double z)
{
    double values[3] = {x, y, z};
    return mn_expr_eval(e, XYZ, values, 3, NULL, NULL, 0);
}

/* Same bits, or both NaN. */
static bool same_value(double a, double b)
{
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return a == b && signbit(a) == signbit(b);
}

/* A random expression over x, y, z using every node kind and function. */
static mn_expr *random_expr(int depth)
{
    if (depth == 0 || rng_uniform() < 0.25) {
        if (rng_uniform() < 0.6) return mn_expr_var(XYZ[rng_int(3)]);
        static const double specials[] = {0, 1, 2, 0.5, -2.5, -0.0, 1e-7, 3.25e12, 0.1,
                                          1.0 / 3.0, 7, 123456.789, -1, 1e300};
        int pick = rng_int(20);
        if (pick < 14) return mn_expr_num(specials[pick]);
        if (pick == 14) return mn_expr_num(rng_uniform() < 0.5 ? INFINITY : -INFINITY);
        if (pick == 15) return mn_expr_num(NAN);
        return mn_expr_num((rng_uniform() - 0.5) * 20);
    }
    int choice = rng_int(12);
    if (choice == 0) return mn_expr_unary(MN_EX_NEG, random_expr(depth - 1));
    if (choice <= 6) {
        static const mn_expr_kind kinds[] = {MN_EX_ADD, MN_EX_SUB, MN_EX_MUL, MN_EX_DIV,
                                             MN_EX_POW, MN_EX_LT,  MN_EX_LE,  MN_EX_GT, MN_EX_GE};
        mn_expr_kind kind = kinds[rng_int(9)];
        mn_expr *a = random_expr(depth - 1);
        return mn_expr_binary(kind, a, random_expr(depth - 1));
    }
    mn_expr_func f = (mn_expr_func)rng_int(MN_FN_COUNT);
    mn_expr *args[3] = {NULL, NULL, NULL};
    int n = mn_expr_func_arity(f);
    for (int i = 0; i < n; i++) args[i] = random_expr(depth - 1);
    return mn_expr_call(f, n, args);
}

static double random_point(void)
{
    int pick = rng_int(10);
    if (pick == 0) return 0;
    if (pick == 1) return 1;
    return (rng_uniform() - 0.5) * 6;
}

/* ---------------------------------------------------- precedence table */

static void test_precedence(void)
{
    static const struct {
        const char *src;
        double want;
    } cases[] = {
        {"1 + 2 * 3", 7},          {"(1 + 2) * 3", 9},       {"2 ^ 3 ^ 2", 512},
        {"-2^2", -4},              {"(-2)^2", 4},            {"2^-1", 0.5},
        {"-2^-2", -0.25},          {"10 - 3 - 2", 5},        {"24 / 4 / 2", 3},
        {"2 * 3 ^ 2", 18},         {"-3 * 2", -6},           {"2*3+4*5", 26},
        {"2*(3+4)*5", 70},         {"1 < 2", 1},             {"1 + 1 <= 2", 1},
        {"3 > 4", 0},              {"2 >= 2", 1},            {"1 - 2 < 3 - 4", 0},
        {"--3", 3},                {"- - 3", 3},             {"2 - -3", 5},
        {"2 * -3", -6},            {"1e-3 * 1000", 1},       {".5 + 1.5", 2},
        {"2.5e2", 250},            {"1E+2", 100},            {"5.", 5},
        {"max(1, 2) + min(3, 4)", 5}, {"where(1 < 2, 10, 20)", 10}, {"where(0, 10, 20)", 20},
        {"abs(-3)", 3},            {"sign(-2)", -1},         {"sign(0)", 0},
        {"relu(-1)", 0},           {"relu(2)", 2},           {"sqrt(16)", 4},
        {"exp(0)", 1},             {"log(1)", 0},            {"tanh(0)", 0},
        {"sigmoid(0)", 0.5},       {"softplus(0)", 0.69314718055994531},
        {"silu(1)", 0.73105857863000490}, {"gelu(1)", 0.84134474606854293},
        {"_gelu_grad(0)", 0.5},    {"softplus(1000)", 1000}, {"softplus(-1000)", 0},
        {"sigmoid(-1000)", 0},     {"sigmoid(1000)", 1},     {"x^2 - y", 1},
        {"-x^2", -4},              {"x * y ^ 2 / 3", 6},     {"  1\t+\n2 ", 3},
        {"(x < y) + (x >= y)", 1}, {"2^3^-1", 1.2599210498948732},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[128];
        snprintf(name, sizeof name, "precedence '%s'", cases[i].src);
        for (char *c = name; *c; c++) /* one line per check */
            if (*c == '\n' || *c == '\t') *c = ' ';
        mn_expr *e = parse_or_null(cases[i].src);
        CHECK_NEAR(name, e ? eval_xyz(e, 2, 3, 0) : NAN, cases[i].want, 1e-15);
        mn_expr_unref(e);
    }
}

/* -------------------------------------------------------------- errors */

static void test_errors(void)
{
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"y - $v", "expression 'y - $v': unexpected character '$' at position 5"},
        {"foo(y)", "expression 'foo(y)': unknown function 'foo' at position 1"},
        {"max(y)", "expression 'max(y)': max takes 2 arguments, got 1 at position 1"},
        {"1 + where(1, 2)", "expression '1 + where(1, 2)': where takes 3 arguments, got 2 at position 5"},
        {"abs(1, 2)", "expression 'abs(1, 2)': abs takes 1 argument, got 2 at position 1"},
        {"max()", "expression 'max()': max takes 2 arguments, got 0 at position 1"},
        {"y +", "expression 'y +': expected a number, a name or '(', found end of expression at position 4"},
        {"(y", "expression '(y': expected ')', found end of expression at position 3"},
        {"y)", "expression 'y)': unexpected ')' at position 2"},
        {"y v", "expression 'y v': unexpected 'v' at position 3"},
        {"y < v < r", "expression 'y < v < r': comparisons do not chain: unexpected '<' at position 7"},
        {"1e", "expression '1e': malformed number '1e' at position 1"},
        {"2x + 1", "expression '2x + 1': malformed number '2x' at position 1"},
        {"1.2.3", "expression '1.2.3': malformed number '1.2.3' at position 1"},
        {"1e999", "expression '1e999': number '1e999' out of range at position 1"},
        {"abs + 1", "expression 'abs + 1': expected '(' after function 'abs', found '+' at position 5"},
        {"", "expression '': empty expression"},
        {"   ", "expression '   ': empty expression"},
        {"y == v", "expression 'y == v': unexpected character '=' at position 3"},
        {"max(1 2)", "expression 'max(1 2)': expected ',' or ')', found '2' at position 7"},
        {"y * * v", "expression 'y * * v': expected a number, a name or '(', found '*' at position 5"},
        {"y\xc3\xa9", "expression 'y\xc3\xa9': unexpected character '\\xc3' at position 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[128];
        snprintf(name, sizeof name, "error '%s'", cases[i].src);
        mn_expr *e = (mn_expr *)1;
        mn_clear_error();
        mn_status st = mn_expr_parse(cases[i].src, &e);
        bool ok = st == MN_ERR_ARG && e == NULL && strcmp(mn_last_error(), cases[i].want) == 0;
        if (!ok) printf("# got status %d, message: %s\n", (int)st, mn_last_error());
        CHECK(name, ok);
        if (st == MN_OK) mn_expr_unref(e);
    }

    char deep[1024] = "";
    for (int i = 0; i < 300; i++) strcat(deep, "(");
    strcat(deep, "1");
    for (int i = 0; i < 300; i++) strcat(deep, ")");
    mn_expr *e = NULL;
    CHECK("error nesting depth status", mn_expr_parse(deep, &e) == MN_ERR_ARG && !e);
    CHECK_STR_CONTAINS("error nesting depth message", mn_last_error(), "nested too deeply");
    CHECK("error NULL source", mn_expr_parse(NULL, &e) == MN_ERR_ARG);

    mn_expr *args[1] = {mn_expr_var("x")};
    CHECK("call arity refused", mn_expr_call(MN_FN_MAX, 1, args) == NULL);
    CHECK_STR_CONTAINS("call arity message", mn_last_error(), "max takes 2 arguments, got 1");
    CHECK("binary NULL propagates", mn_expr_binary(MN_EX_ADD, mn_expr_num(1), NULL) == NULL);
}

/* --------------------------------------------------------- round trips */

static void test_round_trip(void)
{
    rng_state = 12345;
    int failures = 0, idempotent_failures = 0, total = 500;
    for (int i = 0; i < total; i++) {
        mn_expr *e = random_expr(1 + i % 6);
        char *text = e ? mn_expr_to_string(e) : NULL;
        mn_expr *back = text ? parse_or_null(text) : NULL;
        char *text2 = back ? mn_expr_to_string(back) : NULL;
        bool ok = back != NULL;
        for (int k = 0; ok && k < 6; k++) {
            double x = random_point(), y = random_point(), z = random_point();
            double a = eval_xyz(e, x, y, z), b = eval_xyz(back, x, y, z);
            if (!same_value(a, b)) {
                ok = false;
                printf("# round trip '%s': %.17g vs %.17g at (%g, %g, %g)\n", text, a, b, x, y, z);
            }
        }
        if (ok && strcmp(text, text2) != 0) {
            idempotent_failures++;
            if (idempotent_failures == 1) printf("# printed twice: '%s' then '%s'\n", text, text2);
        }
        failures += !ok;
        free(text);
        free(text2);
        mn_expr_unref(e);
        mn_expr_unref(back);
    }
    printf("# %d random expressions round-tripped\n", total);
    CHECK("round trip: to_string then parse evaluates identically (500 random)", failures == 0);
    CHECK("round trip: printing the parsed expression gives the same text", idempotent_failures == 0);

    /* A few printed forms, to pin down the minimal parentheses. */
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"(a + b) + c", "a + b + c"}, {"a + (b + c)", "a + (b + c)"}, {"a - (b - c)", "a - (b - c)"},
        {"(a * b) / c", "a * b / c"}, {"a / (b * c)", "a / (b * c)"}, {"(a ^ b) ^ c", "(a^b)^c"},
        {"a ^ (b ^ c)", "a^b^c"},     {"(-a) ^ 2", "(-a)^2"},         {"-(a ^ 2)", "-a^2"},
        {"a ^ (-b)", "a^-b"},         {"-(-a)", "--a"},               {"a - (-b)", "a - -b"},
        {"(a < b) < c", "(a < b) < c"}, {"max((a), (b > c))", "max(a, b > c)"},
        {"(a + b) * -c", "(a + b) * -c"}, {"1e-3 + 0.1 + 2.5e12", "0.001 + 0.1 + 2.5e12"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[128];
        snprintf(name, sizeof name, "to_string '%s'", cases[i].src);
        mn_expr *e = parse_or_null(cases[i].src);
        char *text = e ? mn_expr_to_string(e) : NULL;
        CHECK(name, text && strcmp(text, cases[i].want) == 0);
        if (text && strcmp(text, cases[i].want) != 0) printf("# got '%s'\n", text);
        free(text);
        mn_expr_unref(e);
    }

    /* Inf and NaN constants print as expressions that make them. */
    mn_expr *specials = mn_expr_binary(MN_EX_ADD, mn_expr_num(-INFINITY), mn_expr_num(NAN));
    char *text = mn_expr_to_string(specials);
    CHECK("to_string of -Inf + NaN", text && strcmp(text, "-1 / 0 + 0 / 0") == 0);
    free(text);
    mn_expr_unref(specials);
}

/* ------------------------------------------------------------ simplifier */

static void check_printed(const char *name, mn_expr *e, const char *want)
{
    char *text = e ? mn_expr_to_string(e) : NULL;
    bool ok = text && strcmp(text, want) == 0;
    CHECK(name, ok);
    if (!ok) printf("# got '%s', want '%s'\n", text ? text : "(null)", want);
    free(text);
    mn_expr_unref(e);
}

static void test_simplify(void)
{
    static const struct {
        const char *src, *want;
    } simplified[] = {
        {"x + 0", "x"},       {"0 + x", "x"},           {"x - 0", "x"},
        {"x * 1", "x"},       {"1 * x", "x"},           {"x * 0", "0"},
        {"x / 1", "x"},       {"x^1", "x"},             {"x^0", "1"},
        {"--x", "x"},         {"0 - x", "-x"},          {"-a * b", "-(a * b)"},
        {"a * -b", "-(a * b)"}, {"-a * -b", "a * b"},   {"-a / b", "-(a / b)"},
        {"2 * 3 + x", "6 + x"}, {"x * 2", "2 * x"},     {"x + -y", "x - y"},
        {"x - -y", "x + y"},  {"-x + y", "y - x"},      {"x - x", "0"},
        {"1/0 + x", "1 / 0 + x"}, {"4e-320 + x", "4e-320 + x"}, {"x - 1e-05", "x - 1e-5"}, {"where(1, a, b)", "a"}, {"where(0, a, b)", "b"},
        {"where(x > 0, 1, 0)", "x > 0"}, {"where(c, a, a)", "a"}, {"max(x, x)", "x"},
        {"abs(-abs(x))", "abs(x)"}, {"sqrt(4) * x", "2 * x"}, {"x + 2 - 2", "x + 2 - 2"},
    };
    for (size_t i = 0; i < sizeof simplified / sizeof simplified[0]; i++) {
        char name[128];
        snprintf(name, sizeof name, "simplify '%s'", simplified[i].src);
        mn_expr *e = parse_or_null(simplified[i].src);
        check_printed(name, e ? mn_expr_simplify(e) : NULL, simplified[i].want);
        mn_expr_unref(e);
    }

    static const struct {
        const char *src, *var, *want;
    } derivatives[] = {
        {"r^2", "r", "2 * r"},          {"x^3", "x", "3 * x^2"},
        {"r^p", "r", "p * r^(p - 1)"},  {"abs(r)", "r", "sign(r)"},
        {"relu(z)", "z", "z > 0"},      {"max(z, 0)", "z", "z >= 0"},
        {"min(z, 1)", "z", "z <= 1"},   {"log(x)", "x", "1 / x"},
        {"sqrt(x)", "x", "0.5 / sqrt(x)"}, {"exp(2 * x)", "x", "2 * exp(2 * x)"},
        {"softplus(z)", "z", "sigmoid(z)"}, {"gelu(z)", "z", "_gelu_grad(z)"},
        {"-y * v", "y", "-v"},          {"(y - v)^2", "y", "2 * (y - v)"},
        {"y * v", "q", "0"},            {"sign(x) + (x < 1)", "x", "0"},
        {"sigmoid(z)", "z", "sigmoid(z) * (1 - sigmoid(z))"},
        {"tanh(z)", "z", "1 - tanh(z)^2"},
        {"where(abs(r) <= d, 0.5 * r^2, d * (abs(r) - 0.5 * d))", "r",
         "where(abs(r) <= d, r, d * sign(r))"},
    };
    for (size_t i = 0; i < sizeof derivatives / sizeof derivatives[0]; i++) {
        char name[160];
        snprintf(name, sizeof name, "derivative d/d%s '%s'", derivatives[i].var, derivatives[i].src);
        mn_expr *e = parse_or_null(derivatives[i].src);
        check_printed(name, e ? mn_expr_diff(e, derivatives[i].var) : NULL, derivatives[i].want);
        mn_expr_unref(e);
    }

    /* Binding constants, then differentiating: what the engines emit for huber. */
    mn_expr *huber = parse_or_null("where(abs(r) <= delta, 0.5 * r^2, delta * (abs(r) - 0.5 * delta))");
    const char *const consts[] = {"delta"};
    const double one[] = {1};
    mn_expr *bound = huber ? mn_expr_bind(huber, consts, one, 1) : NULL;
    check_printed("bind delta = 1", bound ? mn_expr_ref(bound) : NULL,
                  "where(abs(r) <= 1, 0.5 * r^2, abs(r) - 0.5)");
    check_printed("derivative after bind", bound ? mn_expr_diff(bound, "r") : NULL,
                  "where(abs(r) <= 1, r, sign(r))");
    mn_expr_unref(bound);
    mn_expr_unref(huber);

    /* The simplified form computes the same value wherever the original is finite. */
    rng_state = 777;
    int failures = 0;
    for (int i = 0; i < 500; i++) {
        mn_expr *e = random_expr(1 + i % 6);
        mn_expr *s = e ? mn_expr_simplify(e) : NULL;
        for (int k = 0; s && k < 6; k++) {
            double x = random_point(), y = random_point(), z = random_point();
            double a = eval_xyz(e, x, y, z), b = eval_xyz(s, x, y, z);
            if (isfinite(a) && a != b) {
                if (!failures) {
                    char *t1 = mn_expr_to_string(e), *t2 = mn_expr_to_string(s);
                    printf("# simplify changed '%s' -> '%s': %.17g vs %.17g\n", t1, t2, a, b);
                    free(t1);
                    free(t2);
                }
                failures++;
            }
        }
        failures += s == NULL;
        mn_expr_unref(e);
        mn_expr_unref(s);
    }
    CHECK("simplify keeps finite values (500 random)", failures == 0);
}

/* ---------------------------------------------------------- derivatives */

/* Central difference of e in var at (x, y). */
static double central_difference(const mn_expr *e, int var, double x, double y)
{
    double h = 1e-5 * fmax(1.0, fabs(var == 0 ? x : y));
    double p[2] = {x, y}, m[2] = {x, y};
    p[var] += h;
    m[var] -= h;
    return (eval_xyz(e, p[0], p[1], 0) - eval_xyz(e, m[0], m[1], 0)) / (p[var] - m[var]);
}

static void test_derivatives(void)
{
    static const struct {
        const char *src;
        double lo, hi; /* the range of x and y */
    } cases[] = {
        {"x + y", -3, 3}, {"x - y", -3, 3}, {"x * y", -3, 3}, {"x / y", 0.5, 3},
        {"-x", -3, 3}, {"x^3", -3, 3}, {"x^y", 0.3, 2.5}, {"x^x", 0.3, 2.5},
        {"x^-1.5", 0.3, 3}, {"2^x", -3, 3}, {"y^(x * x)", 0.3, 2}, {"abs(x)", -3, 3},
        {"sqrt(x)", 0.2, 3}, {"exp(x)", -3, 3}, {"log(x)", 0.2, 3}, {"tanh(x)", -3, 3},
        {"sigmoid(x)", -5, 5}, {"softplus(x)", -5, 5}, {"sign(x) * y", -3, 3},
        {"relu(x)", -3, 3}, {"silu(x)", -5, 5}, {"gelu(x)", -5, 5},
        {"_gelu_grad(x)", -4, 4}, {"min(x, y)", -3, 3}, {"max(x, y)", -3, 3},
        {"min(x^2, y)", -2, 2}, {"where(x > y, x^2, 3 * x * y)", -3, 3},
        {"(x < y) + (x <= y) + (x > y) + (x >= y)", -3, 3}, {"x * (x >= y)", -3, 3},
        {"log(1 + exp(x)) * sigmoid(x * y)", -3, 3}, {"sqrt(x^2 + y^2)", -3, 3},
        {"tanh(gelu(x) * silu(y))", -3, 3}, {"softplus(x * y) - log(x) / y", 0.3, 3},
        {"(x - y)^2", -3, 3}, {"abs(x - y)^1.5", -3, 3}, {"-x^2 / (1 + y^2)", -3, 3},
        {"where(abs(x - y) <= 1, 0.5 * (x - y)^2, abs(x - y) - 0.5)", -3, 3},
        {"x * y * exp(-x * y) - max(relu(x), softplus(y))", -2, 2},
    };
    rng_state = 4242;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mn_expr *e = parse_or_null(cases[i].src);
        mn_expr *d[2] = {e ? mn_expr_diff(e, "x") : NULL, e ? mn_expr_diff(e, "y") : NULL};
        double worst = 0;
        int points = 0;
        for (int tries = 0; d[0] && d[1] && points < 5 && tries < 1000; tries++) {
            double x = cases[i].lo + (cases[i].hi - cases[i].lo) * rng_uniform();
            double y = cases[i].lo + (cases[i].hi - cases[i].lo) * rng_uniform();
            /* away from every kink these cases have */
            if (fabs(x) < 0.05 || fabs(y) < 0.05 || fabs(x - y) < 0.05 || fabs(x * x - y) < 0.05 ||
                fabs(fabs(x - y) - 1) < 0.05)
                continue;
            points++;
            for (int var = 0; var < 2; var++) {
                double want = central_difference(e, var, x, y), got = eval_xyz(d[var], x, y, 0);
                double err = fabs(got - want) / fmax(1.0, fabs(want));
                if (!(err <= worst)) worst = err;
                if (!(err < 1e-6))
                    printf("# d/d%s '%s' at (%g, %g): got %.17g want %.17g\n", var ? "y" : "x",
                           cases[i].src, x, y, got, want);
            }
        }
        char name[160];
        snprintf(name, sizeof name, "derivative of '%s' matches finite differences", cases[i].src);
        CHECK(name, points == 5 && worst < 1e-6);
        mn_expr_unref(e);
        mn_expr_unref(d[0]);
        mn_expr_unref(d[1]);
    }

    /* Derivatives of derivatives: everything the derivative emits has one too. */
    mn_expr *e = parse_or_null("gelu(x) + silu(x) * sigmoid(x) + softplus(x)");
    mn_expr *d1 = e ? mn_expr_diff(e, "x") : NULL;
    mn_expr *d2 = d1 ? mn_expr_diff(d1, "x") : NULL;
    bool ok = d2 != NULL;
    for (double x = -2.3; ok && x < 2.5; x += 0.7)
        ok = fabs(eval_xyz(d2, x, 0, 0) - central_difference(d1, 0, x, 0)) < 1e-6;
    CHECK("second derivative matches finite differences", ok);
    mn_expr_unref(e);
    mn_expr_unref(d1);
    mn_expr_unref(d2);
}

/* ----------------------------------------------------- compiled program */

static void test_program(void)
{
    enum { N = 1000 };
    static double xs[N], ys[N], zs[N], out[N], inplace[N];
    const char *const names[] = {"x", "y", "z"};
    const char *const consts[] = {"c"};
    const double cvals[] = {0.75};
    /* Every operator and function by name first, then random expressions. */
    static const char *const fixed[] = {
        "x^2 + y^2 * z - (x * y)^2", "x^y + 2^x - x^-1.5 + x^c", "-x / y", "(x < y) + (x <= y) + (x > y) + (x >= y)",
        "abs(x) + sqrt(y) + exp(z) + log(x)", "tanh(x) + sigmoid(y) + softplus(z) + sign(x)",
        "relu(x) + silu(y) + gelu(z) + _gelu_grad(x)", "min(x, y) + max(y, z) + where(x - y, z, c)",
        "x", "2.5",
    };
    enum { NFIXED = sizeof fixed / sizeof fixed[0] };
    rng_state = 99;
    int failures = 0, compile_failures = 0;
    for (int i = 0; i < NFIXED + 300; i++) {
        mn_expr *e = i < NFIXED ? parse_or_null(fixed[i]) : random_expr(1 + i % 6);
        if (i % 7 == 0 && i >= NFIXED) e = mn_expr_binary(MN_EX_MUL, e, mn_expr_var("c"));
        mn_expr_program *p = NULL;
        if (!e || mn_expr_compile(e, names, 3, consts, cvals, 1, &p) != MN_OK) {
            compile_failures++;
            mn_expr_unref(e);
            continue;
        }
        int n = i < NFIXED ? N : i % 10 == 0 ? 1 : i % 10 == 1 ? 257 : N;
        for (int k = 0; k < n; k++) { /* 0, 1, and values on both sides of 1 and 2 */
            xs[k] = random_point();
            ys[k] = random_point();
            zs[k] = i < NFIXED && k % 3 ? fabs(random_point()) + 0.5 : random_point();
            inplace[k] = xs[k];
        }
        const double *inputs[3] = {xs, ys, zs};
        mn_expr_program_run(p, inputs, out, n);
        const double *inputs_inplace[3] = {inplace, ys, zs};
        mn_expr_program_run(p, inputs_inplace, inplace, n);
        for (int k = 0; k < n; k++) {
            double values[3] = {xs[k], ys[k], zs[k]};
            double want = mn_expr_eval(e, names, values, 3, consts, cvals, 1);
            if (!same_value(out[k], want) || !same_value(inplace[k], want)) {
                if (!failures) {
                    char *t = mn_expr_to_string(e);
                    printf("# program '%s' element %d: %.17g (in place %.17g) want %.17g\n", t,
                           k, out[k], inplace[k], want);
                    free(t);
                }
                failures++;
                break;
            }
        }
        mn_expr_program_free(p);
        mn_expr_unref(e);
    }
    CHECK("compiled program equals recursive eval (every function, 300 random, in place too)",
          failures == 0 && compile_failures == 0);

    mn_expr *e = parse_or_null("q + x");
    mn_expr_program *p = NULL;
    mn_status st = e ? mn_expr_compile(e, names, 3, consts, cvals, 1, &p) : MN_ERR_ARG;
    CHECK("compile refuses an unknown name", st == MN_ERR_ARG && p == NULL);
    CHECK_STR_CONTAINS("compile error names the name", mn_last_error(),
                       "expression 'q + x': unknown name 'q' (allowed: x, y, z, c)");
    mn_expr_unref(e);

    /* A constant expression, a bare variable, and unused inputs left NULL. */
    e = parse_or_null("c");
    p = NULL;
    if (e && mn_expr_compile(e, names, 3, consts, cvals, 1, &p) == MN_OK) {
        const double *inputs[3] = {NULL, NULL, NULL};
        mn_expr_program_run(p, inputs, out, 300);
        CHECK("program of a constant", out[0] == 0.75 && out[299] == 0.75);
    } else {
        CHECK("program of a constant", false);
    }
    mn_expr_program_free(p);
    mn_expr_unref(e);
}

/* ---------------------------------------------------------- name checks */

static void test_check_names(void)
{
    const char *const vars[] = {"y", "v", "r"};
    const char *const consts[] = {"delta"};
    mn_expr *e = parse_or_null("abs(q - v)");
    CHECK("check_names refuses q", e && mn_expr_check_names(e, vars, 3, NULL, 0) == MN_ERR_ARG);
    CHECK("check_names message", strcmp(mn_last_error(),
                                        "expression 'abs(q - v)': unknown name 'q' (allowed: y, v, r)") == 0);
    CHECK("check_names lists constants", e && mn_expr_check_names(e, vars, 3, consts, 1) == MN_ERR_ARG &&
                                             strstr(mn_last_error(), "(allowed: y, v, r, delta)"));
    mn_expr_unref(e);
    e = parse_or_null("where(abs(r) <= delta, 0.5 * r^2, delta * abs(r))");
    CHECK("check_names accepts known names", e && mn_expr_check_names(e, vars, 3, consts, 1) == MN_OK);
    CHECK("uses r", e && mn_expr_uses(e, "r") && !mn_expr_uses(e, "y"));
    mn_expr_unref(e);
    CHECK("function lookup", mn_expr_func_lookup("softplus") == MN_FN_SOFTPLUS &&
                                 mn_expr_func_lookup("nope") == -1);
    CHECK("internal functions", mn_expr_func_is_internal(MN_FN_GELU_GRAD) &&
                                    !mn_expr_func_is_internal(MN_FN_GELU));
}

/* ------------------------------------------------------------ C output */

static const char *const C_SOURCES[] = {
    "r^2", "abs(r) + sign(r) - relu(-r)", "sqrt(abs(y)) * exp(v) / (1 + log(1 + v^2))",
    "tanh(y) + sigmoid(y * 40) + softplus(-y * 30)", "silu(y) + gelu(v) + _gelu_grad(r)",
    "min(y, v) - max(y, v) + where(y > v, r, -r)", "(y < v) + 2 * (y <= v) + 4 * (y > v) + 8 * (y >= v)",
    "-(-y) - -v", "where(abs(r) <= delta, 0.5 * r^2, delta * (abs(r) - 0.5 * delta))",
    "abs(r)^1.5 + 2^-y", "1 / 2 + 3 / 4 * y", "y * 1e-300 * 1e-300 + 1/0 * 0 + v",
};

/* Write a program that prints every expression at a few points, compile it
 * with cc, run it, and compare with mn_expr_eval. */
static void check_c_output(bool single, const char *dir)
{
    const char *const vars[] = {"y", "v", "r"}, *const names[] = {"in_y", "in_v", "in_r"};
    const char *const consts[] = {"delta"};
    const double cvals[] = {1.25};
    const double points[][3] = {{0.3, -1.2, 1.5}, {-2.0, 0.7, -2.7}, {1.1, 1.1, 0.0}, {0.01, 3, -2.99}};
    enum { NPOINTS = sizeof points / sizeof points[0] };
    size_t nsrc = sizeof C_SOURCES / sizeof C_SOURCES[0];
    const char *type = single ? "float" : "double";
    char path[512], cmd[1600];
    snprintf(path, sizeof path, "%s/gen_%s.c", dir, type);
    FILE *f = fopen(path, "w");
    if (!f) {
        CHECK("to_c: temporary file", false);
        return;
    }
    fprintf(f, "#include <stdio.h>\n%s\n", mn_expr_c_prelude(single));
    fprintf(f, "static void show(%s in_y, %s in_v, %s in_r) {\n", type, type, type);
    mn_expr *exprs[2 * (sizeof C_SOURCES / sizeof C_SOURCES[0])];
    size_t nexpr = 0;
    bool ok = true;
    for (size_t i = 0; i < nsrc; i++) {
        mn_expr *e = parse_or_null(C_SOURCES[i]);
        if (!e) {
            ok = false;
            continue;
        }
        exprs[nexpr++] = e;
        exprs[nexpr++] = mn_expr_diff(e, "r"); /* derivatives reach _gelu_grad and friends */
    }
    for (size_t i = 0; i < nexpr; i++) {
        char *code = exprs[i] ? mn_expr_to_c(exprs[i], vars, names, 3, consts, cvals, 1, single) : NULL;
        if (!code) {
            ok = false;
            fprintf(f, "    printf(\"nan\\n\");\n");
            continue;
        }
        fprintf(f, "    printf(\"%%.17g\\n\", (double)(%s));\n", code);
        free(code);
    }
    fprintf(f, "}\nint main(void) {\n");
    for (int k = 0; k < NPOINTS; k++)
        fprintf(f, "    show(%.17g, %.17g, %.17g);\n", points[k][0], points[k][1], points[k][2]);
    fprintf(f, "    return 0;\n}\n");
    fclose(f);
    CHECK(single ? "to_c float: every expression emitted" : "to_c double: every expression emitted", ok);

    snprintf(cmd, sizeof cmd, "cc -std=c11 -O1 -Wall -Wextra -Werror -o %s/gen_%s %s -lm "
             ">%s/cc.log 2>&1", dir, type, path, dir);
    fflush(stdout);
    int rc = system(cmd);
    if (rc != 0) { /* show the compiler's complaint as comment lines */
        snprintf(cmd, sizeof cmd, "sed 's/^/# /' %s/cc.log", dir);
        fflush(stdout);
        if (system(cmd) != 0) printf("# no compiler log\n");
    }
    CHECK(single ? "to_c float: generated source compiles with -Wall -Wextra -Werror"
                 : "to_c double: generated source compiles with -Wall -Wextra -Werror", rc == 0);
    if (rc != 0) goto done;
    snprintf(cmd, sizeof cmd, "%s/gen_%s", dir, type);
    fflush(stdout);
    FILE *run = popen(cmd, "r");
    int failures = 0, count = 0;
    for (int k = 0; run && k < NPOINTS; k++) {
        for (size_t i = 0; i < nexpr; i++) {
            double got = NAN;
            char line[128];
            if (!fgets(line, sizeof line, run)) {
                failures++;
                continue;
            }
            got = strtod(line, NULL);
            double want = mn_expr_eval(exprs[i], vars, points[k], 3, consts, cvals, 1);
            double tol = single ? 2e-5 : 1e-14;
            bool agree = (isnan(got) && isnan(want)) || got == want ||
                         fabs(got - want) <= tol * fmax(1.0, fabs(want));
            if (!agree) {
                char *t = mn_expr_to_string(exprs[i]);
                printf("# %s '%s' at point %d: C gives %.17g, eval %.17g\n", type, t, k, got, want);
                free(t);
                failures++;
            }
            count++;
        }
    }
    if (run) pclose(run);
    printf("# %d %s values compared\n", count, type);
    CHECK(single ? "to_c float: compiled values match mn_expr_eval"
                 : "to_c double: compiled values match mn_expr_eval",
          run && failures == 0 && count == (int)nexpr * NPOINTS);
done:
    for (size_t i = 0; i < nexpr; i++) mn_expr_unref(exprs[i]);
}

static void test_to_c(void)
{
    mn_expr *e = parse_or_null("-(-y) * 2 + delta / 4 - (y < 1) + max(y, 0)^3");
    const char *const vars[] = {"y"}, *const names[] = {"yy"};
    const char *const consts[] = {"delta"};
    const double cvals[] = {0.5};
    char *code = e ? mn_expr_to_c(e, vars, names, 1, consts, cvals, 1, true) : NULL;
    const char *want = "-(-yy) * 2.0f + 0.5f / 4.0f - mn_f_lt(yy, 1.0f) + mn_f_pow(mn_f_max(yy, 0.0f), 3.0f)";
    CHECK("to_c float text", code && strcmp(code, want) == 0);
    if (code && strcmp(code, want) != 0) printf("# got %s\n", code);
    free(code);
    code = e ? mn_expr_to_c(e, vars, names, 1, NULL, NULL, 0, false) : NULL;
    CHECK("to_c refuses an unknown name", !code);
    CHECK_STR_CONTAINS("to_c error names the name", mn_last_error(), "unknown name 'delta'");
    mn_expr_unref(e);

    fflush(stdout);
    if (system("cc --version >/dev/null 2>&1") != 0) {
        SKIP("to_c compiled with cc", "no cc on this machine");
        return;
    }
    char dir[] = "/tmp/mn_test_expr_XXXXXX";
    if (!mkdtemp(dir)) {
        SKIP("to_c compiled with cc", "cannot make a temporary directory");
        return;
    }
    check_c_output(false, dir);
    check_c_output(true, dir);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("# could not remove %s\n", dir);
}

/* ------------------------------------------------------------ depth limits */

/* "t op t op ... op t" with n terms */
static char *chain(const char *term, const char *op, int n)
{
    size_t len = (strlen(term) + strlen(op)) * (size_t)n + 1;
    char *s = malloc(len);
    if (!s) return NULL;
    s[0] = 0;
    for (int i = 0; i < n; i++) {
        if (i) strcat(s, op);
        strcat(s, term);
    }
    return s;
}

/* Every walker at the deepest tree a constructor accepts, and derivatives of
 * the deepest trees a user may write: an error or a result, never a crash
 * (the sanitizer build runs this too, with its larger stack frames). */
static void test_depth_limits(void)
{
    const char *vars[] = {"r"};
    /* 1000 terms are 1000 levels: accepted; 1001 are refused with the limit */
    char *at = chain("r", "+", MN_EXPR_MAX_DEPTH), *over = chain("r", "+", MN_EXPR_MAX_DEPTH + 1);
    mn_expr *e = NULL;
    CHECK("depth: a chain at the limit parses", at && mn_expr_parse(at, &e) == MN_OK && e &&
          e->depth == MN_EXPR_MAX_DEPTH);
    mn_expr_unref(e);
    e = NULL;
    CHECK("depth: a chain over the limit is refused", over && mn_expr_parse(over, &e) == MN_ERR_ARG && !e);
    CHECK_STR_CONTAINS("depth: the message states the limit", mn_last_error(), "nested too deeply (over 1000 levels");
    free(at);
    free(over);

    /* the user's deepest expressions of each shape still differentiate */
    const char *shapes[][2] = {{"r", "*"}, {"r", "/"}, {"tanh(r)", "*"}, {"sqrt(r)", "/"},
                               {"max(r, 1)", "*"}, {"r", "-"}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        char name[96];
        snprintf(name, sizeof name, "depth: d/dr of %s%s... at the limit", shapes[i][0], shapes[i][1]);
        int terms = MN_EXPR_MAX_DEPTH - (strchr(shapes[i][0], '(') ? 1 : 0);
        char *src = chain(shapes[i][0], shapes[i][1], terms);
        e = NULL;
        mn_status st = src ? mn_expr_parse(src, &e) : MN_ERR_OOM;
        mn_expr *d = st == MN_OK ? mn_expr_diff(e, "r") : NULL;
        /* (derivatives grow up to 3 times deeper here: 1000 -> 2994 for r/r/...) */
        char *text = d ? mn_expr_to_string(d) : NULL;
        mn_expr_program *prog = NULL;
        CHECK(name, st == MN_OK && d && text && mn_expr_compile(d, vars, 1, NULL, NULL, 0, &prog) == MN_OK);
        mn_expr_program_free(prog);
        free(text);
        mn_expr_unref(d);
        mn_expr_unref(e);
        free(src);
    }

    /* sharing: 41 levels but 2^41 nodes to walk; the size check refuses it */
    e = mn_expr_var("r");
    for (int i = 0; e && i < 40; i++) e = mn_expr_binary(MN_EX_MUL, e, mn_expr_ref(e));
    CHECK("size: a shared tree counts every use", e && e->depth == 41 && e->size == ((int64_t)1 << 41) - 1);
    CHECK("size: over the limit is refused", e && mn_expr_check_depth(e) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("size: the message states the limit", mn_last_error(), "expression too large: over 20000 nodes");
    mn_expr_unref(e);

    /* a tree at the hard limit: every walker runs; one more level is refused */
    e = mn_expr_var("r");
    for (int i = 1; e && i < MN_EXPR_HARD_DEPTH; i++) {
        if (i % 3 == 0) e = mn_expr_binary(MN_EX_MUL, e, mn_expr_num(1.0 + 1.0 / i));
        else if (i % 3 == 1) e = mn_expr_binary(MN_EX_ADD, mn_expr_var("r"), e);
        else {
            mn_expr *a[1] = {e};
            e = mn_expr_call(MN_FN_TANH, 1, a);
        }
    }
    CHECK("depth: constructors build up to the hard limit", e && e->depth == MN_EXPR_HARD_DEPTH);
    if (!e) return;
    mn_expr *deeper = mn_expr_unary(MN_EX_NEG, mn_expr_ref(e));
    CHECK("depth: constructors refuse past the hard limit", !deeper);
    CHECK_STR_CONTAINS("depth: the hard limit message", mn_last_error(), "nested too deeply: over 10000 levels");
    char *text = mn_expr_to_string(e);
    CHECK("depth: to_string at the hard limit", text && strlen(text) > MN_EXPR_HARD_DEPTH);
    free(text);
    const char *names[] = {"x"};
    char *c = mn_expr_to_c(e, vars, names, 1, NULL, NULL, 0, false);
    CHECK("depth: to_c at the hard limit", c != NULL);
    free(c);
    mn_expr *s = mn_expr_simplify(e);
    CHECK("depth: simplify at the hard limit", s != NULL);
    mn_expr_unref(s);
    mn_expr *d = mn_expr_diff(e, "r");
    CHECK("depth: diff at the hard limit gives a result or an error",
          d != NULL || strstr(mn_last_error(), "nested too deeply") != NULL);
    mn_expr_unref(d);
    double one = 0.5;
    double v = mn_expr_eval(e, vars, &one, 1, NULL, NULL, 0);
    CHECK("depth: eval at the hard limit", isfinite(v));
    mn_expr_program *prog = NULL;
    CHECK("depth: compile at the hard limit", mn_expr_compile(e, vars, 1, NULL, NULL, 0, &prog) == MN_OK);
    if (prog) {
        double in[4] = {0.5, -0.5, 1, 2}, out[4] = {0};
        const double *inputs[1] = {in};
        mn_expr_program_run(prog, inputs, out, 4);
        CHECK_NEAR("depth: the program agrees with eval", out[0], v, 1e-12);
        mn_expr_program_free(prog);
    }
    mn_expr_unref(e);
}

int main(void)
{
    test_precedence();
    test_errors();
    test_round_trip();
    test_simplify();
    test_derivatives();
    test_program();
    test_check_names();
    test_to_c();
    test_depth_limits();
    return CHECK_DONE();
}
