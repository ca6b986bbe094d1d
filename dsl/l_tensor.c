/* l_tensor.c: the Lua face of tensors: the mnemo.Tensor userdata, its
 * constructors (mnemo.zeros, ...), methods, metamethods and indexing, and the
 * op methods generated from model/ops.def.
 * Lua sees 1-based indices and dims, as Lua and torch7 do; negative ones count
 * from the end (-1 is the last). Ranges in indexing and t:slice include their
 * stop (torch7); arange's stop is exclusive (numpy, torch).
 * Every tensor userdata owns one storage reference, released by __gc or
 * __close. The userdata is pushed before anything is allocated into it, so a
 * Lua error at any point leaves nothing unowned. */
#include "dsl.h"
#include "../model/ops.h"
#include "../model/op_math.h"
#include "../model/random.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Defined in l_tensor_print.c: pushes the text of t (torch7 style). */
void l_tensor_push_string(lua_State *L, const mn_tensor *t);

/* Registry key of the weak-keyed table of every tensor userdata (for who()). */
static const char live_key = 0;

/* ---------------------------------------------------------------- errors */

/* Who is complaining: a function (arguments counted from 1) or a method
 * (self is not counted, as Lua counts it for t:f(...)). */
typedef struct { const char *name; int base; } fname_t;
#define FN(n) ((fname_t){ (n), 0 })
#define METHOD(n) ((fname_t){ (n), 1 })

