/* l_rule.c: update rules and memories from Lua.
 *   mnemo.rule{...}            a Rule from a table (SPEC.md sections 1-4)
 *   rule:run{k=, v=, ...}      one run, returning a table in the result schema
 *   rule:memory{...}           a stateful Memory: write, read, run, reset
 *   rule:experiment{...}       a table in the experiment schema (mnemo.save it)
 *   mnemo.load_experiment(p)   rule and inputs from an experiment file
 * Rule parts may be names ("huber"), expression strings ("abs(r)^1.5") or Lua
 * functions over symbolic arguments; gates may be numbers, tensors or
 * functions of the inputs. */
#include "dsl.h"
#include "l_expr.h"
#include "../model/engine.h"
#include "../model/experiment.h"
#include "../model/h5.h"
#include "../model/ops.h"
#include "../model/random.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/codegen.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RULE_MT "mnemo.Rule"
#define MEMORY_MT "mnemo.Memory"

typedef struct l_rule {
    mn_rule rule;
    bool ready;
} l_rule;

typedef struct l_memory {
    mn_memory_state state;
    mn_tensor initial[MN_MAX_PARAMS]; /* for reset */
    bool ready;
} l_memory;

static l_rule *check_rule(lua_State *L, int idx) { return luaL_checkudata(L, idx, RULE_MT); }
static l_memory *check_memory(lua_State *L, int idx)
{
    l_memory *m = luaL_checkudata(L, idx, MEMORY_MT);
    if (!m->ready) luaL_error(L, "memory: this memory has been closed");
    return m;
}

/* ---- building a rule from a table ---- */

static const char *const rule_keys[] = {
    "layers", "hidden", "activation", "bias", "residual", "loss", "loss_delta", "loss_p", "delta", "p",
    "feature_reduce", "token_reduce", "step", "refresh", "retrieve", "clip", "clip_max", "clip_scope",
    "clip_scale", "clip_expr", "loss_expr", "activation_expr", "constants", "theta", "eta", "alpha", NULL};

static int field_int(lua_State *L, int t, const char *key, int dflt)
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
    r->layers = field_int(L, t, "layers", 1);
    r->hidden = field_int(L, t, "hidden", 0);
    r->bias = field_int(L, t, "bias", r->layers >= 2) != 0;
    r->residual = field_int(L, t, "residual", 0) != 0;
    r->loss_delta = field_number(L, t, "delta", field_number(L, t, "loss_delta", r->loss_delta));
    r->loss_p = field_number(L, t, "p", field_number(L, t, "loss_p", r->loss_p));
    r->step = field_int(L, t, "step", 1);
    r->refresh = field_int(L, t, "refresh", -1);
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
    } else if (!lua_isnil(L, -1)) {
        r->activation = MN_ACT_CUSTOM;
        r->activation_expr = custom_part(L, t, "activation", act_vars, 1, r);
    }
    lua_pop(L, 1);

    lua_getfield(L, t, "loss");
    if (lua_type(L, -1) == LUA_TSTRING && mn_loss_lookup(lua_tostring(L, -1), &r->loss) == MN_OK) {
        if (r->loss == MN_LOSS_CUSTOM) r->loss_expr = custom_part(L, t, "loss_expr", loss_vars, 3, r);
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
static void push_rule_attrs(lua_State *L, const mn_rule *r)
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
    push_rule_attrs(L, &check_rule(L, 1)->rule);
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
        d.dk = field_int(L, 2, "dk", 64);
        d.dh = field_int(L, 2, "hidden", 0);
        d.dv = field_int(L, 2, "dv", 0);
        lua_getfield(L, 2, "precision");
        if (!lua_isnil(L, -1) && mn_precision_lookup(luaL_checkstring(L, -1), &prec) != MN_OK) l_raise(L);
        lua_pop(L, 1);
    }
    if (d.dv == 0) d.dv = d.dk;
    if (d.dh == 0) d.dh = r->hidden > 0 ? r->hidden : 64;
#ifdef MN_HAVE_CUDA
    char *src = mn_cuda_rule_source(r, &d, prec);
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

/* ---- inputs ---- */

/* The tensor at field key of the table at t, as a 4-d [B,H,T,d] view:
 * [T,d] and [H,T,d] are accepted for convenience. Pushes the tensor. */
