/* grad.h: gradients of a run (SPEC.md section 7) on the CPU. A run is a
 * differentiable function of its inputs; given upstream gradients of its
 * outputs (any subset), mn_run_backward returns the gradient of
 *   L = <dy, y> + <dloss, loss> + sum_P <dP, P^(S)>
 * with respect to k, v, q, the gates and the initial parameters and momenta.
 * The backward recomputes the forward from the initial state: it keeps the
 * parameters at checkpoints every K steps and recomputes inside a block, so
 * its memory grows with sqrt(S), not S. */
#ifndef MN_GRAD_H
#define MN_GRAD_H

#include "engine.h"
#include "expr_shared.h"
#include "mlp_cpu.h"

/* Upstream gradients; an empty tensor (storage NULL) counts as zero.
 * dy [B,H,T,dv], dloss [B,H,T]; dparams[i] / dmomenta[i]: the gradient of
 * final parameter i / its momentum, any shape that broadcasts to [B,H,...]. */
typedef struct mn_run_upstream {
    mn_tensor dy, dloss;
    mn_tensor dparams[MN_MAX_PARAMS], dmomenta[MN_MAX_PARAMS];
} mn_run_upstream;

/* Gradients at full shape, f32 on the device the backward ran on (the CPU,
 * or a backend's, mn_run_backward_on): k, v [B,H,T,dk|dv], q (only when
 * the run had q), theta [B,H,T], eta and alpha [B,H,S], and params[i] /
 * momenta[i] [B,H,...] for the initial parameters and momenta. */
typedef struct mn_run_grads {
    mn_tensor k, v, q, theta, eta, alpha;
    mn_tensor params[MN_MAX_PARAMS], momenta[MN_MAX_PARAMS];
    int nparams;
    mn_tensor outer[MN_OUTER_COUNT]; /* ln_g, ln_b [B,H,dv] with out_norm, else empty */
    /* Memory: block = K (steps between checkpoints); backward_bytes = the
     * checkpoints (the forward's, when given), block states and scratch of
     * every worker at their peak;
     * forward_bytes = the forward's state (parameters, momenta, anchor of
     * B x H memories), for comparison. */
    int64_t block, backward_bytes, forward_bytes;
} mn_run_grads;

/* Checkpoints of a forward run: the state (W, S, anchor) of every memory at
 * the first step of each block of K steps, [block][memory][W, S, A] with each
 * part in the parameter order of one memory (P floats). */
typedef struct mn_run_checkpoints {
    int64_t K, nblocks, memories, P;
    int parts;   /* per memory and block: W, S (2), and the anchor too (3) */
    float *data; /* [block][memory][part][P] */
} mn_run_checkpoints;

/* What a checkpoint keeps: W and S, and the anchor unless every step opens
 * its refresh block (refresh = step), where the recompute sets it from W
 * before any use. */
int mn_grad_checkpoint_parts(const mn_rule *rule);

/* K for a run of nsteps steps: block_steps, or about sqrt(nsteps) when 0. */
int64_t mn_grad_block_steps(int64_t nsteps, int64_t block_steps);

/* mn_segment_run of a whole run on a cpu memory at its initial state, as
 * segments of K steps (grad_forward.c), keeping the checkpoints that spare
 * the backward its own checkpoint pass. Same outputs as one segment. */
mn_status mn_run_forward_checkpointed(mn_memory_state *st, const mn_segment_inputs *in, int64_t block_steps,
                                      mn_segment_outputs *out, mn_run_checkpoints *ck);
void mn_run_checkpoints_free(mn_run_checkpoints *ck);

/* The backward of one run from the initial state (init_params / init_momenta
 * as for mn_memory_create, init_outer (NULL: defaults) as for
 * mn_memory_set_outer; in as for mn_segment_run, any dtype and shape that
 * broadcasts). block_steps: K, or 0 to choose about sqrt(S). ck: the
 * forward's checkpoints (its K wins), or NULL to recompute them. Errors name
 * the upstream tensor whose shape does not fit. */
mn_status mn_run_backward(const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                          const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                          const mn_run_upstream *up, int64_t block_steps, const mn_run_checkpoints *ck,
                          mn_run_grads *out);
