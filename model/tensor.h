/* tensor.h: n-dimensional strided tensors over refcounted storage.
 * A tensor is a small value (shape, strides, offset, dtype) that points at a
 * storage; views share the storage and bump its count. Holders (a Lua
 * userdata, an engine struct) own one storage reference each and give it back
 * with mn_tensor_release. Sizes are in elements, strides in elements. */
#ifndef MN_TENSOR_H
#define MN_TENSOR_H

#include "mn.h"

#define MN_MAX_DIMS 8

typedef struct mn_storage {
    void *data;
    size_t nbytes;
    int refs;
    mn_device device;
    bool borrowed;       /* memory owned by someone else (mn_tensor_wrap): never freed here */
} mn_storage;

typedef struct mn_tensor {
    mn_storage *storage; /* NULL for an empty (released) tensor */
    int64_t offset;      /* first element, in elements of dtype */
    int ndim;            /* 0 for a scalar tensor */
    int64_t shape[MN_MAX_DIMS];
    int64_t stride[MN_MAX_DIMS];
    mn_dtype dtype;
} mn_tensor;

/* Storage allocation is pluggable per device: the CUDA layer registers its
 * caching allocator here; the CPU uses malloc. */
typedef struct mn_allocator {
    mn_status (*alloc)(size_t nbytes, void **out);
    void (*free)(void *ptr, size_t nbytes);
} mn_allocator;
void mn_set_allocator(mn_device dev, const mn_allocator *a);

/* New contiguous tensor, uninitialised (zeros: mn_tensor_zeros). out must be
 * empty (zeroed or released); on failure out stays empty. */
mn_status mn_tensor_empty(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          mn_device dev);
mn_status mn_tensor_zeros(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          mn_device dev);
/* A tensor over memory the caller owns (a torch tensor's data, say): no copy,
 * and the last release frees only the header, never data. Strides in
 * elements (NULL: contiguous); the caller keeps data alive and unmoved while
 * any holder of the tensor lives. */
mn_status mn_tensor_wrap(mn_tensor *out, void *data, mn_dtype dt, int ndim, const int64_t *shape,
                         const int64_t *stride, mn_device dev);
/* Give back this holder's storage reference and make t empty. NULL-safe. */
void mn_tensor_release(mn_tensor *t);
/* Release those of t[0..n) that hold storage and leave the empty ones as
 * they are, for a struct of tensor slots that the caller clears after (the
 * memory state's 3 x MN_MAX_PARAMS: clearing every slot on its own was 10%
 * of a tiny CPU rule:run). */
void mn_tensor_release_held(mn_tensor *t, int n);
/* out becomes another holder of src's storage with the same view. */
void mn_tensor_share(mn_tensor *out, const mn_tensor *src);

int64_t mn_tensor_numel(const mn_tensor *t);
bool mn_tensor_is_contiguous(const mn_tensor *t);
bool mn_tensor_same_shape(const mn_tensor *a, const mn_tensor *b);
/* Pointer to the first element of the view (host or device address). */
void *mn_tensor_data(const mn_tensor *t);
/* "4x8" (scalar: "scalar"); buf of at least 128 bytes. */
const char *mn_shape_string(const mn_tensor *t, char *buf, size_t len);

/* Element access on CPU tensors (index of length ndim, 0-based). */
double mn_tensor_get(const mn_tensor *t, const int64_t *index);
void mn_tensor_set(mn_tensor *t, const int64_t *index, double value);
/* Offset in elements of index from the storage start. */
int64_t mn_tensor_offset_of(const mn_tensor *t, const int64_t *index);

/* ---- views: out shares src's storage (out must be empty) ---- */
/* Negative dims count from the end (-1 is the last); errors name the dim. */
mn_status mn_view_reshape(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape);
mn_status mn_view_permute(mn_tensor *out, const mn_tensor *src, const int *perm);
mn_status mn_view_transpose(mn_tensor *out, const mn_tensor *src, int dim0, int dim1);
/* Elements start, start+step, ... < stop along dim (0-based, stop exclusive,
 * step >= 1, already clamped by the caller). */
mn_status mn_view_slice(mn_tensor *out, const mn_tensor *src, int dim, int64_t start,
                        int64_t stop, int64_t step);
/* Drop dim by fixing its index. */
mn_status mn_view_select(mn_tensor *out, const mn_tensor *src, int dim, int64_t index);
mn_status mn_view_unsqueeze(mn_tensor *out, const mn_tensor *src, int dim);
mn_status mn_view_squeeze(mn_tensor *out, const mn_tensor *src, int dim); /* dim -99: all size-1 */
/* Broadcast view to shape (stride 0 on expanded dims); numpy rules. */
mn_status mn_view_expand(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape);

/* Numpy broadcasting of two shapes; error names both shapes. */
mn_status mn_broadcast_shapes(int andim, const int64_t *ashape, int bndim, const int64_t *bshape,
                              int *out_ndim, int64_t *out_shape);

/* Copies of data. */
mn_status mn_tensor_contiguous(mn_tensor *out, const mn_tensor *src); /* view when already so */
mn_status mn_tensor_clone(mn_tensor *out, const mn_tensor *src);
mn_status mn_tensor_to_dtype(mn_tensor *out, const mn_tensor *src, mn_dtype dt);
mn_status mn_tensor_to_device(mn_tensor *out, const mn_tensor *src, mn_device dev);
/* dst[...] = src broadcast to dst's shape, converting dtype. */
mn_status mn_tensor_copy_into(mn_tensor *dst, const mn_tensor *src);
mn_status mn_tensor_fill(mn_tensor *t, double value);
mn_status mn_tensor_cat(mn_tensor *out, const mn_tensor *const *parts, int n, int dim);
mn_status mn_tensor_stack(mn_tensor *out, const mn_tensor *const *parts, int n, int dim);

/* Resolve a possibly negative dim against ndim (extra: 1 allows ndim itself,
 * as unsqueeze needs); error names the argument. */
mn_status mn_resolve_dim(int dim, int ndim, int extra, int *out);

/* ---- additions by the tensor core ---- */
/* "4x8" of a bare shape ("scalar" for ndim 0), as mn_shape_string. */
const char *mn_shape_string_of(int ndim, const int64_t *shape, char *buf, size_t len);
/* torch.reshape: a view when the strides allow one (mn_view_reshape), else a
 * contiguous copy. One dim may be -1 (inferred), here and in mn_view_reshape. */
mn_status mn_tensor_reshape(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape);

/* Copies between devices belong to the device layer (kernels/): it registers
 * one function per (destination, source) pair. The function gets dst fresh,
 * contiguous, on dst_dev, with src's shape and dtype; src has any strides.
 * mn_tensor_to_device and cross-device mn_tensor_copy_into go through it. */
typedef mn_status (*mn_device_copy_fn)(mn_tensor *dst, const mn_tensor *src);
void mn_register_device_copy(mn_device dst_dev, mn_device src_dev, mn_device_copy_fn fn);

/* double -> i64 as every conversion in the engine does it: truncation toward
 * zero, NaN -> 0, out-of-range values (and infinities) saturate. A plain C
 * cast is undefined behaviour for NaN and out-of-range values. */
static inline int64_t mn_to_i64(double x)
{
    if (x != x) return 0;
    if (x >= 9223372036854775808.0) return INT64_MAX;
    if (x < -9223372036854775808.0) return INT64_MIN;
    return (int64_t)x;
}

#endif
