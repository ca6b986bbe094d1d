/* l_tensor.c: the Lua face of tensors: the mnemo.Tensor userdata (push,
 * check, __gc/__close, __index/__newindex, fields), the argument parsers and
 * error helpers that l_tensor_ops.c shares (l_tensor_internal.h), tensors
 * from Lua numbers and nested tables, the constructors (mnemo.zeros, ...),
 * and l_tensor_register, which also registers what l_tensor_ops.c defines.
 * Lua sees 1-based indices and dims, as Lua and torch7 do; negative ones count
 * from the end (-1 is the last). Ranges in indexing and t:slice include their
 * stop (torch7); arange's stop is exclusive (numpy, torch).
 * Every tensor userdata owns one storage reference, released by __gc or
 * __close. The userdata is pushed before anything is allocated into it, so a
 * Lua error at any point leaves nothing unowned. */
#include "l_tensor_internal.h"
#include "../model/ops.h"
#include "../model/random.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Defined in l_tensor_print.c: pushes the text of t (torch7 style). */
void l_tensor_push_string(lua_State *L, const mn_tensor *t);

/* Registry key of the weak-keyed table of every tensor userdata (for who()). */
static const char live_key = 0;

/* ---------------------------------------------------------------- errors */

int l_argfail(lua_State *L, fname_t f, int idx, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (f.base && idx == 1) return luaL_error(L, "%s: bad self (%s)", f.name, msg);
    return luaL_error(L, "%s: bad argument #%d (%s)", f.name, idx - f.base, msg);
}

/* luaL_error with printf's formats (lua_pushfstring has no %lld). */
int l_failf(lua_State *L, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return luaL_error(L, "%s", msg);
}

/* The engine's message, prefixed with the function name unless it has it. */
int l_raise_in(lua_State *L, const char *fn)
{
    const char *msg = mn_last_error();
    size_t n = strlen(fn);
    if (strncmp(msg, fn, n) == 0 && msg[n] == ':') return luaL_error(L, "%s", msg);
    return luaL_error(L, "%s: %s", fn, msg);
}

int l_raise(lua_State *L)
{
    lua_pushstring(L, mn_last_error());
    return lua_error(L);
}

/* "got -1", "got 2.5", "got string" for messages; the string lives on the stack. */
const char *l_got(lua_State *L, int idx)
{
    if (lua_type(L, idx) == LUA_TNUMBER) return lua_pushfstring(L, "got %s", luaL_tolstring(L, idx, NULL));
    return lua_pushfstring(L, "got %s", luaL_typename(L, idx));
}

/* ---------------------------------------------------------------- userdata */

mn_tensor *l_push_empty_tensor(lua_State *L)
{
    mn_tensor *t = lua_newuserdatauv(L, sizeof(mn_tensor), 0);
    memset(t, 0, sizeof *t);
    luaL_setmetatable(L, MN_TENSOR_MT);
    if (lua_rawgetp(L, LUA_REGISTRYINDEX, &live_key) == LUA_TTABLE) {
        lua_pushvalue(L, -2);
        lua_pushboolean(L, 1);
        lua_rawset(L, -3);
    }
    lua_pop(L, 1);
    return t;
}

mn_tensor *l_test_tensor(lua_State *L, int idx)
{
    return luaL_testudata(L, idx, MN_TENSOR_MT);
}

mn_tensor *l_check_tensor(lua_State *L, int idx)
{
    mn_tensor *t = luaL_checkudata(L, idx, MN_TENSOR_MT);
    if (!t->storage) luaL_argerror(L, idx, "tensor was closed");
    return t;
}

mn_tensor *l_self_tensor(lua_State *L, fname_t f)
{
    mn_tensor *t = l_test_tensor(L, 1);
    if (!t) l_argfail(L, f, 1, "tensor expected, %s", l_got(L, 1));
    if (!t->storage) l_argfail(L, f, 1, "tensor was closed");
    return t;
}

/* ---------------------------------------------------------------- arguments */

int64_t l_check_int(lua_State *L, fname_t f, int idx, const char *what)
{
    int isnum = 0;
    lua_Integer v = 0;
    if (lua_type(L, idx) == LUA_TNUMBER) v = lua_tointegerx(L, idx, &isnum);
    if (!isnum) l_argfail(L, f, idx, "%s must be an integer, %s", what, l_got(L, idx));
    return (int64_t)v;
}

double l_check_num(lua_State *L, fname_t f, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TNUMBER) l_argfail(L, f, idx, "%s must be a number, %s", what, l_got(L, idx));
    return lua_tonumber(L, idx);
}

