/* cuda.c: the device layer: finding the device (once, at start-up) and
 * creating its context (lazily, at the first allocation), error translation,
 * the caching allocator, copies between the host and the device, and the
 * registration of all of it (tensor backend, allocator, device copies, rule
 * engine) with the engine's registries. Without a usable device the same
 * registries get stand-ins that fail with "cuda: <reason>", so every CUDA
 * request says why, and everything else goes on working.
 * One device (0) and the legacy default stream: every launch and copy is
 * ordered on it, which is what lets the allocator hand a freed block to the
 * next request without waiting. */
#include "cuda_check.h"
#include "cuda_ops.h"
#include "engine_large.h" /* the steps it keeps between runs: given back with the cache */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct {
    bool tried, usable, context;
    char reason[256];
    char describe[320];
    int arch, sms;
    long smem_optin;
} dev;

/* ---- the current stream (cuda.h) ---- */

static void *current_stream; /* cudaStream_t; NULL: the legacy default stream */
void mn_cuda_set_stream(void *stream) { current_stream = stream; }
void *mn_cuda_get_stream(void) { return current_stream; }

/* ---- errors ---- */

mn_status mn_cuda_status(cudaError_t err, const char *call, const char *file, int line)
{
    if (err == cudaSuccess) return MN_OK;
    (void)cudaGetLastError(); /* reported here; not again by check_pending */
    return mn_fail(err == cudaErrorMemoryAllocation ? MN_ERR_OOM : MN_ERR_DEVICE, "cuda: %s (%s) in %s at %s:%d",
                   cudaGetErrorString(err), cudaGetErrorName(err), call, file, line);
}

static mn_status unavailable(void)
{
    return mn_fail(MN_ERR_DEVICE, "cuda: %s", dev.reason[0] ? dev.reason : "the CUDA layer was not started");
}

/* ---- the device ---- */

static void find_device(void)
{
    int count = 0, driver = 0, runtime = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        if (driver == 0)
            snprintf(dev.reason, sizeof dev.reason, "no CUDA driver on this machine (libcuda not found)");
        else if (err == cudaErrorInsufficientDriver)
            snprintf(dev.reason, sizeof dev.reason, "the CUDA driver (%d) is older than the runtime (%d) (%s)",
                     driver, runtime, cudaGetErrorString(err));
        else if (err == cudaErrorNoDevice)
            snprintf(dev.reason, sizeof dev.reason, "no CUDA device (cudaGetDeviceCount: %s)", cudaGetErrorString(err));
        else
            snprintf(dev.reason, sizeof dev.reason, "cudaGetDeviceCount failed: %s (%s)", cudaGetErrorString(err),
                     cudaGetErrorName(err));
        return;
    }
    if (count < 1) {
        snprintf(dev.reason, sizeof dev.reason, "no CUDA device (cudaGetDeviceCount found none)");
        return;
    }
    struct cudaDeviceProp p;
    err = cudaGetDeviceProperties(&p, 0);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(dev.reason, sizeof dev.reason, "device 0 cannot be queried: %s", cudaGetErrorString(err));
        return;
    }
    dev.arch = 10 * p.major + p.minor;
    dev.sms = p.multiProcessorCount;
    dev.smem_optin = (long)p.sharedMemPerBlockOptin;
    snprintf(dev.describe, sizeof dev.describe, "%.200s (sm_%d, %d SMs, %.1f GiB)", p.name, dev.arch, dev.sms,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    dev.usable = true;
}

mn_status mn_cuda_ensure_device(void)
{
    if (!dev.usable) return unavailable();
    if (dev.context) return MN_OK;
    MN_CUDA_CHECK(cudaSetDevice(0));
    MN_CUDA_CHECK(cudaFree(0)); /* creates the primary context now, not inside a later call */
    dev.context = true;
    return MN_OK;
}

bool mn_cuda_available(void) { return dev.usable; }
const char *mn_cuda_unavailable_reason(void) { return dev.usable ? "" : dev.reason; }
const char *mn_cuda_describe(void) { return dev.usable ? dev.describe : dev.reason; }
int mn_cuda_arch(void) { return dev.usable ? dev.arch : 0; }
int mn_cuda_sm_count(void) { return dev.sms > 0 ? dev.sms : 1; }
long mn_cuda_smem_optin(void) { return dev.usable ? dev.smem_optin : 0; }

