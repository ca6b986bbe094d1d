/* l_expr.h: Expr userdata helpers shared by the rule builder. */
#ifndef MN_L_EXPR_H
#define MN_L_EXPR_H

#include "../model/expr.h"
#include "dsl.h"

/* Push an Expr holding e (takes the reference; NULL raises the pending error). */
void l_push_expr(lua_State *L, mn_expr *e);
mn_expr *l_test_expr(lua_State *L, int idx);
/* A new reference from an Expr, number or string at idx; raises otherwise. */
mn_expr *l_to_expr(lua_State *L, int idx, const char *what);

#endif
