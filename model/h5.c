/* h5.c: HDF5 files as trees (h5.h): mn_h5_save writes a tree atomically (to
 * "<path>.tmp-<pid>", then rename); mn_h5_load, which reads a whole file
 * back, is h5_read.c. Here too what both share (h5_internal.h): errors,
 * paths, the context of a load or save, staged transfers.
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
 * strings variable-length UTF-8 scalar attributes (what h5py writes for str). */
#include "h5_internal.h"
#include "ops.h"
#include "phase_timing.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

mn_status mn_h5_fail(mn_h5_ctx *cx, const char *srcfile, int line)
{
    char msg[512] = "";
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_cb, msg);
    H5Eclear2(H5E_DEFAULT);
    if (!msg[0]) snprintf(msg, sizeof msg, "HDF5 call failed");
    return mn_fail(MN_ERR_IO, "%s '%s': %s: %s [%s:%d]", cx->verb, cx->file, cx->where, msg,
                   srcfile, line);
}

mn_status mn_h5_fail_here(mn_h5_ctx *cx, mn_status st, const char *what)
{
    return mn_fail(st, "%s '%s': %s: %s", cx->verb, cx->file, cx->where, what);
}

mn_status mn_h5_context(mn_h5_ctx *cx, mn_status st)
{
    return mn_fail_context(st, "%s '%s': %s: ", cx->verb, cx->file, cx->where);
}

/* ---- paths ---- */

mn_status mn_h5_path_push(mn_h5_ctx *cx, const char *name, size_t *saved)
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

void mn_h5_path_pop(mn_h5_ctx *cx, size_t saved)
{
    cx->plen = saved;
    cx->path[saved] = 0;
}

void mn_h5_ctx_init(mn_h5_ctx *cx, const char *verb, const char *file)
{
    memset(cx, 0, sizeof *cx);
    cx->verb = verb;
    cx->file = file;
    cx->path[0] = '/';
    cx->path[1] = 0;
    cx->plen = 1;
    snprintf(cx->where, sizeof cx->where, "file");
    cx->gcpl = cx->lcpl = cx->acpl = H5I_INVALID_HID;
    cx->writeback_fd = -1;
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
    mn_h5_ctx *cx;
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
    mn_h5_ctx *cx = sp->cx;
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
    if (sp->write) {
        H5C(H5Dwrite(sp->ds, sp->mtype, mspace, sp->fspace, H5P_DEFAULT, host));
        mn_h5_start_writeback(cx); /* the disk takes each piece while the next one downloads */
    } else {
        H5C(H5Dread(sp->ds, sp->mtype, mspace, sp->fspace, H5P_DEFAULT, host));
    }
done:
    CLOSE(H5Sclose, mspace);
    if (st != MN_OK) sp->move_failed = true;
    return st;
}

mn_status mn_h5_staged_transfer(mn_h5_ctx *cx, hid_t ds, hid_t mtype, const mn_tensor *t, bool write)
{
    mn_status st = MN_OK;
    const mn_backend *be = mn_backend_for(t->storage->device);
    staged sp = {.cx = cx, .ds = ds, .fspace = H5I_INVALID_HID, .mtype = mtype, .write = write,
                 .ndim = t->ndim, .esize = mn_dtype_size(t->dtype), .split = -1};
    memcpy(sp.shape, t->shape, sizeof sp.shape);
    mn_stage_io io = {staged_piece, staged_move, &sp};
    size_t nbytes = (size_t)mn_tensor_numel(t) * sp.esize;
    if (!be || !be->stage_in || !be->stage_out || t->ndim < 1)
        return mn_h5_fail_here(cx, MN_ERR_ARG, "no staged transfer here");
    H5C(sp.fspace = H5Dget_space(ds));
    st = write ? be->stage_out(mn_tensor_data(t), nbytes, &io) : be->stage_in(mn_tensor_data(t), nbytes, &io);
    if (st != MN_OK && !sp.move_failed) mn_h5_context(cx, st);
    if (st == MN_OK) cx->io->staged_bytes += (double)nbytes;
done:
    CLOSE(H5Sclose, sp.fspace);
    return st;
}

bool mn_h5_device_stages(mn_device dev)
{
    if (dev == MN_CPU) return false;
    const mn_backend *be = mn_backend_for(dev);
    if (!be) mn_clear_error();
    return be && be->stage_in && be->stage_out;
}

/* ===================================================================== */
/* Writing                                                               */
/* ===================================================================== */

static mn_status write_group(mn_h5_ctx *cx, hid_t gid, const mn_node *g);

static mn_status write_attr(mn_h5_ctx *cx, hid_t gid, const mn_node *n)
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
        st = mn_h5_fail_here(cx, MN_ERR_ARG, "not an attribute kind");
        goto done;
    }
    CLOSE_CHECKED(H5Aclose, attr);
done:
    CLOSE(H5Aclose, attr);
    CLOSE(H5Tclose, type);
    CLOSE(H5Sclose, space);
    return st;
}

