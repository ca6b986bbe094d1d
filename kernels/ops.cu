/* ops.cu: the CUDA backend's kernels and their extern "C" launchers
 * (cuda_ops.h): elementwise unary and binary ops from ops.def, where, copy
 * with dtype conversion, fill, whole-tensor and per-dim reductions,
 * argmax/argmin and the i64 matrix product.
 * Every op computes the scalar definition of op_math.h (MN_HD), in double as
 * the CPU backend does, and stores the result in the tensor's dtype, so the
 * two backends agree to the last rounding; i64 keeps the CPU's exact integer
 * paths (wrapping add, sub, mul; comparisons; sums and products along a dim).
 * Operands have any strides (broadcast views have stride 0): each kernel
 * walks a geometry whose dims were fused where every operand allows, so a
 * contiguous tensor is one dim and needs no division per element. */
#include "../model/op_math.h"
#include "../model/random_counter.h"
#include "cuda_check.h"
#include "cuda_ops.h"
#include "rownorm_warp.cuh"

#include <stdint.h>
#include <string.h>
#include <type_traits>

/* every launch and copy goes to the layer's current stream (cuda.h) */
#define MN_STREAM ((cudaStream_t)mn_cuda_get_stream())

/* ---- geometry ---- */

enum { MAX_OPS = 4, THREADS = 256 };

struct Geom {
    int ndim; /* >= 1 after fusing */
    int64_t numel;
    int64_t shape[MN_MAX_DIMS];
    int64_t stride[MAX_OPS][MN_MAX_DIMS]; /* in elements */
};

/* Tensors of one shape (that of t[0]): drop size-1 dims, fuse a dim into the
 * previous one when every operand steps over both as one run. */
static void geom_init(Geom *g, int nops, const mn_tensor *const *t)
{
    memset(g, 0, sizeof *g);
    int nd = 0;
    g->numel = 1;
    for (int d = 0; d < t[0]->ndim; d++) {
        int64_t s = t[0]->shape[d];
        g->numel *= s;
        if (s == 1) continue;
        bool fuse = nd > 0;
        for (int k = 0; k < nops && fuse; k++) fuse = g->stride[k][nd - 1] == t[k]->stride[d] * s;
        if (fuse) {
            g->shape[nd - 1] *= s;
            for (int k = 0; k < nops; k++) g->stride[k][nd - 1] = t[k]->stride[d];
        } else {
            g->shape[nd] = s;
            for (int k = 0; k < nops; k++) g->stride[k][nd] = t[k]->stride[d];
            nd++;
        }
    }
    if (nd == 0) {
        g->shape[0] = 1;
        nd = 1;
    }
    g->ndim = nd;
}

/* Element offsets of linear index i for the first N operands. The loop is
 * unrolled over every possible dim so that the geometry's arrays are indexed
 * by constants (no local-memory copy of the kernel parameter). */
template <int N>
__device__ __forceinline__ void offsets(const Geom &g, int64_t i, int64_t (&off)[N])
{
    if (g.ndim == 1) {
#pragma unroll
        for (int k = 0; k < N; k++) off[k] = i * g.stride[k][0];
        return;
    }
#pragma unroll
    for (int k = 0; k < N; k++) off[k] = 0;
#pragma unroll
    for (int d = MN_MAX_DIMS - 1; d >= 0; d--) {
        if (d >= g.ndim) continue;
        int64_t s = g.shape[d], c = i % s;
        i /= s;
#pragma unroll
        for (int k = 0; k < N; k++) off[k] += c * g.stride[k][d];
    }
}

#define GRID_STRIDE_LOOP(i, n)                                                 \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);  \
         i += (int64_t)gridDim.x * blockDim.x)

static unsigned blocks_for(int64_t n)
{
    int64_t b = (n + THREADS - 1) / THREADS, cap = (int64_t)mn_cuda_sm_count() * 16;
    return (unsigned)(b < cap ? (b > 0 ? b : 1) : cap);
}

static mn_status check_cuda(const char *who, int n, const mn_tensor *const *t, bool same_shape)
{
    for (int k = 0; k < n; k++) {
        if (!t[k]->storage || t[k]->storage->device != MN_CUDA)
            return mn_fail(MN_ERR_ARG, "cuda %s: operand %d is not a cuda tensor", who, k);
        if (same_shape && k > 0 && !mn_tensor_same_shape(t[0], t[k]))
            return mn_fail(MN_ERR_ARG, "cuda %s: operand shapes differ", who);
    }
    return MN_OK;
}

static mn_status check_dtypes(const char *who, int n, const mn_tensor *const *t)
{
    for (int k = 1; k < n; k++)
        if (t[k]->dtype != t[0]->dtype)
            return mn_fail(MN_ERR_ARG, "cuda %s: operand dtypes differ (%s, %s)", who, mn_dtype_name(t[0]->dtype),
                           mn_dtype_name(t[k]->dtype));
    return MN_OK;
}

