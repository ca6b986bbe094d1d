/* l_kernel_info.c: the generated kernels from Lua (kernels/kernel_info.h).
 *   rule:kernel_info{dk=, dv=, hidden=, B=, H=, precision=, arch=}
 *       registers, shared memory, stack, spills and launch bounds of the
 *       rule's kernels as ptxas reported them (NVRTC only: no GPU needed);
 *       on a GPU also the driver's attributes and the occupancy (l_rule.c
 *       calls l_rule_kernel_info for the method)
 *   rule:plan{dk=, dv=, hidden=, B=, H=, precision=}
 *       which CUDA path (kernels/plan.h) would run the rule, and why
 *   mnemo._profile_kernel_hook("start" | "stop")
 *       set when a GPU is usable: mnemo.profile (dsl/prelude.lua) calls it
 *       around fn; "stop" returns the GPU time of each kernel launched since
 *       "start", from the engine's launch timing, which is on only between
 *       the two. Nested profiles each see their own launches. */
#include "dsl.h"
#include "../model/engine.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/codegen.h"
#include "../kernels/cuda.h"
#include "../kernels/kernel_info.h"
#include "../kernels/plan.h"
#endif

#include <stdio.h>
#include <string.h>

#define KERNEL_INFO_MT "mnemo.KernelInfo"
#define PLAN_MT "mnemo.Plan"

#ifdef MN_HAVE_CUDA

static void set_int(lua_State *L, const char *key, long long v)
{
    lua_pushinteger(L, (lua_Integer)v);
    lua_setfield(L, -2, key);
}

static void set_num(lua_State *L, const char *key, double v)
{
    lua_pushnumber(L, v);
    lua_setfield(L, -2, key);
}

static void set_str(lua_State *L, const char *key, const char *v)
{
    lua_pushstring(L, v);
    lua_setfield(L, -2, key);
}