static int argfail(lua_State *L, fname_t f, int idx, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int argfail(lua_State *L, fname_t f, int idx, const char *fmt, ...)
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
static int failf(lua_State *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int failf(lua_State *L, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return luaL_error(L, "%s", msg);
}

/* The engine's message, prefixed with the function name unless it has it. */
static int raise_in(lua_State *L, const char *fn)
{
    const char *msg = mn_last_error();
    size_t n = strlen(fn);
    if (strncmp(msg, fn, n) == 0 && msg[n] == ':') return luaL_error(L, "%s", msg);
    return luaL_error(L, "%s: %s", fn, msg);
}
/* Out of memory (the GPU's, mostly): tensors that Lua no longer references
 * may still hold memory until the collector runs, so run a full collection
 * and try once more before raising. expr must be safe to repeat: every use
 * fills an empty tensor (left empty on failure) or copies into one. */
#define TRY_IN(L, fn, expr)                                                    \
    do {                                                                       \
        mn_status try_in_st_ = (expr);                                         \
        if (try_in_st_ == MN_ERR_OOM) {                                        \
            lua_gc((L), LUA_GCCOLLECT, 0);                                     \
            try_in_st_ = (expr);                                               \
        }                                                                      \
        if (try_in_st_ != MN_OK) raise_in((L), (fn));                          \
    } while (0)

int l_raise(lua_State *L)
{
    lua_pushstring(L, mn_last_error());
    return lua_error(L);
}

/* "got -1", "got 2.5", "got string" for messages; the string lives on the stack. */
static const char *got(lua_State *L, int idx)
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

static mn_tensor *self_tensor(lua_State *L, fname_t f)
{
    mn_tensor *t = l_test_tensor(L, 1);
    if (!t) argfail(L, f, 1, "tensor expected, %s", got(L, 1));
    if (!t->storage) argfail(L, f, 1, "tensor was closed");
    return t;
}

static mn_device device_of(const mn_tensor *t)
{
    return t->storage ? t->storage->device : MN_CPU;
}

/* ---------------------------------------------------------------- arguments */

static int64_t check_int(lua_State *L, fname_t f, int idx, const char *what)
{
    int isnum = 0;
    lua_Integer v = 0;
    if (lua_type(L, idx) == LUA_TNUMBER) v = lua_tointegerx(L, idx, &isnum);
    if (!isnum) argfail(L, f, idx, "%s must be an integer, %s", what, got(L, idx));
    return (int64_t)v;
}

static double check_num(lua_State *L, fname_t f, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TNUMBER) argfail(L, f, idx, "%s must be a number, %s", what, got(L, idx));
    return lua_tonumber(L, idx);
}

/* A 1-based or negative dim at idx, resolved to 0-based against ndim + extra
 * positions (extra 1: unsqueeze and stack may name the position after the last). */
static int resolve_dim(lua_State *L, fname_t f, int idx, int64_t d, int ndim, int extra)
{
    int n = ndim + extra;
    if (d >= 1 && d <= n) return (int)d - 1;
    if (d <= -1 && d >= -n) return n + (int)d;
    if (n == 0) argfail(L, f, idx, "dim %lld out of range: the tensor is 0-d", (long long)d);
    argfail(L, f, idx, "dim %lld out of range for a %d-d tensor (expected 1..%d or -%d..-1)",
            (long long)d, ndim, n, n);
    return 0;
}

static int check_dim(lua_State *L, fname_t f, int idx, int ndim, int extra)
{
    return resolve_dim(L, f, idx, check_int(L, f, idx, "dim"), ndim, extra);
}

/* A 1-based or negative index into a dim of the given size -> 0-based.
 * idx > 0: the index came from argument idx; else from an indexing key. */
static int64_t resolve_index(lua_State *L, fname_t f, int idx, int64_t i, int dim, int64_t size)
{
    if (i >= 1 && i <= size) return i - 1;
    if (i <= -1 && i >= -size) return size + i;
    if (idx > 0)
        argfail(L, f, idx, "index %lld out of range for dim %d of size %lld", (long long)i, dim + 1,
                (long long)size);
    failf(L, "%s: index %lld out of range for dim %d of size %lld", f.name, (long long)i,
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
static void parse_type_string(lua_State *L, fname_t f, int idx, mn_dtype *dt, mn_device *dev)
{
    const char *s = lua_tostring(L, idx);
    bool ok;
    mn_dtype d = dtype_name(s, &ok);
    if (ok) { *dt = d; return; }
    if (device_name(s, dev)) return;
    argfail(L, f, idx, "unknown dtype or device '%s' (expected f32, f64, i64, cpu or cuda)", s);
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
static int parse_options(lua_State *L, fname_t f, int top, mn_dtype *dt, mn_device *dev)
{
    if (top < 1) return top;
    if (lua_type(L, top) == LUA_TSTRING) {
        parse_type_string(L, f, top, dt, dev);
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
                argfail(L, f, top, "unknown %s '%s' (expected %s)", k, s ? s : luaL_typename(L, -1),
                        k[1] == 't' ? "f32, f64 or i64" : "cpu or cuda");
        } else {
            argfail(L, f, top, "unknown option '%s' (expected dtype or device)", k);
        }
        lua_pop(L, 1);
    }
    return top - 1;
}

/* Sizes from arguments first..last: integers, or one table of integers.
 * allow: -1 (one inferred size, view/reshape; keep a size, expand). */
static int parse_sizes(lua_State *L, fname_t f, int first, int last, int64_t *shape, bool allow_m1)
{
    int n = 0;
    const char *need = allow_m1 ? "a non-negative integer or -1" : "a non-negative integer";
    if (first == last && lua_istable(L, first)) {
        lua_Integer len = (lua_Integer)lua_rawlen(L, first);
        if (len > MN_MAX_DIMS) argfail(L, f, first, "%lld sizes: at most %d dims", (long long)len, MN_MAX_DIMS);
        for (lua_Integer i = 1; i <= len; i++) {
            lua_geti(L, first, i);
            int isnum = 0;
            lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isnum) : 0;
            if (!isnum || v < (allow_m1 ? -1 : 0))
                argfail(L, f, first, "size [%lld] must be %s, %s", (long long)i, need, got(L, -1));
            shape[n++] = v;
            lua_pop(L, 1);
        }
        return n;
    }
    if (last - first + 1 > MN_MAX_DIMS)
        argfail(L, f, first, "%d sizes: at most %d dims", last - first + 1, MN_MAX_DIMS);
    for (int i = first; i <= last; i++) {
        int isnum = 0;
        lua_Integer v = lua_type(L, i) == LUA_TNUMBER ? lua_tointegerx(L, i, &isnum) : 0;
        if (!isnum || v < (allow_m1 ? -1 : 0)) argfail(L, f, i, "size must be %s, %s", need, got(L, i));
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
        argfail(L, f, argi, "ragged nested table: %s%s has %lld entries, expected %lld (depth %d)",
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
                argfail(L, f, argi, "ragged nested table: element %s is a %s, expected a table (depth %d)",
                        path, lua_typename(L, ty), depth + 2);
            }
            fill_from_table(L, f, argi, dst, depth + 1, pos, flat);
        } else {
            if (ty != LUA_TNUMBER) {
                path_string(path, sizeof path, pos, depth + 1);
                argfail(L, f, argi, "%s element %s is a %s, expected a number",
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
static mn_tensor *value_to_tensor(lua_State *L, fname_t f, int idx, mn_dtype dt, mn_device dev)
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
    if (!lua_istable(L, idx)) argfail(L, f, idx, "expected a number or nested table, %s", got(L, idx));
    /* The shape comes from the first entry at each depth; fill checks the rest. */
    int saved = lua_gettop(L);
    lua_pushvalue(L, idx);
    while (lua_istable(L, -1)) {
        if (ndim == MN_MAX_DIMS) argfail(L, f, idx, "nested table deeper than %d", MN_MAX_DIMS);
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
    return value_to_tensor(L, FN("tensor"), idx, MN_F32, MN_CPU);
}

/* A tensor argument, or a number / nested table made into one (pushed). */
static mn_tensor *arg_tensor(lua_State *L, fname_t f, int idx)
{
    mn_tensor *t = l_test_tensor(L, idx);
    if (t) {
        if (!t->storage) argfail(L, f, idx, "tensor was closed");
        return t;
    }
    int ty = lua_type(L, idx);
    if (ty == LUA_TNUMBER || ty == LUA_TTABLE) return value_to_tensor(L, f, idx, MN_F32, MN_CPU);
    argfail(L, f, idx, "expected a tensor, number or table, %s", got(L, idx));
    return NULL;
}

/* t itself when on the CPU, else a CPU copy (pushed). */
static const mn_tensor *on_host(lua_State *L, const char *fn, const mn_tensor *t)
{
    if (device_of(t) == MN_CPU) return t;
    mn_tensor *h = l_push_empty_tensor(L);
    TRY_IN(L, fn, mn_tensor_to_device(h, t, MN_CPU));
    return h;
}

static void push_element(lua_State *L, const mn_tensor *t, const int64_t *index)
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
    int top = parse_options(L, f, lua_gettop(L), &dt, &dev);
    if (has_value) {
        if (top < 1) argfail(L, f, 1, "expected sizes then a fill value");
        value = check_num(L, f, top, "fill value (the last argument)");
        top--;
    }
    int64_t shape[MN_MAX_DIMS];
    int nd = parse_sizes(L, f, 1, top, shape, false);
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
    int top = parse_options(L, f, lua_gettop(L), &dt, &dev);
    if (dt == MN_I64) argfail(L, f, top + 1, "needs a float dtype (f32 or f64); for integers use mnemo.randint");
    int64_t shape[MN_MAX_DIMS];
    int nd = parse_sizes(L, f, 1, top, shape, false);
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
    if (hi <= lo) argfail(L, f, 2, "hi must be greater than lo");
    mn_dtype dt = MN_I64;
    mn_device dev = MN_CPU;
    int top = parse_options(L, f, lua_gettop(L), &dt, &dev);
    int64_t shape[MN_MAX_DIMS];
    int nd = parse_sizes(L, f, 3, top, shape, false);
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
    int top = parse_options(L, f, lua_gettop(L), &dt, &dev);
    double start = 0, stop, step = 1;
    if (top == 1) stop = check_num(L, f, 1, "stop");
    else if (top == 2 || top == 3) {
        start = check_num(L, f, 1, "start");
        stop = check_num(L, f, 2, "stop");
        if (top == 3) step = check_num(L, f, 3, "step");
    } else return argfail(L, f, top < 1 ? 1 : 4, "expected arange(stop) or arange(start, stop [, step])");
    if (step == 0) argfail(L, f, 3, "step must not be 0");
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "arange", mn_tensor_arange(t, dt, start, stop, step));
    return push_created(L, "arange", t, dev);
}

static int l_linspace(lua_State *L)
{
    fname_t f = FN("linspace");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    parse_options(L, f, lua_gettop(L), &dt, &dev);
    double start = check_num(L, f, 1, "start"), stop = check_num(L, f, 2, "stop");
    int64_t n = check_int(L, f, 3, "the number of points");
    if (n < 0) argfail(L, f, 3, "the number of points must be >= 0, got %lld", (long long)n);
    mn_tensor *t = l_push_empty_tensor(L);
    TRY_IN(L, "linspace", mn_tensor_linspace(t, dt, start, stop, n));
    return push_created(L, "linspace", t, dev);
}

static int l_eye(lua_State *L)
{
    fname_t f = FN("eye");
    mn_dtype dt = MN_F32;
    mn_device dev = MN_CPU;
    int top = parse_options(L, f, lua_gettop(L), &dt, &dev);
    int64_t n = check_int(L, f, 1, "n");
    int64_t m = top >= 2 ? check_int(L, f, 2, "m") : n;
    if (n < 0) argfail(L, f, 1, "n must be >= 0, got %lld", (long long)n);
    if (m < 0) argfail(L, f, 2, "m must be >= 0, got %lld", (long long)m);
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
    if (top >= 2) top = parse_options(L, f, top, &dt, &dev);
    if (top != 1) argfail(L, f, top < 1 ? 1 : 2, "expected tensor(data [, dtype | {dtype=, device=}])");
    mn_tensor *src = l_test_tensor(L, 1);
    if (src) { /* a copy, as torch.tensor(t) */
        if (!src->storage) argfail(L, f, 1, "tensor was closed");
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
    value_to_tensor(L, f, 1, dt, dev);
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
    mn_tensor *t = self_tensor(L, f);
    if (lua_isnoneornil(L, 2)) push_shape(L, t, t->shape);
    else lua_pushinteger(L, (lua_Integer)t->shape[check_dim(L, f, 2, t->ndim, 0)]);
    return 1;
}

static int m_stride(lua_State *L)
{
    fname_t f = METHOD("stride");
    mn_tensor *t = self_tensor(L, f);
    if (lua_isnoneornil(L, 2)) push_shape(L, t, t->stride);
    else lua_pushinteger(L, (lua_Integer)t->stride[check_dim(L, f, 2, t->ndim, 0)]);
    return 1;
}

static int m_dim(lua_State *L)
{
    lua_pushinteger(L, self_tensor(L, METHOD("dim"))->ndim);
    return 1;
}

static int m_numel(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)mn_tensor_numel(self_tensor(L, METHOD("numel"))));
    return 1;
}

static int m_is_contiguous(lua_State *L)
{
    lua_pushboolean(L, mn_tensor_is_contiguous(self_tensor(L, METHOD("is_contiguous"))));
    return 1;
}

/* ---------------------------------------------------------------- views */

static int infer_shape(lua_State *L, fname_t f, const mn_tensor *t, int nd, int64_t *shape)
{
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < nd; i++) {
        if (shape[i] == -1) {
            if (infer >= 0) argfail(L, f, 2, "only one size may be -1");
            infer = i;
        } else known *= shape[i];
    }
    int64_t numel = mn_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || numel % known != 0) {
            char buf[128];
            argfail(L, f, 2, "cannot infer the -1 size: %lld elements (shape %s) do not divide by %lld",
                    (long long)numel, mn_shape_string(t, buf, sizeof buf), (long long)known);
        }
        shape[infer] = numel / known;
    }
    return nd;
}

