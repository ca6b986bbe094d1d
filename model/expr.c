/* expr.c: expression nodes (constructors, reference counts), the function
 * table, the scalar math that every engine shares (mn_math_func), name checks,
 * the recursive evaluator and the compiled block program of expr.h.
 * The parser lives in expr_parse.c, simplifier and derivative in expr_diff.c,
 * string and C output in expr_emit.c. */
#include "expr.h"
#include "op_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- nodes */

static mn_expr *node_new(mn_expr_kind kind)
{
    mn_expr *e = mn_calloc(1, sizeof *e, "an expression node");
    if (!e) return NULL;
    e->refs = 1;
    e->kind = kind;
    e->depth = 1;
    e->size = 1;
    return e;
}

/* 1 + the deepest of n operands; -1 (message set) past MN_EXPR_HARD_DEPTH,
 * so that no walker is ever handed a tree deep enough to exhaust the stack. */
static int depth_over(mn_expr *const *args, int n)
{
    int d = 0;
    for (int i = 0; i < n; i++)
        if (args[i] && args[i]->depth > d) d = args[i]->depth;
    if (d + 1 > MN_EXPR_HARD_DEPTH) {
        mn_fail(MN_ERR_ARG, "expression nested too deeply: over %d levels", MN_EXPR_HARD_DEPTH);
        return -1;
    }
    return d + 1;
}

mn_status mn_expr_check_depth(const mn_expr *e)
{
    if (e && e->depth > MN_EXPR_MAX_DEPTH)
        return mn_fail(MN_ERR_ARG, "expression nested too deeply: %d levels, the limit is %d",
                       e->depth, MN_EXPR_MAX_DEPTH);
    if (e && e->size > MN_EXPR_MAX_NODES)
        return mn_fail(MN_ERR_ARG, "expression too large: over %d nodes counting each use of a shared part (%lld)",
                       MN_EXPR_MAX_NODES, (long long)e->size);
    return MN_OK;
}

mn_expr *mn_expr_num(double value)
{
    mn_expr *e = node_new(MN_EX_NUM);
    if (e) e->num = value;
    return e;
}

/* The bit of a name in mn_expr.names (FNV-1a, 64 bits folded to 6). */
static uint64_t name_bit(const char *name)
{
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 1099511628211ull;
    return 1ull << ((h ^ (h >> 32) ^ (h >> 16)) & 63);
}

mn_expr *mn_expr_var(const char *name)
{
    if (!name) {
        mn_fail(MN_ERR_ARG, "expression variable name is NULL");
        return NULL;
    }
    mn_expr *e = node_new(MN_EX_VAR);
    if (!e) return NULL;
    e->name = mn_strdup(name);
    if (!e->name) {
        free(e);
        return NULL;
    }
    e->names = name_bit(name);
    return e;
}

mn_expr *mn_expr_unary(mn_expr_kind kind, mn_expr *a)
{
    if (!a) return NULL;
    if (kind != MN_EX_NEG) {
        mn_expr_unref(a);
        mn_fail(MN_ERR_ARG, "expression node kind %d is not unary", (int)kind);
        return NULL;
    }
    int depth = depth_over(&a, 1);
    mn_expr *e = depth > 0 ? node_new(kind) : NULL;
    if (!e) {
        mn_expr_unref(a);
        return NULL;
    }
    e->depth = depth;
    e->nargs = 1;
    e->args[0] = a;
    for (int i = 0; i < e->nargs; i++) {
        e->names |= e->args[i]->names;
        e->size += e->args[i]->size;
        if (e->size > ((int64_t)1 << 60)) e->size = (int64_t)1 << 60; /* saturate */
    }
    return e;
}

mn_expr *mn_expr_binary(mn_expr_kind kind, mn_expr *a, mn_expr *b)
{
    if (!a || !b) {
        mn_expr_unref(a);
        mn_expr_unref(b);
        return NULL;
    }
    if (kind < MN_EX_ADD || kind > MN_EX_GE) {
        mn_expr_unref(a);
        mn_expr_unref(b);
        mn_fail(MN_ERR_ARG, "expression node kind %d is not binary", (int)kind);
        return NULL;
    }
    mn_expr *ab[2] = {a, b};
    int depth = depth_over(ab, 2);
    mn_expr *e = depth > 0 ? node_new(kind) : NULL;
    if (!e) {
        mn_expr_unref(a);
        mn_expr_unref(b);
        return NULL;
    }
    e->depth = depth;
    e->nargs = 2;
    e->args[0] = a;
    e->args[1] = b;
    for (int i = 0; i < e->nargs; i++) {
        e->names |= e->args[i]->names;
        e->size += e->args[i]->size;
        if (e->size > ((int64_t)1 << 60)) e->size = (int64_t)1 << 60; /* saturate */
    }
    return e;
}

