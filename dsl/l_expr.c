/* l_expr.c: symbolic expressions from Lua (SPEC.md section 4). An Expr
 * userdata holds one reference to an mn_expr; Lua operators build new ones,
 * so a loss written as `function(y, v, r) return mnemo.abs(r)^1.5 end` yields
 * the same IR as the string "abs(r)^1.5". The math functions of the module
 * (mnemo.abs, mnemo.max, ...) are wrapped so that they build expressions when
 * any argument is an Expr and keep their tensor/number meaning otherwise. */
#include "dsl.h"
#include "l_expr.h"

#include <stdlib.h>
#include <string.h>

#define EXPR_MT "mnemo.Expr"

static mn_expr **push_expr_slot(lua_State *L)
{
    mn_expr **slot = lua_newuserdatauv(L, sizeof *slot, 0);
    *slot = NULL;
    luaL_setmetatable(L, EXPR_MT);
    return slot;
}

void l_push_expr(lua_State *L, mn_expr *e)
{
    mn_expr **slot = push_expr_slot(L);
    if (!e) l_raise(L);
    *slot = e;
}

mn_expr *l_test_expr(lua_State *L, int idx)
{
    mn_expr **slot = luaL_testudata(L, idx, EXPR_MT);
    return slot ? *slot : NULL;
}

/* A new reference from an Expr, a number, or a string (parsed). */
mn_expr *l_to_expr(lua_State *L, int idx, const char *what)
{
    mn_expr *e = l_test_expr(L, idx);
    if (e) return mn_expr_ref(e);
    if (lua_type(L, idx) == LUA_TNUMBER) {
        e = mn_expr_num(lua_tonumber(L, idx));
        if (!e) l_raise(L);
        return e;
    }
    if (lua_type(L, idx) == LUA_TSTRING) {
        if (mn_expr_parse(lua_tostring(L, idx), &e) != MN_OK) l_raise(L);
        return e;
    }
    luaL_error(L, "%s: expected an expression, a number or a string, got %s", what, luaL_typename(L, idx));
    return NULL;
}

static int expr_gc(lua_State *L)
{
    mn_expr **slot = luaL_checkudata(L, 1, EXPR_MT);
    mn_expr_unref(*slot);
    *slot = NULL;
    return 0;
}

static int expr_tostring(lua_State *L)
{
    mn_expr *e = l_test_expr(L, 1);
    char *s = mn_expr_to_string(e);
    if (!s) return l_raise(L);
    lua_pushstring(L, s);
    free(s);
    return 1;
}

/* Binary operator with Expr or number on either side. */
static int binop(lua_State *L, mn_expr_kind kind, const char *what)
{
    /* The slot owns a while b is converted, so a raise there leaks nothing. */
    mn_expr **slot = push_expr_slot(L);
    if (!l_test_expr(L, 2) && lua_type(L, 2) != LUA_TNUMBER && lua_type(L, 2) != LUA_TSTRING)
        return luaL_error(L, "%s: expected an expression or a number, got %s", what, luaL_typename(L, 2));
    *slot = l_to_expr(L, 1, what);
    mn_expr *b = l_to_expr(L, 2, what);
    mn_expr *combined = mn_expr_binary(kind, *slot, b);
    *slot = combined;
    if (!combined || mn_expr_check_depth(combined) != MN_OK) return l_raise(L);
    return 1;
}

static int expr_add(lua_State *L) { return binop(L, MN_EX_ADD, "+"); }
static int expr_sub(lua_State *L) { return binop(L, MN_EX_SUB, "-"); }
static int expr_mul(lua_State *L) { return binop(L, MN_EX_MUL, "*"); }
static int expr_div(lua_State *L) { return binop(L, MN_EX_DIV, "/"); }
static int expr_pow(lua_State *L) { return binop(L, MN_EX_POW, "^"); }
static int expr_lt(lua_State *L) { return binop(L, MN_EX_LT, "lt"); }
static int expr_le(lua_State *L) { return binop(L, MN_EX_LE, "le"); }
static int expr_gt(lua_State *L) { return binop(L, MN_EX_GT, "gt"); }
static int expr_ge(lua_State *L) { return binop(L, MN_EX_GE, "ge"); }