static int view_or_reshape(lua_State *L, const char *name, bool copy_if_needed)
{
    fname_t f = METHOD(name);
    mn_tensor *t = self_tensor(L, f);
    int64_t shape[MN_MAX_DIMS];
    int nd = parse_sizes(L, f, 2, lua_gettop(L), shape, true);
    infer_shape(L, f, t, nd, shape);
    mn_tensor *out = l_push_empty_tensor(L);
    if (mn_view_reshape(out, t, nd, shape) == MN_OK) return 1;
    if (!copy_if_needed) {
        const char *msg = mn_last_error();
        if (!strncmp(msg, "reshape: ", 9)) msg += 9; /* the engine speaks for reshape */
        return luaL_error(L, "view: %s", msg);
    }
    mn_tensor *c = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_tensor_contiguous(c, t));
    TRY_IN(L, name, mn_view_reshape(out, c, nd, shape));
    lua_pop(L, 1);
    return 1;
}

static int m_view(lua_State *L) { return view_or_reshape(L, "view", false); }
static int m_reshape(lua_State *L) { return view_or_reshape(L, "reshape", true); }

static int m_transpose(lua_State *L)
{
    fname_t f = METHOD("transpose");
    mn_tensor *t = self_tensor(L, f);
    int a = check_dim(L, f, 2, t->ndim, 0), b = check_dim(L, f, 3, t->ndim, 0);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "transpose", mn_view_transpose(out, t, a, b));
    return 1;
}

static int m_t(lua_State *L)
{
    fname_t f = METHOD("t");
    mn_tensor *t = self_tensor(L, f);
    if (t->ndim > 2) argfail(L, f, 1, "t() needs a tensor of at most 2 dims, got %d (use transpose)", t->ndim);
    mn_tensor *out = l_push_empty_tensor(L);
    if (t->ndim < 2) mn_tensor_share(out, t);
    else TRY_IN(L, "t", mn_view_transpose(out, t, 0, 1));
    return 1;
}

static int m_permute(lua_State *L)
{
    fname_t f = METHOD("permute");
    mn_tensor *t = self_tensor(L, f);
    int64_t dims[MN_MAX_DIMS];
    int top = lua_gettop(L), n = 0;
    bool table = top == 2 && lua_istable(L, 2);
    n = table ? (int)lua_rawlen(L, 2) : top - 1;
    if (n != t->ndim) argfail(L, f, 2, "%d dims given for a %d-d tensor", n, t->ndim);
    int perm[MN_MAX_DIMS];
    bool seen[MN_MAX_DIMS] = { false };
    for (int i = 0; i < n; i++) {
        int idx = table ? 2 : i + 2, isnum = 0;
        int at = table ? (lua_geti(L, 2, i + 1), lua_gettop(L)) : idx;
        dims[i] = lua_type(L, at) == LUA_TNUMBER ? (int64_t)lua_tointegerx(L, at, &isnum) : 0;
        if (!isnum) argfail(L, f, idx, "dim %d must be an integer, %s", i + 1, got(L, at));
        perm[i] = resolve_dim(L, f, idx, dims[i], t->ndim, 0);
        if (seen[perm[i]]) argfail(L, f, idx, "dim %lld appears twice", (long long)dims[i]);
        seen[perm[i]] = true;
        if (table) lua_pop(L, 1);
    }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "permute", mn_view_permute(out, t, perm));
    return 1;
}

static int m_unsqueeze(lua_State *L)
{
    fname_t f = METHOD("unsqueeze");
    mn_tensor *t = self_tensor(L, f);
    int d = check_dim(L, f, 2, t->ndim, 1);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "unsqueeze", mn_view_unsqueeze(out, t, d));
    return 1;
}

static int m_squeeze(lua_State *L)
{
    fname_t f = METHOD("squeeze");
    mn_tensor *t = self_tensor(L, f);
    int d = lua_isnoneornil(L, 2) ? -99 : check_dim(L, f, 2, t->ndim, 0);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "squeeze", mn_view_squeeze(out, t, d));
    return 1;
}

static int m_expand(lua_State *L)
{
    fname_t f = METHOD("expand");
    mn_tensor *t = self_tensor(L, f);
    int64_t shape[MN_MAX_DIMS];
    int nd = parse_sizes(L, f, 2, lua_gettop(L), shape, true);
    if (nd < t->ndim) argfail(L, f, 2, "%d sizes given for a %d-d tensor (expand cannot drop dims)", nd, t->ndim);
    for (int i = 0; i < nd; i++) {
        if (shape[i] != -1) continue;
        int j = i - (nd - t->ndim);
        if (j < 0) argfail(L, f, 2, "size -1 (keep) is not allowed for the new leading dim %d", i + 1);
        shape[i] = t->shape[j];
    }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "expand", mn_view_expand(out, t, nd, shape));
    return 1;
}

