/* compare.c: dataset-by-dataset comparison of two trees (compare.h), the
 * engine half of `mnemo compare` and mnemo.compare. Arithmetic is in double
 * whatever the dtypes; B is the reference. */
#include "compare.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A dataset found in a tree, by its full path ("/outputs/y"). */
typedef struct {
    char *path;
    const mn_node *node;
} leaf;

typedef struct {
    leaf *items;
    int n, cap;
} leaf_list;

static void leaves_free(leaf_list *l)
{
    for (int i = 0; i < l->n; i++) free(l->items[i].path);
    free(l->items);
    memset(l, 0, sizeof *l);
}

static mn_status leaves_push(leaf_list *l, const char *prefix, const char *name, const mn_node *n)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 32;
        leaf *items = realloc(l->items, (size_t)cap * sizeof *items);
        if (!items) return mn_fail(MN_ERR_OOM, "out of memory listing datasets to compare");
        l->items = items;
        l->cap = cap;
    }
    size_t len = strlen(prefix) + strlen(name) + 2;
    char *path = mn_malloc(len, "a dataset path");
    if (!path) return MN_ERR_OOM;
    snprintf(path, len, "%s/%s", prefix, name);
    l->items[l->n].path = path;
    l->items[l->n].node = n;
    l->n++;
    return MN_OK;
}

/* Every tensor under g, recursively; prefix is g's own path ("" at the root). */
static mn_status collect(leaf_list *l, const mn_node *g, const char *prefix)
{
    for (int i = 0; i < g->nchildren; i++) {
        const mn_node *c = g->children[i];
        if (c->kind == MN_NODE_TENSOR) {
            MN_TRY(leaves_push(l, prefix, c->name, c));
        } else if (c->kind == MN_NODE_GROUP) {
            size_t len = strlen(prefix) + strlen(c->name) + 2;
            char *sub = mn_malloc(len, "a group path");
            if (!sub) return MN_ERR_OOM;
            snprintf(sub, len, "%s/%s", prefix, c->name);
            mn_status st = collect(l, c, sub);
            free(sub);
            MN_TRY(st);
        }
    }
    return MN_OK;
}

static int leaf_cmp(const void *x, const void *y)
{
    return strcmp(((const leaf *)x)->path, ((const leaf *)y)->path);
}

static bool is_attr(const mn_node *n)
{
    return n && (n->kind == MN_NODE_NUMBER || n->kind == MN_NODE_INTEGER ||
                 n->kind == MN_NODE_STRING);
}

static bool has_group(const mn_node *root, const char *name)
{
    const mn_node *n = mn_node_find(root, name);
    return n && n->kind == MN_NODE_GROUP;
}

static mn_status collect_scope(leaf_list *l, const mn_node *root, bool result_scope)
{
    if (!result_scope) return collect(l, root, "");
    static const char *const groups[] = { "outputs", "final", "grads" };
    for (int i = 0; i < 3; i++) {
        const mn_node *g = mn_node_find(root, groups[i]);
        if (!g) continue;
        char prefix[16];
        snprintf(prefix, sizeof prefix, "/%s", groups[i]);
        if (g->kind == MN_NODE_GROUP) MN_TRY(collect(l, g, prefix));
        else if (g->kind == MN_NODE_TENSOR) MN_TRY(leaves_push(l, "", groups[i], g));
    }
    return MN_OK;
}

/* "engine X, device Y, precision Z" from the root attributes present. */
static void context_of(const mn_node *root, char *buf, size_t len)
{
    static const char *const keys[] = { "engine", "device", "precision" };
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < 3; i++) {
        const mn_node *n = mn_node_find(root, keys[i]);
        if (!is_attr(n) || used >= len) continue;
        const char *sep = used ? ", " : "";
        int w;
        if (n->kind == MN_NODE_STRING)
            w = snprintf(buf + used, len - used, "%s%s %s", sep, keys[i], n->string ? n->string : "");
        else if (n->kind == MN_NODE_INTEGER)
            w = snprintf(buf + used, len - used, "%s%s %lld", sep, keys[i], (long long)n->integer);
        else
            w = snprintf(buf + used, len - used, "%s%s %g", sep, keys[i], n->number);
        if (w > 0) used += (size_t)w;
    }
}

