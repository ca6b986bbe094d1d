/* l_tensor_ops.c: the Tensor methods and mnemo functions that compute
 * tensors from tensors: views (t:view, t:slice, ... and the views named by an
 * indexing key), copies and conversions (t:clone, t:to, t:copy, mnemo.cat,
 * ...), values (t:item, t:tolist, t:any, t:all), the ops generated from
 * model/ops.def (unary and binary methods and module functions, reductions,
 * and the arithmetic and comparison metamethods), argmax / argmin, matmul and
 * where, with their docs. l_tensor_register (l_tensor.c) registers them
 * through the hooks of l_tensor_internal.h. */
#include "l_tensor_internal.h"
#include "../model/ops.h"
#include "../model/op_math.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- views */

static int infer_shape(lua_State *L, fname_t f, const mn_tensor *t, int nd, int64_t *shape)
{
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < nd; i++) {
        if (shape[i] == -1) {
            if (infer >= 0) l_argfail(L, f, 2, "only one size may be -1");
            infer = i;
        } else known *= shape[i];
    }
    int64_t numel = mn_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || numel % known != 0) {
            char buf[128];
            l_argfail(L, f, 2, "cannot infer the -1 size: %lld elements (shape %s) do not divide by %lld",
                    (long long)numel, mn_shape_string(t, buf, sizeof buf), (long long)known);
        }
        shape[infer] = numel / known;
    }
    return nd;
}

static int view_or_reshape(lua_State *L, const char *name, bool copy_if_needed)
{
    fname_t f = METHOD(name);
    mn_tensor *t = l_self_tensor(L, f);
    int64_t shape[MN_MAX_DIMS];
    int nd = l_parse_sizes(L, f, 2, lua_gettop(L), shape, true);
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
    mn_tensor *t = l_self_tensor(L, f);
    int a = l_check_dim(L, f, 2, t->ndim, 0), b = l_check_dim(L, f, 3, t->ndim, 0);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "transpose", mn_view_transpose(out, t, a, b));
    return 1;
}

static int m_t(lua_State *L)
{
    fname_t f = METHOD("t");
    mn_tensor *t = l_self_tensor(L, f);
    if (t->ndim > 2) l_argfail(L, f, 1, "t() needs a tensor of at most 2 dims, got %d (use transpose)", t->ndim);
    mn_tensor *out = l_push_empty_tensor(L);
    if (t->ndim < 2) mn_tensor_share(out, t);
    else TRY_IN(L, "t", mn_view_transpose(out, t, 0, 1));
    return 1;
}

static int m_permute(lua_State *L)
{
    fname_t f = METHOD("permute");
    mn_tensor *t = l_self_tensor(L, f);
    int64_t dims[MN_MAX_DIMS];
    int top = lua_gettop(L), n = 0;
    bool table = top == 2 && lua_istable(L, 2);
    n = table ? (int)lua_rawlen(L, 2) : top - 1;
    if (n != t->ndim) l_argfail(L, f, 2, "%d dims given for a %d-d tensor", n, t->ndim);
    int perm[MN_MAX_DIMS];
    bool seen[MN_MAX_DIMS] = { false };
    for (int i = 0; i < n; i++) {
        int idx = table ? 2 : i + 2, isnum = 0;
        int at = table ? (lua_geti(L, 2, i + 1), lua_gettop(L)) : idx;
        dims[i] = lua_type(L, at) == LUA_TNUMBER ? (int64_t)lua_tointegerx(L, at, &isnum) : 0;
        if (!isnum) l_argfail(L, f, idx, "dim %d must be an integer, %s", i + 1, l_got(L, at));
        perm[i] = l_resolve_dim(L, f, idx, dims[i], t->ndim, 0);
        if (seen[perm[i]]) l_argfail(L, f, idx, "dim %lld appears twice", (long long)dims[i]);
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
    mn_tensor *t = l_self_tensor(L, f);
    int d = l_check_dim(L, f, 2, t->ndim, 1);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "unsqueeze", mn_view_unsqueeze(out, t, d));
    return 1;
}

static int m_squeeze(lua_State *L)
{
    fname_t f = METHOD("squeeze");
    mn_tensor *t = l_self_tensor(L, f);
    int d = lua_isnoneornil(L, 2) ? -99 : l_check_dim(L, f, 2, t->ndim, 0);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "squeeze", mn_view_squeeze(out, t, d));
    return 1;
}

