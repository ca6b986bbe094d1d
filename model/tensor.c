/* tensor.c: tensors and their storage: allocation through per-device
 * allocators, refcounted sharing, views (reshape, permute, slice, expand, ...),
 * numpy broadcasting of shapes, and the data-moving helpers (contiguous,
 * clone, dtype and device changes, copy_into, fill, cat, stack), which hand
 * their element loops to the backend of the tensor's device (ops.h).
 * Refcounts are plain ints: the engine touches tensors from one thread. */
#include "tensor.h"
#include "ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- allocators and storage ---- */

static mn_status cpu_alloc(size_t nbytes, void **out)
{
    /* malloc(0) may return NULL; a real block keeps data + offset valid. */
    void *p = malloc(nbytes ? nbytes : 1);
    if (!p) return mn_fail(MN_ERR_OOM, "out of memory allocating %zu bytes of tensor storage", nbytes);
    *out = p;
    return MN_OK;
}

static void cpu_free(void *ptr, size_t nbytes)
{
    (void)nbytes;
    free(ptr);
}

/* By value, so the caller's struct may be a temporary. A device with no
 * allocator (CUDA until the device layer registers one) cannot allocate. */
static mn_allocator allocators[2] = {{cpu_alloc, cpu_free}, {NULL, NULL}};

static bool device_ok(mn_device dev) { return dev == MN_CPU || dev == MN_CUDA; }

void mn_set_allocator(mn_device dev, const mn_allocator *a)
{
    if (!device_ok(dev)) return;
    if (a) allocators[dev] = *a;
    else if (dev == MN_CPU) allocators[dev] = (mn_allocator){cpu_alloc, cpu_free};
    else allocators[dev] = (mn_allocator){NULL, NULL};
}

static mn_status storage_new(mn_device dev, size_t nbytes, mn_storage **out)
{
    if (!device_ok(dev)) return mn_fail(MN_ERR_ARG, "unknown device %d", (int)dev);
    if (!allocators[dev].alloc) {
        if (dev == MN_CUDA) return mn_fail(MN_ERR_DEVICE, "cuda: no CUDA device in this build");
        return mn_fail(MN_ERR_DEVICE, "%s: no allocator registered", mn_device_name(dev));
    }
    mn_storage *s = mn_malloc(sizeof *s, "a tensor storage header");
    if (!s) return MN_ERR_OOM;
    s->data = NULL;
    mn_status st = allocators[dev].alloc(nbytes, &s->data);
    if (st != MN_OK) {
        free(s);
        return st;
    }
    s->nbytes = nbytes;
    s->refs = 1;
    s->device = dev;
    s->borrowed = false;
    *out = s;
    return MN_OK;
}

static void storage_unref(mn_storage *s)
{
    if (!s || --s->refs > 0) return;
    if (!s->borrowed && allocators[s->device].free) allocators[s->device].free(s->data, s->nbytes);
    free(s);
}

/* ---- small helpers shared by every entry point ---- */

/* out must be empty: writing over a live tensor would leak its reference,
 * and out aliasing an input is always a caller bug. */
static mn_status need_empty(const char *who, const mn_tensor *out)
{
    if (!out) return mn_fail(MN_ERR_ARG, "%s: no output tensor", who);
    if (out->storage) return mn_fail(MN_ERR_ARG, "%s: output tensor is not empty (release it or zero it first)", who);
    return MN_OK;
}

static mn_status need_live(const char *who, const mn_tensor *t)
{
    if (!t || !t->storage) return mn_fail(MN_ERR_ARG, "%s: tensor is empty (released)", who);
    return MN_OK;
}

static void set_contiguous_strides(mn_tensor *t)
{
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        t->stride[d] = s;
        s *= t->shape[d] > 1 ? t->shape[d] : 1;
    }
}

const char *mn_shape_string_of(int ndim, const int64_t *shape, char *buf, size_t len)
{
    if (!buf || len == 0) return "";
    if (ndim <= 0) {
        snprintf(buf, len, "scalar");
        return buf;
    }
    size_t used = 0;
    buf[0] = 0;
    for (int d = 0; d < ndim && used < len; d++) {
        int w = snprintf(buf + used, len - used, d ? "x%lld" : "%lld", (long long)shape[d]);
        if (w < 0) break;
        used += (size_t)w;
    }
    return buf;
}

const char *mn_shape_string(const mn_tensor *t, char *buf, size_t len)
{
    return mn_shape_string_of(t ? t->ndim : 0, t ? t->shape : NULL, buf, len);
}

