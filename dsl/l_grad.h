/* l_grad.h: the hook rule:run uses to make its result differentiable
 * (dsl/l_grad.c). */
#ifndef MN_L_GRAD_H
#define MN_L_GRAD_H

#include "dsl.h"
#include "../model/engine.h"

/* Before the run: with opts.grad true, push the context that res:backward
 * will need (it owns the forward's checkpoints) and return its stack index;
 * else push nothing and return 0. */
int l_grad_begin(lua_State *L, int opts);
/* The run's forward: with a context (ctx_idx != 0) on the cpu, in segments
 * that keep the backward's checkpoints; else mn_segment_run. */
mn_status l_grad_forward(lua_State *L, int ctx_idx, mn_memory_state *st, const mn_segment_inputs *in,
                         mn_segment_outputs *out);
/* Give the result table at the top of the stack its metatable (methods of
 * mnemo.Result) and, with a context, fill it: the rule, the call's k, v, q
 * (from the table at opts), the resolved inputs and gates in, and the
 * initial state (shared, not copied). */
void l_grad_attach(lua_State *L, int ctx_idx, const mn_rule *rule, int opts, const mn_dims *d,
                   const mn_segment_inputs *in, const mn_tensor *params, const mn_tensor *momenta,
                   const mn_tensor *outer);

#endif
