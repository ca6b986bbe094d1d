/* engine.h: running a rule (SPEC.md section 2). A run is a sequence of
 * segments over a memory state, so the one-shot run and the stateful memory
 * of the REPL are the same code: a run is one segment from the initial
 * state. The CPU engine (engine_cpu.c) is the plain statement of the spec;
 * other backends implement mn_engine_backend and are checked against it. */
#ifndef MN_ENGINE_H
#define MN_ENGINE_H

#include "rule.h"

/* Matrix precision (SPEC.md section 3): operands of the memory model's
 * products rounded to tf32 or bf16, accumulation in fp32. The CPU engine
 * computes in fp32 only. */
typedef enum { MN_PREC_FP32, MN_PREC_TF32, MN_PREC_BF16 } mn_precision;
const char *mn_precision_name(mn_precision p);
mn_status mn_precision_lookup(const char *name, mn_precision *out);

/* The state of B x H memories between segments (all CPU float32 or all on
 * one device, contiguous [B,H,...] per parameter). */
typedef struct mn_memory_state {
    mn_rule rule;                 /* a copy: the state outlives the caller's rule */
    mn_dims dims;                 /* B, H, dk, dv, dh (T, S unused) */
    int nparams;
    mn_tensor params[MN_MAX_PARAMS];   /* W^(s) */
    mn_tensor momenta[MN_MAX_PARAMS];  /* S^(s) */
    mn_tensor anchor[MN_MAX_PARAMS];   /* the gradient point Wbar of the current refresh block (where
                                          refresh = step, W itself: the same views) */
    mn_tensor outer[MN_OUTER_COUNT];   /* out_norm's ln_g, ln_b [B,H,dv] (rule.h); empty without out_norm */
    int64_t steps_done;           /* s: steps taken since the initial state */
    mn_device device;
    mn_precision precision;       /* set after mn_memory_create; fp32 by default */
} mn_memory_state;

/* The inputs of one segment. k, v: [B,H,n,dk], [B,H,n,dv]; q: [B,H,n,dk] or
 * empty (q = k). Gates: any shape that broadcasts (numpy rules) to [B,H,n]
 * (theta) or [B,H,Sseg] (eta, alpha), Sseg = steps in this segment; an empty
 * eta/alpha means 0. Tensors may be f32 or f64, any strides. */
typedef struct mn_segment_inputs {
    mn_tensor k, v, q;
    mn_tensor theta, eta, alpha;
    bool want_y;                  /* retrieval outputs wanted */
    mn_tensor lengths;            /* (SPEC v2) ragged batches: [B] integers 0..n counted from the
                                   * segment's start, or empty (every token real); tokens at and
                                   * after lengths_b are padding. Backends get it as i64 on the
                                   * state's device. */
} mn_segment_inputs;

/* Outputs of one segment, allocated by the engine (f32, on the state's
 * device), one row each: X(name, group, shape). group is the result file's
 * group: "outputs" (SPEC.md section 5) or "trace" (step_loss: mean l_t over
 * the step's tokens; weight_norm: global L2 norm of W^(s+1)); shape is
 * TOKEN_DV [B,H,n,dv] (y, only when want_y), TOKEN [B,H,n] or STEP
 * [B,H,Sseg]. The struct, allocation, release, the result tree and the Lua
 * result table come from this list; the engines compute each row. */
#define MN_SEGMENT_OUTPUTS(X)                                                                 \
    X(y, outputs, TOKEN_DV)                                                                   \
    X(loss, outputs, TOKEN)                                                                   \
    X(grad_norm, outputs, STEP)                                                               \
    X(clip_scale, outputs, STEP)                                                              \
    X(skipped, outputs, STEP)                                                                 \
    X(step_loss, trace, STEP)                                                                 \
    X(weight_norm, trace, STEP)

typedef struct mn_segment_outputs {
#define MN_OUTPUT_MEMBER(name, group, shape) mn_tensor name;
    MN_SEGMENT_OUTPUTS(MN_OUTPUT_MEMBER)
#undef MN_OUTPUT_MEMBER
} mn_segment_outputs;

/* The rows as data: name, group, and the member of out. */
typedef struct mn_output_row {
    const char *name, *group;
} mn_output_row;
extern const mn_output_row mn_segment_output_rows[];
extern const int mn_segment_output_count;
mn_tensor *mn_segment_output(mn_segment_outputs *out, int i);

/* A state from initial parameters given per name (W1, b1, ...) with shapes
 * [...], [H,...] or [B,H,...], and optional initial momenta (NULL entries or
 * empty tensors: zeros; a missing bias: zeros; a missing weight: error).
 * Errors name the parameter and the shape that does not fit. */
