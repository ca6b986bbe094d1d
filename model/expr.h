/* expr.h: the expression IR of SPEC.md section 4, shared by the CPU engine
 * (evaluation over arrays) and the CUDA code generator (C source of an
 * expression). Nodes are immutable and reference counted, so sub-expressions
 * are shared freely between an expression and its derivative. The counts are
 * not atomic: make and release expressions on one thread (evaluating them, or
 * running a compiled program, from many threads is fine).
 * Grammar, names and functions: SPEC.md section 4. */
#ifndef MN_EXPR_H
#define MN_EXPR_H

#include "mn.h"

typedef enum {
    MN_EX_NUM,  /* constant number */
    MN_EX_VAR,  /* a name: y, v, r, z, g, n, or a named constant */
    MN_EX_NEG,  /* -a */
    MN_EX_ADD, MN_EX_SUB, MN_EX_MUL, MN_EX_DIV, MN_EX_POW,
    MN_EX_LT, MN_EX_LE, MN_EX_GT, MN_EX_GE, /* 1 or 0 */
    MN_EX_CALL  /* func(args...) */
} mn_expr_kind;

typedef enum {
    MN_FN_ABS, MN_FN_SQRT, MN_FN_EXP, MN_FN_LOG, MN_FN_TANH, MN_FN_SIGMOID,
    MN_FN_SOFTPLUS, MN_FN_SIGN, MN_FN_RELU, MN_FN_SILU, MN_FN_GELU,
    MN_FN_MIN, MN_FN_MAX, MN_FN_WHERE, /* where(c, a, b) = c != 0 ? a : b */
    /* Internal functions: derivatives need them, users do not write them
     * (SPEC.md section 4 does not list them). Their names start with '_' so
     * that to_string output still parses. */
    MN_FN_GELU_GRAD, /* _gelu_grad(x) = Phi(x) + x phi(x), the derivative of gelu */
    MN_FN_COUNT
} mn_expr_func;

typedef struct mn_expr {
    int refs;
    mn_expr_kind kind;
    double num;               /* MN_EX_NUM */
    char *name;               /* MN_EX_VAR */
    mn_expr_func func;        /* MN_EX_CALL */
    int nargs;                /* operands: 1 for NEG, 2 for binary, 1-3 for CALL */
    int depth;                /* 1 for a leaf, else 1 + the deepest operand */
    int64_t size;             /* nodes with shared ones counted each time they
                               * are reached (what a walk visits), saturating */
    uint64_t names;           /* one bit per name below (a hash of it): lets
                               * mn_expr_uses skip the subtrees without it */
    struct mn_expr *args[3];
} mn_expr;

/* Depth limits. Every walker (printer, simplifier, derivative, evaluator,
 * compiler, C emitter, release) recurses once per level, so depth bounds the
 * C stack they use. What a user writes (a parsed string, an Expr built in
 * Lua) may be MN_EXPR_MAX_DEPTH levels deep: "r+r+...+r" with 1000 terms is
 * 1000 levels. Derivatives and simplified forms of such an expression grow
 * deeper, so the constructors themselves refuse only past the larger
 * MN_EXPR_HARD_DEPTH, which the walkers are tested at (tests/unit/test_expr.c)
 * under the sanitizers. */
#define MN_EXPR_MAX_DEPTH 1000
#define MN_EXPR_HARD_DEPTH 10000
/* Size is the other bound: an Expr built in Lua shares sub-expressions
 * (e = e * e forty times is 41 levels but 2^41 nodes to walk), and every
 * walker visits a shared node once per use. */
#define MN_EXPR_MAX_NODES 20000

/* MN_OK when e is at most MN_EXPR_MAX_DEPTH deep and MN_EXPR_MAX_NODES in
 * size, else an error naming the limit ("expression nested too deeply: N
 * levels, the limit is 1000"; "expression too large: over 20000 nodes ..."). */
mn_status mn_expr_check_depth(const mn_expr *e);

/* Constructors take ownership of the references passed in (a NULL argument
 * yields NULL, so a chain of constructors needs one NULL check at the end)
 * and return a new reference, or NULL with mn_last_error() set. */
mn_expr *mn_expr_num(double value);
mn_expr *mn_expr_var(const char *name);
mn_expr *mn_expr_unary(mn_expr_kind kind, mn_expr *a);                 /* NEG */
mn_expr *mn_expr_binary(mn_expr_kind kind, mn_expr *a, mn_expr *b);
mn_expr *mn_expr_call(mn_expr_func func, int nargs, mn_expr **args);   /* checks arity */
mn_expr *mn_expr_ref(mn_expr *e);                                      /* NULL-safe */
void mn_expr_unref(mn_expr *e);                                        /* NULL-safe */

