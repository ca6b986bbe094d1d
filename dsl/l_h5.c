/* l_h5.c: HDF5 from Lua: mnemo.save(path, tbl) and mnemo.load(path), and the
 * tree <-> table helpers of dsl.h (l_table_to_tree, l_push_tree).
 *
 * Tables map to trees (model/tree.h) and trees to files (model/h5.c):
 * tensors are datasets; numbers (integer or float, by math.type), strings and
 * booleans (as integers 0/1) are attributes of the enclosing group; nested
 * tables are groups. Keys must be strings; they are written in sorted order,
 * so that the same table always gives the same file. Loading gives back
 * nested tables of tensors, numbers and strings (a group's attribute and a
 * dataset of the same name: the dataset wins).
 *
 * A tree under construction lives in a "tree box" userdata on the Lua stack,
 * so that a Lua error at any point (a bad key, out of memory) leaves it to
 * the garbage collector instead of leaking it. */
#include "dsl.h"
#include "../model/h5.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define TREE_BOX_MT "mnemo.TreeBox"

typedef struct {
    mn_node *node;
} tree_box;

static int box_release(lua_State *L)
{
    tree_box *b = luaL_checkudata(L, 1, TREE_BOX_MT);
    if (b->node) {
        mn_node_free(b->node);
        b->node = NULL;
    }
    return 0;
}

/* Pushes an empty box; the caller puts a tree in it. */
static tree_box *push_box(lua_State *L)
{
    tree_box *b = lua_newuserdatauv(L, sizeof *b, 0);
    b->node = NULL;
    if (luaL_newmetatable(L, TREE_BOX_MT)) {
        lua_pushcfunction(L, box_release);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, box_release);
        lua_setfield(L, -2, "__close");
    }
    lua_setmetatable(L, -2);
    return b;
}

/* ------------------------------------------------------------ table -> tree */

typedef struct {
    lua_State *L;
    const char *who;  /* "mnemo.save: " prefix of messages, or "" */
    int visiting;     /* stack index of {table = path} for the tables being converted */
    int depth;         /* tables entered: bounded like the loader's groups */
} conv;

static int conv_error(conv *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    lua_pushstring(c->L, c->who);
    lua_pushvfstring(c->L, fmt, ap);
    va_end(ap);
    lua_concat(c->L, 2);
    return lua_error(c->L);
}

/* "the top-level table" or "table 'rule.inputs'" (pushed). */
static const char *table_label(lua_State *L, const char *path)
{
    if (!path[0]) return lua_pushliteral(L, "the top-level table");
    return lua_pushfstring(L, "table '%s'", path);
}

/* A non-string key for messages: [1], [2.5], [true], [table] (pushed). */
static const char *key_label(lua_State *L, int idx)
{
    int t = lua_type(L, idx);
    if (t == LUA_TNUMBER || t == LUA_TBOOLEAN) {
        luaL_tolstring(L, idx, NULL);
        const char *s = lua_pushfstring(L, "[%s]", lua_tostring(L, -1));
        lua_remove(L, -2);
        return s;
    }
    return lua_pushfstring(L, "[%s]", luaL_typename(L, idx));
}

static int cmp_keys(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void add_or_raise(conv *c, mn_node *added)
{
    if (!added) conv_error(c, "%s", mn_last_error());
}

/* Converts the table at tidx into children of g; path is its key path ("" at
 * the top). */
static void table_to_group(conv *c, int tidx, mn_node *g, const char *path)
{
    lua_State *L = c->L;
    luaL_checkstack(L, 8, "tables nested too deeply");

    /* cycle check: visiting[t] holds the path where t was entered */
    lua_pushvalue(L, tidx);
    if (lua_rawget(L, c->visiting) == LUA_TSTRING) {
        const char *first = lua_tostring(L, -1);
        const char *here = table_label(L, path);
        if (first[0]) conv_error(c, "%s contains itself (a cycle back to table '%s')", here, first);
        conv_error(c, "%s contains itself (a cycle back to the top-level table)", here);
    }
    lua_pop(L, 1);
    lua_pushvalue(L, tidx);
    lua_pushstring(L, path);
    lua_rawset(L, c->visiting);

    /* the keys, checked, then sorted: a userdata array the GC owns */
    size_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, tidx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING) {
            const char *k = key_label(L, -1);
            conv_error(c, "key %s in %s is not a string", k, table_label(L, path));
        }
        size_t klen;
        const char *key = lua_tolstring(L, -1, &klen);
        if (!key[0] || strchr(key, '/') || strlen(key) != klen)
            conv_error(c, "key '%s' in %s is not a valid name (empty, or contains '/' or a zero byte)",
                       key, table_label(L, path));
        n++;
    }
    const char **keys = lua_newuserdatauv(L, (n ? n : 1) * sizeof *keys, 0);
    int keys_idx = lua_gettop(L);
    size_t i = 0;
    lua_pushnil(L);
    while (lua_next(L, tidx)) {
        lua_pop(L, 1);
        if (i < n) keys[i++] = lua_tostring(L, -1); /* anchored: a key of the table */
    }
    n = i;
    qsort(keys, n, sizeof *keys, cmp_keys);

    for (i = 0; i < n; i++) {
        const char *key = keys[i];
        const char *kpath = path[0] ? lua_pushfstring(L, "%s.%s", path, key)
                                    : lua_pushstring(L, key);
        int kpath_idx = lua_gettop(L);

        lua_pushstring(L, key);
        lua_rawget(L, tidx);
        int v = lua_gettop(L);
        switch (lua_type(L, v)) {
        case LUA_TNUMBER:
            if (lua_isinteger(L, v)) add_or_raise(c, mn_node_add_integer(g, key, lua_tointeger(L, v)));
            else add_or_raise(c, mn_node_add_number(g, key, lua_tonumber(L, v)));
            break;
        case LUA_TBOOLEAN:
            add_or_raise(c, mn_node_add_integer(g, key, lua_toboolean(L, v) ? 1 : 0));
            break;
        case LUA_TSTRING: {
            size_t slen;
            const char *s = lua_tolstring(L, v, &slen);
            if (strlen(s) != slen)
                conv_error(c, "string at '%s' contains a zero byte", kpath);
            add_or_raise(c, mn_node_add_string(g, key, s));
            break;
        }
        case LUA_TTABLE: {
            mn_node *sub = mn_node_add_group(g, key);
            add_or_raise(c, sub);
            /* The loader refuses groups nested deeper (and the C stack would
             * not hold a recursion as deep as a Lua table can nest). */
            if (++c->depth > MN_H5_MAX_DEPTH)
                conv_error(c, "tables nest more than %d deep at '%s'", MN_H5_MAX_DEPTH, kpath);
            table_to_group(c, v, sub, lua_tostring(L, kpath_idx));
            c->depth--;
            break;
        }
        case LUA_TUSERDATA: {
            mn_tensor *t = l_test_tensor(L, v);
            if (!t) conv_error(c, "value at '%s' is a userdata that is not a tensor", kpath);
            if (!t->storage) conv_error(c, "value at '%s' is a closed tensor", kpath);
            add_or_raise(c, mn_node_add_tensor(g, key, t));
            break;
        }
        default:
            conv_error(c, "value at '%s' is a %s (tensors, numbers, strings, booleans and tables "
                          "can be saved)", kpath, luaL_typename(L, v));
        }
        lua_settop(L, keys_idx);
    }
    lua_settop(L, keys_idx - 1);

    lua_pushvalue(L, tidx);
    lua_pushnil(L);
    lua_rawset(L, c->visiting);
}

