/* rule.h: an update rule (SPEC.md sections 1-4) as the engine sees it: the
 * memory model, loss, clip, step structure and named constants, plus the
 * expression forms of every part (built-in parts too), which the CPU engine
 * evaluates and the CUDA code generator turns into source. */
#ifndef MN_RULE_H
#define MN_RULE_H

#include "expr.h"
#include "param_layout.h"
#include "tensor.h"

#define MN_MAX_LAYERS 8
#define MN_MAX_PARAMS (4 * MN_MAX_LAYERS) /* W, b and glu's U, c per layer */
#define MN_MAX_CONSTS 32

#include "rule.def"

/* The enums of the part lists (MN_ACT_SILU, MN_LOSS_MSE, ...), each with its count. */
#define MN_PART_ENUM_ROW(SET, E, name, expr, vars, flags, param, doc) MN_##SET##_##E,
typedef enum { MN_ACTS(MN_PART_ENUM_ROW) MN_ACT_COUNT } mn_activation;
typedef enum { MN_LOSSES(MN_PART_ENUM_ROW) MN_LOSS_COUNT } mn_loss;
typedef enum { MN_CLIPS(MN_PART_ENUM_ROW) MN_CLIP_COUNT } mn_clip;
typedef enum { MN_SCOPES(MN_PART_ENUM_ROW) MN_SCOPE_COUNT } mn_clip_scope;
typedef enum { MN_REDUCES(MN_PART_ENUM_ROW) MN_REDUCE_COUNT } mn_reduce;
typedef enum { MN_RETRIEVES(MN_PART_ENUM_ROW) MN_RETRIEVE_COUNT } mn_retrieve;
typedef enum { MN_NORMS(MN_PART_ENUM_ROW) MN_NORM_COUNT } mn_norm;
typedef enum { MN_QKNORMS(MN_PART_ENUM_ROW) MN_QKNORM_COUNT } mn_qknorm;
typedef enum { MN_PRECONDS(MN_PART_ENUM_ROW) MN_PRECOND_COUNT } mn_precondition;
#undef MN_PART_ENUM_ROW

#define MN_PARAM_ENUM_ROW(E, name, field, above) MN_PARAM_##E,
typedef enum { MN_PARAMS(MN_PARAM_ENUM_ROW) MN_PARAM_COUNT } mn_part_param;
#undef MN_PARAM_ENUM_ROW

/* One row of a part list. */
typedef struct mn_part {
    const char *name;
    const char *expr;   /* built-in expression, or NULL */
    const char *vars;   /* its variables, space-separated */
    unsigned flags;     /* MN_PART_* (rule.def) */
    mn_part_param param;
    const char *doc;
} mn_part;

/* A part list: what it is called ("loss", "clip", ...) and its rows. */
typedef struct mn_part_set {
    const char *what;
    const mn_part *parts;
    int count;
} mn_part_set;

#define MN_PART_SET_DECL(SET, lower) extern const mn_part_set mn_##lower##_set;
MN_PART_SET_DECL(ACT, activation)
MN_PART_SET_DECL(LOSS, loss)
MN_PART_SET_DECL(CLIP, clip)
MN_PART_SET_DECL(SCOPE, scope)
MN_PART_SET_DECL(REDUCE, reduce)
MN_PART_SET_DECL(RETRIEVE, retrieve)
MN_PART_SET_DECL(NORM, norm)
MN_PART_SET_DECL(QKNORM, qknorm)
MN_PART_SET_DECL(PRECOND, precond)
#undef MN_PART_SET_DECL

/* The struct: one member per row of MN_RULE_FIELDS, then the expressions of
 * custom parts and the named constants. */
#define MN_FIELD_INT_MEMBER(name, dflt, lo, hi, doc) int name;
#define MN_FIELD_BOOL_MEMBER(name, dflt, doc) bool name;
#define MN_FIELD_NUM_MEMBER(name, dflt, alias, doc) double name;
#define MN_FIELD_CHOICE_MEMBER(name, ctype, SET, dflt, doc) ctype name;
typedef struct mn_rule {
    MN_RULE_FIELDS(MN_FIELD_INT_MEMBER, MN_FIELD_BOOL_MEMBER, MN_FIELD_NUM_MEMBER, MN_FIELD_CHOICE_MEMBER)
    /* custom parts: owned references, NULL unless the part is custom */
    mn_expr *activation_expr; /* in z */
    mn_expr *loss_expr;       /* in y, v, r */
    mn_expr *clip_expr;       /* in n (scale) or g (elementwise) */
    /* named constants the expressions may use */
    int nconsts;
    char *const_names[MN_MAX_CONSTS];
    double const_values[MN_MAX_CONSTS];
} mn_rule;
#undef MN_FIELD_INT_MEMBER
#undef MN_FIELD_BOOL_MEMBER
#undef MN_FIELD_NUM_MEMBER
#undef MN_FIELD_CHOICE_MEMBER

