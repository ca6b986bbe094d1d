/* test_h5.c: HDF5 save/load of trees (model/h5.c): round trips of every
 * dtype, scalar and empty datasets, nested groups, attributes of every kind,
 * non-contiguous input; atomic writes (a failed save leaves the old file
 * byte-identical and no temporary file); error messages naming file and
 * dataset; files written by plain HDF5 calls with types mnemo does not write
 * (int32, uint8, half floats, enums, fixed strings, attribute arrays);
 * staged datasets (h5.h) through a stand-in device, and mnemo run's
 * experiment side of them (experiment.h). */
#include "check.h"
#include "experiment.h"
#include "h5.h"
#include "ops.h"

#include <dirent.h>
#include <malloc.h>
#include <hdf5.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static const char *in_dir(const char *name)
{
    static char buf[8][256];
    static int k = 0;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", dir, name);
    return p;
}

static void make_tensor(mn_tensor *t, mn_dtype dt, int ndim, const int64_t *shape, double base)
{
    memset(t, 0, sizeof *t);
    if (mn_tensor_empty(t, dt, ndim, shape, MN_CPU) != MN_OK) {
        printf("FAIL setup: mn_tensor_empty: %s\n", mn_last_error());
        exit(1);
    }
    int64_t n = mn_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double v = base + (double)i * 0.5;
        if (dt == MN_F32) ((float *)mn_tensor_data(t))[i] = (float)v;
        else if (dt == MN_F64) ((double *)mn_tensor_data(t))[i] = v + 1e-12;
        else ((int64_t *)mn_tensor_data(t))[i] = (int64_t)base * 1000003 + i;
    }
}

static double elem(const mn_tensor *t, int64_t i) /* contiguous CPU tensors */
{
    switch (t->dtype) {
    case MN_F32: return ((const float *)mn_tensor_data(t))[i];
    case MN_F64: return ((const double *)mn_tensor_data(t))[i];
    default: return (double)((const int64_t *)mn_tensor_data(t))[i];
    }
}

static bool same_tensor(const mn_tensor *a, const mn_tensor *b)
{
    if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++) if (a->shape[i] != b->shape[i]) return false;
    if (!mn_tensor_is_contiguous(b)) return false;
    int64_t n = mn_tensor_numel(a);
    if (a->dtype == MN_I64) {
        for (int64_t i = 0; i < n; i++)
            if (((const int64_t *)mn_tensor_data(a))[i] != ((const int64_t *)mn_tensor_data(b))[i])
                return false;
        return true;
    }
    return memcmp(mn_tensor_data(a), mn_tensor_data(b), (size_t)n * mn_dtype_size(a->dtype)) == 0;
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); buf = NULL; }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static int count_tmp_files(void)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".tmp-")) n++;
    closedir(d);
    return n;
}

/* HDF5 objects still open in any file (files, groups, datasets, attributes). */
static long hdf5_open_objects(void)
{
    return (long)H5Fget_obj_count((hid_t)H5F_OBJ_ALL, H5F_OBJ_ALL);
}

