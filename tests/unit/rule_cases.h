/* rule_cases.h: rules for the tests that compile generated CUDA sources
 * (test_codegen.c, test_large_source.c): one table row per rule, the rule
 * it makes (with the constants its custom expressions use), and how a
 * compile log is shown under a FAIL line. Static functions: each test
 * includes it once. */
#ifndef MN_TEST_RULE_CASES_H
#define MN_TEST_RULE_CASES_H

#include "engine.h"
#include "expr.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    int layers, bias, residual;
    mn_activation act;
    const char *act_expr;
    mn_loss loss;
    const char *loss_expr;
    mn_clip clip;
    mn_clip_scope scope;
    const char *clip_expr;
    int step, refresh;
    mn_retrieve retrieve;
    mn_precision prec;
    int dk, dv, dh;
    bool feature_sum, token_mean;
} rule_case;

static mn_status make_rule(const rule_case *c, mn_rule *r)
{
    mn_rule_init(r);
    r->layers = c->layers;
    r->bias = c->bias;
    r->residual = c->residual;
    r->activation = c->act;
    r->loss = c->loss;
    r->clip = c->clip;
    r->clip_scope = c->scope;
    r->clip_max = 0.5;
    r->loss_delta = 0.7;
    r->loss_p = 1.5;
    r->step = c->step;
    r->refresh = c->refresh;
    r->retrieve = c->retrieve;
    r->hidden = c->dh;
    if (c->feature_sum) r->feature_reduce = MN_REDUCE_SUM;
    if (c->token_mean) r->token_reduce = MN_REDUCE_MEAN;
    MN_TRY(mn_rule_set_const(r, "w", 0.7));
    MN_TRY(mn_rule_set_const(r, "c3", 0.1));
    MN_TRY(mn_rule_set_const(r, "a", 0.1));
    MN_TRY(mn_rule_set_const(r, "m", 0.25));
    MN_TRY(mn_rule_set_const(r, "delta", 0.3));
    if (c->act_expr) MN_TRY(mn_expr_parse(c->act_expr, &r->activation_expr));
    if (c->loss_expr) MN_TRY(mn_expr_parse(c->loss_expr, &r->loss_expr));
    if (c->clip_expr) MN_TRY(mn_expr_parse(c->clip_expr, &r->clip_expr));
    return mn_rule_validate(r);
}

/* The first lines of a log, on one FAIL line's continuation. */
static void print_log(const char *log)
{
    if (!log) return;
    int lines = 0;
    for (const char *p = log; *p && lines < 20; lines++) {
        const char *e = strchr(p, '\n');
        int n = e ? (int)(e - p) : (int)strlen(p);
        printf("    %.*s\n", n, p);
        p = e ? e + 1 : p + n;
    }
}

#endif
