/* l_run.c: running update rules from Lua.
 *   rule:run{k=, v=, ...}      one run, returning a table in the result schema
 *   rule:experiment{...}       a table in the experiment schema (mnemo.save it)
 *   rule:memory{...}           a stateful Memory: write, read, run, reset, state
 * with the input tensors and gate resolution, initial-state resolution and
 * the guard that owns a run's C-side resources. The methods are registered by
 * l_rule_register (l_rule.c). */
#include "l_rule_internal.h"
#include "l_grad.h"
#include "../model/experiment.h"
#include "../model/h5.h"
#include "../model/ops.h"
#include "../model/random.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct l_memory {
    mn_memory_state state;
    mn_tensor initial[MN_MAX_PARAMS]; /* for reset */
    bool ready;
} l_memory;

static l_memory *check_memory(lua_State *L, int idx)
{
    l_memory *m = luaL_checkudata(L, idx, MEMORY_MT);
    if (!m->ready) luaL_error(L, "memory: this memory has been closed");
    return m;
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
                         mn_tensor *momenta, mn_tensor *outer, mn_device dev)
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
            lua_Integer seed = l_rule_field_int(L, opts, "seed", -1);
            if (seed < 0) seed = (lua_Integer)(mn_rng_u64(mn_global_rng()) >> 1);
            lua_getfield(L, opts, "shared");
            bool shared = lua_toboolean(L, -1);
            lua_pop(L, 2);
            mn_tensor tmp[MN_MAX_PARAMS] = {0};
            /* drawn on the run's device: nothing to upload (engine.h) */
            if (mn_init_params(r, d, scheme, (uint64_t)seed, shared, tmp, dev) != MN_OK) l_raise(L);
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
    /* out_norm's ln_g, ln_b (absent: 1 and 0; given without out_norm: the
     * engine's error names them) */
    for (int j = 0; j < MN_OUTER_COUNT; j++) {
        lua_getfield(L, -1, mn_outer_name(j));
        mn_tensor *t = l_test_tensor(L, -1);
        if (t) mn_tensor_share(&outer[j], t);
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

/* Refuse keys of the call table at opts that are not in allowed (a typo
 * would otherwise be ignored). */
static void check_options(lua_State *L, int opts, const char *what, const char *const *allowed)
{
    lua_pushnil(L);
    while (lua_next(L, opts)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "%s: option keys must be names, got a %s key", what, luaL_typename(L, -1));
        const char *key = lua_tostring(L, -1);
        bool known = false;
        for (int i = 0; allowed[i] && !known; i++) known = strcmp(key, allowed[i]) == 0;
        if (known) continue;
        luaL_Buffer b;
        luaL_buffinit(L, &b);
        for (int i = 0; allowed[i]; i++) {
            if (i) luaL_addstring(&b, ", ");
            luaL_addstring(&b, allowed[i]);
        }
        luaL_pushresult(&b);
        luaL_error(L, "%s: unknown option '%s' (one of: %s)", what, key, lua_tostring(L, -1));
    }
}

static const char *const run_options[] = {"k", "v", "q", "theta", "eta", "alpha", "init", "seed", "shared",
                                          "device", "precision", "grad", "lengths", NULL};
static const char *const memory_options[] = {"B", "H", "dk", "dv", "init", "seed", "shared", "device",
                                             "precision", NULL};

/* Owned C-side resources of a run, freed by __gc/__close if Lua raises.
 * About 28 KB (the memory state holds 3 x MN_MAX_PARAMS tensors), so it
 * lives on the C heap and the userdata holds only its address: a 28 KB
 * userdata each call made Lua's collector run its steps about that much
 * more often, on every rule:run. */
typedef struct run_guard {
    mn_tensor params[MN_MAX_PARAMS], momenta[MN_MAX_PARAMS];
    mn_tensor outer[MN_OUTER_COUNT];
    mn_memory_state state;
    mn_segment_outputs out;
    mn_node *tree;
} run_guard;

static void guard_release(run_guard *g)
{
    /* the slots that hold storage (the memset below clears the rest) */
    mn_tensor_release_held(g->params, MN_MAX_PARAMS);
    mn_tensor_release_held(g->momenta, MN_MAX_PARAMS);
    mn_tensor_release_held(g->outer, MN_OUTER_COUNT);
    mn_memory_free(&g->state);
    mn_segment_outputs_free(&g->out);
    mn_node_free(g->tree);
    memset(g, 0, sizeof *g);
}

static int guard_gc(lua_State *L)
{
    run_guard **box = lua_touserdata(L, 1);
    if (*box) {
        guard_release(*box);
        free(*box);
        *box = NULL;
    }
    return 0;
}

