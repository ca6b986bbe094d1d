/* codegen.c: the CUDA source of a rule (kernels/codegen.h). Every part of
 * the rule, built-in parts too, comes from its expression IR
 * (model/rule.h), with the rule's constants bound first so that literals are
 * folded, exactly as the CPU engine evaluates them. The kernel template is
 * kernels/rule_kernel.cuh, embedded at build time (dsl/embed_sources.sh). */
#include "codegen.h"
#include "../model/grad.h"
#include "../model/rownorm.h"
#include "plan.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { const char *name; const char *source; } mn_embedded_cuda_file;
extern const mn_embedded_cuda_file mn_embedded_cuda[];

const char *mn_cuda_template(const char *name)
{
    for (const mn_embedded_cuda_file *f = mn_embedded_cuda; f->name; f++)
        if (strcmp(f->name, name) == 0) return f->source;
    return NULL;
}

/* ---- growable text ---- */

typedef struct {
    char *s;
    size_t len, cap;
    bool failed;
} text;

static void put(text *t, const char *s)
{
    size_t n = strlen(s);
    if (t->failed) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (cap < t->len + n + 1) cap *= 2;
        char *p = realloc(t->s, cap);
        if (!p) {
            t->failed = true;
            return;
        }
        t->s = p;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n + 1);
    t->len += n;
}

static void putf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(text *t, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    put(t, buf);
}

/* An expression in a comment line (takes the reference e); a "*" "/" pair
 * in it would close the comment early. */
static void put_comment_expr(text *t, const char *label, mn_expr *e)
{
    if (!e) return;
    char *s = mn_expr_to_string(e);
    mn_expr_unref(e);
    if (!s) return;
    for (char *p = s; (p = strstr(p, "*/")) != NULL;) p[1] = '|';
    putf(t, " *   %s: ", label);
    put(t, s);
    put(t, "\n");
    free(s);
}

/* ---- the rule's constants at run time ----
 * A constant (a built-in part's parameter: huber's delta, lp's p, the clip's
 * m; or a named constant of a custom part) is not printed into the source as
 * a literal: the kernels read it from mn_rule_k, which the engine sets before
 * each run (mn_cuda_rule_constants, kernels/cuda_module.c). So the source,
 * its cache key and its compiled kernel are the same for every value, and a
 * sweep over one compiles once. Values 0, 1 and -1 are bound into the source
 * as before: the simplifier drops terms for them (x * 0, x * 1, pow(x, 0)),
 * which changes what is computed where x is not finite; a sweep through
 * them compiles those once more. */

static bool binds_into_source(double value) { return value == 0.0 || value == 1.0 || value == -1.0; }

/* What the source shows of a number: 0, 1 or -1 themselves, any other value not at all. */
static double as_printed(double value) { return binds_into_source(value) ? value : 2.0; }

bool mn_cuda_same_source_rule(const mn_rule *a, const mn_rule *b)
{
    for (int f = 0; f < mn_rule_field_count; f++) {
        double x = mn_rule_field_get(a, f), y = mn_rule_field_get(b, f);
        /* the NUM fields are parts' parameters: constants read at run time */
        if (mn_rule_fields[f].type == MN_FIELD_NUM ? as_printed(x) != as_printed(y) : x != y) return false;
    }
    for (int i = 0; i < mn_rule_expr_slot_count; i++)
        if (*mn_rule_expr_member((mn_rule *)a, i) != *mn_rule_expr_member((mn_rule *)b, i)) return false;
    if (a->nconsts != b->nconsts) return false;
    for (int i = 0; i < a->nconsts; i++)
        if (strcmp(a->const_names[i], b->const_names[i]) != 0 ||
            as_printed(a->const_values[i]) != as_printed(b->const_values[i]))
            return false;
    return true;
}

/* The constants one hook may read: the selected part's parameter (param,
 * the part list's what: "loss", "clip"), or, for a custom part, the rule's
 * named constants; each with its slot in mn_rule_k. */
typedef struct {
    int n;
    bool param;
    const char *what;
    const char *name[MN_MAX_CONSTS];
    int slot[MN_MAX_CONSTS];
    double value[MN_MAX_CONSTS];
} hook_consts;

