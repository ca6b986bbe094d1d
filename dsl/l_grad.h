/* l_grad.h: the hook rule:run uses to make its result differentiable
 * (dsl/l_grad.c). */
#ifndef MN_L_GRAD_H
#define MN_L_GRAD_H

#include "dsl.h"
#include "../model/engine.h"

/* Give the result table at the top of the stack its metatable (methods of
 * mnemo.Result); with opts.grad true, also what res:backward needs: the
 * rule, the call's k, v, q (from the table at opts), the resolved inputs and
 * gates in, and the initial state (shared, not copied). */
void l_grad_attach(lua_State *L, const mn_rule *rule, int opts, const mn_dims *d, const mn_segment_inputs *in,
                   const mn_tensor *params, const mn_tensor *momenta);

#endif
