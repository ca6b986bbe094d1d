/* h5_read.c: mn_h5_load (h5.h), a whole HDF5 file read back as a tree; the
 * errors, paths, context and staged transfers it shares with the writing
 * side are h5.c's (h5_internal.h), and every HDF5 call goes through H5C as
 * there. Its own file: reading maps whatever a file holds (h5py's types,
 * links, attribute arrays) onto the tree, writing only the tree's own.
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
#include "h5_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The load in progress, for mn_h5_loading (a crash inside libhdf5 can then
 * be named by the process's signal handler). One at a time: HDF5 1.10 is
 * not thread-safe in Debian's build anyway. */
static const mn_h5_ctx *volatile loading_now;

const char *mn_h5_loading_file(void) { const mn_h5_ctx *cx = loading_now; return cx ? cx->file : NULL; }
const char *mn_h5_loading_where(void) { const mn_h5_ctx *cx = loading_now; return cx ? cx->where : NULL; }

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
static mn_status read_numeric(mn_h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype,
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
static mn_status read_string(mn_h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype, char **out)
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
        if (!(*out = mn_strdup(vs ? vs : ""))) st = mn_h5_context(cx, MN_ERR_OOM);
    } else {
        size_t size = H5Tget_size(ftype);
        if (size == 0) {
            st = mn_h5_fail(cx, __FILE__, __LINE__);
            goto done;
        }
        H5C(H5Tset_size(mem, size + 1));
        H5C(H5Tset_strpad(mem, H5T_STR_NULLTERM));
        if (!(buf = mn_malloc(size + 1, "a string"))) {
            st = mn_h5_context(cx, MN_ERR_OOM);
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
static mn_status space_shape(mn_h5_ctx *cx, hid_t space, int *ndim, int64_t *shape)
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
        return mn_h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
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
static bool staged_here(mn_h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype, int ndim, const int64_t *shape)
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
    return layout == H5D_CONTIGUOUS && same > 0 && mn_h5_device_stages(cx->io->device);
}

/* A numeric dataset or attribute array as a tensor leaf of g. */
static mn_status read_tensor_leaf(mn_h5_ctx *cx, hid_t obj, bool is_attr, hid_t ftype,
                                  H5T_class_t cls, hid_t space, mn_node *g, const char *name)
{
    mn_status st;
    mn_tensor t = {0};
    int ndim = 0;
    int64_t shape[MN_MAX_DIMS];
    size_t size = H5Tget_size(ftype);

    if (size == 0) return mn_h5_fail(cx, __FILE__, __LINE__);
    MN_TRY(space_shape(cx, space, &ndim, shape));
    mn_dtype dt = dtype_for(cls, size);
    mn_device dev = staged_here(cx, obj, is_attr, ftype, ndim, shape) ? cx->io->device : MN_CPU;
    if ((st = mn_tensor_empty(&t, dt, ndim, shape, dev)) != MN_OK) return mn_h5_context(cx, st);
    int64_t n = mn_tensor_numel(&t);
    if (dev != MN_CPU) st = mn_h5_staged_transfer(cx, obj, H5T_NATIVE_FLOAT, &t, false);
    else if (n > 0) st = read_numeric(cx, obj, is_attr, ftype, cls, dt, (size_t)n, mn_tensor_data(&t));
    if (st == MN_OK && !is_attr) cx->io->bytes += (double)n * (double)mn_dtype_size(dt);
    if (st == MN_OK && !mn_node_add_tensor(g, name, &t))
        st = mn_h5_fail_here(cx, MN_ERR_OOM, "out of memory");
    mn_tensor_release(&t);
    return st;
}

static mn_status read_attr(mn_h5_ctx *cx, hid_t gid, const char *name, mn_node *g)
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
    if (!leaf) st = mn_h5_fail_here(cx, MN_ERR_OOM, "out of memory");
done:
    free(s);
    CLOSE(H5Sclose, space);
    CLOSE(H5Tclose, type);
    CLOSE(H5Aclose, attr);
    return st;
}

typedef struct {
    mn_h5_ctx *cx;
    mn_node *g;
} attr_iter;

static herr_t attr_cb(hid_t loc, const char *name, const H5A_info_t *info, void *data)
{
    attr_iter *it = data;
    (void)info;
    it->cx->cb_status = read_attr(it->cx, loc, name, it->g);
    return it->cx->cb_status == MN_OK ? 0 : -1;
}

static mn_status read_dataset(mn_h5_ctx *cx, hid_t ds, mn_node *g, const char *name)
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
            st = mn_h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
            goto done;
        }
        if ((st = read_string(cx, ds, false, type, &s)) != MN_OK) goto done;
        if (!mn_node_add_string(g, name, s)) st = mn_h5_fail_here(cx, MN_ERR_OOM, "out of memory");
    } else {
        char what[128];
        snprintf(what, sizeof what, "unsupported datatype (%s)", class_name(cls));
        st = mn_h5_fail_here(cx, MN_ERR_UNSUPPORTED, what);
    }
done:
    free(s);
    CLOSE(H5Sclose, space);
    CLOSE(H5Tclose, type);
    return st;
}

static mn_status read_group(mn_h5_ctx *cx, hid_t gid, mn_node *g, int depth);

static mn_status read_link(mn_h5_ctx *cx, hid_t gid, const char *name, mn_node *g, int depth)
{
    mn_status st = MN_OK;
    hid_t obj = H5I_INVALID_HID;
    H5L_info_t li;
    H5I_type_t it;
    size_t saved;

    MN_TRY(mn_h5_path_push(cx, name, &saved));
    WHERE("link '%s'", cx->path);
    H5C(H5Lget_info(gid, name, &li, H5P_DEFAULT));
    if (li.type != H5L_TYPE_HARD) goto done; /* soft and external links: not followed */
    H5C(obj = H5Oopen(gid, name, H5P_DEFAULT));
    H5C(it = H5Iget_type(obj));
    if (it == H5I_GROUP) {
        WHERE("group '%s'", cx->path);
        if (depth + 1 > MN_H5_MAX_DEPTH) {
            st = mn_h5_fail_here(cx, MN_ERR_UNSUPPORTED,
                              "groups nested too deeply (a cycle of hard links?)");
            goto done;
        }
        mn_node *child = mn_node_add_group(g, name);
        if (!child) {
            st = mn_h5_fail_here(cx, MN_ERR_OOM, "out of memory");
            goto done;
        }
        st = read_group(cx, obj, child, depth + 1);
    } else if (it == H5I_DATASET) {
        st = read_dataset(cx, obj, g, name);
    } /* named datatypes: skipped */
done:
    CLOSE(H5Oclose, obj);
    mn_h5_path_pop(cx, saved);
    return st;
}

static mn_status read_group(mn_h5_ctx *cx, hid_t gid, mn_node *g, int depth)
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
        st = cx->cb_status != MN_OK ? cx->cb_status : mn_h5_fail(cx, __FILE__, __LINE__);
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
            st = mn_h5_context(cx, MN_ERR_OOM);
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
    mn_h5_ctx ctx, *cx = &ctx;
    mn_status st = MN_OK;
    hid_t fapl = H5I_INVALID_HID, file = H5I_INVALID_HID, rootg = H5I_INVALID_HID;
    mn_node *root = NULL;
    struct stat sb;
    htri_t is_h5;

    *out = NULL;
    if (!path || !path[0]) return mn_fail(MN_ERR_ARG, "loading: empty file name");
    mn_h5_ctx_init(cx, "loading", path);
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
        st = mn_h5_fail_here(cx, MN_ERR_OOM, "out of memory");
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
