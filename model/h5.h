/* h5.h: HDF5 files as trees (tree.h). Groups are groups, tensors are
 * datasets (f32, f64, i64; little-endian, row-major), numbers and strings are
 * attributes of their group. Writing goes to "<path>.tmp-<pid>" and is renamed
 * over path only when complete, so a failed write leaves the old file intact.
 * Every error names the file and the dataset or attribute. */
#ifndef MN_H5_H
#define MN_H5_H

/* Groups nest at most this deep, on read (deeper: a cycle of hard links) and
 * on write (a Lua table nested deeper is refused before any recursion). */
#define MN_H5_MAX_DEPTH 128

#include "tree.h"

mn_status mn_h5_save(const char *path, const mn_node *root);

/* What a load or save moved, and where a load puts big datasets. A dataset
 * is staged when on_device says so for its path ("/inputs/k"), its file
 * type is float32 in the host's byte order (no conversion: f64 and f16
 * datasets load as mn_h5_load does), it holds at least MN_H5_STAGE_MIN
 * bytes and the device's backend stages (ops.h): it then goes from the
 * file to a tensor on device in pieces, with no host copy of the whole.
 * Saving stages the same way every contiguous device tensor of at least
 * MN_H5_STAGE_MIN bytes. Datasets are written contiguous, in one write or
 * one per piece: h5py and mnemo then read each in one pass. */
enum { MN_H5_STAGE_MIN = 1 << 20 };
typedef struct mn_h5_io {
    mn_device device;                   /* load: where staged datasets go */
    bool (*on_device)(const char *path); /* load: NULL stages nothing */
    struct mn_phase_timer *timer;       /* save: marks "write outputs" and "sync, rename"; NULL: none */
    double bytes;                       /* out: dataset bytes read or written */
    double staged_bytes;                /* out: of which staged to or from the device */
} mn_h5_io;
mn_status mn_h5_load_io(const char *path, mn_node **out, mn_h5_io *io);
mn_status mn_h5_save_io(const char *path, const mn_node *root, mn_h5_io *io);

/* While mn_h5_load runs: the file as the caller named it, and what it is
 * reading ("attribute 'loss' of group '/rule'"); NULL otherwise. For a
 * process's SIGSEGV handler: libhdf5 1.10 itself crashes on some damaged
 * files (h5dump too), and the handler can then name the file. */
const char *mn_h5_loading_file(void);
const char *mn_h5_loading_where(void);
/* Reads the whole file. Datasets of other numeric types are converted: floats
 * to f32 (f64 stays f64), integers to i64. Scalar datasets become 0-d
 * tensors. Attributes: integers -> MN_NODE_INTEGER, floats -> MN_NODE_NUMBER,
 * strings (fixed or variable length) -> MN_NODE_STRING; numeric attributes of
 * one element only (others are skipped with no error). */
mn_status mn_h5_load(const char *path, mn_node **out);

#endif