/* ---- scalar conversions, as the CPU's (mn_to_i64 for double -> i64) ---- */

__device__ __forceinline__ int64_t dev_to_i64(double x)
{
    if (x != x) return 0;
    if (x >= 9223372036854775808.0) return INT64_MAX;
    if (x < -9223372036854775808.0) return INT64_MIN;
    return (int64_t)x;
}

template <typename TD> __device__ __forceinline__ TD from_double(double v) { return (TD)v; }
template <> __device__ __forceinline__ int64_t from_double<int64_t>(double v) { return dev_to_i64(v); }

template <typename TD, typename TS> struct Conv {
    __device__ __forceinline__ TD operator()(TS x) const { return (TD)x; }
};
template <> struct Conv<int64_t, float> {
    __device__ __forceinline__ int64_t operator()(float x) const { return dev_to_i64((double)x); }
};
template <> struct Conv<int64_t, double> {
    __device__ __forceinline__ int64_t operator()(double x) const { return dev_to_i64(x); }
};

/* ---- elementwise ops: op_math.h, selected at compile time ---- */

template <int OP> __device__ __forceinline__ double unary_math(double x)
{
    switch (OP) {
#define MN_UNARY(name, doc) case MN_OP_##name: return mn_op_##name(x);
#include "../model/ops.def"
    default: return x;
    }
}

template <int OP> __device__ __forceinline__ double binary_math(double a, double b)
{
    switch (OP) {
#define MN_BINARY(name, meta, doc) case MN_OP_##name: return mn_op_##name(a, b);
#include "../model/ops.def"
    default: return a;
    }
}

/* Integer ops on integers stay exact (a trip through double is not past
 * 2^53); unsigned arithmetic wraps instead of overflowing. */
template <int OP> __device__ __forceinline__ bool unary_i64_exact(int64_t x, int64_t *r)
{
    switch (OP) {
    case MN_OP_neg: *r = (int64_t)(0ull - (uint64_t)x); return true;
    case MN_OP_abs: *r = x < 0 ? (int64_t)(0ull - (uint64_t)x) : x; return true;
    case MN_OP_relu: *r = x > 0 ? x : 0; return true;
    case MN_OP_sign: *r = (x > 0) - (x < 0); return true;
    case MN_OP_floor: case MN_OP_round: *r = x; return true;
    case MN_OP_isnan: *r = 0; return true;
    case MN_OP_isfinite: *r = 1; return true;
    default: return false;
    }
}

template <int OP> __device__ __forceinline__ bool binary_i64_exact(int64_t x, int64_t y, int64_t *r)
{
    switch (OP) {
    case MN_OP_add: *r = (int64_t)((uint64_t)x + (uint64_t)y); return true;
    case MN_OP_sub: *r = (int64_t)((uint64_t)x - (uint64_t)y); return true;
    case MN_OP_mul: *r = (int64_t)((uint64_t)x * (uint64_t)y); return true;
    case MN_OP_maximum: *r = x > y ? x : y; return true;
    case MN_OP_minimum: *r = x < y ? x : y; return true;
    case MN_OP_lt: *r = x < y; return true;
    case MN_OP_le: *r = x <= y; return true;
    case MN_OP_gt: *r = x > y; return true;
    case MN_OP_ge: *r = x >= y; return true;
    case MN_OP_eq: *r = x == y; return true;
    case MN_OP_ne: *r = x != y; return true;
    default: return false;
    }
}

template <int OP> struct UnaryOp {
    __device__ __forceinline__ float operator()(float x) const { return (float)unary_math<OP>((double)x); }
    __device__ __forceinline__ double operator()(double x) const { return unary_math<OP>(x); }
    __device__ __forceinline__ int64_t operator()(int64_t x) const
    {
        int64_t r;
        if (unary_i64_exact<OP>(x, &r)) return r;
        return dev_to_i64(unary_math<OP>((double)x));
    }
};

template <int OP> struct BinaryOp {
    __device__ __forceinline__ float operator()(float a, float b) const
    {
        return (float)binary_math<OP>((double)a, (double)b);
    }
    __device__ __forceinline__ double operator()(double a, double b) const { return binary_math<OP>(a, b); }
    __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const
    {
        int64_t r;
        if (binary_i64_exact<OP>(a, b, &r)) return r;
        return dev_to_i64(binary_math<OP>((double)a, (double)b));
    }
};

template <typename TO, typename TA, typename F>
__global__ void k_map1(const __grid_constant__ Geom g, TO *o, const TA *a, F f)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[2];
        offsets<2>(g, i, off);
        o[off[0]] = f(a[off[1]]);
    }
}

template <typename T, typename F>
__global__ void k_map2(const __grid_constant__ Geom g, T *o, const T *a, const T *b, F f)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[3];
        offsets<3>(g, i, off);
        o[off[0]] = f(a[off[1]], b[off[2]]);
    }
}