/* A 1-based or negative dim at idx, resolved to 0-based against ndim + extra
 * positions (extra 1: unsqueeze and stack may name the position after the last). */
int l_resolve_dim(lua_State *L, fname_t f, int idx, int64_t d, int ndim, int extra)
{
    int n = ndim + extra;
    if (d >= 1 && d <= n) return (int)d - 1;
    if (d <= -1 && d >= -n) return n + (int)d;
    if (n == 0) l_argfail(L, f, idx, "dim %lld out of range: the tensor is 0-d", (long long)d);
    l_argfail(L, f, idx, "dim %lld out of range for a %d-d tensor (expected 1..%d or -%d..-1)",
            (long long)d, ndim, n, n);
    return 0;
}

int l_check_dim(lua_State *L, fname_t f, int idx, int ndim, int extra)
{
    return l_resolve_dim(L, f, idx, l_check_int(L, f, idx, "dim"), ndim, extra);
}

/* A 1-based or negative index into a dim of the given size -> 0-based.
 * idx > 0: the index came from argument idx; else from an indexing key. */
int64_t l_resolve_index(lua_State *L, fname_t f, int idx, int64_t i, int dim, int64_t size)
{
    if (i >= 1 && i <= size) return i - 1;
    if (i <= -1 && i >= -size) return size + i;
    if (idx > 0)
        l_argfail(L, f, idx, "index %lld out of range for dim %d of size %lld", (long long)i, dim + 1,
                (long long)size);
    l_failf(L, "%s: index %lld out of range for dim %d of size %lld", f.name, (long long)i,
               dim + 1, (long long)size);
    return 0;
}

static mn_dtype dtype_name(const char *s, bool *ok)
{
    *ok = true;
    if (!strcmp(s, "f32")) return MN_F32;
    if (!strcmp(s, "f64")) return MN_F64;
    if (!strcmp(s, "i64")) return MN_I64;
    *ok = false;
    return MN_F32;
}

static bool device_name(const char *s, mn_device *dev)
{
    if (!strcmp(s, "cpu")) { *dev = MN_CPU; return true; }
    if (!strcmp(s, "cuda")) { *dev = MN_CUDA; return true; }
    return false;
}

/* A dtype or device name at idx (a string), into *dt or *dev. */
void l_parse_type_string(lua_State *L, fname_t f, int idx, mn_dtype *dt, mn_device *dev)
{
    const char *s = lua_tostring(L, idx);
    bool ok;
    mn_dtype d = dtype_name(s, &ok);
    if (ok) { *dt = d; return; }
    if (device_name(s, dev)) return;
    l_argfail(L, f, idx, "unknown dtype or device '%s' (expected f32, f64, i64, cpu or cuda)", s);
}

static bool is_options_table(lua_State *L, int idx, int top)
{
    if (!lua_istable(L, idx) || lua_rawlen(L, idx) != 0) return false;
    if (idx > 1 || top > 1) return true;
    bool has = lua_getfield(L, idx, "dtype") != LUA_TNIL;
    has = (lua_getfield(L, idx, "device") != LUA_TNIL) || has;
    lua_pop(L, 2);
    return has;
}

/* A trailing dtype string ("f32", "f64", "i64"), device string, or options
 * table {dtype=, device=} at top: parsed and dropped. Returns the new top. */
int l_parse_options(lua_State *L, fname_t f, int top, mn_dtype *dt, mn_device *dev)
{
    if (top < 1) return top;
    if (lua_type(L, top) == LUA_TSTRING) {
        l_parse_type_string(L, f, top, dt, dev);
        return top - 1;
    }
    if (!is_options_table(L, top, top)) return top;
    lua_pushnil(L);
    while (lua_next(L, top)) {
        const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
        if (!strcmp(k, "dtype") || !strcmp(k, "device")) {
            const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            bool ok = false;
            if (s && k[1] == 't') *dt = dtype_name(s, &ok);
            else if (s) ok = device_name(s, dev);
            if (!ok)
                l_argfail(L, f, top, "unknown %s '%s' (expected %s)", k, s ? s : luaL_typename(L, -1),
                        k[1] == 't' ? "f32, f64 or i64" : "cpu or cuda");
        } else {
            l_argfail(L, f, top, "unknown option '%s' (expected dtype or device)", k);
        }
        lua_pop(L, 1);
    }
    return top - 1;
}

/* Sizes from arguments first..last: integers, or one table of integers.
 * allow: -1 (one inferred size, view/reshape; keep a size, expand). */