static int m_narrow(lua_State *L)
{
    fname_t f = METHOD("narrow");
    mn_tensor *t = self_tensor(L, f);
    int d = check_dim(L, f, 2, t->ndim, 0);
    int64_t size = t->shape[d];
    int64_t s = check_int(L, f, 3, "start"), len = check_int(L, f, 4, "length");
    int64_t s0 = (len == 0 && (s == size + 1)) ? size : resolve_index(L, f, 3, s, d, size);
    if (len < 0 || s0 + len > size)
        argfail(L, f, 4, "length %lld from index %lld runs past dim %d of size %lld", (long long)len,
                (long long)s, d + 1, (long long)size);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "narrow", mn_view_slice(out, t, d, s0, s0 + len, 1));
    return 1;
}

/* Resolved inclusive range [a, b] with step -> exclusive stop for mn_view_slice;
 * b before a gives an empty range. */
static int64_t range_stop(int64_t a0, int64_t b0) { return b0 < a0 ? a0 : b0 + 1; }

static int m_slice(lua_State *L)
{
    fname_t f = METHOD("slice");
    mn_tensor *t = self_tensor(L, f);
    int d = check_dim(L, f, 2, t->ndim, 0);
    int64_t size = t->shape[d];
    int64_t a0 = resolve_index(L, f, 3, check_int(L, f, 3, "start"), d, size);
    int64_t b0 = lua_isnoneornil(L, 4) ? size - 1
                                       : resolve_index(L, f, 4, check_int(L, f, 4, "stop"), d, size);
    int64_t step = lua_isnoneornil(L, 5) ? 1 : check_int(L, f, 5, "step");
    if (step < 1) argfail(L, f, 5, "step must be >= 1, got %lld", (long long)step);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "slice", mn_view_slice(out, t, d, a0, range_stop(a0, b0), step));
    return 1;
}

static int m_select(lua_State *L)
{
    fname_t f = METHOD("select");
    mn_tensor *t = self_tensor(L, f);
    int d = check_dim(L, f, 2, t->ndim, 0);
    int64_t i = resolve_index(L, f, 3, check_int(L, f, 3, "index"), d, t->shape[d]);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "select", mn_view_select(out, t, d, i));
    return 1;
}

/* ---------------------------------------------------------------- indexing */

typedef struct { bool select; int dim; int64_t start, stop, step; } index_op;

/* Parse an indexing key (an integer or a table of per-dim entries) into view
 * ops, checked against t's shape. Errors are raised here, before any view. */
static int parse_index_key(lua_State *L, fname_t f, const mn_tensor *t, int key, index_op *ops)
{
    if (lua_type(L, key) == LUA_TNUMBER) {
        int isnum = 0;
        lua_Integer i = lua_tointegerx(L, key, &isnum);
        if (!isnum) luaL_error(L, "%s: index must be an integer, %s", f.name, got(L, key));
        if (t->ndim == 0) luaL_error(L, "%s: cannot index a 0-d tensor (use t:item())", f.name);
        ops[0] = (index_op){ true, 0, resolve_index(L, f, 0, i, 0, t->shape[0]), 0, 1 };
        return 1;
    }
    int n = (int)lua_rawlen(L, key);
    if (n > t->ndim)
        luaL_error(L, "%s: %d indices for a %d-d tensor", f.name, n, t->ndim);
    int dim = 0, nops = 0; /* dim: position in the view being built */
    for (int k = 1; k <= n; k++, nops++) {
        int src_dim = k - 1; /* dim of t this entry addresses */
        int64_t size = t->shape[src_dim];
        int ty = lua_geti(L, key, k);
        if (ty == LUA_TNUMBER) {
            int isnum = 0;
            lua_Integer i = lua_tointegerx(L, -1, &isnum);
            if (!isnum) luaL_error(L, "%s: entry %d must be an integer or a range, %s", f.name, k, got(L, -1));
            ops[nops] = (index_op){ true, dim, resolve_index(L, f, 0, i, src_dim, size), 0, 1 };
        } else if (ty == LUA_TTABLE) {
            int m = (int)lua_rawlen(L, -1);
            int64_t r[3] = { 1, -1, 1 };
            if (m > 3) luaL_error(L, "%s: range for dim %d has %d entries (expected {}, {i}, {a, b} or {a, b, step})", f.name, k, m);
            for (int j = 0; j < m; j++) {
                lua_geti(L, -1, j + 1);
                int isnum = 0;
                lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isnum) : 0;
                if (!isnum) luaL_error(L, "%s: range for dim %d: entry %d must be an integer, %s", f.name, k, j + 1, got(L, -1));
                r[j] = v;
                lua_pop(L, 1);
            }
            if (m == 1) r[1] = r[0];
            if (r[2] < 1) failf(L, "%s: range for dim %d: step must be >= 1, got %lld", f.name, k, (long long)r[2]);
            int64_t a0 = 0, b0 = size - 1;
            if (m >= 1) {
                a0 = resolve_index(L, f, 0, r[0], src_dim, size);
                b0 = resolve_index(L, f, 0, r[1], src_dim, size);
            }
            ops[nops] = (index_op){ false, dim, a0, range_stop(a0, b0), r[2] };
            dim++;
        } else {
            luaL_error(L, "%s: entry %d must be an integer or a range table, got %s", f.name, k, lua_typename(L, ty));
        }
        lua_pop(L, 1);
    }
    return nops;
}

/* The view of t named by the key at index key, into out (pushed by the caller). */
static void index_view(lua_State *L, fname_t f, const mn_tensor *t, int key, mn_tensor *out)
{
    index_op ops[MN_MAX_DIMS];
    int n = parse_index_key(L, f, t, key, ops);
    mn_tensor cur, next;
    mn_tensor_share(&cur, t);
    for (int i = 0; i < n; i++) {
        memset(&next, 0, sizeof next);
        mn_status st = ops[i].select ? mn_view_select(&next, &cur, ops[i].dim, ops[i].start)
                                     : mn_view_slice(&next, &cur, ops[i].dim, ops[i].start,
                                                     ops[i].stop, ops[i].step);
        mn_tensor_release(&cur);
        if (st != MN_OK) raise_in(L, f.name);
        cur = next;
    }
    *out = cur;
}

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
    index_view(L, f, t, 2, out);
    if (out->ndim == 0) { /* a single element reads as a Lua number */
        const mn_tensor *h = on_host(L, "index", out);
        int64_t none[MN_MAX_DIMS] = { 0 };
        push_element(L, h, none);
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
            src = value_to_tensor(L, f, 3, t->dtype, MN_CPU);
        } else if (!src->storage) return luaL_error(L, "index: value tensor was closed");
    }
    mn_tensor *view = l_push_empty_tensor(L);
    index_view(L, f, t, 2, view);
    if (src) TRY_IN(L, "index", mn_tensor_copy_into(view, src));
    else TRY_IN(L, "index", mn_tensor_fill(view, lua_tonumber(L, 3)));
    mn_tensor_release(view);
    return 0;
}

