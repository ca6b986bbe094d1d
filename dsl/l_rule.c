/* l_rule.c: update rules from Lua: building and describing them.
 *   mnemo.rule{...}            a Rule from a table (SPEC.md sections 1-4)
 *   rule:attrs(), rule:expressions(), rule:source(), rule:kernel_info(),
 *   rule:with{...}, tostring(rule), rule.<field>
 *   mnemo.load_experiment(p)   rule and inputs from an experiment file
 * Rule parts may be names ("huber"), expression strings ("abs(r)^1.5") or Lua
 * functions over symbolic arguments; gates may be numbers, tensors or
 * functions of the inputs. Running a rule (rule:run, rule:experiment,
 * rule:memory and the Memory userdata) is in l_run.c; l_rule_register here
 * registers both. */
#include "l_rule_internal.h"
#include "l_expr.h"
#include "../model/experiment.h"
#include "../model/rule_io.h"
#include "../model/h5.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/codegen.h"
#include "../kernels/cuda.h"
#include "../kernels/plan.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- building a rule from a table ---- */

int l_rule_field_int(lua_State *L, int t, const char *key, int dflt)
{
    int type = lua_getfield(L, t, key);
    int v = dflt;
    if (type == LUA_TBOOLEAN) v = lua_toboolean(L, -1);
    else if (type != LUA_TNIL) {
        int isnum;
        lua_Integer x = lua_tointegerx(L, -1, &isnum);
        if (!isnum) luaL_error(L, "mnemo.rule: field '%s' must be an integer, got %s", key, luaL_typename(L, -1));
        v = (int)x;
    }
    lua_pop(L, 1);
    return v;
}

/* Call the function at idx with symbolic arguments named vars (plus a table
 * of the rule's constants as Exprs) and return its Expr (new reference). */
static mn_expr *symbolic_call(lua_State *L, int idx, const char *part, const char *const *vars, int nvars,
                              const mn_rule *r)
{
    lua_pushvalue(L, idx);
    for (int i = 0; i < nvars; i++) l_push_expr(L, mn_expr_var(vars[i]));
    lua_createtable(L, 0, r->nconsts);
    for (int i = 0; i < r->nconsts; i++) {
        l_push_expr(L, mn_expr_var(r->const_names[i]));
        lua_setfield(L, -2, r->const_names[i]);
    }
    lua_call(L, nvars + 1, 1);
    mn_expr *e = l_test_expr(L, -1);
    if (!e && lua_type(L, -1) != LUA_TNUMBER)
        luaL_error(L, "mnemo.rule: the %s function must return an expression built from its arguments, got %s", part,
                   luaL_typename(L, -1));
    e = l_to_expr(L, -1, part);
    lua_pop(L, 1);
    return e;
}

/* True when s is a bare word that is not one of the part's variables or the
 * rule's constants: it was meant as a built-in name (a typo such as "hubr"),
 * not as an expression. */
static bool misspelt_name_str(const char *s, const char *const *vars, int nvars, const mn_rule *r)
{
    if (!(s[0] == '_' || ((s[0] | 32) >= 'a' && (s[0] | 32) <= 'z'))) return false;
    for (const char *p = s; *p; p++)
        if (!(*p == '_' || (*p >= '0' && *p <= '9') || ((*p | 32) >= 'a' && (*p | 32) <= 'z'))) return false;
    for (int i = 0; i < nvars; i++)
        if (strcmp(s, vars[i]) == 0) return false;
    for (int i = 0; i < r->nconsts; i++)
        if (strcmp(s, r->const_names[i]) == 0) return false;
    return true;
}

/* The Lua table becomes the attribute tree a file gives (rule_io.h), so one
 * reader checks both. The tree and the constants are owned by a userdata on
 * the stack while it is built, so a Lua error in between leaks nothing. */
typedef struct rule_build {
    mn_node *tree;
    mn_rule consts; /* the constants alone: for symbolic calls and names */
} rule_build;

static int rule_build_gc(lua_State *L)
{
    rule_build *rb = luaL_checkudata(L, 1, "mnemo.RuleBuild");
    mn_node_free(rb->tree);
    rb->tree = NULL;
    mn_rule_free(&rb->consts);
    return 0;
}

