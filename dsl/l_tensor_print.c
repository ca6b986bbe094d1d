/* l_tensor_print.c: the text of a tensor (its __tostring), in torch7's
 * style: one common number format for the whole tensor, columns aligned,
 * rows on their own lines, >2-d tensors as 2-d blocks headed "(i,j,.,.) =",
 * and a closing summary line "[mnemo.Tensor f32 cpu 4x8]".
 *
 * Format, chosen over the elements that are shown:
 *   i64, or every finite value an integer below 1e8:   integers
 *   magnitudes spanning more than 4 decades:            %.4e per element
 *   largest |x| >= 1e3 or < 1e-3:                       a "1e-05 *" line, then %.4f
 *   otherwise:                                          %.4f
 * NaN and infinities print as nan, inf, -inf. Tensors of more than 1000
 * elements show the first and last 3 entries of every longer dim, with "...". */
#include "dsl.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void l_tensor_push_string(lua_State *L, const mn_tensor *t);

#define SUMMARY_OVER 1000 /* more elements than this: show only the edges */
#define EDGE 3            /* entries shown at each end of a long dim */
#define LINE_WIDTH 80     /* wider rows are split into column blocks */
#define CELL 40           /* bytes for one formatted element */

enum { FMT_INT, FMT_FIXED, FMT_SCALED, FMT_SCI };

typedef struct {
    const mn_tensor *t;
    bool summarize;
    int mode;
    double scale;
    int width; /* of every cell, a sign column included */
} printer;

/* Entries of dim d that are shown: their count, and the k-th (-1 for "..."). */
static int64_t shown_count(const printer *p, int d)
{
    int64_t n = p->t->shape[d];
    return p->summarize && n > 2 * EDGE ? 2 * EDGE + 1 : n;
}

static int64_t shown_index(const printer *p, int d, int64_t k)
{
    int64_t n = p->t->shape[d];
    if (!(p->summarize && n > 2 * EDGE)) return k;
    if (k < EDGE) return k;
    if (k == EDGE) return -1;
    return n - (2 * EDGE + 1 - k);
}

static double value_at(const mn_tensor *t, const int64_t *index)
{
    int64_t off = mn_tensor_offset_of(t, index);
    const char *base = (const char *)t->storage->data;
    switch (t->dtype) {
    case MN_F32: return ((const float *)base)[off];
    case MN_F64: return ((const double *)base)[off];
    case MN_I64: return (double)((const int64_t *)base)[off];
    }
    return 0;
}

static int format_cell(const printer *p, const int64_t *index, char *buf)
{
    const mn_tensor *t = p->t;
    if (t->dtype == MN_I64) {
        int64_t off = mn_tensor_offset_of(t, index);
        return snprintf(buf, CELL, "%lld", (long long)((const int64_t *)t->storage->data)[off]);
    }
    double v = value_at(t, index);
    if (isnan(v)) return snprintf(buf, CELL, "nan");
    if (isinf(v)) return snprintf(buf, CELL, v > 0 ? "inf" : "-inf");
    switch (p->mode) {
    case FMT_INT: return snprintf(buf, CELL, "%.0f", v + 0.0); /* + 0.0: no "-0" */
    case FMT_FIXED: return snprintf(buf, CELL, "%.4f", v);
    case FMT_SCALED: return snprintf(buf, CELL, "%.4f", v / p->scale);
    default: return snprintf(buf, CELL, "%.4e", v);
    }
}

/* Visit every shown element (odometer over the shown positions). */
typedef void (*visit_fn)(printer *p, const int64_t *index, void *acc);

static void walk(printer *p, int d, int64_t *index, visit_fn fn, void *acc)
{
    if (d == p->t->ndim) { fn(p, index, acc); return; }
    int64_t n = shown_count(p, d);
    for (int64_t k = 0; k < n; k++) {
        int64_t i = shown_index(p, d, k);
        if (i < 0) continue;
        index[d] = i;
        walk(p, d + 1, index, fn, acc);
    }
}

typedef struct { bool all_int; double max_abs, min_abs; } stats;

static void gather(printer *p, const int64_t *index, void *acc)
{
    stats *s = acc;
    double v = value_at(p->t, index);
    if (!isfinite(v)) return;
    double a = fabs(v);
    if (v != floor(v)) s->all_int = false;
    if (a > s->max_abs) s->max_abs = a;
    if (a > 0 && (s->min_abs == 0 || a < s->min_abs)) s->min_abs = a;
}

static void measure(printer *p, const int64_t *index, void *acc)
{
    (void)acc;
    char buf[CELL];
    int w = format_cell(p, index, buf);
    if (buf[0] != '-') w++; /* room for a sign, so columns line up as torch7's do */
    if (w > p->width) p->width = w;
}

static int decade(double a) { return a > 0 ? (int)floor(log10(a)) + 1 : 1; }

static void choose_format(printer *p)
{
    stats s = { true, 0, 0 };
    int64_t index[MN_MAX_DIMS] = { 0 };
    p->mode = FMT_INT;
    p->scale = 1;
    if (p->t->dtype != MN_I64) {
        walk(p, 0, index, gather, &s);
        if (!(s.all_int && s.max_abs < 1e8)) {
            int emax = decade(s.max_abs), emin = decade(s.min_abs);
            if (emax - emin > 4) p->mode = FMT_SCI;
            else if (s.max_abs >= 1e3 || s.max_abs < 1e-3) {
                p->mode = p->t->ndim == 0 ? FMT_SCI : FMT_SCALED;
                p->scale = pow(10.0, emax - 1);
            } else p->mode = FMT_FIXED;
        }
    }
    p->width = 0;
    walk(p, 0, index, measure, NULL);
}