mn_expr *mn_expr_call(mn_expr_func func, int nargs, mn_expr **args)
{
    bool missing = false;
    for (int i = 0; i < nargs && i < 3; i++) missing |= args[i] == NULL;
    mn_status st = MN_OK;
    if ((int)func < 0 || func >= MN_FN_COUNT)
        st = mn_fail(MN_ERR_ARG, "expression function id %d is unknown", (int)func);
    else if (nargs != mn_expr_func_arity(func))
        st = mn_fail(MN_ERR_ARG, "%s takes %d argument%s, got %d", mn_expr_func_name(func),
                     mn_expr_func_arity(func), mn_expr_func_arity(func) == 1 ? "" : "s", nargs);
    int depth = (st == MN_OK && !missing) ? depth_over(args, nargs) : -1;
    mn_expr *e = depth > 0 ? node_new(MN_EX_CALL) : NULL;
    if (!e) {
        for (int i = 0; i < nargs && i < 3; i++) mn_expr_unref(args[i]);
        return NULL;
    }
    e->depth = depth;
    e->func = func;
    e->nargs = nargs;
    for (int i = 0; i < nargs; i++) e->args[i] = args[i];
    for (int i = 0; i < e->nargs; i++) {
        e->names |= e->args[i]->names;
        e->size += e->args[i]->size;
        if (e->size > ((int64_t)1 << 60)) e->size = (int64_t)1 << 60; /* saturate */
    }
    return e;
}

mn_expr *mn_expr_ref(mn_expr *e)
{
    if (e) e->refs++;
    return e;
}

void mn_expr_unref(mn_expr *e)
{
    if (!e || --e->refs > 0) return;
    for (int i = 0; i < e->nargs; i++) mn_expr_unref(e->args[i]);
    free(e->name);
    free(e);
}

bool mn_expr_uses(const mn_expr *e, const char *name)
{
    /* Without the name's bit no name below can be it: the walk goes down
     * only where the name may be, so a derivative stays linear in size. */
    if (!e || !(e->names & name_bit(name))) return false;
    if (e->kind == MN_EX_VAR) return strcmp(e->name, name) == 0;
    for (int i = 0; i < e->nargs; i++)
        if (mn_expr_uses(e->args[i], name)) return true;
    return false;
}

/* ------------------------------------------------------- function table */

static const struct {
    const char *name;
    int arity;
    bool internal;
} func_table[MN_FN_COUNT] = {
    [MN_FN_ABS] = {"abs", 1, false},         [MN_FN_SQRT] = {"sqrt", 1, false},
    [MN_FN_EXP] = {"exp", 1, false},         [MN_FN_LOG] = {"log", 1, false},
    [MN_FN_TANH] = {"tanh", 1, false},       [MN_FN_SIGMOID] = {"sigmoid", 1, false},
    [MN_FN_SOFTPLUS] = {"softplus", 1, false}, [MN_FN_SIGN] = {"sign", 1, false},
    [MN_FN_RELU] = {"relu", 1, false},       [MN_FN_SILU] = {"silu", 1, false},
    [MN_FN_GELU] = {"gelu", 1, false},       [MN_FN_MIN] = {"min", 2, false},
    [MN_FN_MAX] = {"max", 2, false},         [MN_FN_WHERE] = {"where", 3, false},
    [MN_FN_GELU_GRAD] = {"_gelu_grad", 1, true},
};

const char *mn_expr_func_name(mn_expr_func f)
{
    return ((int)f >= 0 && f < MN_FN_COUNT) ? func_table[f].name : "?";
}

int mn_expr_func_lookup(const char *name)
{
    for (int f = 0; f < MN_FN_COUNT; f++)
        if (strcmp(func_table[f].name, name) == 0) return f;
    return -1;
}