static rule_build *push_rule_build(lua_State *L)
{
    rule_build *rb = lua_newuserdatauv(L, sizeof *rb, 0);
    memset(rb, 0, sizeof *rb);
    mn_rule_init(&rb->consts);
    if (luaL_newmetatable(L, "mnemo.RuleBuild")) {
        lua_pushcfunction(L, rule_build_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    rb->tree = mn_node_group("rule");
    if (!rb->tree) luaL_error(L, "mnemo.rule: out of memory");
    return rb;
}

/* The expression at idx (a function of symbolic arguments, an expression
 * string or an Expr) as its string, added to the tree as attr. */
static void add_expr(lua_State *L, rule_build *rb, int idx, const char *key, const char *attr, const mn_part *part)
{
    char buf[4][8];
    const char *vars[4];
    int nvars = mn_part_vars(part, buf, vars);
    mn_expr *e = NULL;
    if (lua_isfunction(L, idx)) e = symbolic_call(L, idx, key, vars, nvars, &rb->consts);
    else if (lua_type(L, idx) == LUA_TSTRING) {
        if (mn_expr_parse(lua_tostring(L, idx), &e) != MN_OK) luaL_error(L, "mnemo.rule: %s: %s", key, mn_last_error());
    } else if ((e = l_test_expr(L, idx))) mn_expr_ref(e);
    else luaL_error(L, "mnemo.rule: field '%s' must be an expression (a string, an Expr or a function of %s), got %s",
                    key, part->vars, luaL_typename(L, idx));
    char *src = mn_expr_to_string(e);
    mn_expr_unref(e);
    if (!src || !mn_node_add_string(rb->tree, attr, src)) {
        free(src);
        luaL_error(L, "mnemo.rule: out of memory");
    }
    free(src);
}

static void add_value(lua_State *L, rule_build *rb, int idx, const char *key, const char *name)
{
    bool ok;
    switch (lua_type(L, idx)) {
    case LUA_TBOOLEAN: ok = mn_node_add_integer(rb->tree, name, lua_toboolean(L, idx)) != NULL; break;
    case LUA_TNUMBER:
        ok = lua_isinteger(L, idx) ? mn_node_add_integer(rb->tree, name, lua_tointeger(L, idx)) != NULL
                                   : mn_node_add_number(rb->tree, name, lua_tonumber(L, idx)) != NULL;
        break;
    case LUA_TSTRING: ok = mn_node_add_string(rb->tree, name, lua_tostring(L, idx)) != NULL; break;
    default:
        luaL_error(L, "mnemo.rule: field '%s' must be a number, a name or a boolean, got %s", key, luaL_typename(L, idx));
        return;
    }
    if (!ok) luaL_error(L, "mnemo.rule: out of memory");
}

/* The custom row of a part list (every list with an expression slot has one). */
static int custom_row(const mn_part_set *set, unsigned kind)
{
    for (int i = 0; i < set->count; i++)
        if ((set->parts[i].flags & MN_PART_CUSTOM) && (!kind || (set->parts[i].flags & kind))) return i;
    return -1;
}

/* A choice field with an expression slot, at idx: a built-in name, a
 * misspelt one (left for the reader's "unknown loss 'hubr' (one of: ...)"),
 * or a custom part given directly (a function, an expression string, an
 * Expr); clip takes functions only as elementwise clips. */
static void add_part(lua_State *L, rule_build *rb, int idx, const mn_rule_expr_slot *slot)
{
    const mn_part_set *set = slot->set;
    int row = custom_row(set, set == &mn_clip_set ? MN_PART_ELEM : 0);
    if (lua_type(L, idx) == LUA_TSTRING) {
        int found;
        char buf[4][8];
        const char *vars[4];
        int nvars = mn_part_vars(&set->parts[row], buf, vars);
        const char *s = lua_tostring(L, idx);
        bool named = mn_part_lookup(set, s, &found) == MN_OK || set == &mn_clip_set ||
                     misspelt_name_str(s, vars, nvars, &rb->consts);
        if (named) {
            add_value(L, rb, idx, slot->field, slot->field);
            return;
        }
    } else if (!lua_isfunction(L, idx) && !l_test_expr(L, idx))
        luaL_error(L, "mnemo.rule: field '%s' must be a name or an expression, got %s", slot->field,
                   luaL_typename(L, idx));
    if (!mn_node_add_string(rb->tree, slot->field, set->parts[row].name)) luaL_error(L, "mnemo.rule: out of memory");
    add_expr(L, rb, idx, slot->field, slot->attr, &set->parts[row]);
}

static const mn_rule_expr_slot *slot_of_field(const char *field)
{
    for (int i = 0; i < mn_rule_expr_slot_count; i++)
        if (strcmp(mn_rule_expr_slots[i].field, field) == 0) return &mn_rule_expr_slots[i];
    return NULL;
}

static const mn_rule_expr_slot *slot_of_attr(const char *attr)
{
    for (int i = 0; i < mn_rule_expr_slot_count; i++)
        if (strcmp(mn_rule_expr_slots[i].attr, attr) == 0) return &mn_rule_expr_slots[i];
    return NULL;
}

/* The table key as a rule field (an alias resolved), or NULL. */
static const mn_field *field_of_key(const char *key)
{
    for (int f = 0; f < mn_rule_field_count; f++)
        if (strcmp(mn_rule_fields[f].name, key) == 0 ||
            (mn_rule_fields[f].alias && strcmp(mn_rule_fields[f].alias, key) == 0))
            return &mn_rule_fields[f];
    return NULL;
}

static bool is_gate(const char *key)
{
    return strcmp(key, "theta") == 0 || strcmp(key, "eta") == 0 || strcmp(key, "alpha") == 0;
}

/* The part row the tree selects for slot's field so far (its default if the
 * table did not give it). */
static const mn_part *selected_part(const rule_build *rb, const mn_rule_expr_slot *slot)
{
    const mn_node *n = mn_node_find(rb->tree, slot->field);
    int i = 0;
    if (n && n->kind == MN_NODE_STRING && mn_part_lookup(slot->set, n->string, &i) == MN_OK) return &slot->set->parts[i];
    return &slot->set->parts[(int)mn_rule_field_default(&rb->consts, mn_rule_field_find(slot->field))];
}

/* Fill r from the table at t; raises on any error. */
static void rule_from_table(lua_State *L, int t, mn_rule *r)
{
    rule_build *rb = push_rule_build(L);
    int top = lua_gettop(L);
    if (lua_getfield(L, t, "constants") == LUA_TTABLE) {
        mn_node *cg = mn_node_add_group(rb->tree, "constants");
        if (!cg) luaL_error(L, "mnemo.rule: out of memory");
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TNUMBER)
                luaL_error(L, "mnemo.rule: constants must map names to numbers");
            if (mn_rule_set_const(&rb->consts, lua_tostring(L, -2), lua_tonumber(L, -1)) != MN_OK)
                luaL_error(L, "mnemo.rule: %s", mn_last_error());
            if (!mn_node_add_number(cg, lua_tostring(L, -2), lua_tonumber(L, -1))) luaL_error(L, "mnemo.rule: out of memory");
            lua_pop(L, 1);
        }
    } else if (!lua_isnil(L, -1)) luaL_error(L, "mnemo.rule: field 'constants' must be a table of numbers");
    lua_settop(L, top);
    /* Fields first (in any order), then expressions, whose variables
     * depend on the part their field selects. */
    for (int pass = 0; pass < 2; pass++) {
        lua_pushnil(L);
        while (lua_next(L, t)) {
            if (lua_type(L, -2) != LUA_TSTRING)
                luaL_error(L, "mnemo.rule: keys must be names, got a %s key", luaL_typename(L, -2));
            const char *key = lua_tostring(L, -2);
            int v = lua_gettop(L);
            const mn_field *fd = field_of_key(key);
            const mn_rule_expr_slot *slot = fd ? slot_of_field(fd->name) : slot_of_attr(key);
            if (pass == 0) {
                if (fd && mn_node_find(rb->tree, fd->name))
                    luaL_error(L, "mnemo.rule: field '%s' is given twice (as '%s' and an alias)", fd->name, key);
                if (fd && slot) add_part(L, rb, v, slot);
                else if (fd) add_value(L, rb, v, key, fd->name);
                else if (!slot && !is_gate(key) && strcmp(key, "constants") != 0 && strcmp(key, "clip_scale") != 0)
                    luaL_error(L, "mnemo.rule: unknown field '%s'", key);
            } else if (!fd && slot) {
                if (mn_node_find(rb->tree, slot->attr))
                    luaL_error(L, "mnemo.rule: '%s' is given twice (with its field and as '%s')", slot->attr, key);
                add_expr(L, rb, v, key, slot->attr, selected_part(rb, slot));
            } else if (strcmp(key, "clip_scale") == 0) {
                /* Lua's shorthand for clip = "scale" with clip_expr. */
                const mn_node *clip = mn_node_find(rb->tree, "clip");
                if (clip && !(clip->kind == MN_NODE_STRING && strcmp(clip->string, "scale") == 0))
                    luaL_error(L, "mnemo.rule: clip_scale goes with clip = 'scale' (or no clip field)");
                if (!clip && !mn_node_add_string(rb->tree, "clip", "scale")) luaL_error(L, "mnemo.rule: out of memory");
                const mn_rule_expr_slot *cs = slot_of_field("clip");
                if (mn_node_find(rb->tree, cs->attr)) luaL_error(L, "mnemo.rule: clip_scale and clip_expr are both given");
                add_expr(L, rb, v, key, cs->attr, &mn_clip_set.parts[MN_CLIP_SCALE]);
            }
            lua_settop(L, v - 1);
        }
    }
    mn_rule built;
    if (mn_rule_from_tree_as(rb->tree, "mnemo.rule", "field", &built) != MN_OK) luaL_error(L, "%s", mn_last_error());
    mn_rule_free(r);
    *r = built;
    lua_settop(L, top - 1);
}