static void hook_consts_of(const mn_rule *r, const mn_part_set *set, int choice, hook_consts *hc)
{
    hc->n = 0;
    hc->what = set->what;
    const char *pname = NULL;
    double pvalue = 0;
    mn_part_param pp = mn_rule_part_param(r, set, choice, &pname, &pvalue);
    hc->param = pp != MN_PARAM_NONE;
    if (hc->param) {
        hc->name[0] = pname;
        hc->slot[0] = MN_PARAM_SLOT(pp);
        hc->value[0] = pvalue;
        hc->n = 1;
        return;
    }
    const mn_part *part = mn_rule_part(r, set, choice);
    if (!part || !(part->flags & MN_PART_CUSTOM)) return;
    for (int i = 0; i < r->nconsts; i++) {
        hc->name[hc->n] = r->const_names[i];
        hc->slot[hc->n] = MN_CONST_SLOT(i);
        hc->value[hc->n++] = r->const_values[i];
    }
}

void mn_cuda_rule_constants(const mn_rule *r, mn_rule_constants *k)
{
    memset(k, 0, sizeof *k);
    const struct { const mn_part_set *set; int choice; } parts[] = {
        {&mn_loss_set, r->loss}, {&mn_clip_set, r->clip}, {&mn_activation_set, r->activation}};
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) {
        double v = 0;
        mn_part_param pp = mn_rule_part_param(r, parts[i].set, parts[i].choice, NULL, &v);
        if (pp != MN_PARAM_NONE) k->d[MN_PARAM_SLOT(pp)] = v;
    }
    for (int i = 0; i < r->nconsts && i < MN_MAX_CONSTS; i++) k->d[MN_CONST_SLOT(i)] = r->const_values[i];
    for (int i = 0; i < MN_RULE_CONSTANT_SLOTS; i++) k->f[i] = (float)k->d[i];
}

/* One hook: "__device__ __forceinline__ TYPE NAME(PARAMS) { return EXPR; }",
 * EXPR the expression in C with the constants of hc read from mn_rule_k
 * (MN_KF(slot) in float, MN_KD(slot) in double; slots marked in used) or
 * bound (binds_into_source). Takes the reference e. */
static mn_status put_hook(text *t, const hook_consts *hc, bool used[MN_RULE_CONSTANT_SLOTS], const char *type,
                          const char *name, const char *params, mn_expr *e, const char *const *vars, int nvars,
                          bool single)
{
    if (!e) return MN_ERR_ARG; /* the constructor recorded why */
    const char *bound_names[MN_MAX_CONSTS], *all_vars[4 + MN_MAX_CONSTS], *c_names[4 + MN_MAX_CONSTS];
    double bound_values[MN_MAX_CONSTS];
    char slot_text[MN_MAX_CONSTS][24];
    int nbound = 0, nall = 0;
    for (int i = 0; i < nvars; i++, nall++) all_vars[nall] = c_names[nall] = vars[i];
    for (int j = 0; j < hc->n; j++) {
        if (binds_into_source(hc->value[j])) {
            bound_names[nbound] = hc->name[j];
            bound_values[nbound++] = hc->value[j];
            continue;
        }
        snprintf(slot_text[j], sizeof slot_text[j], "MN_K%s(%d)", single ? "F" : "D", hc->slot[j]);
        all_vars[nall] = hc->name[j];
        c_names[nall++] = slot_text[j];
    }
    mn_expr *bound = mn_expr_bind(e, bound_names, bound_values, nbound);
    mn_expr_unref(e);
    if (!bound) return MN_ERR_OOM;
    for (int j = 0; j < hc->n; j++)
        if (!binds_into_source(hc->value[j]) && mn_expr_uses(bound, hc->name[j])) used[hc->slot[j]] = true;
    char *c = mn_expr_to_c(bound, all_vars, c_names, nall, NULL, NULL, 0, single);
    mn_expr_unref(bound);
    if (!c) return mn_fail_context(MN_ERR_ARG, "%s: ", name);
    putf(t, "__device__ __forceinline__ %s %s(%s)\n{\n", type, name, params);
    for (int i = 0; i < nvars; i++) putf(t, "    (void)%s;\n", vars[i]);
    put(t, "    return ");
    put(t, c);
    put(t, ";\n}\n");
    free(c);
    return MN_OK;
}