static inline double read_at(const mn_tensor *t, int64_t off)
{
    const void *base = t->storage->data;
    switch (t->dtype) {
    case MN_F32: return ((const float *)base)[off];
    case MN_F64: return ((const double *)base)[off];
    case MN_I64: return (double)((const int64_t *)base)[off];
    }
    return NAN;
}

/* A host view of t: itself, or a copy when it lives on a device. */
static mn_status host_view(const mn_tensor *t, mn_tensor *tmp, const mn_tensor **out,
                           const char *path)
{
    *out = t;
    if (!t->storage) return mn_fail(MN_ERR_ARG, "%s: tensor holds no data", path);
    if (t->storage->device == MN_CPU) return MN_OK;
    mn_status st = mn_tensor_to_device(tmp, t, MN_CPU);
    if (st != MN_OK) return mn_fail_context(st, "comparing %s: ", path);
    *out = tmp;
    return MN_OK;
}

/* Same shapes assumed. Fills the numbers and the status of row. */
static mn_status compare_values(const mn_tensor *ta, const mn_tensor *tb, const char *path,
                                const mn_compare_options *opt, mn_compare_row *row)
{
    mn_tensor tmpa = { 0 }, tmpb = { 0 };
    const mn_tensor *a, *b;
    mn_status st = host_view(ta, &tmpa, &a, path);
    if (st == MN_OK) st = host_view(tb, &tmpb, &b, path);
    if (st != MN_OK) {
        mn_tensor_release(&tmpa);
        return st;
    }

    int nd = a->ndim;
    int64_t n = 1, idx[MN_MAX_DIMS] = { 0 };
    for (int d = 0; d < nd; d++) n *= a->shape[d];
    int64_t oa = a->offset, ob = b->offset;
    int64_t mismatch = 0, nan_a = 0;
    double max_abs = 0, diff2 = 0, ref2 = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = read_at(a, oa), y = read_at(b, ob);
        if (!isfinite(y)) {
            /* SPEC.md section 3: non-finite values at the same places. NaN
             * and Inf stand for each other: which one a skipped step's
             * gradient norm holds depends on the order of 0 * Inf products. */
            if (isfinite(x)) mismatch++;
        } else if (!isfinite(x)) {
            nan_a++;
        } else {
            double e = fabs(x - y);
            if (e > max_abs) max_abs = e;
            diff2 += e * e;
            ref2 += y * y;
        }
        for (int d = nd - 1; d >= 0; d--) {
            oa += a->stride[d];
            ob += b->stride[d];
            if (++idx[d] < a->shape[d]) break;
            oa -= a->stride[d] * a->shape[d];
            ob -= b->stride[d] * b->shape[d];
            idx[d] = 0;
        }
    }
    mn_tensor_release(&tmpa);
    mn_tensor_release(&tmpb);

    row->max_abs = max_abs;
    /* |b| = 0: the absolute norm is the only meaningful error */
    row->rel = ref2 > 0 ? sqrt(diff2) / sqrt(ref2) : sqrt(diff2);
    row->nonfinite_mismatch = mismatch;
    row->nan_in_a = nan_a;
    if (mismatch) {
        row->status = MN_CMP_NONFINITE;
        int w = snprintf(row->text, sizeof row->text, "non-finite mismatch at %lld place%s",
                         (long long)mismatch, mismatch == 1 ? "" : "s");
        if (nan_a && w > 0 && (size_t)w < sizeof row->text)
            snprintf(row->text + w, sizeof row->text - (size_t)w, "; non-finite in A at %lld place%s",
                     (long long)nan_a, nan_a == 1 ? "" : "s");
    } else if (nan_a) {
        row->status = MN_CMP_NAN_A;
        snprintf(row->text, sizeof row->text, "non-finite in A at %lld place%s", (long long)nan_a,
                 nan_a == 1 ? "" : "s");
    } else if (row->rel <= opt->rtol || row->max_abs <= opt->atol) {
        row->status = MN_CMP_PASS;
    } else {
        row->status = MN_CMP_FAIL;
    }
    return MN_OK;
}

