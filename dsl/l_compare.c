/* l_compare.c: mnemo.compare(a, b[, opts]), the Lua face of model/compare.h.
 * a and b are each a file path or a table tree; b is the reference. Returns
 *   { passed = bool, rtol = x, atol = x, scope = "...", nfailed = n,
 *     rows = { { name = "/outputs/y", shape = "2x4", shape_a = .., shape_b = ..,
 *                max_abs = x, rel = x, status = "pass", detail = "..." }, ... } }
 * whose __tostring is the table that `mnemo compare` prints. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsl.h"
#include "../model/compare.h"
#include "../model/h5.h"


#define COMPARE_BOX_MT "mnemo.compare_box"

/* Owns the trees and the report while Lua code between them may raise. */
typedef struct {
    mn_node *tree[2];
    mn_compare_report rep;
} compare_box;

static int box_gc(lua_State *L)
{
    compare_box *box = luaL_checkudata(L, 1, COMPARE_BOX_MT);
    for (int i = 0; i < 2; i++) {
        if (box->tree[i]) mn_node_free(box->tree[i]);
        box->tree[i] = NULL;
    }
    mn_compare_report_free(&box->rep);
    return 0;
}

static void read_options(lua_State *L, int idx, mn_compare_options *opt, bool *quiet)
{
    if (lua_isnoneornil(L, idx)) return;
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
        if (!strcmp(key, "rtol") || !strcmp(key, "atol")) {
            int isnum;
            double x = lua_tonumberx(L, -1, &isnum);
            if (!isnum || !(x >= 0))
                luaL_error(L, "mnemo.compare: option %s must be a number >= 0", key);
            *(key[0] == 'r' ? &opt->rtol : &opt->atol) = x;
        } else if (!strcmp(key, "all")) {
            opt->all = lua_toboolean(L, -1);
        } else if (!strcmp(key, "quiet")) {
            *quiet = lua_toboolean(L, -1);
        } else {
            luaL_error(L, "mnemo.compare: unknown option '%s' (rtol, atol, all, quiet)",
                       lua_type(L, -2) == LUA_TSTRING ? key : luaL_typename(L, -2));
        }
        lua_pop(L, 1);
    }
}

/* Fill box->tree[i] from argument arg; returns the name used in the header. */
static const char *load_arg(lua_State *L, compare_box *box, int i, int arg)
{
    if (lua_type(L, arg) == LUA_TSTRING) {
        const char *path = lua_tostring(L, arg);
        if (mn_h5_load(path, &box->tree[i]) != MN_OK) {
            box->tree[i] = NULL;
            if (!strstr(mn_last_error(), path)) mn_fail_context(MN_ERR_IO, "%s: ", path);
            l_raise(L);
        }
        return path;
    }
    if (lua_type(L, arg) == LUA_TTABLE) {
        box->tree[i] = l_table_to_tree(L, arg, i == 0 ? "a" : "b");
        return "a table";
    }
    luaL_argerror(L, arg, lua_pushfstring(L, "file path or table expected, got %s",
                                          luaL_typename(L, arg)));
    return NULL;
}

static void set_number_or_nil(lua_State *L, const char *key, double x)
{
    if (isnan(x)) return;
    lua_pushnumber(L, x);
    lua_setfield(L, -2, key);
}

static void set_string_if(lua_State *L, const char *key, const char *s)
{
    if (!s[0]) return;
    lua_pushstring(L, s);
    lua_setfield(L, -2, key);
}

static int report_tostring(lua_State *L)
{
    lua_pushvalue(L, lua_upvalueindex(1));
    return 1;
}

/* The printed table as a Lua string (pushed). */
static void push_printed(lua_State *L, const mn_compare_report *rep, const char *na,
                         const char *nb, bool quiet)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) luaL_error(L, "mnemo.compare: out of memory formatting the table");
    mn_compare_print(f, rep, na, nb, quiet);
    fclose(f);
    /* Without the final newline, as print() adds its own. */
    if (len && buf[len - 1] == '\n') len--;
    lua_pushlstring(L, buf, len);
    free(buf);
}

static int l_compare(lua_State *L)
{
    mn_compare_options opt = MN_COMPARE_DEFAULTS;
    bool quiet = false;
    read_options(L, 3, &opt, &quiet);
    lua_settop(L, 2);

    compare_box *box = lua_newuserdatauv(L, sizeof *box, 0); /* index 3 */
    memset(box, 0, sizeof *box);
    luaL_setmetatable(L, COMPARE_BOX_MT);
    const char *na = load_arg(L, box, 0, 1);
    const char *nb = load_arg(L, box, 1, 2);
    L_TRY(L, mn_compare_trees(box->tree[0], box->tree[1], &opt, &box->rep));
    const mn_compare_report *rep = &box->rep;

    lua_createtable(L, 0, 7);
    lua_pushboolean(L, mn_compare_passed(rep));
    lua_setfield(L, -2, "passed");
    lua_pushnumber(L, rep->rtol);
    lua_setfield(L, -2, "rtol");
    lua_pushnumber(L, rep->atol);
    lua_setfield(L, -2, "atol");
    lua_pushstring(L, rep->result_scope ? "/outputs and /final" : "every dataset");
    lua_setfield(L, -2, "scope");
    lua_pushinteger(L, rep->nfailed);
    lua_setfield(L, -2, "nfailed");
    lua_createtable(L, rep->nrows, 0);
    for (int i = 0; i < rep->nrows; i++) {
        const mn_compare_row *row = &rep->rows[i];
        char shape[300];
        lua_createtable(L, 0, 8);
        lua_pushstring(L, row->path);
        lua_setfield(L, -2, "name");
        if (row->shape_a[0] && row->shape_b[0] && strcmp(row->shape_a, row->shape_b))
            snprintf(shape, sizeof shape, "%s vs %s", row->shape_a, row->shape_b);
        else
            snprintf(shape, sizeof shape, "%s", row->shape_a[0] ? row->shape_a : row->shape_b);
        lua_pushstring(L, shape);
        lua_setfield(L, -2, "shape");
        set_string_if(L, "shape_a", row->shape_a);
        set_string_if(L, "shape_b", row->shape_b);
        set_number_or_nil(L, "max_abs", row->max_abs);
        set_number_or_nil(L, "rel", row->rel);
        lua_pushstring(L, mn_compare_status_name(row->status));
        lua_setfield(L, -2, "status");
        lua_pushstring(L, row->text);
        lua_setfield(L, -2, "detail");
        lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, -2, "rows");

    lua_createtable(L, 0, 2); /* the result's own metatable */
    push_printed(L, rep, na, nb, quiet);
    lua_pushcclosure(L, report_tostring, 1);
    lua_setfield(L, -2, "__tostring");
    lua_pushliteral(L, "mnemo.compare");
    lua_setfield(L, -2, "__name");
    lua_setmetatable(L, -2);

    /* Free the trees now rather than at the next collection. */
    lua_pushcfunction(L, box_gc);
    lua_pushvalue(L, 3);
    lua_call(L, 1, 0);
    return 1;
}

void l_compare_register(lua_State *L)
{
    if (luaL_newmetatable(L, COMPARE_BOX_MT)) {
        lua_pushcfunction(L, box_gc);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, box_gc);
        lua_setfield(L, -2, "__close");
    }
    lua_pop(L, 1);
    lua_pushcfunction(L, l_compare);
    lua_setfield(L, -2, "compare");
}