static int expr_unm(lua_State *L)
{
    mn_expr **slot = push_expr_slot(L);
    *slot = mn_expr_unary(MN_EX_NEG, l_to_expr(L, 1, "-"));
    if (!*slot || mn_expr_check_depth(*slot) != MN_OK) return l_raise(L);
    return 1;
}

static int expr_diff(lua_State *L)
{
    mn_expr *e = luaL_checkudata(L, 1, EXPR_MT) ? l_test_expr(L, 1) : NULL;
    const char *var = luaL_checkstring(L, 2);
    l_push_expr(L, mn_expr_diff(e, var));
    return 1;
}

static int expr_simplify(lua_State *L)
{
    mn_expr *e = luaL_checkudata(L, 1, EXPR_MT) ? l_test_expr(L, 1) : NULL;
    l_push_expr(L, mn_expr_simplify(e));
    return 1;
}

/* e:eval{y = 1, v = 2}: every name from the table. */
static int expr_eval(lua_State *L)
{
    mn_expr *e = luaL_checkudata(L, 1, EXPR_MT) ? l_test_expr(L, 1) : NULL;
    luaL_checktype(L, 2, LUA_TTABLE);
    const char *names[64];
    double values[64];
    int n = 0;
    lua_pushnil(L);
    while (lua_next(L, 2) && n < 64) {
        if (lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TNUMBER) {
            names[n] = lua_tostring(L, -2);
            values[n++] = lua_tonumber(L, -1);
        }
        lua_pop(L, 1);
    }
    if (mn_expr_check_names(e, names, n, NULL, 0) != MN_OK) return l_raise(L);
    lua_pushnumber(L, mn_expr_eval(e, names, values, n, NULL, NULL, 0));
    return 1;
}

/* e:c{"y", "v"}: the C source of the expression in double precision. */
static int expr_csource(lua_State *L)
{
    mn_expr *e = luaL_checkudata(L, 1, EXPR_MT) ? l_test_expr(L, 1) : NULL;
    const char *vars[16];
    int n = 0;
    if (!lua_istable(L, 2)) {
        /* default: every expression variable the expression uses */
        static const char *const known[] = {"y", "v", "r", "z", "g", "n"};
        for (size_t i = 0; i < sizeof known / sizeof *known; i++)
            if (mn_expr_uses(e, known[i])) vars[n++] = known[i];
    } else
        for (n = 0; n < 16; n++) {
            if (lua_geti(L, 2, n + 1) != LUA_TSTRING) {
                lua_pop(L, 1);
                break;
            }
            vars[n] = lua_tostring(L, -1);
            lua_pop(L, 1);
        }
    char *src = mn_expr_to_c(e, vars, vars, n, NULL, NULL, 0, lua_toboolean(L, 3));
    if (!src) return l_raise(L);
    lua_pushstring(L, src);
    free(src);
    return 1;
}

/* mnemo.expr("abs(r)^1.5") or mnemo.expr(number) */
static int l_expr_new(lua_State *L)
{
    mn_expr **slot = push_expr_slot(L);
    *slot = l_to_expr(L, 1, "mnemo.expr");
    return 1;
}

/* mnemo.var("y") */
static int l_expr_var(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    l_push_expr(L, mn_expr_var(name));
    return 1;
}

static bool any_expr(lua_State *L, int n)
{
    for (int i = 1; i <= n; i++)
        if (l_test_expr(L, i)) return true;
    return false;
}

/* Wrapped module function: upvalue 1 = function id, upvalue 2 = the original
 * (tensor/number) function or nil. */