/* The same for a run on dev: where a backend registered for dev covers the
 * rule (mn_grad_backend), it computes the gradients there, its products in
 * the forward's precision (the CPU's backward computes in fp32 and double,
 * whatever it is); else the CPU does. mn_run_backward is this with dev the device of in->k (a run whose
 * inputs are on cuda). A backend's gradients stay on its device (a cuda
 * run's on the GPU: no copy of k's and v's gradients through the host). */
mn_status mn_run_backward_on(mn_device dev, mn_precision precision, const mn_rule *rule, const mn_dims *dims, const mn_tensor *init_params,
                             const mn_tensor *init_momenta, const mn_tensor *init_outer,
                             const mn_segment_inputs *in, const mn_run_upstream *up, int64_t block_steps,
                             const mn_run_checkpoints *ck, mn_run_grads *out);

/* A backward on another device (the CUDA general path registers one,
 * kernels/grad_cuda.c), so that model/ never calls kernels/: covers says
 * whether it runs the rule's backward, and if not why (one line into why);
 * run has mn_run_backward's contract for a rule it covers (no
 * checkpoints: it keeps its own). */
typedef struct mn_grad_backend {
    const char *name;
    bool (*covers)(const mn_rule *rule, char *why, size_t why_len);
    mn_status (*run)(const mn_rule *rule, mn_precision precision, const mn_dims *dims, const mn_tensor *init_params,
                     const mn_tensor *init_momenta, const mn_tensor *init_outer, const mn_segment_inputs *in,
                     const mn_run_upstream *up, int64_t block_steps, mn_run_grads *out);
} mn_grad_backend;
void mn_register_grad_backend(mn_device dev, const mn_grad_backend *b);
const mn_grad_backend *mn_grad_backend_for(mn_device dev);

/* An upstream tensor as the backward reads it: empty stays empty (zero);
 * otherwise src, which must broadcast to shape (with exact: have its ndim
 * too), as a new contiguous f32 tensor on dev. The error names it. */
mn_status mn_grad_upstream_input(mn_tensor *out, const mn_tensor *src, const char *name, int ndim,
                                 const int64_t *shape, bool exact, mn_device dev);
void mn_run_grads_free(mn_run_grads *g);

/* full summed back to a broadcast shape (numpy rules: leading dims dropped,
 * dims of size 1 summed), as a contiguous f32 tensor: where nothing is
 * summed, full itself (a view sharing its storage, on full's device); else
 * a new CPU tensor (a device's full is read through the host). */
mn_status mn_sum_to_shape(mn_tensor *out, const mn_tensor *full, int ndim, const int64_t *shape);

/* ---- the memory model's second-order products (mlp_grad_cpu.c) ---- */

/* The pointwise parts of the loss as programs in (y, v, r): f' = df/dy,
 * df/dv, d2f/dy2 and d2f/dydv (r = y - v counted through), from the rule's
 * loss expression, so a custom loss gets its second derivative for free. */
/* The expressions of those four parts of a loss f (borrowed; new references
 * in out: fy, fv, fyy, fyv), the CPU's programs and the CUDA backward's
 * hooks alike. */
mn_status mn_loss_derivative_exprs(const mn_expr *f, mn_expr *out[4]);

typedef struct mn_loss_programs {
    mn_expr_program *fy, *fv, *fyy, *fyv;
    double feature_scale;   /* R: 1/dv (mean) or 1 (sum) */
} mn_loss_programs;

/* Scratch for one thread: the forward's activations (an mn_mlp_work), the
 * tangents, adjoints, and the activation's phi' and phi'' as programs in z. */