static int rule_gc(lua_State *L)
{
    l_rule *lr = luaL_checkudata(L, 1, RULE_MT);
    mn_rule_free(&lr->rule);
    lr->ready = false;
    return 0;
}

/* mnemo.rule{...}: the uservalue keeps the gates and the source table. */
static int l_rule_new(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    l_rule *lr = lua_newuserdatauv(L, sizeof *lr, 1);
    memset(lr, 0, sizeof *lr);
    mn_rule_init(&lr->rule);
    luaL_setmetatable(L, RULE_MT);
    rule_from_table(L, 1, &lr->rule);
    lr->ready = true;
    lua_createtable(L, 0, 3);
    static const char *const gates[] = {"theta", "eta", "alpha"};
    for (int i = 0; i < 3; i++) {
        lua_getfield(L, 1, gates[i]);
        int type = lua_type(L, -1);
        if (type != LUA_TNIL && type != LUA_TNUMBER && type != LUA_TFUNCTION && !l_test_tensor(L, -1))
            luaL_error(L, "mnemo.rule: gate '%s' must be a number, a tensor or a function of the inputs, got %s",
                       gates[i], luaL_typename(L, -1));
        lua_setfield(L, -2, gates[i]);
    }
    lua_pushvalue(L, 1);
    lua_setfield(L, -2, "source");
    lua_setiuservalue(L, -2, 1);
    return 1;
}

