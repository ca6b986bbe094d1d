/* l_rule_internal.h: what l_rule.c (building and describing rules) and
 * l_run.c (running them) share: the Rule userdata, the metatable names, two
 * helpers of l_rule.c that running uses, and the run-side methods that
 * l_rule_register registers. Not for other files. */
#ifndef MN_L_RULE_INTERNAL_H
#define MN_L_RULE_INTERNAL_H

#include "dsl.h"
#include "../model/engine.h"

#define RULE_MT "mnemo.Rule"
#define MEMORY_MT "mnemo.Memory"

typedef struct l_rule {
    mn_rule rule;
    bool ready;
} l_rule;

static inline l_rule *check_rule(lua_State *L, int idx) { return luaL_checkudata(L, idx, RULE_MT); }

/* l_rule.c */
int l_rule_field_int(lua_State *L, int t, const char *key, int dflt);
void l_push_rule_attrs(lua_State *L, const mn_rule *r);

/* l_run.c: Rule methods */
int l_rule_run(lua_State *L);
int l_rule_experiment(lua_State *L);
int l_rule_memory(lua_State *L);

/* l_run.c: Memory methods and metamethods */
int l_memory_write(lua_State *L);
int l_memory_run(lua_State *L);
int l_memory_read(lua_State *L);
int l_memory_reset(lua_State *L);
int l_memory_state(lua_State *L);
int l_memory_gc(lua_State *L);
int l_memory_index(lua_State *L);
int l_memory_tostring(lua_State *L);

#endif