/* Function table: name <-> id and arity ("where" takes 3, min/max 2, the rest 1). */
const char *mn_expr_func_name(mn_expr_func f);
int mn_expr_func_lookup(const char *name);   /* -1 if unknown */
int mn_expr_func_arity(mn_expr_func f);
bool mn_expr_func_is_internal(mn_expr_func f);  /* _gelu_grad: not in SPEC.md, not for help */

/* Parse the string form. Errors name what and where, e.g.
 * "expression 'y - $v': unexpected character '$' at position 5". */
mn_status mn_expr_parse(const char *src, mn_expr **out);

/* Every name in e must be one of vars or consts: otherwise an error such as
 * "expression 'abs(q - v)': unknown name 'q' (allowed: y, v, r)". */
mn_status mn_expr_check_names(const mn_expr *e, const char *const *vars, int nvars,
                              const char *const *consts, int nconsts);

/* Whether the name appears anywhere in e (e.g. does a loss use r?). */
bool mn_expr_uses(const mn_expr *e, const char *name);

/* Algebraic simplification (constant folding, x*1, x+0, x*0, --x, ...).
 * Returns a new reference; e is not consumed. Never changes the value where
 * the original is finite; where it is not, x*0, 0/x, x-x and x/x become 0 or
 * 1 (NaN or Inf in x is lost there: accepted, derivatives need it). */
mn_expr *mn_expr_simplify(const mn_expr *e);

/* e with every named constant replaced by its value, then simplified (so
 * "delta * sign(r)" with delta = 1 becomes "sign(r)"). Give the CPU program
 * and the generated C the same bound expression so that both engines compute
 * the same thing. New reference; e is not consumed. */
mn_expr *mn_expr_bind(const mn_expr *e, const char *const *consts, const double *const_values,
                      int nconsts);

/* Symbolic derivative d e / d var, simplified; new reference.
 * Non-smooth points follow the usual conventions: d|x| = sign(x) (0 at 0),
 * d relu = x > 0, comparisons and sign have derivative 0, d where(c,a,b) =
 * where(c, da, db), d min(a,b) = where(a <= b, da, db), d max(a,b) =
 * where(a >= b, da, db). */
mn_expr *mn_expr_diff(const mn_expr *e, const char *var);

/* The string form; the parser reads it back to an equal expression.
 * Minimal parentheses. Caller frees. */
char *mn_expr_to_string(const mn_expr *e);

/* C / CUDA source for the expression as one C expression. names[i] maps
 * variable vars[i] to the C identifier to emit; constants appear as literals
 * from const_values. Functions are emitted as calls to mn_f_abs, mn_f_sqrt,
 * ..., mn_f_where (the generated file defines them), so float and double
 * variants differ only in the prelude. Caller frees. */
char *mn_expr_to_c(const mn_expr *e, const char *const *vars, const char *const *names,
                   int nvars, const char *const *consts, const double *const_values,
                   int nconsts, bool single_precision);

/* The prelude that defines mn_f_* for generated source (float or double). */
const char *mn_expr_c_prelude(bool single_precision);

/* Scalar evaluation in double; names resolved from vars/values then
 * consts/const_values (an unknown name evaluates to NaN). */
double mn_expr_eval(const mn_expr *e, const char *const *vars, const double *values, int nvars,
                    const char *const *consts, const double *const_values, int nconsts);

/* Fast evaluation over arrays: compile once to a flat program, then run it
 * element by element. inputs[i] points at n doubles for vars[i] (stride 1);
 * it may be NULL for a variable the expression does not use, and out may be
 * one of the inputs (in place). Compiling checks names like check_names.
 * Running allocates nothing and writes nothing in the program, so several
 * threads may run one program on different slices at once. */
typedef struct mn_expr_program mn_expr_program;
mn_status mn_expr_compile(const mn_expr *e, const char *const *vars, int nvars,
                          const char *const *consts, const double *const_values, int nconsts,
                          mn_expr_program **out);
void mn_expr_program_run(const mn_expr_program *p, const double *const *inputs, double *out,
                         int64_t n);
void mn_expr_program_free(mn_expr_program *p);

/* Scalar math shared by the evaluator, the CPU engine and the tests, so that
 * every engine uses one definition of each function (gelu is exact, erf). */
double mn_math_func(mn_expr_func f, double a, double b, double c);

#endif