int l_parse_sizes(lua_State *L, fname_t f, int first, int last, int64_t *shape, bool allow_m1)
{
    int n = 0;
    const char *need = allow_m1 ? "a non-negative integer or -1" : "a non-negative integer";
    if (first == last && lua_istable(L, first)) {
        lua_Integer len = (lua_Integer)lua_rawlen(L, first);
        if (len > MN_MAX_DIMS) l_argfail(L, f, first, "%lld sizes: at most %d dims", (long long)len, MN_MAX_DIMS);
        for (lua_Integer i = 1; i <= len; i++) {
            lua_geti(L, first, i);
            int isnum = 0;
            lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isnum) : 0;
            if (!isnum || v < (allow_m1 ? -1 : 0))
                l_argfail(L, f, first, "size [%lld] must be %s, %s", (long long)i, need, l_got(L, -1));
            shape[n++] = v;
            lua_pop(L, 1);
        }
        return n;
    }
    if (last - first + 1 > MN_MAX_DIMS)
        l_argfail(L, f, first, "%d sizes: at most %d dims", last - first + 1, MN_MAX_DIMS);
    for (int i = first; i <= last; i++) {
        int isnum = 0;
        lua_Integer v = lua_type(L, i) == LUA_TNUMBER ? lua_tointegerx(L, i, &isnum) : 0;
        if (!isnum || v < (allow_m1 ? -1 : 0)) l_argfail(L, f, i, "size must be %s, %s", need, l_got(L, i));
        shape[n++] = v;
    }
    return n;
}

/* ---------------------------------------------------------------- tables -> tensors */

static void path_string(char *buf, size_t len, const int64_t *pos, int depth)
{
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < depth && used < len; i++)
        used += snprintf(buf + used, len - used, "[%lld]", (long long)pos[i] + 1);
}

/* Fill dst (contiguous CPU) from the nested table at the top of the stack. */
static void fill_from_table(lua_State *L, fname_t f, int argi, mn_tensor *dst, int depth,
                            int64_t *pos, int64_t *flat)
{
    char path[160];
    int64_t n = dst->shape[depth];
    if ((int64_t)lua_rawlen(L, -1) != n) {
        path_string(path, sizeof path, pos, depth);
        l_argfail(L, f, argi, "ragged nested table: %s%s has %lld entries, expected %lld (depth %d)",
                depth ? "element " : "the table", path, (long long)lua_rawlen(L, -1), (long long)n,
                depth + 1);
    }
    luaL_checkstack(L, 4, "nested table");
    for (int64_t i = 0; i < n; i++) {
        pos[depth] = i;
        int ty = lua_geti(L, -1, i + 1);
        if (depth + 1 < dst->ndim) {
            if (ty != LUA_TTABLE) {
                path_string(path, sizeof path, pos, depth + 1);
                l_argfail(L, f, argi, "ragged nested table: element %s is a %s, expected a table (depth %d)",
                        path, lua_typename(L, ty), depth + 2);
            }
            fill_from_table(L, f, argi, dst, depth + 1, pos, flat);
        } else {
            if (ty != LUA_TNUMBER) {
                path_string(path, sizeof path, pos, depth + 1);
                l_argfail(L, f, argi, "%s element %s is a %s, expected a number",
                        ty == LUA_TTABLE ? "ragged nested table:" : "nested table:", path,
                        lua_typename(L, ty));
            }
            char *base = (char *)mn_tensor_data(dst);
            int64_t k = (*flat)++;
            switch (dst->dtype) {
            case MN_F32: ((float *)base)[k] = (float)lua_tonumber(L, -1); break;
            case MN_F64: ((double *)base)[k] = lua_tonumber(L, -1); break;
            case MN_I64:
                ((int64_t *)base)[k] = lua_isinteger(L, -1) ? (int64_t)lua_tointeger(L, -1)
                                                            : mn_to_i64(lua_tonumber(L, -1));
                break;
            }
        }
        lua_pop(L, 1);
    }
}