static const char *const loss_vars[] = {"y", "v", "r"};
static const char *const act_vars[] = {"z"};
static const char *const scale_vars[] = {"n"};
static const char *const elem_vars[] = {"g"};

/* The constants of the rule's three expression parts. */
typedef struct {
    hook_consts loss, act, clip;
    bool used[MN_RULE_CONSTANT_SLOTS];
} rule_consts;

static void rule_consts_init(const mn_rule *r, rule_consts *rc)
{
    memset(rc, 0, sizeof *rc);
    hook_consts_of(r, &mn_loss_set, r->loss, &rc->loss);
    hook_consts_of(r, &mn_activation_set, r->activation, &rc->act);
    hook_consts_of(r, &mn_clip_set, r->clip, &rc->clip);
}

static mn_status put_hooks(text *t, const mn_rule *r, rule_consts *rc)
{
    put(t, "\n/* ---- hooks from the rule's expressions ---- */\n");
    mn_expr *f = mn_rule_loss_expr_open(r);
    mn_expr *df = mn_loss_grad_of(f);
    mn_status s = put_hook(t, &rc->loss, rc->used, "float", "mn_hook_loss", "float y, float v, float r", f,
                           loss_vars, 3, true);
    if (s != MN_OK) {
        mn_expr_unref(df);
        return s;
    }
    MN_TRY(put_hook(t, &rc->loss, rc->used, "float", "mn_hook_loss_grad", "float y, float v, float r", df,
                    loss_vars, 3, true));
    MN_TRY(put_hook(t, &rc->act, rc->used, "float", "mn_hook_act", "float z", mn_rule_activation_expr(r), act_vars,
                    1, true));
    MN_TRY(put_hook(t, &rc->act, rc->used, "float", "mn_hook_act_grad", "float z", mn_rule_activation_grad_expr(r),
                    act_vars, 1, true));
    /* The scale of a norm-type clip is one number per step: double, as the
     * CPU engine computes it, so a huge norm does not overflow to Inf. */
    bool scale = mn_rule_clip_scales(r), elem = mn_rule_clip_elementwise(r); /* the clip's kind, rule.def */
    if (scale)
        MN_TRY(put_hook(t, &rc->clip, rc->used, "double", "mn_hook_clip_scale", "double n", mn_rule_clip_expr_open(r),
                        scale_vars, 1, false));
    else put(t, "__device__ __forceinline__ double mn_hook_clip_scale(double n) { (void)n; return 1.0; }\n");
    if (elem)
        MN_TRY(put_hook(t, &rc->clip, rc->used, "float", "mn_hook_clip_elem", "float g", mn_rule_clip_expr_open(r),
                        elem_vars, 1, true));
    else put(t, "__device__ __forceinline__ float mn_hook_clip_elem(float g) { return g; }\n");
    return MN_OK;
}

/* d(e)/d(var), a new reference (NULL when e is NULL or out of memory). */
static mn_expr *diff_of(mn_expr *e, const char *var)
{
    return e ? mn_expr_diff(e, var) : NULL;
}

/* The backward's hooks (kernels/grad_kernel.cuh), in double as the CPU's
 * expression programs (model/mlp_grad_cpu.c, model/grad_cpu.c): the loss's
 * f', df/dv, f'' and d2f/dydv (r = y - v counted through), phi' and phi''
 * of the activation, and the clip's derivative in n or g. */
