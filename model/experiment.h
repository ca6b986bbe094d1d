/* experiment.h: experiment and result files (SPEC.md section 5) as engine
 * structs: the rule from /rule attributes, inputs, gates and initial state;
 * a run's outputs and final state back into the result schema. */
#ifndef MN_EXPERIMENT_H
#define MN_EXPERIMENT_H

#include "engine.h"
#include "h5.h"
#include "rule_io.h"
#include "tree.h"

typedef struct mn_experiment {
    mn_rule rule;
    mn_dims dims;
    mn_tensor k, v, q;                  /* q empty when absent */
    mn_tensor theta, eta, alpha;        /* eta, alpha empty when absent (0) */
    mn_tensor lengths;                  /* /inputs/lengths (SPEC v2), empty when absent */
    mn_tensor init[MN_MAX_PARAMS];      /* W1, b1, ... (empty: missing) */
    mn_tensor init_momenta[MN_MAX_PARAMS];
    mn_tensor init_outer[MN_OUTER_COUNT]; /* /init/ln_g, ln_b (out_norm; empty: defaults) */
    mn_node *rule_group;                /* /rule as read, copied into results */
    mn_node *upstream;                  /* /upstream's datasets (shared), NULL when absent:
                                         * the run's backward is wanted (grad_files.h) */
} mn_experiment;

mn_status mn_experiment_from_tree(const mn_node *root, const char *file, mn_experiment *out);
mn_status mn_experiment_load(const char *path, mn_experiment *out);
/* The same through mn_h5_load_io: with io->on_device set to
 * mn_experiment_path_on_device, the big float32 inputs, gates and initial
 * state go from the file straight to io->device (h5.h). An experiment with
 * /upstream needs them on the host: its backward runs on the cpu. */
mn_status mn_experiment_load_io(const char *path, mn_experiment *out, mn_h5_io *io);
bool mn_experiment_path_on_device(const char *path);
/* Moves what the run reads (inputs, gates, initial state; not lengths) to
 * dev, releasing the host copies; adds the bytes moved to *bytes. The
 * engine would copy each at the run's start: this makes that a phase of its
 * own (mnemo run --timing). */
mn_status mn_experiment_to_device(mn_experiment *e, mn_device dev, double *bytes);
void mn_experiment_free(mn_experiment *e);

/* Runs the experiment as one segment from its initial state, with the
 * products in the given precision. */
mn_status mn_experiment_run(const mn_experiment *e, mn_device dev, mn_precision prec, mn_memory_state *final,
                            mn_segment_outputs *out);

/* A result tree (SPEC section 5): root attrs, /rule, /outputs, /final. With
 * trace, also /trace (step_loss, weight_norm), which the schema does not
 * require. Tensors are shared, not copied. */
mn_status mn_result_tree(const mn_rule *rule, const mn_node *rule_group, const mn_memory_state *final,
                         const mn_segment_outputs *out, const char *device, const char *precision,
                         bool trace, mn_node **root);

#endif