static mn_tensor *input_tensor(lua_State *L, int t, const char *key, bool required)
{
    lua_getfield(L, t, key);
    if (lua_isnil(L, -1)) {
        if (required) luaL_error(L, "run: input '%s' is missing", key);
        return NULL;
    }
    mn_tensor *src = l_test_tensor(L, -1);
    if (!src) luaL_error(L, "run: input '%s' must be a tensor, got %s", key, luaL_typename(L, -1));
    if (src->ndim < 2 || src->ndim > 4) luaL_error(L, "run: input '%s' must be [B,H,T,d], [H,T,d] or [T,d], got %d dims", key, src->ndim);
    if (src->ndim == 4) return src;
    int64_t shape[4] = {1, 1, 1, 1};
    memcpy(shape + 4 - src->ndim, src->shape, sizeof(int64_t) * src->ndim);
    mn_tensor *view = l_push_empty_tensor(L);
    L_TRY(L, mn_view_reshape(view, src, 4, shape));
    lua_remove(L, -2);
    return view;
}

/* A gate from the inputs table (override) or the rule's uservalue: number,
 * tensor, or function(inputs). Pushes a tensor (or nil) and returns it. */
static mn_tensor *resolve_gate(lua_State *L, int rule_idx, int inputs_idx, const char *gate, int env_idx)
{
    lua_getfield(L, inputs_idx, gate);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_getiuservalue(L, rule_idx, 1);
        lua_getfield(L, -1, gate);
        lua_remove(L, -2);
    }
    if (lua_isfunction(L, -1)) {
        lua_pushvalue(L, env_idx);
        if (lua_pcall(L, 1, 1, 0) != LUA_OK) luaL_error(L, "gate %s: %s", gate, lua_tostring(L, -1));
    }
    if (lua_isnil(L, -1)) return NULL;
    if (lua_type(L, -1) == LUA_TNUMBER) {
        double x = lua_tonumber(L, -1);
        lua_pop(L, 1);
        mn_tensor *t = l_push_empty_tensor(L);
        L_TRY(L, mn_tensor_full(t, MN_F32, 0, NULL, x, MN_CPU));
        return t;
    }
    mn_tensor *t = l_test_tensor(L, -1);
    if (!t) luaL_error(L, "gate %s: expected a number or a tensor, got %s", gate, luaL_typename(L, -1));
    return t;
}

/* The table passed to gate functions: k, v, q and the sizes. */
static void push_gate_env(lua_State *L, int k_idx, int v_idx, int q_idx, const mn_dims *d, int step)
{
    lua_createtable(L, 0, 9);
    lua_pushvalue(L, k_idx);
    lua_setfield(L, -2, "k");
    lua_pushvalue(L, v_idx);
    lua_setfield(L, -2, "v");
    lua_pushvalue(L, q_idx ? q_idx : k_idx);
    lua_setfield(L, -2, "q");
    const struct { const char *name; int64_t value; } sizes[] = {
        {"B", d->B}, {"H", d->H}, {"T", d->T}, {"S", (d->T + step - 1) / step}, {"dk", d->dk}, {"dv", d->dv}};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        lua_pushinteger(L, sizes[i].value);
        lua_setfield(L, -2, sizes[i].name);
    }
}

/* Initial parameters from opts.init: a scheme name, a table of tensors, or an
 * HDF5 path (its /init, or /final of a result). Tensors are pushed and kept
 * on the stack; params[] point into them (empty where absent). */
