/* test_compare.c: model/compare.c on trees built in memory: tolerances, the
 * non-finite rules, missing and mismatched datasets, |b| = 0, scope
 * selection, strided views and the printed table. */
#include <stdlib.h>

#include "check.h"
#include "compare.h"

static mn_tensor make(mn_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    mn_tensor t = { 0 };
    if (mn_tensor_empty(&t, dt, ndim, shape, MN_CPU) != MN_OK) {
        printf("FAIL make tensor: %s\n", mn_last_error());
        exit(1);
    }
    int64_t n = mn_tensor_numel(&t);
    for (int64_t i = 0; i < n; i++) {
        void *p = mn_tensor_data(&t);
        if (dt == MN_F32) ((float *)p)[i] = (float)v[i];
        else if (dt == MN_F64) ((double *)p)[i] = v[i];
        else ((int64_t *)p)[i] = (int64_t)v[i];
    }
    return t;
}

static void add(mn_node *g, const char *name, mn_dtype dt, int ndim, const int64_t *shape,
                const double *v)
{
    mn_tensor t = make(dt, ndim, shape, v);
    if (!mn_node_add_tensor(g, name, &t)) {
        printf("FAIL add %s: out of memory\n", name);
        exit(1);
    }
    mn_tensor_release(&t);
}

static void add1(mn_node *g, const char *name, int64_t n, const double *v)
{
    add(g, name, MN_F64, 1, &n, v);
}

/* Compare a one-dataset tree pair: /x of A and B. */
static mn_compare_report one(int64_t n, const double *va, const double *vb, double rtol, double atol)
{
    mn_node *a = mn_node_group("a"), *b = mn_node_group("b");
    add1(a, "x", n, va);
    add1(b, "x", n, vb);
    mn_compare_options opt = { rtol, atol, false };
    mn_compare_report r;
    if (mn_compare_trees(a, b, &opt, &r) != MN_OK) {
        printf("FAIL compare: %s\n", mn_last_error());
        exit(1);
    }
    mn_node_free(a);
    mn_node_free(b);
    return r;
}

static const mn_compare_row *row_named(const mn_compare_report *r, const char *path)
{
    for (int i = 0; i < r->nrows; i++)
        if (!strcmp(r->rows[i].path, path)) return &r->rows[i];
    return NULL;
}

static char *printed(const mn_compare_report *r, bool quiet)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    mn_compare_print(f, r, "a.h5", "b.h5", quiet);
    fclose(f);
    return buf;
}

static void test_identical(void)
{
    mn_node *a = mn_node_group("a"), *b = mn_node_group("b");
    int64_t shape[2] = { 2, 3 };
    double v[6] = { 1, -2, 3.5, 4, 0, 6 };
    add(a, "m", MN_F32, 2, shape, v);
    add(b, "m", MN_F32, 2, shape, v);
    mn_node *ga = mn_node_add_group(a, "g"), *gb = mn_node_add_group(b, "g");
    add1(ga, "w", 6, v);
    add1(gb, "w", 6, v);
    mn_compare_options opt = MN_COMPARE_DEFAULTS;
    mn_compare_report r;
    CHECK("identical: compare ok", mn_compare_trees(a, b, &opt, &r) == MN_OK);
    CHECK("identical: two rows", r.nrows == 2);
    CHECK("identical: none failed", r.nfailed == 0 && mn_compare_passed(&r));
    CHECK("identical: sorted paths", r.nrows == 2 && !strcmp(r.rows[0].path, "/g/w") &&
                                         !strcmp(r.rows[1].path, "/m"));
    CHECK("identical: zero errors", r.nrows == 2 && r.rows[1].max_abs == 0 && r.rows[1].rel == 0);
    CHECK("identical: shape string", r.nrows == 2 && !strcmp(r.rows[1].shape_a, "2x3"));
    CHECK("identical: not result scope", !r.result_scope);
    mn_compare_report_free(&r);
    mn_node_free(a);
    mn_node_free(b);
}

