/* rule.c: rule defaults, names, validation, parameter layout, and the
 * expression form of every part (SPEC.md sections 1, 2 and 4). */
#include "rule.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the tables of rule.def as data ---- */

#define PART_ROW(SET, E, name, expr, vars, flags, param, doc) {name, expr, vars, flags, MN_PARAM_##param, doc},
#define PART_SET(LIST, SET, lower, what, count)                                          \
    static const mn_part lower##_parts[] = {LIST(PART_ROW)};                            \
    _Static_assert(sizeof lower##_parts / sizeof *lower##_parts == count, "part count"); \
    const mn_part_set mn_##lower##_set = {what, lower##_parts, count};
PART_SET(MN_ACTS, ACT, activation, "activation", MN_ACT_COUNT)
PART_SET(MN_LOSSES, LOSS, loss, "loss", MN_LOSS_COUNT)
PART_SET(MN_CLIPS, CLIP, clip, "clip", MN_CLIP_COUNT)
PART_SET(MN_SCOPES, SCOPE, scope, "clip_scope", MN_SCOPE_COUNT)
PART_SET(MN_REDUCES, REDUCE, reduce, "reduction", MN_REDUCE_COUNT)
PART_SET(MN_RETRIEVES, RETRIEVE, retrieve, "retrieve", MN_RETRIEVE_COUNT)
PART_SET(MN_NORMS, NORM, norm, "out_norm", MN_NORM_COUNT)
PART_SET(MN_QKNORMS, QKNORM, qknorm, "qk_norm", MN_QKNORM_COUNT)
PART_SET(MN_PRECONDS, PRECOND, precond, "precondition", MN_PRECOND_COUNT)
#undef PART_SET
#undef PART_ROW

/* Part parameters: the expression name, and where the value lives. */
typedef struct {
    const char *name;
    size_t offset;
    const char *field;
    double above;
} part_param;
#define PARAM_ROW(E, pname, member, bound) {pname, offsetof(mn_rule, member), #member, bound},
static const part_param part_params[MN_PARAM_COUNT] = {MN_PARAMS(PARAM_ROW)};
#undef PARAM_ROW

#define STR_(x) #x
#define FIELD_INT_ROW(name, dflt, lo, hi, doc) {#name, MN_FIELD_INT, NULL, lo, hi, NULL, STR_(dflt), doc},
#define FIELD_BOOL_ROW(name, dflt, doc) {#name, MN_FIELD_BOOL, NULL, 0, 1, NULL, STR_(dflt), doc},
#define FIELD_NUM_ROW(name, dflt, alias, doc) {#name, MN_FIELD_NUM, alias, 0, 0, NULL, STR_(dflt), doc},
#define FIELD_CHOICE_ROW(name, ctype, SET, dflt, doc) {#name, MN_FIELD_CHOICE, NULL, 0, 0, &SET##_SETREF, STR_(dflt), doc},
#define ACT_SETREF mn_activation_set
#define LOSS_SETREF mn_loss_set
#define CLIP_SETREF mn_clip_set
#define SCOPE_SETREF mn_scope_set
#define REDUCE_SETREF mn_reduce_set
#define RETRIEVE_SETREF mn_retrieve_set
#define NORM_SETREF mn_norm_set
#define QKNORM_SETREF mn_qknorm_set
#define PRECOND_SETREF mn_precond_set
const mn_field mn_rule_fields[] = {
    MN_RULE_FIELDS(FIELD_INT_ROW, FIELD_BOOL_ROW, FIELD_NUM_ROW, FIELD_CHOICE_ROW)};
const int mn_rule_field_count = (int)(sizeof mn_rule_fields / sizeof *mn_rule_fields);

/* Field ids in table order, for the generic accessors. */
#define FIELD_ID_INT(name, ...) FIELD_ID_##name,
#define FIELD_ID_CHOICE(name, ...) FIELD_ID_##name,
enum { MN_RULE_FIELDS(FIELD_ID_INT, FIELD_ID_INT, FIELD_ID_INT, FIELD_ID_CHOICE) FIELD_ID_COUNT };
_Static_assert(FIELD_ID_COUNT == sizeof mn_rule_fields / sizeof *mn_rule_fields, "field count");

#define EXPR_SLOT_ROW(field, member, SET) {#field, #member, &SET##_SETREF},
const mn_rule_expr_slot mn_rule_expr_slots[] = {MN_RULE_EXPRS(EXPR_SLOT_ROW)};
#undef EXPR_SLOT_ROW
const int mn_rule_expr_slot_count = (int)(sizeof mn_rule_expr_slots / sizeof *mn_rule_expr_slots);

mn_expr **mn_rule_expr_member(mn_rule *r, int i)
{
    mn_expr **members[] = {
#define EXPR_MEMBER_ROW(field, member, SET) &r->member,
        MN_RULE_EXPRS(EXPR_MEMBER_ROW)
#undef EXPR_MEMBER_ROW
    };
    return (i >= 0 && i < mn_rule_expr_slot_count) ? members[i] : NULL;
}

double mn_rule_field_get(const mn_rule *r, int field)
{
    switch (field) {
#define GET_CASE(name, ...) case FIELD_ID_##name: return (double)r->name;
        MN_RULE_FIELDS(GET_CASE, GET_CASE, GET_CASE, GET_CASE)
#undef GET_CASE
    }
    return NAN;
}

void mn_rule_field_set(mn_rule *r, int field, double value)
{
    switch (field) {
#define SET_INT(name, ...) case FIELD_ID_##name: r->name = (int)value; return;
#define SET_BOOL(name, ...) case FIELD_ID_##name: r->name = value != 0; return;
#define SET_NUM(name, ...) case FIELD_ID_##name: r->name = value; return;
#define SET_CHOICE(name, ctype, ...) case FIELD_ID_##name: r->name = (ctype)(int)value; return;
        MN_RULE_FIELDS(SET_INT, SET_BOOL, SET_NUM, SET_CHOICE)
#undef SET_INT
#undef SET_BOOL
#undef SET_NUM
#undef SET_CHOICE
    }
}

double mn_rule_field_default(const mn_rule *r, int field)
{
    (void)r; /* read by defaults that depend on earlier fields (bias) */
    switch (field) {
#define DFLT_INT(name, dflt, ...) case FIELD_ID_##name: return (double)(dflt);
#define DFLT_CHOICE(name, ctype, SET, dflt, ...) case FIELD_ID_##name: return (double)(dflt);
        MN_RULE_FIELDS(DFLT_INT, DFLT_INT, DFLT_INT, DFLT_CHOICE)
#undef DFLT_INT
#undef DFLT_CHOICE
    }
    return NAN;
}

int mn_rule_field_find(const char *name)
{
    for (int i = 0; i < mn_rule_field_count; i++)
        if (strcmp(mn_rule_fields[i].name, name) == 0) return i;
    return -1;
}

const mn_part *mn_rule_part(const mn_rule *r, const mn_part_set *set, int value)
{
    (void)r;
    return (value >= 0 && value < set->count) ? &set->parts[value] : NULL;
}

void mn_rule_init(mn_rule *r)
{
    memset(r, 0, sizeof *r);
    for (int f = 0; f < mn_rule_field_count; f++) mn_rule_field_set(r, f, mn_rule_field_default(r, f));
}

void mn_rule_free(mn_rule *r)
{
    for (int i = 0; i < mn_rule_expr_slot_count; i++) mn_expr_unref(*mn_rule_expr_member(r, i));
    for (int i = 0; i < r->nconsts; i++) free(r->const_names[i]);
    memset(r, 0, sizeof *r);
}

mn_status mn_rule_copy(mn_rule *dst, const mn_rule *src)
{
    *dst = *src;
    for (int i = 0; i < mn_rule_expr_slot_count; i++) mn_expr_ref(*mn_rule_expr_member(dst, i));
    for (int i = 0; i < src->nconsts; i++) {
        dst->const_names[i] = mn_strdup(src->const_names[i]);
        if (!dst->const_names[i]) {
            dst->nconsts = i;
            mn_rule_free(dst);
            return MN_ERR_OOM;
        }
    }
    return MN_OK;
}

mn_status mn_rule_set_const(mn_rule *r, const char *name, double value)
{
    if (isnan(value)) return mn_fail(MN_ERR_ARG, "constant '%s' is NaN", name);
    for (int i = 0; i < r->nconsts; i++)
        if (strcmp(r->const_names[i], name) == 0) {
            r->const_values[i] = value;
            return MN_OK;
        }
    if (r->nconsts == MN_MAX_CONSTS)
        return mn_fail(MN_ERR_ARG, "constant '%s': a rule holds at most %d constants", name, MN_MAX_CONSTS);
    static const char *const reserved[] = {"y", "v", "r", "z", "g", "n"};
    for (size_t i = 0; i < sizeof reserved / sizeof *reserved; i++)
        if (strcmp(name, reserved[i]) == 0)
            return mn_fail(MN_ERR_ARG, "constant '%s': the name is taken by an expression variable", name);
    if (mn_expr_func_lookup(name) >= 0)
        return mn_fail(MN_ERR_ARG, "constant '%s': the name is taken by a function", name);
    char *copy = mn_strdup(name);
    if (!copy) return MN_ERR_OOM;
    r->const_names[r->nconsts] = copy;
    r->const_values[r->nconsts++] = value;
    return MN_OK;
}

const char *mn_part_name(const mn_part_set *set, int value)
{
    return (value >= 0 && value < set->count) ? set->parts[value].name : "?";
}

/* Look name up in the set; on failure list every name in the message. */
mn_status mn_part_lookup(const mn_part_set *set, const char *name, int *out)
{
    for (int i = 0; i < set->count; i++)
        if (strcmp(name, set->parts[i].name) == 0) {
            *out = i;
            return MN_OK;
        }
    char list[512] = "";
    for (int i = 0; i < set->count; i++) {
        strncat(list, set->parts[i].name, sizeof list - strlen(list) - 1);
        if (i + 1 < set->count) strncat(list, ", ", sizeof list - strlen(list) - 1);
    }
    return mn_fail(MN_ERR_ARG, "unknown %s '%s' (one of: %s)", set->what, name, list);
}

const char *mn_activation_name(mn_activation a) { return mn_part_name(&mn_activation_set, (int)a); }
const char *mn_loss_name(mn_loss l) { return mn_part_name(&mn_loss_set, (int)l); }
const char *mn_clip_name(mn_clip c) { return mn_part_name(&mn_clip_set, (int)c); }

mn_status mn_loss_lookup(const char *name, mn_loss *out)
{
    int i;
    MN_TRY(mn_part_lookup(&mn_loss_set, name, &i));
    *out = (mn_loss)i;
    return MN_OK;
}

int mn_rule_refresh(const mn_rule *r) { return r->refresh < 0 ? r->step : r->refresh; }

int mn_part_vars(const mn_part *part, char buf[4][8], const char *names[4])
{
    int n = 0;
    for (const char *p = part->vars; *p && n < 4;) {
        while (*p == ' ') p++;
        int len = 0;
        while (p[len] && p[len] != ' ') len++;
        if (len == 0) break;
        snprintf(buf[n], sizeof buf[n], "%.*s", len, p);
        names[n] = buf[n];
        n++;
        p += len;
    }
    return n;
}

static mn_status check_expr(const mn_rule *r, const char *attr, const mn_part *part, const mn_expr *e)
{
    if (!e) return mn_fail(MN_ERR_ARG, "%s: the rule is custom but has no expression", attr);
    char buf[4][8];
    const char *vars[4];
    int nvars = mn_part_vars(part, buf, vars);
    if (mn_expr_check_names(e, vars, nvars, (const char *const *)r->const_names, r->nconsts) != MN_OK)
        return mn_fail_context(MN_ERR_ARG, "%s: ", attr);
    return MN_OK;
}

/* Every check walks the tables: bounds of integer fields, finite numbers,
 * choices in range and run by the engines, each selected part's parameter,
 * the expressions of custom parts. */
mn_status mn_rule_validate(const mn_rule *r)
{
    /* Numbers first, so that a NaN is named as such before a part's bound. */
    for (int f = 0; f < mn_rule_field_count; f++) {
        double x = mn_rule_field_get(r, f);
        if (mn_rule_fields[f].type == MN_FIELD_NUM && !isfinite(x))
            return mn_fail(MN_ERR_ARG, "%s must be a finite number, got %s", mn_rule_fields[f].name,
                           x != x ? "nan" : x > 0 ? "inf" : "-inf");
    }
    for (int f = 0; f < mn_rule_field_count; f++) {
        const mn_field *fd = &mn_rule_fields[f];
        double x = mn_rule_field_get(r, f);
        switch (fd->type) {
        case MN_FIELD_INT:
            if (x != mn_rule_field_default(r, f) && (x < fd->lo || x > fd->hi))
                return mn_fail(MN_ERR_ARG, "%s must be between %d and %d, got %g", fd->name, fd->lo, fd->hi, x);
            break;
        case MN_FIELD_BOOL: break;
        case MN_FIELD_NUM: break; /* checked above */
        case MN_FIELD_CHOICE: {
            const mn_part *part = mn_rule_part(r, fd->set, (int)x);
            if (!part) return mn_fail(MN_ERR_ARG, "%s: no such choice (%g)", fd->name, x);
            if (part->flags & MN_PART_PLANNED)
                return mn_fail(MN_ERR_ARG, "%s '%s' is specified (SPEC v2) but no engine of this version runs it yet",
                               fd->name, part->name);
            if (part->param != MN_PARAM_NONE) {
                const part_param *pp = &part_params[part->param];
                double value = *(const double *)((const char *)r + pp->offset);
                if (!(value > pp->above))
                    return mn_fail(MN_ERR_ARG, "%s must be > %g for %s %s, got %g", pp->field, pp->above, fd->name,
                                   part->name, value);
            }
            break;
        }
        }
    }
    if (r->glu && r->layers < 2)
        return mn_fail(MN_ERR_ARG, "glu gates the hidden layers and needs layers >= 2 (got layers = %d)", r->layers);
    int refresh = mn_rule_refresh(r);
    if (refresh < 0 || (refresh > 0 && refresh % r->step != 0))
        return mn_fail(MN_ERR_ARG, "refresh %d is not 0 or a multiple of step %d", refresh, r->step);
    for (int i = 0; i < mn_rule_expr_slot_count; i++) {
        const mn_rule_expr_slot *slot = &mn_rule_expr_slots[i];
        const mn_part *part = mn_rule_part(r, slot->set, (int)mn_rule_field_get(r, mn_rule_field_find(slot->field)));
        mn_expr *e = *mn_rule_expr_member((mn_rule *)r, i);
        if (part->flags & MN_PART_CUSTOM) MN_TRY(check_expr(r, slot->attr, part, e));
    }
    return MN_OK;
}

/* Parameter names, roles and shapes: model/param_layout.h. */
int mn_rule_param_count(const mn_rule *r) { return mn_param_count_glu(r->layers, r->bias, r->glu); }

void mn_rule_param_role(const mn_rule *r, int i, int *layer, bool *is_bias)
{
    *layer = mn_param_layer_glu(r->layers, r->bias, i);
    *is_bias = mn_param_is_bias_glu(r->layers, r->bias, i);
}

/* W1, b1, ... and glu's U1, c1, ... */
const char *mn_rule_param_name(const mn_rule *r, int i, char *buf, size_t len)
{
    static const char letter[2][2] = {{'W', 'b'}, {'U', 'c'}};
    int gate = mn_param_is_gate(r->layers, r->bias, i), bias = mn_param_is_bias_glu(r->layers, r->bias, i);
    snprintf(buf, len, "%c%d", letter[gate][bias], mn_param_layer_glu(r->layers, r->bias, i) + 1);
    return buf;
}

int mn_rule_param_shape(const mn_rule *r, const mn_dims *d, int i, int64_t *shape)
{
    int layer = mn_param_layer_glu(r->layers, r->bias, i);
    shape[0] = mn_layer_out(layer, r->layers, d->dv, d->dh);
    if (mn_param_is_bias_glu(r->layers, r->bias, i)) return 1;
    shape[1] = mn_layer_in(layer, d->dk, d->dh);
    return 2;
}

/* Outer parameters: rows of MN_OUTER_PARAMS, present with an out_norm. */
#define OUTER_NAME(name, dflt) #name,
#define OUTER_DFLT(name, dflt) dflt,
static const char *const outer_names[MN_OUTER_COUNT] = {MN_OUTER_PARAMS(OUTER_NAME)};
static const double outer_defaults[MN_OUTER_COUNT] = {MN_OUTER_PARAMS(OUTER_DFLT)};
#undef OUTER_NAME
#undef OUTER_DFLT
int mn_rule_outer_count(const mn_rule *r) { return r->out_norm != MN_NORM_NONE ? MN_OUTER_COUNT : 0; }
const char *mn_outer_name(int j) { return j >= 0 && j < MN_OUTER_COUNT ? outer_names[j] : NULL; }
double mn_outer_default(int j) { return j >= 0 && j < MN_OUTER_COUNT ? outer_defaults[j] : 0.0; }

/* ---- expression forms ---- */

/* The selected part's expression: the rule's own for a custom part, else the
 * built-in text parsed with its parameter bound to the rule's value (or,
 * open, left as the parameter's name). */
static mn_expr *part_expr(const mn_rule *r, const mn_part_set *set, int value, mn_expr *custom, bool open)
{
    const mn_part *part = mn_rule_part(r, set, value);
    if (!part) {
        mn_fail(MN_ERR_ARG, "unknown %s %d", set->what, value);
        return NULL;
    }
    if (part->flags & MN_PART_CUSTOM) return mn_expr_ref(custom);
    if (!part->expr) return NULL;
    mn_expr *e;
    if (mn_expr_parse(part->expr, &e) != MN_OK) return NULL; /* a bad row: test_rule_table catches it */
    const char *name = NULL;
    double param_value = 0;
    if (open || mn_rule_part_param(r, set, value, &name, &param_value) == MN_PARAM_NONE) return e;
    mn_expr *bound = mn_expr_bind(e, &name, &param_value, 1);
    mn_expr_unref(e);
    return bound;
}

mn_part_param mn_rule_part_param(const mn_rule *r, const mn_part_set *set, int value, const char **name,
                                 double *param_value)
{
    const mn_part *part = mn_rule_part(r, set, value);
    if (!part || (part->flags & MN_PART_CUSTOM) || part->param == MN_PARAM_NONE) return MN_PARAM_NONE;
    const part_param *pp = &part_params[part->param];
    if (name) *name = pp->name;
    if (param_value) *param_value = *(const double *)((const char *)r + pp->offset);
    return part->param;
}

mn_expr *mn_rule_loss_expr(const mn_rule *r) { return part_expr(r, &mn_loss_set, r->loss, r->loss_expr, false); }
mn_expr *mn_rule_loss_expr_open(const mn_rule *r) { return part_expr(r, &mn_loss_set, r->loss, r->loss_expr, true); }

mn_expr *mn_loss_grad_of(const mn_expr *f)
{
    if (!f) return NULL;
    mn_expr *dy = mn_expr_diff(f, "y");
    mn_expr *dr = mn_expr_diff(f, "r");
    mn_expr *sum = mn_expr_binary(MN_EX_ADD, dy, dr);
    if (!sum) return NULL;
    mn_expr *simple = mn_expr_simplify(sum);
    mn_expr_unref(sum);
    return simple;
}

/* df/dy with r = y - v: the partial in y plus the partial in r. */
mn_expr *mn_rule_loss_grad_expr(const mn_rule *r)
{
    mn_expr *f = mn_rule_loss_expr(r);
    mn_expr *d = mn_loss_grad_of(f);
    mn_expr_unref(f);
    return d;
}

mn_expr *mn_rule_activation_expr(const mn_rule *r)
{
    return part_expr(r, &mn_activation_set, r->activation, r->activation_expr, false);
}

mn_expr *mn_rule_activation_grad_expr(const mn_rule *r)
{
    mn_expr *f = mn_rule_activation_expr(r);
    if (!f) return NULL;
    mn_expr *d = mn_expr_diff(f, "z");
    mn_expr_unref(f);
    return d;
}

mn_expr *mn_rule_clip_expr(const mn_rule *r) { return part_expr(r, &mn_clip_set, r->clip, r->clip_expr, false); }
mn_expr *mn_rule_clip_expr_open(const mn_rule *r) { return part_expr(r, &mn_clip_set, r->clip, r->clip_expr, true); }

bool mn_rule_clip_scales(const mn_rule *r) { return (mn_clip_set.parts[r->clip].flags & MN_PART_SCALE) != 0; }
bool mn_rule_clip_elementwise(const mn_rule *r) { return (mn_clip_set.parts[r->clip].flags & MN_PART_ELEM) != 0; }
