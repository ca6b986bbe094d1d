/* ops.h: tensor ops on any backend. The front end (ops.c) checks shapes,
 * broadcasts, promotes dtypes and allocates the result; a backend (cpu.c, and
 * kernels/ when built with CUDA) does the arithmetic. Results go to out, which
 * must be empty; on failure out stays empty. */
#ifndef MN_OPS_H
#define MN_OPS_H

#include "tensor.h"

typedef enum {
#define MN_UNARY(name, doc) MN_OP_##name,
#define MN_BINARY(name, meta, doc) MN_OP_##name,
#define MN_REDUCE(name, doc) MN_OP_##name,
#include "ops.def"
    MN_OP_COUNT
} mn_op;

typedef enum { MN_OPKIND_UNARY, MN_OPKIND_BINARY, MN_OPKIND_REDUCE } mn_op_kind;

const char *mn_op_name(mn_op op);
const char *mn_op_doc(mn_op op);
const char *mn_op_metamethod(mn_op op); /* "__add" ..., or NULL */
mn_op_kind mn_op_kind_of(mn_op op);
int mn_op_lookup(const char *name);     /* -1 when unknown */

/* Result dtype: f64 if either is f64, else f32 if either is f32, else i64;
 * i64 / i64 and i64 ^ i64 give f32 (true division, as torch does). */
mn_dtype mn_promote(mn_op op, mn_dtype a, mn_dtype b);

mn_status mn_unary(mn_op op, mn_tensor *out, const mn_tensor *a);
mn_status mn_binary(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
/* a op s (or s op a when scalar_first); s takes a's dtype, so that a f32
 * tensor times a Lua number stays f32. */
mn_status mn_binary_scalar(mn_op op, mn_tensor *out, const mn_tensor *a, double s,
                           bool scalar_first);
/* Whole-tensor reduction in double; empty tensors: sum 0, prod 1, mean/max/min NaN. */
mn_status mn_reduce_all(mn_op op, const mn_tensor *a, double *result);
mn_status mn_reduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim, bool keepdim);
/* Index (0-based) of the max / min along dim (i64 result). */
mn_status mn_argreduce_dim(mn_op op, mn_tensor *out, const mn_tensor *a, int dim, bool keepdim);

/* torch.matmul semantics: 1-d . 1-d -> scalar tensor; 2-d x 2-d; 1-d promoted
 * to a row/column; >= 3-d batched with broadcast batch dims. */