/* A new tensor from the number or nested table at idx, pushed and returned. */
mn_tensor *l_value_to_tensor(lua_State *L, fname_t f, int idx, mn_dtype dt, mn_device dev)
{
    int64_t shape[MN_MAX_DIMS];
    int ndim = 0;
    if (lua_type(L, idx) == LUA_TNUMBER) {
        mn_tensor *t = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_tensor_full(t, dt, 0, shape, lua_tonumber(L, idx), dev));
        if (dt == MN_I64 && lua_isinteger(L, idx) && dev == MN_CPU)
            *(int64_t *)mn_tensor_data(t) = (int64_t)lua_tointeger(L, idx);
        return t;
    }
    if (!lua_istable(L, idx)) l_argfail(L, f, idx, "expected a number or nested table, %s", l_got(L, idx));
    /* The shape comes from the first entry at each depth; fill checks the rest. */
    int saved = lua_gettop(L);
    lua_pushvalue(L, idx);
    while (lua_istable(L, -1)) {
        if (ndim == MN_MAX_DIMS) l_argfail(L, f, idx, "nested table deeper than %d", MN_MAX_DIMS);
        shape[ndim++] = (int64_t)lua_rawlen(L, -1);
        if (shape[ndim - 1] == 0) break;
        luaL_checkstack(L, 2, "nested table");
        lua_geti(L, -1, 1);
    }
    lua_settop(L, saved);
    mn_tensor *t = l_push_empty_tensor(L);
    int tpos = lua_gettop(L);
    TRY_IN(L, f.name, mn_tensor_empty(t, dt, ndim, shape, MN_CPU));
    int64_t pos[MN_MAX_DIMS], flat = 0;
    lua_pushvalue(L, idx);
    fill_from_table(L, f, idx, t, 0, pos, &flat);
    lua_pop(L, 1);
    if (dev != MN_CPU) {
        mn_tensor *d = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_tensor_to_device(d, t, dev));
        lua_replace(L, tpos);
        return d;
    }
    return t;
}

mn_tensor *l_to_tensor(lua_State *L, int idx)
{
    idx = lua_absindex(L, idx);
    mn_tensor *t = l_test_tensor(L, idx);
    if (t) {
        if (!t->storage) luaL_argerror(L, idx, "tensor was closed");
        lua_pushvalue(L, idx);
        return t;
    }
    int ty = lua_type(L, idx);
    if (ty != LUA_TNUMBER && ty != LUA_TTABLE) luaL_typeerror(L, idx, "tensor, number or table");
    return l_value_to_tensor(L, FN("tensor"), idx, MN_F32, MN_CPU);
}

/* A tensor argument, or a number / nested table made into one (pushed). */
mn_tensor *l_arg_tensor(lua_State *L, fname_t f, int idx)
{
    mn_tensor *t = l_test_tensor(L, idx);
    if (t) {
        if (!t->storage) l_argfail(L, f, idx, "tensor was closed");
        return t;
    }
    int ty = lua_type(L, idx);
    if (ty == LUA_TNUMBER || ty == LUA_TTABLE) return l_value_to_tensor(L, f, idx, MN_F32, MN_CPU);
    l_argfail(L, f, idx, "expected a tensor, number or table, %s", l_got(L, idx));
    return NULL;
}

/* t itself when on the CPU, else a CPU copy (pushed). */
const mn_tensor *l_on_host(lua_State *L, const char *fn, const mn_tensor *t)
{
    if (device_of(t) == MN_CPU) return t;
    mn_tensor *h = l_push_empty_tensor(L);
    TRY_IN(L, fn, mn_tensor_to_device(h, t, MN_CPU));
    return h;
}

void l_push_element(lua_State *L, const mn_tensor *t, const int64_t *index)
{
    int64_t off = mn_tensor_offset_of(t, index);
    const char *base = (const char *)t->storage->data;
    switch (t->dtype) {
    case MN_F32: lua_pushnumber(L, ((const float *)base)[off]); break;
    case MN_F64: lua_pushnumber(L, ((const double *)base)[off]); break;
    case MN_I64: lua_pushinteger(L, (lua_Integer)((const int64_t *)base)[off]); break;
    }
}

/* ---------------------------------------------------------------- constructors */

static int push_created(lua_State *L, const char *fn, mn_tensor *t, mn_device dev)
{
    if (dev != MN_CPU) {
        mn_tensor *d = l_push_empty_tensor(L);
        TRY_IN(L, fn, mn_tensor_to_device(d, t, dev));
    }
    return 1;
}

static int fill_ctor(lua_State *L, const char *name, bool has_value, double value)
{
    fname_t f = FN(name);
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    if (has_value) {
        if (top < 1) l_argfail(L, f, 1, "expected sizes then a fill value");
        value = l_check_num(L, f, top, "fill value (the last argument)");
        top--;
    }
    int64_t shape[MN_MAX_DIMS];
    int nd = l_parse_sizes(L, f, 1, top, shape, false);
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_tensor_full(t, dt, nd, shape, value, dev));
    return 1;
}

static int l_zeros(lua_State *L) { return fill_ctor(L, "zeros", false, 0.0); }
static int l_ones(lua_State *L) { return fill_ctor(L, "ones", false, 1.0); }
static int l_full(lua_State *L) { return fill_ctor(L, "full", true, 0.0); }