typedef struct mn_mlp_grad_work {
    mn_mlp_work fwd;
    int64_t max_rows;
    float *zdot[MN_MAX_LAYERS], *hdot[MN_MAX_LAYERS]; /* tangents */
    float *gdot[MN_MAX_LAYERS];                        /* glu: the gate's tangent */
    float *zbar, *zdotbar, *hbar, *hdotbar;           /* adjoints, rows x widest */
    float *gbar, *gdotbar;                             /* glu: the gate's adjoints, rows x widest */
    float *y, *u, *ybar, *ubar;                        /* rows x dv */
    double *din, *dout, *dout2, *dv_in, *dr_in;        /* program scratch */
    double *dphi_at[MN_MAX_LAYERS];                    /* phi'(z) of the tangent pass, kept for the reverse */
    double *ddphi_at[MN_MAX_LAYERS];                   /* phi''(z), the same */
    float *xclean;                                     /* rows x in: x with non-finite rows zeroed */
    unsigned char *xbad, *cut;                         /* per row: x non-finite; loss terms cut */
    mn_shared_program dphi, ddphi;                     /* phi', phi'' (repeated calls once) */
    double *shared_scratch[MN_SHARED_MAX];
    mn_loss_programs loss;
    /* out_norm: the tangents of o and of nhat (rows x dv), and where
     * the gradients of ln_g, ln_b accumulate (the caller's, per memory) */
    float *od, *nd;
    float *gln_g, *gln_b;
} mn_mlp_grad_work;

mn_status mn_mlp_grad_work_init(mn_mlp_grad_work *w, const mn_mlp_shape *s, const mn_rule *rule,
                                int64_t max_rows);
void mn_mlp_grad_work_free(mn_mlp_grad_work *w);
int64_t mn_mlp_grad_work_bytes(const mn_mlp_shape *s, int64_t max_rows);

/* dyhat[t] = weight[t] R f'(y_t, v_t) for the rows of a step after a forward
 * whose outputs are y (the engine's step gradient G is then the MLP's
 * backward of dyhat). */
void mn_loss_dyhat(mn_mlp_grad_work *w, const float *y, const float *v, const float *weight, int64_t rows,
                   int64_t dv, float *dyhat);

/* Tokens with non-finite inputs (SPEC.md section 7: their own gradient
 * entries are unspecified, every other entry must stay finite) contribute
 * nothing to any other entry, as the reference cuts them: a row whose x is
 * not finite is computed on zeros and its upstream is dropped, and a row
 * whose x is finite but v is not keeps its loss's terms only where f' is
 * finite there (l1 or huber against v = +-Inf). The gradients of x and v at
 * such rows are left as they come out (unspecified). */

/* The adjoint of one step's gradient: with y_t = M(x_t; P), dyhat_t =
 * weight_t R f'(y_t, v_t) and G = sum_t J_P(y_t)^T dyhat_t, accumulate the
 * gradient of  <dG, G> + sum_t dloss_t l_t  with respect to P (gP), x (gx),
 * v (gv) and weight (gweight). dG may be NULL (a skipped step: the loss term
 * only), and dloss may be NULL. Written as the reverse of a forward plus a
 * forward-mode tangent in direction dG: <dG, G> = sum_t <dyhat_t, u_t> with
 * u_t = J_P(y_t) dG, which needs f'' and phi''. dyret (may be NULL): the
 * upstream of retrieval outputs that read the same M(x_t; P) for the first
 * ret_rows rows (q = k and the gradient point at the current weights), so
 * that one pass serves both. kept (may be NULL): this forward's activations
 * from mn_mlp_keep_forward. */
void mn_mlp_step_adjoint(const mn_mlp_shape *s, mn_mlp_grad_work *w, float *const *P, float *const *dG,
                         const float *x, const float *v, const float *weight, const float *dloss,
                         const float *dyret, int64_t ret_rows, int64_t rows, const float *kept,
                         float *const *gP, float *gx, float *gv, float *gweight);

/* The forward's activations of rows rows (hidden z and h, then y), saved by
 * mn_mlp_keep_forward after an mn_mlp_forward on w->fwd with output w->y, so
 * that mn_mlp_step_adjoint (kept != NULL) need not recompute them. */
int64_t mn_mlp_kept_floats(const mn_mlp_shape *s, int64_t rows);
void mn_mlp_keep_forward(const mn_mlp_shape *s, const mn_mlp_grad_work *w, int64_t rows, float *kept);

/* The plain adjoint of y = M(x; P) given dy: accumulates into gP and gx. */
void mn_mlp_vjp(const mn_mlp_shape *s, mn_mlp_grad_work *w, float *const *P, const float *x,
                const float *dy, int64_t rows, float *const *gP, float *gx);

#endif