static mn_status put_grad_hooks(text *t, const mn_rule *r, rule_consts *rc)
{
    put(t, "\n/* ---- the backward's hooks (double, as the CPU's programs) ---- */\n");
    mn_expr *ld[4];
    mn_expr *f = mn_rule_loss_expr_open(r);
    mn_status ds = mn_loss_derivative_exprs(f, ld);
    mn_expr_unref(f);
    MN_TRY(ds);
    static const char *const lnames[] = {"mn_ghook_loss_dy", "mn_ghook_loss_dv", "mn_ghook_loss_dyy", "mn_ghook_loss_dyv"};
    mn_status s = MN_OK;
    for (int i = 0; i < 4; i++) {
        if (s == MN_OK)
            s = put_hook(t, &rc->loss, rc->used, "double", lnames[i], "double y, double v, double r", ld[i], loss_vars,
                         3, false);
        else mn_expr_unref(ld[i]);
    }
    MN_TRY(s);
    mn_expr *dphi = mn_rule_activation_grad_expr(r);
    mn_expr *ddphi = diff_of(dphi, "z");
    s = put_hook(t, &rc->act, rc->used, "double", "mn_ghook_act_d", "double z", dphi, act_vars, 1, false);
    if (s == MN_OK) s = put_hook(t, &rc->act, rc->used, "double", "mn_ghook_act_dd", "double z", ddphi, act_vars, 1, false);
    else mn_expr_unref(ddphi);
    MN_TRY(s);
    if (mn_rule_clip_scales(r)) {
        mn_expr *e = mn_rule_clip_expr_open(r);
        mn_expr *de = diff_of(e, "n");
        mn_expr_unref(e);
        MN_TRY(put_hook(t, &rc->clip, rc->used, "double", "mn_ghook_clip_dscale", "double n", de, scale_vars, 1, false));
    } else {
        put(t, "__device__ __forceinline__ double mn_ghook_clip_dscale(double n) { (void)n; return 0.0; }\n");
    }
    if (mn_rule_clip_elementwise(r)) {
        mn_expr *e = mn_rule_clip_expr_open(r);
        mn_expr *de = diff_of(e, "g");
        s = put_hook(t, &rc->clip, rc->used, "double", "mn_ghook_clip_elem", "double g", e, elem_vars, 1, false);
        if (s == MN_OK)
            s = put_hook(t, &rc->clip, rc->used, "double", "mn_ghook_clip_delem", "double g", de, elem_vars, 1, false);
        else mn_expr_unref(de);
        MN_TRY(s);
    } else {
        put(t, "__device__ __forceinline__ double mn_ghook_clip_elem(double g) { return g; }\n");
        put(t, "__device__ __forceinline__ double mn_ghook_clip_delem(double g) { (void)g; return 1.0; }\n");
    }
    return MN_OK;
}

/* What a slot holds, for the source's comment: the hooks' own names for it. */
static void put_slot_name(text *t, const rule_consts *rc, int slot)
{
    const hook_consts *parts[] = {&rc->loss, &rc->act, &rc->clip};
    for (size_t p = 0; p < sizeof parts / sizeof *parts; p++)
        for (int j = 0; j < parts[p]->n; j++)
            if (parts[p]->slot[j] == slot) {
                if (parts[p]->param) putf(t, " *   %d: the %s's parameter %s\n", slot, parts[p]->what, parts[p]->name[j]);
                else putf(t, " *   %d: the rule's constant %s\n", slot, parts[p]->name[j]);
                return;
            }
}

/* The device copy of the constants and its setter, where a hook reads one. */
static void put_constants_block(text *t, const rule_consts *rc)
{
    bool any = false;
    for (int i = 0; i < MN_RULE_CONSTANT_SLOTS; i++) any |= rc->used[i];
    if (!any) return;
    put(t, "\n/* ---- the rule's constants, read at run time (kernels/codegen.c): the engine\n"
           " * launches " MN_SET_CONSTANTS_KERNEL " with their values before each run, so that\n"
           " * this source serves every value. Slots read here:\n");
    for (int i = 0; i < MN_RULE_CONSTANT_SLOTS; i++)
        if (rc->used[i]) put_slot_name(t, rc, i);
    put(t, " */\n");
    putf(t, "struct mn_rule_constants { double d[%d]; float f[%d]; };\n", MN_RULE_CONSTANT_SLOTS,
         MN_RULE_CONSTANT_SLOTS);
    put(t, "__device__ mn_rule_constants mn_rule_k;\n");
    put(t, "extern \"C\" __global__ void " MN_SET_CONSTANTS_KERNEL "(mn_rule_constants k) { mn_rule_k = k; }\n");
    put(t, "#define MN_KD(i) __ldg(&mn_rule_k.d[i])\n#define MN_KF(i) __ldg(&mn_rule_k.f[i])\n");
    put(t, "#define MN_RULE_CONSTANTS 1 /* this source has them (tests/emu sets them too) */\n");
}