static int m_expand(lua_State *L)
{
    fname_t f = METHOD("expand");
    mn_tensor *t = l_self_tensor(L, f);
    int64_t shape[MN_MAX_DIMS];
    int nd = l_parse_sizes(L, f, 2, lua_gettop(L), shape, true);
    if (nd < t->ndim) l_argfail(L, f, 2, "%d sizes given for a %d-d tensor (expand cannot drop dims)", nd, t->ndim);
    for (int i = 0; i < nd; i++) {
        if (shape[i] != -1) continue;
        int j = i - (nd - t->ndim);
        if (j < 0) l_argfail(L, f, 2, "size -1 (keep) is not allowed for the new leading dim %d", i + 1);
        shape[i] = t->shape[j];
    }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "expand", mn_view_expand(out, t, nd, shape));
    return 1;
}

static int m_narrow(lua_State *L)
{
    fname_t f = METHOD("narrow");
    mn_tensor *t = l_self_tensor(L, f);
    int d = l_check_dim(L, f, 2, t->ndim, 0);
    int64_t size = t->shape[d];
    int64_t s = l_check_int(L, f, 3, "start"), len = l_check_int(L, f, 4, "length");
    int64_t s0 = (len == 0 && (s == size + 1)) ? size : l_resolve_index(L, f, 3, s, d, size);
    if (len < 0 || s0 + len > size)
        l_argfail(L, f, 4, "length %lld from index %lld runs past dim %d of size %lld", (long long)len,
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
    mn_tensor *t = l_self_tensor(L, f);
    int d = l_check_dim(L, f, 2, t->ndim, 0);
    int64_t size = t->shape[d];
    int64_t a0 = l_resolve_index(L, f, 3, l_check_int(L, f, 3, "start"), d, size);
    int64_t b0 = lua_isnoneornil(L, 4) ? size - 1
                                       : l_resolve_index(L, f, 4, l_check_int(L, f, 4, "stop"), d, size);
    int64_t step = lua_isnoneornil(L, 5) ? 1 : l_check_int(L, f, 5, "step");
    if (step < 1) l_argfail(L, f, 5, "step must be >= 1, got %lld", (long long)step);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "slice", mn_view_slice(out, t, d, a0, range_stop(a0, b0), step));
    return 1;
}

static int m_select(lua_State *L)
{
    fname_t f = METHOD("select");
    mn_tensor *t = l_self_tensor(L, f);
    int d = l_check_dim(L, f, 2, t->ndim, 0);
    int64_t i = l_resolve_index(L, f, 3, l_check_int(L, f, 3, "index"), d, t->shape[d]);
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
        if (!isnum) luaL_error(L, "%s: index must be an integer, %s", f.name, l_got(L, key));
        if (t->ndim == 0) luaL_error(L, "%s: cannot index a 0-d tensor (use t:item())", f.name);
        ops[0] = (index_op){ true, 0, l_resolve_index(L, f, 0, i, 0, t->shape[0]), 0, 1 };
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
            if (!isnum) luaL_error(L, "%s: entry %d must be an integer or a range, %s", f.name, k, l_got(L, -1));
            ops[nops] = (index_op){ true, dim, l_resolve_index(L, f, 0, i, src_dim, size), 0, 1 };
        } else if (ty == LUA_TTABLE) {
            int m = (int)lua_rawlen(L, -1);
            int64_t r[3] = { 1, -1, 1 };
            if (m > 3) luaL_error(L, "%s: range for dim %d has %d entries (expected {}, {i}, {a, b} or {a, b, step})", f.name, k, m);
            for (int j = 0; j < m; j++) {
                lua_geti(L, -1, j + 1);
                int isnum = 0;
                lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isnum) : 0;
                if (!isnum) luaL_error(L, "%s: range for dim %d: entry %d must be an integer, %s", f.name, k, j + 1, l_got(L, -1));
                r[j] = v;
                lua_pop(L, 1);
            }
            if (m == 1) r[1] = r[0];
            if (r[2] < 1) l_failf(L, "%s: range for dim %d: step must be >= 1, got %lld", f.name, k, (long long)r[2]);
            int64_t a0 = 0, b0 = size - 1;
            if (m >= 1) {
                a0 = l_resolve_index(L, f, 0, r[0], src_dim, size);
                b0 = l_resolve_index(L, f, 0, r[1], src_dim, size);
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
void l_index_view(lua_State *L, fname_t f, const mn_tensor *t, int key, mn_tensor *out)
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
        if (st != MN_OK) l_raise_in(L, f.name);
        cur = next;
    }
    *out = cur;
}

