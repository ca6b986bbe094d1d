/* grad_files.h: gradients in files (SPEC.md section 5) and upstream names
 * shared with the Lua side: dy, dloss, d<param> (dW1, db1, ...) and
 * dS_<param> (dS_W1, ...). */
#ifndef MN_GRAD_FILES_H
#define MN_GRAD_FILES_H

#include "experiment.h"
#include "grad.h"

/* Put t (shared) in the upstream slot called name; an unknown name is an
 * error "<where><name>: unknown upstream gradient (one of: dy, dloss, ...)". */
mn_status mn_upstream_set(const mn_rule *rule, mn_run_upstream *up, const char *name, const mn_tensor *t,
                          const char *where);
/* "dy, dloss, dW1, ..., dS_W1, ..." for messages and help. */
mn_status mn_upstream_names(const mn_rule *rule, char *buf, size_t len);
void mn_upstream_free(mn_run_upstream *up);

/* mn_experiment_run on the cpu, keeping the backward's checkpoints
 * (mn_run_forward_checkpointed): the same outputs and final state. */
mn_status mn_experiment_run_checkpointed(const mn_experiment *e, mn_memory_state *final, mn_segment_outputs *out,
                                         mn_run_checkpoints *ck);

/* The backward of an experiment that has /upstream (file names it in
 * errors) for a run on dev (mn_run_backward_on: on the GPU where it covers
 * the rule, products in prec); ck: the forward's checkpoints or NULL. */
mn_status mn_experiment_backward(const mn_experiment *e, const char *file, mn_device dev, mn_precision prec,
                                 const mn_run_checkpoints *ck, mn_run_grads *g);

/* /grads into a result tree: k, v, q (when the run had q), theta, eta, alpha
 * at full shape and W1, ..., S_W1, ... at [B,H,...]. Tensors are shared. */
mn_status mn_grads_to_tree(const mn_rule *rule, const mn_run_grads *g, mn_node *root);

#endif