static mn_status build(text *t, const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                       const char *defines, bool grad)
{
    MN_TRY(mn_rule_validate(r));
    if (r->layers >= 2 && d->dh < 1)
        return mn_fail(MN_ERR_ARG, "cuda source: the rule has %d layers but hidden size %lld", r->layers,
                       (long long)d->dh);
    if (d->dk < 1 || d->dv < 1)
        return mn_fail(MN_ERR_ARG, "cuda source: dk and dv must be >= 1, got %lld and %lld", (long long)d->dk,
                       (long long)d->dv);
    if (r->residual && d->dk != d->dv)
        return mn_fail(MN_ERR_ARG, "cuda source: residual needs dk = dv, got dk=%lld, dv=%lld", (long long)d->dk,
                       (long long)d->dv);
    for (const char *const *n = templates; *n; n++)
        if (!mn_cuda_template(*n)) return mn_fail(MN_ERR_UNSUPPORTED, "cuda source: the kernel template %s is not in this build", *n);
    int clip_mode = mn_rule_clip_scales(r) ? 1 : mn_rule_clip_elementwise(r) ? 2 : 0;

    put(t, "/* mnemo rule kernel, generated by kernels/codegen.c from the rule below.\n");
    putf(t, " *   memory: %d layer%s, dk %lld, dv %lld, dh %lld%s%s%s\n", r->layers, r->layers == 1 ? "" : "s",
         (long long)d->dk, (long long)d->dv, r->layers > 1 ? (long long)d->dh : 0LL,
         r->layers > 1 ? ", activation " : "", r->layers > 1 ? mn_activation_name(r->activation) : "",
         r->residual ? ", residual" : "");
    putf(t, " *   loss %s, features %s, tokens %s; step %d, refresh %d, retrieve %s\n", mn_loss_name(r->loss),
         mn_part_name(&mn_reduce_set, r->feature_reduce), mn_part_name(&mn_reduce_set, r->token_reduce), r->step,
         mn_rule_refresh(r), mn_part_name(&mn_retrieve_set, r->retrieve));
    /* no constant's value in the source: it is read at run time (above put_hook) */
    putf(t, " *   clip %s (scope %s); precision %s\n", mn_clip_name(r->clip),
         mn_part_name(&mn_scope_set, r->clip_scope), mn_precision_name(p));
    put_comment_expr(t, "loss", mn_rule_loss_expr_open(r));
    put_comment_expr(t, "activation", r->layers > 1 ? mn_rule_activation_expr(r) : NULL);
    put_comment_expr(t, "clip", r->clip != MN_CLIP_NONE ? mn_rule_clip_expr_open(r) : NULL);
    put(t, " */\n");

    putf(t, "#define MN_LAYERS %d\n#define MN_BIAS %d\n#define MN_RESIDUAL %d\n", r->layers, r->bias ? 1 : 0,
         r->residual ? 1 : 0);
    /* SPEC v2's gated hidden layers (general and large paths: kernels/plan.c) */
    putf(t, "#define MN_GLU %d\n", r->glu && r->layers > 1 ? 1 : 0);
    putf(t, "#define MN_DK %lld\n#define MN_DV %lld\n#define MN_DH %lld\n", (long long)d->dk, (long long)d->dv,
         r->layers > 1 ? (long long)d->dh : 0LL);
    putf(t, "#define MN_STEP %d\n#define MN_REFRESH %d\n#define MN_RETRIEVE_BEFORE %d\n", r->step,
         mn_rule_refresh(r), r->retrieve == MN_RETRIEVE_BEFORE ? 1 : 0);
    putf(t, "#define MN_TOKEN_MEAN %d\n", r->token_reduce == MN_REDUCE_MEAN ? 1 : 0);
    /* R as the CPU engine computes it: 1.0 / (double)dv */
    if (r->feature_reduce == MN_REDUCE_MEAN) putf(t, "#define MN_FEATURE_SCALE (1.0 / %lld.0)\n", (long long)d->dv);
    else put(t, "#define MN_FEATURE_SCALE 1.0\n");
    putf(t, "#define MN_CLIP_MODE %d /* 0 none, 1 scale by mn_hook_clip_scale(norm), 2 mn_hook_clip_elem(g) */\n",
         clip_mode);
    putf(t, "#define MN_CLIP_TENSOR %d\n", r->clip_scope == MN_SCOPE_TENSOR ? 1 : 0);
    /* SPEC v2's preconditioner (general path only: kernels/plan.c) */
    putf(t, "#define MN_PRECOND %d\n#define MN_NS_STEPS %d\n", r->precondition == MN_PRECOND_NEWTON_SCHULZ ? 1 : 0,
         r->ns_steps);
    /* SPEC v2's out_norm, centred or not as its row of rule.def says (general and fused paths: kernels/plan.c) */
    mn_rownorm out_norm = mn_rule_out_norm(r);
    putf(t, "#define MN_OUT_NORM %d /* 0 none, 1 layernorm, 2 rmsnorm */\n",
         !out_norm.on ? 0 : out_norm.center ? 1 : 2);
    putf(t, "#define MN_PREC %d /* 0 fp32, 1 tf32, 2 bf16 operands of the products */\n",
         p == MN_PREC_TF32 ? 1 : p == MN_PREC_BF16 ? 2 : 0);

    /* Both preludes: C++ overloads keep float hooks in float and the double
     * clip-scale hook in double. */
    put(t, "\n");
    put(t, mn_expr_c_prelude(true));
    put(t, "#undef MN_EXPR_PRELUDE\n");
    put(t, mn_expr_c_prelude(false));
    if (defines) put(t, defines);
    /* the hooks first, so that the constants block holds only the slots they read */
    rule_consts rc;
    rule_consts_init(r, &rc);
    text hooks = {0};
    mn_status hs = put_hooks(&hooks, r, &rc);
    if (hs == MN_OK && grad) hs = put_grad_hooks(&hooks, r, &rc);
    if (hs == MN_OK && hooks.failed) hs = mn_fail(MN_ERR_OOM, "cuda source: out of memory");
    if (hs == MN_OK) {
        put_constants_block(t, &rc);
        put(t, hooks.s);
    }
    free(hooks.s);
    MN_TRY(hs);
    /* The parameter layout (model/param_layout.h) that every template uses. */
    const char *layout = mn_cuda_template("param_layout");
    if (!layout) return mn_fail(MN_ERR_UNSUPPORTED, "cuda source: param_layout.h is not in this build");
    put(t, "\n");
    put(t, layout);
    for (const char *const *n = templates; *n; n++) {
        put(t, "\n");
        put(t, mn_cuda_template(*n));
    }
    return MN_OK;
}