/* ---------------------------------------------------------------- copies */

static int m_contiguous(lua_State *L)
{
    mn_tensor *t = self_tensor(L, METHOD("contiguous"));
    if (mn_tensor_is_contiguous(t)) { lua_settop(L, 1); return 1; }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "contiguous", mn_tensor_contiguous(out, t));
    return 1;
}

static int m_clone(lua_State *L)
{
    mn_tensor *t = self_tensor(L, METHOD("clone"));
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "clone", mn_tensor_clone(out, t));
    return 1;
}

static int convert(lua_State *L, const char *fn, mn_tensor *t, mn_dtype dt, mn_device dev)
{
    if (t->dtype == dt && device_of(t) == dev) { lua_pushvalue(L, 1); return 1; }
    if (t->dtype != dt) {
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, fn, mn_tensor_to_dtype(out, t, dt));
        t = out;
    }
    if (device_of(t) != dev) {
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, fn, mn_tensor_to_device(out, t, dev));
    }
    return 1;
}

static int m_float(lua_State *L) { mn_tensor *t = self_tensor(L, METHOD("float")); return convert(L, "float", t, MN_F32, device_of(t)); }
static int m_double(lua_State *L) { mn_tensor *t = self_tensor(L, METHOD("double")); return convert(L, "double", t, MN_F64, device_of(t)); }
static int m_long(lua_State *L) { mn_tensor *t = self_tensor(L, METHOD("long")); return convert(L, "long", t, MN_I64, device_of(t)); }
static int m_cpu(lua_State *L) { mn_tensor *t = self_tensor(L, METHOD("cpu")); return convert(L, "cpu", t, t->dtype, MN_CPU); }
static int m_cuda(lua_State *L) { mn_tensor *t = self_tensor(L, METHOD("cuda")); return convert(L, "cuda", t, t->dtype, MN_CUDA); }

static int m_to(lua_State *L)
{
    fname_t f = METHOD("to");
    mn_tensor *t = self_tensor(L, f);
    mn_dtype dt = t->dtype;
    mn_device dev = device_of(t);
    int top = lua_gettop(L);
    if (top < 2) argfail(L, f, 2, "expected a dtype, a device or {dtype=, device=}");
    for (int i = 2; i <= top; i++) {
        if (lua_type(L, i) == LUA_TSTRING) parse_type_string(L, f, i, &dt, &dev);
        else if (lua_istable(L, i)) parse_options(L, f, i, &dt, &dev);
        else argfail(L, f, i, "expected a dtype, a device or {dtype=, device=}, %s", got(L, i));
    }
    lua_settop(L, 1);
    return convert(L, "to", t, dt, dev);
}

static int m_copy(lua_State *L)
{
    fname_t f = METHOD("copy");
    lua_settop(L, 2);
    mn_tensor *t = self_tensor(L, f);
    mn_tensor *src = arg_tensor(L, f, 2);
    TRY_IN(L, "copy", mn_tensor_copy_into(t, src));
    lua_settop(L, 1);
    return 1;
}

static int m_fill(lua_State *L)
{
    fname_t f = METHOD("fill");
    mn_tensor *t = self_tensor(L, f);
    TRY_IN(L, "fill", mn_tensor_fill(t, check_num(L, f, 2, "value")));
    lua_settop(L, 1);
    return 1;
}

static int m_zero(lua_State *L)
{
    mn_tensor *t = self_tensor(L, METHOD("zero"));
    TRY_IN(L, "zero", mn_tensor_fill(t, 0.0));
    lua_settop(L, 1);
    return 1;
}

/* cat / stack ({a, b, ...} [, dim]) */
static int join(lua_State *L, const char *name, bool stack)
{
    fname_t f = FN(name);
    lua_settop(L, 2); /* slot 2 is the dim (or nil) before anything is pushed */
    luaL_checktype(L, 1, LUA_TTABLE);
    int n = (int)lua_rawlen(L, 1);
    if (n < 1) argfail(L, f, 1, "expected a non-empty list of tensors");
    luaL_checkstack(L, n + 4, "too many tensors");
    const mn_tensor **parts = lua_newuserdatauv(L, (size_t)n * sizeof *parts, 0);
    for (int i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        mn_tensor *p = l_test_tensor(L, -1);
        if (p && !p->storage) argfail(L, f, 1, "entry [%d] is a closed tensor", i + 1);
        if (!p) {
            int ty = lua_type(L, -1);
            if (ty != LUA_TNUMBER && ty != LUA_TTABLE)
                argfail(L, f, 1, "entry [%d] must be a tensor, got %s", i + 1, luaL_typename(L, -1));
            p = value_to_tensor(L, f, lua_gettop(L), MN_F32, MN_CPU);
        }
        parts[i] = p; /* kept alive on the stack */
    }
    if (!stack && parts[0]->ndim == 0) argfail(L, f, 1, "entry [1] is 0-d: cat needs at least 1 dim (use stack)");
    int d = lua_isnoneornil(L, 2) ? 0 : check_dim(L, f, 2, parts[0]->ndim, stack ? 1 : 0);
    /* Shapes checked here so that the message counts dims from 1. */
    for (int i = 1; i < n; i++) {
        char a[160], b[160];
        const mn_tensor *p = parts[i], *q = parts[0];
        bool ok = p->ndim == q->ndim;
        for (int k = 0; ok && k < q->ndim; k++) ok = p->shape[k] == q->shape[k] || (!stack && k == d);
        if (!ok)
            argfail(L, f, 1, "entry [%d] has shape %s, entry [1] has %s (%s)", i + 1,
                    mn_shape_string(p, a, sizeof a), mn_shape_string(q, b, sizeof b),
                    stack ? "stack needs equal shapes" : "cat needs equal sizes except along dim");
    }
    mn_tensor *out = l_push_empty_tensor(L);
    if (stack) TRY_IN(L, name, mn_tensor_stack(out, parts, n, d));
    else TRY_IN(L, name, mn_tensor_cat(out, parts, n, d));
    return 1;
}

static int l_cat(lua_State *L) { return join(L, "cat", false); }
static int l_stack(lua_State *L) { return join(L, "stack", true); }

/* ---------------------------------------------------------------- values */

static void push_reduced(lua_State *L, mn_dtype dt, mn_op op, double v)
{
    bool exact = dt == MN_I64 && op != MN_OP_mean && op != MN_OP_norm;
    if (exact && v == floor(v) && fabs(v) < 9007199254740992.0) lua_pushinteger(L, (lua_Integer)v);
    else lua_pushnumber(L, v);
}