static void test_tolerance(void)
{
    double b[100], under[100], over[100];
    for (int i = 0; i < 100; i++) {
        b[i] = 1 + i * 0.25;
        under[i] = b[i] * (1 + 0.9e-5);
        over[i] = b[i] * (1 + 1.1e-5);
    }
    mn_compare_report r = one(100, under, b, 1e-5, 0);
    CHECK_NEAR("rtol: rel of a uniform scaling", r.rows[0].rel, 0.9e-5, 1e-9);
    CHECK_NEAR("rtol: max_abs", r.rows[0].max_abs, b[99] * 0.9e-5, 1e-9);
    CHECK("rtol: just under passes", r.rows[0].status == MN_CMP_PASS && r.nfailed == 0);
    mn_compare_report_free(&r);

    r = one(100, over, b, 1e-5, 0);
    CHECK("rtol: just over fails", r.rows[0].status == MN_CMP_FAIL && r.nfailed == 1 &&
                                       !mn_compare_passed(&r));
    CHECK("rtol: fail text", !strcmp(r.rows[0].text, "fail"));
    mn_compare_report_free(&r);

    r = one(100, over, b, 2e-5, 0);
    CHECK("rtol: looser rtol passes", r.rows[0].status == MN_CMP_PASS);
    mn_compare_report_free(&r);

    /* atol: an absolute floor, whatever rel says */
    r = one(100, over, b, 1e-5, 1e-3);
    CHECK("atol: max_abs under atol passes", r.rows[0].status == MN_CMP_PASS);
    mn_compare_report_free(&r);
    r = one(100, over, b, 1e-5, 1e-6);
    CHECK("atol: max_abs over atol fails", r.rows[0].status == MN_CMP_FAIL);
    mn_compare_report_free(&r);
}

static void test_nonfinite(void)
{
    double b[5] = { 1, NAN, INFINITY, -INFINITY, 2 };
    double same[5] = { 1, NAN, INFINITY, -INFINITY, 2 };
    mn_compare_report r = one(5, same, b, 1e-5, 0);
    CHECK("nonfinite: matching NaN/Inf pass", r.rows[0].status == MN_CMP_PASS);
    CHECK("nonfinite: excluded from the norms", r.rows[0].rel == 0 && r.rows[0].max_abs == 0);
    mn_compare_report_free(&r);

    double close[5] = { 1, NAN, INFINITY, -INFINITY, 2.5 };
    r = one(5, close, b, 1e-5, 0);
    CHECK_NEAR("nonfinite: norms over finite places only", r.rows[0].rel, 0.5 / sqrt(5.0), 1e-12);
    mn_compare_report_free(&r);

    double num_for_nan[5] = { 1, 0, INFINITY, -INFINITY, 2 };
    r = one(5, num_for_nan, b, 1e-5, 0);
    CHECK("nonfinite: number where B is NaN fails", r.rows[0].status == MN_CMP_NONFINITE);
    CHECK("nonfinite: counted", r.rows[0].nonfinite_mismatch == 1);
    CHECK_STR_CONTAINS("nonfinite: text", r.rows[0].text, "non-finite mismatch at 1 place");
    mn_compare_report_free(&r);

    /* SPEC.md section 3 asks for non-finite values at the same places; NaN
     * and either Inf stand for each other there. */
    double wrong_sign[5] = { 1, NAN, -INFINITY, INFINITY, 2 };
    r = one(5, wrong_sign, b, 1e-5, 0);
    CHECK("nonfinite: Inf of the other sign is still non-finite",
          r.rows[0].status == MN_CMP_PASS && r.rows[0].nonfinite_mismatch == 0);
    mn_compare_report_free(&r);

    double nan_for_inf[5] = { 1, NAN, NAN, -INFINITY, 2 };
    r = one(5, nan_for_inf, b, 1e-5, 0);
    CHECK("nonfinite: NaN where B is Inf passes", r.rows[0].status == MN_CMP_PASS);
    mn_compare_report_free(&r);

    double fb[4] = { 1, 2, 3, 4 }, nan_a[4] = { NAN, 2, NAN, 4 };
    r = one(4, nan_a, fb, 1e-5, 0);
    CHECK("nonfinite: NaN in A where B finite fails", r.rows[0].status == MN_CMP_NAN_A);
    CHECK("nonfinite: NaN in A counted", r.rows[0].nan_in_a == 2);
    CHECK_STR_CONTAINS("nonfinite: NaN in A text", r.rows[0].text, "non-finite in A at 2 places");
    CHECK("nonfinite: NaN in A fails even with a huge rtol", r.nfailed == 1);
    mn_compare_report_free(&r);
    r = one(4, nan_a, fb, 1e30, 1e30);
    CHECK("nonfinite: NaN in A ignores tolerances", r.rows[0].status == MN_CMP_NAN_A);
    mn_compare_report_free(&r);

    double both_b[2] = { NAN, 1 }, both_a[2] = { 0, NAN };
    r = one(2, both_a, both_b, 1e-5, 0);
    CHECK("nonfinite: both kinds at once", r.rows[0].status == MN_CMP_NONFINITE &&
                                               r.rows[0].nan_in_a == 1);
    CHECK("nonfinite: both kinds text",
          !strcmp(r.rows[0].text, "non-finite mismatch at 1 place; non-finite in A at 1 place"));
    mn_compare_report_free(&r);

    double inf_a[4] = { 1, 2, INFINITY, 4 };
    r = one(4, inf_a, fb, 1e-5, 0);
    CHECK("nonfinite: Inf in A where B finite fails",
          r.rows[0].status == MN_CMP_NAN_A && r.rows[0].nan_in_a == 1);
    mn_compare_report_free(&r);
}