static int random_ctor(lua_State *L, const char *name, bool normal)
{
    fname_t f = FN(name);
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    if (dt == MN_I64) l_argfail(L, f, top + 1, "needs a float dtype (f32 or f64); for integers use mnemo.randint");
    int64_t shape[MN_MAX_DIMS];
    int nd = l_parse_sizes(L, f, 1, top, shape, false);
    mn_tensor *t = l_push_empty_tensor(L);
    if (normal) TRY_IN(L, name, mn_tensor_randn(t, dt, nd, shape, 0.0, 1.0, mn_global_rng()));
    else TRY_IN(L, name, mn_tensor_rand(t, dt, nd, shape, 0.0, 1.0, mn_global_rng()));
    return push_created(L, name, t, dev);
}

/* mnemo.randint(lo, hi, d1, d2, ...): integers uniform in [lo, hi), i64. */
static int l_randint(lua_State *L)
{
    fname_t f = FN("randint");
    lua_Integer lo = luaL_checkinteger(L, 1), hi = luaL_checkinteger(L, 2);
    if (hi <= lo) l_argfail(L, f, 2, "hi must be greater than lo");
    mn_dtype dt = MN_I64;
    mn_device dev = MN_CPU;
    int top = l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    int64_t shape[MN_MAX_DIMS];
    int nd = l_parse_sizes(L, f, 3, top, shape, false);
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "randint", mn_tensor_rand(t, MN_I64, nd, shape, (double)lo, (double)hi, mn_global_rng()));
    return push_created(L, "randint", t, dev);
}

static int l_rand(lua_State *L) { return random_ctor(L, "rand", false); }
static int l_randn(lua_State *L) { return random_ctor(L, "randn", true); }

static int l_arange(lua_State *L)
{
    fname_t f = FN("arange");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    double start = 0, stop, step = 1;
    if (top == 1) stop = l_check_num(L, f, 1, "stop");
    else if (top == 2 || top == 3) {
        start = l_check_num(L, f, 1, "start");
        stop = l_check_num(L, f, 2, "stop");
        if (top == 3) step = l_check_num(L, f, 3, "step");
    } else return l_argfail(L, f, top < 1 ? 1 : 4, "expected arange(stop) or arange(start, stop [, step])");
    if (step == 0) l_argfail(L, f, 3, "step must not be 0");
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "arange", mn_tensor_arange(t, dt, start, stop, step));
    return push_created(L, "arange", t, dev);
}

static int l_linspace(lua_State *L)
{
    fname_t f = FN("linspace");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    double start = l_check_num(L, f, 1, "start"), stop = l_check_num(L, f, 2, "stop");
    int64_t n = l_check_int(L, f, 3, "the number of points");
    if (n < 0) l_argfail(L, f, 3, "the number of points must be >= 0, got %lld", (long long)n);
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "linspace", mn_tensor_linspace(t, dt, start, stop, n));
    return push_created(L, "linspace", t, dev);
}

static int l_eye(lua_State *L)
{
    fname_t f = FN("eye");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = l_parse_options(L, f, lua_gettop(L), &dt, &dev);
    int64_t n = l_check_int(L, f, 1, "n");
    int64_t m = top >= 2 ? l_check_int(L, f, 2, "m") : n;
    if (n < 0) l_argfail(L, f, 1, "n must be >= 0, got %lld", (long long)n);
    if (m < 0) l_argfail(L, f, 2, "m must be >= 0, got %lld", (long long)m);
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "eye", mn_tensor_eye(t, dt, n, m));
    return push_created(L, "eye", t, dev);
}

static int l_tensor_new(lua_State *L)
{
    fname_t f = FN("tensor");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = lua_gettop(L);
    if (top >= 2) top = l_parse_options(L, f, top, &dt, &dev);
    if (top != 1) l_argfail(L, f, top < 1 ? 1 : 2, "expected tensor(data [, dtype | {dtype=, device=}])");
    mn_tensor *src = l_test_tensor(L, 1);
    if (src) { /* a copy, as torch.tensor(t) */
        if (!src->storage) l_argfail(L, f, 1, "tensor was closed");
        mn_tensor *t = l_push_empty_tensor(L);
        /* to_dtype shares when the dtype already matches: clone instead */
        if (src->dtype == dt) TRY_IN(L, "tensor", mn_tensor_clone(t, src));
        else TRY_IN(L, "tensor", mn_tensor_to_dtype(t, src, dt));
        if (device_of(t) != dev) {
            mn_tensor *d = l_push_empty_tensor(L);
            TRY_IN(L, "tensor", mn_tensor_to_device(d, t, dev));
        }
        return 1;
    }
    l_value_to_tensor(L, f, 1, dt, dev);
    return 1;
}

