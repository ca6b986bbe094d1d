/* codegen.h: CUDA source of the rule engine's kernels for one rule: the
 * expression prelude, hooks generated from the rule's IR (loss and its
 * derivative, activation and its derivative, clip), size and flag
 * constants, and the kernel template kernels/rule_kernel.cuh. Plain C and
 * no GPU needed, so the REPL can print the source (rule:source()) and CI can
 * compile it with NVRTC (kernels/nvrtc.h). */
#ifndef MN_CODEGEN_H
#define MN_CODEGEN_H

#include "../model/engine.h"

/* The complete source for a rule at the given dims (dk, dv, dh; B, H, T
 * unused) and precision, or NULL with mn_last_error() set. Caller frees.
 * The same inputs give the same text, so the text is the cache key's core. */
char *mn_cuda_rule_source(const mn_rule *r, const mn_dims *d, mn_precision p);

/* The same prelude, constants and hooks followed by the named embedded
 * templates (kernels/NAME.cuh, NULL-terminated list) instead of the general
 * one, with extra #define lines (or NULL) put after the constants: the
 * source of the fast paths (kernels/plan.h). Caller frees. */
char *mn_cuda_source_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                         const char *defines);

/* The text of the embedded template kernels/NAME.cuh, or NULL where this
 * build has none by that name. */
const char *mn_cuda_template(const char *name);

/* Whether rules a and b give the same source text (at the same dims,
 * precision, templates and defines) without generating it: the same
 * fields, the same expression objects (expressions are immutable and
 * shared by reference), the same constants' names, and numbers that differ
 * only where the source does not print them (a part's parameter or a named
 * constant is read at run time unless it is 0, 1 or -1, which are bound
 * into the text). It errs only towards "different": two rules whose
 * expressions are equal but separate objects differ here. */
bool mn_cuda_same_source_rule(const mn_rule *a, const mn_rule *b);

/* The source of the backward on the general path (kernels/grad_kernel.cuh,
 * its kernel MN_GRAD_KERNEL) for a rule that mn_cuda_backward_covers, in
 * fp32, or NULL with the error set (a rule it does not cover: why). */
char *mn_cuda_grad_source(const mn_rule *r, const mn_dims *d);
/* A backward's source from the templates (in order) with the gradient
 * hooks, in precision p, defines after the rule's (the fused backward's,
 * kernels/plan.c); NULL with the error set where the CUDA backward does not
 * cover the rule. */
char *mn_cuda_grad_source_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                              const char *defines);

/* The rule's constants as the kernels read them at run time: slot P - 1
 * holds part parameter P (huber's delta, lp's p, the clip's m: MN_PARAMS in
 * model/rule.def), slot MN_RULE_PARAM_SLOTS + i the rule's constant i;
 * d in double, f the same rounded to float. A source whose hooks read one
 * has the kernel MN_SET_CONSTANTS_KERNEL(mn_rule_constants), which the
 * engine launches before each run (kernels/cuda_module.h); values 0, 1 and
 * -1 are bound into the source instead (kernels/codegen.c says why). */
#define MN_RULE_PARAM_SLOTS (MN_PARAM_COUNT - 1)
#define MN_RULE_CONSTANT_SLOTS (MN_RULE_PARAM_SLOTS + MN_MAX_CONSTS)
#define MN_PARAM_SLOT(param) ((int)(param) - 1)          /* param: an mn_part_param other than NONE */
#define MN_CONST_SLOT(i) (MN_RULE_PARAM_SLOTS + (i))     /* the rule's constant i */
typedef struct mn_rule_constants {
    double d[MN_RULE_CONSTANT_SLOTS];
    float f[MN_RULE_CONSTANT_SLOTS];
} mn_rule_constants;
void mn_cuda_rule_constants(const mn_rule *r, mn_rule_constants *k);
#define MN_SET_CONSTANTS_KERNEL "mn_set_rule_constants"

/* Names of the kernels in that source (extern "C", unmangled). */
#define MN_RULE_STEP_KERNEL "mn_rule_step_kernel"
#define MN_RULE_READ_KERNEL "mn_rule_read_kernel"

#endif