/* rule:attrs(): the /rule attributes as a table. */
void l_push_rule_attrs(lua_State *L, const mn_rule *r)
{
    mn_node *g = mn_node_group("rule");
    if (!g || mn_rule_to_tree(r, g) != MN_OK) {
        mn_node_free(g);
        l_raise(L);
    }
    l_push_tree(L, g);
    mn_node_free(g);
}

static int rule_attrs(lua_State *L)
{
    l_push_rule_attrs(L, &check_rule(L, 1)->rule);
    return 1;
}

/* rule:save(path): the rule alone as a file with the experiment schema's
 * /rule group (attributes and constants), for the PyTorch bridge
 * (python/mnemo_torch) or mnemo.load_experiment's /rule. */
static int rule_save(lua_State *L)
{
    const mn_rule *r = &check_rule(L, 1)->rule;
    const char *path = luaL_checkstring(L, 2);
    mn_node *root = mn_node_group("");
    mn_node *g = root ? mn_node_add_group(root, "rule") : NULL;
    mn_status st = g ? MN_OK : mn_fail(MN_ERR_OOM, "rule:save: out of memory");
    if (st == MN_OK && !mn_node_add_integer(root, "mnemo_schema", 1)) st = mn_fail(MN_ERR_OOM, "rule:save: out of memory");
    if (st == MN_OK) st = mn_rule_to_tree(r, g);
    if (st == MN_OK) st = mn_h5_save(path, root);
    mn_node_free(root);
    if (st != MN_OK) return l_raise(L);
    return 0;
}