static int expr_func_dispatch(lua_State *L)
{
    mn_expr_func f = (mn_expr_func)lua_tointeger(L, lua_upvalueindex(1));
    int arity = mn_expr_func_arity(f);
    int nargs = lua_gettop(L);
    if (!any_expr(L, nargs)) {
        if (lua_isnil(L, lua_upvalueindex(2)))
            return luaL_error(L, "%s: expected expressions (mnemo.var or rule arguments)", mn_expr_func_name(f));
        lua_pushvalue(L, lua_upvalueindex(2));
        lua_insert(L, 1);
        lua_call(L, nargs, LUA_MULTRET);
        return lua_gettop(L);
    }
    if (nargs != arity)
        return luaL_error(L, "%s: takes %d argument%s, got %d", mn_expr_func_name(f), arity, arity == 1 ? "" : "s", nargs);
    /* Only Exprs and numbers here, so converting them cannot raise midway. */
    for (int i = 1; i <= arity; i++)
        if (!l_test_expr(L, i) && lua_type(L, i) != LUA_TNUMBER)
            return luaL_error(L, "%s: bad argument #%d (expected an expression or a number, got %s)",
                              mn_expr_func_name(f), i, luaL_typename(L, i));
    mn_expr **slot = push_expr_slot(L);
    mn_expr *args[3] = {NULL, NULL, NULL};
    for (int i = 0; i < arity; i++) args[i] = l_to_expr(L, i + 1, mn_expr_func_name(f));
    *slot = mn_expr_call(f, arity, args);
    if (!*slot || mn_expr_check_depth(*slot) != MN_OK) return l_raise(L);
    return 1;
}

/* Comparisons as module functions: mnemo.lt(a, b) etc. */
static int wrap_compare(lua_State *L, mn_expr_kind kind, const char *name)
{
    if (!any_expr(L, 2)) {
        lua_pushvalue(L, lua_upvalueindex(1));
        if (lua_isnil(L, -1)) return luaL_error(L, "%s: expected expressions or tensors", name);
        lua_insert(L, 1);
        lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
        return lua_gettop(L);
    }
    return binop(L, kind, name);
}
static int wrap_lt(lua_State *L) { return wrap_compare(L, MN_EX_LT, "lt"); }
static int wrap_le(lua_State *L) { return wrap_compare(L, MN_EX_LE, "le"); }
static int wrap_gt(lua_State *L) { return wrap_compare(L, MN_EX_GT, "gt"); }
static int wrap_ge(lua_State *L) { return wrap_compare(L, MN_EX_GE, "ge"); }

void l_expr_register(lua_State *L)
{
    static const luaL_Reg meta[] = {
        {"__gc", expr_gc}, {"__tostring", expr_tostring}, {"__add", expr_add}, {"__sub", expr_sub},
        {"__mul", expr_mul}, {"__div", expr_div}, {"__pow", expr_pow}, {"__unm", expr_unm}, {NULL, NULL}};
    static const luaL_Reg methods[] = {
        {"diff", expr_diff}, {"simplify", expr_simplify}, {"eval", expr_eval}, {"c", expr_csource},
        {"lt", expr_lt}, {"le", expr_le}, {"gt", expr_gt}, {"ge", expr_ge}, {NULL, NULL}};
    int module = lua_gettop(L);
    luaL_newmetatable(L, EXPR_MT);
    luaL_setfuncs(L, meta, 0);
    luaL_newlib(L, methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, module, "Expr");
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "__index");
    lua_setfield(L, -2, "__methods");
    lua_pop(L, 1);

    lua_pushcfunction(L, l_expr_new);
    lua_setfield(L, module, "expr");
    lua_pushcfunction(L, l_expr_var);
    lua_setfield(L, module, "var");
    /* Wrap every expression function of the module; mnemo.min/max keep their
     * reduction meaning for tensors and become min(a, b) for expressions. */
    for (int f = 0; f < MN_FN_COUNT; f++) {
        const char *name = mn_expr_func_name((mn_expr_func)f);
        if (!name || name[0] == '_') continue;
        lua_pushinteger(L, f);
        lua_getfield(L, module, name);
        lua_pushcclosure(L, expr_func_dispatch, 2);
        lua_setfield(L, module, name);
    }
    static const struct { const char *name; lua_CFunction fn; } cmp[] = {
        {"lt", wrap_lt}, {"le", wrap_le}, {"gt", wrap_gt}, {"ge", wrap_ge}};
    for (size_t i = 0; i < sizeof cmp / sizeof *cmp; i++) {
        lua_getfield(L, module, cmp[i].name);
        lua_pushcclosure(L, cmp[i].fn, 1);
        lua_setfield(L, module, cmp[i].name);
    }
}
