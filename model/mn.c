/* mn.c: the error buffer, interrupt flag and small allocation helpers of mn.h. */
#include "mn.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char error_message[2048];
volatile sig_atomic_t mn_interrupt_requested = 0;

mn_status mn_fail(mn_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_message, sizeof error_message, fmt, ap);
    va_end(ap);
    return st;
}

mn_status mn_fail_context(mn_status st, const char *fmt, ...)
{
    char prefix[1024], old[sizeof error_message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, error_message, sizeof old);
    snprintf(error_message, sizeof error_message, "%.1000s%.1000s", prefix, old);
    return st;
}

const char *mn_last_error(void)
{
    return error_message[0] ? error_message : "unknown error";
}

void mn_clear_error(void) { error_message[0] = 0; }

mn_status mn_check_interrupt(void)
{
    if (!mn_interrupt_requested) return MN_OK;
    mn_interrupt_requested = 0;
    return mn_fail(MN_ERR_INTERRUPTED, "interrupted");
}

size_t mn_dtype_size(mn_dtype dt)
{
    switch (dt) {
    case MN_F32: return 4;
    case MN_F64: return 8;
    case MN_I64: return 8;
    }
    return 0;
}

const char *mn_dtype_name(mn_dtype dt)
{
    switch (dt) {
    case MN_F32: return "f32";
    case MN_F64: return "f64";
    case MN_I64: return "i64";
    }
    return "?";
}

const char *mn_device_name(mn_device dev) { return dev == MN_CUDA ? "cuda" : "cpu"; }

void *mn_malloc(size_t nbytes, const char *what)
{
    void *p = malloc(nbytes ? nbytes : 1);
    if (!p) mn_fail(MN_ERR_OOM, "out of memory allocating %zu bytes for %s", nbytes, what);
    return p;
}

void *mn_calloc(size_t count, size_t size, const char *what)
{
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) mn_fail(MN_ERR_OOM, "out of memory allocating %zu x %zu bytes for %s", count, size, what);
    return p;
}

char *mn_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = mn_malloc(n, "a string");
    if (p) memcpy(p, s, n);
    return p;
}