bool mn_cuda_capture_graph(cudaStream_t stream, mn_status (*enqueue)(void *ctx), void *ctx, cudaGraphExec_t *exec)
{
    *exec = NULL;
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    mn_status s = enqueue(ctx);
    cudaGraph_t g = NULL;
    /* always ends the capture, even when a launch above failed */
    cudaError_t e = cudaStreamEndCapture(stream, &g);
    bool ok = s == MN_OK && e == cudaSuccess && g;
    if (ok && cudaGraphInstantiate(exec, g, 0) != cudaSuccess) {
        *exec = NULL;
        ok = false;
    }
    if (g) (void)cudaGraphDestroy(g);
    if (!ok) (void)cudaGetLastError();
    return ok;
}

mn_status mn_cuda_check_pending(void)
{
    if (!dev.context) return MN_OK; /* nothing ever ran */
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamQuery(0);
    if (err == cudaSuccess || err == cudaErrorNotReady) return MN_OK;
    (void)cudaGetLastError();
    return mn_fail(MN_ERR_DEVICE, "cuda: asynchronous error from an earlier operation: %s (%s)",
                   cudaGetErrorString(err), cudaGetErrorName(err));
}

mn_status mn_cuda_synchronize(void)
{
    if (!dev.usable) return unavailable();
    if (!dev.context) return MN_OK;
    MN_CUDA_CHECK(cudaDeviceSynchronize());
    return MN_OK;
}

/* ---- the caching allocator ----
 * Blocks are rounded to a size class (512 B steps up to 1 MiB, 2 MiB steps
 * above: at most 2 MiB lost per tensor, and a request that fits the device
 * never fails for rounding). A freed block goes to the free list of its
 * class; a request takes a cached block of exactly its class, else
 * cudaMalloc. Out of memory: give the whole cache back and try once more. */

typedef struct block {
    void *ptr;
    size_t size;
    struct block *next;
} block;

enum { NBUCKETS = 1024 };
static block *cache[NBUCKETS];
static mn_cuda_memory_stats stats;

static size_t class_size(size_t n)
{
    const size_t small = 512, big = (size_t)2 << 20;
    if (n <= ((size_t)1 << 20)) return n == 0 ? small : (n + small - 1) / small * small;
    if (n > SIZE_MAX - big) return n;
    return (n + big - 1) / big * big;
}

static unsigned bucket_of(size_t size)
{
    return (unsigned)(((uint64_t)(size >> 9) * 0x9E3779B97F4A7C15ull) >> 54) % NBUCKETS;
}

static void release_cache(void)
{
    for (int i = 0; i < NBUCKETS; i++) {
        while (cache[i]) {
            block *b = cache[i];
            cache[i] = b->next;
            (void)cudaFree(b->ptr); /* a broken context has nothing to give back either */
            stats.cached -= b->size;
            free(b);
        }
    }
    (void)cudaGetLastError();
}

static const char *human(size_t n, char *buf, size_t len)
{
    const double k = 1024.0;
    double v = (double)n;
    if (v >= k * k * k) snprintf(buf, len, "%.2f GiB", v / (k * k * k));
    else if (v >= k * k) snprintf(buf, len, "%.1f MiB", v / (k * k));
    else if (v >= k) snprintf(buf, len, "%.1f KiB", v / k);
    else snprintf(buf, len, "%zu B", n);
    return buf;
}

static void note_alloc(size_t size)
{
    stats.allocated += size;
    if (stats.allocated > stats.peak_allocated) stats.peak_allocated = stats.allocated;
}

static void (*oom_hook)(void *ctx);
static void *oom_ctx;

void mn_cuda_set_oom_hook(void (*hook)(void *ctx), void *ctx)
{
    oom_hook = hook;
    oom_ctx = ctx;
}

size_t mn_cuda_allocated_bytes(void) { return stats.allocated; }

/* A block of size from the cache's bucket, or false. */
static bool from_cache(size_t size, void **out)
{
    for (block **pp = &cache[bucket_of(size)]; *pp; pp = &(*pp)->next) {
        if ((*pp)->size != size) continue;
        block *b = *pp;
        *pp = b->next;
        *out = b->ptr;
        stats.cached -= size;
        stats.cache_hits++;
        note_alloc(size);
        free(b);
        return true;
    }
    return false;
}