static void test_missing_and_shape(void)
{
    mn_node *a = mn_node_group("a"), *b = mn_node_group("b");
    double v[6] = { 1, 2, 3, 4, 5, 6 };
    int64_t s23[2] = { 2, 3 }, s32[2] = { 3, 2 };
    add1(a, "only_a", 3, v);
    add(a, "y", MN_F32, 2, s23, v);
    add(b, "y", MN_F32, 2, s32, v);
    add1(b, "z_only_b", 2, v);
    add1(a, "same", 2, v);
    add1(b, "same", 2, v);
    mn_node_add_number(a, "only_attr", 1.0); /* attributes are not compared */
    mn_compare_options opt = MN_COMPARE_DEFAULTS;
    mn_compare_report r;
    CHECK("missing: compare ok", mn_compare_trees(a, b, &opt, &r) == MN_OK);
    CHECK("missing: four rows, attributes ignored", r.nrows == 4);
    CHECK("missing: three failed", r.nfailed == 3);
    const mn_compare_row *x = row_named(&r, "/only_a");
    CHECK("missing: missing in B", x && x->status == MN_CMP_MISSING_B && !x->shape_b[0] &&
                                       !strcmp(x->text, "missing in B") && isnan(x->rel));
    x = row_named(&r, "/z_only_b");
    CHECK("missing: missing in A", x && x->status == MN_CMP_MISSING_A && !x->shape_a[0] &&
                                       !strcmp(x->shape_b, "2"));
    x = row_named(&r, "/y");
    CHECK("missing: shape mismatch", x && x->status == MN_CMP_SHAPE && isnan(x->max_abs));
    x = row_named(&r, "/same");
    CHECK("missing: the common one passes", x && x->status == MN_CMP_PASS);
    char *out = printed(&r, false);
    CHECK_STR_CONTAINS("missing: printed shape mismatch", out, "2x3 vs 3x2");
    CHECK_STR_CONTAINS("missing: printed status", out, "missing in A");
    CHECK_STR_CONTAINS("missing: summary", out, "4 datasets: 1 passed, 3 failed (rtol 1e-05)");
    free(out);
    mn_compare_report_free(&r);

    /* the same name as a dataset in A and a group in B */
    mn_node *c = mn_node_group("c"), *d = mn_node_group("d");
    add1(c, "w", 2, v);
    add1(mn_node_add_group(d, "w"), "inner", 2, v);
    CHECK("missing: group vs dataset compare ok", mn_compare_trees(c, d, &opt, &r) == MN_OK);
    CHECK("missing: group vs dataset fails", r.nfailed == 2 && r.nrows == 2);
    mn_compare_report_free(&r);
    mn_node_free(c);
    mn_node_free(d);
    mn_node_free(a);
    mn_node_free(b);
}