static void push_expr_string(lua_State *L, mn_expr *e)
{
    if (!e) {
        lua_pushnil(L);
        return;
    }
    char *s = mn_expr_to_string(e);
    mn_expr_unref(e);
    if (!s) l_raise(L);
    lua_pushstring(L, s);
    free(s);
}

/* rule:expressions(): every part and derivative as strings. */
static int rule_expressions(lua_State *L)
{
    const mn_rule *r = &check_rule(L, 1)->rule;
    lua_createtable(L, 0, 5);
    push_expr_string(L, mn_rule_loss_expr(r));
    lua_setfield(L, -2, "loss");
    push_expr_string(L, mn_rule_loss_grad_expr(r));
    lua_setfield(L, -2, "loss_grad");
    push_expr_string(L, mn_rule_activation_expr(r));
    lua_setfield(L, -2, "activation");
    push_expr_string(L, mn_rule_activation_grad_expr(r));
    lua_setfield(L, -2, "activation_grad");
    if (r->clip != MN_CLIP_NONE) {
        push_expr_string(L, mn_rule_clip_expr(r));
        lua_setfield(L, -2, "clip");
    }
    return 1;
}

/* rule:source([{dk=, dv=, hidden=, precision=, backward=, q=, lengths=}]):
 * the CUDA source the GPU engine compiles for this rule at those sizes
 * (default dk 64, dv = dk, hidden = the rule's or 64, fp32) for a run
 * without q and lengths (q = true, lengths = true: with them; the fused
 * path compiles their code only then), or with backward = true that of the
 * backward the plan picks for a run of it. Needs no GPU. */
static int rule_source(lua_State *L)
{
    const mn_rule *r = &check_rule(L, 1)->rule;
    mn_dims d = {1, 1, 1, 64, 0, 0, 1};
    mn_precision prec = MN_PREC_FP32;
    bool backward = false, with_q = false, with_lengths = false;
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        d.dk = l_rule_field_int(L, 2, "dk", 64);
        d.dh = l_rule_field_int(L, 2, "hidden", 0);
        d.dv = l_rule_field_int(L, 2, "dv", 0);
        lua_getfield(L, 2, "precision");
        if (!lua_isnil(L, -1) && mn_precision_lookup(luaL_checkstring(L, -1), &prec) != MN_OK) l_raise(L);
        lua_pop(L, 1);
        lua_getfield(L, 2, "backward");
        backward = lua_toboolean(L, -1);
        lua_pop(L, 1);
        lua_getfield(L, 2, "q");
        with_q = lua_toboolean(L, -1);
        lua_pop(L, 1);
        lua_getfield(L, 2, "lengths");
        with_lengths = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    if (d.dv == 0) d.dv = d.dk;
    if (d.dh == 0) d.dh = r->hidden > 0 ? r->hidden : 64;
#ifdef MN_HAVE_CUDA
    mn_cuda_plan pl;
    char *src = NULL;
    if (backward) {
        char why[256];
        if (!mn_cuda_backward_covers(r, why, sizeof why))
            return luaL_error(L, "source: the backward of this rule runs on the cpu (%s)", why);
        if (mn_cuda_plan_backward(r, &d, prec, mn_cuda_arch(), mn_cuda_smem_optin(), &pl) != MN_OK) return l_raise(L);
        src = mn_cuda_plan_backward_source(r, &d, prec, &pl);
    } else {
        if (mn_cuda_plan_rule(r, &d, prec, 1, mn_cuda_arch(), mn_cuda_smem_optin(), &pl) != MN_OK) return l_raise(L);
        pl.with_q = with_q;
        pl.with_lengths = with_lengths;
        src = mn_cuda_plan_source(r, &d, prec, &pl);
    }
    if (!src) return l_raise(L);
    lua_pushstring(L, src);
    free(src);
    return 1;
#else
    return luaL_error(L, "source: this build has no CUDA code generator (built with CUDA=0)");
#endif
}

/* rule:kernel_info{dk=, dv=, hidden=, B=, H=, precision=, arch=}: resources
 * and occupancy of the rule's GPU kernels (dsl/l_kernel_info.c). */