static void set_dim3(lua_State *L, const char *key, const unsigned v[3])
{
    lua_createtable(L, 3, 0);
    for (int i = 0; i < 3; i++) {
        lua_pushinteger(L, v[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, -2, key);
}

/* The fields of one kernel into the table on top of the stack. Sizes ptxas
 * did not report stay nil. */
static void put_kernel(lua_State *L, const mn_kernel_info *k, long long grid, int cluster)
{
    set_str(L, "name", k->name);
    if (k->registers >= 0) set_int(L, "registers", k->registers);
    if (k->shared_bytes >= 0) set_int(L, "shared_bytes", k->shared_bytes);
    if (k->stack_bytes >= 0) set_int(L, "stack_bytes", k->stack_bytes);
    if (k->spill_stores >= 0) set_int(L, "spill_stores", k->spill_stores);
    if (k->spill_loads >= 0) set_int(L, "spill_loads", k->spill_loads);
    if (k->barriers >= 0) set_int(L, "barriers", k->barriers);
    set_int(L, "max_threads", k->max_threads);
    set_int(L, "block_threads", k->block_threads);
    if (!k->on_device) return;
    lua_createtable(L, 0, 6);
    set_int(L, "blocks_per_sm", k->blocks_per_sm);
    set_int(L, "warps_per_sm", k->warps_per_sm);
    set_int(L, "max_warps_per_sm", k->max_warps_per_sm);
    set_num(L, "fraction", k->occupancy);
    set_int(L, "sms", k->sms);
    /* a persistent block per memory: B*H blocks fill the GPU in waves; a
     * cluster kernel's wave is the clusters resident at once */
    long long per_wave = (long long)k->blocks_per_sm * k->sms;
    if (k->active_clusters > 0) {
        set_int(L, "clusters", k->active_clusters);
        per_wave = (long long)k->active_clusters * cluster;
    }
    if (per_wave > 0) set_int(L, "waves", (grid + per_wave - 1) / per_wave);
    lua_setfield(L, -2, "occupancy");
    lua_createtable(L, 0, 4);
    set_int(L, "registers", k->device_registers);
    set_int(L, "shared_bytes", k->device_shared_bytes);
    set_int(L, "local_bytes", k->device_local_bytes);
    set_int(L, "max_threads", k->device_max_threads);
    lua_setfield(L, -2, "gpu");
}

static int opt_int(lua_State *L, int t, const char *key, int dflt)
{
    int type = lua_getfield(L, t, key), isnum = 0;
    lua_Integer v = dflt;
    if (type != LUA_TNIL) {
        v = lua_tointegerx(L, -1, &isnum);
        if (!isnum || v < 0 || v > 1 << 30)
            luaL_error(L, "kernel_info: option '%s' must be a non-negative integer, got %s", key,
                       type == LUA_TNUMBER ? lua_tostring(L, -1) : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    return (int)v;
}

/* A cell of the printed table: the number, or "?" when not reported. */
static const char *cell(lua_State *L, int t, const char *key, char *buf, size_t len)
{
    if (lua_getfield(L, t, key) == LUA_TNUMBER) snprintf(buf, len, "%lld", (long long)lua_tointeger(L, -1));
    else snprintf(buf, len, "?");
    lua_pop(L, 1);
    return buf;
}

static const char *field_str(lua_State *L, int t, const char *key, const char *dflt)
{
    lua_getfield(L, t, key);
    const char *s = lua_isstring(L, -1) ? lua_tostring(L, -1) : dflt;
    lua_pop(L, 1); /* the table still holds the string */
    return s;
}

static long long field_int(lua_State *L, int t, const char *key)
{
    lua_getfield(L, t, key);
    long long v = (long long)lua_tointeger(L, -1);
    lua_pop(L, 1);
    return v;
}

/* tostring(info): a header line and one row per kernel. */
static int kernel_info_tostring(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    char text[2048];
    size_t n = 0;
#define ADD(...) (n += (size_t)snprintf(text + n, n < sizeof text ? sizeof text - n : 0, __VA_ARGS__))
    lua_getfield(L, 1, "compile_ms");
    double ms = lua_tonumber(L, -1);
    lua_getfield(L, 1, "cached");
    bool cached = lua_toboolean(L, -1);
    lua_pop(L, 2);
    long long grid = field_int(L, 1, "grid"), cluster = field_int(L, 1, "cluster");
    char per[48] = "B*H";
    if (cluster > 1) snprintf(per, sizeof per, "B*H x a cluster of %lld", cluster);
    ADD("rule kernels for sm_%lld (dk %lld, dv %lld, %s; %lld block%s = %s): %scompiled in %.0f ms",
        field_int(L, 1, "arch"), field_int(L, 1, "dk"), field_int(L, 1, "dv"), field_str(L, 1, "precision", "?"),
        grid, grid == 1 ? "" : "s", per, cached ? "cached, " : "", ms);
    ADD("\n%-22s %5s %7s %7s %7s %7s %6s %6s  %s", "kernel", "regs", "smem B", "stack B", "spill>", "spill<", "bounds",
        "block", "occupancy");
    lua_getfield(L, 1, "kernels");
    int ks = lua_gettop(L);
    for (lua_Integer i = 1; lua_istable(L, ks) && n < sizeof text; i++) {
        if (lua_rawgeti(L, ks, i) != LUA_TTABLE) break;
        int k = lua_gettop(L);
        char c[7][24], occ[96] = "- (no GPU)";
        if (lua_getfield(L, k, "occupancy") == LUA_TTABLE) {
            lua_getfield(L, -1, "blocks_per_sm");
            lua_getfield(L, -2, "fraction");
            snprintf(occ, sizeof occ, "%lld blocks/SM, %.0f%% of warps", (long long)lua_tointeger(L, -2),
                     100.0 * lua_tonumber(L, -1));
            lua_pop(L, 2);
            if (lua_getfield(L, -1, "clusters") == LUA_TNUMBER) { /* and the waves they make */
                size_t used = strlen(occ);
                lua_getfield(L, -2, "waves");
                snprintf(occ + used, sizeof occ - used, "; %lld clusters at once, %lld waves",
                         (long long)lua_tointeger(L, -2), (long long)lua_tointeger(L, -1));
                lua_pop(L, 1);
            }
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
        ADD("\n%-22s %5s %7s %7s %7s %7s %6s %6s  %s", field_str(L, k, "name", "?"),
            cell(L, k, "registers", c[0], sizeof c[0]), cell(L, k, "shared_bytes", c[1], sizeof c[1]),
            cell(L, k, "stack_bytes", c[2], sizeof c[2]), cell(L, k, "spill_stores", c[3], sizeof c[3]),
            cell(L, k, "spill_loads", c[4], sizeof c[4]), cell(L, k, "max_threads", c[5], sizeof c[5]),
            cell(L, k, "block_threads", c[6], sizeof c[6]), occ);
        lua_pop(L, 1);
    }
#undef ADD
    lua_pushlstring(L, text, n < sizeof text ? n : sizeof text - 1);
    return 1;
}

/* The options of rule:kernel_info and rule:plan: sizes, precision, arch;
 * and for rule:plan (ragged not NULL) lengths = true, a run with lengths
 * (accepted and checked; every path runs them, so the plan is the rule's). */
static void kernel_opts(lua_State *L, const mn_rule *r, int opts, const char *who, mn_dims *dp, mn_precision *precp,
                        int *archp, bool *ragged)
{
    mn_dims d = {1, 1, 1, 64, 0, 0, 1};
    mn_precision prec = MN_PREC_FP32;
    int arch = 0;
    if (!lua_isnoneornil(L, opts)) {
        luaL_checktype(L, opts, LUA_TTABLE);
        static const char *const known[] = {"dk", "dv", "hidden", "B", "H", "precision", "arch", "lengths", NULL};
        lua_pushnil(L);
        while (lua_next(L, opts)) {
            bool ok = false;
            for (int i = 0; known[i] && !ok; i++)
                ok = lua_type(L, -2) == LUA_TSTRING && !strcmp(lua_tostring(L, -2), known[i]) &&
                     (ragged || strcmp(known[i], "lengths") != 0);
            if (!ok)
                luaL_error(L, "%s: unknown option '%s' (dk, dv, hidden, B, H, precision, arch%s)", who,
                           luaL_tolstring(L, -2, NULL), ragged ? ", lengths" : "");
            lua_pop(L, 1);
        }
        if (ragged) {
            lua_getfield(L, opts, "lengths");
            if (!lua_isnil(L, -1) && !lua_isboolean(L, -1))
                luaL_error(L, "%s: lengths must be true or false (whether the run has lengths), got %s", who,
                           luaL_typename(L, -1));
            *ragged = lua_toboolean(L, -1);
            lua_pop(L, 1);
        }
        d.dk = opt_int(L, opts, "dk", 64);
        d.dv = opt_int(L, opts, "dv", 0);
        d.dh = opt_int(L, opts, "hidden", 0);
        d.B = opt_int(L, opts, "B", 1);
        d.H = opt_int(L, opts, "H", 1);
        arch = opt_int(L, opts, "arch", 0);
        lua_getfield(L, opts, "precision");
        if (!lua_isnil(L, -1) && mn_precision_lookup(luaL_checkstring(L, -1), &prec) != MN_OK)
            luaL_error(L, "%s: %s", who, mn_last_error());
        lua_pop(L, 1);
    }
    if (d.dv == 0) d.dv = d.dk;
    if (d.dh == 0) d.dh = r->hidden > 0 ? r->hidden : 64;
    if (d.B < 1 || d.H < 1) luaL_error(L, "%s: B and H must be >= 1", who);
    if (d.dk < 1 || d.dv < 1 || d.dh < 1) luaL_error(L, "%s: dk, dv and hidden must be >= 1", who);
    if (arch != 0 && arch < 50) luaL_error(L, "%s: arch %d is not an sm (e.g. 90 for sm_90)", who, arch);
    *dp = d;
    *precp = prec;
    *archp = arch;
}

/* The backward's path of a cuda run (kernels/plan.h) into the plan table
 * on top: backward = "fused (cuda)", "large (cuda)", "general (cuda)" or
 * "cpu", and
 * backward_why; with d (NULL: the rule is not for cuda at all), the fused
 * backward's rows and shared memory too. */
static void set_backward(lua_State *L, const mn_rule *r, const mn_dims *d, mn_precision prec, int arch, long smem)
{
    char why[256];
    bool gpu = mn_cuda_backward_covers(r, why, sizeof why);
    mn_cuda_plan bp;
    if (gpu && d && mn_cuda_plan_backward(r, d, prec, arch, smem, &bp) != MN_OK) {
        luaL_error(L, "plan: %s", mn_last_error());
        return;
    }
    if (!gpu || !d) {
        set_str(L, "backward", gpu ? "general (cuda)" : "cpu");
        set_str(L, "backward_why", gpu ? "the general backward kernel (grad_kernel.cuh)" : why);
        return;
    }
    const bool fused = bp.path == MN_PATH_FUSED;
    char where[32];
    snprintf(where, sizeof where, "%s (cuda)", mn_cuda_path_name(bp.path));
    set_str(L, "backward", where);
    set_str(L, "backward_why", bp.why);
    if (fused) {
        set_int(L, "backward_rows", bp.rows);
        set_int(L, "backward_smem_bytes", bp.smem_bytes);
        set_str(L, "backward_kernel", MN_FUSED_GRAD_KERNEL_NAME);
    }
}

/* rule:plan{...}: which CUDA path would run the rule, and why. */
int l_rule_plan(lua_State *L, const mn_rule *r, int opts)
{
    mn_dims d;
    mn_precision prec;
    int arch;
    bool ragged = false;
    kernel_opts(L, r, opts, "plan", &d, &prec, &arch, &ragged);
    if (mn_rule_device_check(r, MN_CUDA) != MN_OK) {
        /* a row of the rule table the CUDA engine does not run (rule.def) */
        lua_createtable(L, 0, 2);
        set_str(L, "path", "cpu");
        set_str(L, "why", mn_last_error());
        set_backward(L, r, NULL, prec, 0, 0);
        luaL_setmetatable(L, PLAN_MT);
        return 1;
    }
    mn_cuda_plan pl;
    int dev_arch = mn_cuda_arch();
    if (arch == 0) arch = dev_arch;
    (void)ragged; /* every path runs lengths: the plan is the rule's */
    if (mn_cuda_plan_rule(r, &d, prec, d.B * d.H, arch, arch == dev_arch ? mn_cuda_smem_optin() : 0, &pl) != MN_OK)
        return luaL_error(L, "plan: %s", mn_last_error());
    lua_createtable(L, 0, 10);
    set_str(L, "path", mn_cuda_path_name(pl.path));
    set_str(L, "why", pl.why);
    lua_pushboolean(L, pl.forced);
    lua_setfield(L, -2, "forced");
    set_str(L, "precision", mn_precision_name(prec));
    set_int(L, "memories", d.B * d.H);
    if (pl.path == MN_PATH_FUSED) {
        set_int(L, "rows", pl.rows);
        set_int(L, "cluster", pl.cluster);
        set_int(L, "blocks_per_sm", pl.min_blocks);
        set_int(L, "threads", pl.threads);
        set_int(L, "smem_bytes", pl.smem_bytes);
        lua_pushboolean(L, pl.g_shared);
        lua_setfield(L, -2, "grad_in_shared");
        lua_pushboolean(L, pl.g_swizzle);
        lua_setfield(L, -2, "grad_swizzled");
        lua_pushboolean(L, pl.z_pad);
        lua_setfield(L, -2, "z_pad");
        lua_pushboolean(L, pl.w16);
        lua_setfield(L, -2, "w16");
        set_int(L, "k_unroll", pl.kunroll);
        set_str(L, "kernel", MN_FUSED_STEP_KERNEL);
    } else if (pl.path == MN_PATH_GENERAL) {
        set_str(L, "kernel", MN_RULE_STEP_KERNEL);
    }
    set_int(L, "arch", arch > 0 ? arch : 90);
    set_str(L, "device", mn_cuda_available() ? mn_cuda_describe() : "none");
    set_backward(L, r, &d, prec, arch, arch == dev_arch ? mn_cuda_smem_optin() : 0);
    luaL_setmetatable(L, PLAN_MT);
    return 1;
}

static int plan_tostring(lua_State *L)
{
    lua_getfield(L, 1, "path");
    lua_getfield(L, 1, "why");
    lua_getfield(L, 1, "rows");
    if (lua_isnil(L, -1))
        lua_pushfstring(L, "plan: %s path: %s", lua_tostring(L, -3), lua_tostring(L, -2));
    else {
        lua_getfield(L, 1, "threads");
        lua_getfield(L, 1, "smem_bytes");
        lua_pushfstring(L, "plan: %s path: %s\n  %d-row chunks, %d threads per memory, %d KB shared memory",
                        lua_tostring(L, -5), lua_tostring(L, -4), (int)lua_tointeger(L, -3),
                        (int)lua_tointeger(L, -2), (int)(lua_tointeger(L, -1) / 1024));
    }
    int text = lua_gettop(L);
    lua_getfield(L, 1, "backward");
    lua_getfield(L, 1, "backward_why");
    if (lua_isstring(L, -2)) {
        bool gpu = strcmp(lua_tostring(L, -2), "cpu") != 0;
        lua_pushfstring(L, "%s\n  backward: %s%s%s", lua_tostring(L, text), lua_tostring(L, -2),
                        gpu ? ": " : ", because ", lua_tostring(L, -1));
    } else {
        lua_pushvalue(L, text);
    }
    return 1;
}

int l_rule_kernel_info(lua_State *L, const mn_rule *r, int opts)
{
    mn_dims d;
    mn_precision prec;
    int arch;
    kernel_opts(L, r, opts, "kernel_info", &d, &prec, &arch, NULL);
    mn_kernel_set kset, *set = &kset;
    if (mn_cuda_rule_kernel_info(r, &d, prec, arch, set) != MN_OK)
        return luaL_error(L, "kernel_info: %s", mn_last_error());
    /* the step kernel at the top (a run spends its time there), all in kernels;
     * a block per memory, or a cluster of them */
    const int cluster = set->cluster;
    long long grid = d.B * d.H * cluster;
    lua_createtable(L, 0, 24);
    for (int i = 0; i < set->n; i++)
        if (!strcmp(set->k[i].name, set->step_kernel)) put_kernel(L, &set->k[i], grid, cluster);
    set_str(L, "path", set->path);
    set_int(L, "arch", set->arch);
    set_num(L, "compile_ms", set->compile_ms);
    lua_pushboolean(L, set->cached);
    lua_setfield(L, -2, "cached");
    set_str(L, "key", set->key);
    set_int(L, "dk", d.dk);
    set_int(L, "dv", d.dv);
    if (r->layers > 1) set_int(L, "hidden", d.dh);
    set_int(L, "grid", grid);
    set_int(L, "cluster", cluster);
    set_str(L, "precision", mn_precision_name(prec));
    lua_createtable(L, set->n, 0);
    int at = 1;
    for (int pass = 0; pass < 2; pass++) /* the step kernel first, then the others in ptxas's order */
        for (int i = 0; i < set->n; i++) {
            if ((strcmp(set->k[i].name, set->step_kernel) == 0) != (pass == 0)) continue;
            lua_createtable(L, 0, 12);
            put_kernel(L, &set->k[i], grid, cluster);
            lua_rawseti(L, -2, at++);
        }
    lua_setfield(L, -2, "kernels");
    luaL_setmetatable(L, KERNEL_INFO_MT);
    return 1;
}

/* ---- mnemo._profile_kernel_hook ---- */

/* Upvalue 1: a stack of snapshots, one per open "start": {recorded =,
 * [name] = {calls, ms}}. */
static int profile_hook(lua_State *L)
{
    const char *what = luaL_checkstring(L, 1);
    int stack = lua_upvalueindex(1);
    lua_Integer depth = (lua_Integer)lua_rawlen(L, stack);
    mn_kernel_total totals[MN_PROFILE_KERNELS];
    int n = mn_cuda_profile_totals(totals, MN_PROFILE_KERNELS);
    long long recorded = 0;
    mn_kernel_launch recent[MN_PROFILE_RING];
    int nrecent = mn_cuda_profile_recent(recent, MN_PROFILE_RING, &recorded);
    if (!strcmp(what, "start")) {
        if (mn_cuda_profile_set(true) != MN_OK) return l_raise(L);
        lua_createtable(L, 0, n + 1);
        set_int(L, "recorded", recorded);
        for (int i = 0; i < n; i++) {
            lua_createtable(L, 2, 0);
            lua_pushinteger(L, totals[i].calls);
            lua_rawseti(L, -2, 1);
            lua_pushnumber(L, totals[i].ms);
            lua_rawseti(L, -2, 2);
            lua_setfield(L, -2, totals[i].name);
        }
        lua_rawseti(L, stack, depth + 1);
        return 0;
    }
    if (strcmp(what, "stop") != 0)
        return luaL_error(L, "profile hook: expected \"start\" or \"stop\", got \"%s\"", what);
    if (depth == 0) return 0;
    lua_rawgeti(L, stack, depth);
    int snap = lua_gettop(L);
    lua_pushnil(L);
    lua_rawseti(L, stack, depth);
    if (depth == 1) (void)mn_cuda_profile_set(false); /* off always succeeds */
    /* the kernels launched since start, most GPU time first */
    lua_createtable(L, n, 1);
    int out = lua_gettop(L), m = 0;
    int order[MN_PROFILE_KERNELS];
    double delta_ms[MN_PROFILE_KERNELS];
    long long delta_calls[MN_PROFILE_KERNELS];
    for (int i = 0; i < n; i++) {
        long long calls0 = 0;
        double ms0 = 0;
        if (lua_getfield(L, snap, totals[i].name) == LUA_TTABLE) {
            lua_rawgeti(L, -1, 1);
            lua_rawgeti(L, -2, 2);
            calls0 = (long long)lua_tointeger(L, -2);
            ms0 = lua_tonumber(L, -1);
            lua_pop(L, 2);
        }
        lua_pop(L, 1);
        if (totals[i].calls <= calls0) continue;
        delta_calls[i] = totals[i].calls - calls0;
        delta_ms[i] = totals[i].ms - ms0;
        int j = m++;
        while (j > 0 && delta_ms[order[j - 1]] < delta_ms[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    for (int j = 0; j < m; j++) {
        const mn_kernel_total *t = &totals[order[j]];
        lua_createtable(L, 0, 7);
        set_str(L, "name", t->name);
        set_int(L, "calls", delta_calls[order[j]]);
        set_num(L, "seconds", delta_ms[order[j]] / 1e3);
        set_num(L, "ms", delta_ms[order[j]]);
        set_num(L, "mean_ms", delta_ms[order[j]] / (double)delta_calls[order[j]]);
        set_dim3(L, "grid", t->grid);
        set_dim3(L, "block", t->block);
        lua_rawseti(L, out, j + 1);
    }
    /* the launches themselves, as many as the ring still holds */
    lua_getfield(L, snap, "recorded");
    long long since = recorded - (long long)lua_tointeger(L, -1);
    lua_pop(L, 1);
    int first = since < nrecent ? nrecent - (int)since : 0;
    lua_createtable(L, nrecent - first, 0);
    for (int i = first; i < nrecent; i++) {
        lua_createtable(L, 0, 4);
        set_str(L, "name", recent[i].name);
        set_num(L, "ms", recent[i].ms);
        set_dim3(L, "grid", recent[i].grid);
        set_dim3(L, "block", recent[i].block);
        lua_rawseti(L, -2, i - first + 1);
    }
    lua_setfield(L, out, "launches");
    set_int(L, "launched", since);
    set_int(L, "recorded", recorded); /* since the process started */
    return 1;
}

#else /* no CUDA */

int l_rule_plan(lua_State *L, const mn_rule *r, int opts)
{
    (void)r;
    (void)opts;
    lua_createtable(L, 0, 2);
    lua_pushstring(L, "cpu");
    lua_setfield(L, -2, "path");
    lua_pushstring(L, "this build has no CUDA (built with CUDA=0): the CPU engine runs every rule");
    lua_setfield(L, -2, "why");
    return 1;
}

int l_rule_kernel_info(lua_State *L, const mn_rule *r, int opts)
{
    (void)r;
    (void)opts;
    return luaL_error(L, "kernel_info: this build has no CUDA");
}

#endif

void l_kernel_info_register(lua_State *L)
{
#ifdef MN_HAVE_CUDA
    luaL_newmetatable(L, KERNEL_INFO_MT);
    lua_pushcfunction(L, kernel_info_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
    luaL_newmetatable(L, PLAN_MT);
    lua_pushcfunction(L, plan_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
    if (mn_cuda_available()) { /* unset without a GPU: profile then shows no kernel table */
        lua_newtable(L);
        lua_pushcclosure(L, profile_hook, 1);
        lua_setfield(L, -2, "_profile_kernel_hook");
    }
#else
    (void)L;
#endif
}