static void resolve_init(lua_State *L, int opts, const mn_rule *r, const mn_dims *d, mn_tensor *params,
                         mn_tensor *momenta)
{
    int np = mn_rule_param_count(r);
    lua_getfield(L, opts, "init");
    if (lua_isnil(L, -1) || lua_type(L, -1) == LUA_TSTRING) {
        const char *scheme = lua_isnil(L, -1) ? "xavier" : lua_tostring(L, -1);
        size_t len = strlen(scheme);
        if (len > 3 && strcmp(scheme + len - 3, ".h5") == 0) {
            mn_node *root;
            if (mn_h5_load(scheme, &root) != MN_OK) l_raise(L);
            mn_node *g = mn_node_find(root, "init");
            if (!g) g = mn_node_find(root, "final");
            if (!g) {
                mn_node_free(root);
                luaL_error(L, "run: init file '%s' has neither /init nor /final", scheme);
            }
            l_push_tree(L, g);
            mn_node_free(root);
            lua_replace(L, -2);
        } else {
            lua_Integer seed = field_int(L, opts, "seed", -1);
            if (seed < 0) seed = (lua_Integer)(mn_rng_u64(mn_global_rng()) >> 1);
            lua_getfield(L, opts, "shared");
            bool shared = lua_toboolean(L, -1);
            lua_pop(L, 2);
            mn_tensor tmp[MN_MAX_PARAMS] = {0};
            if (mn_init_params(r, d, scheme, (uint64_t)seed, shared, tmp) != MN_OK) l_raise(L);
            lua_createtable(L, 0, np);
            for (int i = 0; i < np; i++) {
                char name[16];
                mn_tensor *t = l_push_empty_tensor(L);
                *t = tmp[i];
                lua_setfield(L, -2, mn_rule_param_name(r, i, name, sizeof name));
            }
        }
    }
    if (!lua_istable(L, -1)) luaL_error(L, "run: init must be a scheme name, a table of tensors or an .h5 path");
    for (int i = 0; i < np; i++) {
        char name[16], sname[20];
        mn_rule_param_name(r, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        lua_getfield(L, -1, name);
        mn_tensor *t = l_test_tensor(L, -1);
        if (t) mn_tensor_share(&params[i], t);
        lua_pop(L, 1);
        lua_getfield(L, -1, sname);
        t = l_test_tensor(L, -1);
        if (t) mn_tensor_share(&momenta[i], t);
        lua_pop(L, 1);
    }
}

static mn_precision resolve_precision(lua_State *L, int opts)
{
    lua_getfield(L, opts, "precision");
    mn_precision prec = MN_PREC_FP32;
    if (!lua_isnil(L, -1) && mn_precision_lookup(luaL_checkstring(L, -1), &prec) != MN_OK) l_raise(L);
    lua_pop(L, 1);
    return prec;
}

static mn_device resolve_device(lua_State *L, int opts)
{
    lua_getfield(L, opts, "device");
    const char *dev = lua_isnil(L, -1) ? "cpu" : luaL_checkstring(L, -1);
    lua_pop(L, 1);
    if (strcmp(dev, "cpu") == 0) return MN_CPU;
    if (strcmp(dev, "cuda") == 0) return MN_CUDA;
    luaL_error(L, "run: device must be 'cpu' or 'cuda', got '%s'", dev);
    return MN_CPU;
}

/* Memory dims from k, v and the rule (hidden from the rule or W1). */
static void dims_from(lua_State *L, const mn_rule *r, const mn_tensor *k, const mn_tensor *v, const mn_tensor *w1, mn_dims *d)
{
    memset(d, 0, sizeof *d);
    d->B = k->shape[0];
    d->H = k->shape[1];
    d->T = k->shape[2];
    d->dk = k->shape[3];
    d->dv = v->shape[3];
    if (r->layers >= 2) {
        d->dh = r->hidden;
        if (d->dh == 0 && w1 && w1->storage && w1->ndim >= 2) d->dh = w1->shape[w1->ndim - 2];
        if (d->dh <= 0) luaL_error(L, "run: the rule has %d layers but no hidden size (set hidden = ...)", r->layers);
    }
}

/* Owned C-side resources of a run, freed by __gc/__close if Lua raises. */
typedef struct run_guard {
    mn_tensor params[MN_MAX_PARAMS], momenta[MN_MAX_PARAMS];
    mn_memory_state state;
    mn_segment_outputs out;
    mn_node *tree;
} run_guard;

static void guard_release(run_guard *g)
{
    for (int i = 0; i < MN_MAX_PARAMS; i++) {
        mn_tensor_release(&g->params[i]);
        mn_tensor_release(&g->momenta[i]);
    }
    mn_memory_free(&g->state);
    mn_segment_outputs_free(&g->out);
    mn_node_free(g->tree);
    memset(g, 0, sizeof *g);
}

static int guard_gc(lua_State *L)
{
    guard_release(lua_touserdata(L, 1));
    return 0;
}

static run_guard *push_guard(lua_State *L)
{
    run_guard *g = lua_newuserdatauv(L, sizeof *g, 0);
    memset(g, 0, sizeof *g);
    if (luaL_newmetatable(L, "mnemo.RunGuard")) {
        lua_pushcfunction(L, guard_gc);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, guard_gc);
        lua_setfield(L, -2, "__close");
    }
    lua_setmetatable(L, -2);
    return g;
}

/* Resolve k, v, q and the gates of a call: opts at index 2. Leaves the
 * tensors on the stack; fills in. */
