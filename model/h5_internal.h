/* h5_internal.h: what the two files behind model/h5.h share, h5.c
 * (mn_h5_save, and the definitions of what is declared here) and h5_read.c
 * (mn_h5_load): the context of one load or save, the check every HDF5 call
 * goes through and the errors that name the file and the object at hand,
 * that object's path, and the staged transfers of big datasets (ops.h).
 * Only model/h5*.c include it. */
#ifndef MN_H5_INTERNAL_H
#define MN_H5_INTERNAL_H

#include "h5.h"

#include <hdf5.h>

#define H5_PATH_MAX 4096

typedef struct {
    const char *verb;              /* "saving" / "loading" */
    const char *file;              /* as the caller named it */
    char path[H5_PATH_MAX];        /* current group or dataset path */
    size_t plen;
    char where[H5_PATH_MAX + 256]; /* "dataset '/a/b'": what the next call touches */
    hid_t gcpl, lcpl, acpl;        /* save: creation property lists */
    mn_status cb_status;           /* failure recorded inside an iteration callback */
    mn_h5_io *io;                  /* never NULL inside a load or save */
    int writeback_fd;              /* save: the temporary file, for early writeback (-1: none) */
} mn_h5_ctx;

/* An HDF5 call failed: HDF5's innermost message (cleared after), prefixed
 * with the file and cx->where, with our srcfile:line (H5C gives it). */
mn_status mn_h5_fail(mn_h5_ctx *cx, const char *srcfile, int line);
/* A failure that is ours, not HDF5's, about the current `where`. */
mn_status mn_h5_fail_here(mn_h5_ctx *cx, mn_status st, const char *what);
/* Prefix an engine message (out of memory, device copy) with file and object. */
mn_status mn_h5_context(mn_h5_ctx *cx, mn_status st);

/* Check an HDF5 call: every HDF5 id, herr_t and htri_t is negative on failure. */
#define H5C(expr)                                                                \
    do {                                                                         \
        if ((expr) < 0) { st = mn_h5_fail(cx, __FILE__, __LINE__); goto done; }  \
    } while (0)

#define WHERE(...) snprintf(cx->where, sizeof cx->where, __VA_ARGS__)

/* Closing on cleanup paths: the first error is already recorded. */
#define CLOSE(fn, id)                                                            \
    do { if ((id) >= 0) { fn(id); (id) = H5I_INVALID_HID; } } while (0)
/* Closing on the success path, where a failure (a flush) matters. */
#define CLOSE_CHECKED(fn, id)                                                    \
    do { hid_t id_ = (id); (id) = H5I_INVALID_HID; H5C(fn(id_)); } while (0)

/* A load's or save's context (verb "loading" or "saving") at the root
 * group; also turns HDF5's own printing of errors off. */
void mn_h5_ctx_init(mn_h5_ctx *cx, const char *verb, const char *file);
/* Appends name to cx->path, *saved the length mn_h5_path_pop goes back to;
 * a path too long is an error. */
mn_status mn_h5_path_push(mn_h5_ctx *cx, const char *name, size_t *saved);
void mn_h5_path_pop(mn_h5_ctx *cx, size_t saved);

/* The whole of dataset ds to or from t (contiguous, on a device whose
 * backend stages), piece by piece. */
/* Save: starts the disk writes of what the temporary file holds so far,
 * without waiting for them (Linux's sync_file_range; nothing elsewhere),
 * so that the fsync before the rename finds most of a big file on disk. */
void mn_h5_start_writeback(const mn_h5_ctx *cx);

mn_status mn_h5_staged_transfer(mn_h5_ctx *cx, hid_t ds, hid_t mtype, const mn_tensor *t, bool write);
/* Whether a device's backend stages (ops.h). */
bool mn_h5_device_stages(mn_device dev);

#endif