/* The fields as data, for code that walks them (file I/O, the Lua parser,
 * help): generated from MN_RULE_FIELDS. */
typedef enum { MN_FIELD_INT, MN_FIELD_BOOL, MN_FIELD_NUM, MN_FIELD_CHOICE } mn_field_type;
typedef struct mn_field {
    const char *name;
    mn_field_type type;
    const char *alias;          /* NUM: another Lua key, or NULL */
    int lo, hi;                 /* INT: bounds */
    const mn_part_set *set;     /* CHOICE: its part list */
    const char *dflt;           /* the default, as written in rule.def */
    const char *doc;
} mn_field;
extern const mn_field mn_rule_fields[];
extern const int mn_rule_field_count;

/* The custom expression that goes with a choice field, as data. */
typedef struct mn_rule_expr_slot {
    const char *field;          /* "loss" */
    const char *attr;           /* "loss_expr" */
    const mn_part_set *set;
} mn_rule_expr_slot;
extern const mn_rule_expr_slot mn_rule_expr_slots[];
extern const int mn_rule_expr_slot_count;
/* The expression member of slot i. */
mn_expr **mn_rule_expr_member(mn_rule *r, int i);

/* A part's variables ("y v r") as names (pointers into buf); returns the count. */
int mn_part_vars(const mn_part *part, char buf[4][8], const char *names[4]);
/* The part row a choice field currently selects. */
const mn_part *mn_rule_part(const mn_rule *r, const mn_part_set *set, int value);
/* Reading a field generically (for writers, help): the field's value as a
 * double (INT, BOOL, NUM, CHOICE as its index); setting from a double. */
double mn_rule_field_get(const mn_rule *r, int field);
void mn_rule_field_set(mn_rule *r, int field, double value);
/* The field's default for this rule (defaults may read earlier fields). */
double mn_rule_field_default(const mn_rule *r, int field);
int mn_rule_field_find(const char *name); /* -1 if not a field */

/* The defaults of SPEC.md (layers 1, silu, mse, mean/sum, step 1, refresh =
 * step, retrieve after, clip none, loss_delta 1, loss_p 1.5, clip_max 1). */
void mn_rule_init(mn_rule *r);
void mn_rule_free(mn_rule *r);              /* releases expressions and names */
mn_status mn_rule_copy(mn_rule *dst, const mn_rule *src);
mn_status mn_rule_set_const(mn_rule *r, const char *name, double value);

/* Names <-> enums; lookups fail with a message listing the valid names,
 * e.g. "unknown loss 'hubr' (one of: mse, l1, huber, lp, dot, custom)". */
mn_status mn_part_lookup(const mn_part_set *set, const char *name, int *out);
const char *mn_part_name(const mn_part_set *set, int value);
const char *mn_activation_name(mn_activation a);
const char *mn_loss_name(mn_loss l);
const char *mn_clip_name(mn_clip c);
mn_status mn_loss_lookup(const char *name, mn_loss *out);

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

/* Outer-loop parameters (SPEC.md section 1, v2): tensors the model reads and
 * the update never changes, each [dv] per memory (given [dv], [H,dv] or
 * [B,H,dv]): out_norm's gain g and shift beta. X(name, default). They exist
 * only while out_norm is not none; their index j is the order here. */
#define MN_OUTER_PARAMS(X) X(ln_g, 1.0) X(ln_b, 0.0)
#define MN_OUTER_COUNT 2
int mn_rule_outer_count(const mn_rule *r);
const char *mn_outer_name(int j);
double mn_outer_default(int j);

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
/* df/dy of a loss f(y, v, r), r = y - v counted through (new reference; NULL in, NULL out). */
mn_expr *mn_loss_grad_of(const mn_expr *f);
/* The loss and the clip with the selected built-in part's parameter (huber's
 * delta, lp's p, the clip's m) left as its name rather than bound to the
 * rule's value, for a generator that binds it late: the CUDA source reads it
 * at run time, so that a sweep over it reuses one compiled kernel
 * (kernels/codegen.c). A custom part's expression is the same in both forms. */
mn_expr *mn_rule_loss_expr_open(const mn_rule *r);
mn_expr *mn_rule_clip_expr_open(const mn_rule *r);
/* The parameter of the part that choice value selects in set: its enum
 * (MN_PARAM_NONE for custom parts and parts without one), its name in the
 * part's expression and the rule's value (either pointer may be NULL). */
mn_part_param mn_rule_part_param(const mn_rule *r, const mn_part_set *set, int value, const char **name,
                                 double *param_value);
/* The clip's kind (rule.def): a scale of G by expr(n), or expr(g) per element. */
bool mn_rule_clip_scales(const mn_rule *r);
bool mn_rule_clip_elementwise(const mn_rule *r);

#endif