/* ---------------------------------------------------------------- copies */

static int m_contiguous(lua_State *L)
{
    mn_tensor *t = l_self_tensor(L, METHOD("contiguous"));
    if (mn_tensor_is_contiguous(t)) { lua_settop(L, 1); return 1; }
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "contiguous", mn_tensor_contiguous(out, t));
    return 1;
}

static int m_clone(lua_State *L)
{
    mn_tensor *t = l_self_tensor(L, METHOD("clone"));
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

static int m_float(lua_State *L) { mn_tensor *t = l_self_tensor(L, METHOD("float")); return convert(L, "float", t, MN_F32, device_of(t)); }
static int m_double(lua_State *L) { mn_tensor *t = l_self_tensor(L, METHOD("double")); return convert(L, "double", t, MN_F64, device_of(t)); }
static int m_long(lua_State *L) { mn_tensor *t = l_self_tensor(L, METHOD("long")); return convert(L, "long", t, MN_I64, device_of(t)); }
static int m_cpu(lua_State *L) { mn_tensor *t = l_self_tensor(L, METHOD("cpu")); return convert(L, "cpu", t, t->dtype, MN_CPU); }
static int m_cuda(lua_State *L) { mn_tensor *t = l_self_tensor(L, METHOD("cuda")); return convert(L, "cuda", t, t->dtype, MN_CUDA); }

static int m_to(lua_State *L)
{
    fname_t f = METHOD("to");
    mn_tensor *t = l_self_tensor(L, f);
    mn_dtype dt = t->dtype;
    mn_device dev = device_of(t);
    int top = lua_gettop(L);
    if (top < 2) l_argfail(L, f, 2, "expected a dtype, a device or {dtype=, device=}");
    for (int i = 2; i <= top; i++) {
        if (lua_type(L, i) == LUA_TSTRING) l_parse_type_string(L, f, i, &dt, &dev);
        else if (lua_istable(L, i)) l_parse_options(L, f, i, &dt, &dev);
        else l_argfail(L, f, i, "expected a dtype, a device or {dtype=, device=}, %s", l_got(L, i));
    }
    lua_settop(L, 1);
    return convert(L, "to", t, dt, dev);
}

static int m_copy(lua_State *L)
{
    fname_t f = METHOD("copy");
    lua_settop(L, 2);
    mn_tensor *t = l_self_tensor(L, f);
    mn_tensor *src = l_arg_tensor(L, f, 2);
    TRY_IN(L, "copy", mn_tensor_copy_into(t, src));
    lua_settop(L, 1);
    return 1;
}

static int m_fill(lua_State *L)
{
    fname_t f = METHOD("fill");
    mn_tensor *t = l_self_tensor(L, f);
    TRY_IN(L, "fill", mn_tensor_fill(t, l_check_num(L, f, 2, "value")));
    lua_settop(L, 1);
    return 1;
}

static int m_zero(lua_State *L)
{
    mn_tensor *t = l_self_tensor(L, METHOD("zero"));
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
    if (n < 1) l_argfail(L, f, 1, "expected a non-empty list of tensors");
    luaL_checkstack(L, n + 4, "too many tensors");
    const mn_tensor **parts = lua_newuserdatauv(L, (size_t)n * sizeof *parts, 0);
    for (int i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        mn_tensor *p = l_test_tensor(L, -1);
        if (p && !p->storage) l_argfail(L, f, 1, "entry [%d] is a closed tensor", i + 1);
        if (!p) {
            int ty = lua_type(L, -1);
            if (ty != LUA_TNUMBER && ty != LUA_TTABLE)
                l_argfail(L, f, 1, "entry [%d] must be a tensor, got %s", i + 1, luaL_typename(L, -1));
            p = l_value_to_tensor(L, f, lua_gettop(L), MN_F32, MN_CPU);
        }
        parts[i] = p; /* kept alive on the stack */
    }
    if (!stack && parts[0]->ndim == 0) l_argfail(L, f, 1, "entry [1] is 0-d: cat needs at least 1 dim (use stack)");
    int d = lua_isnoneornil(L, 2) ? 0 : l_check_dim(L, f, 2, parts[0]->ndim, stack ? 1 : 0);
    /* Shapes checked here so that the message counts dims from 1. */
    for (int i = 1; i < n; i++) {
        char a[160], b[160];
        const mn_tensor *p = parts[i], *q = parts[0];
        bool ok = p->ndim == q->ndim;
        for (int k = 0; ok && k < q->ndim; k++) ok = p->shape[k] == q->shape[k] || (!stack && k == d);
        if (!ok)
            l_argfail(L, f, 1, "entry [%d] has shape %s, entry [1] has %s (%s)", i + 1,
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
    mn_tensor *t = l_self_tensor(L, f);
    if (mn_tensor_numel(t) != 1) {
        char buf[128];
        l_argfail(L, f, 1, "item() needs exactly one element, the tensor has %lld (shape %s)",
                (long long)mn_tensor_numel(t), mn_shape_string(t, buf, sizeof buf));
    }
    const mn_tensor *h = l_on_host(L, "item", t);
    int64_t index[MN_MAX_DIMS] = { 0 };
    l_push_element(L, h, index);
    return 1;
}

static void push_list(lua_State *L, const mn_tensor *t, int d, int64_t *index)
{
    if (d == t->ndim) { l_push_element(L, t, index); return; }
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
    mn_tensor *t = l_self_tensor(L, METHOD("tolist"));
    const mn_tensor *h = l_on_host(L, "tolist", t);
    int64_t index[MN_MAX_DIMS] = { 0 };
    push_list(L, h, 0, index);
    return 1;
}

/* any / all: whether any / every element is nonzero (NaN counts as nonzero). */
static int any_all(lua_State *L, const char *name, bool all)
{
    mn_tensor *t = l_self_tensor(L, METHOD(name));
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
    mn_tensor *a = is_method(L) ? l_self_tensor(L, f) : l_arg_tensor(L, f, 1);
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
        mn_tensor *a = l_arg_tensor(L, f, ia);
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_binary_scalar(op, out, a, lua_tonumber(L, ib), false));
        return 1;
    }
    if (na) {
        mn_tensor *b = l_arg_tensor(L, f, ib);
        mn_tensor *out = l_push_empty_tensor(L);
        TRY_IN(L, f.name, mn_binary_scalar(op, out, b, lua_tonumber(L, ia), true));
        return 1;
    }
    mn_tensor *a = l_arg_tensor(L, f, ia);
    mn_tensor *b = l_arg_tensor(L, f, ib);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, f.name, mn_binary(op, out, a, b));
    return 1;
}

