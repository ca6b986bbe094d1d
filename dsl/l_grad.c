/* l_grad.c: gradients of a run from Lua (SPEC.md section 7).
 *   res = rule:run{..., grad = true}
 *   g = res:backward{dy =, dloss =, dW1 =, ..., dS_W1 =, ...}   (any subset)
 * rule:run gives every result table a metatable whose __index is
 * mnemo.Result (the methods) and, with grad = true, whose __mnemo_grad holds
 * what the backward needs: the rule, the inputs and gates as the call gave
 * them, the initial state, the run's device and (on the cpu) the forward's
 * checkpoints. The backward runs where the run ran when it can: a cuda run's
 * on the GPU's general path (kernels/grad_kernel.cuh) for every rule that
 * path covers (rule:plan's backward line says which), else on the cpu
 * (model/grad_cpu.c), recomputing the forward block by block from the
 * checkpoints; either way it sums every gradient back to the shape the user
 * gave (a scalar gate gets a scalar, [H,T] gets [H,T], W1 given as [dh,dk]
 * gets [dh,dk]). */
#include "l_rule_internal.h"
#include "l_grad.h"
#include "../model/grad.h"
#include "../model/grad_files.h"

#include <stdio.h>
#include <string.h>

#define GRAD_CTX_MT "mnemo.GradContext"

/* What a run leaves for its backward: tensors shared with the call. */
typedef struct grad_ctx {
    mn_rule rule;
    mn_dims dims;
    int nparams;
    mn_tensor k, v, q;                 /* as the call gave them ([T,d] .. [B,H,T,d]) */
    mn_segment_inputs in;              /* 4-d views and the resolved gates */
    mn_tensor init[MN_MAX_PARAMS], momenta[MN_MAX_PARAMS];
    mn_tensor outer[MN_OUTER_COUNT];   /* ln_g, ln_b as given (empty: defaults) */
    mn_run_checkpoints ck;             /* the forward's, when it ran on the cpu */
    mn_device dev;                     /* where the run ran: its backward runs there if it can */
    mn_precision precision;            /* the run's: a GPU backward's products take it too */
    bool ready;
} grad_ctx;

static void ctx_release(grad_ctx *c)
{
    mn_tensor *ts[] = {&c->k, &c->v, &c->q, &c->in.k, &c->in.v, &c->in.q, &c->in.theta, &c->in.eta, &c->in.alpha,
                       &c->in.lengths};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) mn_tensor_release(ts[i]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&c->init[p]);
        mn_tensor_release(&c->momenta[p]);
    }
    for (int j = 0; j < MN_OUTER_COUNT; j++) mn_tensor_release(&c->outer[j]);
    if (c->ready) mn_rule_free(&c->rule);
    mn_run_checkpoints_free(&c->ck);
    c->ready = false;
}

static int ctx_gc(lua_State *L)
{
    ctx_release(luaL_checkudata(L, 1, GRAD_CTX_MT));
    return 0;
}

static void share_if(mn_tensor *dst, const mn_tensor *src)
{
    if (src && src->storage) mn_tensor_share(dst, src);
}

int l_grad_begin(lua_State *L, int opts)
{
    lua_getfield(L, opts, "grad");
    bool want = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (!want) return 0;
    grad_ctx *c = lua_newuserdatauv(L, sizeof *c, 0);
    memset(c, 0, sizeof *c);
    luaL_setmetatable(L, GRAD_CTX_MT);
    return lua_gettop(L);
}

mn_status l_grad_forward(lua_State *L, int ctx_idx, mn_memory_state *st, const mn_segment_inputs *in,
                         mn_segment_outputs *out)
{
    if (!ctx_idx) return mn_segment_run(st, in, out);
    grad_ctx *c = luaL_checkudata(L, ctx_idx, GRAD_CTX_MT);
    c->dev = st->device;
    c->precision = st->precision;
    if (st->device != MN_CPU) return mn_segment_run(st, in, out);
    return mn_run_forward_checkpointed(st, in, 0, out, &c->ck);
}