static int rule_kernel_info(lua_State *L) { return l_rule_kernel_info(L, &check_rule(L, 1)->rule, 2); }

/* rule:plan{dk=, dv=, hidden=, B=, H=, precision=}: which CUDA path would run
 * the rule at those sizes, and why (dsl/l_kernel_info.c, kernels/plan.h). */
static int rule_plan(lua_State *L) { return l_rule_plan(L, &check_rule(L, 1)->rule, 2); }

static int rule_tostring(lua_State *L)
{
    const mn_rule *r = &check_rule(L, 1)->rule;
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    char line[512];
    snprintf(line, sizeof line, "mnemo.Rule: memory %s%d layer%s", r->layers == 1 ? "linear, " : "MLP, ", r->layers,
             r->layers == 1 ? "" : "s");
    luaL_addstring(&b, line);
    if (r->layers > 1) {
        snprintf(line, sizeof line, ", hidden %d, %s%s%s", r->hidden, mn_activation_name(r->activation),
                 r->glu ? " gated (glu)" : "", r->bias ? ", bias" : "");
        luaL_addstring(&b, line);
    }
    if (r->residual) luaL_addstring(&b, ", residual");
    char param[48] = "";
    if (r->loss == MN_LOSS_HUBER) snprintf(param, sizeof param, "delta %g, ", r->loss_delta);
    if (r->loss == MN_LOSS_LP) snprintf(param, sizeof param, "p %g, ", r->loss_p);
    snprintf(line, sizeof line, "\n  loss %s (%sfeatures: %s, tokens: %s)", mn_loss_name(r->loss), param,
             r->feature_reduce == MN_REDUCE_MEAN ? "mean" : "sum", r->token_reduce == MN_REDUCE_MEAN ? "mean" : "sum");
    luaL_addstring(&b, line);
    snprintf(line, sizeof line, "\n  step %d, refresh %d, retrieve %s", r->step, mn_rule_refresh(r),
             r->retrieve == MN_RETRIEVE_AFTER ? "after" : "before");
    luaL_addstring(&b, line);
    if (r->clip != MN_CLIP_NONE) {
        snprintf(line, sizeof line, "\n  clip %s (max %g, scope %s)", mn_clip_name(r->clip), r->clip_max,
                 r->clip_scope == MN_SCOPE_GLOBAL ? "global" : "tensor");
        luaL_addstring(&b, line);
    }
    mn_expr *parts[3] = {r->loss_expr, r->activation_expr, r->clip_expr};
    const char *names[3] = {"loss", "activation", "clip"};
    for (int i = 0; i < 3; i++) {
        if (!parts[i]) continue;
        char *s = mn_expr_to_string(parts[i]);
        snprintf(line, sizeof line, "\n  %s = %s", names[i], s ? s : "?");
        free(s);
        luaL_addstring(&b, line);
    }
    luaL_pushresult(&b);
    return 1;
}