int mn_expr_func_arity(mn_expr_func f)
{
    return ((int)f >= 0 && f < MN_FN_COUNT) ? func_table[f].arity : -1;
}

bool mn_expr_func_is_internal(mn_expr_func f)
{
    return ((int)f >= 0 && f < MN_FN_COUNT) ? func_table[f].internal : false;
}

/* ---------------------------------------------------------- scalar math */

/* Every function is defined once, in model/scalar_math.h (through op_math.h). */
double mn_math_func(mn_expr_func f, double a, double b, double c)
{
    switch (f) {
    case MN_FN_ABS: return fabs(a);
    case MN_FN_SQRT: return sqrt(a);
    case MN_FN_EXP: return exp(a);
    case MN_FN_LOG: return log(a);
    case MN_FN_TANH: return tanh(a);
    case MN_FN_SIGMOID: return mn_sm_sigmoid(a);
    case MN_FN_SOFTPLUS: return mn_sm_softplus(a);
    case MN_FN_SIGN: return mn_sm_sign(a);
    case MN_FN_RELU: return mn_sm_relu(a);
    case MN_FN_SILU: return mn_sm_silu(a);
    case MN_FN_GELU: return mn_sm_gelu(a);
    case MN_FN_MIN: return mn_sm_min(a, b);
    case MN_FN_MAX: return mn_sm_max(a, b);
    case MN_FN_WHERE: return mn_sm_where(a, b, c);
    case MN_FN_GELU_GRAD: return mn_sm_gelu_grad(a);
    case MN_FN_COUNT: break;
    }
    return NAN;
}

/* ------------------------------------------------------------ name checks */

static int find_name(const char *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (names[i] && strcmp(names[i], name) == 0) return i;
    return -1;
}

static const mn_expr *first_unknown_name(const mn_expr *e, const char *const *vars, int nvars,
                                         const char *const *consts, int nconsts)
{
    if (e->kind == MN_EX_VAR)
        return (find_name(e->name, vars, nvars) < 0 && find_name(e->name, consts, nconsts) < 0)
                   ? e : NULL;
    for (int i = 0; i < e->nargs; i++) {
        const mn_expr *bad = first_unknown_name(e->args[i], vars, nvars, consts, nconsts);
        if (bad) return bad;
    }
    return NULL;
}

/* "expression 'abs(q - v)': unknown name 'q' (allowed: y, v, r)" */
static mn_status unknown_name_error(const mn_expr *e, const char *name, const char *const *vars,
                                    int nvars, const char *const *consts, int nconsts)
{
    char allowed[512] = "";
    size_t used = 0;
    for (int i = 0; i < nvars + nconsts; i++) {
        const char *n = i < nvars ? vars[i] : consts[i - nvars];
        if (!n) continue;
        int w = snprintf(allowed + used, sizeof allowed - used, "%s%s", used ? ", " : "", n);
        if (w < 0 || (size_t)w >= sizeof allowed - used) break;
        used += (size_t)w;
    }
    char *text = mn_expr_to_string(e);
    mn_status st = mn_fail(MN_ERR_ARG, "expression '%s': unknown name '%s' (allowed: %s)",
                           text ? text : "?", name, used ? allowed : "none");
    free(text);
    return st;
}

mn_status mn_expr_check_names(const mn_expr *e, const char *const *vars, int nvars,
                              const char *const *consts, int nconsts)
{
    if (!e) return mn_fail(MN_ERR_ARG, "expression is NULL");
    const mn_expr *bad = first_unknown_name(e, vars, nvars, consts, nconsts);
    if (!bad) return MN_OK;
    return unknown_name_error(e, bad->name, vars, nvars, consts, nconsts);
}

/* ------------------------------------------------------ recursive eval */

static double eval_binary(mn_expr_kind kind, double a, double b)
{
    switch (kind) {
    case MN_EX_ADD: return a + b;
    case MN_EX_SUB: return a - b;
    case MN_EX_MUL: return a * b;
    case MN_EX_DIV: return a / b;
    case MN_EX_POW: return mn_sm_pow(a, b);
    case MN_EX_LT: return a < b ? 1.0 : 0.0;
    case MN_EX_LE: return a <= b ? 1.0 : 0.0;
    case MN_EX_GT: return a > b ? 1.0 : 0.0;
    case MN_EX_GE: return a >= b ? 1.0 : 0.0;
    default: return NAN;
    }
}

