/* expr_emit.c: text out of the expression IR: the string form with minimal
 * parentheses (mn_expr_to_string, which the parser reads back), one C or
 * CUDA expression (mn_expr_to_c), and the prelude of mn_f_* functions that
 * generated source includes (mn_expr_c_prelude). */
#include "expr.h"
#include "scalar_math.h"

#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------ growable string */

typedef struct {
    char *s;
    size_t len, cap;
    bool failed;
} strbuf;

static void sb_put(strbuf *sb, const char *text)
{
    size_t n = strlen(text);
    if (sb->failed) return;
    if (sb->len + n + 1 > sb->cap) {
        size_t cap = sb->cap ? sb->cap : 64;
        while (cap < sb->len + n + 1) cap *= 2;
        char *s = realloc(sb->s, cap);
        if (!s) {
            sb->failed = true;
            mn_fail(MN_ERR_OOM, "out of memory printing an expression");
            return;
        }
        sb->s = s;
        sb->cap = cap;
    }
    memcpy(sb->s + sb->len, text, n + 1);
    sb->len += n;
}

static char *sb_finish(strbuf *sb)
{
    if (sb->failed) {
        free(sb->s);
        return NULL;
    }
    if (!sb->s) sb_put(sb, "");
    return sb->s;
}

/* The shortest %g form that reads back to the same double (or, for single
 * precision, the same float), with '.' as the decimal point whatever
 * LC_NUMERIC says, and a plain exponent ("1e-5", not "1e-05"). v must be
 * finite. */
static void format_number(double v, bool single, char *buf, size_t size)
{
    for (int precision = 1; precision <= 17; precision++) {
        snprintf(buf, size, "%.*g", precision, v);
        double back = strtod(buf, NULL);
        if (single ? (float)back == (float)v : back == v) break;
    }
    const char *point = localeconv()->decimal_point;
    if (point && point[0] && point[0] != '.' && !point[1]) {
        char *p = strchr(buf, point[0]);
        if (p) *p = '.';
    }
    char *exponent = strchr(buf, 'e');
    if (exponent) {
        char *digits = exponent + 1, *src = digits;
        if (*src == '+') src++;
        else if (*src == '-') src++, digits++;
        while (*src == '0' && src[1]) src++;
        memmove(digits, src, strlen(src) + 1);
    }
}

/* ---------------------------------------------------------- string form */

/* Binding strength, loosest first, following the grammar of SPEC.md 4. */
enum { LV_CMP, LV_SUM, LV_PROD, LV_UNARY, LV_POW, LV_ATOM };

static int string_level(const mn_expr *e)
{
    switch (e->kind) {
    case MN_EX_NUM: /* Inf and NaN print as divisions, so they bind like one */
        if (!isfinite(e->num)) return LV_PROD;
        return signbit(e->num) ? LV_UNARY : LV_ATOM;
    case MN_EX_VAR: case MN_EX_CALL: return LV_ATOM;
    case MN_EX_NEG: return LV_UNARY;
    case MN_EX_POW: return LV_POW;
    case MN_EX_MUL: case MN_EX_DIV: return LV_PROD;
    case MN_EX_ADD: case MN_EX_SUB: return LV_SUM;
    default: return LV_CMP;
    }
}

static const char *operator_text(mn_expr_kind kind)
{
    switch (kind) {
    case MN_EX_ADD: return " + ";
    case MN_EX_SUB: return " - ";
    case MN_EX_MUL: return " * ";
    case MN_EX_DIV: return " / ";
    case MN_EX_POW: return "^";
    case MN_EX_LT: return " < ";
    case MN_EX_LE: return " <= ";
    case MN_EX_GT: return " > ";
    case MN_EX_GE: return " >= ";
    default: return " ? ";
    }
}

/* The language has no Inf or NaN literal: write the divisions that make
 * them, which print the same way again once parsed. */
static void put_string_number(strbuf *sb, double v)
{
    char buf[40];
    if (isnan(v)) sb_put(sb, "0 / 0");
    else if (isinf(v)) sb_put(sb, v > 0 ? "1 / 0" : "-1 / 0");
    else {
        format_number(v, false, buf, sizeof buf);
        sb_put(sb, buf);
    }
}