static mn_status compare_pair(const leaf *la, const leaf *lb, const mn_compare_options *opt,
                              mn_compare_row *row)
{
    row->max_abs = row->rel = NAN;
    row->path = mn_strdup(la ? la->path : lb->path);
    if (!row->path) return mn_fail(MN_ERR_OOM, "out of memory naming a compared dataset");
    if (la) mn_shape_string(&la->node->tensor, row->shape_a, sizeof row->shape_a);
    if (lb) mn_shape_string(&lb->node->tensor, row->shape_b, sizeof row->shape_b);
    if (!la) row->status = MN_CMP_MISSING_A;
    else if (!lb) row->status = MN_CMP_MISSING_B;
    else if (!mn_tensor_same_shape(&la->node->tensor, &lb->node->tensor)) row->status = MN_CMP_SHAPE;
    else MN_TRY(compare_values(&la->node->tensor, &lb->node->tensor, row->path, opt, row));
    if (!row->text[0]) snprintf(row->text, sizeof row->text, "%s", mn_compare_status_name(row->status));
    return MN_OK;
}

mn_status mn_compare_trees(const mn_node *a, const mn_node *b, const mn_compare_options *opt,
                           mn_compare_report *out)
{
    mn_compare_options defaults = MN_COMPARE_DEFAULTS;
    if (!opt) opt = &defaults;
    memset(out, 0, sizeof *out);
    if (!(opt->rtol >= 0) || !(opt->atol >= 0))
        return mn_fail(MN_ERR_ARG, "compare: rtol and atol must be numbers >= 0 (got %g, %g)",
                       opt->rtol, opt->atol);
    out->rtol = opt->rtol;
    out->atol = opt->atol;
    /* Result files hold their inputs' copies and the rule as well; what an
     * engine computed is in /outputs and /final (and /grads, SPEC section 7). */
    out->result_scope = !opt->all && is_attr(mn_node_find(a, "mnemo_schema")) &&
                        is_attr(mn_node_find(b, "mnemo_schema")) &&
                        (has_group(a, "outputs") || has_group(b, "outputs"));
    context_of(a, out->context_a, sizeof out->context_a);
    context_of(b, out->context_b, sizeof out->context_b);

    leaf_list la = { 0 }, lb = { 0 };
    mn_status st = collect_scope(&la, a, out->result_scope);
    if (st == MN_OK) st = collect_scope(&lb, b, out->result_scope);
    if (st == MN_OK && la.n + lb.n > 0) {
        out->rows = calloc((size_t)(la.n + lb.n), sizeof *out->rows);
        if (!out->rows) st = mn_fail(MN_ERR_OOM, "out of memory for the comparison table");
    }
    if (st == MN_OK) {
        if (la.n) qsort(la.items, (size_t)la.n, sizeof *la.items, leaf_cmp);
        if (lb.n) qsort(lb.items, (size_t)lb.n, sizeof *lb.items, leaf_cmp);
        int i = 0, j = 0;
        while (st == MN_OK && (i < la.n || j < lb.n)) {
            int c = i >= la.n ? 1 : j >= lb.n ? -1 : strcmp(la.items[i].path, lb.items[j].path);
            const leaf *pa = c <= 0 ? &la.items[i++] : NULL;
            const leaf *pb = c >= 0 ? &lb.items[j++] : NULL;
            mn_compare_row *row = &out->rows[out->nrows++];
            st = compare_pair(pa, pb, opt, row);
            if (st == MN_OK && row->status != MN_CMP_PASS) out->nfailed++;
            if (st == MN_OK) st = mn_check_interrupt();
        }
    }
    leaves_free(&la);
    leaves_free(&lb);
    if (st != MN_OK) mn_compare_report_free(out);
    return st;
}