static void segment_inputs(lua_State *L, int rule_idx, int opts, const mn_dims *d, int step, mn_segment_inputs *in)
{
    int k_idx, v_idx, q_idx = 0;
    mn_tensor *k = input_tensor(L, opts, "k", true);
    k_idx = lua_gettop(L);
    mn_tensor *v = input_tensor(L, opts, "v", true);
    v_idx = lua_gettop(L);
    mn_tensor *q = input_tensor(L, opts, "q", false);
    if (q) q_idx = lua_gettop(L);
    push_gate_env(L, k_idx, v_idx, q_idx, d, step);
    int env = lua_gettop(L);
    mn_tensor *theta = resolve_gate(L, rule_idx, opts, "theta", env);
    if (!theta) luaL_error(L, "run: gate theta is missing (set theta in the rule or the call)");
    mn_tensor *eta = resolve_gate(L, rule_idx, opts, "eta", env);
    mn_tensor *alpha = resolve_gate(L, rule_idx, opts, "alpha", env);
    memset(in, 0, sizeof *in);
    in->k = *k;
    in->v = *v;
    if (q) in->q = *q;
    in->theta = *theta;
    if (eta) in->eta = *eta;
    if (alpha) in->alpha = *alpha;
    in->want_y = true;
}

/* rule:run{k=, v=, q=, theta=, eta=, alpha=, init=, seed=, shared=, device=, precision=, trace=} */
/* What rule:run and rule:experiment share: the inputs of the call table at
 * index 2 (k, v, q, gates) and the initial state, with the guard that owns
 * the C side. Leaves its tensors on the stack. */
static run_guard *prepare_call(lua_State *L, const l_rule *lr, mn_dims *d, mn_segment_inputs *in)
{
    luaL_checktype(L, 2, LUA_TTABLE);
    run_guard *g = push_guard(L);
    mn_tensor *k = input_tensor(L, 2, "k", true);
    mn_tensor *v = input_tensor(L, 2, "v", true);
    lua_getfield(L, 2, "init");
    mn_tensor *w1 = NULL;
    if (lua_istable(L, -1)) {
        lua_getfield(L, -1, "W1");
        w1 = l_test_tensor(L, -1);
    }
    dims_from(L, &lr->rule, k, v, w1, d);
    resolve_init(L, 2, &lr->rule, d, g->params, g->momenta);
    segment_inputs(L, 1, 2, d, lr->rule.step, in);
    return g;
}

static int rule_run(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    mn_dims d;
    mn_segment_inputs in;
    run_guard *g = prepare_call(L, lr, &d, &in);
    mn_device dev = resolve_device(L, 2);
    mn_precision prec = resolve_precision(L, 2);
    if (mn_memory_create(&g->state, &lr->rule, &d, g->params, g->momenta, dev) != MN_OK) l_raise(L);
    g->state.precision = prec;
    if (mn_segment_run(&g->state, &in, &g->out) != MN_OK) l_raise(L);
    if (mn_result_tree(&lr->rule, NULL, &g->state, &g->out, mn_device_name(dev), mn_precision_name(prec), true,
                       &g->tree) != MN_OK)
        l_raise(L);
    l_push_tree(L, g->tree);
    guard_release(g); /* the result table holds its own tensor references now */
    return 1;
}