mn_status mn_cuda_alloc(size_t nbytes, void **out)
{
    MN_TRY(mn_cuda_ensure_device());
    size_t size = class_size(nbytes);
    stats.alloc_calls++;
    if (from_cache(size, out)) return MN_OK;
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        mn_cuda_large_release();
        release_cache();
        err = cudaMalloc(&p, size);
    }
    if (err == cudaErrorMemoryAllocation && oom_hook) {
        /* dead tensors the Lua layer still holds: collected, their blocks
         * come back to the cache; one of the right size, or the driver's */
        (void)cudaGetLastError();
        oom_hook(oom_ctx);
        if (from_cache(size, out)) return MN_OK;
        release_cache();
        err = cudaMalloc(&p, size);
    }
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
        char a[32], c[32], f[32], t[32];
        return mn_fail(MN_ERR_OOM, "cuda: out of memory allocating %zu bytes (allocated %s, cached %s, free %s of %s)",
                       nbytes, human(stats.allocated, a, sizeof a), human(stats.cached, c, sizeof c),
                       human(free_b, f, sizeof f), human(total_b, t, sizeof t));
    }
    MN_TRY(mn_cuda_status(err, "cudaMalloc", __FILE__, __LINE__));
    stats.cuda_mallocs++;
    note_alloc(size);
    *out = p;
    return MN_OK;
}

void mn_cuda_free(void *ptr, size_t nbytes)
{
    if (!ptr) return;
    size_t size = class_size(nbytes);
    stats.allocated -= size;
    block *b = malloc(sizeof *b);
    if (!b) { /* no room to remember it: give it back instead */
        (void)cudaFree(ptr);
        (void)cudaGetLastError();
        return;
    }
    unsigned k = bucket_of(size);
    *b = (block){ptr, size, cache[k]};
    cache[k] = b;
    stats.cached += size;
}

mn_status mn_cuda_empty_cache(void)
{
    if (!dev.usable) return unavailable();
    mn_cuda_large_release(); /* its blocks go to the cache first */
    release_cache();
    mn_cuda_staging_release();
    return MN_OK;
}

mn_status mn_cuda_memory(mn_cuda_memory_stats *out)
{
    MN_TRY(mn_cuda_ensure_device());
    *out = stats;
    out->kept = mn_cuda_large_kept_bytes();
    MN_CUDA_CHECK(cudaMemGetInfo(&out->device_free, &out->device_total));
    return MN_OK;
}

/* ---- copies between devices ----
 * tensor.h: dst is fresh and contiguous with src's shape; these also take
 * any dst strides and dtypes, converting on whichever side is cheaper. */

static mn_status same_shape(const char *who, const mn_tensor *dst, const mn_tensor *src)
{
    if (!mn_tensor_same_shape(dst, src)) {
        char a[160], b[160];
        return mn_fail(MN_ERR_ARG, "%s: shapes differ (%s, %s)", who, mn_shape_string(dst, a, sizeof a),
                       mn_shape_string(src, b, sizeof b));
    }
    return MN_OK;
}

static size_t bytes_of(const mn_tensor *t)
{
    return (size_t)mn_tensor_numel(t) * mn_dtype_size(t->dtype);
}

/* cpu -> cuda: the host side makes a contiguous block of dst's dtype (the
 * CPU backend converts and gathers strides), one upload, and for a strided
 * dst a device copy from a contiguous temporary. */
static mn_status copy_to_device(mn_tensor *dst, const mn_tensor *src)
{
    MN_TRY(same_shape("copy to cuda", dst, src));
    mn_status st = MN_OK;
    if (!mn_tensor_is_contiguous(dst)) {
        mn_tensor tmp = {0};
        MN_TRY(mn_tensor_empty(&tmp, dst->dtype, src->ndim, src->shape, MN_CUDA));
        st = copy_to_device(&tmp, src);
        if (st == MN_OK) st = mn_cuda_copy(dst, &tmp);
        mn_tensor_release(&tmp);
        return st;
    }
    mn_tensor host = {0};
    const mn_tensor *s = src;
    if (!mn_tensor_is_contiguous(src) || src->dtype != dst->dtype) {
        MN_TRY(mn_tensor_empty(&host, dst->dtype, src->ndim, src->shape, MN_CPU));
        st = mn_cpu_backend()->copy(&host, src);
        s = &host;
    }
    if (st == MN_OK && bytes_of(dst) > 0)
        st = MN_CUDA_ST(cudaMemcpy(mn_tensor_data(dst), mn_tensor_data(s), bytes_of(dst), cudaMemcpyHostToDevice));
    mn_tensor_release(&host);
    return st;
}

/* cuda -> cpu: the device side makes a contiguous block of dst's dtype, one
 * download (straight into dst when it is contiguous). */
