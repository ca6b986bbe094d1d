/* compare.h: compare the datasets of two trees (tree.h), as `mnemo compare`
 * and mnemo.compare do: per dataset, the max abs error and the relative L2
 * error |a - b| / |b| with B the reference (SPEC.md section 3), and the
 * non-finite rules: where B holds NaN or +-Inf, A must hold the same at the
 * same places; a NaN in A where B is finite fails. Attributes are not
 * compared. */
#ifndef MN_COMPARE_H
#define MN_COMPARE_H

#include <stdio.h>

#include "tree.h"

typedef struct {
    double rtol; /* a dataset passes if rel <= rtol ... */
    double atol; /* ... or max_abs <= atol */
    bool all;    /* every dataset, even when both are result files */
} mn_compare_options;

#define MN_COMPARE_DEFAULT_RTOL 1e-5 /* SPEC.md section 3, fp32 */
#define MN_COMPARE_DEFAULTS { MN_COMPARE_DEFAULT_RTOL, 0.0, false }

typedef enum {
    MN_CMP_PASS = 0,
    MN_CMP_FAIL,        /* past the tolerance */
    MN_CMP_MISSING_A,   /* a dataset of B that A lacks */
    MN_CMP_MISSING_B,
    MN_CMP_SHAPE,       /* shapes differ */
    MN_CMP_NONFINITE,   /* B's NaN/Inf not matched in A */
    MN_CMP_NAN_A        /* NaN in A where B is finite */
} mn_compare_status;

typedef struct {
    char *path;                      /* "/outputs/y" */
    char shape_a[128], shape_b[128]; /* "4x8", "scalar"; "" where missing */
    double max_abs, rel;             /* NaN where not computed (missing, shape) */
    int64_t nonfinite_mismatch;      /* places where B is NaN/Inf and A differs */
    int64_t nan_in_a;                /* places where A is NaN and B finite */
    mn_compare_status status;
    char text[128];                  /* the table's status column */
} mn_compare_row;

typedef struct {
    mn_compare_row *rows; /* sorted by path */
    int nrows, nfailed;
    double rtol, atol;
    bool result_scope;    /* only /outputs and /final (and /grads) were compared */
    char context_a[256], context_b[256]; /* "engine X, device Y, precision Z" or "" */
} mn_compare_report;

/* Fills out (which needs no prior setup); on failure out is empty. */
mn_status mn_compare_trees(const mn_node *a, const mn_node *b, const mn_compare_options *opt,
                           mn_compare_report *out);
void mn_compare_report_free(mn_compare_report *r);
/* All passed, and something was compared. */
bool mn_compare_passed(const mn_compare_report *r);
const char *mn_compare_status_name(mn_compare_status s); /* "pass", "missing in A", ... */

/* The header (scope and context, named by name_a and name_b), the aligned
 * table and the summary line; failures_only: only failed rows and the
 * summary. */
void mn_compare_print(FILE *f, const mn_compare_report *r, const char *name_a, const char *name_b,
                      bool failures_only);

#endif