static void add_cell(luaL_Buffer *b, const printer *p, const char *s)
{
    for (int pad = p->width - (int)strlen(s); pad > 0; pad--) luaL_addchar(b, ' ');
    luaL_addstring(b, s);
}

/* The shown column positions [k0, k1) of a row fit in one line from k0. */
static int64_t columns_that_fit(const printer *p, int64_t k0, int64_t ncols)
{
    int64_t k = k0, used = 0;
    int per = (p->width > 3 ? p->width : 3) + 1;
    while (k < ncols && (k == k0 || used + per <= LINE_WIDTH + 1)) { used += per; k++; }
    return k;
}

/* The last two dims of t at index (leading dims fixed), as rows. A 1-d
 * tensor is one row; rows wider than LINE_WIDTH are cut into column blocks. */
static void add_matrix(luaL_Buffer *b, printer *p, int64_t *index)
{
    const mn_tensor *t = p->t;
    int rd = t->ndim - 2, cd = t->ndim - 1; /* row dim (-1 for 1-d), column dim */
    int64_t nrows = rd >= 0 ? shown_count(p, rd) : 1, ncols = shown_count(p, cd);
    char buf[CELL];
    for (int64_t c0 = 0; c0 < ncols;) {
        int64_t c1 = columns_that_fit(p, c0, ncols);
        if (rd >= 0 && (c0 > 0 || c1 < ncols)) { /* torch7's header for a block of columns */
            int64_t first = shown_index(p, cd, c0), last = shown_index(p, cd, c1 - 1);
            if (first < 0) first = shown_index(p, cd, c0 + 1);
            if (last < 0) last = shown_index(p, cd, c1 - 2);
            if (c0 > 0) luaL_addchar(b, '\n');
            lua_pushfstring(b->L, "Columns %I to %I\n", (lua_Integer)first + 1, (lua_Integer)last + 1);
            luaL_addvalue(b);
        }
        for (int64_t r = 0; r < nrows; r++) {
            int64_t i = rd >= 0 ? shown_index(p, rd, r) : 0;
            if (i < 0) { /* the "..." row */
                add_cell(b, p, "...");
                luaL_addchar(b, '\n');
                continue;
            }
            if (rd >= 0) index[rd] = i;
            for (int64_t c = c0; c < c1; c++) {
                int64_t j = shown_index(p, cd, c);
                if (c > c0) luaL_addchar(b, ' ');
                if (j < 0) { add_cell(b, p, "..."); continue; }
                index[cd] = j;
                format_cell(p, index, buf);
                add_cell(b, p, buf);
            }
            luaL_addchar(b, '\n');
        }
        c0 = c1;
    }
}

/* Blocks of a >2-d tensor: every shown combination of the leading dims. */
static void add_blocks(luaL_Buffer *b, printer *p, int d, int64_t *index, bool *first)
{
    const mn_tensor *t = p->t;
    if (d == t->ndim - 2) {
        if (!*first) luaL_addchar(b, '\n');
        *first = false;
        luaL_addchar(b, '(');
        for (int i = 0; i < d; i++) {
            lua_pushfstring(b->L, "%I,", (lua_Integer)index[i] + 1);
            luaL_addvalue(b);
        }
        luaL_addstring(b, ".,.) =\n");
        add_matrix(b, p, index);
        return;
    }
    int64_t n = shown_count(p, d);
    for (int64_t k = 0; k < n; k++) {
        int64_t i = shown_index(p, d, k);
        if (i < 0) {
            luaL_addstring(b, "\n...\n");
            continue;
        }
        index[d] = i;
        add_blocks(b, p, d + 1, index, first);
    }
}

static void add_summary(luaL_Buffer *b, const mn_tensor *t, mn_device dev)
{
    char shape[160];
    lua_pushfstring(b->L, "[mnemo.Tensor %s %s %s]", mn_dtype_name(t->dtype), mn_device_name(dev),
                    mn_shape_string(t, shape, sizeof shape));
    luaL_addvalue(b);
}

void l_tensor_push_string(lua_State *L, const mn_tensor *t)
{
    mn_device dev = t->storage ? t->storage->device : MN_CPU;
    int top = lua_gettop(L);
    if (dev != MN_CPU) { /* print a host copy */
        mn_tensor *h = l_push_empty_tensor(L);
        L_TRY(L, mn_tensor_to_device(h, t, MN_CPU));
        t = h;
    }
    printer p = { t, mn_tensor_numel(t) > SUMMARY_OVER, FMT_INT, 1, 0 };
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    if (mn_tensor_numel(t) > 0) {
        int64_t index[MN_MAX_DIMS] = { 0 };
        choose_format(&p);
        if (p.mode == FMT_SCALED) {
            char s[CELL];
            snprintf(s, sizeof s, "%g *\n", p.scale);
            luaL_addstring(&b, s);
        }
        if (t->ndim == 0) {
            char s[CELL];
            format_cell(&p, index, s);
            luaL_addstring(&b, s);
            luaL_addchar(&b, '\n');
        } else if (t->ndim <= 2) {
            add_matrix(&b, &p, index);
        } else {
            bool first = true;
            add_blocks(&b, &p, 0, index, &first);
        }
    }
    add_summary(&b, t, dev);
    luaL_pushresult(&b);
    if (lua_gettop(L) > top + 1) { /* drop the host copy under the string */
        lua_replace(L, top + 1);
        lua_settop(L, top + 1);
    }
}