mn_status mn_memory_create(mn_memory_state *st, const mn_rule *rule, const mn_dims *dims,
                           const mn_tensor *init_params, const mn_tensor *init_momenta,
                           mn_device dev);
void mn_memory_free(mn_memory_state *st);
/* The outer parameters (ln_g, ln_b: rule.h) of a state made with an
 * out_norm, given [dv], [H,dv] or [B,H,dv]; NULL or empty entries keep their
 * defaults (1 and 0), which mn_memory_create sets. A rule without out_norm
 * takes none: a given one is an error naming it. */
mn_status mn_memory_set_outer(mn_memory_state *st, const mn_tensor *outer);
/* Whether the device's engine runs every part of the rule: the CUDA engine
 * does not run the rows flagged MN_PART_CPU_ONLY (rule.def); the error names
 * the field and says to use the cpu. */
mn_status mn_rule_device_check(const mn_rule *rule, mn_device dev);

/* Check a segment's inputs against the state: shapes of k, v, q, gates.
 * Fills n (tokens) and the number of steps. */
mn_status mn_segment_check(const mn_memory_state *st, const mn_segment_inputs *in,
                           int64_t *ntokens, int64_t *nsteps);

/* lengths (SPEC v2): a 1-d tensor of B integers from 0 to T, else an error
 * that names lengths. */
mn_status mn_lengths_check(const mn_tensor *lengths, int64_t B, int64_t T);

/* Run one segment: the step loop of SPEC.md section 2. Step boundaries are
 * relative to the segment start; a segment whose length is not a multiple of
 * the step ends with a short step (so a sequence fed piece by piece equals
 * one run when every piece but the last is a multiple of the step). */
mn_status mn_segment_run(mn_memory_state *st, const mn_segment_inputs *in,
                         mn_segment_outputs *out);
void mn_segment_outputs_free(mn_segment_outputs *out);

/* A segment's inputs as the backends read them (mn_segment_run gives them
 * these): contiguous f32 on the state's device at full shape, the gates
 * broadcast to [B,H,n] and [B,H,S] (an empty eta or alpha: zeros), lengths
 * as i64, keys and queries normalised with qk_norm; n and S from
 * mn_segment_check. out is released on failure; else release it with
 * mn_segment_inputs_release. */
mn_status mn_segment_inputs_materialize(const mn_memory_state *st, const mn_segment_inputs *in, int64_t n, int64_t S,
                                        mn_segment_inputs *out);
void mn_segment_inputs_release(mn_segment_inputs *mat);

/* Retrieval only: y = M(q; W) with the current weights. */
mn_status mn_memory_read(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y);

/* Deterministic initialisers for parameters (one memory's shape broadcast
 * to all memories, or distinct per memory): "normal" (std 0.02), "xavier"
 * (uniform, Glorot), "zeros"; biases start at zero. Output tensors [B,H,...]
 * on dev, drawn there (model/random_counter.h: parameter i is stream i,
 * element e of memory m index m * numel + e, or e when shared), so the CPU
 * and a GPU give the same weights for a seed and nothing is uploaded. */
mn_status mn_init_params(const mn_rule *rule, const mn_dims *dims, const char *scheme,
                         uint64_t seed, bool shared_across_memories, mn_tensor *params, mn_device dev);

/* Progress of a long segment: engines call the installed function from one
 * thread, at most once per step of the first memory they run, with the
 * steps done so far out of the total (steps x memories, approximately). The
 * function must be cheap; NULL uninstalls. */
typedef void (*mn_progress_fn)(void *ctx, int64_t done, int64_t total);
void mn_set_progress(mn_progress_fn fn, void *ctx);
void mn_report_progress(int64_t done, int64_t total);

/* Backends: the CPU engine is always there; a CUDA engine registers itself. */
typedef struct mn_engine_backend {
    const char *name;
    mn_status (*segment_run)(mn_memory_state *st, const mn_segment_inputs *in,
                             mn_segment_outputs *out, int64_t n, int64_t nsteps);
    mn_status (*read)(const mn_memory_state *st, const mn_tensor *q, mn_tensor *y);
} mn_engine_backend;
void mn_register_engine(mn_device dev, const mn_engine_backend *b);
const mn_engine_backend *mn_engine_cpu(void);
/* The CPU engine's workers for this many memories (OpenMP threads, at most one a memory). */
int mn_cpu_worker_count(int64_t memories);

#endif