static int m_item(lua_State *L)
{
    fname_t f = METHOD("item");
    mn_tensor *t = self_tensor(L, f);
    if (mn_tensor_numel(t) != 1) {
        char buf[128];
        argfail(L, f, 1, "item() needs exactly one element, the tensor has %lld (shape %s)",
                (long long)mn_tensor_numel(t), mn_shape_string(t, buf, sizeof buf));
    }
    const mn_tensor *h = on_host(L, "item", t);
    int64_t index[MN_MAX_DIMS] = { 0 };
    push_element(L, h, index);
    return 1;
}

static void push_list(lua_State *L, const mn_tensor *t, int d, int64_t *index)
{
    if (d == t->ndim) { push_element(L, t, index); return; }
    luaL_checkstack(L, 3, "tolist");
    lua_createtable(L, (int)t->shape[d], 0);
    for (int64_t i = 0; i < t->shape[d]; i++) {
        index[d] = i;
        push_list(L, t, d + 1, index);
        lua_rawseti(L, -2, i + 1);
    }
}

static int m_tolist(lua_State *L)
{
    mn_tensor *t = self_tensor(L, METHOD("tolist"));
    const mn_tensor *h = on_host(L, "tolist", t);
    int64_t index[MN_MAX_DIMS] = { 0 };
    push_list(L, h, 0, index);
    return 1;
}

/* any / all: whether any / every element is nonzero (NaN counts as nonzero). */
static int any_all(lua_State *L, const char *name, bool all)
{
    mn_tensor *t = self_tensor(L, METHOD(name));
    if (mn_tensor_numel(t) == 0) { lua_pushboolean(L, all); return 1; }
    mn_tensor *nz = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_binary_scalar(MN_OP_ne, nz, t, 0.0, false));
    double v = 0;
    TRY_IN(L, name, mn_reduce_all(all ? MN_OP_min : MN_OP_max, nz, &v));
    lua_pushboolean(L, v > 0);
    return 1;
}

static int m_any(lua_State *L) { return any_all(L, "any", false); }
static int m_all(lua_State *L) { return any_all(L, "all", true); }

/* ---------------------------------------------------------------- ops from ops.def */

typedef double (*unary_fn)(double);
typedef double (*binary_fn)(double, double);

static const unary_fn unary_math[MN_OP_COUNT] = {
#define MN_UNARY(name, doc) [MN_OP_##name] = mn_op_##name,
#include "../model/ops.def"
};
static const binary_fn binary_math[MN_OP_COUNT] = {
#define MN_BINARY(name, meta, doc) [MN_OP_##name] = mn_op_##name,
#include "../model/ops.def"
};

static mn_op op_upvalue(lua_State *L) { return (mn_op)lua_tointeger(L, lua_upvalueindex(1)); }
static bool is_method(lua_State *L) { return lua_toboolean(L, lua_upvalueindex(2)); }

/* t:name() / mnemo.name(x): a number in gives a number out. */
static int l_unary(lua_State *L)
{
    mn_op op = op_upvalue(L);
    const char *name = mn_op_name(op);
    fname_t f = is_method(L) ? METHOD(name) : FN(name);
    if (!is_method(L) && lua_type(L, 1) == LUA_TNUMBER) {
        lua_pushnumber(L, unary_math[op](lua_tonumber(L, 1)));
        return 1;
    }
    mn_tensor *a = is_method(L) ? self_tensor(L, f) : arg_tensor(L, f, 1);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_unary(op, out, a));
    return 1;
}

/* a op b where either may be a number (kept as a scalar of the tensor's dtype). */
static int binary_at(lua_State *L, mn_op op, fname_t f, int ia, int ib)
{
    bool na = lua_type(L, ia) == LUA_TNUMBER, nb = lua_type(L, ib) == LUA_TNUMBER;
    if (na && nb) {
        lua_pushnumber(L, binary_math[op](lua_tonumber(L, ia), lua_tonumber(L, ib)));
        return 1;
    }
    if (nb) {
        mn_tensor *a = arg_tensor(L, f, ia);
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_binary_scalar(op, out, a, lua_tonumber(L, ib), false));
        return 1;
    }
    if (na) {
        mn_tensor *b = arg_tensor(L, f, ib);
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_binary_scalar(op, out, b, lua_tonumber(L, ia), true));
        return 1;
    }
    mn_tensor *a = arg_tensor(L, f, ia);
    mn_tensor *b = arg_tensor(L, f, ib);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, f.name, mn_binary(op, out, a, b));
    return 1;
}

static int l_binary(lua_State *L)
{
    mn_op op = op_upvalue(L);
    const char *name = mn_op_name(op);
    if (is_method(L)) {
        self_tensor(L, METHOD(name));
        if (lua_isnone(L, 2)) return argfail(L, METHOD(name), 2, "expected a tensor or number, got no value");
        lua_settop(L, 2);
        return binary_at(L, op, METHOD(name), 1, 2);
    }
    lua_settop(L, 2);
    return binary_at(L, op, FN(name), 1, 2);
}

static int l_metabinary(lua_State *L)
{
    mn_op op = op_upvalue(L);
    return binary_at(L, op, FN(mn_op_name(op)), 1, 2);
}

static int l_unm(lua_State *L)
{
    mn_tensor *a = l_check_tensor(L, 1);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "neg", mn_unary(MN_OP_neg, out, a));
    return 1;
}

/* t:name() -> number; t:name(dim [, keepdim]) -> tensor along dim. */
static int l_reduce(lua_State *L)
{
    mn_op op = op_upvalue(L);
    const char *name = mn_op_name(op);
    fname_t f = is_method(L) ? METHOD(name) : FN(name);
    lua_settop(L, 3); /* slots 2, 3: dim, keepdim (or nil) before anything is pushed */
    mn_tensor *a = is_method(L) ? self_tensor(L, f) : arg_tensor(L, f, 1);
    if (lua_isnil(L, 2)) {
        double v = 0;
        TRY_IN(L, name, mn_reduce_all(op, a, &v));
        push_reduced(L, a->dtype, op, v);
        return 1;
    }
    int d = check_dim(L, f, 2, a->ndim, 0);
    if ((op == MN_OP_max || op == MN_OP_min) && a->shape[d] == 0 && mn_tensor_numel(a) == 0) {
        char buf[160];
        int64_t rest = 1;
        for (int k = 0; k < a->ndim; k++) if (k != d) rest *= a->shape[k];
        if (rest > 0) argfail(L, f, 2, "dim %d of %s has size 0: no %s", d + 1, mn_shape_string(a, buf, sizeof buf), name);
    }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_reduce_dim(op, out, a, d, lua_toboolean(L, 3)));
    return 1;
}