static void test_zero_reference(void)
{
    double zero[2] = { 0, 0 }, small[2] = { 3e-6, 4e-6 }, big[2] = { 3e-5, 4e-5 };
    mn_compare_report r = one(2, small, zero, 1e-5, 0);
    CHECK_NEAR("zero ref: rel is |a - b|", r.rows[0].rel, 5e-6, 1e-12);
    CHECK("zero ref: small passes", r.rows[0].status == MN_CMP_PASS);
    mn_compare_report_free(&r);
    r = one(2, big, zero, 1e-5, 0);
    CHECK("zero ref: large fails", r.rows[0].status == MN_CMP_FAIL);
    mn_compare_report_free(&r);
    r = one(2, zero, zero, 0, 0);
    CHECK("zero ref: zeros equal at rtol 0", r.rows[0].status == MN_CMP_PASS);
    mn_compare_report_free(&r);
}

/* A result-schema tree: outputs/y and final/W1 from yv, inputs/k from kv. */
static mn_node *result_tree(const char *name, bool schema, double yv, double kv)
{
    mn_node *root = mn_node_group(name);
    if (schema) mn_node_add_integer(root, "mnemo_schema", 1);
    mn_node_add_string(root, "engine", "mnemo 0.1.0");
    mn_node_add_string(root, "precision", "fp32");
    double y[3] = { yv, yv + 1, yv + 2 }, k[3] = { kv, kv, kv };
    mn_node *rule = mn_node_add_group(root, "rule");
    mn_node_add_integer(rule, "layers", 1);
    add1(mn_node_add_group(root, "inputs"), "k", 3, k);
    add1(mn_node_add_group(root, "outputs"), "y", 3, y);
    add1(mn_node_add_group(root, "final"), "W1", 3, y);
    return root;
}

static void test_scope(void)
{
    mn_node *a = result_tree("a", true, 1, 5), *b = result_tree("b", true, 1, 7);
    mn_compare_options opt = MN_COMPARE_DEFAULTS;
    mn_compare_report r;
    CHECK("scope: compare ok", mn_compare_trees(a, b, &opt, &r) == MN_OK);
    CHECK("scope: result files", r.result_scope);
    CHECK("scope: outputs and final only", r.nrows == 2 && row_named(&r, "/outputs/y") &&
                                               row_named(&r, "/final/W1") &&
                                               !row_named(&r, "/inputs/k"));
    CHECK("scope: passes though inputs differ", mn_compare_passed(&r));
    CHECK_STR_CONTAINS("scope: context", r.context_a, "engine mnemo 0.1.0, precision fp32");
    char *out = printed(&r, false);
    CHECK_STR_CONTAINS("scope: header", out,
                       "comparing /outputs and /final of a.h5 (A) and b.h5 (B)\n");
    CHECK_STR_CONTAINS("scope: header context", out, "  A: engine mnemo 0.1.0, precision fp32\n");
    CHECK_STR_CONTAINS("scope: table header", out, "dataset");
    CHECK_STR_CONTAINS("scope: summary", out, "2 datasets: 2 passed, 0 failed (rtol 1e-05)\n");
    free(out);
    out = printed(&r, true);
    CHECK("scope: quiet prints the summary only", out && !strncmp(out, "2 datasets:", 11));
    free(out);
    mn_compare_report_free(&r);

    opt.all = true;
    CHECK("scope: --all compare ok", mn_compare_trees(a, b, &opt, &r) == MN_OK);
    CHECK("scope: --all takes every dataset", !r.result_scope && r.nrows == 3);
    CHECK("scope: --all sees the inputs differ", r.nfailed == 1 && row_named(&r, "/inputs/k") &&
                                                     row_named(&r, "/inputs/k")->status == MN_CMP_FAIL);
    out = printed(&r, false);
    CHECK_STR_CONTAINS("scope: --all header", out, "comparing every dataset of a.h5 (A) and b.h5 (B)");
    free(out);
    out = printed(&r, true);
    CHECK("scope: quiet omits passing rows", out && !strstr(out, "/outputs/y") && strstr(out, "/inputs/k"));
    free(out);
    mn_compare_report_free(&r);

    mn_node *c = result_tree("c", false, 1, 5);
    opt.all = false;
    CHECK("scope: one without schema compare ok", mn_compare_trees(c, b, &opt, &r) == MN_OK);
    CHECK("scope: one without schema compares everything", !r.result_scope && r.nrows == 3);
    mn_compare_report_free(&r);

    mn_node *e = mn_node_group("e"), *f = mn_node_group("f");
    mn_node_add_integer(e, "mnemo_schema", 1);
    mn_node_add_integer(f, "mnemo_schema", 1);
    double k[3] = { 1, 2, 3 };
    add1(mn_node_add_group(e, "inputs"), "k", 3, k);
    add1(mn_node_add_group(f, "inputs"), "k", 3, k);
    CHECK("scope: experiment files compare ok", mn_compare_trees(e, f, &opt, &r) == MN_OK);
    CHECK("scope: no /outputs: every dataset", !r.result_scope && r.nrows == 1);
    mn_compare_report_free(&r);

    mn_node *g = mn_node_group("g"), *h = mn_node_group("h");
    CHECK("scope: empty trees compare ok", mn_compare_trees(g, h, &opt, &r) == MN_OK);
    CHECK("scope: nothing compared is not a pass", r.nrows == 0 && !mn_compare_passed(&r));
    out = printed(&r, false);
    CHECK_STR_CONTAINS("scope: nothing to compare", out, "nothing to compare");
    free(out);
    mn_compare_report_free(&r);
    mn_node_free(a);
    mn_node_free(b);
    mn_node_free(c);
    mn_node_free(e);
    mn_node_free(f);
    mn_node_free(g);
    mn_node_free(h);
}