/* ---------------------------------------------------------------- fields and sizes */

static void push_shape(lua_State *L, const mn_tensor *t, const int64_t *v)
{
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, (lua_Integer)v[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

static int m_size(lua_State *L)
{
    fname_t f = METHOD("size");
    mn_tensor *t = l_self_tensor(L, f);
    if (lua_isnoneornil(L, 2)) push_shape(L, t, t->shape);
    else lua_pushinteger(L, (lua_Integer)t->shape[l_check_dim(L, f, 2, t->ndim, 0)]);
    return 1;
}

static int m_stride(lua_State *L)
{
    fname_t f = METHOD("stride");
    mn_tensor *t = l_self_tensor(L, f);
    if (lua_isnoneornil(L, 2)) push_shape(L, t, t->stride);
    else lua_pushinteger(L, (lua_Integer)t->stride[l_check_dim(L, f, 2, t->ndim, 0)]);
    return 1;
}

static int m_dim(lua_State *L)
{
    lua_pushinteger(L, l_self_tensor(L, METHOD("dim"))->ndim);
    return 1;
}

static int m_numel(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)mn_tensor_numel(l_self_tensor(L, METHOD("numel"))));
    return 1;
}

static int m_is_contiguous(lua_State *L)
{
    lua_pushboolean(L, mn_tensor_is_contiguous(l_self_tensor(L, METHOD("is_contiguous"))));
    return 1;
}

/* ---------------------------------------------------------------- indexing */

static int m_index(lua_State *L)
{
    mn_tensor *t = luaL_checkudata(L, 1, MN_TENSOR_MT);
    int kt = lua_type(L, 2);
    if (kt == LUA_TSTRING) {
        const char *k = lua_tostring(L, 2);
        if (!strcmp(k, "shape")) { push_shape(L, t, t->shape); return 1; }
        if (!strcmp(k, "dtype")) { lua_pushstring(L, mn_dtype_name(t->dtype)); return 1; }
        if (!strcmp(k, "device")) { lua_pushstring(L, mn_device_name(device_of(t))); return 1; }
        if (!strcmp(k, "ndim")) { lua_pushinteger(L, t->ndim); return 1; }
        lua_pushvalue(L, 2);
        lua_rawget(L, lua_upvalueindex(1));
        return 1;
    }
    if (kt != LUA_TNUMBER && kt != LUA_TTABLE) return 0;
    if (!t->storage) return luaL_error(L, "index: tensor was closed");
    fname_t f = FN("index");
    mn_tensor *out = l_push_empty_tensor(L);
    l_index_view(L, f, t, 2, out);
    if (out->ndim == 0) { /* a single element reads as a Lua number */
        const mn_tensor *h = l_on_host(L, "index", out);
        int64_t none[MN_MAX_DIMS] = { 0 };
        l_push_element(L, h, none);
    }
    return 1;
}

/* t[key] = number | tensor | nested table: a broadcast copy into the view. */
static int m_newindex(lua_State *L)
{
    mn_tensor *t = luaL_checkudata(L, 1, MN_TENSOR_MT);
    int kt = lua_type(L, 2);
    if (kt != LUA_TNUMBER && kt != LUA_TTABLE) {
        if (kt == LUA_TSTRING)
            return luaL_error(L, "cannot set field '%s' of a tensor (tensors have no settable fields)",
                              lua_tostring(L, 2));
        return luaL_error(L, "index: a tensor is indexed by integers or tables, got %s", luaL_typename(L, 2));
    }
    if (!t->storage) return luaL_error(L, "index: tensor was closed");
    fname_t f = FN("index");
    int vt = lua_type(L, 3);
    mn_tensor *src = NULL;
    if (vt != LUA_TNUMBER) {
        src = l_test_tensor(L, 3);
        if (!src) {
            if (vt != LUA_TTABLE)
                return luaL_error(L, "index: value must be a number, tensor or table, got %s", luaL_typename(L, 3));
            src = l_value_to_tensor(L, f, 3, t->dtype, MN_CPU);
        } else if (!src->storage) return luaL_error(L, "index: value tensor was closed");
    }
    mn_tensor *view = l_push_empty_tensor(L);
    l_index_view(L, f, t, 2, view);
    if (src) TRY_IN(L, "index", mn_tensor_copy_into(view, src));
    else TRY_IN(L, "index", mn_tensor_fill(view, lua_tonumber(L, 3)));
    mn_tensor_release(view);
    return 0;
}

/* ---------------------------------------------------------------- metamethods */