template <typename F>
static mn_status launch_map1(const Geom &g, mn_dtype dt, void *o, const void *a)
{
    unsigned nb = blocks_for(g.numel);
    switch (dt) {
    case MN_F32: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, (float *)o, (const float *)a, F()); break;
    case MN_F64: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, (double *)o, (const double *)a, F()); break;
    case MN_I64: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, (int64_t *)o, (const int64_t *)a, F()); break;
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

template <typename F>
static mn_status launch_map2(const Geom &g, mn_dtype dt, void *o, const void *a, const void *b)
{
    unsigned nb = blocks_for(g.numel);
    switch (dt) {
    case MN_F32: k_map2<<<nb, THREADS, 0, MN_STREAM>>>(g, (float *)o, (const float *)a, (const float *)b, F()); break;
    case MN_F64: k_map2<<<nb, THREADS, 0, MN_STREAM>>>(g, (double *)o, (const double *)a, (const double *)b, F()); break;
    case MN_I64: k_map2<<<nb, THREADS, 0, MN_STREAM>>>(g, (int64_t *)o, (const int64_t *)a, (const int64_t *)b, F()); break;
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

extern "C" mn_status mn_cuda_unary(mn_op op, mn_tensor *out, const mn_tensor *a)
{
    const mn_tensor *t[2] = {out, a};
    MN_TRY(check_cuda("unary", 2, t, true));
    MN_TRY(check_dtypes("unary", 2, t));
    Geom g;
    geom_init(&g, 2, t);
    if (g.numel == 0) return MN_OK;
    void *o = mn_tensor_data(out);
    const void *x = mn_tensor_data(a);
    switch (op) {
#define MN_UNARY(name, doc) case MN_OP_##name: return launch_map1<UnaryOp<MN_OP_##name>>(g, out->dtype, o, x);
#include "../model/ops.def"
    default: return mn_fail(MN_ERR_ARG, "cuda unary: '%s' is not a unary op", mn_op_name(op));
    }
}

extern "C" mn_status mn_cuda_binary(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[3] = {out, a, b};
    MN_TRY(check_cuda("binary", 3, t, true));
    MN_TRY(check_dtypes("binary", 3, t));
    Geom g;
    geom_init(&g, 3, t);
    if (g.numel == 0) return MN_OK;
    void *o = mn_tensor_data(out);
    const void *x = mn_tensor_data(a), *y = mn_tensor_data(b);
    switch (op) {
#define MN_BINARY(name, meta, doc) case MN_OP_##name: return launch_map2<BinaryOp<MN_OP_##name>>(g, out->dtype, o, x, y);
#include "../model/ops.def"
    default: return mn_fail(MN_ERR_ARG, "cuda binary: '%s' is not a binary op", mn_op_name(op));
    }
}

/* ---- where: the selected value moves as bits, so only its size matters ---- */

template <typename TV, typename TC>
__global__ void k_where(const __grid_constant__ Geom g, TV *o, const TC *c, const TV *a, const TV *b)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[4];
        offsets<4>(g, i, off);
        o[off[0]] = c[off[1]] != 0 ? a[off[2]] : b[off[3]];
    }
}

template <typename TV>
static void launch_where(const Geom &g, mn_dtype cdt, void *o, const void *c, const void *a, const void *b)
{
    unsigned nb = blocks_for(g.numel);
    const TV *pa = (const TV *)a, *pb = (const TV *)b;
    switch (cdt) {
    case MN_F32: k_where<<<nb, THREADS, 0, MN_STREAM>>>(g, (TV *)o, (const float *)c, pa, pb); break;
    case MN_F64: k_where<<<nb, THREADS, 0, MN_STREAM>>>(g, (TV *)o, (const double *)c, pa, pb); break;
    case MN_I64: k_where<<<nb, THREADS, 0, MN_STREAM>>>(g, (TV *)o, (const int64_t *)c, pa, pb); break;
    }
}

extern "C" mn_status mn_cuda_where(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b)
{
    const mn_tensor *t[4] = {out, c, a, b}, *v[3] = {out, a, b};
    MN_TRY(check_cuda("where", 4, t, true));
    MN_TRY(check_dtypes("where", 3, v));
    Geom g;
    geom_init(&g, 4, t);
    if (g.numel == 0) return MN_OK;
    void *o = mn_tensor_data(out);
    const void *pc = mn_tensor_data(c), *pa = mn_tensor_data(a), *pb = mn_tensor_data(b);
    if (mn_dtype_size(out->dtype) == 8) launch_where<uint64_t>(g, c->dtype, o, pc, pa, pb);
    else launch_where<uint32_t>(g, c->dtype, o, pc, pa, pb);
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- copy and fill ---- */

template <typename TD>
static void launch_copy_from(const Geom &g, mn_dtype sdt, TD *d, const void *s)
{
    unsigned nb = blocks_for(g.numel);
    switch (sdt) {
    case MN_F32: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, d, (const float *)s, Conv<TD, float>()); break;
    case MN_F64: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, d, (const double *)s, Conv<TD, double>()); break;
    case MN_I64: k_map1<<<nb, THREADS, 0, MN_STREAM>>>(g, d, (const int64_t *)s, Conv<TD, int64_t>()); break;
    }
}