mn_status mn_resolve_dim(int dim, int ndim, int extra, int *out)
{
    int n = ndim + extra;
    if (n <= 0 || dim < -n || dim >= n) {
        if (n <= 0) return mn_fail(MN_ERR_ARG, "dim %d out of range for a %d-d tensor (it has no dims)", dim, ndim);
        return mn_fail(MN_ERR_ARG, "dim %d out of range for a %d-d tensor (valid: %d..%d)", dim, ndim, -n, n - 1);
    }
    *out = dim < 0 ? dim + n : dim;
    return MN_OK;
}

/* mn_resolve_dim with the caller's name in front of the message. */
static mn_status resolve_dim(const char *who, int dim, int ndim, int extra, int *out)
{
    mn_status st = mn_resolve_dim(dim, ndim, extra, out);
    if (st != MN_OK) return mn_fail_context(st, "%s: ", who);
    return MN_OK;
}

/* Number of elements of a shape, refusing negative sizes and overflow. */
static mn_status shape_numel(const char *who, int ndim, const int64_t *shape, size_t esize,
                             int64_t *numel)
{
    if (ndim < 0 || ndim > MN_MAX_DIMS)
        return mn_fail(MN_ERR_ARG, "%s: %d dims (at most %d)", who, ndim, MN_MAX_DIMS);
    /* span: the product with zero sizes read as 1, so that the strides of an
     * empty tensor such as [2^62, 0] do not overflow either. */
    int64_t n = 1, span = (int64_t)esize;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) return mn_fail(MN_ERR_ARG, "%s: negative size %lld in dim %d", who, (long long)shape[d], d);
        if (__builtin_mul_overflow(n, shape[d], &n) ||
            __builtin_mul_overflow(span, shape[d] ? shape[d] : 1, &span))
            return mn_fail(MN_ERR_ARG, "%s: shape too large", who);
    }
    if ((uint64_t)span > SIZE_MAX) return mn_fail(MN_ERR_ARG, "%s: shape too large", who);
    *numel = n;
    return MN_OK;
}

/* ---- creation and release ---- */

mn_status mn_tensor_empty(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          mn_device dev)
{
    MN_TRY(need_empty("empty", out));
    size_t esize = mn_dtype_size(dt);
    if (!esize) return mn_fail(MN_ERR_ARG, "empty: unknown dtype %d", (int)dt);
    if (ndim > 0 && !shape) return mn_fail(MN_ERR_ARG, "empty: no shape");
    int64_t n = 0;
    MN_TRY(shape_numel("empty", ndim, shape, esize, &n));
    mn_storage *s = NULL;
    MN_TRY(storage_new(dev, (size_t)n * esize, &s));
    memset(out, 0, sizeof *out);
    out->storage = s;
    out->dtype = dt;
    out->ndim = ndim;
    for (int d = 0; d < ndim; d++) out->shape[d] = shape[d];
    set_contiguous_strides(out);
    return MN_OK;
}

mn_status mn_tensor_wrap(mn_tensor *out, void *data, mn_dtype dt, int ndim, const int64_t *shape,
                         const int64_t *stride, mn_device dev)
{
    MN_TRY(need_empty("wrap", out));
    size_t esize = mn_dtype_size(dt);
    if (!esize) return mn_fail(MN_ERR_ARG, "wrap: unknown dtype %d", (int)dt);
    if (!device_ok(dev)) return mn_fail(MN_ERR_ARG, "wrap: unknown device %d", (int)dev);
    if (ndim < 0 || ndim > MN_MAX_DIMS) return mn_fail(MN_ERR_ARG, "wrap: %d dims (at most %d)", ndim, MN_MAX_DIMS);
    int64_t n = 0;
    MN_TRY(shape_numel("wrap", ndim, shape, esize, &n));
    if (!data && n > 0) return mn_fail(MN_ERR_ARG, "wrap: no data for %lld elements", (long long)n);
    /* bytes spanned by the view, so that nbytes means what it does elsewhere */
    int64_t span = n > 0 ? 1 : 0;
    for (int d = 0; d < ndim && stride && n > 0; d++) {
        if (stride[d] < 0) return mn_fail(MN_ERR_ARG, "wrap: negative stride %lld in dim %d", (long long)stride[d], d + 1);
        span += (shape[d] - 1) * stride[d];
    }
    if (!stride) span = n;
    mn_storage *s = mn_malloc(sizeof *s, "a tensor storage header");
    if (!s) return MN_ERR_OOM;
    *s = (mn_storage){.data = data, .nbytes = (size_t)span * esize, .refs = 1, .device = dev, .borrowed = true};
    memset(out, 0, sizeof *out);
    out->storage = s;
    out->dtype = dt;
    out->ndim = ndim;
    for (int d = 0; d < ndim; d++) out->shape[d] = shape[d];
    if (stride)
        for (int d = 0; d < ndim; d++) out->stride[d] = stride[d];
    else set_contiguous_strides(out);
    return MN_OK;
}