mn_status mn_matmul(mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
/* where(c, a, b) elementwise with broadcasting, c != 0 selects a. */
mn_status mn_where(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b);

/* Creation (CPU unless dev says otherwise). */
mn_status mn_tensor_full(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                         double value, mn_device dev);
mn_status mn_tensor_arange(mn_tensor *out, mn_dtype dt, double start, double stop, double step);
mn_status mn_tensor_eye(mn_tensor *out, mn_dtype dt, int64_t n, int64_t m);
mn_status mn_tensor_linspace(mn_tensor *out, mn_dtype dt, double start, double stop, int64_t n);

/* The host side of a staged transfer: piece says how many bytes (1 to
 * capacity) the piece starting at offset holds (a file may want pieces that
 * end on its rows); move fills host with them (stage_in) or consumes them
 * (stage_out). Offsets go up from 0 to nbytes, piece before move. */
typedef struct mn_stage_io {
    size_t (*piece)(void *ctx, size_t offset, size_t capacity);
    mn_status (*move)(void *ctx, size_t offset, size_t nbytes, void *host);
    void *ctx;
} mn_stage_io;

#define MN_TILE_MANY 8 /* the most copies one tile_many takes */

/* The backend interface. Inputs arrive already expanded to out's shape
 * (stride-0 views where broadcast) and already of out's dtype where the op
 * needs that; out is freshly allocated and contiguous unless noted. */
typedef struct mn_backend {
    const char *name;
    mn_status (*unary)(mn_op op, mn_tensor *out, const mn_tensor *a);
    mn_status (*binary)(mn_op op, mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
    mn_status (*where)(mn_tensor *out, const mn_tensor *c, const mn_tensor *a, const mn_tensor *b);
    /* Reduce a along dim into out (out has a's shape with dim removed). */
    mn_status (*reduce_dim)(mn_op op, mn_tensor *out, const mn_tensor *a, int dim);
    mn_status (*argreduce_dim)(mn_op op, mn_tensor *out, const mn_tensor *a, int dim);
    mn_status (*reduce_all)(mn_op op, const mn_tensor *a, double *result);
    /* Batched: a [batch, m, k], b [batch, k, n] (any strides), out [batch, m, n] contiguous. */
    mn_status (*matmul)(mn_tensor *out, const mn_tensor *a, const mn_tensor *b);
    /* dst (any strides) = src (same shape, any strides), converting dtype. */
    mn_status (*copy)(mn_tensor *dst, const mn_tensor *src);
    mn_status (*fill)(mn_tensor *dst, double value);
    /* out = the row normalisation of model/rownorm.h on the last dimension
     * of x, both f32 and contiguous, of one shape (qk_norm's keys on a
     * device; the CPU runs rownorm.c's loops, so the CPU backend has none);
     * scale, unless NULL, gets each row's s (f32, contiguous, one a row). */
    mn_status (*rownorm)(mn_tensor *out, mn_tensor *scale, const mn_tensor *x, bool center, bool sum, double eps);
    /* Its adjoint (rownorm.c's mn_rownorm_vjp): xbar = J(x)^T a from the
     * forward's out (nhat) and scale, xbar, nhat and a of one shape; xbar
     * may be a (qk_norm's key gradients on a device, in place). */
    mn_status (*rownorm_vjp)(mn_tensor *xbar, const mn_tensor *nhat, const mn_tensor *scale, const mn_tensor *a,
                             bool center, bool sum);
    /* Initial weights where they live (model/random_counter.h): dst, f32 and
     * contiguous, gets element e = mn_rc_init_value(kind, scale, seed,
     * stream, period > 0 ? e % period : e). NULL: drawn on the CPU. */
    mn_status (*init_fill)(mn_tensor *dst, int kind, double scale, uint64_t seed, uint64_t stream, int64_t period);
    /* n copies in one go (a memory state's initial tensors, a run's gates:
     * one launch, not one driver call each): dst[i] (f32, contiguous)
     * element e = src[i] (f32, contiguous, of a numel that divides
     * dst[i]'s) element e % numel(src[i]); src[i] is on dst's device, or is
     * one value on the CPU (a fill). n <= MN_TILE_MANY. NULL: callers copy
     * each. */
    mn_status (*tile_many)(int n, mn_tensor *const *dst, const mn_tensor *const *src);
    /* Staged transfers between the host and a device, for big tensors on
     * their way from or to a file: nbytes at the device address dev move in
     * consecutive pieces through the device layer's own page-locked buffers
     * (each at most their size), so that reading the file into one buffer
     * overlaps the copy of the other and no host copy of the whole tensor is
     * ever made. NULL: the device has none (callers copy whole tensors). */
    mn_status (*stage_in)(void *dev, size_t nbytes, const mn_stage_io *io);
    mn_status (*stage_out)(const void *dev, size_t nbytes, const mn_stage_io *io);
} mn_backend;

/* What every backend's tile_many asks of its copies (the count, f32,
 * contiguity, the source's size dividing the destination's), its error
 * naming the copy at fault; where the tensors live is the backend's check. */
mn_status mn_tile_many_check(int n, mn_tensor *const *dst, const mn_tensor *const *src);


void mn_register_backend(mn_device dev, const mn_backend *b);
/* NULL with an error when the device has no backend in this build/machine. */
const mn_backend *mn_backend_for(mn_device dev);

/* ---- additions by the tensor core ---- */
/* The CPU backend (cpu.c); mn_backend_for(MN_CPU) registers it on first use,
 * so no init call is needed. */
const mn_backend *mn_cpu_backend(void);
/* Result dtype of a unary op: the input's, except that i64 goes to f32 for
 * the ops whose values are not integers (exp, log, sqrt, tanh, sigmoid, silu,
 * gelu, softplus). */
mn_dtype mn_unary_dtype(mn_op op, mn_dtype a);
/* Result dtype of mn_reduce_dim: the input's, except i64 mean/norm -> f32. */
mn_dtype mn_reduce_dtype(mn_op op, mn_dtype a);
/* What the front end (ops.c) hands a backend, in detail:
 *   unary, binary: every input already of out's dtype, broadcast views
 *     (stride 0) of out's shape; out fresh and contiguous, never aliasing.
 *   where: a and b of out's dtype; c keeps its own dtype (converting could
 *     turn NaN or 1e-300, both true, into 0).
 *   reduce_dim: a already of out's dtype; a dim of size 0 may arrive for
 *     sum/mean/norm/prod (give 0, NaN, 0, 1); for max/min only when out is
 *     empty too.
 *   argreduce_dim: a of any dtype (out i64); its dim of size 0 only when
 *     out is empty too.
 *   reduce_all: any dtype and strides, never empty.
 *   matmul: a, b and out of one dtype; k may be 0 (out = 0).
 *   copy: dst and src of one device; no overlap (copy_into clones first). */

#endif