extern "C" mn_status mn_cuda_copy(mn_tensor *dst, const mn_tensor *src)
{
    const mn_tensor *t[2] = {dst, src};
    MN_TRY(check_cuda("copy", 2, t, true));
    Geom g;
    geom_init(&g, 2, t);
    if (g.numel == 0) return MN_OK;
    void *d = mn_tensor_data(dst);
    const void *s = mn_tensor_data(src);
    if (dst->dtype == src->dtype && mn_tensor_is_contiguous(dst) && mn_tensor_is_contiguous(src)) {
        MN_CUDA_CHECK(cudaMemcpyAsync(d, s, (size_t)g.numel * mn_dtype_size(dst->dtype), cudaMemcpyDeviceToDevice, MN_STREAM));
        return MN_OK;
    }
    switch (dst->dtype) {
    case MN_F32: launch_copy_from(g, src->dtype, (float *)d, s); break;
    case MN_F64: launch_copy_from(g, src->dtype, (double *)d, s); break;
    case MN_I64: launch_copy_from(g, src->dtype, (int64_t *)d, s); break;
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

template <typename T> __global__ void k_fill(const __grid_constant__ Geom g, T *d, T v)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[1];
        offsets<1>(g, i, off);
        d[off[0]] = v;
    }
}

extern "C" mn_status mn_cuda_fill(mn_tensor *dst, double value)
{
    const mn_tensor *t[1] = {dst};
    MN_TRY(check_cuda("fill", 1, t, false));
    Geom g;
    geom_init(&g, 1, t);
    if (g.numel == 0) return MN_OK;
    void *d = mn_tensor_data(dst);
    /* All three dtypes store +0 as zero bytes. */
    if (value == 0 && !signbit(value) && mn_tensor_is_contiguous(dst)) {
        MN_CUDA_CHECK(cudaMemsetAsync(d, 0, (size_t)g.numel * mn_dtype_size(dst->dtype), MN_STREAM));
        return MN_OK;
    }
    unsigned nb = blocks_for(g.numel);
    switch (dst->dtype) {
    case MN_F32: k_fill<<<nb, THREADS, 0, MN_STREAM>>>(g, (float *)d, (float)value); break;
    case MN_F64: k_fill<<<nb, THREADS, 0, MN_STREAM>>>(g, (double *)d, value); break;
    case MN_I64: k_fill<<<nb, THREADS, 0, MN_STREAM>>>(g, (int64_t *)d, mn_to_i64(value)); break;
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- row normalisation (model/rownorm.h: c = x - mean x or x, c / sqrt(|c|^2 / D + eps)) ----
 * One warp a row (rownorm_warp.cuh); memory-bound: one read of x and one
 * write of out, and of the adjoint's a and xbar. */

__global__ void k_rownorm(float *out, float *scale, const float *x, int64_t rows, int64_t n, bool center, bool sum,
                          double eps)
{
    const int64_t row = (int64_t)blockIdx.x * (THREADS / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const double sc = mn_rownorm_warp_row(out + row * n, x + row * n, n, lane, center, sum, eps);
    if (scale && lane == 0) scale[row] = (float)sc;
}

__global__ void k_rownorm_vjp(float *xbar, const float *nhat, const float *scale, const float *a, int64_t rows,
                              int64_t n, bool center, bool sum)
{
    const int64_t row = (int64_t)blockIdx.x * (THREADS / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    mn_rownorm_warp_vjp(xbar + row * n, nhat + row * n, scale[row], a + row * n, n, lane, center, sum);
}

static bool rows_f32(const mn_tensor *t) { return t->dtype == MN_F32 && mn_tensor_is_contiguous(t) && t->ndim >= 1; }

extern "C" mn_status mn_cuda_rownorm(mn_tensor *out, mn_tensor *scale, const mn_tensor *x, bool center, bool sum,
                                     double eps)
{
    const mn_tensor *t[2] = {out, x};
    MN_TRY(check_cuda("rownorm", 2, t, true));
    const mn_tensor *st[1] = {scale};
    if (scale) MN_TRY(check_cuda("rownorm", 1, st, false));
    if (!rows_f32(out) || !rows_f32(x))
        return mn_fail(MN_ERR_ARG, "cuda rownorm: needs contiguous f32 tensors of at least one dimension");
    const int64_t n = x->shape[x->ndim - 1], numel = mn_tensor_numel(x);
    if (numel == 0 || n == 0) return MN_OK;
    const int64_t rows = numel / n, per_block = THREADS / 32;
    if (scale && (scale->dtype != MN_F32 || !mn_tensor_is_contiguous(scale) || mn_tensor_numel(scale) != rows))
        return mn_fail(MN_ERR_ARG, "cuda rownorm: the scales need a contiguous f32 tensor of one entry a row");
    const unsigned nb = (unsigned)((rows + per_block - 1) / per_block);
    k_rownorm<<<nb, THREADS, 0, MN_STREAM>>>((float *)mn_tensor_data(out), scale ? (float *)mn_tensor_data(scale) : NULL,
                                             (const float *)mn_tensor_data(x), rows, n, center, sum, eps);
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

extern "C" mn_status mn_cuda_rownorm_vjp(mn_tensor *xbar, const mn_tensor *nhat, const mn_tensor *scale,
                                         const mn_tensor *a, bool center, bool sum)
{
    const mn_tensor *t[3] = {xbar, nhat, a};
    MN_TRY(check_cuda("rownorm_vjp", 3, t, true));
    MN_TRY(check_cuda("rownorm_vjp", 1, &scale, false));
    if (!rows_f32(xbar) || !rows_f32(nhat) || !rows_f32(a))
        return mn_fail(MN_ERR_ARG, "cuda rownorm_vjp: needs contiguous f32 tensors of at least one dimension");
    const int64_t n = nhat->shape[nhat->ndim - 1], numel = mn_tensor_numel(nhat);
    if (numel == 0 || n == 0) return MN_OK;
    const int64_t rows = numel / n, per_block = THREADS / 32;
    if (scale->dtype != MN_F32 || !mn_tensor_is_contiguous(scale) || mn_tensor_numel(scale) != rows)
        return mn_fail(MN_ERR_ARG, "cuda rownorm_vjp: the scales need a contiguous f32 tensor of one entry a row");
    const unsigned nb = (unsigned)((rows + per_block - 1) / per_block);
    k_rownorm_vjp<<<nb, THREADS, 0, MN_STREAM>>>((float *)mn_tensor_data(xbar), (const float *)mn_tensor_data(nhat),
                                                 (const float *)mn_tensor_data(scale), (const float *)mn_tensor_data(a),
                                                 rows, n, center, sum);
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- several tiled copies in one launch (model/ops.h: tile_many) ---- */

struct TileMany {
    float *dst[MN_TILE_MANY];
    const float *src[MN_TILE_MANY]; /* NULL: value[i] everywhere */
    float value[MN_TILE_MANY];
    int64_t n[MN_TILE_MANY], period[MN_TILE_MANY];
};

/* blockIdx.y picks the copy; the x blocks stride over it */
__global__ void k_tile_many(const __grid_constant__ TileMany t)
{
    const int i = blockIdx.y;
    float *d = t.dst[i];
    const float *s = t.src[i];
    const float value = t.value[i];
    const int64_t n = t.n[i], period = t.period[i];
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x)
        d[e] = !s ? value : s[period == n ? e : period == 1 ? 0 : e % period];
}

extern "C" mn_status mn_cuda_tile_many(int n, mn_tensor *const *dst, const mn_tensor *const *src)
{
    MN_TRY(mn_tile_many_check(n, dst, src));
    TileMany t;
    memset(&t, 0, sizeof t);
    int64_t most = 0;
    for (int i = 0; i < n; i++) {
        const int64_t dn = mn_tensor_numel(dst[i]), sn = mn_tensor_numel(src[i]);
        const bool value = src[i]->storage && src[i]->storage->device == MN_CPU && sn == 1;
        const mn_tensor *pair[2] = {dst[i], src[i]};
        MN_TRY(check_cuda("tile_many", value ? 1 : 2, pair, false));
        t.dst[i] = (float *)mn_tensor_data(dst[i]);
        if (value) t.value[i] = *(const float *)mn_tensor_data(src[i]);
        else t.src[i] = (const float *)mn_tensor_data(src[i]);
        t.n[i] = dn;
        t.period[i] = sn;
        if (dn > most) most = dn;
    }
    if (most == 0) return MN_OK;
    dim3 grid = {blocks_for(most), (unsigned)n, 1};
    k_tile_many<<<grid, THREADS, 0, MN_STREAM>>>(t);
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- initial weights (model/random_counter.h): each element its own draw ---- */

__global__ void k_init_fill(float *d, int64_t n, int kind, double scale, uint64_t seed, uint64_t stream,
                            int64_t period)
{
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x)
        d[e] = mn_rc_init_value(kind, scale, seed, stream, (uint64_t)(period > 0 ? e % period : e));
}

extern "C" mn_status mn_cuda_init_fill(mn_tensor *dst, int kind, double scale, uint64_t seed, uint64_t stream,
                                       int64_t period)
{
    const mn_tensor *t[1] = {dst};
    MN_TRY(check_cuda("init_fill", 1, t, false));
    if (dst->dtype != MN_F32 || !mn_tensor_is_contiguous(dst))
        return mn_fail(MN_ERR_ARG, "cuda init_fill: needs a contiguous f32 tensor");
    int64_t n = mn_tensor_numel(dst);
    if (n == 0) return MN_OK;
    k_init_fill<<<blocks_for(n), THREADS, 0, MN_STREAM>>>((float *)mn_tensor_data(dst), n, kind, scale, seed, stream,
                                                         period);
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- reductions ----
 * Two accumulation policies: RedD, in double for every dtype (the CPU's
 * reduce_all, and its per-dim float path), and RedI, exact wrapping integers
 * for i64 sum, prod, max and min along a dim (the CPU's run_i64_exact). */

template <int OP> struct RedD {
    typedef double acc_t;
    __device__ static double ident()
    {
        return OP == MN_OP_prod ? 1.0 : OP == MN_OP_max ? -INFINITY : OP == MN_OP_min ? INFINITY : 0.0;
    }
    template <typename T> __device__ static double add(double acc, T x)
    {
        double v = (double)x;
        switch (OP) {
        case MN_OP_norm: return acc + v * v;
        case MN_OP_prod: return acc * v;
        case MN_OP_max: return mn_op_maximum(acc, v);
        case MN_OP_min: return mn_op_minimum(acc, v);
        default: return acc + v;
        }
    }
    __device__ static double merge(double a, double b)
    {
        switch (OP) {
        case MN_OP_prod: return a * b;
        case MN_OP_max: return mn_op_maximum(a, b);
        case MN_OP_min: return mn_op_minimum(a, b);
        default: return a + b;
        }
    }
    template <typename T> __device__ static T finish(double acc, int64_t n)
    {
        if (OP == MN_OP_mean) acc = acc / (double)n;
        if (OP == MN_OP_norm) acc = sqrt(acc);
        if ((OP == MN_OP_max || OP == MN_OP_min) && n == 0) acc = NAN;
        return from_double<T>(acc);
    }
};

template <int OP> struct RedI {
    typedef int64_t acc_t;
    __device__ static int64_t ident()
    {
        return OP == MN_OP_prod ? 1 : OP == MN_OP_max ? INT64_MIN : OP == MN_OP_min ? INT64_MAX : 0;
    }
    template <typename T> __device__ static int64_t add(int64_t acc, T x) { return merge(acc, (int64_t)x); }
    __device__ static int64_t merge(int64_t a, int64_t b)
    {
        switch (OP) {
        case MN_OP_prod: return (int64_t)((uint64_t)a * (uint64_t)b);
        case MN_OP_max: return a > b ? a : b;
        case MN_OP_min: return a < b ? a : b;
        default: return (int64_t)((uint64_t)a + (uint64_t)b);
        }
    }
    template <typename T> __device__ static T finish(int64_t acc, int64_t n)
    {
        return (OP == MN_OP_max || OP == MN_OP_min) && n == 0 ? 0 : (T)acc;
    }
};

template <typename T, int OP>
using Policy = typename std::conditional<std::is_same<T, int64_t>::value &&
                                             (OP == MN_OP_sum || OP == MN_OP_prod || OP == MN_OP_max || OP == MN_OP_min),
                                         RedI<OP>, RedD<OP>>::type;

template <typename R> __device__ __forceinline__ typename R::acc_t warp_merge(typename R::acc_t acc)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = R::merge(acc, __shfl_down_sync(0xffffffffu, acc, o));
    return acc;
}

/* Whole tensor: per-block partials in double, merged on the host in a fixed
 * order (so the result does not depend on timing). */
template <typename T, int OP>
__global__ void k_reduce_all(const __grid_constant__ Geom g, const T *a, double *partial)
{
    typedef RedD<OP> R;
    __shared__ double warps[THREADS / 32];
    double acc = R::ident();
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[1];
        offsets<1>(g, i, off);
        acc = R::add(acc, a[off[0]]);
    }
    acc = warp_merge<R>(acc);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warps[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < THREADS / 32 ? warps[lane] : R::ident();
        acc = warp_merge<R>(acc);
        if (lane == 0) partial[blockIdx.x] = acc;
    }
}

template <int OP> static double host_merge(double a, double b)
{
    switch (OP) {
    case MN_OP_prod: return a * b;
    case MN_OP_max: return mn_op_maximum(a, b);
    case MN_OP_min: return mn_op_minimum(a, b);
    default: return a + b;
    }
}

template <int OP> static mn_status reduce_all_op(const Geom &g, mn_dtype dt, const void *a, double *result)
{
    unsigned nb = blocks_for(g.numel);
    if (nb > 1024) nb = 1024;
    double *partial = NULL, host[1024];
    MN_TRY(mn_cuda_alloc(nb * sizeof(double), (void **)&partial));
    switch (dt) {
    case MN_F32: k_reduce_all<float, OP><<<nb, THREADS, 0, MN_STREAM>>>(g, (const float *)a, partial); break;
    case MN_F64: k_reduce_all<double, OP><<<nb, THREADS, 0, MN_STREAM>>>(g, (const double *)a, partial); break;
    case MN_I64: k_reduce_all<int64_t, OP><<<nb, THREADS, 0, MN_STREAM>>>(g, (const int64_t *)a, partial); break;
    }
    mn_status st = MN_CUDA_ST(cudaGetLastError());
    if (st == MN_OK) st = MN_CUDA_ST(cudaMemcpy(host, partial, nb * sizeof(double), cudaMemcpyDeviceToHost));
    mn_cuda_free(partial, nb * sizeof(double));
    MN_TRY(st);
    double acc = OP == MN_OP_prod ? 1.0 : OP == MN_OP_max ? -INFINITY : OP == MN_OP_min ? INFINITY : 0.0;
    for (unsigned i = 0; i < nb; i++) acc = host_merge<OP>(acc, host[i]);
    if (OP == MN_OP_mean) acc /= (double)g.numel;
    if (OP == MN_OP_norm) acc = sqrt(acc);
    *result = acc;
    return MN_OK;
}

extern "C" mn_status mn_cuda_reduce_all(mn_op op, const mn_tensor *a, double *result)
{
    const mn_tensor *t[1] = {a};
    MN_TRY(check_cuda("reduce", 1, t, false));
    Geom g;
    geom_init(&g, 1, t);
    if (g.numel == 0) return mn_fail(MN_ERR_ARG, "cuda reduce: empty tensor");
    const void *p = mn_tensor_data(a);
    switch (op) {
#define MN_REDUCE(name, doc) case MN_OP_##name: return reduce_all_op<MN_OP_##name>(g, a->dtype, p, result);
#include "../model/ops.def"
    default: return mn_fail(MN_ERR_ARG, "cuda reduce: '%s' is not a reduction", mn_op_name(op));
    }
}

/* Along a dim: the geometry walks out and a-without-dim together. One
 * thread per output when the reduced dim is strided (neighbouring threads
 * then read neighbouring elements); one warp per output when the reduced dim
 * is a long unit-stride row, so that the row is read coalesced. */
template <typename T, typename R>
__global__ void k_reduce_dim(const __grid_constant__ Geom g, T *o, const T *a, int64_t len, int64_t rs)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[2];
        offsets<2>(g, i, off);
        const T *p = a + off[1];
        typename R::acc_t acc = R::ident();
        for (int64_t j = 0; j < len; j++) acc = R::add(acc, p[j * rs]);
        o[off[0]] = R::template finish<T>(acc, len);
    }
}

template <typename T, typename R>
__global__ void k_reduce_dim_warp(const __grid_constant__ Geom g, T *o, const T *a, int64_t len)
{
    int lane = threadIdx.x % 32;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int64_t nwarps = (int64_t)gridDim.x * blockDim.x / 32;
    for (int64_t i = warp; i < g.numel; i += nwarps) {
        int64_t off[2];
        offsets<2>(g, i, off);
        const T *p = a + off[1];
        typename R::acc_t acc = R::ident();
        for (int64_t j = lane; j < len; j += 32) acc = R::add(acc, p[j]);
        acc = warp_merge<R>(acc);
        if (lane == 0) o[off[0]] = R::template finish<T>(acc, len);
    }
}

template <typename T, int OP>
static void launch_reduce_dim(const Geom &g, T *o, const T *a, int64_t len, int64_t rs)
{
    typedef Policy<T, OP> R;
    if (rs == 1 && len >= 64) {
        int64_t threads = g.numel * 32;
        k_reduce_dim_warp<T, R><<<blocks_for(threads), THREADS, 0, MN_STREAM>>>(g, o, a, len);
    } else {
        k_reduce_dim<T, R><<<blocks_for(g.numel), THREADS, 0, MN_STREAM>>>(g, o, a, len, rs);
    }
}

template <int OP> static void reduce_dim_op(const Geom &g, mn_dtype dt, void *o, const void *a, int64_t len, int64_t rs)
{
    switch (dt) {
    case MN_F32: launch_reduce_dim<float, OP>(g, (float *)o, (const float *)a, len, rs); break;
    case MN_F64: launch_reduce_dim<double, OP>(g, (double *)o, (const double *)a, len, rs); break;
    case MN_I64: launch_reduce_dim<int64_t, OP>(g, (int64_t *)o, (const int64_t *)a, len, rs); break;
    }
}

/* a without dim d: the shape and strides of one output's position. */
static void drop_dim(const mn_tensor *a, int d, mn_tensor *v)
{
    *v = *a;
    for (int i = d; i < a->ndim - 1; i++) {
        v->shape[i] = a->shape[i + 1];
        v->stride[i] = a->stride[i + 1];
    }
    v->ndim = a->ndim - 1;
}

extern "C" mn_status mn_cuda_reduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int d)
{
    if (d < 0 || d >= a->ndim) return mn_fail(MN_ERR_ARG, "cuda reduce: dim %d out of range", d);
    mn_tensor rest;
    drop_dim(a, d, &rest);
    const mn_tensor *t[2] = {out, &rest};
    MN_TRY(check_cuda("reduce", 2, t, true));
    MN_TRY(check_dtypes("reduce", 2, t));
    Geom g;
    geom_init(&g, 2, t);
    if (g.numel == 0) return MN_OK;
    void *o = mn_tensor_data(out);
    const void *p = mn_tensor_data(a);
    int64_t len = a->shape[d], rs = a->stride[d];
    switch (op) {
#define MN_REDUCE(name, doc) case MN_OP_##name: reduce_dim_op<MN_OP_##name>(g, out->dtype, o, p, len, rs); break;
#include "../model/ops.def"
    default: return mn_fail(MN_ERR_ARG, "cuda reduce: '%s' is not a reduction", mn_op_name(op));
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* First index of the max (min); a NaN counts as larger (smaller) than
 * everything, as in torch and the CPU backend, so the first NaN wins. */
template <typename T, bool MAX>
__global__ void k_argreduce(const __grid_constant__ Geom g, int64_t *o, const T *a, int64_t len, int64_t rs)
{
    GRID_STRIDE_LOOP(i, g.numel)
    {
        int64_t off[2];
        offsets<2>(g, i, off);
        const T *p = a + off[1];
        int64_t best = 0;
        T bv = p[0];
        if (bv == bv) {
            for (int64_t j = 1; j < len; j++) {
                T v = p[j * rs];
                if (v != v) {
                    best = j;
                    break;
                }
                if (MAX ? v > bv : v < bv) {
                    bv = v;
                    best = j;
                }
            }
        }
        o[off[0]] = best;
    }
}

template <typename T>
static void launch_arg(const Geom &g, bool want_max, int64_t *o, const T *a, int64_t len, int64_t rs)
{
    unsigned nb = blocks_for(g.numel);
    if (want_max) k_argreduce<T, true><<<nb, THREADS, 0, MN_STREAM>>>(g, o, a, len, rs);
    else k_argreduce<T, false><<<nb, THREADS, 0, MN_STREAM>>>(g, o, a, len, rs);
}

extern "C" mn_status mn_cuda_argreduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int d)
{
    if (out->dtype != MN_I64) return mn_fail(MN_ERR_ARG, "cuda argreduce: output must be i64");
    if (op != MN_OP_max && op != MN_OP_min) return mn_fail(MN_ERR_ARG, "cuda argreduce: op must be max or min");
    if (d < 0 || d >= a->ndim) return mn_fail(MN_ERR_ARG, "cuda argreduce: dim %d out of range", d);
    mn_tensor rest;
    drop_dim(a, d, &rest);
    const mn_tensor *t[2] = {out, &rest};
    MN_TRY(check_cuda("argreduce", 2, t, true));
    Geom g;
    geom_init(&g, 2, t);
    if (g.numel == 0) return MN_OK;
    int64_t len = a->shape[d], rs = a->stride[d];
    if (len == 0) return mn_fail(MN_ERR_ARG, "cuda argreduce: empty dim");
    int64_t *o = (int64_t *)mn_tensor_data(out);
    const void *p = mn_tensor_data(a);
    bool want_max = op == MN_OP_max;
    switch (a->dtype) {
    case MN_F32: launch_arg(g, want_max, o, (const float *)p, len, rs); break;
    case MN_F64: launch_arg(g, want_max, o, (const double *)p, len, rs); break;
    case MN_I64: launch_arg(g, want_max, o, (const int64_t *)p, len, rs); break;
    }
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}

/* ---- i64 matrix product: no cuBLAS type for it; one thread per output,
 * wrapping arithmetic as the CPU's ---- */

struct MatGeom {
    int64_t batch, m, n, k;
    int64_t as[3], bs[3];
};

__global__ void k_matmul_i64(const MatGeom mg, int64_t *c, const int64_t *a, const int64_t *b)
{
    int64_t mn = mg.m * mg.n;
    GRID_STRIDE_LOOP(idx, mg.batch * mn)
    {
        int64_t q = idx / mn, r = idx % mn, i = r / mg.n, j = r % mg.n;
        const int64_t *pa = a + q * mg.as[0] + i * mg.as[1];
        const int64_t *pb = b + q * mg.bs[0] + j * mg.bs[2];
        uint64_t acc = 0;
        for (int64_t l = 0; l < mg.k; l++) acc += (uint64_t)pa[l * mg.as[2]] * (uint64_t)pb[l * mg.bs[1]];
        c[idx] = (int64_t)acc;
    }
}

extern "C" mn_status mn_cuda_matmul_i64(mn_tensor *out, const mn_tensor *a, const mn_tensor *b)
{
    MatGeom mg = {out->shape[0], out->shape[1], out->shape[2], a->shape[2], {0}, {0}};
    for (int i = 0; i < 3; i++) {
        mg.as[i] = a->stride[i];
        mg.bs[i] = b->stride[i];
    }
    int64_t total = mg.batch * mg.m * mg.n;
    if (total == 0) return MN_OK;
    k_matmul_i64<<<blocks_for(total), THREADS, 0, MN_STREAM>>>(mg, (int64_t *)mn_tensor_data(out),
                                                 (const int64_t *)mn_tensor_data(a), (const int64_t *)mn_tensor_data(b));
    MN_CUDA_CHECK_LAUNCH();
    return MN_OK;
}
