/* rule.h: an update rule (SPEC.md sections 1-4) as the engine sees it: the
 * memory model, loss, clip, step structure and named constants, plus the
 * expression forms of every part (built-in parts too), which the CPU engine
 * evaluates and the CUDA code generator turns into source. */
#ifndef MN_RULE_H
#define MN_RULE_H

#include "expr.h"
#include "tensor.h"

#define MN_MAX_LAYERS 8
#define MN_MAX_PARAMS (2 * MN_MAX_LAYERS)
#define MN_MAX_CONSTS 32

typedef enum { MN_ACT_SILU, MN_ACT_GELU, MN_ACT_RELU, MN_ACT_TANH, MN_ACT_IDENTITY, MN_ACT_CUSTOM, MN_ACT_COUNT } mn_activation;
typedef enum { MN_LOSS_MSE, MN_LOSS_L1, MN_LOSS_HUBER, MN_LOSS_LP, MN_LOSS_DOT, MN_LOSS_CUSTOM, MN_LOSS_COUNT } mn_loss;
typedef enum { MN_CLIP_NONE, MN_CLIP_NORM, MN_CLIP_SOFTNORM, MN_CLIP_VALUE, MN_CLIP_SCALE, MN_CLIP_ELEMENTWISE, MN_CLIP_COUNT } mn_clip;
typedef enum { MN_SCOPE_GLOBAL, MN_SCOPE_TENSOR } mn_clip_scope;
typedef enum { MN_REDUCE_MEAN, MN_REDUCE_SUM } mn_reduce;
typedef enum { MN_RETRIEVE_AFTER, MN_RETRIEVE_BEFORE } mn_retrieve;

typedef struct mn_rule {
    /* memory model (SPEC section 1) */
    int layers;           /* L >= 1 */
    int hidden;           /* dh; 0 = take it from W1's shape */
    mn_activation activation;
    bool bias, residual;
    /* loss (section 2) */
    mn_loss loss;
    double loss_delta, loss_p;
    mn_reduce feature_reduce, token_reduce;
    /* step structure */
    int step;             /* c >= 1 */
    int refresh;          /* r: 0 or a multiple of c; -1 = "same as step" */
    mn_retrieve retrieve;
    /* clip */
    mn_clip clip;
    double clip_max;
    mn_clip_scope clip_scope;
    /* custom parts: owned references, NULL unless the part is custom */
    mn_expr *activation_expr; /* in z */
    mn_expr *loss_expr;       /* in y, v, r */
    mn_expr *clip_expr;       /* in n (scale) or g (elementwise) */
    /* named constants the expressions may use */
    int nconsts;
    char *const_names[MN_MAX_CONSTS];
    double const_values[MN_MAX_CONSTS];
} mn_rule;

/* The defaults of SPEC.md (layers 1, silu, mse, mean/sum, step 1, refresh =
 * step, retrieve after, clip none, loss_delta 1, loss_p 1.5, clip_max 1). */
void mn_rule_init(mn_rule *r);
void mn_rule_free(mn_rule *r);              /* releases expressions and names */
mn_status mn_rule_copy(mn_rule *dst, const mn_rule *src);
mn_status mn_rule_set_const(mn_rule *r, const char *name, double value);

/* Names <-> enums; lookups fail with a message listing the valid names,
 * e.g. "unknown loss 'hubr' (one of: mse, l1, huber, lp, dot, custom)". */
const char *mn_activation_name(mn_activation a);
const char *mn_loss_name(mn_loss l);
const char *mn_clip_name(mn_clip c);
mn_status mn_activation_lookup(const char *name, mn_activation *out);
mn_status mn_loss_lookup(const char *name, mn_loss *out);
mn_status mn_clip_lookup(const char *name, mn_clip *out);
mn_status mn_clip_scope_lookup(const char *name, mn_clip_scope *out);
mn_status mn_reduce_lookup(const char *what, const char *name, mn_reduce *out);
mn_status mn_retrieve_lookup(const char *name, mn_retrieve *out);

/* The effective refresh interval (resolves -1 to step). */
int mn_rule_refresh(const mn_rule *r);

/* Dimensions of one run; filled by mn_rule_check from the inputs. */
typedef struct mn_dims {
    int64_t B, H, T, dk, dv, dh, S; /* S = number of steps = ceil(T / c) */
} mn_dims;

/* Everything about the rule itself that can be wrong, before anything runs:
 * bias/residual/refresh/expressions and their names. */
mn_status mn_rule_validate(const mn_rule *r);

/* Parameters: W1, b1, W2, b2, ... in this order (biases only when bias is
 * on). Shapes for one memory; nparams returned. */
int mn_rule_param_count(const mn_rule *r);
const char *mn_rule_param_name(const mn_rule *r, int i, char *buf, size_t len);
/* Parameter i's layer (0-based) and whether it is a bias. */
void mn_rule_param_role(const mn_rule *r, int i, int *layer, bool *is_bias);
int mn_rule_param_shape(const mn_rule *r, const mn_dims *d, int i, int64_t *shape);

/* Expression forms (new references). Built-in parts are expressed in the
 * same IR, so code generators treat every rule alike:
 *   loss f(y, v, r) and df/dy (r = y - v counted through dr/dy = 1);
 *   activation phi(z) and phi'(z);
 *   clip: scale(n) for norm/softnorm/scale; g -> clip(g) for value/elementwise. */
mn_expr *mn_rule_loss_expr(const mn_rule *r);
mn_expr *mn_rule_loss_grad_expr(const mn_rule *r);
mn_expr *mn_rule_activation_expr(const mn_rule *r);
mn_expr *mn_rule_activation_grad_expr(const mn_rule *r);
mn_expr *mn_rule_clip_expr(const mn_rule *r); /* NULL for clip none */

#endif