/* Leaves a box holding the tree on the stack top (raises on error; then the
 * box, unreachable, is freed by the GC). */
static tree_box *build_tree(lua_State *L, int idx, const char *root_name, const char *who)
{
    idx = lua_absindex(L, idx);
    luaL_checktype(L, idx, LUA_TTABLE);
    tree_box *b = push_box(L);
    int box_idx = lua_gettop(L);
    if (!(b->node = mn_node_group(root_name ? root_name : "/"))) l_raise(L);
    lua_newtable(L);
    conv c = {L, who, lua_gettop(L), 0};
    table_to_group(&c, idx, b->node, "");
    lua_settop(L, box_idx);
    return b;
}

mn_node *l_table_to_tree(lua_State *L, int idx, const char *root_name)
{
    tree_box *b = build_tree(L, idx, root_name, "");
    mn_node *n = b->node;
    b->node = NULL;
    lua_pop(L, 1);
    return n;
}

/* ------------------------------------------------------------ tree -> table */

static void push_node(lua_State *L, const mn_node *n)
{
    switch (n->kind) {
    case MN_NODE_GROUP:
        l_push_tree(L, n);
        break;
    case MN_NODE_TENSOR:
        if (n->tensor.storage) mn_tensor_share(l_push_empty_tensor(L), &n->tensor);
        else lua_pushnil(L);
        break;
    case MN_NODE_NUMBER:
        lua_pushnumber(L, n->number);
        break;
    case MN_NODE_INTEGER:
        lua_pushinteger(L, (lua_Integer)n->integer);
        break;
    case MN_NODE_STRING:
        lua_pushstring(L, n->string ? n->string : "");
        break;
    default:
        lua_pushnil(L);
    }
}

void l_push_tree(lua_State *L, const mn_node *g)
{
    luaL_checkstack(L, 4, "tree nested too deeply");
    if (g->kind != MN_NODE_GROUP) {
        push_node(L, g);
        return;
    }
    lua_createtable(L, 0, g->nchildren);
    for (int i = 0; i < g->nchildren; i++) {
        const mn_node *c = g->children[i];
        /* Attributes come before datasets in a loaded group: a dataset
         * wins over an attribute of the same name. */
        push_node(L, c);
        lua_setfield(L, -2, c->name);
    }
}

/* ------------------------------------------------------------ mnemo.save/load */

/* mnemo.save(path, tbl) */
static int l_save(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    tree_box *b = build_tree(L, 2, "/", "mnemo.save: ");
    mn_status st = mn_h5_save(path, b->node);
    mn_node_free(b->node); /* now, not at the next collection: it holds tensor references */
    b->node = NULL;
    if (st != MN_OK) return l_raise(L);
    return 0;
}

/* mnemo.load(path) -> table */
static int l_load(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    tree_box *b = push_box(L);
    if (mn_h5_load(path, &b->node) != MN_OK) return l_raise(L);
    l_push_tree(L, b->node);
    mn_node_free(b->node);
    b->node = NULL;
    return 1;
}

void l_h5_register(lua_State *L)
{
    static const luaL_Reg fns[] = {
        {"save", l_save},
        {"load", l_load},
        {NULL, NULL},
    };
    luaL_setfuncs(L, fns, 0);
}
