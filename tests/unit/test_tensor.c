/* test_tensor.c: tensors and storage (tensor.c) and the tree of values
 * (tree.c): creation, refcounts through a counting allocator, views that
 * alias storage, error messages, copies and dtype conversion, cat and stack,
 * the device hooks. */
#include "check.h"
#include "ops.h"
#include "tree.h"

#include <stdint.h>
#include <stdlib.h>

static double at2(const mn_tensor *t, int64_t i, int64_t j)
{
    int64_t idx[2] = {i, j};
    return mn_tensor_get(t, idx);
}

static void set2(mn_tensor *t, int64_t i, int64_t j, double v)
{
    int64_t idx[2] = {i, j};
    mn_tensor_set(t, idx, v);
}

static double at1(const mn_tensor *t, int64_t i) { return mn_tensor_get(t, &i); }

/* A [rows, cols] f64 tensor holding 10*i + j. */
static mn_tensor grid(int64_t rows, int64_t cols, mn_dtype dt)
{
    mn_tensor t = {0};
    int64_t shape[2] = {rows, cols};
    if (mn_tensor_empty(&t, dt, 2, shape, MN_CPU) != MN_OK) abort();
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) set2(&t, i, j, 10.0 * (double)i + (double)j);
    return t;
}

/* ---- a counting allocator, to see storage freed exactly at the last release ---- */

static int live_blocks, total_allocs;

static mn_status count_alloc(size_t nbytes, void **out)
{
    *out = malloc(nbytes ? nbytes : 1);
    if (!*out) return mn_fail(MN_ERR_OOM, "test allocator: out of memory");
    live_blocks++;
    total_allocs++;
    return MN_OK;
}

static void count_free(void *p, size_t nbytes)
{
    (void)nbytes;
    live_blocks--;
    free(p);
}

static const mn_allocator counting = {count_alloc, count_free};

static void test_create(void)
{
    mn_tensor t = {0};
    int64_t shape[3] = {2, 3, 4};
    char buf[128];
    CHECK("tensor/empty_ok", mn_tensor_zeros(&t, MN_F32, 3, shape, MN_CPU) == MN_OK);
    CHECK("tensor/numel", mn_tensor_numel(&t) == 24);
    CHECK("tensor/strides", t.stride[0] == 12 && t.stride[1] == 4 && t.stride[2] == 1);
    CHECK("tensor/contiguous", mn_tensor_is_contiguous(&t));
    CHECK("tensor/shape_string", strcmp(mn_shape_string(&t, buf, sizeof buf), "2x3x4") == 0);
    int64_t idx[3] = {1, 2, 3};
    CHECK("tensor/zeros_are_zero", mn_tensor_get(&t, idx) == 0.0);
    mn_tensor_set(&t, idx, 2.5);
    CHECK("tensor/set_get", mn_tensor_get(&t, idx) == 2.5 && ((float *)mn_tensor_data(&t))[23] == 2.5f);
    CHECK("tensor/offset_of", mn_tensor_offset_of(&t, idx) == 23);
    mn_status st = mn_tensor_zeros(&t, MN_F32, 3, shape, MN_CPU);
    CHECK("tensor/out_must_be_empty", st == MN_ERR_ARG);
    CHECK_STR_CONTAINS("tensor/out_must_be_empty_message", mn_last_error(), "not empty");
    mn_tensor_release(&t);
    CHECK("tensor/release_empties", t.storage == NULL && t.ndim == 0);
    mn_tensor_release(&t); /* twice is harmless */
    mn_tensor_release(NULL);

    /* Scalars. */
    CHECK("tensor/scalar_ok", mn_tensor_empty(&t, MN_F64, 0, NULL, MN_CPU) == MN_OK);
    CHECK("tensor/scalar_numel", mn_tensor_numel(&t) == 1 && mn_tensor_is_contiguous(&t));
    CHECK("tensor/scalar_string", strcmp(mn_shape_string(&t, buf, sizeof buf), "scalar") == 0);
    mn_tensor_set(&t, NULL, 7.0);
    CHECK("tensor/scalar_get", mn_tensor_get(&t, NULL) == 7.0);
    mn_tensor_release(&t);

    /* Zero-size dims. */
    int64_t zshape[2] = {0, 3};
    CHECK("tensor/zero_size_ok", mn_tensor_zeros(&t, MN_I64, 2, zshape, MN_CPU) == MN_OK);
    CHECK("tensor/zero_size_numel", mn_tensor_numel(&t) == 0 && mn_tensor_data(&t) != NULL);
    mn_tensor v = {0};
    int64_t rs[2] = {3, 0};
    CHECK("tensor/zero_size_reshape", mn_view_reshape(&v, &t, 2, rs) == MN_OK && v.shape[1] == 0);
    mn_tensor_release(&v);
    CHECK("tensor/zero_size_transpose", mn_view_transpose(&v, &t, 0, 1) == MN_OK && v.shape[0] == 3);
    mn_tensor c = {0};
    CHECK("tensor/zero_size_clone", mn_tensor_clone(&c, &v) == MN_OK && mn_tensor_numel(&c) == 0);
    CHECK("tensor/zero_size_fill", mn_tensor_fill(&v, 3.0) == MN_OK);
    mn_tensor_release(&c);
    mn_tensor_release(&v);
    mn_tensor_release(&t);

    int64_t bad[2] = {2, -1};
    st = mn_tensor_empty(&t, MN_F32, 2, bad, MN_CPU);
    CHECK("tensor/negative_size", st == MN_ERR_ARG && t.storage == NULL);
    CHECK_STR_CONTAINS("tensor/negative_size_message", mn_last_error(), "negative size -1 in dim 1");
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    CHECK("tensor/too_many_dims", mn_tensor_empty(&t, MN_F32, 9, nine, MN_CPU) == MN_ERR_ARG);
    int64_t huge[3] = {INT64_MAX / 2, 4, 4};
    CHECK("tensor/overflowing_shape", mn_tensor_empty(&t, MN_F32, 3, huge, MN_CPU) == MN_ERR_ARG);
}

