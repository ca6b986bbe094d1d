/* h5.c: HDF5 files as trees (h5.h): mn_h5_save writes a tree atomically (to
 * "<path>.tmp-<pid>", then rename), mn_h5_load reads a whole file back.
 *
 * Every HDF5 call goes through H5C, which records our file:line and HDF5's own
 * innermost message, prefixed with the file and the dataset, attribute or
 * group at fault; every handle is closed on every path (cleanup at `done:`).
 * HDF5's automatic stderr printing is turned off: the message travels in
 * mn_last_error() like every other engine error.
 *
 * Writing: groups become groups (link and attribute creation order tracked,
 * so a file reads back in the order it was written), tensors become datasets
 * (f32 -> IEEE_F32LE, f64 -> IEEE_F64LE, i64 -> STD_I64LE; 0-d tensors get a
 * scalar dataspace; CUDA and non-contiguous tensors are copied first),
 * integers int64 scalar attributes, numbers float64 scalar attributes,
 * strings variable-length UTF-8 scalar attributes (what h5py writes for str).
 *
 * Reading: groups in creation order when the file tracks it, else name order;
 * for each group its attributes first, then its links. Datasets: floats of
 * <= 4 bytes -> f32, wider floats -> f64, any integer (signed or not) or enum
 * (numpy bool is an enum of int8) -> i64; a dataset holding one string -> a
 * string leaf; other types (compound, opaque, references, string arrays) are
 * an error naming the dataset. Attributes: one numeric element -> integer
 * (integers, enums, bools) or number (floats); one string (fixed or variable
 * length, ASCII or UTF-8) -> string. A numeric attribute with another number
 * of elements becomes a tensor leaf of the group under the attribute's name
 * (the tree has no separate place for attribute arrays), unless the group
 * already has a link of that name; other attributes (string arrays,
 * compound, references) are skipped with no error, and so are the
 * attributes of datasets. Soft and external links are not followed, and
 * named datatypes are skipped. */
#include "h5.h"
#include "ops.h"
#include "phase_timing.h"

#include <hdf5.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
} h5_ctx;

/* The load in progress, for mn_h5_loading (a crash inside libhdf5 can then
 * be named by the process's signal handler). One at a time: HDF5 1.10 is
 * not thread-safe in Debian's build anyway. */
static const h5_ctx *volatile loading_now;

const char *mn_h5_loading_file(void) { const h5_ctx *cx = loading_now; return cx ? cx->file : NULL; }
const char *mn_h5_loading_where(void) { const h5_ctx *cx = loading_now; return cx ? cx->where : NULL; }

/* ---- errors ---- */

static herr_t innermost_cb(unsigned n, const H5E_error2_t *e, void *data)
{
    char *buf = data;
    if (n != 0) return 0;
    if (e->desc && e->desc[0]) {
        snprintf(buf, 512, "%s", e->desc);
    } else {
        H5E_type_t type;
        if (H5Eget_msg(e->min_num, &type, buf, 512) < 0) buf[0] = 0;
    }
    return 0;
}

static mn_status h5_fail(h5_ctx *cx, const char *srcfile, int line)
{
    char msg[512] = "";
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_cb, msg);
    H5Eclear2(H5E_DEFAULT);
    if (!msg[0]) snprintf(msg, sizeof msg, "HDF5 call failed");
    return mn_fail(MN_ERR_IO, "%s '%s': %s: %s [%s:%d]", cx->verb, cx->file, cx->where, msg,
                   srcfile, line);
}

/* A failure that is ours, not HDF5's, about the current `where`. */
static mn_status h5_fail_here(h5_ctx *cx, mn_status st, const char *what)
{
    return mn_fail(st, "%s '%s': %s: %s", cx->verb, cx->file, cx->where, what);
}

/* Prefix an engine message (out of memory, device copy) with file and object. */
static mn_status h5_context(h5_ctx *cx, mn_status st)
{
    return mn_fail_context(st, "%s '%s': %s: ", cx->verb, cx->file, cx->where);
}

/* Check an HDF5 call: every HDF5 id, herr_t and htri_t is negative on failure. */
#define H5C(expr)                                                              \
    do {                                                                       \
        if ((expr) < 0) { st = h5_fail(cx, __FILE__, __LINE__); goto done; }   \
    } while (0)

#define WHERE(...) snprintf(cx->where, sizeof cx->where, __VA_ARGS__)

/* Closing on cleanup paths: the first error is already recorded. */
#define CLOSE(fn, id)                                                          \
    do { if ((id) >= 0) { fn(id); (id) = H5I_INVALID_HID; } } while (0)
/* Closing on the success path, where a failure (a flush) matters. */
#define CLOSE_CHECKED(fn, id)                                                  \
    do { hid_t id_ = (id); (id) = H5I_INVALID_HID; H5C(fn(id_)); } while (0)

/* ---- paths ---- */

static mn_status path_push(h5_ctx *cx, const char *name, size_t *saved)
{
    size_t n = strlen(name);
    bool at_root = cx->plen == 1;
    *saved = cx->plen;
    if (cx->plen + n + 2 > sizeof cx->path)
        return mn_fail(MN_ERR_ARG, "%s '%s': path '%s/%s' is too long", cx->verb, cx->file,
                       cx->path, name);
    if (!at_root) cx->path[cx->plen++] = '/';
    memcpy(cx->path + cx->plen, name, n + 1);
    cx->plen += n;
    return MN_OK;
}