static mn_status copy_to_host(mn_tensor *dst, const mn_tensor *src)
{
    MN_TRY(same_shape("copy to cpu", dst, src));
    mn_status st = MN_OK;
    mn_tensor dtmp = {0}, htmp = {0};
    const mn_tensor *s = src;
    if (!mn_tensor_is_contiguous(src) || src->dtype != dst->dtype) {
        MN_TRY(mn_tensor_empty(&dtmp, dst->dtype, src->ndim, src->shape, MN_CUDA));
        st = mn_cuda_copy(&dtmp, src);
        s = &dtmp;
    }
    mn_tensor *d = dst;
    if (st == MN_OK && !mn_tensor_is_contiguous(dst)) {
        st = mn_tensor_empty(&htmp, dst->dtype, dst->ndim, dst->shape, MN_CPU);
        d = &htmp;
    }
    if (st == MN_OK && bytes_of(dst) > 0)
        st = MN_CUDA_ST(cudaMemcpy(mn_tensor_data(d), mn_tensor_data(s), bytes_of(dst), cudaMemcpyDeviceToHost));
    if (st == MN_OK && d != dst) st = mn_cpu_backend()->copy(dst, d);
    mn_tensor_release(&htmp);
    mn_tensor_release(&dtmp);
    return st;
}

static mn_status copy_on_device(mn_tensor *dst, const mn_tensor *src)
{
    MN_TRY(same_shape("cuda copy", dst, src));
    return mn_cuda_copy(dst, src);
}

/* ---- stand-ins without a device: every entry says why ---- */

static mn_status na_alloc(size_t n, void **out) { (void)n; (void)out; return unavailable(); }
static void na_free(void *p, size_t n) { (void)p; (void)n; }
static mn_status na_unary(mn_op op, mn_tensor *o, const mn_tensor *a) { (void)op; (void)o; (void)a; return unavailable(); }
static mn_status na_binary(mn_op op, mn_tensor *o, const mn_tensor *a, const mn_tensor *b)
{
    (void)op; (void)o; (void)a; (void)b;
    return unavailable();
}
static mn_status na_where(mn_tensor *o, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b)
{
    (void)o; (void)c; (void)a; (void)b;
    return unavailable();
}
static mn_status na_reduce(mn_op op, mn_tensor *o, const mn_tensor *a, int d) { (void)op; (void)o; (void)a; (void)d; return unavailable(); }
static mn_status na_reduce_all(mn_op op, const mn_tensor *a, double *r) { (void)op; (void)a; (void)r; return unavailable(); }
static mn_status na_matmul(mn_tensor *o, const mn_tensor *a, const mn_tensor *b) { (void)o; (void)a; (void)b; return unavailable(); }
static mn_status na_copy(mn_tensor *d, const mn_tensor *s) { (void)d; (void)s; return unavailable(); }
static mn_status na_fill(mn_tensor *d, double v) { (void)d; (void)v; return unavailable(); }

static const mn_backend unavailable_backend = {
    .name = "cuda (unavailable)",
    .unary = na_unary,
    .binary = na_binary,
    .where = na_where,
    .reduce_dim = na_reduce,
    .argreduce_dim = na_reduce,
    .reduce_all = na_reduce_all,
    .matmul = na_matmul,
    .copy = na_copy,
    .fill = na_fill,
};

static const mn_backend cuda_backend = {
    .name = "cuda",
    .unary = mn_cuda_unary,
    .binary = mn_cuda_binary,
    .where = mn_cuda_where,
    .reduce_dim = mn_cuda_reduce_dim,
    .argreduce_dim = mn_cuda_argreduce_dim,
    .reduce_all = mn_cuda_reduce_all,
    .matmul = mn_cuda_matmul,
    .copy = mn_cuda_copy,
    .fill = mn_cuda_fill,
    .rownorm = mn_cuda_rownorm,
    .rownorm_vjp = mn_cuda_rownorm_vjp,
    .init_fill = mn_cuda_init_fill,
    .tile_many = mn_cuda_tile_many,
    .stage_in = mn_cuda_stage_in,
    .stage_out = mn_cuda_stage_out,
};

bool mn_cuda_register(void)
{
    if (dev.tried) return dev.usable;
    dev.tried = true;
    find_device();
    if (!dev.usable) {
        mn_set_allocator(MN_CUDA, &(mn_allocator){na_alloc, na_free});
        mn_register_backend(MN_CUDA, &unavailable_backend);
        mn_register_device_copy(MN_CUDA, MN_CPU, na_copy);
        mn_register_device_copy(MN_CPU, MN_CUDA, na_copy);
        return false;
    }
    mn_set_allocator(MN_CUDA, &(mn_allocator){mn_cuda_alloc, mn_cuda_free});
    mn_register_backend(MN_CUDA, &cuda_backend);
    mn_register_device_copy(MN_CUDA, MN_CPU, copy_to_device);
    mn_register_device_copy(MN_CPU, MN_CUDA, copy_to_host);
    mn_register_device_copy(MN_CUDA, MN_CUDA, copy_on_device);
    mn_cuda_engine_register();
    mn_cuda_grad_register();
    return true;
}