mn_status mn_tensor_zeros(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          mn_device dev)
{
    MN_TRY(mn_tensor_empty(out, dt, ndim, shape, dev));
    mn_status st = mn_tensor_fill(out, 0.0);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

void mn_tensor_release(mn_tensor *t)
{
    if (!t) return;
    storage_unref(t->storage);
    memset(t, 0, sizeof *t);
}

void mn_tensor_release_held(mn_tensor *t, int n)
{
    for (int i = 0; i < n; i++)
        if (t[i].storage) mn_tensor_release(&t[i]);
}

void mn_tensor_share(mn_tensor *out, const mn_tensor *src)
{
    if (!out || out == src) return;
    *out = *src;
    if (out->storage) out->storage->refs++;
}

int64_t mn_tensor_numel(const mn_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

bool mn_tensor_is_contiguous(const mn_tensor *t)
{
    int64_t expect = 1;
    if (mn_tensor_numel(t) == 0) return true;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] == 1) continue; /* its stride is never used */
        if (t->stride[d] != expect) return false;
        expect *= t->shape[d];
    }
    return true;
}

bool mn_tensor_same_shape(const mn_tensor *a, const mn_tensor *b)
{
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

void *mn_tensor_data(const mn_tensor *t)
{
    if (!t || !t->storage) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)mn_dtype_size(t->dtype);
}

int64_t mn_tensor_offset_of(const mn_tensor *t, const int64_t *index)
{
    int64_t off = t->offset;
    for (int d = 0; d < t->ndim; d++) off += index[d] * t->stride[d];
    return off;
}

/* Host access only; the caller checks bounds (the Lua binding does, once per
 * call, rather than this per element). NaN / no-op for an unusable tensor. */
double mn_tensor_get(const mn_tensor *t, const int64_t *index)
{
    if (!t || !t->storage || t->storage->device != MN_CPU) return NAN;
    int64_t off = mn_tensor_offset_of(t, index);
    switch (t->dtype) {
    case MN_F32: return ((const float *)t->storage->data)[off];
    case MN_F64: return ((const double *)t->storage->data)[off];
    case MN_I64: return (double)((const int64_t *)t->storage->data)[off];
    }
    return NAN;
}

void mn_tensor_set(mn_tensor *t, const int64_t *index, double value)
{
    if (!t || !t->storage || t->storage->device != MN_CPU) return;
    int64_t off = mn_tensor_offset_of(t, index);
    switch (t->dtype) {
    case MN_F32: ((float *)t->storage->data)[off] = (float)value; break;
    case MN_F64: ((double *)t->storage->data)[off] = value; break;
    case MN_I64: ((int64_t *)t->storage->data)[off] = mn_to_i64(value); break;
    }
}

/* ---- views ---- */

/* Fill in a -1 in a requested shape; errors in the words of reshape. */
static mn_status infer_shape(const mn_tensor *src, int ndim, const int64_t *shape, int64_t *resolved)
{
    char a[160], b[160];
    int64_t known = 1, numel = mn_tensor_numel(src);
    int infer = -1;
    if (ndim < 0 || ndim > MN_MAX_DIMS)
        return mn_fail(MN_ERR_ARG, "reshape: %d dims (at most %d)", ndim, MN_MAX_DIMS);
    for (int d = 0; d < ndim; d++) {
        resolved[d] = shape[d];
        if (shape[d] == -1 && infer < 0) {
            infer = d;
        } else if (shape[d] < 0) {
            return mn_fail(MN_ERR_ARG, "reshape: bad size %lld in dim %d of %s", (long long)shape[d], d,
                           mn_shape_string_of(ndim, shape, b, sizeof b));
        } else if (__builtin_mul_overflow(known, shape[d], &known)) {
            return mn_fail(MN_ERR_ARG, "reshape: shape %s too large", mn_shape_string_of(ndim, shape, b, sizeof b));
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known != 0)
            return mn_fail(MN_ERR_ARG, "reshape: cannot view %s (%lld elements) as %s",
                           mn_shape_string(src, a, sizeof a), (long long)numel,
                           mn_shape_string_of(ndim, shape, b, sizeof b));
        resolved[infer] = numel / known;
        known = numel;
    }
    if (known != numel)
        return mn_fail(MN_ERR_ARG, "reshape: cannot view %s (%lld elements) as %s (%lld elements)",
                       mn_shape_string(src, a, sizeof a), (long long)numel,
                       mn_shape_string_of(ndim, shape, b, sizeof b), (long long)known);
    return MN_OK;
}