static void test_round_trip(void)
{
    const char *path = in_dir("rt.h5");
    mn_node *root = mn_node_group("/");
    mn_tensor f32, f64, i64, s32, s64, e1, e2, base, tr = {0};
    int64_t sh23[] = {2, 3}, sh4[] = {4}, sh222[] = {2, 2, 2}, sh0[] = {0}, sh30[] = {3, 0};

    make_tensor(&f32, MN_F32, 2, sh23, 1.25);
    make_tensor(&f64, MN_F64, 1, sh4, -3.0);
    make_tensor(&i64, MN_I64, 3, sh222, 1 << 20);
    ((int64_t *)mn_tensor_data(&i64))[0] = INT64_MIN;
    ((int64_t *)mn_tensor_data(&i64))[7] = INT64_MAX;
    make_tensor(&s32, MN_F32, 0, NULL, 7.5);
    make_tensor(&s64, MN_I64, 0, NULL, -42);
    make_tensor(&e1, MN_F32, 1, sh0, 0);
    make_tensor(&e2, MN_F64, 2, sh30, 0);
    make_tensor(&base, MN_F32, 2, sh23, 10);
    if (mn_view_transpose(&tr, &base, 0, 1) != MN_OK) {
        printf("FAIL setup: transpose: %s\n", mn_last_error());
        exit(1);
    }

    mn_node_add_integer(root, "mnemo_schema", 1);
    mn_node_add_tensor(root, "f32", &f32);
    mn_node *a = mn_node_add_group(root, "a");
    mn_node_add_tensor(a, "f64", &f64);
    mn_node_add_number(a, "pi", 3.141592653589793);
    mn_node *b = mn_node_add_group(a, "b");
    mn_node_add_tensor(b, "i64", &i64);
    mn_node_add_string(b, "name", "h\xc3\xa9llo w\xc3\xb6rld"); /* UTF-8 */
    mn_node_add_string(b, "empty", "");
    mn_node_add_integer(b, "big", INT64_MIN);
    mn_node_add_number(b, "tiny", 5e-324);
    mn_node *c = mn_node_add_group(b, "c"); /* empty group */
    (void)c;
    mn_node *s = mn_node_add_group(root, "scalars");
    mn_node_add_tensor(s, "s32", &s32);
    mn_node_add_tensor(s, "s64", &s64);
    mn_node_add_tensor(s, "e1", &e1);
    mn_node_add_tensor(s, "e2", &e2);
    mn_node_add_tensor(root, "transposed", &tr);
    /* creation order, not name order, must come back */
    mn_node *z = mn_node_add_group(root, "zz");
    mn_node_add_integer(z, "y", 2);
    mn_node_add_integer(z, "x", 1);
    mn_node_add_group(z, "m");
    mn_node_add_group(z, "k");

    mn_status st = mn_h5_save(path, root);
    CHECK("save round trip file", st == MN_OK);
    if (st != MN_OK) printf("  error: %s\n", mn_last_error());
    CHECK("no temporary file left after save", count_tmp_files() == 0);

    mn_node *back = NULL;
    st = mn_h5_load(path, &back);
    CHECK("load round trip file", st == MN_OK && back);
    if (st != MN_OK) { printf("  error: %s\n", mn_last_error()); goto out; }

    mn_node *n;
    n = mn_node_find(back, "mnemo_schema");
    CHECK("int attr at root", n && n->kind == MN_NODE_INTEGER && n->integer == 1);
    n = mn_node_find(back, "f32");
    CHECK("f32 dataset round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&f32, &n->tensor));
    n = mn_node_find(back, "a/f64");
    CHECK("f64 dataset in group round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&f64, &n->tensor));
    n = mn_node_find(back, "a/pi");
    CHECK("float attr round trip exact", n && n->kind == MN_NODE_NUMBER && n->number == 3.141592653589793);
    n = mn_node_find(back, "a/b/i64");
    CHECK("i64 dataset (3-d, extremes) round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&i64, &n->tensor));
    n = mn_node_find(back, "a/b/name");
    CHECK("utf-8 string attr round trip", n && n->kind == MN_NODE_STRING && strcmp(n->string, "h\xc3\xa9llo w\xc3\xb6rld") == 0);
    n = mn_node_find(back, "a/b/empty");
    CHECK("empty string attr round trip", n && n->kind == MN_NODE_STRING && n->string[0] == 0);
    n = mn_node_find(back, "a/b/big");
    CHECK("INT64_MIN attr round trip", n && n->kind == MN_NODE_INTEGER && n->integer == INT64_MIN);
    n = mn_node_find(back, "a/b/tiny");
    CHECK("denormal float attr round trip", n && n->kind == MN_NODE_NUMBER && n->number == 5e-324);
    n = mn_node_find(back, "a/b/c");
    CHECK("empty group round trip", n && n->kind == MN_NODE_GROUP && n->nchildren == 0);
    n = mn_node_find(back, "scalars/s32");
    CHECK("0-d f32 round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&s32, &n->tensor));
    n = mn_node_find(back, "scalars/s64");
    CHECK("0-d i64 round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&s64, &n->tensor));
    n = mn_node_find(back, "scalars/e1");
    CHECK("empty 1-d dataset round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&e1, &n->tensor));
    n = mn_node_find(back, "scalars/e2");
    CHECK("empty 3x0 dataset round trip", n && n->kind == MN_NODE_TENSOR && same_tensor(&e2, &n->tensor));
    n = mn_node_find(back, "transposed");
    bool tr_ok = n && n->kind == MN_NODE_TENSOR && n->tensor.ndim == 2 && n->tensor.shape[0] == 3 &&
                 n->tensor.shape[1] == 2 && n->tensor.dtype == MN_F32;
    for (int i = 0; tr_ok && i < 3; i++)
        for (int j = 0; j < 2; j++)
            if (elem(&n->tensor, i * 2 + j) != elem(&base, j * 3 + i)) tr_ok = false;
    CHECK("non-contiguous (transposed) tensor saved in logical order", tr_ok);
    n = mn_node_find(back, "zz");
    CHECK("creation order kept on load",
          n && n->nchildren == 4 && strcmp(n->children[0]->name, "y") == 0 &&
              strcmp(n->children[1]->name, "x") == 0 && strcmp(n->children[2]->name, "m") == 0 &&
              strcmp(n->children[3]->name, "k") == 0);
    CHECK("root children count", back->nchildren == 6);
out:
    if (back) mn_node_free(back);
    mn_node_free(root);
    mn_tensor_release(&f32); mn_tensor_release(&f64); mn_tensor_release(&i64);
    mn_tensor_release(&s32); mn_tensor_release(&s64); mn_tensor_release(&e1);
    mn_tensor_release(&e2); mn_tensor_release(&base); mn_tensor_release(&tr);
}

/* The file that a save replaces must survive any failed save unchanged. */
static void test_atomic(void)
{
    const char *path = in_dir("keep.h5");
    mn_tensor t;
    int64_t sh[] = {5};
    make_tensor(&t, MN_F32, 1, sh, 1);
    mn_node *good = mn_node_group("/");
    mn_node_add_tensor(good, "x", &t);
    mn_node_add_string(good, "note", "original");
    CHECK("save original", mn_h5_save(path, good) == MN_OK);
    size_t len0 = 0, len1 = 0;
    char *before = slurp(path, &len0);

    /* fails after several datasets are written: a duplicate dataset name */
    mn_node *bad = mn_node_group("/");
    mn_node *g = mn_node_add_group(bad, "outputs");
    mn_node_add_tensor(g, "y", &t);
    mn_node_add_tensor(g, "z", &t);
    mn_node_add_tensor(g, "y", &t);
    mn_status st = mn_h5_save(path, bad);
    CHECK("duplicate dataset fails", st != MN_OK);
    CHECK_STR_CONTAINS("duplicate dataset error names the file", mn_last_error(), "saving '");
    CHECK_STR_CONTAINS("duplicate dataset error names the file (path)", mn_last_error(), "keep.h5'");
    CHECK_STR_CONTAINS("duplicate dataset error names the dataset", mn_last_error(), "dataset '/outputs/y'");
    CHECK_STR_CONTAINS("error records our file:line", mn_last_error(), "h5.c:");
    printf("  (message: %s)\n", mn_last_error());
    char *after = slurp(path, &len1);
    CHECK("failed save leaves the old file byte-identical",
          before && after && len0 == len1 && memcmp(before, after, len0) == 0);
    CHECK("failed save removes its temporary file", count_tmp_files() == 0);
    free(after);

    /* a bad child name deep in the tree */
    mn_node *bad2 = mn_node_group("/");
    mn_node_add_tensor(bad2, "ok", &t);
    mn_node_add_number(mn_node_add_group(bad2, "rule"), "a/b", 1.0);
    st = mn_h5_save(path, bad2);
    CHECK("name with '/' fails", st == MN_ERR_ARG);
    CHECK_STR_CONTAINS("name with '/' error names it", mn_last_error(), "'a/b'");
    CHECK_STR_CONTAINS("name with '/' error names the group", mn_last_error(), "group '/rule'");
    after = slurp(path, &len1);
    CHECK("bad name leaves the old file byte-identical",
          after && len0 == len1 && memcmp(before, after, len0) == 0);
    CHECK("bad name leaves no temporary file", count_tmp_files() == 0);
    free(after);

    /* a released tensor in the middle of the tree */
    mn_node *bad3 = mn_node_group("/");
    mn_node_add_tensor(bad3, "a", &t);
    mn_node *rel = mn_node_add_tensor(mn_node_add_group(bad3, "g"), "gone", &t);
    mn_tensor_release(&rel->tensor);
    st = mn_h5_save(path, bad3);
    CHECK("released tensor fails", st != MN_OK);
    CHECK_STR_CONTAINS("released tensor error names the dataset", mn_last_error(), "dataset '/g/gone'");
    after = slurp(path, &len1);
    CHECK("released tensor leaves the old file byte-identical",
          after && len0 == len1 && memcmp(before, after, len0) == 0);
    free(after);

    /* Ctrl-C during a save: an error, and the old file stays */
    mn_interrupt_requested = 1;
    st = mn_h5_save(path, good);
    CHECK("interrupted save fails", st == MN_ERR_INTERRUPTED);
    CHECK_STR_CONTAINS("interrupted save names the file", mn_last_error(), "keep.h5': interrupted");
    after = slurp(path, &len1);
    CHECK("interrupted save leaves the old file byte-identical",
          after && len0 == len1 && memcmp(before, after, len0) == 0);
    CHECK("interrupted save leaves no temporary file", count_tmp_files() == 0);
    free(after);

    /* target is a directory */
    const char *d = in_dir("adir.h5");
    mkdir(d, 0755);
    st = mn_h5_save(d, good);
    CHECK("saving over a directory fails", st != MN_OK);
    CHECK_STR_CONTAINS("directory target error names it", mn_last_error(), "adir.h5");
    CHECK("directory target leaves no temporary file", count_tmp_files() == 0);
    rmdir(d);

    /* missing directory */
    st = mn_h5_save(in_dir("nope/sub/out.h5"), good);
    CHECK("missing directory fails", st == MN_ERR_IO);
    CHECK_STR_CONTAINS("missing directory error names it", mn_last_error(), "nope/sub' does not exist");

    /* root that is not a group */
    st = mn_h5_save(in_dir("x.h5"), good->children[0]);
    CHECK("root must be a group", st == MN_ERR_ARG);

    /* the old file still loads and holds the original */
    mn_node *back = NULL;
    st = mn_h5_load(path, &back);
    mn_node *note = back ? mn_node_find(back, "note") : NULL;
    CHECK("old file still loads after failed saves",
          st == MN_OK && note && note->kind == MN_NODE_STRING && strcmp(note->string, "original") == 0);
    if (back) mn_node_free(back);

    /* a successful save replaces it */
    mn_node_add_integer(good, "v", 2);
    CHECK("second save succeeds", mn_h5_save(path, good) == MN_OK);
    back = NULL;
    CHECK("second save replaced the file",
          mn_h5_load(path, &back) == MN_OK && mn_node_find(back, "v") != NULL);
    if (back) mn_node_free(back);

    free(before);
    mn_node_free(good);
    mn_node_free(bad);
    mn_node_free(bad2);
    mn_node_free(bad3);
    mn_tensor_release(&t);
}

static void test_load_errors(void)
{
    mn_node *out = (mn_node *)1;
    mn_status st = mn_h5_load(in_dir("missing.h5"), &out);
    CHECK("missing file fails", st == MN_ERR_IO && out == NULL);
    CHECK_STR_CONTAINS("missing file message", mn_last_error(), "missing.h5': no such file");
    CHECK_STR_CONTAINS("missing file message starts with loading", mn_last_error(), "loading '");

    FILE *f = fopen(in_dir("text.h5"), "w");
    fputs("this is not HDF5\n", f);
    fclose(f);
    st = mn_h5_load(in_dir("text.h5"), &out);
    CHECK("text file fails", st == MN_ERR_IO && out == NULL);
    CHECK_STR_CONTAINS("text file message", mn_last_error(), "text.h5': not an HDF5 file");

    f = fopen(in_dir("empty.h5"), "w");
    fclose(f);
    st = mn_h5_load(in_dir("empty.h5"), &out);
    CHECK("empty file fails", st == MN_ERR_IO);
    CHECK_STR_CONTAINS("empty file message", mn_last_error(), "empty.h5': not an HDF5 file");

    st = mn_h5_load(dir, &out);
    CHECK("directory fails on load", st == MN_ERR_IO);
    CHECK_STR_CONTAINS("directory load message", mn_last_error(), "directory");
}

/* A file written with plain HDF5 calls, with types mnemo never writes. */
static void write_foreign(const char *path, bool with_compound)
{
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hsize_t d3[] = {3}, d22[] = {2, 2};
    hid_t sp3 = H5Screate_simple(1, d3, NULL), sp22 = H5Screate_simple(2, d22, NULL);
    hid_t scal = H5Screate(H5S_SCALAR);

    int32_t i32[] = {-1, 2, 2147483647};
    hid_t ds = H5Dcreate2(f, "i32", H5T_STD_I32BE, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, i32);
    H5Dclose(ds);

    uint64_t u64[] = {0, 1, 12345678901ull};
    ds = H5Dcreate2(f, "u64", H5T_STD_U64LE, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, u64);
    H5Dclose(ds);

    uint8_t u8[] = {0, 200, 255, 7};
    ds = H5Dcreate2(f, "u8", H5T_STD_U8LE, sp22, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, u8);
    H5Dclose(ds);

    double f64be[] = {1.5, -2.25, 1e300};
    ds = H5Dcreate2(f, "f64be", H5T_IEEE_F64BE, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, f64be);
    H5Dclose(ds);

    /* IEEE half, as numpy float16 is stored */
    hid_t half = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(half, 15, 10, 5, 0, 10);
    H5Tset_size(half, 2);
    H5Tset_ebias(half, 15);
    H5Tset_precision(half, 16);
    float hv[] = {0.5f, -2.0f, 65504.0f};
    ds = H5Dcreate2(f, "f16", half, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, hv);
    H5Dclose(ds);
    H5Tclose(half);

    /* numpy bool: enum of int8 FALSE = 0, TRUE = 1 */
    hid_t boolt = H5Tenum_create(H5T_NATIVE_INT8);
    int8_t fv = 0, tv = 1;
    H5Tenum_insert(boolt, "FALSE", &fv);
    H5Tenum_insert(boolt, "TRUE", &tv);
    int8_t bv[] = {1, 0, 1};
    ds = H5Dcreate2(f, "flags", boolt, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, boolt, H5S_ALL, H5S_ALL, H5P_DEFAULT, bv);
    hid_t at = H5Acreate2(ds, "ignored_on_datasets", H5T_NATIVE_INT, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Aclose(at);
    H5Dclose(ds);
    at = H5Acreate2(f, "yes", boolt, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, boolt, &tv);
    H5Aclose(at);

    /* fixed-length ASCII string attribute (numpy bytes) and dataset */
    hid_t fs = H5Tcopy(H5T_C_S1);
    H5Tset_size(fs, 5);
    H5Tset_strpad(fs, H5T_STR_NULLPAD);
    at = H5Acreate2(f, "fixed", fs, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, fs, "abc\0\0");
    H5Aclose(at);
    at = H5Acreate2(f, "full", fs, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, fs, "12345");
    H5Aclose(at);
    ds = H5Dcreate2(f, "label", fs, scal, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, fs, H5S_ALL, H5S_ALL, H5P_DEFAULT, "relu\0");
    H5Dclose(ds);
    H5Tclose(fs);

    /* variable-length ASCII string attribute */
    hid_t vs = H5Tcopy(H5T_C_S1);
    H5Tset_size(vs, H5T_VARIABLE);
    const char *sv = "variable ascii";
    at = H5Acreate2(f, "vascii", vs, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, vs, &sv);
    H5Aclose(at);
    /* a string array attribute: skipped */
    const char *sa[] = {"a", "b", "c"};
    at = H5Acreate2(f, "strings", vs, sp3, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, vs, sa);
    H5Aclose(at);
    H5Tclose(vs);

    /* numeric attribute arrays: a tensor leaf, unless a dataset has the name */
    hid_t g = H5Gcreate2(f, "grp", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    double av[] = {1, 2, 3};
    at = H5Acreate2(g, "arr", H5T_IEEE_F64LE, sp3, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, H5T_NATIVE_DOUBLE, av);
    H5Aclose(at);
    int32_t one[] = {9};
    hsize_t d1[] = {1};
    hid_t sp1 = H5Screate_simple(1, d1, NULL);
    at = H5Acreate2(g, "one", H5T_STD_I32LE, sp1, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, H5T_NATIVE_INT32, one);
    H5Aclose(at);
    H5Sclose(sp1);
    float fa = 0.25f;
    at = H5Acreate2(g, "f32attr", H5T_IEEE_F32LE, scal, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, H5T_NATIVE_FLOAT, &fa);
    H5Aclose(at);
    at = H5Acreate2(g, "clash", H5T_IEEE_F64LE, sp3, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(at, H5T_NATIVE_DOUBLE, av);
    H5Aclose(at);
    int64_t cv = 77;
    ds = H5Dcreate2(g, "clash", H5T_STD_I64LE, scal, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, &cv);
    H5Dclose(ds);
    H5Lcreate_soft("/i32", g, "soft", H5P_DEFAULT, H5P_DEFAULT);
    hid_t sub = H5Gcreate2(g, "sub", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(sub);
    H5Gclose(g);

    if (with_compound) {
        hid_t ct = H5Tcreate(H5T_COMPOUND, 16);
        H5Tinsert(ct, "a", 0, H5T_NATIVE_DOUBLE);
        H5Tinsert(ct, "b", 8, H5T_NATIVE_INT64);
        hid_t g2 = H5Gcreate2(f, "deep", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        ds = H5Dcreate2(g2, "table", ct, sp3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        H5Dclose(ds);
        H5Gclose(g2);
        H5Tclose(ct);
    }
    H5Tclose(boolt);
    H5Sclose(sp3);
    H5Sclose(sp22);
    H5Sclose(scal);
    H5Fclose(f);
}

static void test_foreign(void)
{
    const char *path = in_dir("foreign.h5");
    write_foreign(path, false);
    mn_node *r = NULL, *n;
    mn_status st = mn_h5_load(path, &r);
    CHECK("load foreign file", st == MN_OK && r);
    if (st != MN_OK) { printf("  error: %s\n", mn_last_error()); return; }

    n = mn_node_find(r, "i32");
    CHECK("int32 big-endian -> i64", n && n->kind == MN_NODE_TENSOR && n->tensor.dtype == MN_I64 &&
          n->tensor.ndim == 1 && elem(&n->tensor, 0) == -1 && elem(&n->tensor, 2) == 2147483647);
    n = mn_node_find(r, "u64");
    CHECK("uint64 -> i64", n && n->tensor.dtype == MN_I64 && elem(&n->tensor, 2) == 12345678901.0);
    n = mn_node_find(r, "u8");
    CHECK("uint8 2x2 -> i64", n && n->tensor.dtype == MN_I64 && n->tensor.ndim == 2 &&
          n->tensor.shape[1] == 2 && elem(&n->tensor, 1) == 200 && elem(&n->tensor, 2) == 255);
    n = mn_node_find(r, "f64be");
    CHECK("f64 big-endian -> f64", n && n->tensor.dtype == MN_F64 && elem(&n->tensor, 2) == 1e300 &&
          elem(&n->tensor, 1) == -2.25);
    n = mn_node_find(r, "f16");
    CHECK("float16 -> f32", n && n->tensor.dtype == MN_F32 && elem(&n->tensor, 0) == 0.5 &&
          elem(&n->tensor, 1) == -2.0 && elem(&n->tensor, 2) == 65504.0);
    n = mn_node_find(r, "flags");
    CHECK("bool enum dataset -> i64 0/1", n && n->tensor.dtype == MN_I64 && elem(&n->tensor, 0) == 1 &&
          elem(&n->tensor, 1) == 0 && elem(&n->tensor, 2) == 1);
    n = mn_node_find(r, "yes");
    CHECK("bool enum attr -> integer 1", n && n->kind == MN_NODE_INTEGER && n->integer == 1);
    n = mn_node_find(r, "fixed");
    CHECK("fixed-length null-padded string attr", n && n->kind == MN_NODE_STRING && strcmp(n->string, "abc") == 0);
    n = mn_node_find(r, "full");
    CHECK("fixed-length string filling its size", n && n->kind == MN_NODE_STRING && strcmp(n->string, "12345") == 0);
    n = mn_node_find(r, "label");
    CHECK("scalar string dataset -> string leaf", n && n->kind == MN_NODE_STRING && strcmp(n->string, "relu") == 0);
    n = mn_node_find(r, "vascii");
    CHECK("variable-length ascii string attr", n && n->kind == MN_NODE_STRING && strcmp(n->string, "variable ascii") == 0);
    CHECK("string array attr skipped", mn_node_find(r, "strings") == NULL);
    n = mn_node_find(r, "grp/arr");
    CHECK("numeric attr array -> tensor leaf", n && n->kind == MN_NODE_TENSOR && n->tensor.dtype == MN_F64 &&
          n->tensor.ndim == 1 && n->tensor.shape[0] == 3 && elem(&n->tensor, 2) == 3.0);
    n = mn_node_find(r, "grp/one");
    CHECK("one-element int32 attr array -> integer", n && n->kind == MN_NODE_INTEGER && n->integer == 9);
    n = mn_node_find(r, "grp/f32attr");
    CHECK("float32 attr -> number", n && n->kind == MN_NODE_NUMBER && n->number == 0.25);
    n = mn_node_find(r, "grp/clash");
    CHECK("dataset wins over attr array of the same name", n && n->kind == MN_NODE_TENSOR &&
          n->tensor.dtype == MN_I64 && n->tensor.ndim == 0 && elem(&n->tensor, 0) == 77);
    int clashes = 0;
    mn_node *grp = mn_node_find(r, "grp");
    for (int i = 0; grp && i < grp->nchildren; i++) clashes += strcmp(grp->children[i]->name, "clash") == 0;
    CHECK("only one child named clash", clashes == 1);
    CHECK("soft link not followed", mn_node_find(r, "grp/soft") == NULL);
    n = mn_node_find(r, "grp/sub");
    CHECK("empty nested group from foreign file", n && n->kind == MN_NODE_GROUP);
    CHECK("name order without creation order tracking",
          r->nchildren > 1 && strcmp(r->children[r->nchildren - 1]->name, "u8") == 0);
    mn_node_free(r);

    write_foreign(path, true);
    r = NULL;
    st = mn_h5_load(path, &r);
    CHECK("compound dataset fails", st != MN_OK && r == NULL);
    CHECK_STR_CONTAINS("compound error names the file", mn_last_error(), "loading '");
    CHECK_STR_CONTAINS("compound error names the dataset", mn_last_error(), "dataset '/deep/table'");
    CHECK_STR_CONTAINS("compound error names the type", mn_last_error(), "compound");
}

/* Handles that leak (dataspaces, types, property lists as well as objects)
 * and memory that leaks show as heap growth over many save/load cycles,
 * successful and failing; HDF5's free lists settle after the first few.
 * glibc's per-thread cache makes mallinfo2 drift by a few bytes a cycle with
 * no leak at all, so main() re-executes the test with the cache off. */
static size_t heap_in_use(void)
{
    return mallinfo2().uordblks;
}

/* paths[0]: the file saved and loaded; then a missing, a text and a
 * foreign file (with a compound dataset) that fail to load. */
static void cycle_once(mn_node *good, mn_node *bad, char paths[4][256])
{
    mn_node *back = NULL;
    if (mn_h5_save(paths[0], good) != MN_OK) printf("  save: %s\n", mn_last_error());
    if (mn_h5_save(paths[0], bad) == MN_OK) printf("  bad save succeeded\n");
    if (mn_h5_load(paths[0], &back) == MN_OK) mn_node_free(back);
    for (int i = 1; i < 4; i++) {
        back = NULL;
        if (mn_h5_load(paths[i], &back) == MN_OK) {
            printf("  load of %s succeeded\n", paths[i]);
            mn_node_free(back);
        }
    }
}

static void test_no_growth(void)
{
    char paths[4][256];
    const char *names[4] = {"cycle.h5", "missing.h5", "text.h5", "foreign.h5"};
    for (int i = 0; i < 4; i++) snprintf(paths[i], sizeof paths[i], "%s", in_dir(names[i]));
    mn_tensor t;
    int64_t sh[] = {3, 4};
    make_tensor(&t, MN_F64, 2, sh, 2);
    mn_node *good = mn_node_group("/");
    mn_node_add_string(good, "s", "text");
    mn_node_add_number(mn_node_add_group(good, "g"), "n", 1.5);
    mn_node_add_tensor(mn_node_find(good, "g"), "t", &t);
    mn_node *bad = mn_node_group("/");
    mn_node_add_tensor(bad, "t", &t);
    mn_node_add_string(bad, "t", "attr and dataset may share a name");
    mn_node_add_tensor(bad, "t", &t); /* duplicate dataset: fails */
    for (int i = 0; i < 30; i++) cycle_once(good, bad, paths);
    size_t before = heap_in_use();
    for (int i = 0; i < 200; i++) cycle_once(good, bad, paths);
    size_t after = heap_in_use();
    printf("  (heap in use: %zu bytes before, %zu after 200 cycles)\n", before, after);
    CHECK("no heap growth over 200 save/load cycles", after <= before + 1024);
    CHECK("no HDF5 object left open after cycles", hdf5_open_objects() == 0);
    mn_node_free(good);
    mn_node_free(bad);
    mn_tensor_release(&t);
}

/* ---- staged datasets (h5.h), through a stand-in device ----
 * A device whose memory is host memory and whose backend stages through one
 * small buffer the way kernels/staging.c does (pieces of at most STAND_IN
 * bytes, each checked): the piece and hyperslab arithmetic of h5.c is then
 * tested here, without a GPU. */

enum { STAND_IN = 100000 }; /* no power of two: pieces end inside rows */
static int stand_in_pieces;
static mn_status fake_alloc(size_t n, void **out)
{
    *out = malloc(n ? n : 1);
    return *out ? MN_OK : MN_ERR_OOM;
}
static void fake_free(void *p, size_t n) { (void)n; free(p); }
static mn_status fake_stage(char *dev, size_t nbytes, const mn_stage_io *io, bool in)
{
    static unsigned char buf[STAND_IN];
    for (size_t off = 0; off < nbytes;) {
        size_t n = io->piece(io->ctx, off, STAND_IN);
        if (n == 0 || n > STAND_IN || n > nbytes - off)
            return mn_fail(MN_ERR_ARG, "stand-in: bad piece of %zu bytes at %zu of %zu", n, off, nbytes);
        memset(buf, 0xA5, sizeof buf); /* a short fill would leave this */
        if (!in) memcpy(buf, dev + off, n);
        MN_TRY(io->move(io->ctx, off, n, buf));
        if (in) memcpy(dev + off, buf, n);
        off += n;
        stand_in_pieces++;
    }
    return MN_OK;
}
static mn_status fake_in(void *dev, size_t n, const mn_stage_io *io) { return fake_stage(dev, n, io, true); }
static mn_status fake_out(const void *dev, size_t n, const mn_stage_io *io) { return fake_stage((char *)dev, n, io, false); }
static bool all_on_device(const char *path) { return strncmp(path, "/skip", 5) != 0; }

static void test_staged(void)
{
    static const mn_backend fake = {.name = "stand-in", .stage_in = fake_in, .stage_out = fake_out};
    mn_set_allocator(MN_CUDA, &(mn_allocator){fake_alloc, fake_free});
    mn_register_backend(MN_CUDA, &fake);
    /* staged: 4-d with the split inside (rows of 72800 bytes), 2-d with a
     * row wider than a piece and a short last piece, 1-d; not staged: f64
     * (a conversion), a small one, a path the caller keeps on the host. */
    int64_t s4[] = {3, 5, 7, 2600}, s2[] = {2, 299999}, s1[] = {400000}, small[] = {10, 10}, s64[] = {300000};
    mn_tensor t4, t2, t1, ts, t64, tskip;
    make_tensor(&t4, MN_F32, 4, s4, 1);
    make_tensor(&t2, MN_F32, 2, s2, 2);
    make_tensor(&t1, MN_F32, 1, s1, 3);
    make_tensor(&ts, MN_F32, 2, small, 4);
    make_tensor(&t64, MN_F64, 1, s64, 5);
    make_tensor(&tskip, MN_F32, 1, s1, 6);
    mn_node *root = mn_node_group("/");
    mn_node *g = mn_node_add_group(root, "g");
    mn_node_add_tensor(g, "t4", &t4);
    mn_node_add_tensor(g, "t2", &t2);
    mn_node_add_tensor(root, "t1", &t1);
    mn_node_add_tensor(root, "small", &ts);
    mn_node_add_tensor(root, "t64", &t64);
    mn_node_add_tensor(root, "skip", &tskip);
    const char *p = in_dir("staged.h5"), *p2 = in_dir("staged2.h5");
    CHECK("staged: save from the host", mn_h5_save(p, root) == MN_OK);
    { /* and a chunked one, as h5py writes with compression: not staged */
        hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT), dcpl = H5Pcreate(H5P_DATASET_CREATE);
        hsize_t n = 400000, chunk = 50000;
        hid_t sp = H5Screate_simple(1, &n, NULL);
        H5Pset_chunk(dcpl, 1, &chunk);
        hid_t ds = H5Dcreate2(f, "chunked", H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
        CHECK("staged: a chunked dataset written by plain HDF5",
              ds >= 0 && H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, mn_tensor_data(&t1)) >= 0);
        H5Dclose(ds);
        H5Sclose(sp);
        H5Pclose(dcpl);
        H5Fclose(f);
    }

    mn_node *back = NULL;
    mn_h5_io io = {.device = MN_CUDA, .on_device = all_on_device};
    stand_in_pieces = 0;
    mn_status st = mn_h5_load_io(p, &back, &io);
    CHECK("staged: load to the stand-in device", st == MN_OK);
    if (st != MN_OK) printf("  %s\n", mn_last_error());
    const mn_node *b4 = back ? mn_node_find(back, "g/t4") : NULL, *b2 = back ? mn_node_find(back, "g/t2") : NULL,
                  *b1 = back ? mn_node_find(back, "t1") : NULL, *bs = back ? mn_node_find(back, "small") : NULL,
                  *b64 = back ? mn_node_find(back, "t64") : NULL, *bk = back ? mn_node_find(back, "skip") : NULL;
    CHECK("staged: big float32 datasets land on the device",
          b4 && b2 && b1 && b4->tensor.storage->device == MN_CUDA && b2->tensor.storage->device == MN_CUDA &&
              b1->tensor.storage->device == MN_CUDA);
    const mn_node *bc = back ? mn_node_find(back, "chunked") : NULL;
    CHECK("staged: small, f64, chunked and refused datasets stay on the host",
          bs && b64 && bk && bc && bs->tensor.storage->device == MN_CPU && b64->tensor.storage->device == MN_CPU &&
              bk->tensor.storage->device == MN_CPU && bc->tensor.storage->device == MN_CPU &&
              same_tensor(&t1, &bc->tensor));
    CHECK("staged: values of every staged dataset", b4 && same_tensor(&t4, &b4->tensor) && same_tensor(&t2, &b2->tensor) &&
                                                        same_tensor(&t1, &b1->tensor));
    /* t4: 15 pieces of one row; t2: ceil(299999 / 25000) = 12 a row, 2 rows; t1: 16 */
    printf("  (%d pieces staged in)\n", stand_in_pieces);
    CHECK("staged: pieces as the rows say", stand_in_pieces == 15 + 24 + 16);
    double want_staged = 4.0 * (273000 + 599998 + 400000);
    CHECK_NEAR("staged: bytes counted", io.staged_bytes, want_staged, 0);
    CHECK_NEAR("staged: all bytes counted", io.bytes, want_staged + 4.0 * (100 + 2 * 400000) + 8.0 * 300000, 0);

    /* And back out of the device into a file that a plain load reads. */
    mn_h5_io out = {0};
    stand_in_pieces = 0;
    st = back ? mn_h5_save_io(p2, back, &out) : MN_ERR_ARG;
    CHECK("staged: save from the stand-in device", st == MN_OK);
    if (st != MN_OK) printf("  %s\n", mn_last_error());
    CHECK("staged: pieces out as in", stand_in_pieces == 15 + 24 + 16);
    CHECK_NEAR("staged: bytes out", out.staged_bytes, want_staged, 0);
    mn_node *again = NULL;
    st = mn_h5_load(p2, &again);
    const mn_node *a4 = again ? mn_node_find(again, "g/t4") : NULL, *a2 = again ? mn_node_find(again, "g/t2") : NULL,
                  *a1 = again ? mn_node_find(again, "t1") : NULL, *a64 = again ? mn_node_find(again, "t64") : NULL;
    CHECK("staged: the file written from the device reads back",
          st == MN_OK && a4 && a2 && a1 && a64 && same_tensor(&t4, &a4->tensor) && same_tensor(&t2, &a2->tensor) &&
              same_tensor(&t1, &a1->tensor) && same_tensor(&t64, &a64->tensor));
    mn_node_free(again);
    mn_node_free(back);
    mn_node_free(root);
    mn_tensor *all[] = {&t4, &t2, &t1, &ts, &t64, &tskip};
    for (int i = 0; i < 6; i++) mn_tensor_release(all[i]);
}

/* mnemo run's side of it (experiment.h): inputs, gates and initial state
 * staged or moved to the device, lengths never; and back. */
static mn_status host_copy(mn_tensor *dst, const mn_tensor *src)
{
    if (dst->dtype != src->dtype || !mn_tensor_is_contiguous(dst) || !mn_tensor_is_contiguous(src))
        return mn_fail(MN_ERR_UNSUPPORTED, "stand-in copy: contiguous, one dtype only");
    memcpy(mn_tensor_data(dst), mn_tensor_data(src), (size_t)mn_tensor_numel(src) * mn_dtype_size(src->dtype));
    return MN_OK;
}
static void test_staged_experiment(void)
{
    mn_register_device_copy(MN_CUDA, MN_CPU, host_copy); /* the stand-in's memory is the host's */
    mn_register_device_copy(MN_CPU, MN_CUDA, host_copy);
    int64_t kshape[] = {1, 2, 2048, 64}, wshape[] = {64, 64}, one[] = {1};
    mn_tensor k, v, w, len, theta;
    make_tensor(&k, MN_F32, 4, kshape, 1); /* 1 MiB: staged */
    make_tensor(&v, MN_F32, 4, kshape, 2);
    make_tensor(&w, MN_F32, 2, wshape, 3); /* 16 KiB: moved by to_device */
    make_tensor(&len, MN_I64, 1, one, 0);
    make_tensor(&theta, MN_F32, 0, NULL, 0.25);
    mn_node *root = mn_node_group("/");
    mn_node_add_integer(root, "mnemo_schema", 1);
    mn_node_add_integer(mn_node_add_group(root, "rule"), "layers", 1);
    mn_node *in = mn_node_add_group(root, "inputs");
    mn_node_add_tensor(in, "k", &k);
    mn_node_add_tensor(in, "v", &v);
    mn_node_add_tensor(in, "lengths", &len);
    mn_node_add_tensor(mn_node_add_group(root, "gates"), "theta", &theta);
    mn_node_add_tensor(mn_node_add_group(root, "init"), "W1", &w);
    const char *p = in_dir("staged_exp.h5");
    CHECK("staged experiment: saved", mn_h5_save(p, root) == MN_OK);
    CHECK("staged experiment: which paths go to the device",
          mn_experiment_path_on_device("/inputs/k") && mn_experiment_path_on_device("/gates/eta") &&
              mn_experiment_path_on_device("/init/S_W1") && !mn_experiment_path_on_device("/inputs/lengths") &&
              !mn_experiment_path_on_device("/upstream/y") && !mn_experiment_path_on_device("/init/x/y"));
    mn_experiment e;
    mn_h5_io io = {.device = MN_CUDA, .on_device = mn_experiment_path_on_device};
    mn_status st = mn_experiment_load_io(p, &e, &io);
    CHECK("staged experiment: loads", st == MN_OK);
    if (st != MN_OK) {
        printf("  %s\n", mn_last_error());
        return;
    }
    CHECK("staged experiment: k and v on the device, the rest not yet",
          e.k.storage->device == MN_CUDA && e.v.storage->device == MN_CUDA && e.init[0].storage->device == MN_CPU &&
              e.theta.storage->device == MN_CPU && e.lengths.storage->device == MN_CPU);
    CHECK_NEAR("staged experiment: bytes staged", io.staged_bytes, 2.0 * 4 * 2048 * 128, 0);
    double up = 0;
    st = mn_experiment_to_device(&e, MN_CUDA, &up);
    CHECK("staged experiment: to the device", st == MN_OK);
    if (st != MN_OK) printf("  %s\n", mn_last_error());
    CHECK("staged experiment: all but lengths there",
          e.init[0].storage->device == MN_CUDA && e.theta.storage->device == MN_CUDA &&
              e.lengths.storage->device == MN_CPU && !e.q.storage && !e.eta.storage);
    CHECK_NEAR("staged experiment: bytes moved", up, 4.0 * (64 * 64 + 1), 0);
    CHECK("staged experiment: back to the host", mn_experiment_to_device(&e, MN_CPU, NULL) == MN_OK);
    CHECK("staged experiment: values after the round trip",
          e.k.storage->device == MN_CPU && same_tensor(&k, &e.k) && same_tensor(&v, &e.v) &&
              same_tensor(&w, &e.init[0]) && same_tensor(&theta, &e.theta) && same_tensor(&len, &e.lengths));
    mn_experiment_free(&e);
    mn_node_free(root);
    mn_tensor *all[] = {&k, &v, &w, &len, &theta};
    for (int i = 0; i < 5; i++) mn_tensor_release(all[i]);
    mn_register_device_copy(MN_CUDA, MN_CPU, NULL);
    mn_register_device_copy(MN_CPU, MN_CUDA, NULL);
    mn_register_backend(MN_CUDA, NULL);
    mn_set_allocator(MN_CUDA, NULL);
}

int main(int argc, char **argv)
{
    (void)argc;
    if (!getenv("MNEMO_TEST_H5_CHILD")) { /* see test_no_growth */
        const char *old = getenv("GLIBC_TUNABLES");
        char tun[512];
        snprintf(tun, sizeof tun, "%s%sglibc.malloc.tcache_count=0", old ? old : "", old ? ":" : "");
        setenv("GLIBC_TUNABLES", tun, 1);
        setenv("MNEMO_TEST_H5_CHILD", "1", 1);
        fflush(stdout);
        execv("/proc/self/exe", argv);
        printf("  (could not re-execute without the malloc cache; heap counts may drift)\n");
    }
    snprintf(dir, sizeof dir, "/tmp/mnemo-test-h5-XXXXXX");
    if (!mkdtemp(dir)) { printf("FAIL setup: mkdtemp\n"); return 1; }
    test_round_trip();
    CHECK("no HDF5 object left open after round trip", hdf5_open_objects() == 0);
    test_atomic();
    CHECK("no HDF5 object left open after failed saves", hdf5_open_objects() == 0);
    test_load_errors();
    test_foreign();
    CHECK("no HDF5 object left open after foreign loads and errors", hdf5_open_objects() == 0);
    test_no_growth();
    test_staged();
    test_staged_experiment();
    CHECK("no HDF5 object left open after staged loads and saves", hdf5_open_objects() == 0);
    SKIP("save of a CUDA tensor", "needs a GPU (tests/gpu covers device tensors)");
    char cmd[128];
    if (getenv("KEEP")) return CHECK_DONE();
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", dir);
    return CHECK_DONE();
}
