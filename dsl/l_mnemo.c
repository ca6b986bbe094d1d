/* l_mnemo.c: luaopen_mnemo, the `mnemo` module: the module table, the
 * registrars of every Lua-facing part (tensors, HDF5, ...), version, seed and
 * device, and the Lua files embedded at build time (the .lua files of dsl/, through
 * dsl/embed_sources.sh): each is package.preload["mnemo.<name>"], and the one
 * named "prelude" runs before luaopen_mnemo returns.
 * Every embedded chunk is called with (mnemo, "mnemo.<name>"), so it starts
 * with `local mnemo = ...` and never needs require "mnemo". */
#include "dsl.h"
#include "../model/random.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/cuda.h"
#endif

#include <string.h>

/* The table that dsl/embed_sources.sh generates ({NULL, NULL} ends it). */
typedef struct { const char *name; const char *source; } mn_embedded_lua_file;
extern const mn_embedded_lua_file mn_embedded_lua[];

/* Adding a part of the module is one line here. */
static void (*const registrars[])(lua_State *L) = {
    l_tensor_register,
    l_h5_register,
    l_compare_register,
    l_rule_register,
    l_grad_register,
    l_progress_register,
    l_kernel_info_register,
    l_expr_register, /* last: it wraps the math functions registered above */
};

static int l_seed(lua_State *L)
{
    int isnum = 0;
    lua_Integer n = lua_type(L, 1) == LUA_TNUMBER ? lua_tointegerx(L, 1, &isnum) : 0;
    if (!isnum)
        return luaL_error(L, "seed: bad argument #1 (seed must be an integer, got %s)",
                          lua_type(L, 1) == LUA_TNUMBER ? lua_tostring(L, 1) : luaL_typename(L, 1));
    mn_seed((uint64_t)n);
    return 0;
}

/* ---- devices: what the CUDA layer (kernels/cuda.h) says, or, in a build
 * without it, that there is none ---- */

#ifdef MN_HAVE_CUDA
static bool cuda_ok(void) { return mn_cuda_available(); }
static const char *cuda_reason(void) { return mn_cuda_unavailable_reason(); }
#else
static bool cuda_ok(void) { return false; }
/* The engine's own words for a cuda request in such a build (model/tensor.c). */
static const char *cuda_reason(void) { return "no CUDA device in this build"; }
#endif

static int l_device(lua_State *L)
{
    lua_pushstring(L, cuda_ok() ? "cuda" : "cpu");
    return 1;
}

static int l_cuda_available(lua_State *L)
{
    lua_pushboolean(L, cuda_ok());
    if (cuda_ok()) return 1;
    lua_pushstring(L, cuda_reason());
    return 2;
}

#ifdef MN_HAVE_CUDA
static void set_count(lua_State *L, const char *k, long long v)
{
    lua_pushinteger(L, (lua_Integer)v);
    lua_setfield(L, -2, k);
}
#endif

static int l_memory(lua_State *L)
{
    lua_newtable(L);
    lua_pushboolean(L, cuda_ok());
    lua_setfield(L, -2, "available");
    if (!cuda_ok()) {
        lua_pushstring(L, cuda_reason());
        lua_setfield(L, -2, "reason");
        return 1;
    }
#ifdef MN_HAVE_CUDA
    mn_cuda_memory_stats s;
    if (mn_cuda_memory(&s) != MN_OK) return l_raise(L);
    lua_pushstring(L, mn_cuda_describe());
    lua_setfield(L, -2, "device");
    set_count(L, "allocated", (long long)s.allocated);
    set_count(L, "cached", (long long)s.cached);
    set_count(L, "peak_allocated", (long long)s.peak_allocated);
    set_count(L, "kept", (long long)s.kept);
    set_count(L, "device_free", (long long)s.device_free);
    set_count(L, "device_total", (long long)s.device_total);
    set_count(L, "alloc_calls", (long long)s.alloc_calls);
    set_count(L, "cache_hits", (long long)s.cache_hits);
    set_count(L, "cuda_mallocs", (long long)s.cuda_mallocs);
#endif
    return 1;
}

static int l_empty_cache(lua_State *L)
{
#ifdef MN_HAVE_CUDA
    if (cuda_ok() && mn_cuda_empty_cache() != MN_OK) return l_raise(L);
#endif
    (void)L;
    return 0;
}