/* Strides that view src's elements, in order, with shape; false when the
 * strides of src do not allow it. torch's computeStride: walk src's dims from
 * the last, in chunks of dims that are contiguous with each other, and match
 * each chunk against a run of new dims with the same element count. */
static bool view_strides(const mn_tensor *src, int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t numel = mn_tensor_numel(src);
    if (numel == 0 || src->ndim == 0) {
        mn_tensor tmp = {.ndim = ndim};
        for (int d = 0; d < ndim; d++) tmp.shape[d] = shape[d];
        set_contiguous_strides(&tmp);
        memcpy(stride, tmp.stride, sizeof(int64_t) * (size_t)ndim);
        return true;
    }
    int view_d = ndim - 1;
    int64_t chunk_base = src->stride[src->ndim - 1], tensor_numel = 1, view_numel = 1;
    for (int td = src->ndim - 1; td >= 0; td--) {
        tensor_numel *= src->shape[td];
        if (td == 0 || (src->shape[td - 1] != 1 && src->stride[td - 1] != tensor_numel * chunk_base)) {
            while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
                stride[view_d] = view_numel * chunk_base;
                view_numel *= shape[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel) return false;
            if (td > 0) {
                chunk_base = src->stride[td - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    return view_d == -1;
}

mn_status mn_view_reshape(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape)
{
    MN_TRY(need_empty("reshape", out));
    MN_TRY(need_live("reshape", src));
    int64_t want[MN_MAX_DIMS], stride[MN_MAX_DIMS];
    MN_TRY(infer_shape(src, ndim, shape, want));
    if (!view_strides(src, ndim, want, stride)) {
        char a[160], b[160];
        return mn_fail(MN_ERR_ARG, "reshape: cannot view a non-contiguous %s tensor as %s (make it contiguous first)",
                       mn_shape_string(src, a, sizeof a), mn_shape_string_of(ndim, want, b, sizeof b));
    }
    mn_tensor_share(out, src);
    out->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        out->shape[d] = want[d];
        out->stride[d] = stride[d];
    }
    return MN_OK;
}

mn_status mn_tensor_reshape(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape)
{
    MN_TRY(need_empty("reshape", out));
    MN_TRY(need_live("reshape", src));
    int64_t want[MN_MAX_DIMS], stride[MN_MAX_DIMS];
    MN_TRY(infer_shape(src, ndim, shape, want));
    if (view_strides(src, ndim, want, stride)) return mn_view_reshape(out, src, ndim, want);
    mn_tensor dense = {0};
    MN_TRY(mn_tensor_clone(&dense, src));
    mn_status st = mn_view_reshape(out, &dense, ndim, want);
    mn_tensor_release(&dense);
    return st;
}

mn_status mn_view_permute(mn_tensor *out, const mn_tensor *src, const int *perm)
{
    MN_TRY(need_empty("permute", out));
    MN_TRY(need_live("permute", src));
    int dims[MN_MAX_DIMS];
    bool seen[MN_MAX_DIMS] = {0};
    for (int i = 0; i < src->ndim; i++) {
        MN_TRY(resolve_dim("permute", perm[i], src->ndim, 0, &dims[i]));
        if (seen[dims[i]]) return mn_fail(MN_ERR_ARG, "permute: dim %d appears twice", perm[i]);
        seen[dims[i]] = true;
    }
    mn_tensor_share(out, src);
    for (int i = 0; i < src->ndim; i++) {
        out->shape[i] = src->shape[dims[i]];
        out->stride[i] = src->stride[dims[i]];
    }
    return MN_OK;
}

mn_status mn_view_transpose(mn_tensor *out, const mn_tensor *src, int dim0, int dim1)
{
    MN_TRY(need_empty("transpose", out));
    MN_TRY(need_live("transpose", src));
    int d0, d1;
    MN_TRY(resolve_dim("transpose", dim0, src->ndim, 0, &d0));
    MN_TRY(resolve_dim("transpose", dim1, src->ndim, 0, &d1));
    mn_tensor_share(out, src);
    out->shape[d0] = src->shape[d1];
    out->stride[d0] = src->stride[d1];
    out->shape[d1] = src->shape[d0];
    out->stride[d1] = src->stride[d0];
    return MN_OK;
}

mn_status mn_view_slice(mn_tensor *out, const mn_tensor *src, int dim, int64_t start,
                        int64_t stop, int64_t step)
{
    MN_TRY(need_empty("slice", out));
    MN_TRY(need_live("slice", src));
    int d;
    MN_TRY(resolve_dim("slice", dim, src->ndim, 0, &d));
    int64_t size = src->shape[d];
    if (step < 1) return mn_fail(MN_ERR_ARG, "slice: step %lld must be >= 1", (long long)step);
    if (start < 0 || start > size || stop < 0 || stop > size)
        return mn_fail(MN_ERR_ARG, "slice: range [%lld, %lld) out of bounds for dim %d of size %lld",
                       (long long)start, (long long)stop, d, (long long)size);
    int64_t len = stop > start ? (stop - start + step - 1) / step : 0;
    mn_tensor_share(out, src);
    if (len > 0) out->offset += start * src->stride[d];
    out->shape[d] = len;
    out->stride[d] = src->stride[d] * step;
    return MN_OK;
}

mn_status mn_view_select(mn_tensor *out, const mn_tensor *src, int dim, int64_t index)
{
    MN_TRY(need_empty("select", out));
    MN_TRY(need_live("select", src));
    int d;
    MN_TRY(resolve_dim("select", dim, src->ndim, 0, &d));
    if (index < 0 || index >= src->shape[d])
        return mn_fail(MN_ERR_ARG, "select: index %lld out of range for dim %d of size %lld",
                       (long long)index, d, (long long)src->shape[d]);
    mn_tensor_share(out, src);
    out->offset += index * src->stride[d];
    for (int i = d; i < src->ndim - 1; i++) {
        out->shape[i] = src->shape[i + 1];
        out->stride[i] = src->stride[i + 1];
    }
    out->ndim--;
    return MN_OK;
}

mn_status mn_view_unsqueeze(mn_tensor *out, const mn_tensor *src, int dim)
{
    MN_TRY(need_empty("unsqueeze", out));
    MN_TRY(need_live("unsqueeze", src));
    if (src->ndim >= MN_MAX_DIMS)
        return mn_fail(MN_ERR_ARG, "unsqueeze: a %d-d tensor cannot grow a dim (at most %d)", src->ndim, MN_MAX_DIMS);
    int d;
    MN_TRY(resolve_dim("unsqueeze", dim, src->ndim, 1, &d));
    mn_tensor_share(out, src);
    for (int i = src->ndim; i > d; i--) {
        out->shape[i] = src->shape[i - 1];
        out->stride[i] = src->stride[i - 1];
    }
    out->shape[d] = 1;
    /* The stride a contiguous tensor would have, so contiguity survives. */
    out->stride[d] = d < src->ndim ? src->shape[d] * src->stride[d] : 1;
    out->ndim++;
    return MN_OK;
}

/* As torch: squeezing a dim whose size is not 1 leaves the tensor as it is. */
mn_status mn_view_squeeze(mn_tensor *out, const mn_tensor *src, int dim)
{
    MN_TRY(need_empty("squeeze", out));
    MN_TRY(need_live("squeeze", src));
    int only = -1;
    if (dim != -99) MN_TRY(resolve_dim("squeeze", dim, src->ndim, 0, &only));
    mn_tensor_share(out, src);
    int nd = 0;
    for (int i = 0; i < src->ndim; i++) {
        bool drop = src->shape[i] == 1 && (only < 0 || i == only);
        if (drop) continue;
        out->shape[nd] = src->shape[i];
        out->stride[nd] = src->stride[i];
        nd++;
    }
    out->ndim = nd;
    return MN_OK;
}

mn_status mn_view_expand(mn_tensor *out, const mn_tensor *src, int ndim, const int64_t *shape)
{
    MN_TRY(need_empty("expand", out));
    MN_TRY(need_live("expand", src));
    char a[160], b[160];
    if (ndim < src->ndim || ndim > MN_MAX_DIMS)
        return mn_fail(MN_ERR_ARG, "expand: cannot expand %s to %s", mn_shape_string(src, a, sizeof a),
                       mn_shape_string_of(ndim, shape, b, sizeof b));
    int64_t nshape[MN_MAX_DIMS], nstride[MN_MAX_DIMS];
    int lead = ndim - src->ndim;
    for (int i = 0; i < ndim; i++) {
        int j = i - lead;
        int64_t want = shape[i];
        if (j < 0) {
            if (want < 0) goto bad;
            nshape[i] = want;
            nstride[i] = 0;
        } else if (want == -1 || want == src->shape[j]) {
            nshape[i] = src->shape[j];
            nstride[i] = src->stride[j];
        } else if (src->shape[j] == 1 && want >= 0) {
            nshape[i] = want;
            nstride[i] = 0;
        } else {
            goto bad;
        }
    }
    mn_tensor_share(out, src);
    out->ndim = ndim;
    memcpy(out->shape, nshape, sizeof(int64_t) * (size_t)ndim);
    memcpy(out->stride, nstride, sizeof(int64_t) * (size_t)ndim);
    return MN_OK;
bad:
    return mn_fail(MN_ERR_ARG, "expand: cannot expand %s to %s", mn_shape_string(src, a, sizeof a),
                   mn_shape_string_of(ndim, shape, b, sizeof b));
}

mn_status mn_broadcast_shapes(int andim, const int64_t *ashape, int bndim, const int64_t *bshape,
                              int *out_ndim, int64_t *out_shape)
{
    int n = andim > bndim ? andim : bndim;
    int64_t res[MN_MAX_DIMS];
    if (n > MN_MAX_DIMS) return mn_fail(MN_ERR_ARG, "too many dims (%d)", n);
    for (int i = 0; i < n; i++) {
        int ia = andim - n + i, ib = bndim - n + i;
        int64_t da = ia >= 0 ? ashape[ia] : 1, db = ib >= 0 ? bshape[ib] : 1;
        if (da == db || db == 1) res[i] = da;
        else if (da == 1) res[i] = db;
        else {
            char a[160], b[160];
            return mn_fail(MN_ERR_ARG, "shapes %s and %s do not broadcast",
                           mn_shape_string_of(andim, ashape, a, sizeof a),
                           mn_shape_string_of(bndim, bshape, b, sizeof b));
        }
    }
    *out_ndim = n;
    memcpy(out_shape, res, sizeof(int64_t) * (size_t)n);
    return MN_OK;
}

/* ---- copies of data ---- */

static mn_status new_like(mn_tensor *out, const mn_tensor *src, mn_dtype dt, mn_device dev)
{
    return mn_tensor_empty(out, dt, src->ndim, src->shape, dev);
}

/* Same-device copy through the backend, with out freshly allocated. */
static mn_status copy_new(const char *who, mn_tensor *out, const mn_tensor *src, mn_dtype dt)
{
    MN_TRY(need_empty(who, out));
    MN_TRY(need_live(who, src));
    const mn_backend *be = mn_backend_for(src->storage->device);
    if (!be) return MN_ERR_DEVICE;
    MN_TRY(new_like(out, src, dt, src->storage->device));
    mn_status st = be->copy(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

mn_status mn_tensor_contiguous(mn_tensor *out, const mn_tensor *src)
{
    MN_TRY(need_empty("contiguous", out));
    MN_TRY(need_live("contiguous", src));
    if (mn_tensor_is_contiguous(src)) {
        mn_tensor_share(out, src);
        return MN_OK;
    }
    return copy_new("contiguous", out, src, src->dtype);
}

mn_status mn_tensor_clone(mn_tensor *out, const mn_tensor *src)
{
    return copy_new("clone", out, src, src ? src->dtype : MN_F32);
}

/* As torch's .to(dtype): the same dtype gives a share, not a copy. */
mn_status mn_tensor_to_dtype(mn_tensor *out, const mn_tensor *src, mn_dtype dt)
{
    MN_TRY(need_empty("to_dtype", out));
    MN_TRY(need_live("to_dtype", src));
    if (!mn_dtype_size(dt)) return mn_fail(MN_ERR_ARG, "to_dtype: unknown dtype %d", (int)dt);
    if (src->dtype == dt) {
        mn_tensor_share(out, src);
        return MN_OK;
    }
    return copy_new("to_dtype", out, src, dt);
}

static mn_device_copy_fn device_copies[2][2];

void mn_register_device_copy(mn_device dst_dev, mn_device src_dev, mn_device_copy_fn fn)
{
    if (device_ok(dst_dev) && device_ok(src_dev)) device_copies[dst_dev][src_dev] = fn;
}

mn_status mn_tensor_to_device(mn_tensor *out, const mn_tensor *src, mn_device dev)
{
    MN_TRY(need_empty("to_device", out));
    MN_TRY(need_live("to_device", src));
    if (!device_ok(dev)) return mn_fail(MN_ERR_ARG, "to_device: unknown device %d", (int)dev);
    mn_device from = src->storage->device;
    if (from == dev) {
        mn_tensor_share(out, src);
        return MN_OK;
    }
    if (!mn_backend_for(dev) || !mn_backend_for(from)) return MN_ERR_DEVICE;
    mn_device_copy_fn fn = device_copies[dev][from];
    if (!fn)
        return mn_fail(MN_ERR_UNSUPPORTED, "to_device: no copy from %s to %s in this build",
                       mn_device_name(from), mn_device_name(dev));
    MN_TRY(new_like(out, src, src->dtype, dev));
    mn_status st = fn(out, src);
    if (st != MN_OK) mn_tensor_release(out);
    return st;
}

/* The bytes [lo, hi) of t's storage that its elements span. */
static void byte_span(const mn_tensor *t, int64_t *lo, int64_t *hi)
{
    int64_t first = t->offset, last = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) {
            *lo = *hi = 0;
            return;
        }
        const int64_t reach = (t->shape[i] - 1) * t->stride[i];
        if (reach < 0) first += reach;
        else last += reach;
    }
    const int64_t es = (int64_t)mn_dtype_size(t->dtype);
    *lo = first * es;
    *hi = (last + 1) * es;
}

/* Whether a write through a could change what b reads: the same storage
 * and spans that meet (disjoint parts of one block, as the memory state's
 * W and anchor are, copy directly). */
static bool may_overlap(const mn_tensor *a, const mn_tensor *b)
{
    if (a->storage != b->storage) return false;
    int64_t alo, ahi, blo, bhi;
    byte_span(a, &alo, &ahi);
    byte_span(b, &blo, &bhi);
    return alo < bhi && blo < ahi;
}

mn_status mn_tensor_copy_into(mn_tensor *dst, const mn_tensor *src)
{
    MN_TRY(need_live("copy", dst));
    MN_TRY(need_live("copy", src));
    mn_device dev = dst->storage->device;
    const mn_backend *be = mn_backend_for(dev);
    if (!be) return MN_ERR_DEVICE;
    /* One f32 value from the host into an f32 tensor on another device (a
     * gate given as a number, broadcast over [B,H,T]): a fill there, not an
     * upload of four bytes and a broadcast copy (two allocations, a
     * transfer from pageable memory and a kernel). The same float either way. */
    if (src->storage->device == MN_CPU && dev != MN_CPU && src->dtype == MN_F32 && dst->dtype == MN_F32 &&
        mn_tensor_numel(src) == 1)
        return be->fill(dst, (double)*(const float *)mn_tensor_data(src));
    mn_tensor moved = {0}, safe = {0}, wide = {0};
    mn_status st = MN_OK;
    const mn_tensor *s = src;
    if (src->storage->device != dev) {
        if ((st = mn_tensor_to_device(&moved, src, dev)) != MN_OK) goto done;
        s = &moved;
    } else if (may_overlap(dst, src)) {
        /* Overlapping views would read elements already overwritten. */
        if ((st = mn_tensor_clone(&safe, src)) != MN_OK) goto done;
        s = &safe;
    }
    if ((st = mn_view_expand(&wide, s, dst->ndim, dst->shape)) != MN_OK) {
        char a[160], b[160];
        st = mn_fail(MN_ERR_ARG, "copy: cannot broadcast %s into %s", mn_shape_string(src, a, sizeof a),
                     mn_shape_string(dst, b, sizeof b));
        goto done;
    }
    st = be->copy(dst, &wide);
done:
    mn_tensor_release(&wide);
    mn_tensor_release(&safe);
    mn_tensor_release(&moved);
    return st;
}

mn_status mn_tensor_fill(mn_tensor *t, double value)
{
    MN_TRY(need_live("fill", t));
    const mn_backend *be = mn_backend_for(t->storage->device);
    if (!be) return MN_ERR_DEVICE;
    return be->fill(t, value);
}

/* cat and stack promote dtypes as a binary op would (torch.cat does too). */
mn_status mn_tensor_cat(mn_tensor *out, const mn_tensor *const *parts, int n, int dim)
{
    MN_TRY(need_empty("cat", out));
    if (n < 1 || !parts) return mn_fail(MN_ERR_ARG, "cat: no tensors to join");
    for (int i = 0; i < n; i++)
        if (!parts[i] || !parts[i]->storage) return mn_fail(MN_ERR_ARG, "cat: part %d is empty (released)", i);
    const mn_tensor *ref = parts[0];
    if (ref->ndim == 0) return mn_fail(MN_ERR_ARG, "cat: part 0 is a scalar (cat needs at least 1 dim)");
    int d;
    MN_TRY(resolve_dim("cat", dim, ref->ndim, 0, &d));
    mn_dtype dt = ref->dtype;
    int64_t total = 0;
    char a[160], b[160];
    for (int i = 0; i < n; i++) {
        const mn_tensor *p = parts[i];
        if (p->ndim != ref->ndim)
            return mn_fail(MN_ERR_ARG, "cat: part %d (%s) has %d dims, part 0 (%s) has %d", i,
                           mn_shape_string(p, a, sizeof a), p->ndim, mn_shape_string(ref, b, sizeof b), ref->ndim);
        for (int k = 0; k < ref->ndim; k++)
            if (k != d && p->shape[k] != ref->shape[k])
                return mn_fail(MN_ERR_ARG, "cat: part %d (%s) differs from part 0 (%s) at dim %d", i,
                               mn_shape_string(p, a, sizeof a), mn_shape_string(ref, b, sizeof b), k);
        if (p->storage->device != ref->storage->device)
            return mn_fail(MN_ERR_ARG, "cat: part %d is on %s, part 0 on %s", i,
                           mn_device_name(p->storage->device), mn_device_name(ref->storage->device));
        dt = mn_promote(MN_OP_add, dt, p->dtype);
        total += p->shape[d];
    }
    int64_t shape[MN_MAX_DIMS];
    memcpy(shape, ref->shape, sizeof shape);
    shape[d] = total;
    mn_tensor res = {0};
    MN_TRY(mn_tensor_empty(&res, dt, ref->ndim, shape, ref->storage->device));
    int64_t at = 0;
    mn_status st = MN_OK;
    for (int i = 0; i < n && st == MN_OK; i++) {
        mn_tensor part = {0};
        int64_t len = parts[i]->shape[d];
        st = mn_view_slice(&part, &res, d, at, at + len, 1);
        if (st == MN_OK) st = mn_tensor_copy_into(&part, parts[i]);
        if (st != MN_OK) mn_fail_context(st, "cat: part %d: ", i);
        mn_tensor_release(&part);
        at += len;
    }
    if (st != MN_OK) {
        mn_tensor_release(&res);
        return st;
    }
    *out = res;
    return MN_OK;
}

mn_status mn_tensor_stack(mn_tensor *out, const mn_tensor *const *parts, int n, int dim)
{
    MN_TRY(need_empty("stack", out));
    if (n < 1 || !parts) return mn_fail(MN_ERR_ARG, "stack: no tensors to join");
    for (int i = 0; i < n; i++)
        if (!parts[i] || !parts[i]->storage) return mn_fail(MN_ERR_ARG, "stack: part %d is empty (released)", i);
    const mn_tensor *ref = parts[0];
    char a[160], b[160];
    for (int i = 1; i < n; i++)
        if (!mn_tensor_same_shape(parts[i], ref))
            return mn_fail(MN_ERR_ARG, "stack: part %d has shape %s, part 0 has %s", i,
                           mn_shape_string(parts[i], a, sizeof a), mn_shape_string(ref, b, sizeof b));
    int d;
    MN_TRY(resolve_dim("stack", dim, ref->ndim, 1, &d));
    mn_tensor *views = mn_calloc((size_t)n, sizeof *views, "stack views");
    const mn_tensor **ptrs = mn_calloc((size_t)n, sizeof *ptrs, "stack views");
    mn_status st = views && ptrs ? MN_OK : MN_ERR_OOM;
    for (int i = 0; i < n && st == MN_OK; i++) {
        st = mn_view_unsqueeze(&views[i], parts[i], d);
        ptrs[i] = &views[i];
    }
    if (st == MN_OK) {
        st = mn_tensor_cat(out, ptrs, n, d);
        if (st != MN_OK) {
            /* cat's words are about the unsqueezed parts; say stack. */
            char msg[2048];
            snprintf(msg, sizeof msg, "%s", mn_last_error());
            const char *rest = strncmp(msg, "cat: ", 5) == 0 ? msg + 5 : msg;
            mn_fail(st, "stack: %s", rest);
        }
    }
    for (int i = 0; views && i < n; i++) mn_tensor_release(&views[i]);
    free(views);
    free(ptrs);
    return st;
}
