/* dsl.h: what the Lua-facing files share. Only dsl/ and repl/ include Lua;
 * they turn mn_status failures into Lua errors after freeing what they own. */
#ifndef MN_DSL_H
#define MN_DSL_H

#include <lua.h>
#include <lauxlib.h>

#include "../model/tensor.h"
#include "../model/tree.h"

#define MN_TENSOR_MT "mnemo.Tensor"

/* Opens the `mnemo` module (the table is left on the stack): tensors, I/O,
 * expressions, rules; then runs the embedded prelude (dsl/prelude.lua). */
int luaopen_mnemo(lua_State *L);

/* Each registrar adds its functions to the module table at index -1 and may
 * create metatables in the registry. */
void l_tensor_register(lua_State *L);
void l_h5_register(lua_State *L);
void l_expr_register(lua_State *L);
void l_rule_register(lua_State *L);
void l_grad_register(lua_State *L);    /* dsl/l_grad.c: mnemo.Result, res:backward */
void l_compare_register(lua_State *L);
void l_progress_register(lua_State *L); /* dsl/l_progress.c: progress lines, a wall clock */
void l_kernel_info_register(lua_State *L); /* dsl/l_kernel_info.c: mnemo._profile_kernel_hook */

/* rule:kernel_info{...} for the rule r, options at index opts (dsl/l_kernel_info.c). */
struct mn_rule;
int l_rule_kernel_info(lua_State *L, const struct mn_rule *r, int opts);
int l_rule_plan(lua_State *L, const struct mn_rule *r, int opts);

/* Ownership before allocation: push a userdata holding an empty tensor with
 * the Tensor metatable; fill it afterwards (its __gc releases whatever it
 * ended up holding). */
mn_tensor *l_push_empty_tensor(lua_State *L);
mn_tensor *l_check_tensor(lua_State *L, int idx);
mn_tensor *l_test_tensor(lua_State *L, int idx); /* NULL when not a tensor */
/* A tensor from a tensor, a number (0-d f32) or a nested table (f32) at idx;
 * the result is pushed on the stack (so the GC owns it) and returned. */
mn_tensor *l_to_tensor(lua_State *L, int idx);
/* Raise a Lua error with mn_last_error(); never returns. */
int l_raise(lua_State *L);
/* After an engine call: a full collection when live GPU tensors grew by
 * more than 1 GiB since the last one (dsl/l_mnemo.c says why). */
void l_device_pressure(lua_State *L);
#define L_TRY(L, expr) do { if ((expr) != MN_OK) l_raise(L); } while (0)

/* Trees <-> Lua tables (numbers, integers, strings, booleans as 0/1,
 * tensors, nested tables); errors name the offending key path. */
void l_push_tree(lua_State *L, const mn_node *g);
mn_node *l_table_to_tree(lua_State *L, int idx, const char *root_name); /* raises on error */

#endif