static mn_status write_dataset(mn_h5_ctx *cx, hid_t gid, const mn_node *n)
{
    mn_status st = MN_OK;
    mn_tensor host = {0}, dense = {0};
    const mn_tensor *t = &n->tensor;
    hid_t space = H5I_INVALID_HID, ds = H5I_INVALID_HID, dcpl = H5I_INVALID_HID, ftype, mtype;
    hsize_t dims[MN_MAX_DIMS];

    if (!t->storage) {
        st = mn_h5_fail_here(cx, MN_ERR_ARG, "the tensor has been released (no storage)");
        goto done;
    }
    if (t->ndim < 0 || t->ndim > MN_MAX_DIMS) {
        st = mn_h5_fail_here(cx, MN_ERR_ARG, "the tensor has a bad number of dimensions");
        goto done;
    }
    switch (t->dtype) {
    case MN_F32: ftype = H5T_IEEE_F32LE; mtype = H5T_NATIVE_FLOAT; break;
    case MN_F64: ftype = H5T_IEEE_F64LE; mtype = H5T_NATIVE_DOUBLE; break;
    case MN_I64: ftype = H5T_STD_I64LE; mtype = H5T_NATIVE_INT64; break;
    default:
        st = mn_h5_fail_here(cx, MN_ERR_ARG, "unknown tensor dtype");
        goto done;
    }
    size_t nbytes = (size_t)mn_tensor_numel(t) * mn_dtype_size(t->dtype);
    if (t->storage->device != MN_CPU && t->ndim >= 1 && nbytes >= MN_H5_STAGE_MIN && mn_tensor_is_contiguous(t) &&
        mn_h5_device_stages(t->storage->device)) {
        /* Straight from the device, piece by piece. The file gets no fill
         * values first: every element is written. */
        for (int i = 0; i < t->ndim; i++) dims[i] = (hsize_t)t->shape[i];
        H5C(space = H5Screate_simple(t->ndim, dims, NULL));
        H5C(dcpl = H5Pcreate(H5P_DATASET_CREATE));
        H5C(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
        H5C(ds = H5Dcreate2(gid, n->name, ftype, space, cx->lcpl, dcpl, H5P_DEFAULT));
        if ((st = mn_h5_staged_transfer(cx, ds, mtype, t, true)) != MN_OK) goto done;
        cx->io->bytes += (double)nbytes;
        CLOSE_CHECKED(H5Dclose, ds);
        goto done;
    }
    if (t->storage->device != MN_CPU) {
        if ((st = mn_tensor_to_device(&host, t, MN_CPU)) != MN_OK) {
            mn_h5_context(cx, st);
            goto done;
        }
        t = &host;
    }
    if ((st = mn_tensor_contiguous(&dense, t)) != MN_OK) {
        mn_h5_context(cx, st);
        goto done;
    }
    for (int i = 0; i < dense.ndim; i++) dims[i] = (hsize_t)dense.shape[i];

    if (dense.ndim == 0) H5C(space = H5Screate(H5S_SCALAR));
    else H5C(space = H5Screate_simple(dense.ndim, dims, NULL));
    H5C(ds = H5Dcreate2(gid, n->name, ftype, space, cx->lcpl, H5P_DEFAULT, H5P_DEFAULT));
    if (mn_tensor_numel(&dense) > 0)
        H5C(H5Dwrite(ds, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, mn_tensor_data(&dense)));
    if (nbytes >= MN_H5_STAGE_MIN) mn_h5_start_writeback(cx); /* while the next datasets are written */
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

static mn_status write_child(mn_h5_ctx *cx, hid_t gid, const mn_node *c)
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
        return mn_h5_fail_here(cx, MN_ERR_ARG, what);
    }
    memcpy(group_path, cx->path, cx->plen + 1);
    if ((st = mn_h5_path_push(cx, c->name, &saved)) != MN_OK) return st;
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
        st = mn_h5_fail_here(cx, MN_ERR_ARG, "unknown node kind");
        break;
    }
done:
    CLOSE(H5Gclose, sub);
    mn_h5_path_pop(cx, saved);
    return st;
}

static mn_status write_group(mn_h5_ctx *cx, hid_t gid, const mn_node *g)
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

void mn_h5_start_writeback(const mn_h5_ctx *cx)
{
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
    /* a hint: a failure (a filesystem without it) leaves the work to fsync */
    if (cx->writeback_fd >= 0) (void)sync_file_range(cx->writeback_fd, 0, 0, SYNC_FILE_RANGE_WRITE);
#else
    (void)cx;
#endif
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
    mn_h5_ctx ctx, *cx = &ctx;
    mn_status st = MN_OK;
    hid_t fapl = H5I_INVALID_HID, fcpl = H5I_INVALID_HID, file = H5I_INVALID_HID,
          rootg = H5I_INVALID_HID;
    char *tmp = NULL;
    bool created = false;

    if (!path || !path[0]) return mn_fail(MN_ERR_ARG, "saving: empty file name");
    mn_h5_ctx_init(cx, "saving", path);
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
    /* our own descriptor of the file, for the writeback hints only: HDF5's
     * writes go through its own (a failure here only loses the hints) */
    cx->writeback_fd = open(tmp, O_RDONLY | O_CLOEXEC);
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
    if (cx->writeback_fd >= 0) close(cx->writeback_fd);
    if (created) remove(tmp);
    free(tmp);
    H5Eclear2(H5E_DEFAULT);
    return st;
}
