/* l_tensor_internal.h: what l_tensor.c (the Tensor userdata, argument
 * parsing, constructors, registration) and l_tensor_ops.c (views, copies and
 * the ops from model/ops.def) share: the error helpers, the argument parsers,
 * value -> tensor conversion, and the hooks l_tensor_register calls to
 * register the ops. Not for other files. */
#ifndef MN_L_TENSOR_INTERNAL_H
#define MN_L_TENSOR_INTERNAL_H

#include "dsl.h"

#include <stdbool.h>
#include <stdint.h>

/* Who is complaining: a function (arguments counted from 1) or a method
 * (self is not counted, as Lua counts it for t:f(...)). */
typedef struct { const char *name; int base; } fname_t;
#define FN(n) ((fname_t){ (n), 0 })
#define METHOD(n) ((fname_t){ (n), 1 })

/* "f: bad argument #n (msg)", or "f: bad self (msg)"; never returns. */
int l_argfail(lua_State *L, fname_t f, int idx, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* luaL_error with printf's formats (lua_pushfstring has no %lld). */
int l_failf(lua_State *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The engine's message, prefixed with the function name unless it has it. */
int l_raise_in(lua_State *L, const char *fn);
/* "got -1", "got 2.5", "got string" for messages; the string lives on the stack. */
const char *l_got(lua_State *L, int idx);

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
        if (try_in_st_ != MN_OK) l_raise_in((L), (fn));                        \
    } while (0)

mn_tensor *l_self_tensor(lua_State *L, fname_t f);

static inline mn_device device_of(const mn_tensor *t)
{
    return t->storage ? t->storage->device : MN_CPU;
}

/* Arguments (l_tensor.c). Dims and indices are 1-based or negative. */
int64_t l_check_int(lua_State *L, fname_t f, int idx, const char *what);
double l_check_num(lua_State *L, fname_t f, int idx, const char *what);
int l_resolve_dim(lua_State *L, fname_t f, int idx, int64_t d, int ndim, int extra);
int l_check_dim(lua_State *L, fname_t f, int idx, int ndim, int extra);
int64_t l_resolve_index(lua_State *L, fname_t f, int idx, int64_t i, int dim, int64_t size);
void l_parse_type_string(lua_State *L, fname_t f, int idx, mn_dtype *dt, mn_device *dev);
int l_parse_options(lua_State *L, fname_t f, int top, mn_dtype *dt, mn_device *dev);
int l_parse_sizes(lua_State *L, fname_t f, int first, int last, int64_t *shape, bool allow_m1);

/* Values and tensors (l_tensor.c); each pushes what it makes. */
mn_tensor *l_value_to_tensor(lua_State *L, fname_t f, int idx, mn_dtype dt, mn_device dev);
mn_tensor *l_arg_tensor(lua_State *L, fname_t f, int idx);
const mn_tensor *l_on_host(lua_State *L, const char *fn, const mn_tensor *t);
void l_push_element(lua_State *L, const mn_tensor *t, const int64_t *index);

/* The view of t named by the indexing key at index key, into out (pushed by
 * the caller); l_tensor_ops.c. */
void l_index_view(lua_State *L, fname_t f, const mn_tensor *t, int key, mn_tensor *out);

/* Registration. */
typedef struct { const char *name; lua_CFunction fn; const char *doc; } l_doc_reg;

#define DIMS_NOTE " Dims and indices are 1-based; negative ones count from the end (-1 = last)."

/* Set docs[prefix .. name] = doc, docs at the stack top. */
void l_set_doc(lua_State *L, const char *prefix, const char *name, const char *doc);

/* l_tensor_ops.c: the methods and module functions it defines (NULL-ended),
 * registered by l_tensor_register after its own. */
extern const l_doc_reg l_tensor_ops_methods[];
extern const l_doc_reg l_tensor_ops_funcs[];
/* The ops of model/ops.def as methods, module functions, docs and
 * mnemo._opdocs (stack unchanged). */
void l_tensor_ops_register(lua_State *L, int mod, int methods, int docs);
/* __unm and the arithmetic / comparison metamethods, into the metatable at mt. */
void l_tensor_ops_metatable(lua_State *L, int mt);

#endif
