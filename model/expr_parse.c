/* expr_parse.c: the recursive-descent parser of the expression language of
 * SPEC.md section 4 (mn_expr_parse). Every error names the expression, the
 * offending character, token or name, and its 1-based position. */
#include "expr.h"

#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parentheses, unary minus and exponents nest by recursion; bound it so a
 * hostile string cannot overflow the C stack (here or in the recursive
 * evaluator, printer and derivative that walk the result). */
#define PARSE_MAX_DEPTH 200

typedef enum { TOK_END, TOK_NUM, TOK_NAME, TOK_OP } token_kind;

typedef struct {
    token_kind kind;
    int pos;       /* 0-based offset into the source */
    int len;
    double num;    /* TOK_NUM */
    char op[3];    /* TOK_OP: "+", "<=", "(", ... */
} token;

typedef struct {
    const char *src;
    token tok;
    int depth;
} parser;

static mn_status parse_error(const parser *ps, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The message quotes the expression on one line: control characters become
 * spaces and a long expression is shortened. */
static mn_status parse_error(const parser *ps, const char *fmt, ...)
{
    char echo[208], detail[512];
    size_t n = 0;
    for (const char *c = ps->src; *c && n < 200; c++) echo[n++] = ((unsigned char)*c < 32 || *c == 127) ? ' ' : *c;
    echo[n] = 0;
    if (strlen(ps->src) > 200) strcpy(echo + 200, "...");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return mn_fail(MN_ERR_ARG, "expression '%s': %s", echo, detail);
}

/* "'<text>'" for a token, "end of expression" at the end. */
static const char *token_text(const parser *ps, const token *t, char *buf, size_t size)
{
    if (t->kind == TOK_END) return "end of expression";
    int len = t->len > 40 ? 40 : t->len;
    snprintf(buf, size, "'%.*s%s'", len, ps->src + t->pos, t->len > 40 ? "..." : "");
    return buf;
}

/* ASCII only, whatever the C locale says about bytes above 127. */
static bool is_digit(int c) { return c >= '0' && c <= '9'; }
static bool is_name_start(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_name_char(int c) { return is_name_start(c) || is_digit(c); }
static bool is_space(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* strtod follows LC_NUMERIC, which a REPL may have set to a locale with a
 * decimal comma; the language always uses '.', so translate first. */
static double convert_number(const char *text, int len)
{
    char buf[128];
    if (len >= (int)sizeof buf) len = (int)sizeof buf - 1;
    memcpy(buf, text, (size_t)len);
    buf[len] = 0;
    const char *point = localeconv()->decimal_point;
    if (point && point[0] && point[0] != '.' && !point[1]) {
        char *dot = strchr(buf, '.');
        if (dot) *dot = point[0];
    }
    return strtod(buf, NULL);
}

static mn_status scan_number(parser *ps, const char *start)
{
    const char *p = start;
    while (is_digit((unsigned char)*p)) p++;
    if (*p == '.') {
        p++;
        while (is_digit((unsigned char)*p)) p++;
    }
    bool ok = true;
    if (*p == 'e' || *p == 'E') {
        const char *q = p + 1;
        if (*q == '+' || *q == '-') q++;
        if (is_digit((unsigned char)*q)) {
            while (is_digit((unsigned char)*q)) q++;
            p = q;
        } else {
            ok = false;
        }
    }
    /* "2x", "1.2.3", "1e": report the whole run as one malformed number */
    if (!ok || is_name_char((unsigned char)*p) || *p == '.') {
        const char *end = p;
        while (is_name_char((unsigned char)*end) || *end == '.') end++;
        if (!ok) end = end > p + 1 ? end : p + 1;
        return parse_error(ps, "malformed number '%.*s' at position %d", (int)(end - start),
                           start, (int)(start - ps->src) + 1);
    }
    int len = (int)(p - start);
    double value = convert_number(start, len);
    if (isinf(value))
        return parse_error(ps, "number '%.*s' out of range at position %d", len, start,
                           (int)(start - ps->src) + 1);
    ps->tok = (token){.kind = TOK_NUM, .pos = (int)(start - ps->src), .len = len, .num = value};
    return MN_OK;
}

static mn_status next_token(parser *ps)
{
    const char *p = ps->src + ps->tok.pos + ps->tok.len;
    while (is_space((unsigned char)*p)) p++;
    int pos = (int)(p - ps->src);
    unsigned char c = (unsigned char)*p;
    if (c == 0) {
        ps->tok = (token){.kind = TOK_END, .pos = pos, .len = 0};
        return MN_OK;
    }
    if (is_digit(c) || (c == '.' && is_digit((unsigned char)p[1]))) return scan_number(ps, p);
    if (is_name_start(c)) {
        const char *q = p;
        while (is_name_char((unsigned char)*q)) q++;
        ps->tok = (token){.kind = TOK_NAME, .pos = pos, .len = (int)(q - p)};
        return MN_OK;
    }
    if (strchr("+-*/^(),<>", (char)c)) {
        token t = {.kind = TOK_OP, .pos = pos, .len = 1, .op = {(char)c, 0, 0}};
        if ((c == '<' || c == '>') && p[1] == '=') {
            t.op[1] = '=';
            t.len = 2;
        }
        ps->tok = t;
        return MN_OK;
    }
    if (c >= 32 && c < 127)
        return parse_error(ps, "unexpected character '%c' at position %d", c, pos + 1);
    return parse_error(ps, "unexpected character '\\x%02x' at position %d", c, pos + 1);
}

static bool tok_is(const parser *ps, const char *op)
{
    return ps->tok.kind == TOK_OP && strcmp(ps->tok.op, op) == 0;
}

static mn_expr_kind comparison_kind(const parser *ps)
{
    if (tok_is(ps, "<")) return MN_EX_LT;
    if (tok_is(ps, "<=")) return MN_EX_LE;
    if (tok_is(ps, ">")) return MN_EX_GT;
    if (tok_is(ps, ">=")) return MN_EX_GE;
    return MN_EX_NUM; /* not a comparison */
}

static mn_status expected(const parser *ps, const char *what)
{
    char buf[64];
    return parse_error(ps, "expected %s, found %s at position %d", what,
                       token_text(ps, &ps->tok, buf, sizeof buf), ps->tok.pos + 1);
}

/* A constructor returns NULL only on out-of-memory, with the message set.
 * A node deeper than MN_EXPR_MAX_DEPTH stops the parse here, at the token
 * that made it so: a long chain "r+r+...+r" is as deep as it is long, and
 * every walker of the result recurses once per level. */
static mn_status built_at(const parser *ps, mn_expr *e, mn_expr **out)
{
    *out = NULL;
    if (!e) return MN_ERR_OOM;
    if (e->depth > MN_EXPR_MAX_DEPTH) {
        mn_expr_unref(e);
        return parse_error(ps, "nested too deeply (over %d levels, as in a chain of over %d terms) at position %d",
                           MN_EXPR_MAX_DEPTH, MN_EXPR_MAX_DEPTH, ps->tok.pos + 1);
    }
    if (e->size > MN_EXPR_MAX_NODES) {
        mn_expr_unref(e);
        return parse_error(ps, "too large (over %d nodes) at position %d", MN_EXPR_MAX_NODES, ps->tok.pos + 1);
    }
    *out = e;
    return MN_OK;
}
#define built(e, out) built_at(ps, (e), (out))

static mn_status parse_expr(parser *ps, mn_expr **out);
static mn_status parse_unary(parser *ps, mn_expr **out);

static mn_status enter(parser *ps)
{
    if (++ps->depth > PARSE_MAX_DEPTH)
        return parse_error(ps, "nested too deeply (over %d levels) at position %d",
                           PARSE_MAX_DEPTH, ps->tok.pos + 1);
    return MN_OK;
}

/* func '(' expr {',' expr} ')', the name already consumed */
static mn_status parse_call(parser *ps, const token *name, mn_expr **out)
{
    char fname[64];
    snprintf(fname, sizeof fname, "%.*s", name->len, ps->src + name->pos);
    int f = mn_expr_func_lookup(fname);
    if (f < 0) {
        char buf[64];
        return parse_error(ps, "unknown function %s at position %d",
                           token_text(ps, name, buf, sizeof buf), name->pos + 1);
    }
    MN_TRY(next_token(ps)); /* past '(' */
    mn_expr *args[3] = {NULL, NULL, NULL};
    int nargs = 0;
    mn_status st = MN_OK;
    if (!tok_is(ps, ")")) {
        for (;;) {
            mn_expr *arg = NULL;
            st = parse_expr(ps, &arg);
            if (st != MN_OK) break;
            if (nargs < 3) args[nargs] = arg;
            else mn_expr_unref(arg);
            nargs++;
            if (tok_is(ps, ",")) {
                st = next_token(ps);
                if (st != MN_OK) break;
                continue;
            }
            if (!tok_is(ps, ")")) st = expected(ps, "',' or ')'");
            break;
        }
    }
    if (st == MN_OK && nargs != mn_expr_func_arity((mn_expr_func)f)) {
        int arity = mn_expr_func_arity((mn_expr_func)f);
        st = parse_error(ps, "%s takes %d argument%s, got %d at position %d", fname, arity,
                         arity == 1 ? "" : "s", nargs, name->pos + 1);
    }
    if (st == MN_OK) st = next_token(ps); /* past ')' */
    if (st != MN_OK) {
        for (int i = 0; i < 3; i++) mn_expr_unref(args[i]);
        return st;
    }
    return built(mn_expr_call((mn_expr_func)f, nargs, args), out);
}

/* atom := number | name | func '(' expr {',' expr} ')' | '(' expr ')' */
static mn_status parse_atom(parser *ps, mn_expr **out)
{
    token t = ps->tok;
    if (t.kind == TOK_NUM) {
        MN_TRY(next_token(ps));
        return built(mn_expr_num(t.num), out);
    }
    if (t.kind == TOK_NAME) {
        MN_TRY(next_token(ps));
        if (tok_is(ps, "(")) return parse_call(ps, &t, out);
        char *name = mn_malloc((size_t)t.len + 1, "an expression name");
        if (!name) return MN_ERR_OOM;
        memcpy(name, ps->src + t.pos, (size_t)t.len);
        name[t.len] = 0;
        if (mn_expr_func_lookup(name) >= 0) {
            char what[100];
            snprintf(what, sizeof what, "'(' after function '%s'", name);
            free(name);
            return expected(ps, what);
        }
        mn_status st = built(mn_expr_var(name), out);
        free(name);
        return st;
    }
    if (tok_is(ps, "(")) {
        MN_TRY(enter(ps));
        MN_TRY(next_token(ps));
        mn_expr *inner = NULL;
        MN_TRY(parse_expr(ps, &inner));
        if (!tok_is(ps, ")")) {
            mn_expr_unref(inner);
            return expected(ps, "')'");
        }
        ps->depth--;
        mn_status st = next_token(ps);
        if (st != MN_OK) {
            mn_expr_unref(inner);
            return st;
        }
        *out = inner;
        return MN_OK;
    }
    return expected(ps, "a number, a name or '('");
}

/* pow := atom ('^' unary)?   right-associative through unary */
static mn_status parse_pow(parser *ps, mn_expr **out)
{
    mn_expr *base = NULL;
    MN_TRY(parse_atom(ps, &base));
    if (!tok_is(ps, "^")) {
        *out = base;
        return MN_OK;
    }
    mn_expr *exponent = NULL;
    mn_status st = next_token(ps);
    if (st == MN_OK) st = parse_unary(ps, &exponent);
    if (st != MN_OK) {
        mn_expr_unref(base);
        return st;
    }
    return built(mn_expr_binary(MN_EX_POW, base, exponent), out);
}

/* unary := '-' unary | pow */
static mn_status parse_unary(parser *ps, mn_expr **out)
{
    MN_TRY(enter(ps));
    mn_status st;
    if (tok_is(ps, "-")) {
        mn_expr *operand = NULL;
        MN_TRY(next_token(ps));
        MN_TRY(parse_unary(ps, &operand));
        st = built(mn_expr_unary(MN_EX_NEG, operand), out);
    } else {
        st = parse_pow(ps, out);
    }
    ps->depth--;
    return st;
}

/* One left-associative level: prod := unary (('*'|'/') unary)*, and sum. */
static mn_status parse_left_assoc(parser *ps, mn_expr **out, const char *op1, mn_expr_kind kind1,
                                  const char *op2, mn_expr_kind kind2,
                                  mn_status (*operand)(parser *, mn_expr **))
{
    mn_expr *left = NULL;
    MN_TRY(operand(ps, &left));
    while (tok_is(ps, op1) || tok_is(ps, op2)) {
        mn_expr_kind kind = tok_is(ps, op1) ? kind1 : kind2;
        mn_expr *right = NULL;
        mn_status st = next_token(ps);
        if (st == MN_OK) st = operand(ps, &right);
        if (st != MN_OK) {
            mn_expr_unref(left);
            return st;
        }
        MN_TRY(built(mn_expr_binary(kind, left, right), &left));
    }
    *out = left;
    return MN_OK;
}

static mn_status parse_prod(parser *ps, mn_expr **out)
{
    return parse_left_assoc(ps, out, "*", MN_EX_MUL, "/", MN_EX_DIV, parse_unary);
}

static mn_status parse_sum(parser *ps, mn_expr **out)
{
    return parse_left_assoc(ps, out, "+", MN_EX_ADD, "-", MN_EX_SUB, parse_prod);
}

/* expr := sum (('<' | '<=' | '>' | '>=') sum)?   one comparison, no chains */
static mn_status parse_expr(parser *ps, mn_expr **out)
{
    MN_TRY(enter(ps));
    mn_expr *left = NULL, *right = NULL;
    MN_TRY(parse_sum(ps, &left));
    mn_expr_kind kind = comparison_kind(ps);
    if (kind == MN_EX_NUM) {
        ps->depth--;
        *out = left;
        return MN_OK;
    }
    mn_status st = next_token(ps);
    if (st == MN_OK) st = parse_sum(ps, &right);
    if (st == MN_OK && comparison_kind(ps) != MN_EX_NUM)
        st = parse_error(ps, "comparisons do not chain: unexpected '%s' at position %d",
                         ps->tok.op, ps->tok.pos + 1);
    if (st != MN_OK) {
        mn_expr_unref(left);
        mn_expr_unref(right);
        return st;
    }
    ps->depth--;
    return built(mn_expr_binary(kind, left, right), out);
}

mn_status mn_expr_parse(const char *src, mn_expr **out)
{
    *out = NULL;
    if (!src) return mn_fail(MN_ERR_ARG, "expression is NULL");
    parser ps_ = {.src = src, .tok = {.kind = TOK_END, .pos = 0, .len = 0}, .depth = 0};
    parser *ps = &ps_;
    MN_TRY(next_token(ps));
    if (ps->tok.kind == TOK_END) return parse_error(ps, "empty expression");
    mn_expr *e = NULL;
    MN_TRY(parse_expr(ps, &e));
    if (ps->tok.kind != TOK_END) {
        char buf[64];
        mn_status st = parse_error(ps, "unexpected %s at position %d",
                                   token_text(ps, &ps->tok, buf, sizeof buf), ps->tok.pos + 1);
        mn_expr_unref(e);
        return st;
    }
    *out = e;
    return MN_OK;
}