static run_guard *push_guard(lua_State *L)
{
    run_guard **box = lua_newuserdatauv(L, sizeof *box, 0);
    *box = NULL;
    if (luaL_newmetatable(L, "mnemo.RunGuard")) {
        lua_pushcfunction(L, guard_gc);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, guard_gc);
        lua_setfield(L, -2, "__close");
    }
    lua_setmetatable(L, -2);
    *box = calloc(1, sizeof **box);
    if (!*box) luaL_error(L, "run: out of host memory");
    return *box;
}

/* lengths (ragged batches, SPEC v2) from the call: a tensor, or a table of
 * integers made into an i64 tensor [B]. Pushes it (or nothing); the engine
 * checks its shape and values. */
static mn_tensor *resolve_lengths(lua_State *L, int opts)
{
    lua_getfield(L, opts, "lengths");
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        return NULL;
    }
    mn_tensor *t = l_test_tensor(L, -1);
    if (t) return t;
    if (!lua_istable(L, -1))
        luaL_error(L, "run: lengths must be a tensor or a table of integers [B], got %s", luaL_typename(L, -1));
    int64_t B = (int64_t)luaL_len(L, -1);
    mn_tensor *out = l_push_empty_tensor(L);
    L_TRY(L, mn_tensor_zeros(out, MN_I64, 1, &B, MN_CPU));
    for (int64_t b = 0; b < B; b++) {
        lua_geti(L, -2, b + 1);
        int isint = 0;
        lua_Integer x = lua_tointegerx(L, -1, &isint);
        if (!isint) luaL_error(L, "run: lengths[%d] must be an integer, got %s", (int)(b + 1), luaL_tolstring(L, -1, NULL));
        ((int64_t *)mn_tensor_data(out))[b] = (int64_t)x;
        lua_pop(L, 1);
    }
    lua_remove(L, -2);
    return out;
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
    mn_tensor *lengths = resolve_lengths(L, opts);
    memset(in, 0, sizeof *in);
    if (lengths) in->lengths = *lengths;
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
static run_guard *prepare_call(lua_State *L, const l_rule *lr, mn_dims *d, mn_segment_inputs *in, mn_device dev)
{
    luaL_checktype(L, 2, LUA_TTABLE);
    check_options(L, 2, "run", run_options);
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
    resolve_init(L, 2, &lr->rule, d, g->params, g->momenta, g->outer, dev);
    segment_inputs(L, 1, 2, d, lr->rule.step, in);
    return g;
}

int l_rule_run(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    mn_dims d;
    mn_segment_inputs in;
    mn_device dev = resolve_device(L, 2);
    /* a rule the device does not run is refused before its weights are drawn there */
    if (mn_rule_device_check(&lr->rule, dev) != MN_OK) l_raise(L);
    run_guard *g = prepare_call(L, lr, &d, &in, dev);
    mn_precision prec = resolve_precision(L, 2);
    if (mn_memory_create(&g->state, &lr->rule, &d, g->params, g->momenta, dev) != MN_OK ||
        mn_memory_set_outer(&g->state, g->outer) != MN_OK)
        l_raise(L);
    g->state.precision = prec;
    int grad_ctx = l_grad_begin(L, 2); /* grad = true: what res:backward needs (l_grad.c) */
    /* On cuda the result table is built while the step kernel runs; the
     * wait (and a fault of the kernel's) comes before rule:run returns. */
#ifdef MN_HAVE_CUDA
    const bool overlap = dev == MN_CUDA;
    if (overlap) mn_cuda_defer_begin();
#endif
    mn_status s = l_grad_forward(L, grad_ctx, &g->state, &in, &g->out);
    if (s == MN_OK)
        s = mn_result_tree(&lr->rule, NULL, &g->state, &g->out, mn_device_name(dev), mn_precision_name(prec), true,
                           &g->tree);
    if (s == MN_OK) {
        l_push_tree(L, g->tree);
        l_grad_attach(L, grad_ctx, &lr->rule, 2, &d, &in, g->params, g->momenta, g->outer);
        /* The result table holds its own tensor references now. Released
         * before the wait, while the kernel runs (about 3 us of host time on
         * P1-lin's rule:run, after it before): what this frees on the device
         * goes back to the cache, and the stream orders any later use of it
         * after the kernel. A fault the wait reports raises as before. */
        guard_release(g);
    }
#ifdef MN_HAVE_CUDA
    if (overlap) {
        mn_status waited = mn_cuda_defer_end();
        if (s == MN_OK) s = waited; /* else the first error is the one to report */
    }
#endif
    if (s != MN_OK) l_raise(L);
    l_device_pressure(L);
    return 1;
}