double mn_expr_eval(const mn_expr *e, const char *const *vars, const double *values, int nvars,
                    const char *const *consts, const double *const_values, int nconsts)
{
    if (!e) return NAN;
    switch (e->kind) {
    case MN_EX_NUM: return e->num;
    case MN_EX_VAR: {
        int i = find_name(e->name, vars, nvars);
        if (i >= 0) return values[i];
        i = find_name(e->name, consts, nconsts);
        return i >= 0 ? const_values[i] : NAN;
    }
    case MN_EX_NEG:
        return -mn_expr_eval(e->args[0], vars, values, nvars, consts, const_values, nconsts);
    case MN_EX_CALL: {
        double v[3] = {0, 0, 0};
        for (int i = 0; i < e->nargs; i++)
            v[i] = mn_expr_eval(e->args[i], vars, values, nvars, consts, const_values, nconsts);
        return mn_math_func(e->func, v[0], v[1], v[2]);
    }
    default: {
        double a = mn_expr_eval(e->args[0], vars, values, nvars, consts, const_values, nconsts);
        double b = mn_expr_eval(e->args[1], vars, values, nvars, consts, const_values, nconsts);
        return eval_binary(e->kind, a, b);
    }
    }
}

/* ------------------------------------------------------ compiled program */

/* The program is a register machine that works on blocks of elements: each
 * instruction runs one tight loop over up to PROGRAM_BLOCK elements, so the
 * interpretation cost (one switch) is paid once per block, not per element,
 * and the loops vectorize. Registers are pointers set per block: variables
 * point straight into the caller's arrays (no copy), constants at arrays the
 * program fills once, temporaries into a scratch area on the stack of
 * mn_expr_program_run (so one program may run on many threads at once), and
 * the output register at the caller's output. */
#define PROGRAM_BLOCK 256
#define PROGRAM_SCRATCH_DOUBLES 8192 /* 64 KiB of stack for temporaries */
#define PROGRAM_MAX_TEMPS PROGRAM_SCRATCH_DOUBLES

/* Operations beyond the node kinds: a constant exponent 2 needs no test. */
enum { PROGRAM_SQUARE = MN_EX_CALL + 1 };

typedef struct {
    unsigned char kind;  /* mn_expr_kind or PROGRAM_SQUARE; MN_EX_NUM: copy a */
    unsigned char func;  /* mn_expr_func for MN_EX_CALL */
    int dst, a, b, c;    /* register numbers */
} program_op;

struct mn_expr_program {
    int nvars;           /* registers [0, nvars): the inputs */
    int nconsts;         /* registers [nvars, nvars + nconsts): constants */
    int ntemps;          /* then the temporaries, then one output register */
    double *const_blocks; /* nconsts x PROGRAM_BLOCK copies of each constant */
    program_op *ops;
    int nops, cap_ops;
    int temps_in_use;    /* compile time only: a stack of temporaries */
};

static int program_out_reg(const mn_expr_program *p) { return p->nvars + p->nconsts + p->ntemps; }

static mn_status program_push(mn_expr_program *p, program_op op)
{
    if (p->nops == p->cap_ops) {
        int cap = p->cap_ops ? 2 * p->cap_ops : 16;
        program_op *ops = realloc(p->ops, (size_t)cap * sizeof *ops);
        if (!ops) return mn_fail(MN_ERR_OOM, "out of memory compiling an expression");
        p->ops = ops;
        p->cap_ops = cap;
    }
    p->ops[p->nops++] = op;
    return MN_OK;
}

static mn_status program_const(mn_expr_program *p, double value, int *reg)
{
    for (int i = 0; i < p->nconsts; i++)
        if (memcmp(&p->const_blocks[(size_t)i * PROGRAM_BLOCK], &value, sizeof value) == 0) {
            *reg = p->nvars + i;
            return MN_OK;
        }
    double *blocks = realloc(p->const_blocks, (size_t)(p->nconsts + 1) * PROGRAM_BLOCK * sizeof *blocks);
    if (!blocks) return mn_fail(MN_ERR_OOM, "out of memory compiling an expression");
    p->const_blocks = blocks;
    for (int i = 0; i < PROGRAM_BLOCK; i++) blocks[(size_t)p->nconsts * PROGRAM_BLOCK + i] = value;
    *reg = p->nvars + p->nconsts++;
    return MN_OK;
}