static void put_string(strbuf *sb, const mn_expr *e, int min_level)
{
    bool parens = string_level(e) < min_level;
    if (parens) sb_put(sb, "(");
    switch (e->kind) {
    case MN_EX_NUM: put_string_number(sb, e->num); break;
    case MN_EX_VAR: sb_put(sb, e->name); break;
    case MN_EX_NEG:
        sb_put(sb, "-");
        put_string(sb, e->args[0], LV_UNARY);
        break;
    case MN_EX_CALL:
        sb_put(sb, mn_expr_func_name(e->func));
        sb_put(sb, "(");
        for (int i = 0; i < e->nargs; i++) {
            if (i) sb_put(sb, ", ");
            put_string(sb, e->args[i], LV_CMP);
        }
        sb_put(sb, ")");
        break;
    case MN_EX_POW: /* pow := atom '^' unary: right-associative */
        put_string(sb, e->args[0], LV_ATOM);
        sb_put(sb, "^");
        put_string(sb, e->args[1], LV_UNARY);
        break;
    default: { /* left-associative binary levels; comparisons do not chain */
        int level = string_level(e);
        put_string(sb, e->args[0], level == LV_CMP ? LV_SUM : level);
        sb_put(sb, operator_text(e->kind));
        put_string(sb, e->args[1], level + 1);
        break;
    }
    }
    if (parens) sb_put(sb, ")");
}

char *mn_expr_to_string(const mn_expr *e)
{
    if (!e) {
        mn_fail(MN_ERR_ARG, "expression is NULL");
        return NULL;
    }
    strbuf sb = {0};
    put_string(&sb, e, LV_CMP);
    return sb_finish(&sb);
}

/* -------------------------------------------------------------- C form */

typedef struct {
    const char *const *vars, *const *names;
    int nvars;
    const char *const *consts;
    const double *const_values;
    int nconsts;
    bool single;
} c_context;

/* A floating literal ("2.0", "1e-5f"), parenthesized when negative, so
 * that no "- -" or "--" can appear; Inf and NaN as constant divisions. */
static void put_c_number(strbuf *sb, double v, bool single)
{
    const char *suffix = single ? "f" : "";
    char buf[64], num[40];
    if (isnan(v)) {
        snprintf(buf, sizeof buf, "(0.0%s/0.0%s)", suffix, suffix);
        sb_put(sb, buf);
        return;
    }
    if (single) v = (float)v; /* no literal that over- or underflows a float */
    if (isinf(v)) {
        snprintf(buf, sizeof buf, "(%s1.0%s/0.0%s)", v > 0 ? "" : "-", suffix, suffix);
        sb_put(sb, buf);
        return;
    }
    format_number(v, single, num, sizeof num);
    bool is_floating = strpbrk(num, ".e") != NULL;
    snprintf(buf, sizeof buf, "%s%s%s%s%s", signbit(v) ? "(" : "", num, is_floating ? "" : ".0",
             suffix, signbit(v) ? ")" : "");
    sb_put(sb, buf);
}

static int find_name(const char *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (names[i] && strcmp(names[i], name) == 0) return i;
    return -1;
}

/* Comparisons and pow are calls in C, so only + - * / and unary minus need
 * precedence: LV_SUM, LV_PROD, LV_UNARY and LV_ATOM keep their meaning. */
static int c_level(const mn_expr *e)
{
    switch (e->kind) {
    case MN_EX_NEG: return LV_UNARY;
    case MN_EX_MUL: case MN_EX_DIV: return LV_PROD;
    case MN_EX_ADD: case MN_EX_SUB: return LV_SUM;
    default: return LV_ATOM;
    }
}

static const char *c_call_name(const mn_expr *e)
{
    switch (e->kind) {
    case MN_EX_POW: return "mn_f_pow";
    case MN_EX_LT: return "mn_f_lt";
    case MN_EX_LE: return "mn_f_le";
    case MN_EX_GT: return "mn_f_gt";
    case MN_EX_GE: return "mn_f_ge";
    default: return NULL;
    }
}

