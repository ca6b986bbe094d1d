/* rule_io.c: the /rule attribute tree in and out (rule_io.h), by walking the
 * rule table of rule.def: no field is named here. */
#include "rule_io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool mn_field_is_v2(const mn_field *f) { return strncmp(f->doc, "(v2)", 4) == 0; }

static bool is_expr_attr(const char *name)
{
    for (int i = 0; i < mn_rule_expr_slot_count; i++)
        if (strcmp(mn_rule_expr_slots[i].attr, name) == 0) return true;
    return false;
}

static const char *kind_name(const mn_node *n)
{
    switch (n->kind) {
    case MN_NODE_GROUP: return "a group";
    case MN_NODE_TENSOR: return "a dataset";
    case MN_NODE_NUMBER: return "a number";
    case MN_NODE_INTEGER: return "an integer";
    case MN_NODE_STRING: return "a string";
    }
    return "?";
}

/* A number from an attribute node (a one-element dataset counts too). */
static bool node_number(const mn_node *n, double *out)
{
    if (n->kind == MN_NODE_NUMBER) *out = n->number;
    else if (n->kind == MN_NODE_INTEGER) *out = (double)n->integer;
    else if (n->kind == MN_NODE_TENSOR && n->tensor.storage && mn_tensor_numel(&n->tensor) == 1) {
        int64_t zero[MN_MAX_DIMS] = {0};
        *out = mn_tensor_get(&n->tensor, zero);
    } else return false;
    return true;
}

static mn_status read_field(const mn_node *n, const mn_field *fd, const char *where, const char *noun, mn_rule *r,
                            int f)
{
    double x = 0;
    switch (fd->type) {
    case MN_FIELD_INT:
        if (!node_number(n, &x)) return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be an integer, got %s", where, noun, fd->name, kind_name(n));
        if (x != floor(x) || fabs(x) > 2e9)
            return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be an integer, got %g", where, noun, fd->name, x);
        break;
    case MN_FIELD_BOOL:
        if (!node_number(n, &x)) return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be 0 or 1, got %s", where, noun, fd->name, kind_name(n));
        if (x != 0 && x != 1) /* a 2 is more likely a slip than a yes */
            return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be 0 or 1 (false or true), got %g", where, noun, fd->name, x);
        break;
    case MN_FIELD_NUM:
        if (!node_number(n, &x)) return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be a number, got %s", where, noun, fd->name, kind_name(n));
        break;
    case MN_FIELD_CHOICE: {
        if (n->kind != MN_NODE_STRING)
            return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be a name, got %s", where, noun, fd->name, kind_name(n));
        int i;
        if (mn_part_lookup(fd->set, n->string, &i) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
        x = i;
        break;
    }
    }
    mn_rule_field_set(r, f, x);
    return MN_OK;
}

static mn_status rule_from_tree(const mn_node *g, const char *where, const char *noun, mn_rule *r)
{
    for (int i = 0; i < g->nchildren; i++) {
        const mn_node *c = g->children[i];
        if (c->kind == MN_NODE_GROUP) {
            if (strcmp(c->name, "constants") != 0)
                return mn_fail(MN_ERR_ARG, "%s: unexpected group '%s' (only 'constants')", where, c->name);
        } else if (mn_rule_field_find(c->name) < 0 && !is_expr_attr(c->name))
            return mn_fail(MN_ERR_ARG, "%s: unknown %s '%s'", where, noun, c->name);
    }
    /* In table order, so that a default may read the fields before it. */
    for (int f = 0; f < mn_rule_field_count; f++) {
        const mn_node *n = mn_node_find(g, mn_rule_fields[f].name);
        if (n) MN_TRY(read_field(n, &mn_rule_fields[f], where, noun, r, f));
        else mn_rule_field_set(r, f, mn_rule_field_default(r, f));
    }
    const mn_node *consts = mn_node_find(g, "constants");
    for (int i = 0; consts && consts->kind == MN_NODE_GROUP && i < consts->nchildren; i++) {
        const mn_node *c = consts->children[i];
        double value;
        if (!node_number(c, &value))
            return mn_fail(MN_ERR_ARG, "%s: constant '%s' must be a number, got %s", where, c->name, kind_name(c));
        if (mn_rule_set_const(r, c->name, value) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    }
    for (int i = 0; i < mn_rule_expr_slot_count; i++) {
        const mn_rule_expr_slot *slot = &mn_rule_expr_slots[i];
        int value = (int)mn_rule_field_get(r, mn_rule_field_find(slot->field));
        if (!(mn_rule_part(r, slot->set, value)->flags & MN_PART_CUSTOM)) continue;
        const mn_node *n = mn_node_find(g, slot->attr);
        if (!n) return mn_fail(MN_ERR_ARG, "%s: %s '%s' is missing (%s is custom)", where, noun, slot->attr, slot->field);
        if (n->kind != MN_NODE_STRING)
            return mn_fail(MN_ERR_ARG, "%s: %s '%s' must be an expression string, got %s", where, noun, slot->attr, kind_name(n));
        if (mn_expr_parse(n->string, mn_rule_expr_member(r, i)) != MN_OK)
            return mn_fail_context(MN_ERR_ARG, "%s: %s '%s': ", where, noun, slot->attr);
    }
    if (mn_rule_validate(r) != MN_OK) return mn_fail_context(MN_ERR_ARG, "%s: ", where);
    return MN_OK;
}

mn_status mn_rule_from_tree_as(const mn_node *group, const char *where, const char *noun, mn_rule *out)
{
    mn_rule_init(out);
    mn_status s = rule_from_tree(group, where, noun, out);
    if (s != MN_OK) mn_rule_free(out);
    return s;
}

mn_status mn_rule_from_tree(const mn_node *group, const char *where, mn_rule *out)
{
    return mn_rule_from_tree_as(group, where, "attribute", out);
}

mn_status mn_rule_to_tree(const mn_rule *r, mn_node *g)
{
    bool ok = true;
    for (int f = 0; ok && f < mn_rule_field_count; f++) {
        const mn_field *fd = &mn_rule_fields[f];
        double x = mn_rule_field_get(r, f);
        if (mn_field_is_v2(fd) && x == mn_rule_field_default(r, f)) continue;
        if (strcmp(fd->name, "refresh") == 0) x = mn_rule_refresh(r); /* files hold the resolved interval */
        switch (fd->type) {
        case MN_FIELD_INT:
        case MN_FIELD_BOOL: ok = mn_node_add_integer(g, fd->name, (int64_t)x) != NULL; break;
        case MN_FIELD_NUM: ok = mn_node_add_number(g, fd->name, x) != NULL; break;
        case MN_FIELD_CHOICE: ok = mn_node_add_string(g, fd->name, mn_part_name(fd->set, (int)x)) != NULL; break;
        }
    }
    for (int i = 0; ok && i < mn_rule_expr_slot_count; i++) {
        const mn_expr *e = *mn_rule_expr_member((mn_rule *)r, i);
        if (!e) continue;
        char *src = mn_expr_to_string(e);
        ok = src && mn_node_add_string(g, mn_rule_expr_slots[i].attr, src);
        free(src);
    }
    if (ok && r->nconsts) {
        mn_node *c = mn_node_add_group(g, "constants");
        ok = c != NULL;
        for (int i = 0; ok && i < r->nconsts; i++) ok = mn_node_add_number(c, r->const_names[i], r->const_values[i]) != NULL;
    }
    return ok ? MN_OK : mn_fail(MN_ERR_OOM, "out of memory writing the rule");
}