void l_grad_attach(lua_State *L, int ctx_idx, const mn_rule *rule, int opts, const mn_dims *d,
                   const mn_segment_inputs *in, const mn_tensor *params, const mn_tensor *momenta,
                   const mn_tensor *outer)
{
    int res = lua_gettop(L);
    lua_createtable(L, 0, 2); /* this result's metatable */
    lua_getfield(L, LUA_REGISTRYINDEX, "mnemo.Result");
    lua_setfield(L, -2, "__index");
    if (ctx_idx) {
        grad_ctx *c = luaL_checkudata(L, ctx_idx, GRAD_CTX_MT);
        L_TRY(L, mn_rule_copy(&c->rule, rule));
        c->ready = true;
        c->dims = *d;
        c->nparams = mn_rule_param_count(rule);
        const char *names[] = {"k", "v", "q"};
        mn_tensor *given[] = {&c->k, &c->v, &c->q};
        for (int i = 0; i < 3; i++) {
            lua_getfield(L, opts, names[i]);
            share_if(given[i], l_test_tensor(L, -1));
            lua_pop(L, 1);
        }
        share_if(&c->in.k, &in->k);
        share_if(&c->in.v, &in->v);
        share_if(&c->in.q, &in->q);
        share_if(&c->in.theta, &in->theta);
        share_if(&c->in.eta, &in->eta);
        share_if(&c->in.alpha, &in->alpha);
        share_if(&c->in.lengths, &in->lengths);
        for (int p = 0; p < c->nparams; p++) {
            share_if(&c->init[p], &params[p]);
            share_if(&c->momenta[p], &momenta[p]);
        }
        for (int j = 0; j < MN_OUTER_COUNT; j++) share_if(&c->outer[j], &outer[j]);
        lua_pushvalue(L, ctx_idx);
        lua_setfield(L, -2, "__mnemo_grad");
    }
    lua_setmetatable(L, res);
}

/* Push full summed back to the given shape (or full itself when shape is NULL). */
static void push_reduced(lua_State *L, const mn_tensor *full, const mn_tensor *like)
{
    mn_tensor *t = l_push_empty_tensor(L);
    if (!like || !like->storage) {
        mn_tensor_share(t, full);
        return;
    }
    L_TRY(L, mn_sum_to_shape(t, full, like->ndim, like->shape));
    /* on the device of the tensor the call gave (a sum went through the host) */
    if (t->storage->device != like->storage->device) {
        mn_tensor moved = {0};
        L_TRY(L, mn_tensor_to_device(&moved, t, like->storage->device));
        mn_tensor_release(t);
        *t = moved;
    }
}