static int l_synchronize(lua_State *L)
{
#ifdef MN_HAVE_CUDA
    if (cuda_ok() && mn_cuda_synchronize() != MN_OK) return l_raise(L);
#endif
    (void)L;
    return 0;
}

/* Lua's collector sees a GPU tensor as a few bytes of userdata, so a loop of
 * rule:run calls that drops its results keeps their GPU memory until Lua's
 * own heap grows enough for a cycle: the allocator's cache gets none of it
 * back, every run pays cudaMallocs (0.3-0.8 ms a run at P1's sizes on an
 * H100), and the device fills. So after each engine call, when the bytes
 * held by live tensors grew by more than 1 GiB since the last collection,
 * collect: the dead results' blocks return to the cache for the next runs. */
#define DEVICE_GC_BYTES ((size_t)1 << 30)

void l_device_pressure(lua_State *L)
{
#ifdef MN_HAVE_CUDA
    static size_t mark; /* live bytes after the last collection */
    size_t live = mn_cuda_allocated_bytes();
    if (live < mark) mark = live;
    if (live - mark < DEVICE_GC_BYTES) return;
    lua_gc(L, LUA_GCCOLLECT);
    mark = mn_cuda_allocated_bytes();
#else
    (void)L;
#endif
}

#ifdef MN_HAVE_CUDA
/* The allocator's last resort before out of memory (kernels/cuda.h). */
static void collect_on_oom(void *ctx) { lua_gc((lua_State *)ctx, LUA_GCCOLLECT); }
#endif

static int l_compiles(lua_State *L)
{
    lua_createtable(L, 0, 5);
    int fast = 0, upgraded = 0, pending = 0, failed = 0, shared = 0; /* a build without CUDA compiles nothing */
#ifdef MN_HAVE_CUDA
    mn_cuda_compile_stats s;
    mn_cuda_compile_stats_get(&s);
    fast = s.fast, upgraded = s.upgraded, pending = s.pending, failed = s.failed, shared = s.shared;
#endif
    const struct { const char *name; int n; } f[] = {
        {"fast", fast}, {"upgraded", upgraded}, {"pending", pending}, {"failed", failed}, {"shared", shared}};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) {
        lua_pushinteger(L, f[i].n);
        lua_setfield(L, -2, f[i].name);
    }
    return 1;
}

static int l_compile_wait(lua_State *L)
{
    int moved = 0;
#ifdef MN_HAVE_CUDA
    if (mn_cuda_compile_wait(&moved) != MN_OK) return l_raise(L);
#endif
    lua_pushinteger(L, moved);
    return 1;
}

#ifdef MN_HAVE_CUDA
/* mnemo._after_statement: the REPL calls it after each statement, so that
 * a fault in a kernel launched asynchronously is reported where it happened
 * (give or take a statement) rather than at some later, unrelated call. */
static int l_after_statement(lua_State *L)
{
    if (mn_cuda_check_pending() != MN_OK) return l_raise(L);
    return 0;
}
#endif

static const struct { const char *name; lua_CFunction fn; const char *doc; } device_funcs[] = {
    { "device", l_device, "mnemo.device() -> 'cuda' when a CUDA device is usable, else 'cpu'" },
    { "cuda_available", l_cuda_available, "mnemo.cuda_available() -> true, or false and the reason (no driver, no device, ...)" },
    { "memory", l_memory, "mnemo.memory() -> a table of GPU memory: available, device, allocated, cached, peak_allocated, kept (of allocated: workspace and step graphs the large path keeps for the next run of a shape), device_free, device_total (bytes), alloc_calls, cache_hits, cuda_mallocs; without a device {available = false, reason = ...}" },
    { "empty_cache", l_empty_cache, "mnemo.empty_cache() -> nil; gives the GPU memory cached for reuse back to the driver" },
    { "synchronize", l_synchronize, "mnemo.synchronize() -> nil; waits for the GPU to finish, raising any error of its work" },
    { "compiles", l_compiles, "mnemo.compiles() -> {fast, upgraded, pending, failed, shared}: kernels first run from the fast compile, those moved to the full one since, background compiles not yet taken up, those that failed, and of the moved, those another process compiled while this one waited for the same kernel (see MNEMO_COMPILE)" },
    { "compile_wait", l_compile_wait, "mnemo.compile_wait() -> n; waits for the background compiles and moves their kernels to the full tier (do it before timing kernels); n of them moved" },
};

