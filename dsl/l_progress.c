/* l_progress.c: the C side of progress lines and timing for the prelude
 * (dsl/prelude.lua wraps rule:run, mem:write and mem:run with them):
 *   mnemo._progress_begin(label, tokens_per_step) -> a handle (to-be-closed)
 *       installs model/progress.c's line as the engine's progress hook;
 *       closing or collecting the handle erases the line and uninstalls it.
 *       Returns nil when a line is already running (nested runs).
 *   mnemo._clock() -> seconds from a monotonic wall clock (mnemo.profile). */
#include "dsl.h"
#include "../model/progress.h"

#define PROGRESS_MT "mnemo.Progress"

typedef struct l_progress {
    mn_progress p;
    bool attached;
} l_progress;

static l_progress *current; /* the attached handle, if any */

static int progress_close(lua_State *L)
{
    l_progress *h = luaL_checkudata(L, 1, PROGRESS_MT);
    if (h->attached) {
        mn_progress_detach(&h->p);
        h->attached = false;
        if (current == h) current = NULL;
    }
    return 0;
}

static int l_progress_begin(lua_State *L)
{
    const char *label = luaL_optstring(L, 1, "run");
    double per_step = luaL_optnumber(L, 2, 0);
    if (current) {
        lua_pushnil(L);
        return 1;
    }
    l_progress *h = lua_newuserdatauv(L, sizeof *h, 0);
    h->attached = false;
    luaL_setmetatable(L, PROGRESS_MT);
    mn_progress_init(&h->p, label, stderr, true, per_step);
    mn_progress_attach(&h->p);
    h->attached = true;
    current = h;
    return 1;
}

static int l_clock(lua_State *L)
{
    lua_pushnumber(L, mn_clock_monotonic());
    return 1;
}

void l_progress_register(lua_State *L)
{
    int module = lua_gettop(L);
    if (luaL_newmetatable(L, PROGRESS_MT)) {
        lua_pushcfunction(L, progress_close);
        lua_setfield(L, -2, "__close");
        lua_pushcfunction(L, progress_close);
        lua_setfield(L, -2, "__gc");
    }
    lua_pop(L, 1);
    lua_pushcfunction(L, l_progress_begin);
    lua_setfield(L, module, "_progress_begin");
    lua_pushcfunction(L, l_clock);
    lua_setfield(L, module, "_clock");
}