static int l_binary(lua_State *L)
{
    mn_op op = op_upvalue(L);
    const char *name = mn_op_name(op);
    if (is_method(L)) {
        l_self_tensor(L, METHOD(name));
        if (lua_isnone(L, 2)) return l_argfail(L, METHOD(name), 2, "expected a tensor or number, got no value");
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
    mn_tensor *a = is_method(L) ? l_self_tensor(L, f) : l_arg_tensor(L, f, 1);
    if (lua_isnil(L, 2)) {
        double v = 0;
        TRY_IN(L, name, mn_reduce_all(op, a, &v));
        push_reduced(L, a->dtype, op, v);
        return 1;
    }
    int d = l_check_dim(L, f, 2, a->ndim, 0);
    if ((op == MN_OP_max || op == MN_OP_min) && a->shape[d] == 0 && mn_tensor_numel(a) == 0) {
        char buf[160];
        int64_t rest = 1;
        for (int k = 0; k < a->ndim; k++) if (k != d) rest *= a->shape[k];
        if (rest > 0) l_argfail(L, f, 2, "dim %d of %s has size 0: no %s", d + 1, mn_shape_string(a, buf, sizeof buf), name);
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
    mn_tensor *a = method ? l_self_tensor(L, f) : l_arg_tensor(L, f, 1);
    if (lua_isnil(L, 2)) { /* over the whole tensor: a flat 1-based index */
        if (mn_tensor_numel(a) == 0) l_argfail(L, f, 1, "%s of an empty tensor", name);
        mn_tensor *idx = l_push_empty_tensor(L);
        int64_t flat = mn_tensor_numel(a);
        mn_tensor *v = l_push_empty_tensor(L);
        if (mn_view_reshape(v, a, 1, &flat) != MN_OK) {
            mn_tensor *c = l_push_empty_tensor(L);
            TRY_IN(L, name, mn_tensor_contiguous(c, a));
            TRY_IN(L, name, mn_view_reshape(v, c, 1, &flat));
        }
        TRY_IN(L, name, mn_argreduce_dim(op, idx, v, 0, false));
        const mn_tensor *h = l_on_host(L, name, idx);
        int64_t none[MN_MAX_DIMS] = { 0 };
        l_push_element(L, h, none);
        lua_pushinteger(L, lua_tointeger(L, -1) + 1);
        return 1;
    }
    int d = l_check_dim(L, f, 2, a->ndim, 0);
    if (a->shape[d] == 0) {
        char buf[160];
        l_argfail(L, f, 2, "dim %d of %s has size 0: no %s", d + 1, mn_shape_string(a, buf, sizeof buf), name);
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
    mn_tensor *a = f.base ? l_self_tensor(L, f) : l_arg_tensor(L, f, 1);
    mn_tensor *b = l_arg_tensor(L, f, 2);
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
    mn_tensor *c = l_arg_tensor(L, f, 1);
    mn_tensor *ta = l_test_tensor(L, 2), *tb = l_test_tensor(L, 3);
    mn_dtype dt = ta ? ta->dtype : tb ? tb->dtype : MN_F32;
    mn_device dev = device_of(c); /* numbers join c on its device */
    mn_tensor *a = lua_type(L, 2) == LUA_TNUMBER ? l_value_to_tensor(L, f, 2, dt, dev) : l_arg_tensor(L, f, 2);
    mn_tensor *b = lua_type(L, 3) == LUA_TNUMBER ? l_value_to_tensor(L, f, 3, dt, dev) : l_arg_tensor(L, f, 3);
    mn_tensor *out = l_push_empty_tensor(L);
    TRY_IN(L, "where", mn_where(out, c, a, b));
    return 1;
}

/* ---------------------------------------------------------------- registration */

const l_doc_reg l_tensor_ops_methods[] = {
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

const l_doc_reg l_tensor_ops_funcs[] = {
    { "cat", l_cat, "mnemo.cat({a, b, ...} [, dim]) -> the tensors joined along an existing dim (default 1)" },
    { "stack", l_stack, "mnemo.stack({a, b, ...} [, dim]) -> the tensors stacked along a new dim (default 1)" },
    { "matmul", l_matmul, "mnemo.matmul(a, b) -> the matrix product (torch.matmul rules)" },
    { "mm", l_mm, "mnemo.mm(a, b) -> the same as mnemo.matmul(a, b)" },
    { "where", l_where, "mnemo.where(c, a, b) -> a where c is nonzero, else b (broadcast; a number takes the other's dtype)" },
    { "argmax", l_argmax, "mnemo.argmax(t [, dim [, keepdim]]) -> as t:argmax (1-based)" },
    { "argmin", l_argmin, "mnemo.argmin(t [, dim [, keepdim]]) -> as t:argmin (1-based)" },
    { NULL, NULL, NULL }
};

static void push_op_closure(lua_State *L, lua_CFunction fn, int op, bool method)
{
    lua_pushinteger(L, op);
    lua_pushboolean(L, method);
    lua_pushcclosure(L, fn, 2);
}

void l_tensor_ops_register(lua_State *L, int mod, int methods, int docs)
{
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
            l_set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(x) -> elementwise %s (a number for a number)", name, doc);
            l_set_doc(L, "mnemo.", key, text);
        } else if (ops[op].kind == MN_OPKIND_BINARY) {
            snprintf(text, sizeof text, "t:%s(x) -> elementwise %s, with a = t and b = x (a tensor or number, broadcast)", name, doc);
            l_set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(a, b) -> elementwise %s (tensors or numbers, broadcast; numbers give a number)", name, doc);
            l_set_doc(L, "mnemo.", key, text);
        } else {
            snprintf(text, sizeof text, "t:%s([dim [, keepdim]]) -> %s: a number over the whole tensor, or a tensor along dim (1-based, -1 = last)", name, doc);
            l_set_doc(L, "Tensor:", key, text);
            snprintf(text, sizeof text, "mnemo.%s(t [, dim [, keepdim]]) -> %s (as t:%s)", name, doc, name);
            l_set_doc(L, "mnemo.", key, text);
        }
        lua_pop(L, 1);
    }
    lua_setfield(L, mod, "_opdocs");
}

void l_tensor_ops_metatable(lua_State *L, int mt)
{
    lua_pushcfunction(L, l_unm);
    lua_setfield(L, mt, "__unm");
    static const struct { int op; const char *meta; } metaops[] = {
#define MN_BINARY(name, meta, doc) { MN_OP_##name, meta },
#include "../model/ops.def"
    };
    for (size_t i = 0; i < sizeof metaops / sizeof metaops[0]; i++) {
        if (!metaops[i].meta) continue;
        push_op_closure(L, l_metabinary, metaops[i].op, false);
        lua_setfield(L, mt, metaops[i].meta);
    }
}