/* package.preload loader: upvalue 1 the index into mn_embedded_lua, upvalue
 * 2 the module table. Errors name the chunk ("mnemo.prelude:12: ..."). */
static int load_embedded(lua_State *L)
{
    const mn_embedded_lua_file *f = &mn_embedded_lua[lua_tointeger(L, lua_upvalueindex(1))];
    lua_pushfstring(L, "=mnemo.%s", f->name);
    if (luaL_loadbufferx(L, f->source, strlen(f->source), lua_tostring(L, -1), "t") != LUA_OK)
        return lua_error(L);
    lua_pushvalue(L, lua_upvalueindex(2));
    lua_pushfstring(L, "mnemo.%s", f->name);
    lua_call(L, 2, 1);
    return 1;
}

/* Run the embedded prelude as require would (its result goes to
 * package.loaded), turning any error into one that names it. */
static void run_prelude(lua_State *L, int mod, int index)
{
    lua_pushinteger(L, index);
    lua_pushvalue(L, mod);
    lua_pushcclosure(L, load_embedded, 2);
    if (lua_pcall(L, 0, 1, 0) != LUA_OK) {
        const char *msg = luaL_tolstring(L, -1, NULL);
        luaL_error(L, "mnemo: the embedded prelude (mnemo.prelude) failed: %s", msg);
    }
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_pushboolean(L, 1);
    }
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_insert(L, -2);
    lua_setfield(L, -2, "mnemo.prelude");
    lua_pop(L, 1);
}

int luaopen_mnemo(lua_State *L)
{
#ifdef MN_HAVE_CUDA
    mn_cuda_register(); /* once per process; without a device it records why */
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
    mn_cuda_set_oom_hook(collect_on_oom, lua_tothread(L, -1));
    lua_pop(L, 1);
#endif
    lua_newtable(L);
    int mod = lua_gettop(L);
    for (size_t i = 0; i < sizeof registrars / sizeof registrars[0]; i++) {
        registrars[i](L);
        lua_settop(L, mod);
    }
    lua_pushliteral(L, MN_VERSION);
    lua_setfield(L, mod, "version");
    lua_pushcfunction(L, l_seed);
    lua_setfield(L, mod, "seed");
    for (size_t i = 0; i < sizeof device_funcs / sizeof device_funcs[0]; i++) {
        lua_pushcfunction(L, device_funcs[i].fn);
        lua_setfield(L, mod, device_funcs[i].name);
    }
#ifdef MN_HAVE_CUDA
    lua_pushcfunction(L, l_after_statement);
    lua_setfield(L, mod, "_after_statement");
#endif
    if (lua_getfield(L, mod, "_docs") == LUA_TTABLE) {
        lua_pushliteral(L, "mnemo.seed(n) -> nil; reseeds the global generator behind rand and randn (the same n gives the same numbers on every machine)");
        lua_setfield(L, -2, "mnemo.seed");
        for (size_t i = 0; i < sizeof device_funcs / sizeof device_funcs[0]; i++) {
            lua_pushfstring(L, "mnemo.%s", device_funcs[i].name);
            lua_pushstring(L, device_funcs[i].doc);
            lua_rawset(L, -3);
        }
        lua_pushliteral(L, "mnemo.version -> the version string");
        lua_setfield(L, -2, "mnemo.version");
    }
    lua_settop(L, mod);

    /* The prelude may require "mnemo" (or a sibling that does): let it find this table. */
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_pushvalue(L, mod);
    lua_setfield(L, -2, "mnemo");
    lua_pop(L, 1);

    int prelude = -1;
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    for (int i = 0; mn_embedded_lua[i].name; i++) {
        lua_pushinteger(L, i);
        lua_pushvalue(L, mod);
        lua_pushcclosure(L, load_embedded, 2);
        lua_pushfstring(L, "mnemo.%s", mn_embedded_lua[i].name);
        lua_insert(L, -2);
        lua_settable(L, -3);
        if (!strcmp(mn_embedded_lua[i].name, "prelude")) prelude = i;
    }
    lua_pop(L, 1);
    if (prelude >= 0) run_prelude(L, mod, prelude);
    lua_settop(L, mod);
    return 1;
}