static void put_c(strbuf *sb, const mn_expr *e, int min_level, c_context *cx)
{
    bool parens = c_level(e) < min_level;
    if (parens) sb_put(sb, "(");
    switch (e->kind) {
    case MN_EX_NUM: put_c_number(sb, e->num, cx->single); break;
    case MN_EX_VAR: {
        int i = find_name(e->name, cx->vars, cx->nvars);
        if (i >= 0) sb_put(sb, cx->names[i]);
        else if ((i = find_name(e->name, cx->consts, cx->nconsts)) >= 0)
            put_c_number(sb, cx->const_values[i], cx->single);
        break; /* unknown names were refused before printing began */
    }
    case MN_EX_NEG: /* the operand is an atom: never "--x" */
        sb_put(sb, "-");
        put_c(sb, e->args[0], LV_ATOM, cx);
        break;
    case MN_EX_ADD: case MN_EX_SUB: case MN_EX_MUL: case MN_EX_DIV: {
        int level = c_level(e);
        put_c(sb, e->args[0], level, cx);
        sb_put(sb, operator_text(e->kind));
        put_c(sb, e->args[1], level + 1, cx);
        break;
    }
    default: { /* a call: functions, pow, comparisons */
        char fname[40];
        const char *name = c_call_name(e);
        if (!name) { /* "_gelu_grad" becomes mn_f_gelu_grad */
            const char *f = mn_expr_func_name(e->func);
            snprintf(fname, sizeof fname, "mn_f_%s", f[0] == '_' ? f + 1 : f);
            name = fname;
        }
        sb_put(sb, name);
        sb_put(sb, "(");
        for (int i = 0; i < e->nargs; i++) {
            if (i) sb_put(sb, ", ");
            put_c(sb, e->args[i], LV_SUM, cx);
        }
        sb_put(sb, ")");
        break;
    }
    }
    if (parens) sb_put(sb, ")");
}

char *mn_expr_to_c(const mn_expr *e, const char *const *vars, const char *const *names,
                   int nvars, const char *const *consts, const double *const_values,
                   int nconsts, bool single_precision)
{
    if (!e) {
        mn_fail(MN_ERR_ARG, "expression is NULL");
        return NULL;
    }
    if (mn_expr_check_names(e, vars, nvars, consts, nconsts) != MN_OK) return NULL;
    c_context cx = {vars, names, nvars, consts, const_values, nconsts, single_precision};
    strbuf sb = {0};
    put_c(&sb, e, LV_SUM, &cx);
    return sb_finish(&sb);
}

/* -------------------------------------------------------------- prelude */

/* The prelude is model/scalar_math.h's one definition, stringized in float
 * or double (C++ overloads in CUDA keep each hook in its type), with a line
 * break put back after each function so that rule:source() stays readable. */
#define MN_PRELUDE_HEAD                                                                    \
    "/* mnemo expression prelude: the mn_f_* functions that generated expressions call\n"  \
    " * (model/scalar_math.h) */\n"                                                        \
    "#ifndef MN_EXPR_PRELUDE\n"                                                            \
    "#define MN_EXPR_PRELUDE 1\n"                                                          \
    "#if !defined(__CUDACC_RTC__)\n"                                                       \
    "#include <math.h>\n"                                                                  \
    "#endif\n"                                                                             \
    "#ifndef MN_DEVICE_FN\n"                                                               \
    "#if defined(__CUDACC__) || defined(__CUDA_ARCH__) || defined(__CUDACC_RTC__)\n"       \
    "#define MN_DEVICE_FN __device__ __forceinline__\n"                                    \
    "#else\n"                                                                              \
    "#define MN_DEVICE_FN static inline\n"                                                 \
    "#endif\n"                                                                             \
    "#endif\n"
#define MN_PRELUDE_NAME(name) mn_f_##name
#define MN_STRINGIZE_(...) #__VA_ARGS__
#define MN_STRINGIZE(...) MN_STRINGIZE_(__VA_ARGS__)
static const char body_float[] = MN_STRINGIZE(MN_SCALAR_MATH(MN_DEVICE_FN, float, MN_SM_FLOAT, MN_PRELUDE_NAME));
static const char body_double[] = MN_STRINGIZE(MN_SCALAR_MATH(MN_DEVICE_FN, double, MN_SM_DOUBLE, MN_PRELUDE_NAME));

/* head + body with a newline before each "MN_DEVICE_FN" + "#endif". */
static char *make_prelude(const char *body)
{
    size_t n = strlen(MN_PRELUDE_HEAD) + 2 * strlen(body) + 16;
    char *out = malloc(n), *o = out;
    if (!out) return NULL;
    o += sprintf(o, "%s", MN_PRELUDE_HEAD);
    for (const char *p = body; *p; p++) {
        if (p != body && strncmp(p, "MN_DEVICE_FN", 12) == 0) {
            if (o > out && o[-1] == ' ') o--;
            *o++ = '\n';
        }
        *o++ = *p;
    }
    sprintf(o, "\n#endif\n");
    return out;
}

const char *mn_expr_c_prelude(bool single_precision)
{
    /* Made once; the callers (code generation, tests) run on the main thread. */
    static char *prelude[2];
    int i = single_precision ? 1 : 0;
    if (!prelude[i]) prelude[i] = make_prelude(single_precision ? body_float : body_double);
    return prelude[i] ? prelude[i] : "#error out of memory making the expression prelude\n";
}