static void path_pop(h5_ctx *cx, size_t saved)
{
    cx->plen = saved;
    cx->path[saved] = 0;
}

static void ctx_init(h5_ctx *cx, const char *verb, const char *file)
{
    memset(cx, 0, sizeof *cx);
    cx->verb = verb;
    cx->file = file;
    cx->path[0] = '/';
    cx->path[1] = 0;
    cx->plen = 1;
    snprintf(cx->where, sizeof cx->where, "file");
    cx->gcpl = cx->lcpl = cx->acpl = H5I_INVALID_HID;
    /* Our checks report errors; HDF5 printing its stack to stderr would only
     * duplicate them (and interleave with the REPL). */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

/* ---- staged datasets: pieces that end on rows ----
 * A staged transfer (ops.h) moves a contiguous dataset in pieces of at most
 * the device layer's buffer size. Each piece is one box of the dataspace,
 * so that it is one hyperslab and one contiguous range of the file: the
 * split dim is the outermost one whose rows (all the dims after it) fit a
 * buffer; a piece holds whole rows of it, at one index of the dims before. */

typedef struct {
    h5_ctx *cx;
    hid_t ds, fspace;
    hid_t mtype;
    bool write;
    int ndim;
    int64_t shape[MN_MAX_DIMS];
    size_t esize;
    int split;          /* -1 until the first piece */
    int64_t row;        /* elements in one row of the split dim */
    bool move_failed;   /* the error names the file already */
} staged;

static size_t staged_piece(void *ctx, size_t offset, size_t capacity)
{
    staged *sp = ctx;
    if (sp->split < 0) {
        int j = sp->ndim - 1;
        int64_t row = 1;
        while (j > 0 && (size_t)(row * sp->shape[j]) * sp->esize <= capacity) row *= sp->shape[j--];
        sp->split = j;
        sp->row = row;
    }
    size_t row_bytes = (size_t)sp->row * sp->esize;
    if (row_bytes > capacity) return 0; /* one element is larger than a buffer: refused by the caller */
    int64_t r = (int64_t)(offset / row_bytes); /* rows of the split dim before offset */
    int64_t at = r % sp->shape[sp->split];
    int64_t rows = (int64_t)(capacity / row_bytes);
    if (rows > sp->shape[sp->split] - at) rows = sp->shape[sp->split] - at;
    return (size_t)rows * row_bytes;
}

static mn_status staged_move(void *ctx, size_t offset, size_t nbytes, void *host)
{
    staged *sp = ctx;
    h5_ctx *cx = sp->cx;
    mn_status st = MN_OK;
    hid_t mspace = H5I_INVALID_HID;
    hsize_t start[MN_MAX_DIMS], count[MN_MAX_DIMS], n = nbytes / sp->esize;
    size_t row_bytes = (size_t)sp->row * sp->esize;
    int64_t r = (int64_t)(offset / row_bytes);
    for (int d = sp->ndim - 1; d >= 0; d--) {
        if (d > sp->split) {
            start[d] = 0;
            count[d] = (hsize_t)sp->shape[d];
        } else {
            start[d] = (hsize_t)(r % sp->shape[d]);
            count[d] = d == sp->split ? (hsize_t)(nbytes / row_bytes) : 1;
            r /= sp->shape[d];
        }
    }
    H5C(H5Sselect_hyperslab(sp->fspace, H5S_SELECT_SET, start, NULL, count, NULL));
    H5C(mspace = H5Screate_simple(1, &n, NULL));
    if (sp->write) H5C(H5Dwrite(sp->ds, sp->mtype, mspace, sp->fspace, H5P_DEFAULT, host));
    else H5C(H5Dread(sp->ds, sp->mtype, mspace, sp->fspace, H5P_DEFAULT, host));
done:
    CLOSE(H5Sclose, mspace);
    if (st != MN_OK) sp->move_failed = true;
    return st;
}

/* The whole of dataset ds to or from t (contiguous, on a device whose
 * backend stages), piece by piece. */
static mn_status staged_transfer(h5_ctx *cx, hid_t ds, hid_t mtype, const mn_tensor *t, bool write)
{
    mn_status st = MN_OK;
    const mn_backend *be = mn_backend_for(t->storage->device);
    staged sp = {.cx = cx, .ds = ds, .fspace = H5I_INVALID_HID, .mtype = mtype, .write = write,
                 .ndim = t->ndim, .esize = mn_dtype_size(t->dtype), .split = -1};
    memcpy(sp.shape, t->shape, sizeof sp.shape);
    mn_stage_io io = {staged_piece, staged_move, &sp};
    size_t nbytes = (size_t)mn_tensor_numel(t) * sp.esize;
    if (!be || !be->stage_in || !be->stage_out || t->ndim < 1) return h5_fail_here(cx, MN_ERR_ARG, "no staged transfer here");
    H5C(sp.fspace = H5Dget_space(ds));
    st = write ? be->stage_out(mn_tensor_data(t), nbytes, &io) : be->stage_in(mn_tensor_data(t), nbytes, &io);
    if (st != MN_OK && !sp.move_failed) h5_context(cx, st);
    if (st == MN_OK) cx->io->staged_bytes += (double)nbytes;
done:
    CLOSE(H5Sclose, sp.fspace);
    return st;
}

/* Whether a device's backend stages (ops.h). */
static bool device_stages(mn_device dev)
{
    if (dev == MN_CPU) return false;
    const mn_backend *be = mn_backend_for(dev);
    if (!be) mn_clear_error();
    return be && be->stage_in && be->stage_out;
}

/* ===================================================================== */
/* Writing                                                               */
/* ===================================================================== */

static mn_status write_group(h5_ctx *cx, hid_t gid, const mn_node *g);

static mn_status write_attr(h5_ctx *cx, hid_t gid, const mn_node *n)
{
    mn_status st = MN_OK;
    hid_t space = H5I_INVALID_HID, attr = H5I_INVALID_HID, type = H5I_INVALID_HID;

    H5C(space = H5Screate(H5S_SCALAR));
    switch (n->kind) {
    case MN_NODE_INTEGER:
        H5C(attr = H5Acreate2(gid, n->name, H5T_STD_I64LE, space, cx->acpl, H5P_DEFAULT));
        H5C(H5Awrite(attr, H5T_NATIVE_INT64, &n->integer));
        break;
    case MN_NODE_NUMBER:
        H5C(attr = H5Acreate2(gid, n->name, H5T_IEEE_F64LE, space, cx->acpl, H5P_DEFAULT));
        H5C(H5Awrite(attr, H5T_NATIVE_DOUBLE, &n->number));
        break;
    case MN_NODE_STRING: {
        const char *s = n->string ? n->string : "";
        H5C(type = H5Tcopy(H5T_C_S1));
        H5C(H5Tset_size(type, H5T_VARIABLE));
        H5C(H5Tset_cset(type, H5T_CSET_UTF8));
        H5C(attr = H5Acreate2(gid, n->name, type, space, cx->acpl, H5P_DEFAULT));
        H5C(H5Awrite(attr, type, &s));
        break;
    }
    default:
        st = h5_fail_here(cx, MN_ERR_ARG, "not an attribute kind");
        goto done;
    }
    CLOSE_CHECKED(H5Aclose, attr);
done:
    CLOSE(H5Aclose, attr);
    CLOSE(H5Tclose, type);
    CLOSE(H5Sclose, space);
    return st;
}

static mn_status write_dataset(h5_ctx *cx, hid_t gid, const mn_node *n)
{
    mn_status st = MN_OK;
    mn_tensor host = {0}, dense = {0};
    const mn_tensor *t = &n->tensor;
    hid_t space = H5I_INVALID_HID, ds = H5I_INVALID_HID, dcpl = H5I_INVALID_HID, ftype, mtype;
    hsize_t dims[MN_MAX_DIMS];

    if (!t->storage) {
        st = h5_fail_here(cx, MN_ERR_ARG, "the tensor has been released (no storage)");
        goto done;
    }
    if (t->ndim < 0 || t->ndim > MN_MAX_DIMS) {
        st = h5_fail_here(cx, MN_ERR_ARG, "the tensor has a bad number of dimensions");
        goto done;
    }
    switch (t->dtype) {
    case MN_F32: ftype = H5T_IEEE_F32LE; mtype = H5T_NATIVE_FLOAT; break;
    case MN_F64: ftype = H5T_IEEE_F64LE; mtype = H5T_NATIVE_DOUBLE; break;
    case MN_I64: ftype = H5T_STD_I64LE; mtype = H5T_NATIVE_INT64; break;
    default:
        st = h5_fail_here(cx, MN_ERR_ARG, "unknown tensor dtype");
        goto done;
    }
    size_t nbytes = (size_t)mn_tensor_numel(t) * mn_dtype_size(t->dtype);
    if (t->storage->device != MN_CPU && t->ndim >= 1 && nbytes >= MN_H5_STAGE_MIN && mn_tensor_is_contiguous(t) &&
        device_stages(t->storage->device)) {
        /* Straight from the device, piece by piece. The file gets no fill
         * values first: every element is written. */
        for (int i = 0; i < t->ndim; i++) dims[i] = (hsize_t)t->shape[i];
        H5C(space = H5Screate_simple(t->ndim, dims, NULL));
        H5C(dcpl = H5Pcreate(H5P_DATASET_CREATE));
        H5C(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
        H5C(ds = H5Dcreate2(gid, n->name, ftype, space, cx->lcpl, dcpl, H5P_DEFAULT));
        if ((st = staged_transfer(cx, ds, mtype, t, true)) != MN_OK) goto done;
        cx->io->bytes += (double)nbytes;
        CLOSE_CHECKED(H5Dclose, ds);
        goto done;
    }
    if (t->storage->device != MN_CPU) {
        if ((st = mn_tensor_to_device(&host, t, MN_CPU)) != MN_OK) {
            h5_context(cx, st);
            goto done;
        }
        t = &host;
    }
    if ((st = mn_tensor_contiguous(&dense, t)) != MN_OK) {
        h5_context(cx, st);
        goto done;
    }
    for (int i = 0; i < dense.ndim; i++) dims[i] = (hsize_t)dense.shape[i];

    if (dense.ndim == 0) H5C(space = H5Screate(H5S_SCALAR));
    else H5C(space = H5Screate_simple(dense.ndim, dims, NULL));
    H5C(ds = H5Dcreate2(gid, n->name, ftype, space, cx->lcpl, H5P_DEFAULT, H5P_DEFAULT));
    if (mn_tensor_numel(&dense) > 0)
        H5C(H5Dwrite(ds, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, mn_tensor_data(&dense)));
    cx->io->bytes += (double)nbytes;
    CLOSE_CHECKED(H5Dclose, ds);
done:
    CLOSE(H5Dclose, ds);
    CLOSE(H5Pclose, dcpl);
    CLOSE(H5Sclose, space);
    mn_tensor_release(&dense);
    mn_tensor_release(&host);
    return st;
}

static mn_status write_child(h5_ctx *cx, hid_t gid, const mn_node *c)
{
    mn_status st = MN_OK;
    hid_t sub = H5I_INVALID_HID;
    size_t saved;
    char group_path[H5_PATH_MAX];

    if (!c->name || !c->name[0] || strchr(c->name, '/')) {
        WHERE("group '%s'", cx->path);
        char what[600];
        snprintf(what, sizeof what, "child name '%.500s' is not valid (empty or contains '/')",
                 c->name ? c->name : "(null)");
        return h5_fail_here(cx, MN_ERR_ARG, what);
    }
    memcpy(group_path, cx->path, cx->plen + 1);
    if ((st = path_push(cx, c->name, &saved)) != MN_OK) return st;
    switch (c->kind) {
    case MN_NODE_GROUP:
        WHERE("group '%s'", cx->path);
        H5C(sub = H5Gcreate2(gid, c->name, cx->lcpl, cx->gcpl, H5P_DEFAULT));
        if ((st = write_group(cx, sub, c)) != MN_OK) goto done;
        WHERE("group '%s'", cx->path);
        CLOSE_CHECKED(H5Gclose, sub);
        break;
    case MN_NODE_TENSOR:
        WHERE("dataset '%s'", cx->path);
        st = write_dataset(cx, gid, c);
        break;
    case MN_NODE_NUMBER:
    case MN_NODE_INTEGER:
    case MN_NODE_STRING:
        WHERE("attribute '%s' of group '%s'", c->name, group_path);
        st = write_attr(cx, gid, c);
        break;
    default:
        WHERE("'%s'", cx->path);
        st = h5_fail_here(cx, MN_ERR_ARG, "unknown node kind");
        break;
    }
done:
    CLOSE(H5Gclose, sub);
    path_pop(cx, saved);
    return st;
}

static mn_status write_group(h5_ctx *cx, hid_t gid, const mn_node *g)
{
    for (int i = 0; i < g->nchildren; i++) {
        if (mn_check_interrupt() != MN_OK)
            return mn_fail_context(MN_ERR_INTERRUPTED, "%s '%s': ", cx->verb, cx->file);
        MN_TRY(write_child(cx, gid, g->children[i]));
    }
    return MN_OK;
}

/* The directory part of path must exist: HDF5's own message for that case
 * ("unable to open file ... errno = 2") is much less clear. */
static mn_status check_target(const char *path)
{
    struct stat sb;
    const char *slash = strrchr(path, '/');
    if (slash) {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        char *dir = mn_malloc(n + 1, "a directory name");
        if (!dir) return MN_ERR_OOM;
        memcpy(dir, path, n);
        dir[n] = 0;
        mn_status st = MN_OK;
        if (stat(dir, &sb) != 0) {
            st = errno == ENOENT || errno == ENOTDIR
                ? mn_fail(MN_ERR_IO, "saving '%s': directory '%s' does not exist", path, dir)
                : mn_fail(MN_ERR_IO, "saving '%s': directory '%s': %s", path, dir, strerror(errno));
        } else if (!S_ISDIR(sb.st_mode)) {
            st = mn_fail(MN_ERR_IO, "saving '%s': '%s' is not a directory", path, dir);
        }
        free(dir);
        if (st != MN_OK) return st;
    }
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return mn_fail(MN_ERR_IO, "saving '%s': it is a directory", path);
    return MN_OK;
}

/* Make the finished temporary file durable before it replaces the old one. */
static mn_status sync_file(const char *path, const char *tmp)
{
    int fd = open(tmp, O_RDONLY);
    if (fd < 0) return mn_fail(MN_ERR_IO, "saving '%s': reopening '%s': %s", path, tmp, strerror(errno));
    int r = fsync(fd);
    int err = errno;
    close(fd);
    if (r != 0 && err != EINVAL && err != EROFS) /* some filesystems cannot sync */
        return mn_fail(MN_ERR_IO, "saving '%s': syncing '%s': %s", path, tmp, strerror(err));
    return MN_OK;
}

mn_status mn_h5_save(const char *path, const mn_node *root) { return mn_h5_save_io(path, root, NULL); }

mn_status mn_h5_save_io(const char *path, const mn_node *root, mn_h5_io *io)
{
    mn_h5_io none = {0};
    h5_ctx ctx, *cx = &ctx;
    mn_status st = MN_OK;
    hid_t fapl = H5I_INVALID_HID, fcpl = H5I_INVALID_HID, file = H5I_INVALID_HID,
          rootg = H5I_INVALID_HID;
    char *tmp = NULL;
    bool created = false;

    if (!path || !path[0]) return mn_fail(MN_ERR_ARG, "saving: empty file name");
    ctx_init(cx, "saving", path);
    cx->io = io ? io : &none;
    if (!root || root->kind != MN_NODE_GROUP)
        return mn_fail(MN_ERR_ARG, "saving '%s': the root of the tree must be a group", path);
    MN_TRY(check_target(path));

    size_t tlen = strlen(path) + 32;
    if (!(tmp = mn_malloc(tlen, "a temporary file name"))) return MN_ERR_OOM;
    snprintf(tmp, tlen, "%s.tmp-%ld", path, (long)getpid());

    WHERE("property lists");
    unsigned order = H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED;
    H5C(fapl = H5Pcreate(H5P_FILE_ACCESS));
    /* Closing the file closes anything still open in it, so that an error
     * path can never keep the temporary file half-open. */
    H5C(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG));
    H5C(fcpl = H5Pcreate(H5P_FILE_CREATE));
    H5C(H5Pset_link_creation_order(fcpl, order));
    H5C(H5Pset_attr_creation_order(fcpl, order));
    H5C(cx->gcpl = H5Pcreate(H5P_GROUP_CREATE));
    H5C(H5Pset_link_creation_order(cx->gcpl, order));
    H5C(H5Pset_attr_creation_order(cx->gcpl, order));
    /* Keep up to 64 attributes in compact storage: HDF5 1.10 (Debian 12)
     * crashes when H5Ocopy (h5py's Group.copy) copies string attributes
     * held in dense storage, which starts at 9 attributes by default. */
    H5C(H5Pset_attr_phase_change(cx->gcpl, 64, 48));
    H5C(H5Pset_attr_phase_change(fcpl, 64, 48));
    H5C(cx->lcpl = H5Pcreate(H5P_LINK_CREATE));
    H5C(H5Pset_char_encoding(cx->lcpl, H5T_CSET_UTF8));
    H5C(cx->acpl = H5Pcreate(H5P_ATTRIBUTE_CREATE));
    H5C(H5Pset_char_encoding(cx->acpl, H5T_CSET_UTF8));

    WHERE("creating temporary file '%s'", tmp);
    H5C(file = H5Fcreate(tmp, H5F_ACC_TRUNC, fcpl, fapl));
    created = true;
    WHERE("group '/'");
    H5C(rootg = H5Gopen2(file, "/", H5P_DEFAULT));
    if ((st = write_group(cx, rootg, root)) != MN_OK) goto done;
    WHERE("group '/'");
    CLOSE_CHECKED(H5Gclose, rootg);
    WHERE("closing temporary file '%s'", tmp);
    CLOSE_CHECKED(H5Fclose, file);
    mn_phase_mark(cx->io->timer, "write outputs", cx->io->bytes);
    if (cx->io->staged_bytes > 0)
        mn_phase_note(cx->io->timer, "%.1f MB of it downloaded while writing", cx->io->staged_bytes / 1e6);
    if ((st = sync_file(path, tmp)) != MN_OK) goto done;
    if (rename(tmp, path) != 0) {
        st = mn_fail(MN_ERR_IO, "saving '%s': renaming '%s' over it: %s", path, tmp,
                     strerror(errno));
        goto done;
    }
    created = false;
    mn_phase_mark(cx->io->timer, "sync, rename", 0);
done:
    CLOSE(H5Gclose, rootg);
    CLOSE(H5Fclose, file);
    CLOSE(H5Pclose, fapl);
    CLOSE(H5Pclose, fcpl);
    CLOSE(H5Pclose, cx->gcpl);
    CLOSE(H5Pclose, cx->lcpl);
    CLOSE(H5Pclose, cx->acpl);
    if (created) remove(tmp);
    free(tmp);
    H5Eclear2(H5E_DEFAULT);
    return st;
}

/* ===================================================================== */
/* Reading                                                               */
/* ===================================================================== */

static const char *class_name(H5T_class_t c)
{
    switch (c) {
    case H5T_INTEGER: return "integer";
    case H5T_FLOAT: return "float";
    case H5T_TIME: return "time";
    case H5T_STRING: return "string";
    case H5T_BITFIELD: return "bitfield";
    case H5T_OPAQUE: return "opaque";
    case H5T_COMPOUND: return "compound";
    case H5T_REFERENCE: return "reference";
    case H5T_ENUM: return "enum";
    case H5T_VLEN: return "variable-length sequence";
    case H5T_ARRAY: return "array";
    default: return "unknown";
    }
}

static bool class_is_numeric(H5T_class_t c)
{
    return c == H5T_INTEGER || c == H5T_FLOAT || c == H5T_ENUM;
}

/* Read all n elements of a dataset (is_attr false) or attribute into buf, as
 * dtype dt (floats) or i64 (integers, enums). */
static mn_status read_numeric(h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype,
                              H5T_class_t cls, mn_dtype dt, size_t n, void *buf)
{
    mn_status st = MN_OK;
    hid_t mem = H5I_INVALID_HID, super = H5I_INVALID_HID;
    bool own = false;

    if (cls == H5T_ENUM) {
        /* HDF5 converts enums only to enums: read the native enum (its
         * values are native integers of the base size), then widen them
         * in place; buf holds n int64, wide enough for the base type. */
        H5C(mem = H5Tget_native_type(ftype, H5T_DIR_ASCEND));
        H5C(super = H5Tget_super(mem));
        own = true;
    } else {
        mem = dt == MN_F32 ? H5T_NATIVE_FLOAT : dt == MN_F64 ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64;
    }
    if (is_attr) H5C(H5Aread(obj, mem, buf));
    else H5C(H5Dread(obj, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf));
    if (cls == H5T_ENUM) H5C(H5Tconvert(super, H5T_NATIVE_INT64, n, buf, NULL, H5P_DEFAULT));
done:
    if (own) {
        CLOSE(H5Tclose, super);
        CLOSE(H5Tclose, mem);
    }
    return st;
}

/* One string (fixed or variable length, any character set) from a dataset or
 * attribute of one element. */
static mn_status read_string(h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype, char **out)
{
    mn_status st = MN_OK;
    hid_t mem = H5I_INVALID_HID;
    htri_t vlen;
    H5T_cset_t cset;
    char *vs = NULL, *buf = NULL;

    *out = NULL;
    H5C(vlen = H5Tis_variable_str(ftype));
    H5C(cset = H5Tget_cset(ftype));
    H5C(mem = H5Tcopy(H5T_C_S1));
    H5C(H5Tset_cset(mem, cset)); /* HDF5 does not convert between character sets */
    if (vlen) {
        H5C(H5Tset_size(mem, H5T_VARIABLE));
        if (is_attr) H5C(H5Aread(obj, mem, &vs));
        else H5C(H5Dread(obj, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, &vs));
        if (!(*out = mn_strdup(vs ? vs : ""))) st = h5_context(cx, MN_ERR_OOM);
    } else {
        size_t size = H5Tget_size(ftype);
        if (size == 0) {
            st = h5_fail(cx, __FILE__, __LINE__);
            goto done;
        }
        H5C(H5Tset_size(mem, size + 1));
        H5C(H5Tset_strpad(mem, H5T_STR_NULLTERM));
        if (!(buf = mn_malloc(size + 1, "a string"))) {
            st = h5_context(cx, MN_ERR_OOM);
            goto done;
        }
        if (is_attr) H5C(H5Aread(obj, mem, buf));
        else H5C(H5Dread(obj, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf));
        buf[size] = 0;
        *out = buf;
        buf = NULL;
    }
done:
    if (vs) H5free_memory(vs);
    free(buf);
    CLOSE(H5Tclose, mem);
    return st;
}

/* Shape of a dataspace: scalar -> 0-d, null -> {0}, simple -> its dims. */
static mn_status space_shape(h5_ctx *cx, hid_t space, int *ndim, int64_t *shape)
{
    mn_status st = MN_OK;
    H5S_class_t sc;
    int nd;
    hsize_t dims[H5S_MAX_RANK];

    H5C(sc = H5Sget_simple_extent_type(space));
    if (sc == H5S_SCALAR) { *ndim = 0; return MN_OK; }
    if (sc == H5S_NULL) { *ndim = 1; shape[0] = 0; return MN_OK; }
    H5C(nd = H5Sget_simple_extent_ndims(space));
    if (nd > MN_MAX_DIMS) {
        char what[128];
        snprintf(what, sizeof what, "%d dimensions, more than the %d a tensor can have", nd,
                 MN_MAX_DIMS);
        return h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
    }
    H5C(H5Sget_simple_extent_dims(space, dims, NULL));
    *ndim = nd;
    for (int i = 0; i < nd; i++) shape[i] = (int64_t)dims[i];
done:
    return st;
}

static mn_dtype dtype_for(H5T_class_t cls, size_t size)
{
    if (cls == H5T_FLOAT) return size <= 4 ? MN_F32 : MN_F64;
    return MN_I64;
}

/* Whether the dataset being read goes straight to the device (h5.h). */
static bool staged_here(h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype, int ndim, const int64_t *shape)
{
    if (is_attr || !cx->io->on_device || ndim < 1 || !cx->io->on_device(cx->path)) return false;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    if ((double)n * 4 < MN_H5_STAGE_MIN) return false;
    /* Contiguous only: pieces of a chunked (compressed) dataset could cut
     * its chunks, and a chunk cut in two is read and inflated twice. */
    hid_t dcpl = H5Dget_create_plist(obj);
    H5D_layout_t layout = dcpl >= 0 ? H5Pget_layout(dcpl) : H5D_LAYOUT_ERROR;
    if (dcpl >= 0) H5Pclose(dcpl);
    htri_t same = H5Tequal(ftype, H5T_NATIVE_FLOAT);
    H5Eclear2(H5E_DEFAULT); /* a failed query means no: the plain read says why, if it fails too */
    return layout == H5D_CONTIGUOUS && same > 0 && device_stages(cx->io->device);
}

/* A numeric dataset or attribute array as a tensor leaf of g. */
static mn_status read_tensor_leaf(h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype,
                                  H5T_class_t cls, hid_t space, mn_node *g, const char *name)
{
    mn_status st;
    mn_tensor t = {0};
    int ndim = 0;
    int64_t shape[MN_MAX_DIMS];
    size_t size = H5Tget_size(ftype);

    if (size == 0) return h5_fail(cx, __FILE__, __LINE__);
    MN_TRY(space_shape(cx, space, &ndim, shape));
    mn_dtype dt = dtype_for(cls, size);
    mn_device dev = staged_here(cx, obj, is_attr, ftype, ndim, shape) ? cx->io->device : MN_CPU;
    if ((st = mn_tensor_empty(&t, dt, ndim, shape, dev)) != MN_OK) return h5_context(cx, st);
    int64_t n = mn_tensor_numel(&t);
    if (dev != MN_CPU) st = staged_transfer(cx, obj, H5T_NATIVE_FLOAT, &t, false);
    else if (n > 0) st = read_numeric(cx, obj, is_attr, ftype, cls, dt, (size_t)n, mn_tensor_data(&t));
    if (st == MN_OK && !is_attr) cx->io->bytes += (double)n * (double)mn_dtype_size(dt);
    if (st == MN_OK && !mn_node_add_tensor(g, name, &t))
        st = h5_fail_here(cx, MN_ERR_OOM, "out of memory");
    mn_tensor_release(&t);
    return st;
}

static mn_status read_attr(h5_ctx *cx, hid_t gid, const char *name, mn_node *g)
{
    mn_status st = MN_OK;
    hid_t attr = H5I_INVALID_HID, type = H5I_INVALID_HID, space = H5I_INVALID_HID;
    H5T_class_t cls;
    H5S_class_t sc;
    hssize_t npoints;
    mn_node *leaf = NULL;
    char *s = NULL;

    WHERE("attribute '%s' of group '%s'", name, cx->path);
    H5C(attr = H5Aopen(gid, name, H5P_DEFAULT));
    H5C(type = H5Aget_type(attr));
    H5C(space = H5Aget_space(attr));
    H5C(cls = H5Tget_class(type));
    H5C(sc = H5Sget_simple_extent_type(space));
    H5C(npoints = H5Sget_simple_extent_npoints(space));
    bool one = sc != H5S_NULL && npoints == 1;

    if (cls == H5T_STRING) {
        if (!one) goto done; /* string arrays: no place in the tree */
        if ((st = read_string(cx, attr, true, type, &s)) != MN_OK) goto done;
        leaf = mn_node_add_string(g, name, s);
    } else if (class_is_numeric(cls) && one) {
        if (cls == H5T_FLOAT) {
            double v;
            H5C(H5Aread(attr, H5T_NATIVE_DOUBLE, &v));
            leaf = mn_node_add_number(g, name, v);
        } else {
            int64_t v;
            if ((st = read_numeric(cx, attr, true, type, cls, MN_I64, 1, &v)) != MN_OK) goto done;
            leaf = mn_node_add_integer(g, name, v);
        }
    } else if (class_is_numeric(cls)) {
        htri_t clash = 0;
        /* A link of the same name wins; a name with '/' would be a path. */
        if (strchr(name, '/')) goto done;
        H5C(clash = H5Lexists(gid, name, H5P_DEFAULT));
        if (clash) goto done;
        st = read_tensor_leaf(cx, attr, true, type, cls, space, g, name);
        goto done;
    } else {
        goto done; /* compound, references, ...: skipped (h5.h) */
    }
    if (!leaf) st = h5_fail_here(cx, MN_ERR_OOM, "out of memory");
done:
    free(s);
    CLOSE(H5Sclose, space);
    CLOSE(H5Tclose, type);
    CLOSE(H5Aclose, attr);
    return st;
}

typedef struct {
    h5_ctx *cx;
    mn_node *g;
} attr_iter;

static herr_t attr_cb(hid_t loc, const char *name, const H5A_info_t *info, void *data)
{
    attr_iter *it = data;
    (void)info;
    it->cx->cb_status = read_attr(it->cx, loc, name, it->g);
    return it->cx->cb_status == MN_OK ? 0 : -1;
}

static mn_status read_dataset(h5_ctx *cx, hid_t ds, mn_node *g, const char *name)
{
    mn_status st = MN_OK;
    hid_t type = H5I_INVALID_HID, space = H5I_INVALID_HID;
    H5T_class_t cls;
    hssize_t npoints;
    char *s = NULL;

    WHERE("dataset '%s'", cx->path);
    H5C(type = H5Dget_type(ds));
    H5C(space = H5Dget_space(ds));
    H5C(cls = H5Tget_class(type));
    if (class_is_numeric(cls)) {
        st = read_tensor_leaf(cx, ds, false, type, cls, space, g, name);
    } else if (cls == H5T_STRING) {
        H5S_class_t sc;
        H5C(sc = H5Sget_simple_extent_type(space));
        H5C(npoints = H5Sget_simple_extent_npoints(space));
        if (npoints != 1 || sc == H5S_NULL) {
            char what[160];
            snprintf(what, sizeof what,
                     "a string dataset of %lld elements (only single strings are supported)",
                     (long long)npoints);
            st = h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
            goto done;
        }
        if ((st = read_string(cx, ds, false, type, &s)) != MN_OK) goto done;
        if (!mn_node_add_string(g, name, s)) st = h5_fail_here(cx, MN_ERR_OOM, "out of memory");
    } else {
        char what[128];
        snprintf(what, sizeof what, "unsupported datatype (%s)", class_name(cls));
        st = h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
    }
done:
    free(s);
    CLOSE(H5Sclose, space);
    CLOSE(H5Tclose, type);
    return st;
}

static mn_status read_group(h5_ctx *cx, hid_t gid, mn_node *g, int depth);

static mn_status read_link(h5_ctx *cx, hid_t gid, const char *name, mn_node *g, int depth)
{
    mn_status st = MN_OK;
    hid_t obj = H5I_INVALID_HID;
    H5L_info_t li;
    H5I_type_t it;
    size_t saved;

    MN_TRY(path_push(cx, name, &saved));
    WHERE("link '%s'", cx->path);
    H5C(H5Lget_info(gid, name, &li, H5P_DEFAULT));
    if (li.type != H5L_TYPE_HARD) goto done; /* soft and external links: not followed */
    H5C(obj = H5Oopen(gid, name, H5P_DEFAULT));
    H5C(it = H5Iget_type(obj));
    if (it == H5I_GROUP) {
        WHERE("group '%s'", cx->path);
        if (depth + 1 > MN_H5_MAX_DEPTH) {
            st = h5_fail_here(cx, MN_ERR_UNSUPPORTED,
                              "groups nested too deeply (a cycle of hard links?)");
            goto done;
        }
        mn_node *child = mn_node_add_group(g, name);
        if (!child) {
            st = h5_fail_here(cx, MN_ERR_OOM, "out of memory");
            goto done;
        }
        st = read_group(cx, obj, child, depth + 1);
    } else if (it == H5I_DATASET) {
        st = read_dataset(cx, obj, g, name);
    } /* named datatypes: skipped */
done:
    CLOSE(H5Oclose, obj);
    path_pop(cx, saved);
    return st;
}

static mn_status read_group(h5_ctx *cx, hid_t gid, mn_node *g, int depth)
{
    mn_status st = MN_OK;
    hid_t gcpl = H5I_INVALID_HID;
    unsigned lorder = 0, aorder = 0;
    H5G_info_t info;
    char *name = NULL;

    WHERE("group '%s'", cx->path);
    H5C(gcpl = H5Gget_create_plist(gid));
    H5C(H5Pget_link_creation_order(gcpl, &lorder));
    H5C(H5Pget_attr_creation_order(gcpl, &aorder));
    H5_index_t lidx = (lorder & H5P_CRT_ORDER_INDEXED) ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME;
    H5_index_t aidx = (aorder & H5P_CRT_ORDER_INDEXED) ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME;

    attr_iter ai = {cx, g};
    hsize_t pos = 0;
    cx->cb_status = MN_OK;
    if (H5Aiterate2(gid, aidx, H5_ITER_INC, &pos, attr_cb, &ai) < 0) {
        st = cx->cb_status != MN_OK ? cx->cb_status : h5_fail(cx, __FILE__, __LINE__);
        H5Eclear2(H5E_DEFAULT);
        goto done;
    }

    WHERE("group '%s'", cx->path);
    H5C(H5Gget_info(gid, &info));
    for (hsize_t i = 0; i < info.nlinks; i++) {
        ssize_t len;
        if ((st = mn_check_interrupt()) != MN_OK) {
            mn_fail_context(st, "%s '%s': ", cx->verb, cx->file);
            goto done;
        }
        WHERE("group '%s'", cx->path);
        H5C(len = H5Lget_name_by_idx(gid, ".", lidx, H5_ITER_INC, i, NULL, 0, H5P_DEFAULT));
        if (!(name = mn_malloc((size_t)len + 1, "a link name"))) {
            st = h5_context(cx, MN_ERR_OOM);
            goto done;
        }
        H5C(H5Lget_name_by_idx(gid, ".", lidx, H5_ITER_INC, i, name, (size_t)len + 1,
                               H5P_DEFAULT));
        if ((st = read_link(cx, gid, name, g, depth)) != MN_OK) goto done;
        free(name);
        name = NULL;
    }
done:
    free(name);
    CLOSE(H5Pclose, gcpl);
    return st;
}

mn_status mn_h5_load(const char *path, mn_node **out) { return mn_h5_load_io(path, out, NULL); }

mn_status mn_h5_load_io(const char *path, mn_node **out, mn_h5_io *io)
{
    mn_h5_io none = {0};
    h5_ctx ctx, *cx = &ctx;
    mn_status st = MN_OK;
    hid_t fapl = H5I_INVALID_HID, file = H5I_INVALID_HID, rootg = H5I_INVALID_HID;
    mn_node *root = NULL;
    struct stat sb;
    htri_t is_h5;

    *out = NULL;
    if (!path || !path[0]) return mn_fail(MN_ERR_ARG, "loading: empty file name");
    ctx_init(cx, "loading", path);
    cx->io = io ? io : &none;
    if (stat(path, &sb) != 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return mn_fail(MN_ERR_IO, "loading '%s': no such file", path);
        return mn_fail(MN_ERR_IO, "loading '%s': %s", path, strerror(errno));
    }
    if (S_ISDIR(sb.st_mode)) return mn_fail(MN_ERR_IO, "loading '%s': it is a directory", path);
    WHERE("checking the file signature");
#if H5_VERSION_GE(1, 12, 0)
    H5C(is_h5 = H5Fis_accessible(path, H5P_DEFAULT)); /* H5Fis_hdf5 is deprecated there */
#else
    H5C(is_h5 = H5Fis_hdf5(path));
#endif
    if (!is_h5) return mn_fail(MN_ERR_IO, "loading '%s': not an HDF5 file", path);

    WHERE("opening the file");
    loading_now = cx;
    H5C(fapl = H5Pcreate(H5P_FILE_ACCESS));
    H5C(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG));
    H5C(file = H5Fopen(path, H5F_ACC_RDONLY, fapl));
    WHERE("group '/'");
    H5C(rootg = H5Gopen2(file, "/", H5P_DEFAULT));
    if (!(root = mn_node_group("/"))) {
        st = h5_fail_here(cx, MN_ERR_OOM, "out of memory");
        goto done;
    }
    if ((st = read_group(cx, rootg, root, 0)) != MN_OK) goto done;
    WHERE("group '/'");
    CLOSE_CHECKED(H5Gclose, rootg);
    WHERE("closing the file");
    CLOSE_CHECKED(H5Fclose, file);
    *out = root;
    root = NULL;
done:
    if (root) mn_node_free(root);
    CLOSE(H5Gclose, rootg);
    CLOSE(H5Fclose, file);
    CLOSE(H5Pclose, fapl);
    H5Eclear2(H5E_DEFAULT);
    loading_now = NULL;
    return st;
}