static void test_refcounts(void)
{
    mn_set_allocator(MN_CPU, &counting);
    live_blocks = 0;
    mn_tensor a = grid(3, 4, MN_F64), b = {0}, c = {0}, d = {0};
    CHECK("refs/one_block", live_blocks == 1 && a.storage->refs == 1);
    mn_view_transpose(&b, &a, 0, 1);
    mn_view_select(&c, &b, 0, 2);
    mn_tensor_share(&d, &c);
    CHECK("refs/views_share", live_blocks == 1 && a.storage->refs == 4 && c.storage == a.storage);
    /* Release the base first: the views keep the storage alive. */
    mn_tensor_release(&a);
    CHECK("refs/base_released_first", live_blocks == 1 && b.storage->refs == 3);
    CHECK("refs/view_still_reads", at1(&c, 1) == 12.0);
    mn_tensor_release(&c);
    mn_tensor_release(&b);
    CHECK("refs/not_yet_freed", live_blocks == 1);
    mn_tensor_release(&d);
    CHECK("refs/freed_at_zero", live_blocks == 0);

    /* mn_tensor_release_held: the slots with storage released, the empty
     * ones (one with stale fields, which it leaves) untouched */
    mn_tensor slots[3] = {grid(2, 2, MN_F32), {0}, {0}};
    slots[1].ndim = 2;
    mn_tensor_share(&slots[2], &slots[0]);
    CHECK("refs/held_before", live_blocks == 1 && slots[0].storage->refs == 2);
    mn_tensor_release_held(slots, 3);
    CHECK("refs/held_released", live_blocks == 0 && !slots[0].storage && !slots[2].storage && slots[0].ndim == 0 &&
                                    slots[1].ndim == 2);

    /* The other order, and temporaries inside ops free themselves. */
    a = grid(5, 6, MN_F32);
    mn_view_slice(&b, &a, 1, 1, 5, 2);
    mn_tensor_release(&b);
    CHECK("refs/view_first", live_blocks == 1);
    mn_tensor_release(&a);
    CHECK("refs/view_first_freed", live_blocks == 0);
    a = grid(5, 6, MN_F32);
    mn_tensor i = grid(6, 5, MN_I64);
    mn_view_transpose(&b, &i, 0, 1);
    CHECK("refs/op_ok", mn_binary(MN_OP_add, &c, &a, &b) == MN_OK && c.dtype == MN_F32);
    CHECK("refs/op_temporaries_freed", live_blocks == 3);
    CHECK("refs/op_result_value", at2(&c, 4, 5) == 45.0 + 54.0);
    mn_tensor_release(&a);
    mn_tensor_release(&b);
    mn_tensor_release(&c);
    mn_tensor_release(&i);
    CHECK("refs/all_freed", live_blocks == 0);

    /* A failed op leaves its out empty and nothing behind. */
    a = grid(2, 3, MN_F32);
    b = grid(3, 2, MN_F32);
    CHECK("refs/failed_op", mn_binary(MN_OP_mul, &c, &a, &b) == MN_ERR_ARG && c.storage == NULL);
    mn_tensor_release(&a);
    mn_tensor_release(&b);
    CHECK("refs/failed_op_no_leak", live_blocks == 0);
    mn_set_allocator(MN_CPU, NULL);
}

