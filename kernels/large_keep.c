/* large_keep.c: the large path's steps kept between segments
 * (kernels/engine_large.c runs them; large_run.h is what the two share).
 * A segment's host work is mostly the launches of its first steps: the
 * first step runs directly, the second is captured and instantiated (P2 of
 * issue 14, one step, spends 0.2 ms enqueueing 14 launches and 5 products
 * that the GPU runs in 0.15 ms). So a segment with at least one full step
 * keeps its workspace and its step's graph for the next segment of the
 * same shape, rule module and options (a sweep, a training loop): that one
 * writes its arguments, copies the weights in, replays the graph for every
 * full step from the first, and copies the weights out. The graph holds no
 * pointer to the caller's tensors: the kernels reach them through the
 * arguments in device memory (large_kernels.cuh), and the products read
 * only the workspace and the path's own copies of W and A.
 * At most KEPT_MAX shapes, least recently used first out, and at most a
 * quarter of the device's memory; mn_cuda_empty_cache and the allocator's
 * out-of-memory path give them back (mn_cuda_large_release).
 * MNEMO_LARGE_KEEP=0 turns this off. */
#include "large_run.h"
#include "cuda.h"

#include <stdlib.h>
#include <string.h>

#define KEPT_MAX 4

/* What a captured step depends on besides its workspace: the kernels (a
 * module's move to the full tier changes them), the sizes, the options. */
typedef struct kept_key {
    cudaKernel_t k[K_COUNT];
    long long M, dk, dv, dh, CR, step, refresh;
    int prec, L, per, np, glu, ns, y, copy_y, retrieve, after, q;
} kept_key;

/* An entry: its step (large_run.h's kept, which the segment holds a
 * pointer to), its key and its workspace. */
typedef struct entry {
    kept step;
    kept_key key;
    void *work;
    size_t work_bytes;
    unsigned long long used;
} entry;

static struct {
    entry *e[KEPT_MAX];
    int n;
    unsigned long long clock;
    size_t bytes;
} keep;

static bool keep_enabled(void)
{
    const char *knob = getenv("MNEMO_LARGE_KEEP");
    return !(knob && strcmp(knob, "0") == 0);
}

static void kept_drop(int i)
{
    entry *E = keep.e[i];
    if (E->step.graph) (void)cudaGraphExecDestroy(E->step.graph);
    mn_cuda_free(E->work, E->work_bytes);
    keep.bytes -= E->work_bytes;
    free(E);
    keep.e[i] = keep.e[--keep.n];
}

void mn_large_kept_forget(kept *E)
{
    for (int i = 0; i < keep.n; i++)
        if (&keep.e[i]->step == E) kept_drop(i);
}

void mn_large_kept_drop_all(void)
{
    while (keep.n > 0) kept_drop(keep.n - 1);
}

size_t mn_large_kept_bytes(void) { return keep.bytes; }

static void key_of(const run *R, kept_key *k)
{
    memset(k, 0, sizeof *k); /* the padding too: keys compare as bytes */
    memcpy(k->k, R->mod->k, sizeof k->k);
    k->M = R->M;
    k->dk = R->dk;
    k->dv = R->dv;
    k->dh = R->dh;
    k->CR = R->CR;
    k->step = R->step;
    k->refresh = R->refresh;
    k->prec = (int)R->prec;
    k->L = R->L;
    k->per = R->per;
    k->np = R->np;
    k->glu = R->glu;
    k->ns = R->ns;
    k->y = R->y != NULL;
    k->copy_y = R->copy_y;
    k->retrieve = R->retrieve;
    k->after = R->after;
    k->q = R->q != NULL;
}

mn_status mn_large_kept_attach(run *R, size_t device_bytes)
{
    if (!keep_enabled()) return MN_OK;
    kept_key key;
    key_of(R, &key);
    entry *E = NULL;
    for (int i = 0; i < keep.n && !E; i++)
        if (memcmp(&keep.e[i]->key, &key, sizeof key) == 0) E = keep.e[i];
    R->own = true;
    if (!E) {
        /* the key fixes the layout: only a new entry needs it counted */
        const size_t bytes = mn_large_carve(R, NULL);
        if (bytes > device_bytes / 4) {
            R->own = false;
            return MN_OK;
        }
        while (keep.n > 0 && (keep.n == KEPT_MAX || keep.bytes + bytes > device_bytes / 4)) {
            int lru = 0;
            for (int i = 1; i < keep.n; i++)
                if (keep.e[i]->used < keep.e[lru]->used) lru = i;
            kept_drop(lru);
        }
        E = calloc(1, sizeof *E);
        if (!E) return mn_fail(MN_ERR_OOM, "cuda large path: out of memory");
        E->key = key;
        E->work_bytes = bytes;
        mn_status s = mn_cuda_alloc(bytes, &E->work);
        if (s != MN_OK) {
            free(E);
            R->own = false;
            return s;
        }
        keep.e[keep.n++] = E;
        keep.bytes += bytes;
    }
    E->used = ++keep.clock;
    R->kept = &E->step;
    R->work = E->work;
    R->work_bytes = E->work_bytes;
    mn_large_carve(R, R->work);
    mn_large_point_weights(R);
    return MN_OK;
}
