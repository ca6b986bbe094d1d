/* l_mnemo.c: luaopen_mnemo, the `mnemo` module: the module table, the
 * registrars of every Lua-facing part (tensors, HDF5, ...), version, seed and
 * device, and the Lua files embedded at build time (the .lua files of dsl/, through
 * dsl/embed_lua.sh): each is package.preload["mnemo.<name>"], and the one
 * named "prelude" runs before luaopen_mnemo returns.
 * Every embedded chunk is called with (mnemo, "mnemo.<name>"), so it starts
 * with `local mnemo = ...` and never needs require "mnemo". */
#include "dsl.h"
#include "../model/random.h"

#include <string.h>

/* The table that dsl/embed_lua.sh generates ({NULL, NULL} ends it). */
typedef struct { const char *name; const char *source; } mn_embedded_lua_file;
extern const mn_embedded_lua_file mn_embedded_lua[];

/* Adding a part of the module is one line here. */
static void (*const registrars[])(lua_State *L) = {
    l_tensor_register,
    l_h5_register,
    l_compare_register,
    l_rule_register,
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

static int l_device(lua_State *L)
{
    lua_pushliteral(L, "cpu");
    return 1;
}

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
    lua_pushcfunction(L, l_device);
    lua_setfield(L, mod, "device");
    if (lua_getfield(L, mod, "_docs") == LUA_TTABLE) {
        lua_pushliteral(L, "mnemo.seed(n) -> nil; reseeds the global generator behind rand and randn (the same n gives the same numbers on every machine)");
        lua_setfield(L, -2, "mnemo.seed");
        lua_pushliteral(L, "mnemo.device() -> the default device: 'cpu'");
        lua_setfield(L, -2, "mnemo.device");
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