/* rule:experiment{k=, v=, q=, init=, ...}: the experiment-schema table. */
static int rule_experiment(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    mn_dims d;
    mn_segment_inputs in;
    run_guard *g = prepare_call(L, lr, &d, &in);
    lua_createtable(L, 0, 5);
    lua_pushinteger(L, 1);
    lua_setfield(L, -2, "mnemo_schema");
    push_rule_attrs(L, &lr->rule);
    lua_setfield(L, -2, "rule");
    lua_createtable(L, 0, 3);
    mn_tensor *slots[] = {&in.k, &in.v, &in.q, &in.theta, &in.eta, &in.alpha};
    const char *names[] = {"k", "v", "q", "theta", "eta", "alpha"};
    for (int i = 0; i < 6; i++) {
        if (i == 3) {
            lua_setfield(L, -2, "inputs");
            lua_createtable(L, 0, 3);
        }
        if (!slots[i]->storage) continue;
        mn_tensor *t = l_push_empty_tensor(L);
        mn_tensor_share(t, slots[i]);
        lua_setfield(L, -2, names[i]);
    }
    lua_setfield(L, -2, "gates");
    lua_createtable(L, 0, 4);
    for (int i = 0; i < mn_rule_param_count(&lr->rule); i++) {
        char name[16], sname[20];
        mn_rule_param_name(&lr->rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        if (g->params[i].storage) {
            mn_tensor *t = l_push_empty_tensor(L);
            mn_tensor_share(t, &g->params[i]);
            lua_setfield(L, -2, name);
        }
        if (g->momenta[i].storage) {
            mn_tensor *t = l_push_empty_tensor(L);
            mn_tensor_share(t, &g->momenta[i]);
            lua_setfield(L, -2, sname);
        }
    }
    lua_setfield(L, -2, "init");
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

/* ---- memories ---- */

static int memory_gc(lua_State *L)
{
    l_memory *m = luaL_checkudata(L, 1, MEMORY_MT);
    mn_memory_free(&m->state);
    for (int i = 0; i < MN_MAX_PARAMS; i++) mn_tensor_release(&m->initial[i]);
    m->ready = false;
    return 0;
}

/* rule:memory{B=1, H=1, dk=, dv=, init=, seed=, device=} */
static int rule_memory(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    run_guard *g = push_guard(L);
    mn_dims d = {0};
    d.B = field_int(L, 2, "B", 1);
    d.H = field_int(L, 2, "H", 1);
    d.dk = field_int(L, 2, "dk", 0);
    d.dv = field_int(L, 2, "dv", (int)d.dk);
    d.dh = lr->rule.layers >= 2 ? lr->rule.hidden : 0;
    if (d.B < 1 || d.H < 1 || d.dk < 1 || d.dv < 1) luaL_error(L, "memory: B, H, dk and dv must be >= 1 (dk is required)");
    if (lr->rule.layers >= 2 && d.dh < 1) luaL_error(L, "memory: the rule has %d layers but no hidden size", lr->rule.layers);
    mn_device dev = resolve_device(L, 2);
    resolve_init(L, 2, &lr->rule, &d, g->params, g->momenta);
    l_memory *m = lua_newuserdatauv(L, sizeof *m, 1);
    memset(m, 0, sizeof *m);
    luaL_setmetatable(L, MEMORY_MT);
    if (mn_memory_create(&m->state, &lr->rule, &d, g->params, g->momenta, dev) != MN_OK) l_raise(L);
    m->state.precision = resolve_precision(L, 2);
    m->ready = true;
    for (int i = 0; i < m->state.nparams; i++)
        if (mn_tensor_clone(&m->initial[i], &m->state.params[i]) != MN_OK) l_raise(L);
    lua_pushvalue(L, 1); /* the rule: its gates are the memory's defaults */
    lua_setiuservalue(L, -2, 1);
    return 1;
}

static void push_segment_outputs(lua_State *L, mn_segment_outputs *out)
{
    lua_createtable(L, 0, 7);
    const struct { const char *name; mn_tensor *t; } items[] = {
        {"y", &out->y}, {"loss", &out->loss}, {"grad_norm", &out->grad_norm}, {"clip_scale", &out->clip_scale},
        {"skipped", &out->skipped}, {"step_loss", &out->step_loss}, {"weight_norm", &out->weight_norm}};
    for (size_t i = 0; i < sizeof items / sizeof *items; i++) {
        if (!items[i].t->storage) continue;
        mn_tensor *t = l_push_empty_tensor(L);
        *t = *items[i].t; /* the table takes the engine's reference */
        memset(items[i].t, 0, sizeof *items[i].t);
        lua_setfield(L, -2, items[i].name);
    }
}

/* mem:write{k=, v=, theta=...} or mem:write(k, v[, gates]); mem:run also retrieves. */
static int memory_segment(lua_State *L, bool want_y)
{
    l_memory *m = check_memory(L, 1);
    if (!lua_istable(L, 2)) {
        /* positional form: (k, v[, q][, gates]) -> a table */
        int top = lua_gettop(L);
        lua_createtable(L, 0, 6);
        int t = lua_gettop(L);
        int gates_at = 0;
        lua_pushvalue(L, 2);
        lua_setfield(L, t, "k");
        lua_pushvalue(L, 3);
        lua_setfield(L, t, "v");
        if (top >= 4 && l_test_tensor(L, 4)) {
            lua_pushvalue(L, 4);
            lua_setfield(L, t, "q");
            gates_at = top >= 5 ? 5 : 0;
        } else if (top >= 4) gates_at = 4;
        if (gates_at && lua_istable(L, gates_at)) {
            lua_pushnil(L);
            while (lua_next(L, gates_at)) {
                lua_pushvalue(L, -2);
                lua_insert(L, -2);
                lua_settable(L, t);
            }
        }
        lua_replace(L, 2);
        lua_settop(L, 2);
    }
    run_guard *g = push_guard(L);
    lua_getiuservalue(L, 1, 1);
    int rule_idx = lua_gettop(L);
    mn_dims d = m->state.dims;
    mn_tensor *k = input_tensor(L, 2, "k", true);
    d.T = k->shape[2];
    lua_pop(L, 1);
    mn_segment_inputs in;
    segment_inputs(L, rule_idx, 2, &d, m->state.rule.step, &in);
    in.want_y = want_y;
    if (mn_segment_run(&m->state, &in, &g->out) != MN_OK) l_raise(L);
    push_segment_outputs(L, &g->out);
    return 1;
}

static int memory_write(lua_State *L) { return memory_segment(L, false); }
static int memory_run(lua_State *L) { return memory_segment(L, true); }

static int memory_read(lua_State *L)
{
    l_memory *m = check_memory(L, 1);
    lua_createtable(L, 0, 1);
    lua_pushvalue(L, 2);
    lua_setfield(L, -2, "q");
    mn_tensor *q = input_tensor(L, lua_gettop(L), "q", true);
    mn_tensor *y = l_push_empty_tensor(L);
    if (mn_memory_read(&m->state, q, y) != MN_OK) l_raise(L);
    return 1;
}

/* mem:reset(): back to the initial weights, zero momentum, step 0. */
static int memory_reset(lua_State *L)
{
    l_memory *m = check_memory(L, 1);
    for (int i = 0; i < m->state.nparams; i++) {
        L_TRY(L, mn_tensor_copy_into(&m->state.params[i], &m->initial[i]));
        L_TRY(L, mn_tensor_copy_into(&m->state.anchor[i], &m->initial[i]));
        L_TRY(L, mn_tensor_fill(&m->state.momenta[i], 0));
    }
    m->state.steps_done = 0;
    return 0;
}

/* mem:state(): {W1=, ..., S_W1=, ...} copies of the current state. */
static int memory_state(lua_State *L)
{
    l_memory *m = check_memory(L, 1);
    lua_createtable(L, 0, 2 * m->state.nparams);
    for (int i = 0; i < m->state.nparams; i++) {
        char name[16], sname[20];
        mn_rule_param_name(&m->state.rule, i, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        mn_tensor *t = l_push_empty_tensor(L);
        L_TRY(L, mn_tensor_clone(t, &m->state.params[i]));
        lua_setfield(L, -2, name);
        t = l_push_empty_tensor(L);
        L_TRY(L, mn_tensor_clone(t, &m->state.momenta[i]));
        lua_setfield(L, -2, sname);
    }
    return 1;
}

static int memory_index(lua_State *L)
{
    l_memory *m = check_memory(L, 1);
    const char *key = luaL_checkstring(L, 2);
    if (strcmp(key, "steps") == 0) {
        lua_pushinteger(L, m->state.steps_done);
        return 1;
    }
    if (strcmp(key, "rule") == 0) {
        lua_getiuservalue(L, 1, 1);
        return 1;
    }
    luaL_getmetatable(L, MEMORY_MT);
    lua_getfield(L, -1, "__methods");
    lua_getfield(L, -1, key);
    return 1;
}

static int memory_tostring(lua_State *L)
{
    l_memory *m = luaL_checkudata(L, 1, MEMORY_MT);
    if (!m->ready) {
        lua_pushliteral(L, "mnemo.Memory (closed)");
        return 1;
    }
    const mn_dims *d = &m->state.dims;
    lua_pushfstring(L, "mnemo.Memory: %d x %d memories, dk %d, dv %d%s, %d steps taken, on %s", (int)d->B, (int)d->H,
                    (int)d->dk, (int)d->dv, m->state.rule.layers > 1 ? ", MLP" : ", linear", (int)m->state.steps_done,
                    mn_device_name(m->state.device));
    return 1;
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
    push_rule_attrs(L, &check_rule(L, 1)->rule);
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
        {"run", rule_run}, {"memory", rule_memory}, {"experiment", rule_experiment}, {"attrs", rule_attrs},
        {"expressions", rule_expressions}, {"with", rule_with}, {"source", rule_source},
        {"kernel_info", rule_kernel_info}, {NULL, NULL}};
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
        {"write", memory_write}, {"run", memory_run}, {"read", memory_read}, {"reset", memory_reset},
        {"state", memory_state}, {"close", memory_gc}, {NULL, NULL}};
    luaL_newmetatable(L, MEMORY_MT);
    lua_pushcfunction(L, memory_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, memory_gc);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, memory_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, memory_index);
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