/* Temporaries are numbered from 0 here and shifted past the constants once
 * compilation is done (the constant count is only known then). They form a
 * stack: a node's operands are the most recent temporaries, so a node frees
 * its operands' temporaries and takes the lowest free one for its result. */
#define TEMP_TAG 0x40000000

static int is_temp(int reg) { return reg >= TEMP_TAG; }

static mn_status program_emit(mn_expr_program *p, const mn_expr *e, const char *const *vars,
                              const char *const *consts, const double *const_values,
                              int nconsts, int *reg)
{
    if (e->kind == MN_EX_NUM) return program_const(p, e->num, reg);
    if (e->kind == MN_EX_VAR) {
        int i = find_name(e->name, vars, p->nvars);
        if (i >= 0) {
            *reg = i;
            return MN_OK;
        }
        i = find_name(e->name, consts, nconsts);
        if (i >= 0) return program_const(p, const_values[i], reg);
        return mn_fail(MN_ERR_ARG, "unknown name '%s'", e->name); /* checked before */
    }
    int r[3] = {0, 0, 0};
    for (int i = 0; i < e->nargs; i++)
        MN_TRY(program_emit(p, e->args[i], vars, consts, const_values, nconsts, &r[i]));
    for (int i = 0; i < e->nargs; i++)
        if (is_temp(r[i])) p->temps_in_use--;
    int dst = TEMP_TAG + p->temps_in_use++;
    if (p->temps_in_use > p->ntemps) p->ntemps = p->temps_in_use;
    if (p->ntemps > PROGRAM_MAX_TEMPS)
        return mn_fail(MN_ERR_ARG, "expression too large to compile (over %d temporaries)",
                       PROGRAM_MAX_TEMPS);
    *reg = dst;
    program_op op = {(unsigned char)e->kind, (unsigned char)(e->kind == MN_EX_CALL ? e->func : 0),
                     dst, r[0], r[1], r[2]};
    if (e->kind == MN_EX_POW && e->args[1]->kind == MN_EX_NUM && e->args[1]->num == 2)
        op.kind = PROGRAM_SQUARE;
    return program_push(p, op);
}

mn_status mn_expr_compile(const mn_expr *e, const char *const *vars, int nvars,
                          const char *const *consts, const double *const_values, int nconsts,
                          mn_expr_program **out)
{
    *out = NULL;
    if (!e) return mn_fail(MN_ERR_ARG, "expression is NULL");
    MN_TRY(mn_expr_check_names(e, vars, nvars, consts, nconsts));
    mn_expr_program *p = mn_calloc(1, sizeof *p, "an expression program");
    if (!p) return MN_ERR_OOM;
    p->nvars = nvars;
    int root = 0;
    mn_status st = program_emit(p, e, vars, consts, const_values, nconsts, &root);
    /* The root's result goes straight to the output; a root that is a
     * variable or a constant becomes a copy. */
    if (st == MN_OK && !is_temp(root)) {
        program_op copy = {MN_EX_NUM, 0, TEMP_TAG, root, 0, 0};
        st = program_push(p, copy);
        if (p->ntemps < 1) p->ntemps = 1;
    }
    if (st != MN_OK) {
        mn_expr_program_free(p);
        return st;
    }
    int temp_base = p->nvars + p->nconsts;
    for (int i = 0; i < p->nops; i++) {
        program_op *op = &p->ops[i];
        int *regs[4] = {&op->dst, &op->a, &op->b, &op->c};
        for (int k = 0; k < 4; k++)
            if (is_temp(*regs[k])) *regs[k] = temp_base + (*regs[k] - TEMP_TAG);
    }
    p->ops[p->nops - 1].dst = program_out_reg(p); /* the last op computes the root */
    *out = p;
    return MN_OK;
}

void mn_expr_program_free(mn_expr_program *p)
{
    if (!p) return;
    free(p->const_blocks);
    free(p->ops);
    free(p);
}

#define LOOP(body) for (int64_t i = 0; i < len; i++) d[i] = (body)

