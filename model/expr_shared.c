/* expr_shared.c: an expression program that evaluates repeated calls once.
 * Symbolic derivatives repeat their sub-expressions (silu'' holds sigmoid(z)
 * five times) and a compiled program evaluates each occurrence, so the
 * backward's phi' and phi'' would pay one exp per occurrence per element.
 * Here every call that occurs twice or more becomes a variable _s0, _s1, ...
 * computed once by its own program (innermost first), and the expression is
 * compiled over the input and those variables. The value is the same. */
#include "expr_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Distinct call sub-expressions and how often each occurs. */
typedef struct call_count {
    char *key[64];
    const mn_expr *node[64];
    int count[64];
    int n;
} call_count;

static void count_calls(const mn_expr *e, call_count *cc)
{
    for (int i = 0; i < e->nargs; i++) count_calls(e->args[i], cc);
    if (e->kind != MN_EX_CALL) return;
    char *key = mn_expr_to_string(e);
    if (!key) return;
    for (int i = 0; i < cc->n; i++)
        if (strcmp(cc->key[i], key) == 0) {
            cc->count[i]++;
            free(key);
            return;
        }
    if (cc->n == 64) {
        free(key);
        return;
    }
    cc->key[cc->n] = key;
    cc->node[cc->n] = e;
    cc->count[cc->n++] = 1;
}

/* e with every sub-expression whose string is keys[j] replaced by the
 * variable names[j] (e itself too unless skip_root). New reference. */
static mn_expr *substitute(const mn_expr *e, char *const *keys, char *const *names, int n, bool skip_root)
{
    if (!skip_root && e->kind == MN_EX_CALL) {
        char *key = mn_expr_to_string(e);
        for (int j = 0; key && j < n; j++)
            if (strcmp(key, keys[j]) == 0) {
                free(key);
                return mn_expr_var(names[j]);
            }
        free(key);
    }
    mn_expr *args[3] = {NULL, NULL, NULL};
    for (int i = 0; i < e->nargs; i++) args[i] = substitute(e->args[i], keys, names, n, false);
    switch (e->kind) {
    case MN_EX_NUM: return mn_expr_num(e->num);
    case MN_EX_VAR: return mn_expr_var(e->name);
    case MN_EX_NEG: return mn_expr_unary(MN_EX_NEG, args[0]);
    case MN_EX_CALL: return mn_expr_call(e->func, e->nargs, args);
    default: return mn_expr_binary(e->kind, args[0], args[1]);
    }
}

mn_status mn_shared_program_compile(const mn_expr *e, const char *var, const char *const *consts,
                                    const double *const_values, int nconsts, mn_shared_program *out)
{
    memset(out, 0, sizeof *out);
    call_count cc = {0};
    count_calls(e, &cc);
    /* repeated calls, shortest (innermost) first */
    int order[64], n = 0;
    for (int i = 0; i < cc.n; i++)
        if (cc.count[i] >= 2) order[n++] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strlen(cc.key[order[j]]) < strlen(cc.key[order[j - 1]]); j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    if (n > MN_SHARED_MAX) n = MN_SHARED_MAX;
    char *keys[MN_SHARED_MAX], *names[MN_SHARED_MAX];
    const char *vars[MN_SHARED_MAX + 1] = {var};
    mn_status st = MN_OK;
    for (int i = 0; i < n && st == MN_OK; i++) {
        keys[i] = cc.key[order[i]];
        names[i] = out->names[i];
        snprintf(out->names[i], sizeof out->names[i], "_s%d", i);
        vars[i + 1] = out->names[i];
        mn_expr *sub = substitute(cc.node[order[i]], keys, names, i, true);
        st = sub ? mn_expr_compile(sub, vars, i + 1, consts, const_values, nconsts, &out->sub[i]) : MN_ERR_OOM;
        mn_expr_unref(sub);
        out->nsub = i + 1;
    }
    if (st == MN_OK) {
        mn_expr *main = substitute(e, keys, names, n, false);
        st = main ? mn_expr_compile(main, vars, n + 1, consts, const_values, nconsts, &out->main) : MN_ERR_OOM;
        mn_expr_unref(main);
    }
    for (int i = 0; i < cc.n; i++) free(cc.key[i]);
    if (st != MN_OK) mn_shared_program_free(out);
    return st;
}

void mn_shared_program_run(const mn_shared_program *p, const double *x, double *const *scratch, double *out,
                           int64_t n)
{
    const double *in[MN_SHARED_MAX + 1] = {x};
    for (int i = 0; i < p->nsub; i++) {
        mn_expr_program_run(p->sub[i], in, scratch[i], n);
        in[i + 1] = scratch[i];
    }
    mn_expr_program_run(p->main, in, out, n);
}

void mn_shared_program_free(mn_shared_program *p)
{
    for (int i = 0; i < MN_SHARED_MAX; i++) mn_expr_program_free(p->sub[i]);
    mn_expr_program_free(p->main);
    memset(p, 0, sizeof *p);
}