void mn_compare_report_free(mn_compare_report *r)
{
    if (!r) return;
    for (int i = 0; i < r->nrows; i++) free(r->rows[i].path);
    free(r->rows);
    r->rows = NULL;
    r->nrows = r->nfailed = 0;
}

bool mn_compare_passed(const mn_compare_report *r)
{
    return r->nrows > 0 && r->nfailed == 0;
}

const char *mn_compare_status_name(mn_compare_status s)
{
    switch (s) {
    case MN_CMP_PASS: return "pass";
    case MN_CMP_FAIL: return "fail";
    case MN_CMP_MISSING_A: return "missing in A";
    case MN_CMP_MISSING_B: return "missing in B";
    case MN_CMP_SHAPE: return "shape mismatch";
    case MN_CMP_NONFINITE: return "non-finite mismatch";
    case MN_CMP_NAN_A: return "non-finite in A";
    }
    return "?";
}

/* ---- printing ---- */

static void shape_cell(const mn_compare_row *row, char *buf, size_t len)
{
    if (row->shape_a[0] && row->shape_b[0] && strcmp(row->shape_a, row->shape_b) != 0)
        snprintf(buf, len, "%s vs %s", row->shape_a, row->shape_b);
    else
        snprintf(buf, len, "%s", row->shape_a[0] ? row->shape_a : row->shape_b);
}

static void number_cell(double x, char *buf, size_t len)
{
    if (isnan(x)) snprintf(buf, len, "-");
    else snprintf(buf, len, "%.2e", x);
}

void mn_compare_print(FILE *f, const mn_compare_report *r, const char *name_a, const char *name_b,
                      bool failures_only)
{
    if (!failures_only) {
        fprintf(f, "comparing %s of %s (A) and %s (B)\n",
                r->result_scope ? "/outputs and /final" : "every dataset", name_a, name_b);
        if (r->context_a[0]) fprintf(f, "  A: %s\n", r->context_a);
        if (r->context_b[0]) fprintf(f, "  B: %s\n", r->context_b);
    }
    char shape[300], mx[32], rel[32];
    int w_name = (int)strlen("dataset"), w_shape = (int)strlen("shape"), w_num = (int)strlen("max_abs");
    int shown = 0;
    for (int i = 0; i < r->nrows; i++) {
        const mn_compare_row *row = &r->rows[i];
        if (failures_only && row->status == MN_CMP_PASS) continue;
        shown++;
        shape_cell(row, shape, sizeof shape);
        number_cell(row->max_abs, mx, sizeof mx);
        number_cell(row->rel, rel, sizeof rel);
        int l = (int)strlen(row->path);
        if (l > w_name) w_name = l;
        if ((int)strlen(shape) > w_shape) w_shape = (int)strlen(shape);
        if ((int)strlen(mx) > w_num) w_num = (int)strlen(mx);
        if ((int)strlen(rel) > w_num) w_num = (int)strlen(rel);
    }
    if (shown) {
        fprintf(f, "%-*s  %-*s  %*s  %*s  %s\n", w_name, "dataset", w_shape, "shape", w_num,
                "max_abs", w_num, "rel_l2", "status");
        for (int i = 0; i < r->nrows; i++) {
            const mn_compare_row *row = &r->rows[i];
            if (failures_only && row->status == MN_CMP_PASS) continue;
            shape_cell(row, shape, sizeof shape);
            number_cell(row->max_abs, mx, sizeof mx);
            number_cell(row->rel, rel, sizeof rel);
            fprintf(f, "%-*s  %-*s  %*s  %*s  %s\n", w_name, row->path, w_shape, shape, w_num, mx,
                    w_num, rel, row->text);
        }
    }
    fprintf(f, "%d datasets: %d passed, %d failed (rtol %g", r->nrows, r->nrows - r->nfailed,
            r->nfailed, r->rtol);
    if (r->atol > 0) fprintf(f, ", atol %g", r->atol);
    fprintf(f, ")%s\n", r->nrows == 0 ? ": nothing to compare" : "");
}