static void test_dtypes_and_views(void)
{
    mn_node *a = mn_node_group("a"), *b = mn_node_group("b");
    int64_t n = 4, s23[2] = { 2, 3 }, s32[2] = { 3, 2 };
    double v[4] = { 1, 2, 3, 4 };
    add(a, "i", MN_I64, 1, &n, v);
    add(b, "i", MN_F32, 1, &n, v);
    /* A: a transposed view of [[1,2,3],[4,5,6]]; B: the same values laid out */
    double m[6] = { 1, 2, 3, 4, 5, 6 }, mt[6] = { 1, 4, 2, 5, 3, 6 };
    mn_tensor t = make(MN_F64, 2, s23, m), tv = { 0 };
    CHECK("views: transpose", mn_view_transpose(&tv, &t, 0, 1) == MN_OK);
    mn_node_add_tensor(a, "t", &tv);
    mn_tensor_release(&tv);
    mn_tensor_release(&t);
    add(b, "t", MN_F32, 2, s32, mt);
    double s = 2.5;
    add(a, "s", MN_F64, 0, NULL, &s);
    add(b, "s", MN_F64, 0, NULL, &s);
    mn_compare_options opt = { 0, 0, false };
    mn_compare_report r;
    CHECK("dtypes: compare ok", mn_compare_trees(a, b, &opt, &r) == MN_OK);
    const mn_compare_row *x = row_named(&r, "/i");
    CHECK("dtypes: i64 vs f32 compared by value", x && x->status == MN_CMP_PASS && x->rel == 0);
    x = row_named(&r, "/t");
    CHECK("views: strided A equals its laid-out copy", x && x->status == MN_CMP_PASS && x->max_abs == 0);
    x = row_named(&r, "/s");
    CHECK("dtypes: scalars compare", x && x->status == MN_CMP_PASS && !strcmp(x->shape_a, "scalar"));
    mn_compare_report_free(&r);

    /* and a transposed A against the untransposed layout must fail */
    mn_node *c = mn_node_group("c");
    add(c, "t", MN_F32, 2, s32, m);
    mn_node *tb = mn_node_find(b, "t");
    mn_node *d = mn_node_group("d");
    mn_node_add_tensor(d, "t", &tb->tensor);
    CHECK("views: compare ok", mn_compare_trees(c, d, &opt, &r) == MN_OK);
    CHECK("views: wrong layout fails", r.nrows == 1 && r.rows[0].status == MN_CMP_FAIL);
    mn_compare_report_free(&r);

    mn_compare_options bad = { -1, 0, false };
    CHECK("options: negative rtol refused", mn_compare_trees(a, b, &bad, &r) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("options: message", mn_last_error(), "rtol");
    bad.rtol = NAN;
    CHECK("options: NaN rtol refused", mn_compare_trees(a, b, &bad, &r) == MN_ERR_ARG);
    mn_node_free(a);
    mn_node_free(b);
    mn_node_free(c);
    mn_node_free(d);
}

int main(void)
{
    test_identical();
    test_tolerance();
    test_nonfinite();
    test_missing_and_shape();
    test_zero_reference();
    test_scope();
    test_dtypes_and_views();
    return CHECK_DONE();
}