static int m_gc(lua_State *L)
{
    mn_tensor *t = luaL_checkudata(L, 1, MN_TENSOR_MT);
    mn_tensor_release(t);
    return 0;
}

static int m_len(lua_State *L)
{
    mn_tensor *t = l_check_tensor(L, 1);
    if (t->ndim == 0) return luaL_error(L, "len: a 0-d tensor has no length (use t:numel())");
    lua_pushinteger(L, (lua_Integer)t->shape[0]);
    return 1;
}

static int m_tostring(lua_State *L)
{
    mn_tensor *t = luaL_checkudata(L, 1, MN_TENSOR_MT);
    if (!t->storage) { lua_pushliteral(L, "[mnemo.Tensor (closed)]"); return 1; }
    l_tensor_push_string(L, t);
    return 1;
}

/* ---------------------------------------------------------------- module functions */

static int l_is_tensor(lua_State *L)
{
    lua_pushboolean(L, l_test_tensor(L, 1) != NULL);
    return 1;
}

static int l_tensor_bytes(lua_State *L)
{
    mn_tensor *t = l_check_tensor(L, 1);
    lua_pushinteger(L, (lua_Integer)(mn_tensor_numel(t) * (int64_t)mn_dtype_size(t->dtype)));
    lua_pushinteger(L, (lua_Integer)t->storage->nbytes);
    return 2;
}

static int l_live_tensors(lua_State *L)
{
    lua_newtable(L);
    int n = 0;
    if (lua_rawgetp(L, LUA_REGISTRYINDEX, &live_key) != LUA_TTABLE) { lua_pop(L, 1); return 1; }
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        lua_pop(L, 1);
        mn_tensor *t = l_test_tensor(L, -1);
        if (t && t->storage) { /* skip closed ones and those awaiting collection */
            lua_pushvalue(L, -1);
            lua_rawseti(L, -4, ++n);
        }
    }
    lua_pop(L, 1);
    return 1;
}

/* ---------------------------------------------------------------- registration */

static const l_doc_reg tensor_methods[] = {
    { "size", m_size, "t:size([dim]) -> a table of sizes, or the size of dim." DIMS_NOTE },
    { "dim", m_dim, "t:dim() -> the number of dims (as t.ndim)" },
    { "numel", m_numel, "t:numel() -> the number of elements" },
    { "stride", m_stride, "t:stride([dim]) -> a table of strides (in elements), or the stride of dim" },
    { "is_contiguous", m_is_contiguous, "t:is_contiguous() -> true when row-major with no gaps" },
    { NULL, NULL, NULL }
};

static const l_doc_reg module_funcs[] = {
    { "zeros", l_zeros, "mnemo.zeros(d1, d2, ... | {shape} [, dtype | {dtype=, device=}]) -> a tensor of zeros (f32 on the cpu unless said otherwise)" },
    { "ones", l_ones, "mnemo.ones(d1, d2, ... | {shape} [, dtype | opts]) -> a tensor of ones" },
    { "full", l_full, "mnemo.full(d1, d2, ... | {shape}, value [, dtype | opts]) -> a tensor filled with value (the last number)" },
    { "randint", l_randint, "mnemo.randint(lo, hi, d1, d2, ... | {shape}) -> i64 integers uniform in [lo, hi) from the global generator" },
    { "rand", l_rand, "mnemo.rand(d1, d2, ... | {shape} [, dtype | opts]) -> uniform in [0, 1) from the global generator (mnemo.seed)" },
    { "randn", l_randn, "mnemo.randn(d1, d2, ... | {shape} [, dtype | opts]) -> standard normal from the global generator (mnemo.seed)" },
    { "arange", l_arange, "mnemo.arange(stop) or mnemo.arange(start, stop [, step]) [, dtype | opts] -> start, start+step, ... below stop (stop exclusive, as numpy and torch); f32 unless said otherwise" },
    { "linspace", l_linspace, "mnemo.linspace(start, stop, n [, dtype | opts]) -> n evenly spaced points from start to stop (both included)" },
    { "eye", l_eye, "mnemo.eye(n [, m] [, dtype | opts]) -> the n x m identity matrix" },
    { "tensor", l_tensor_new, "mnemo.tensor(data [, dtype | opts]) -> a tensor from a number (0-d), a nested table of numbers (rectangular), or a copy of a tensor; f32 unless said otherwise, e.g. mnemo.tensor({{1, 2}, {3, 4}}, 'i64')" },
    { NULL, NULL, NULL }
};