/* mnemo.load_experiment(path) -> rule, inputs (a table for rule:run). */
static int l_load_experiment(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    mn_experiment e;
    if (mn_experiment_load(path, &e) != MN_OK) return l_raise(L);
    l_rule *lr = lua_newuserdatauv(L, sizeof *lr, 1);
    memset(lr, 0, sizeof *lr);
    luaL_setmetatable(L, RULE_MT);
    mn_status s = mn_rule_copy(&lr->rule, &e.rule);
    lr->ready = s == MN_OK;
    lua_createtable(L, 0, 1);
    lua_createtable(L, 0, 0);
    lua_setfield(L, -2, "source");
    lua_setiuservalue(L, -2, 1);
    lua_createtable(L, 0, 8);
    const struct { const char *name; mn_tensor *t; } items[] = {
        {"k", &e.k}, {"v", &e.v}, {"q", &e.q}, {"theta", &e.theta}, {"eta", &e.eta}, {"alpha", &e.alpha}};
    for (size_t i = 0; i < sizeof items / sizeof *items; i++) {
        if (!items[i].t->storage) continue;
        mn_tensor *t = l_push_empty_tensor(L);
        mn_tensor_share(t, items[i].t);
        lua_setfield(L, -2, items[i].name);
    }
    lua_createtable(L, 0, 4);
    for (int i = 0; i < mn_rule_param_count(&e.rule); i++) {
        char name[16], sname[20];
        mn_rule_param_name(&e.rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        mn_tensor *srcs[2] = {&e.init[i], &e.init_momenta[i]};
        const char *names[2] = {name, sname};
        for (int j = 0; j < 2; j++) {
            if (!srcs[j]->storage) continue;
            mn_tensor *t = l_push_empty_tensor(L);
            mn_tensor_share(t, srcs[j]);
            lua_setfield(L, -2, names[j]);
        }
    }
    lua_setfield(L, -2, "init");
    mn_experiment_free(&e);
    if (s != MN_OK) return l_raise(L);
    return 2;
}

/* Rule fields read like a table: rule.step, rule.loss, ... */
static int rule_index(lua_State *L)
{
    check_rule(L, 1);
    luaL_getmetatable(L, RULE_MT);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, 2);
    if (lua_rawget(L, -2) != LUA_TNIL) return 1;
    if (lua_type(L, 2) != LUA_TSTRING) return 0;
    const char *key = lua_tostring(L, 2);
    if (strcmp(key, "theta") == 0 || strcmp(key, "eta") == 0 || strcmp(key, "alpha") == 0 || strcmp(key, "source") == 0) {
        lua_getiuservalue(L, 1, 1);
        lua_getfield(L, -1, key);
        return 1;
    }
    l_push_rule_attrs(L, &check_rule(L, 1)->rule);
    lua_getfield(L, -1, key);
    return 1;
}

/* rule:with{step = 16}: a new rule with some fields replaced. */
static int rule_with(lua_State *L)
{
    check_rule(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_getiuservalue(L, 1, 1);
    lua_getfield(L, -1, "source");
    if (!lua_istable(L, -1)) luaL_error(L, "with: this rule was not made by mnemo.rule{...}");
    lua_createtable(L, 0, 16);
    int merged = lua_gettop(L);
    for (int src = 0; src < 2; src++) {
        lua_pushnil(L);
        while (lua_next(L, src == 0 ? merged - 1 : 2)) {
            lua_pushvalue(L, -2);
            lua_insert(L, -2);
            lua_settable(L, merged);
        }
    }
    lua_pushcfunction(L, l_rule_new);
    lua_pushvalue(L, merged);
    lua_call(L, 1, 1);
    return 1;
}

static void push_part_flags(lua_State *L, unsigned flags)
{
    static const struct { unsigned flag; const char *name; } names[] = {
        {MN_PART_CUSTOM, "custom"}, {MN_PART_KINK, "kink"}, {MN_PART_SCALE, "scale"},
        {MN_PART_ELEM, "elementwise"}, {MN_PART_PLANNED, "planned"}, {MN_PART_CPU_ONLY, "cpu_only"}};
    lua_createtable(L, 0, 6);
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        lua_pushboolean(L, (flags & names[i].flag) != 0);
        lua_setfield(L, -2, names[i].name);
    }
}

/* mnemo.vocabulary() -> {fields = {...}, parts = {loss = {...}, ...}}: the
 * rule table (model/rule.def) as Lua data, for help() and for tests that
 * iterate every field and part. */