static void run_call(mn_expr_func f, double *d, const double *a, const double *b,
                     const double *c, int64_t len)
{
    switch (f) {
    case MN_FN_ABS: LOOP(fabs(a[i])); break;
    case MN_FN_SQRT: LOOP(sqrt(a[i])); break;
    case MN_FN_EXP: LOOP(exp(a[i])); break;
    case MN_FN_LOG: LOOP(log(a[i])); break;
    case MN_FN_TANH: LOOP(tanh(a[i])); break;
    case MN_FN_SIGMOID: LOOP(mn_sm_sigmoid(a[i])); break;
    case MN_FN_SOFTPLUS: LOOP(mn_sm_softplus(a[i])); break;
    case MN_FN_SIGN: LOOP(mn_sm_sign(a[i])); break;
    case MN_FN_RELU: LOOP(mn_sm_relu(a[i])); break;
    case MN_FN_SILU: LOOP(mn_sm_silu(a[i])); break;
    case MN_FN_GELU: LOOP(mn_sm_gelu(a[i])); break;
    case MN_FN_MIN: LOOP(mn_sm_min(a[i], b[i])); break;
    case MN_FN_MAX: LOOP(mn_sm_max(a[i], b[i])); break;
    case MN_FN_WHERE: LOOP(mn_sm_where(a[i], b[i], c[i])); break;
    case MN_FN_GELU_GRAD: LOOP(mn_sm_gelu_grad(a[i])); break;
    case MN_FN_COUNT: LOOP(NAN); break;
    }
}

/* d may equal a, b or c (a node reuses its operand's temporary, and the
 * caller may evaluate in place); every loop reads element i before writing
 * element i, so that is safe, and nothing is declared restrict. */
static void run_op(const program_op *op, double *const *reg, int64_t len)
{
    double *d = reg[op->dst];
    const double *a = reg[op->a], *b = reg[op->b], *c = reg[op->c];
    switch (op->kind) {
    case MN_EX_NUM: LOOP(a[i]); break;
    case MN_EX_NEG: LOOP(-a[i]); break;
    case MN_EX_ADD: LOOP(a[i] + b[i]); break;
    case MN_EX_SUB: LOOP(a[i] - b[i]); break;
    case MN_EX_MUL: LOOP(a[i] * b[i]); break;
    case MN_EX_DIV: LOOP(a[i] / b[i]); break;
    case MN_EX_POW: LOOP(mn_sm_pow(a[i], b[i])); break;
    case PROGRAM_SQUARE: LOOP(a[i] * a[i]); break;
    case MN_EX_LT: LOOP(a[i] < b[i] ? 1.0 : 0.0); break;
    case MN_EX_LE: LOOP(a[i] <= b[i] ? 1.0 : 0.0); break;
    case MN_EX_GT: LOOP(a[i] > b[i] ? 1.0 : 0.0); break;
    case MN_EX_GE: LOOP(a[i] >= b[i] ? 1.0 : 0.0); break;
    case MN_EX_CALL: run_call((mn_expr_func)op->func, d, a, b, c, len); break;
    default: break; /* MN_EX_VAR: never emitted */
    }
}
#undef LOOP

void mn_expr_program_run(const mn_expr_program *p, const double *const *inputs, double *out,
                         int64_t n)
{
    double scratch[PROGRAM_SCRATCH_DOUBLES];
    int nregs = program_out_reg(p) + 1;
    double *reg[nregs];
    /* With many temporaries, shrink the block so they still fit the scratch. */
    int64_t block = PROGRAM_SCRATCH_DOUBLES / (p->ntemps ? p->ntemps : 1);
    if (block > PROGRAM_BLOCK) block = PROGRAM_BLOCK;
    for (int i = 0; i < p->nconsts; i++)
        reg[p->nvars + i] = &p->const_blocks[(size_t)i * PROGRAM_BLOCK];
    for (int i = 0; i < p->ntemps; i++)
        reg[p->nvars + p->nconsts + i] = &scratch[(size_t)i * (size_t)block];
    for (int64_t start = 0; start < n; start += block) {
        int64_t len = n - start < block ? n - start : block;
        for (int i = 0; i < p->nvars; i++)
            reg[i] = inputs[i] ? (double *)(inputs[i] + start) : NULL;
        reg[nregs - 1] = out + start;
        for (int k = 0; k < p->nops; k++) run_op(&p->ops[k], reg, len);
    }
}