/* argmax / argmin: 1-based indices (the engine's 0-based ones plus 1). */
static int argreduce(lua_State *L, const char *name, mn_op op, bool method)
{
    fname_t f = method ? METHOD(name) : FN(name);
    lua_settop(L, 3); /* slots 2, 3: dim, keepdim (or nil) before anything is pushed */
    mn_tensor *a = method ? self_tensor(L, f) : arg_tensor(L, f, 1);
    if (lua_isnil(L, 2)) { /* over the whole tensor: a flat 1-based index */
        if (mn_tensor_numel(a) == 0) argfail(L, f, 1, "%s of an empty tensor", name);
        mn_tensor *idx = l_push_empty_tensor(L);
        int64_t flat = mn_tensor_numel(a);
        mn_tensor *v = l_push_empty_tensor(L);
        if (mn_view_reshape(v, a, 1, &flat) != MN_OK) {
            mn_tensor *c = l_push_empty_tensor(L);
            TRY_IN(L, name, mn_tensor_contiguous(c, a));
            TRY_IN(L, name, mn_view_reshape(v, c, 1, &flat));
        }
        TRY_IN(L, name, mn_argreduce_dim(op, idx, v, 0, false));
        const mn_tensor *h = on_host(L, name, idx);
        int64_t none[MN_MAX_DIMS] = { 0 };
        push_element(L, h, none);
        lua_pushinteger(L, lua_tointeger(L, -1) + 1);
        return 1;
    }
    int d = check_dim(L, f, 2, a->ndim, 0);
    if (a->shape[d] == 0) {
        char buf[160];
        argfail(L, f, 2, "dim %d of %s has size 0: no %s", d + 1, mn_shape_string(a, buf, sizeof buf), name);
    }
    mn_tensor *idx = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_argreduce_dim(op, idx, a, d, lua_toboolean(L, 3)));
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, name, mn_binary_scalar(MN_OP_add, out, idx, 1.0, false));
    return 1;
}

static int m_argmax(lua_State *L) { return argreduce(L, "argmax", MN_OP_max, true); }
static int m_argmin(lua_State *L) { return argreduce(L, "argmin", MN_OP_min, true); }
static int l_argmax(lua_State *L) { return argreduce(L, "argmax", MN_OP_max, false); }
static int l_argmin(lua_State *L) { return argreduce(L, "argmin", MN_OP_min, false); }

static int matmul_at(lua_State *L, fname_t f)
{
    lua_settop(L, 2);
    mn_tensor *a = f.base ? self_tensor(L, f) : arg_tensor(L, f, 1);
    mn_tensor *b = arg_tensor(L, f, 2);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, f.name, mn_matmul(out, a, b));
    return 1;
}

static int m_matmul(lua_State *L) { return matmul_at(L, METHOD("matmul")); }
static int m_mm(lua_State *L) { return matmul_at(L, METHOD("mm")); }
static int l_matmul(lua_State *L) { return matmul_at(L, FN("matmul")); }
static int l_mm(lua_State *L) { return matmul_at(L, FN("mm")); }

/* where(c, a, b): numbers for a or b take the other's dtype. */
static int l_where(lua_State *L)
{
    fname_t f = FN("where");
    lua_settop(L, 3);
    mn_tensor *c = arg_tensor(L, f, 1);
    mn_tensor *ta = l_test_tensor(L, 2), *tb = l_test_tensor(L, 3);
    mn_dtype dt = ta ? ta->dtype : tb ? tb->dtype : MN_F32;
    mn_device dev = device_of(c); /* numbers join c on its device */
    mn_tensor *a = lua_type(L, 2) == LUA_TNUMBER ? value_to_tensor(L, f, 2, dt, dev) : arg_tensor(L, f, 2);
    mn_tensor *b = lua_type(L, 3) == LUA_TNUMBER ? value_to_tensor(L, f, 3, dt, dev) : arg_tensor(L, f, 3);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "where", mn_where(out, c, a, b));
    return 1;
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

typedef struct { const char *name; lua_CFunction fn; const char *doc; } l_doc_reg;

#define DIMS_NOTE " Dims and indices are 1-based; negative ones count from the end (-1 = last)."