char *mn_cuda_source_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                         const char *defines)
{
    text t = {0};
    mn_status s = build(&t, r, d, p, templates, defines, false);
    if (s == MN_OK && t.failed) s = mn_fail(MN_ERR_OOM, "cuda source: out of memory");
    if (s != MN_OK) {
        free(t.s);
        return NULL;
    }
    return t.s;
}

char *mn_cuda_rule_source(const mn_rule *r, const mn_dims *d, mn_precision p)
{
    static const char *const general[] = {"update_math", "rule_kernel", NULL};
    return mn_cuda_source_for(r, d, p, general, NULL);
}

char *mn_cuda_grad_source_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                              const char *defines)
{
    char why[256];
    if (!mn_cuda_backward_rule_covers(r, why, sizeof why)) {
        mn_fail(MN_ERR_UNSUPPORTED, "cuda backward source: %s", why);
        return NULL;
    }
    text t = {0};
    mn_status s = build(&t, r, d, p, templates, defines, true);
    if (s == MN_OK && t.failed) s = mn_fail(MN_ERR_OOM, "cuda source: out of memory");
    if (s != MN_OK) {
        free(t.s);
        return NULL;
    }
    return t.s;
}

char *mn_cuda_grad_source(const mn_rule *r, const mn_dims *d)
{
    static const char *const grad[] = {"update_math", "rule_kernel", "grad_common", "grad_ns_adjoint",
                                       "grad_out_norm", "grad_kernel", NULL};
    /* fp32: the general backward computes as the CPU's does, whatever the forward's precision */
    return mn_cuda_grad_source_for(r, d, MN_PREC_FP32, grad, "#define MN_GRAD_SOURCE 1\n");
}
