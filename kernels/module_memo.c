/* module_memo.c: a rule's loaded kernels found again without generating
 * their source (kernels/module_memo.h). */
#include "module_memo.h"

#include <stdlib.h>
#include <string.h>

/* Sweeps and comparisons use a handful of rules at a time; the least
 * recently used entry goes first. Modules live for the process, so an
 * entry's pointer stays good; its rule copy holds its expressions, so their
 * addresses cannot be reused by other expressions while it lives. */
#define MEMO_MAX 64

typedef struct memo {
    const char *const *templates, *const *names;
    char *defines; /* a copy, or NULL */
    int64_t dk, dv, dh;
    mn_precision p;
    mn_rule rule; /* a copy */
    mn_cuda_module *mod;
    unsigned long long used;
} memo;

static memo memos[MEMO_MAX];
static int nmemos;
static unsigned long long clock_;

static int64_t hidden_of(const mn_rule *r, const mn_dims *d) { return r->layers > 1 ? d->dh : 0; }

static bool same_text(const char *a, const char *b) { return (!a && !b) || (a && b && strcmp(a, b) == 0); }

static memo *find(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                  const char *defines, const char *const *names)
{
    for (int i = 0; i < nmemos; i++) {
        memo *e = &memos[i];
        if (e->templates == templates && e->names == names && e->p == p && e->dk == d->dk && e->dv == d->dv &&
            e->dh == hidden_of(r, d) && same_text(e->defines, defines) && mn_cuda_same_source_rule(&e->rule, r))
            return e;
    }
    return NULL;
}

/* Remembers mod for these inputs; where memory runs out it simply does not. */
static void remember(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                     const char *defines, const char *const *names, mn_cuda_module *mod)
{
    memo e = {templates, names, NULL, d->dk, d->dv, hidden_of(r, d), p, {0}, mod, ++clock_};
    if (defines && !(e.defines = strdup(defines))) return;
    if (mn_rule_copy(&e.rule, r) != MN_OK) {
        free(e.defines);
        return;
    }
    int slot = nmemos;
    if (nmemos == MEMO_MAX) {
        slot = 0;
        for (int i = 1; i < nmemos; i++)
            if (memos[i].used < memos[slot].used) slot = i;
        mn_rule_free(&memos[slot].rule);
        free(memos[slot].defines);
    } else {
        nmemos++;
    }
    memos[slot] = e;
}

mn_status mn_cuda_module_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                             const char *defines, const char *const *names, double work, mn_cuda_module **out)
{
    memo *e = find(r, d, p, templates, defines, names);
    if (e) {
        e->used = ++clock_;
        *out = e->mod;
        return mn_cuda_module_touch(e->mod, work);
    }
    char *src = mn_cuda_source_for(r, d, p, templates, defines);
    if (!src) return MN_ERR_ARG;
    mn_status s = mn_cuda_module_get(src, names, work, out);
    free(src);
    if (s == MN_OK) remember(r, d, p, templates, defines, names, *out);
    return s;
}