static int l_vocabulary(lua_State *L)
{
    lua_createtable(L, 0, 2);
    lua_createtable(L, mn_rule_field_count, 0);
    static const char *const type_names[] = {"integer", "boolean", "number", "choice"};
    for (int f = 0; f < mn_rule_field_count; f++) {
        const mn_field *fd = &mn_rule_fields[f];
        lua_createtable(L, 0, 8);
        lua_pushstring(L, fd->name);
        lua_setfield(L, -2, "name");
        lua_pushstring(L, type_names[fd->type]);
        lua_setfield(L, -2, "type");
        /* The default as a user writes it: a name, a number, or the rule
         * for a default that depends on earlier fields ("layers >= 2"). */
        mn_rule fresh;
        mn_rule_init(&fresh);
        double x = mn_rule_field_get(&fresh, f);
        if (strstr(fd->dflt, "r->")) {
            luaL_Buffer b;
            luaL_buffinit(L, &b);
            for (const char *p = fd->dflt; *p; p++) {
                if (strncmp(p, "r->", 3) == 0) p += 3;
                luaL_addchar(&b, *p);
            }
            luaL_pushresult(&b);
        } else if (fd->type == MN_FIELD_CHOICE) lua_pushstring(L, mn_part_name(fd->set, (int)x));
        else if (fd->type == MN_FIELD_BOOL) lua_pushboolean(L, x != 0);
        else if (fd->type == MN_FIELD_INT) lua_pushinteger(L, (lua_Integer)x);
        else lua_pushnumber(L, x);
        mn_rule_free(&fresh);
        lua_setfield(L, -2, "default");
        lua_pushstring(L, fd->doc);
        lua_setfield(L, -2, "doc");
        lua_pushboolean(L, mn_field_is_v2(fd));
        lua_setfield(L, -2, "v2");
        if (fd->alias) {
            lua_pushstring(L, fd->alias);
            lua_setfield(L, -2, "alias");
        }
        if (fd->type == MN_FIELD_INT) {
            lua_pushinteger(L, fd->lo);
            lua_setfield(L, -2, "min");
            lua_pushinteger(L, fd->hi);
            lua_setfield(L, -2, "max");
        }
        if (fd->set) {
            lua_pushstring(L, fd->set->what);
            lua_setfield(L, -2, "parts");
        }
        lua_rawseti(L, -2, f + 1);
    }
    lua_setfield(L, -2, "fields");
    const mn_part_set *sets[] = {&mn_activation_set, &mn_loss_set, &mn_clip_set, &mn_scope_set, &mn_reduce_set,
                                 &mn_retrieve_set, &mn_norm_set, &mn_qknorm_set, &mn_precond_set};
    lua_createtable(L, 0, (int)(sizeof sets / sizeof *sets));
    for (size_t i = 0; i < sizeof sets / sizeof *sets; i++) {
        lua_createtable(L, sets[i]->count, 0);
        for (int j = 0; j < sets[i]->count; j++) {
            const mn_part *p = &sets[i]->parts[j];
            lua_createtable(L, 0, 5);
            lua_pushstring(L, p->name);
            lua_setfield(L, -2, "name");
            if (p->expr) {
                lua_pushstring(L, p->expr);
                lua_setfield(L, -2, "expr");
            }
            lua_pushstring(L, p->vars);
            lua_setfield(L, -2, "vars");
            lua_pushstring(L, p->doc);
            lua_setfield(L, -2, "doc");
            push_part_flags(L, p->flags);
            lua_setfield(L, -2, "flags");
            lua_rawseti(L, -2, j + 1);
        }
        lua_setfield(L, -2, sets[i]->what);
    }
    lua_setfield(L, -2, "parts");
    return 1;
}

void l_rule_register(lua_State *L)
{
    int module = lua_gettop(L);
    static const luaL_Reg rule_methods[] = {
        {"run", l_rule_run}, {"memory", l_rule_memory}, {"experiment", l_rule_experiment}, {"attrs", rule_attrs}, {"save", rule_save},
        {"expressions", rule_expressions}, {"with", rule_with}, {"source", rule_source},
        {"kernel_info", rule_kernel_info}, {"plan", rule_plan}, {NULL, NULL}};
    luaL_newmetatable(L, RULE_MT);
    lua_pushcfunction(L, rule_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, rule_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, rule_index);
    lua_setfield(L, -2, "__index");
    luaL_newlib(L, rule_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, module, "Rule");
    lua_setfield(L, -2, "__methods");
    lua_pop(L, 1);

    static const luaL_Reg memory_methods[] = {
        {"write", l_memory_write}, {"run", l_memory_run}, {"read", l_memory_read}, {"reset", l_memory_reset},
        {"state", l_memory_state}, {"close", l_memory_gc}, {NULL, NULL}};
    luaL_newmetatable(L, MEMORY_MT);
    lua_pushcfunction(L, l_memory_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_memory_gc);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, l_memory_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, l_memory_index);
    lua_setfield(L, -2, "__index");
    luaL_newlib(L, memory_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, module, "Memory");
    lua_setfield(L, -2, "__methods");
    lua_pop(L, 1);

    lua_pushcfunction(L, l_rule_new);
    lua_setfield(L, module, "rule");
    lua_pushcfunction(L, l_load_experiment);
    lua_setfield(L, module, "load_experiment");
    lua_pushcfunction(L, l_vocabulary);
    lua_setfield(L, module, "vocabulary");
}
