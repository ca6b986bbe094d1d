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
#ifdef MN_HAVE_CUDA
#include "../kernels/codegen.h"
#include "../kernels/cuda.h"
#include "../kernels/plan.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- building a rule from a table ---- */

static const char *const rule_keys[] = {
    "layers", "hidden", "activation", "bias", "residual", "loss", "loss_delta", "loss_p", "delta", "p",
    "feature_reduce", "token_reduce", "step", "refresh", "retrieve", "clip", "clip_max", "clip_scope",
    "clip_scale", "clip_expr", "loss_expr", "activation_expr", "constants", "theta", "eta", "alpha", NULL};

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

static double field_number(lua_State *L, int t, const char *key, double dflt)
{
    int type = lua_getfield(L, t, key);
    double v = dflt;
    if (type != LUA_TNIL) {
        int isnum;
        v = lua_tonumberx(L, -1, &isnum);
        if (!isnum) luaL_error(L, "mnemo.rule: field '%s' must be a number, got %s", key, luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    return v;
}

/* The string field, or NULL when absent; the string stays valid while the
 * table holds it. */
static const char *field_string(lua_State *L, int t, const char *key)
{
    int type = lua_getfield(L, t, key);
    const char *s = NULL;
    if (type == LUA_TSTRING) s = lua_tostring(L, -1);
    else if (type != LUA_TNIL) luaL_error(L, "mnemo.rule: field '%s' must be a string, got %s", key, luaL_typename(L, -1));
    lua_pop(L, 1);
    return s;
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

/* A custom part from a function or an expression string at field key. */
static mn_expr *custom_part(lua_State *L, int t, const char *key, const char *const *vars, int nvars, const mn_rule *r)
{
    lua_getfield(L, t, key);
    mn_expr *e = NULL;
    if (lua_isfunction(L, -1)) e = symbolic_call(L, lua_gettop(L), key, vars, nvars, r);
    else if (lua_type(L, -1) == LUA_TSTRING) {
        if (mn_expr_parse(lua_tostring(L, -1), &e) != MN_OK) {
            lua_pop(L, 1);
            luaL_error(L, "mnemo.rule: %s: %s", key, mn_last_error());
        }
    } else if ((e = l_test_expr(L, -1))) mn_expr_ref(e);
    lua_pop(L, 1);
    return e;
}

static const char *const loss_vars[] = {"y", "v", "r"};
static const char *const act_vars[] = {"z"};
static const char *const g_vars[] = {"g"};
static const char *const n_vars[] = {"n"};

/* True when the string at the top of the stack is a bare word that is not
 * one of the part's variables or the rule's constants: it was meant as a
 * built-in name (a typo such as "hubr"), not as an expression. */
static bool misspelt_name(lua_State *L, const char *const *vars, int nvars, const mn_rule *r)
{
    if (lua_type(L, -1) != LUA_TSTRING) return false;
    const char *s = lua_tostring(L, -1);
    if (!(s[0] == '_' || ((s[0] | 32) >= 'a' && (s[0] | 32) <= 'z'))) return false;
    for (const char *p = s; *p; p++)
        if (!(*p == '_' || (*p >= '0' && *p <= '9') || ((*p | 32) >= 'a' && (*p | 32) <= 'z'))) return false;
    for (int i = 0; i < nvars; i++)
        if (strcmp(s, vars[i]) == 0) return false;
    for (int i = 0; i < r->nconsts; i++)
        if (strcmp(s, r->const_names[i]) == 0) return false;
    return true;
}

/* Fill r from the table at t; raises on any error (r is owned by a
 * userdata, so its expressions are freed by the GC). */
static void rule_from_table(lua_State *L, int t, mn_rule *r)
{
    lua_pushnil(L);
    while (lua_next(L, t)) {
        if (lua_type(L, -2) != LUA_TSTRING) luaL_error(L, "mnemo.rule: keys must be names, got a %s key", luaL_typename(L, -2));
        const char *key = lua_tostring(L, -2);
        bool known = false;
        for (int i = 0; rule_keys[i] && !known; i++) known = strcmp(key, rule_keys[i]) == 0;
        if (!known) luaL_error(L, "mnemo.rule: unknown field '%s'", key);
        lua_pop(L, 1);
    }
    r->layers = l_rule_field_int(L, t, "layers", 1);
    r->hidden = l_rule_field_int(L, t, "hidden", 0);
    r->bias = l_rule_field_int(L, t, "bias", r->layers >= 2) != 0;
    r->residual = l_rule_field_int(L, t, "residual", 0) != 0;
    r->loss_delta = field_number(L, t, "delta", field_number(L, t, "loss_delta", r->loss_delta));
    r->loss_p = field_number(L, t, "p", field_number(L, t, "loss_p", r->loss_p));
    r->step = l_rule_field_int(L, t, "step", 1);
    r->refresh = l_rule_field_int(L, t, "refresh", -1);
    r->clip_max = field_number(L, t, "clip_max", r->clip_max);
    const char *s;
    if ((s = field_string(L, t, "feature_reduce")) && mn_reduce_lookup("feature_reduce", s, &r->feature_reduce) != MN_OK) l_raise(L);
    if ((s = field_string(L, t, "token_reduce")) && mn_reduce_lookup("token_reduce", s, &r->token_reduce) != MN_OK) l_raise(L);
    if ((s = field_string(L, t, "retrieve")) && mn_retrieve_lookup(s, &r->retrieve) != MN_OK) l_raise(L);
    if ((s = field_string(L, t, "clip_scope")) && mn_clip_scope_lookup(s, &r->clip_scope) != MN_OK) l_raise(L);

    if (lua_getfield(L, t, "constants") == LUA_TTABLE) {
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TNUMBER)
                luaL_error(L, "mnemo.rule: constants must map names to numbers");
            if (mn_rule_set_const(r, lua_tostring(L, -2), lua_tonumber(L, -1)) != MN_OK) l_raise(L);
            lua_pop(L, 1);
        }
    }
    lua_pop(L, 1);

    /* activation: a built-in name, else a custom function or expression */
    lua_getfield(L, t, "activation");
    if (lua_type(L, -1) == LUA_TSTRING && mn_activation_lookup(lua_tostring(L, -1), &r->activation) == MN_OK) {
        if (r->activation == MN_ACT_CUSTOM) r->activation_expr = custom_part(L, t, "activation_expr", act_vars, 1, r);
    } else if (misspelt_name(L, act_vars, 1, r)) {
        luaL_error(L, "mnemo.rule: %s", mn_last_error()); /* the lookup's "unknown activation ... (one of: ...)" */
    } else if (!lua_isnil(L, -1)) {
        r->activation = MN_ACT_CUSTOM;
        r->activation_expr = custom_part(L, t, "activation", act_vars, 1, r);
    }
    lua_pop(L, 1);

    lua_getfield(L, t, "loss");
    if (lua_type(L, -1) == LUA_TSTRING && mn_loss_lookup(lua_tostring(L, -1), &r->loss) == MN_OK) {
        if (r->loss == MN_LOSS_CUSTOM) r->loss_expr = custom_part(L, t, "loss_expr", loss_vars, 3, r);
    } else if (misspelt_name(L, loss_vars, 3, r)) {
        luaL_error(L, "mnemo.rule: %s", mn_last_error()); /* the lookup's "unknown loss ... (one of: ...)" */
    } else if (!lua_isnil(L, -1)) {
        r->loss = MN_LOSS_CUSTOM;
        r->loss_expr = custom_part(L, t, "loss", loss_vars, 3, r);
    }
    lua_pop(L, 1);

    lua_getfield(L, t, "clip");
    if (lua_isfunction(L, -1)) {
        r->clip = MN_CLIP_ELEMENTWISE;
        r->clip_expr = custom_part(L, t, "clip", g_vars, 1, r);
    } else if (lua_type(L, -1) == LUA_TSTRING) {
        if (mn_clip_lookup(lua_tostring(L, -1), &r->clip) != MN_OK) l_raise(L);
        if (r->clip == MN_CLIP_ELEMENTWISE) r->clip_expr = custom_part(L, t, "clip_expr", g_vars, 1, r);
        if (r->clip == MN_CLIP_SCALE) {
            r->clip_expr = custom_part(L, t, "clip_scale", n_vars, 1, r);
            if (!r->clip_expr) r->clip_expr = custom_part(L, t, "clip_expr", n_vars, 1, r);
        }
    } else if (!lua_isnil(L, -1)) luaL_error(L, "mnemo.rule: field 'clip' must be a name or a function of g");
    lua_pop(L, 1);
    lua_getfield(L, t, "clip_scale");
    if (!lua_isnil(L, -1) && r->clip != MN_CLIP_SCALE) {
        if (r->clip != MN_CLIP_NONE) luaL_error(L, "mnemo.rule: clip_scale goes with clip = 'scale' (or no clip field)");
        r->clip = MN_CLIP_SCALE;
        r->clip_expr = custom_part(L, t, "clip_scale", n_vars, 1, r);
    }
    lua_pop(L, 1);
    if (mn_rule_validate(r) != MN_OK) luaL_error(L, "mnemo.rule: %s", mn_last_error());
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

/* rule:source([{dk=, dv=, hidden=, precision=}]): the CUDA source the GPU
 * engine compiles for this rule at those sizes (default dk 64, dv = dk,
 * hidden = the rule's or 64, fp32). Needs no GPU. */
static int rule_source(lua_State *L)
{
    const mn_rule *r = &check_rule(L, 1)->rule;
    mn_dims d = {1, 1, 1, 64, 0, 0, 1};
    mn_precision prec = MN_PREC_FP32;
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        d.dk = l_rule_field_int(L, 2, "dk", 64);
        d.dh = l_rule_field_int(L, 2, "hidden", 0);
        d.dv = l_rule_field_int(L, 2, "dv", 0);
        lua_getfield(L, 2, "precision");
        if (!lua_isnil(L, -1) && mn_precision_lookup(luaL_checkstring(L, -1), &prec) != MN_OK) l_raise(L);
        lua_pop(L, 1);
    }
    if (d.dv == 0) d.dv = d.dk;
    if (d.dh == 0) d.dh = r->hidden > 0 ? r->hidden : 64;
#ifdef MN_HAVE_CUDA
    mn_cuda_plan pl;
    if (mn_cuda_plan_rule(r, &d, prec, 1, mn_cuda_arch(), mn_cuda_smem_optin(), &pl) != MN_OK) return l_raise(L);
    char *src = mn_cuda_plan_source(r, &d, prec, &pl);
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
        snprintf(line, sizeof line, ", hidden %d, %s%s", r->hidden, mn_activation_name(r->activation), r->bias ? ", bias" : "");
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

void l_rule_register(lua_State *L)
{
    int module = lua_gettop(L);
    static const luaL_Reg rule_methods[] = {
        {"run", l_rule_run}, {"memory", l_rule_memory}, {"experiment", l_rule_experiment}, {"attrs", rule_attrs},
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
}