static const l_doc_reg tensor_methods[] = {
    { "size", m_size, "t:size([dim]) -> a table of sizes, or the size of dim." DIMS_NOTE },
    { "dim", m_dim, "t:dim() -> the number of dims (as t.ndim)" },
    { "numel", m_numel, "t:numel() -> the number of elements" },
    { "stride", m_stride, "t:stride([dim]) -> a table of strides (in elements), or the stride of dim" },
    { "is_contiguous", m_is_contiguous, "t:is_contiguous() -> true when row-major with no gaps" },
    { "view", m_view, "t:view(d1, d2, ... | {shape}) -> a view with that shape sharing storage; one size may be -1 (inferred); errors when the strides do not allow a view (use reshape)" },
    { "reshape", m_reshape, "t:reshape(d1, d2, ... | {shape}) -> a view when possible, else a contiguous copy; one size may be -1" },
    { "transpose", m_transpose, "t:transpose(d1, d2) -> a view with dims d1 and d2 swapped." DIMS_NOTE },
    { "t", m_t, "t:t() -> the transpose of a 2-d tensor (a view); 0-d and 1-d tensors come back as they are" },
    { "permute", m_permute, "t:permute(d1, d2, ...) -> a view with the dims in that order (1-based)" },
    { "unsqueeze", m_unsqueeze, "t:unsqueeze(d) -> a view with a new size-1 dim at position d (1..ndim+1; -1 = a new last dim)" },
    { "squeeze", m_squeeze, "t:squeeze([d]) -> a view without size-1 dims (all, or only d)" },
    { "expand", m_expand, "t:expand(d1, d2, ... | {shape}) -> a broadcast view (stride 0 on expanded dims); -1 keeps a size" },
    { "narrow", m_narrow, "t:narrow(dim, start, length) -> a view of length elements from start (1-based) along dim" },
    { "slice", m_slice, "t:slice(dim, start [, stop [, step]]) -> a view of start..stop (inclusive, torch7 style; stop defaults to -1, the last) along dim, every step-th element." DIMS_NOTE },
    { "select", m_select, "t:select(dim, i) -> a view with dim removed, fixed at index i (a 0-d tensor for a 1-d t)." DIMS_NOTE },
    { "contiguous", m_contiguous, "t:contiguous() -> t itself when contiguous, else a contiguous copy" },
    { "clone", m_clone, "t:clone() -> a contiguous copy with its own storage" },
    { "float", m_float, "t:float() -> t as f32 (t itself when already f32)" },
    { "double", m_double, "t:double() -> t as f64 (t itself when already f64)" },
    { "long", m_long, "t:long() -> t as i64, truncating (t itself when already i64)" },
    { "to", m_to, "t:to(dtype | device | {dtype=, device=}) -> t converted ('f32', 'f64', 'i64', 'cpu', 'cuda'); t itself when nothing changes" },
    { "cpu", m_cpu, "t:cpu() -> t on the CPU (t itself when already there)" },
    { "cuda", m_cuda, "t:cuda() -> t on the GPU" },
    { "copy", m_copy, "t:copy(src) -> t, after copying src into it in place (broadcast, converting dtype)" },
    { "fill", m_fill, "t:fill(v) -> t, every element set to v in place" },
    { "zero", m_zero, "t:zero() -> t, every element set to 0 in place" },
    { "item", m_item, "t:item() -> the one element of t as a Lua number (an integer for i64)" },
    { "tolist", m_tolist, "t:tolist() -> nested Lua tables of numbers (a number for a 0-d t)" },
    { "totable", m_tolist, "t:totable() -> the same as t:tolist()" },
    { "any", m_any, "t:any() -> true when some element is nonzero" },
    { "all", m_all, "t:all() -> true when every element is nonzero (true for an empty t)" },
    { "argmax", m_argmax, "t:argmax([dim [, keepdim]]) -> 1-based indices of the largest elements along dim (an i64 tensor), or the 1-based flat index over the whole tensor (a number)" },
    { "argmin", m_argmin, "t:argmin([dim [, keepdim]]) -> 1-based indices of the smallest elements along dim (an i64 tensor), or the 1-based flat index over the whole tensor" },
    { "matmul", m_matmul, "t:matmul(b) -> the matrix product (torch.matmul rules: 1-d . 1-d gives a 0-d tensor, batched for >= 3-d)" },
    { "mm", m_mm, "t:mm(b) -> the same as t:matmul(b)" },
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
    { "cat", l_cat, "mnemo.cat({a, b, ...} [, dim]) -> the tensors joined along an existing dim (default 1)" },
    { "stack", l_stack, "mnemo.stack({a, b, ...} [, dim]) -> the tensors stacked along a new dim (default 1)" },
    { "matmul", l_matmul, "mnemo.matmul(a, b) -> the matrix product (torch.matmul rules)" },
    { "mm", l_mm, "mnemo.mm(a, b) -> the same as mnemo.matmul(a, b)" },
    { "where", l_where, "mnemo.where(c, a, b) -> a where c is nonzero, else b (broadcast; a number takes the other's dtype)" },
    { "argmax", l_argmax, "mnemo.argmax(t [, dim [, keepdim]]) -> as t:argmax (1-based)" },
    { "argmin", l_argmin, "mnemo.argmin(t [, dim [, keepdim]]) -> as t:argmin (1-based)" },
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
static void set_doc(lua_State *L, const char *prefix, const char *name, const char *doc)
{
    lua_pushfstring(L, "%s%s", prefix, name);
    lua_pushstring(L, doc);
    lua_rawset(L, -3);
}

static void push_op_closure(lua_State *L, lua_CFunction fn, int op, bool method)
{
    lua_pushinteger(L, op);
    lua_pushboolean(L, method);
    lua_pushcclosure(L, fn, 2);
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
    lua_newtable(L);
    int opdocs = lua_gettop(L);
    static const struct { const char *name; const char *doc; int kind; } ops[] = {
#define MN_UNARY(name, doc) { #name, doc, MN_OPKIND_UNARY },
#define MN_BINARY(name, meta, doc) { #name, doc, MN_OPKIND_BINARY },
#define MN_REDUCE(name, doc) { #name, doc, MN_OPKIND_REDUCE },
#include "../model/ops.def"
    };
    for (int op = 0; op < MN_OP_COUNT; op++) {
        const char *name = ops[op].name, *doc = ops[op].doc;
        lua_CFunction fn = ops[op].kind == MN_OPKIND_UNARY ? l_unary
                         : ops[op].kind == MN_OPKIND_BINARY ? l_binary : l_reduce;
        push_op_closure(L, fn, op, true);
        lua_setfield(L, methods, name);
        push_op_closure(L, fn, op, false);
        lua_setfield(L, mod, name);
        lua_pushstring(L, doc);
        lua_setfield(L, opdocs, name);
        char key[64], text[512];
        lua_pushvalue(L, docs);
        snprintf(key, sizeof key, "%s", name);
        if (ops[op].kind == MN_OPKIND_UNARY) {
            snprintf(text, sizeof text, "t:%s() -> elementwise %s", name, doc);
            set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(x) -> elementwise %s (a number for a number)", name, doc);
            set_doc(L, "mnemo.", key, text);
        } else if (ops[op].kind == MN_OPKIND_BINARY) {
            snprintf(text, sizeof text, "t:%s(x) -> elementwise %s, with a = t and b = x (a tensor or number, broadcast)", name, doc);
            set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(a, b) -> elementwise %s (tensors or numbers, broadcast; numbers give a number)", name, doc);
            set_doc(L, "mnemo.", key, text);
        } else {
            snprintf(text, sizeof text, "t:%s([dim [, keepdim]]) -> %s: a number over the whole tensor, or a tensor along dim (1-based, -1 = last)", name, doc);
            set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(t [, dim [, keepdim]]) -> %s (as t:%s)", name, doc, name);
            set_doc(L, "mnemo.", key, text);
        }
        lua_pop(L, 1);
    }
    lua_setfield(L, mod, "_opdocs");

    for (const l_doc_reg *r = tensor_methods; r->name; r++) {
        lua_pushcfunction(L, r->fn);
        lua_setfield(L, methods, r->name);
        lua_pushvalue(L, docs);
        set_doc(L, "Tensor:", r->name, r->doc);
        lua_pop(L, 1);
    }
    lua_pushvalue(L, docs);
    for (size_t i = 0; i < sizeof field_docs / sizeof field_docs[0]; i++)
        set_doc(L, "Tensor.", field_docs[i].name, field_docs[i].doc);
    set_doc(L, "Tensor", "[]",
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
        { "__len", m_len }, { "__tostring", m_tostring }, { "__unm", l_unm }, { NULL, NULL }
    };
    luaL_setfuncs(L, metas, 0);
    static const struct { int op; const char *meta; } metaops[] = {
#define MN_BINARY(name, meta, doc) { MN_OP_##name, meta },
#include "../model/ops.def"
    };
    for (size_t i = 0; i < sizeof metaops / sizeof metaops[0]; i++) {
        if (!metaops[i].meta) continue;
        push_op_closure(L, l_metabinary, metaops[i].op, false);
        lua_setfield(L, mt, metaops[i].meta);
    }
    lua_pop(L, 1); /* metatable */

    /* Module functions. */
    for (const l_doc_reg *r = module_funcs; r->name; r++) {
        lua_pushcfunction(L, r->fn);
        lua_setfield(L, mod, r->name);
        lua_pushvalue(L, docs);
        set_doc(L, "mnemo.", r->name, r->doc);
        lua_pop(L, 1);
    }
    lua_pushvalue(L, methods);
    lua_setfield(L, mod, "Tensor");
    lua_settop(L, mod);
}