/* After those of l_tensor_ops.c. */
static const l_doc_reg module_utils[] = {
    { "is_tensor", l_is_tensor, "mnemo.is_tensor(x) -> true when x is a tensor" },
    { "tensor_bytes", l_tensor_bytes, "mnemo.tensor_bytes(t) -> bytes of t's elements, and bytes of its whole storage (shared by its views)" },
    { "_live_tensors", l_live_tensors, "mnemo._live_tensors() -> an array of every tensor not yet collected or closed (for who())" },
    { NULL, NULL, NULL }
};

static const struct { const char *name; const char *doc; } field_docs[] = {
    { "shape", "t.shape -> a new table of the sizes, e.g. {4, 8}" },
    { "dtype", "t.dtype -> 'f32', 'f64' or 'i64'" },
    { "device", "t.device -> 'cpu' or 'cuda'" },
    { "ndim", "t.ndim -> the number of dims (0 for a scalar)" },
};

/* Set docs[key] = doc, docs at the stack top. */
void l_set_doc(lua_State *L, const char *prefix, const char *name, const char *doc)
{
    lua_pushfstring(L, "%s%s", prefix, name);
    lua_pushstring(L, doc);
    lua_rawset(L, -3);
}

/* Set table[name] = fn and docs[prefix .. name] = doc for each entry of r. */
static void set_funcs(lua_State *L, int table, int docs, const char *prefix, const l_doc_reg *r)
{
    for (; r->name; r++) {
        lua_pushcfunction(L, r->fn);
        lua_setfield(L, table, r->name);
        lua_pushvalue(L, docs);
        l_set_doc(L, prefix, r->name, r->doc);
        lua_pop(L, 1);
    }
}

void l_tensor_register(lua_State *L)
{
    int mod = lua_gettop(L);

    /* mnemo._docs (shared with the other registrars): "mnemo.zeros", "Tensor:view", "Tensor.shape" */
    if (lua_getfield(L, mod, "_docs") != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, mod, "_docs");
    }
    int docs = lua_gettop(L);

    /* The live-tensor table: weak keys, so it never keeps a tensor alive. */
    lua_newtable(L);
    lua_createtable(L, 0, 1);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &live_key);

    /* Methods. */
    lua_newtable(L);
    int methods = lua_gettop(L);
    l_tensor_ops_register(L, mod, methods, docs);

    set_funcs(L, methods, docs, "Tensor:", tensor_methods);
    set_funcs(L, methods, docs, "Tensor:", l_tensor_ops_methods);
    lua_pushvalue(L, docs);
    for (size_t i = 0; i < sizeof field_docs / sizeof field_docs[0]; i++)
        l_set_doc(L, "Tensor.", field_docs[i].name, field_docs[i].doc);
    l_set_doc(L, "Tensor", "[]",
              "t[i] selects along dim 1 (a number when t is 1-d); t[{e1, e2, ...}] indexes dim k with "
              "entry k: a number selects (the dim goes), {a, b} is the inclusive range a..b, {a, b, step} "
              "every step-th of it, {a} the range a..a (the dim stays), {} the whole dim; missing trailing "
              "entries mean whole dims. Indices are 1-based, negative ones count from the end (-1 = last). "
              "A result with no dims reads as a Lua number. t[key] = number | tensor | nested table fills or "
              "copies into that view (broadcast), writing through to t's storage.");
    lua_pop(L, 1);

    /* The metatable. */
    luaL_newmetatable(L, MN_TENSOR_MT); /* sets __name */
    int mt = lua_gettop(L);
    lua_pushvalue(L, methods);
    lua_setfield(L, mt, "__methods");
    lua_createtable(L, 4, 0);
    for (int i = 0; i < 4; i++) {
        lua_pushstring(L, field_docs[i].name);
        lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, mt, "__fields");
    lua_pushvalue(L, methods);
    lua_pushcclosure(L, m_index, 1);
    lua_setfield(L, mt, "__index");
    static const luaL_Reg metas[] = {
        { "__newindex", m_newindex }, { "__gc", m_gc }, { "__close", m_gc },
        { "__len", m_len }, { "__tostring", m_tostring }, { NULL, NULL }
    };
    luaL_setfuncs(L, metas, 0);
    l_tensor_ops_metatable(L, mt);
    lua_pop(L, 1); /* metatable */

    /* Module functions. */
    set_funcs(L, mod, docs, "mnemo.", module_funcs);
    set_funcs(L, mod, docs, "mnemo.", l_tensor_ops_funcs);
    set_funcs(L, mod, docs, "mnemo.", module_utils);
    lua_pushvalue(L, methods);
    lua_setfield(L, mod, "Tensor");
    lua_settop(L, mod);
}