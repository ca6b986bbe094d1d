/* mn.h: the engine's common ground: status codes, the error message buffer,
 * check macros, dtype and device enums, and the interrupt flag.
 * The engine (model/, kernels/) never knows Lua: every fallible call returns
 * an mn_status and leaves a one-line message in mn_last_error(). */
#ifndef MN_H
#define MN_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define MN_VERSION "0.1.0"

typedef enum {
    MN_OK = 0,
    MN_ERR_ARG,         /* bad input: shapes, names, values, expressions */
    MN_ERR_OOM,         /* out of memory (host or device) */
    MN_ERR_IO,          /* files: HDF5, temporary names, renames */
    MN_ERR_DEVICE,      /* CUDA, cuBLAS, NVRTC, or no device at all */
    MN_ERR_UNSUPPORTED, /* valid request that this build or backend lacks */
    MN_ERR_INTERRUPTED  /* Ctrl-C reached a long loop */
} mn_status;

typedef enum { MN_F32 = 0, MN_F64 = 1, MN_I64 = 2 } mn_dtype;
typedef enum { MN_CPU = 0, MN_CUDA = 1 } mn_device;

/* Record a formatted message and return st. Messages are one line, and name
 * the file, dataset, attribute, argument or expression at fault. */
mn_status mn_fail(mn_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prefix the current message with context ("reading exp.h5: " + old). */
mn_status mn_fail_context(mn_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *mn_last_error(void);
void mn_clear_error(void);

/* Propagate a failure unchanged. */
#define MN_TRY(expr)                                                           \
    do {                                                                       \
        mn_status mn_try_status_ = (expr);                                     \
        if (mn_try_status_ != MN_OK) return mn_try_status_;                    \
    } while (0)

/* Ctrl-C: the REPL's SIGINT handler sets this; long engine loops poll it
 * through mn_check_interrupt() and stop with MN_ERR_INTERRUPTED. */
extern volatile sig_atomic_t mn_interrupt_requested;
mn_status mn_check_interrupt(void);

size_t mn_dtype_size(mn_dtype dt);
const char *mn_dtype_name(mn_dtype dt);   /* "f32", "f64", "i64" */
const char *mn_device_name(mn_device dev); /* "cpu", "cuda" */

/* Allocation that records an out-of-memory message naming what was wanted. */
void *mn_malloc(size_t nbytes, const char *what);
void *mn_calloc(size_t count, size_t size, const char *what);
char *mn_strdup(const char *s);

#endif