/* res:backward{dy =, dloss =, dW1 =, ..., dS_W1 =, ... [, block = K]} */
static int l_result_backward(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    if (lua_isnoneornil(L, 2)) lua_newtable(L);
    else luaL_checktype(L, 2, LUA_TTABLE);
    lua_settop(L, 2);
    grad_ctx *c = NULL;
    if (lua_getmetatable(L, 1)) {
        lua_getfield(L, -1, "__mnemo_grad");
        c = luaL_testudata(L, -1, GRAD_CTX_MT);
        lua_pop(L, 2);
    }
    if (!c || !c->ready)
        return luaL_error(L, "backward: this result was run without grad = true (rule:run{..., grad = true})");
    /* upstream: shared references, given back on every path out */
    mn_run_upstream *up = lua_newuserdatauv(L, sizeof *up, 0);
    memset(up, 0, sizeof *up);
    int64_t block = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        if (lua_type(L, -2) != LUA_TSTRING) {
            mn_upstream_free(up);
            return luaL_error(L, "backward: upstream gradients are named (dy =, dloss =, dW1 =, ...), got a %s key",
                              luaL_typename(L, -2));
        }
        const char *key = lua_tostring(L, -2);
        if (strcmp(key, "block") == 0) {
            int isint = 0;
            block = (int64_t)lua_tointegerx(L, -1, &isint);
            if (!isint || block < 0) {
                mn_upstream_free(up);
                return luaL_error(L, "backward: block must be an integer >= 0 (steps between checkpoints; 0 = about sqrt(S))");
            }
            lua_pop(L, 1);
            continue;
        }
        mn_tensor *t = l_test_tensor(L, -1);
        if (!t) {
            mn_upstream_free(up);
            return luaL_error(L, "backward: %s must be a tensor, got %s", key, luaL_typename(L, -1));
        }
        if (mn_upstream_set(&c->rule, up, key, t, "backward: ") != MN_OK) {
            mn_upstream_free(up);
            return l_raise(L);
        }
        lua_pop(L, 1);
    }
    mn_run_grads g;
    /* the forward's checkpoints serve when no other block size is asked for */
    const mn_run_checkpoints *ck = c->ck.data && (block == 0 || block == c->ck.K) ? &c->ck : NULL;
    mn_status st =
        mn_run_backward_on(c->dev, c->precision, &c->rule, &c->dims, c->init, c->momenta, c->outer, &c->in, up, block, ck, &g);
    mn_upstream_free(up);
    if (st != MN_OK) {
        mn_fail_context(st, "backward: ");
        return l_raise(L);
    }
    /* The result table owns tensors that share g's storage; g is released
     * after (a raise in between leaks only if a reduction fails on OOM). */
    lua_createtable(L, 0, 8);
    int out = lua_gettop(L);
    push_reduced(L, &g.k, &c->k);
    lua_setfield(L, out, "k");
    push_reduced(L, &g.v, &c->v);
    lua_setfield(L, out, "v");
    if (g.q.storage) {
        push_reduced(L, &g.q, &c->q);
        lua_setfield(L, out, "q");
    }
    push_reduced(L, &g.theta, &c->in.theta);
    lua_setfield(L, out, "theta");
    push_reduced(L, &g.eta, &c->in.eta);
    lua_setfield(L, out, "eta");
    push_reduced(L, &g.alpha, &c->in.alpha);
    lua_setfield(L, out, "alpha");
    lua_createtable(L, 0, 2 * c->nparams);
    for (int p = 0; p < c->nparams; p++) {
        char name[16], sname[24];
        mn_rule_param_name(&c->rule, p, name, sizeof name);
        snprintf(sname, sizeof sname, "S_%s", name);
        push_reduced(L, &g.params[p], &c->init[p]);
        lua_setfield(L, -2, name);
        push_reduced(L, &g.momenta[p], &c->momenta[p]);
        lua_setfield(L, -2, sname);
    }
    for (int j = 0; j < MN_OUTER_COUNT; j++)
        if (g.outer[j].storage) {
            push_reduced(L, &g.outer[j], &c->outer[j]);
            lua_setfield(L, -2, mn_outer_name(j));
        }
    lua_setfield(L, out, "init");
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, g.block);
    lua_setfield(L, -2, "block");
    lua_pushinteger(L, g.backward_bytes);
    lua_setfield(L, -2, "backward_bytes");
    lua_pushinteger(L, g.forward_bytes);
    lua_setfield(L, -2, "forward_bytes");
    lua_setfield(L, out, "memory");
    mn_run_grads_free(&g);
    l_device_pressure(L);
    return 1;
}

void l_grad_register(lua_State *L)
{
    int module = lua_gettop(L);
    if (luaL_newmetatable(L, GRAD_CTX_MT)) {
        lua_pushcfunction(L, ctx_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_pop(L, 1);
    static const luaL_Reg result_methods[] = {{"backward", l_result_backward}, {NULL, NULL}};
    luaL_newlib(L, result_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, "mnemo.Result");
    lua_setfield(L, module, "Result");
}