/* rule:experiment{k=, v=, q=, init=, ...}: the experiment-schema table. */
int l_rule_experiment(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    mn_dims d;
    mn_segment_inputs in;
    run_guard *g = prepare_call(L, lr, &d, &in, MN_CPU); /* an experiment is written from the CPU */
    lua_createtable(L, 0, 5);
    lua_pushinteger(L, 1);
    lua_setfield(L, -2, "mnemo_schema");
    l_push_rule_attrs(L, &lr->rule);
    lua_setfield(L, -2, "rule");
    lua_createtable(L, 0, 3);
    mn_tensor *slots[] = {&in.k, &in.v, &in.q, &in.lengths, &in.theta, &in.eta, &in.alpha};
    const char *names[] = {"k", "v", "q", "lengths", "theta", "eta", "alpha"};
    for (int i = 0; i < 7; i++) {
        if (i == 4) {
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
    for (int j = 0; j < MN_OUTER_COUNT; j++)
        if (g->outer[j].storage) {
            mn_tensor *t = l_push_empty_tensor(L);
            mn_tensor_share(t, &g->outer[j]);
            lua_setfield(L, -2, mn_outer_name(j));
        }
    lua_setfield(L, -2, "init");
    return 1;
}

/* ---- memories ---- */

int l_memory_gc(lua_State *L)
{
    l_memory *m = luaL_checkudata(L, 1, MEMORY_MT);
    mn_memory_free(&m->state);
    for (int i = 0; i < MN_MAX_PARAMS; i++) mn_tensor_release(&m->initial[i]);
    m->ready = false;
    return 0;
}

/* rule:memory{B=1, H=1, dk=, dv=, init=, seed=, device=} */
int l_rule_memory(lua_State *L)
{
    l_rule *lr = check_rule(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    check_options(L, 2, "memory", memory_options);
    run_guard *g = push_guard(L);
    mn_dims d = {0};
    d.B = l_rule_field_int(L, 2, "B", 1);
    d.H = l_rule_field_int(L, 2, "H", 1);
    d.dk = l_rule_field_int(L, 2, "dk", 0);
    d.dv = l_rule_field_int(L, 2, "dv", (int)d.dk);
    d.dh = lr->rule.layers >= 2 ? lr->rule.hidden : 0;
    if (d.B < 1 || d.H < 1 || d.dk < 1 || d.dv < 1) luaL_error(L, "memory: B, H, dk and dv must be >= 1 (dk is required)");
    if (lr->rule.layers >= 2 && d.dh < 1) luaL_error(L, "memory: the rule has %d layers but no hidden size", lr->rule.layers);
    mn_device dev = resolve_device(L, 2);
    if (mn_rule_device_check(&lr->rule, dev) != MN_OK) l_raise(L);
    resolve_init(L, 2, &lr->rule, &d, g->params, g->momenta, g->outer, dev);
    l_memory *m = lua_newuserdatauv(L, sizeof *m, 1);
    memset(m, 0, sizeof *m);
    luaL_setmetatable(L, MEMORY_MT);
    if (mn_memory_create(&m->state, &lr->rule, &d, g->params, g->momenta, dev) != MN_OK ||
        mn_memory_set_outer(&m->state, g->outer) != MN_OK)
        l_raise(L);
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
    lua_createtable(L, 0, mn_segment_output_count);
    for (int i = 0; i < mn_segment_output_count; i++) {
        mn_tensor *src = mn_segment_output(out, i);
        if (!src->storage) continue;
        mn_tensor *t = l_push_empty_tensor(L);
        *t = *src; /* the table takes the engine's reference */
        memset(src, 0, sizeof *src);
        lua_setfield(L, -2, mn_segment_output_rows[i].name);
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
    l_device_pressure(L);
    return 1;
}

int l_memory_write(lua_State *L) { return memory_segment(L, false); }
int l_memory_run(lua_State *L) { return memory_segment(L, true); }

int l_memory_read(lua_State *L)
{
    l_memory *m = check_memory(L, 1);
    lua_createtable(L, 0, 1);
    lua_pushvalue(L, 2);
    lua_setfield(L, -2, "q");
    mn_tensor *q = input_tensor(L, lua_gettop(L), "q", true);
    mn_tensor *y = l_push_empty_tensor(L);
    if (mn_memory_read(&m->state, q, y) != MN_OK) l_raise(L);
    l_device_pressure(L);
    return 1;
}

/* mem:reset(): back to the initial weights, zero momentum, step 0. */
int l_memory_reset(lua_State *L)
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
int l_memory_state(lua_State *L)
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

int l_memory_index(lua_State *L)
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

int l_memory_tostring(lua_State *L)
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