static void test_views(void)
{
    mn_tensor a = grid(3, 4, MN_F64), t = {0}, s = {0}, v = {0};
    CHECK("views/transpose_ok", mn_view_transpose(&t, &a, 0, -1) == MN_OK);
    CHECK("views/transpose_shape", t.shape[0] == 4 && t.shape[1] == 3 && !mn_tensor_is_contiguous(&t));
    set2(&t, 3, 1, -5.0); /* writes a[1][3] */
    CHECK("views/write_through_transpose", at2(&a, 1, 3) == -5.0);
    CHECK("views/read_through_transpose", at2(&t, 2, 0) == 2.0);

    CHECK("views/slice_ok", mn_view_slice(&s, &a, 1, 1, 4, 2) == MN_OK);
    CHECK("views/slice_shape", s.ndim == 2 && s.shape[1] == 2 && s.stride[1] == 2);
    CHECK("views/slice_values", at2(&s, 2, 0) == 21.0 && at2(&s, 2, 1) == 23.0);
    set2(&s, 0, 0, 99.0);
    CHECK("views/write_through_slice", at2(&a, 0, 1) == 99.0);
    mn_tensor_release(&s);
    CHECK("views/slice_empty_range", mn_view_slice(&s, &a, 0, 2, 2, 1) == MN_OK && s.shape[0] == 0);
    mn_tensor_release(&s);
    CHECK("views/slice_out_of_bounds", mn_view_slice(&s, &a, 0, 0, 4, 1) == MN_ERR_ARG);
    CHECK("views/slice_bad_step", mn_view_slice(&s, &a, 0, 0, 2, 0) == MN_ERR_ARG);

    CHECK("views/select_ok", mn_view_select(&s, &t, 0, 2) == MN_OK && s.ndim == 1 && s.shape[0] == 3);
    CHECK("views/select_values", at1(&s, 0) == 2.0 && at1(&s, 2) == 22.0);
    mn_tensor_release(&s);
    CHECK("views/select_out_of_range", mn_view_select(&s, &a, 1, 4) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/select_message", mn_last_error(), "select: index 4 out of range for dim 1 of size 4");

    CHECK("views/unsqueeze", mn_view_unsqueeze(&s, &a, 1) == MN_OK && s.ndim == 3 && s.shape[1] == 1 &&
                                 mn_tensor_is_contiguous(&s));
    CHECK("views/unsqueeze_last", mn_view_unsqueeze(&v, &s, -1) == MN_OK && v.ndim == 4 && v.shape[3] == 1);
    mn_tensor_release(&s);
    CHECK("views/squeeze_all", mn_view_squeeze(&s, &v, -99) == MN_OK && s.ndim == 2 && s.shape[1] == 4);
    mn_tensor_release(&s);
    CHECK("views/squeeze_one", mn_view_squeeze(&s, &v, 1) == MN_OK && s.ndim == 3);
    mn_tensor_release(&s);
    CHECK("views/squeeze_non1_noop", mn_view_squeeze(&s, &v, 0) == MN_OK && s.ndim == 4);
    mn_tensor_release(&s);
    mn_tensor_release(&v);

    int perm[2] = {1, 0};
    CHECK("views/permute", mn_view_permute(&s, &a, perm) == MN_OK && s.stride[0] == 1 && s.stride[1] == 4);
    mn_tensor_release(&s);
    int dup[2] = {1, -1};
    CHECK("views/permute_dup", mn_view_permute(&s, &a, dup) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/permute_dup_message", mn_last_error(), "appears twice");

    int64_t eshape[3] = {2, 3, 4};
    CHECK("views/expand", mn_view_expand(&s, &a, 3, eshape) == MN_OK && s.stride[0] == 0);
    CHECK("views/expand_aliases", mn_tensor_data(&s) == mn_tensor_data(&a));
    mn_tensor_release(&s);
    int64_t bshape[2] = {3, 5};
    CHECK("views/expand_bad", mn_view_expand(&s, &a, 2, bshape) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/expand_bad_message", mn_last_error(), "expand: cannot expand 3x4 to 3x5");

    int64_t r2[2] = {2, 6}, r1[1] = {-1}, r55[2] = {5, 5};
    CHECK("views/reshape_view", mn_view_reshape(&s, &a, 2, r2) == MN_OK && s.storage == a.storage);
    CHECK("views/reshape_values", at2(&s, 1, 0) == 12.0);
    mn_tensor_release(&s);
    CHECK("views/reshape_infer", mn_view_reshape(&s, &a, 1, r1) == MN_OK && s.shape[0] == 12);
    mn_tensor_release(&s);
    mn_tensor b = grid(4, 6, MN_F32);
    CHECK("views/reshape_bad", mn_view_reshape(&s, &b, 2, r55) == MN_ERR_ARG && s.storage == NULL);
    CHECK_STR_CONTAINS("views/reshape_bad_message", mn_last_error(),
                       "reshape: cannot view 4x6 (24 elements) as 5x5 (25 elements)");
    /* A transposed tensor cannot be flattened as a view; mn_tensor_reshape copies. */
    CHECK("views/reshape_noncontig_refused", mn_view_reshape(&s, &t, 1, r1) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/reshape_noncontig_message", mn_last_error(), "non-contiguous");
    CHECK("views/tensor_reshape_copies", mn_tensor_reshape(&s, &t, 1, r1) == MN_OK && s.storage != a.storage);
    CHECK("views/tensor_reshape_order", at1(&s, 1) == 10.0 && at1(&s, 3) == 99.0);
    mn_tensor_release(&s);
    /* Splitting a dim of a transposed tensor is still a view. */
    int64_t split[3] = {2, 2, 3};
    CHECK("views/reshape_split_transposed", mn_view_reshape(&s, &t, 3, split) == MN_OK && s.storage == a.storage &&
                                                mn_tensor_get(&s, (int64_t[]){0, 0, 0}) == 0.0);
    int64_t ix[3] = {1, 0, 2};
    CHECK("views/reshape_split_value", mn_tensor_get(&s, ix) == 22.0);
    mn_tensor_release(&s);

    CHECK("views/transpose_bad_dim", mn_view_transpose(&s, &a, 3, 0) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/transpose_bad_dim_message", mn_last_error(),
                       "transpose: dim 3 out of range for a 2-d tensor");
    int d;
    CHECK("views/resolve_negative", mn_resolve_dim(-1, 3, 0, &d) == MN_OK && d == 2);
    CHECK("views/resolve_extra", mn_resolve_dim(3, 3, 1, &d) == MN_OK && d == 3);
    CHECK("views/resolve_bad", mn_resolve_dim(-4, 3, 0, &d) == MN_ERR_ARG);

    int ndim;
    int64_t out[MN_MAX_DIMS], s1[2] = {3, 1}, s2[3] = {2, 1, 4}, s3[1] = {4}, s4[2] = {2, 3}, s0[2] = {0, 1};
    CHECK("views/broadcast", mn_broadcast_shapes(2, s1, 3, s2, &ndim, out) == MN_OK && ndim == 3 &&
                                 out[0] == 2 && out[1] == 3 && out[2] == 4);
    CHECK("views/broadcast_zero", mn_broadcast_shapes(2, s0, 1, s3, &ndim, out) == MN_OK && out[0] == 0 && out[1] == 4);
    CHECK("views/broadcast_scalar", mn_broadcast_shapes(0, NULL, 2, s4, &ndim, out) == MN_OK && ndim == 2);
    CHECK("views/broadcast_bad", mn_broadcast_shapes(2, s4, 1, s3, &ndim, out) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("views/broadcast_bad_message", mn_last_error(), "shapes 2x3 and 4 do not broadcast");

    mn_tensor_release(&t);
    mn_tensor_release(&a);
    mn_tensor_release(&b);
}

static void test_copies(void)
{
    mn_tensor a = grid(3, 4, MN_F64), t = {0}, c = {0};
    mn_view_transpose(&t, &a, 0, 1);
    CHECK("copy/contiguous_copies", mn_tensor_contiguous(&c, &t) == MN_OK && c.storage != a.storage &&
                                        mn_tensor_is_contiguous(&c));
    CHECK("copy/contiguous_values", at2(&c, 3, 2) == 23.0 && ((double *)mn_tensor_data(&c))[1] == 10.0);
    mn_tensor_release(&c);
    CHECK("copy/contiguous_shares", mn_tensor_contiguous(&c, &a) == MN_OK && c.storage == a.storage);
    mn_tensor_release(&c);
    CHECK("copy/clone", mn_tensor_clone(&c, &a) == MN_OK && c.storage != a.storage && at2(&c, 2, 3) == 23.0);
    set2(&c, 0, 0, 5.0);
    CHECK("copy/clone_independent", at2(&a, 0, 0) == 0.0);
    mn_tensor_release(&c);
    CHECK("copy/to_same_dtype_shares", mn_tensor_to_dtype(&c, &a, MN_F64) == MN_OK && c.storage == a.storage);
    mn_tensor_release(&c);

    /* Float to integer: toward zero; NaN -> 0; infinities saturate. */
    double vals[6] = {-2.7, 2.7, NAN, INFINITY, -INFINITY, 1e30};
    int64_t want[6] = {-2, 2, 0, INT64_MAX, INT64_MIN, INT64_MAX};
    int64_t six = 6;
    mn_tensor f = {0}, i = {0}, g = {0};
    mn_tensor_empty(&f, MN_F64, 1, &six, MN_CPU);
    memcpy(mn_tensor_data(&f), vals, sizeof vals);
    CHECK("copy/to_i64", mn_tensor_to_dtype(&i, &f, MN_I64) == MN_OK && i.dtype == MN_I64);
    CHECK("copy/to_i64_values", memcmp(mn_tensor_data(&i), want, sizeof want) == 0);
    CHECK("copy/to_f32", mn_tensor_to_dtype(&g, &f, MN_F32) == MN_OK && ((float *)mn_tensor_data(&g))[0] == -2.7f &&
                             isnan(((float *)mn_tensor_data(&g))[2]) && isinf(((float *)mn_tensor_data(&g))[3]) &&
                             ((float *)mn_tensor_data(&g))[5] == 1e30f);
    mn_tensor_release(&g);
    CHECK("copy/i64_to_f64", mn_tensor_to_dtype(&g, &i, MN_F64) == MN_OK && at1(&g, 0) == -2.0 &&
                                 at1(&g, 4) == -9223372036854775808.0);
    mn_tensor_release(&g);
    mn_tensor_release(&i);
    mn_tensor_release(&f);

    /* copy_into: broadcast a row into a transposed view, converting dtype. */
    mn_tensor row = {0};
    int64_t three = 3;
    mn_tensor_empty(&row, MN_I64, 1, &three, MN_CPU);
    for (int64_t k = 0; k < 3; k++) mn_tensor_set(&row, &k, (double)(k + 1));
    CHECK("copy/into_broadcast", mn_tensor_copy_into(&t, &row) == MN_OK);
    CHECK("copy/into_values", at2(&a, 0, 3) == 1.0 && at2(&a, 2, 0) == 3.0 && at2(&a, 1, 2) == 2.0);
    int64_t two = 2;
    mn_tensor small = {0};
    mn_tensor_zeros(&small, MN_F32, 1, &two, MN_CPU);
    CHECK("copy/into_bad", mn_tensor_copy_into(&t, &small) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("copy/into_bad_message", mn_last_error(), "copy: cannot broadcast 2 into 4x3");
    mn_tensor_release(&small);
    mn_tensor_release(&row);

    /* Overlapping views of one storage: a = a^T on a square matrix. */
    mn_tensor sq = grid(3, 3, MN_F32), sqt = {0};
    mn_view_transpose(&sqt, &sq, 0, 1);
    CHECK("copy/into_overlap", mn_tensor_copy_into(&sq, &sqt) == MN_OK);
    CHECK("copy/into_overlap_values", at2(&sq, 0, 2) == 20.0 && at2(&sq, 2, 0) == 2.0 && at2(&sq, 1, 2) == 21.0);
    mn_tensor_release(&sqt);
    mn_tensor_release(&sq);

    /* Parts of one storage: v[0:4] = v[2:6] (spans meet: read before any
     * write), then v[6:8] = v[0:2] (apart: a direct copy), and columns of
     * one matrix (interleaved spans, disjoint elements). */
    int64_t eight = 8;
    mn_tensor vec = {0}, lo = {0}, hi = {0};
    mn_tensor_empty(&vec, MN_F32, 1, &eight, MN_CPU);
    for (int64_t k = 0; k < 8; k++) mn_tensor_set(&vec, &k, (double)k);
    mn_view_slice(&lo, &vec, 0, 0, 4, 1);
    mn_view_slice(&hi, &vec, 0, 2, 6, 1);
    CHECK("copy/into_shifted", mn_tensor_copy_into(&lo, &hi) == MN_OK);
    float *vd = mn_tensor_data(&vec);
    CHECK("copy/into_shifted_values", vd[0] == 2 && vd[1] == 3 && vd[2] == 4 && vd[3] == 5 && vd[4] == 4);
    mn_tensor_release(&lo);
    mn_tensor_release(&hi);
    mn_view_slice(&lo, &vec, 0, 0, 2, 1);
    mn_view_slice(&hi, &vec, 0, 6, 8, 1);
    CHECK("copy/into_apart", mn_tensor_copy_into(&hi, &lo) == MN_OK);
    CHECK("copy/into_apart_values", vd[6] == 2 && vd[7] == 3 && vd[0] == 2 && vd[5] == 5);
    mn_tensor_release(&lo);
    mn_tensor_release(&hi);
    mn_tensor_release(&vec);
    mn_tensor cols = grid(3, 2, MN_F32), c0 = {0}, c1 = {0};
    mn_view_select(&c0, &cols, 1, 0);
    mn_view_select(&c1, &cols, 1, 1);
    CHECK("copy/into_interleaved", mn_tensor_copy_into(&c0, &c1) == MN_OK);
    CHECK("copy/into_interleaved_values",
          at2(&cols, 0, 0) == at2(&cols, 0, 1) && at2(&cols, 2, 0) == at2(&cols, 2, 1) && at2(&cols, 1, 1) == 11.0);
    mn_tensor_release(&c0);
    mn_tensor_release(&c1);
    mn_tensor_release(&cols);

    /* fill on a strided view touches only the view. */
    mn_tensor col = {0};
    mn_view_select(&col, &a, 1, 1);
    CHECK("copy/fill_view", mn_tensor_fill(&col, -1.5) == MN_OK);
    CHECK("copy/fill_view_values", at2(&a, 0, 1) == -1.5 && at2(&a, 2, 1) == -1.5 && at2(&a, 2, 2) != -1.5);
    mn_tensor_release(&col);
    mn_tensor z = grid(2, 2, MN_I64);
    CHECK("copy/fill_i64_truncates", mn_tensor_fill(&z, 3.9) == MN_OK && at2(&z, 1, 1) == 3.0);
    CHECK("copy/fill_zero", mn_tensor_fill(&z, 0.0) == MN_OK && at2(&z, 1, 0) == 0.0);
    mn_tensor_release(&z);
    mn_tensor_release(&t);
    mn_tensor_release(&a);
}

static void test_cat_stack(void)
{
    mn_tensor a = grid(2, 3, MN_F32), b = grid(4, 3, MN_F64), c = grid(2, 4, MN_F32), out = {0};
    const mn_tensor *ab[2] = {&a, &b};
    CHECK("cat/dim0", mn_tensor_cat(&out, ab, 2, 0) == MN_OK && out.shape[0] == 6 && out.dtype == MN_F64);
    CHECK("cat/dim0_values", at2(&out, 1, 2) == 12.0 && at2(&out, 2, 0) == 0.0 && at2(&out, 5, 1) == 31.0);
    mn_tensor_release(&out);
    const mn_tensor *ac[3] = {&a, &c, &a};
    CHECK("cat/dim1", mn_tensor_cat(&out, ac, 3, -1) == MN_OK && out.shape[1] == 10 && out.shape[0] == 2);
    CHECK("cat/dim1_values", at2(&out, 1, 3) == 10.0 && at2(&out, 1, 6) == 13.0 && at2(&out, 1, 9) == 12.0);
    mn_tensor_release(&out);
    const mn_tensor *bad[3] = {&a, &a, &c};
    CHECK("cat/mismatch", mn_tensor_cat(&out, bad, 3, 0) == MN_ERR_ARG && out.storage == NULL);
    CHECK_STR_CONTAINS("cat/mismatch_message", mn_last_error(), "cat: part 2 (2x4) differs from part 0 (2x3) at dim 1");

    const mn_tensor *aa[2] = {&a, &a};
    CHECK("stack/dim0", mn_tensor_stack(&out, aa, 2, 0) == MN_OK && out.ndim == 3 && out.shape[0] == 2);
    int64_t ix[3] = {1, 1, 2};
    CHECK("stack/dim0_value", mn_tensor_get(&out, ix) == 12.0);
    mn_tensor_release(&out);
    CHECK("stack/dim_last", mn_tensor_stack(&out, aa, 2, 2) == MN_OK && out.shape[2] == 2 && out.shape[1] == 3);
    mn_tensor_release(&out);
    const mn_tensor *ac2[2] = {&a, &c};
    CHECK("stack/mismatch", mn_tensor_stack(&out, ac2, 2, 0) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("stack/mismatch_message", mn_last_error(), "stack: part 1 has shape 2x4, part 0 has 2x3");
    CHECK("cat/none", mn_tensor_cat(&out, NULL, 0, 0) == MN_ERR_ARG);
    mn_tensor_release(&a);
    mn_tensor_release(&b);
    mn_tensor_release(&c);
}

/* ---- the device hooks, exercised with a pretend device made of host memory ---- */

static int copies_made;

static mn_status fake_copy(mn_tensor *dst, const mn_tensor *src)
{
    copies_made++;
    if (!mn_tensor_is_contiguous(src)) return mn_fail(MN_ERR_ARG, "fake copy wants contiguous sources");
    memcpy(mn_tensor_data(dst), mn_tensor_data(src), (size_t)mn_tensor_numel(src) * mn_dtype_size(src->dtype));
    return MN_OK;
}

static void test_devices(void)
{
    mn_tensor a = grid(2, 3, MN_F32), b = {0};
    CHECK("device/cpu_to_cpu_shares", mn_tensor_to_device(&b, &a, MN_CPU) == MN_OK && b.storage == a.storage);
    mn_tensor_release(&b);
    CHECK("device/no_cuda", mn_tensor_to_device(&b, &a, MN_CUDA) == MN_ERR_DEVICE && b.storage == NULL);
    CHECK_STR_CONTAINS("device/no_cuda_message", mn_last_error(), "cuda: no CUDA device in this build");
    int64_t two = 2;
    CHECK("device/no_cuda_alloc", mn_tensor_empty(&b, MN_F32, 1, &two, MN_CUDA) == MN_ERR_DEVICE);
    CHECK_STR_CONTAINS("device/no_cuda_alloc_message", mn_last_error(), "cuda: no CUDA device in this build");

    /* Registering a backend, an allocator and the copies is all a device
     * layer does; the pretend one reuses host memory. */
    mn_backend fake = *mn_cpu_backend();
    fake.name = "fake";
    mn_register_backend(MN_CUDA, &fake);
    mn_set_allocator(MN_CUDA, &counting);
    live_blocks = 0;
    CHECK("device/no_copy_registered", mn_tensor_to_device(&b, &a, MN_CUDA) == MN_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS("device/no_copy_message", mn_last_error(), "no copy from cpu to cuda");
    mn_register_device_copy(MN_CUDA, MN_CPU, fake_copy);
    mn_register_device_copy(MN_CPU, MN_CUDA, fake_copy);
    CHECK("device/to_cuda", mn_tensor_to_device(&b, &a, MN_CUDA) == MN_OK && b.storage->device == MN_CUDA &&
                                copies_made == 1 && live_blocks == 1);
    mn_tensor back = {0};
    CHECK("device/back", mn_tensor_to_device(&back, &b, MN_CPU) == MN_OK && back.storage->device == MN_CPU &&
                             at2(&back, 1, 2) == 12.0);
    mn_tensor sum = {0};
    CHECK("device/mixed_op_refused", mn_binary(MN_OP_add, &sum, &a, &b) == MN_ERR_ARG);
    CHECK_STR_CONTAINS("device/mixed_op_message", mn_last_error(), "add: operands on cpu and cuda");
    /* copy_into across devices moves the source first. */
    mn_tensor c = grid(2, 3, MN_F64);
    CHECK("device/copy_into_across", mn_tensor_copy_into(&c, &b) == MN_OK && copies_made == 3);
    mn_tensor_release(&c);
    mn_tensor_release(&b);
    CHECK("device/freed_by_its_allocator", live_blocks == 0);
    mn_tensor_release(&back);
    mn_register_device_copy(MN_CUDA, MN_CPU, NULL);
    mn_register_device_copy(MN_CPU, MN_CUDA, NULL);
    mn_set_allocator(MN_CUDA, NULL);
    mn_register_backend(MN_CUDA, NULL);
    CHECK("device/unregistered_again", mn_backend_for(MN_CUDA) == NULL && mn_backend_for(MN_CPU) != NULL);
    mn_tensor_release(&a);
}

static void test_tree(void)
{
    mn_node *root = mn_node_group("/");
    mn_node *rule = mn_node_add_group(root, "rule");
    mn_node *in = mn_node_add_group(root, "inputs");
    mn_tensor t = grid(2, 2, MN_F32);
    CHECK("tree/add", rule && in && mn_node_add_integer(rule, "layers", 2) && mn_node_add_number(rule, "clip_max", 0.5) &&
                          mn_node_add_string(rule, "loss", "mse") && mn_node_add_tensor(in, "k", &t));
    CHECK("tree/tensor_ref_taken", t.storage->refs == 2);
    mn_node *sub = mn_node_add_group(in, "deep");
    for (int i = 0; i < 20; i++) { /* grows past the first capacity */
        char name[16];
        snprintf(name, sizeof name, "n%d", i);
        mn_node_add_integer(sub, name, i);
    }
    CHECK("tree/order_kept", root->nchildren == 2 && strcmp(root->children[1]->name, "inputs") == 0);
    mn_node *f = mn_node_find(root, "rule/layers");
    CHECK("tree/find_path", f && f->kind == MN_NODE_INTEGER && f->integer == 2);
    f = mn_node_find(root, "/inputs/deep/n17");
    CHECK("tree/find_deep", f && f->integer == 17);
    CHECK("tree/find_direct", mn_node_find(rule, "loss") && strcmp(mn_node_find(rule, "loss")->string, "mse") == 0);
    CHECK("tree/find_missing", mn_node_find(root, "rule/nope") == NULL && mn_node_find(root, "rule/layers/x") == NULL);
    CHECK("tree/find_prefix_not_match", mn_node_find(root, "rul") == NULL);
    CHECK("tree/find_self", mn_node_find(root, "") == root);
    mn_node *k = mn_node_find(root, "inputs/k");
    CHECK("tree/tensor_leaf", k && k->kind == MN_NODE_TENSOR && k->tensor.storage == t.storage);
    CHECK("tree/add_to_leaf_refused", mn_node_add_number(k, "x", 1) == NULL);
    mn_node_free(root);
    CHECK("tree/free_releases", t.storage->refs == 1);
    mn_node_free(NULL);
    mn_tensor_release(&t);
}

int main(void)
{
    test_create();
    test_refcounts();
    test_views();
    test_copies();
    test_cat_stack();
    test_devices();
    test_tree();
    return CHECK_DONE();
}
