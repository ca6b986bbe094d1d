/* tree.c: the tree of named values of tree.h (groups, tensors, numbers,
 * strings), the engine-side form of an HDF5 file or a Lua table of results.
 * Children keep their order; names are not checked for duplicates, since a
 * group may hold an attribute and a dataset of the same name. */
#include "tree.h"

#include <stdlib.h>
#include <string.h>

static mn_node *node_new(const char *name, mn_node_kind kind)
{
    mn_node *n = mn_calloc(1, sizeof *n, "a tree node");
    if (!n) return NULL;
    n->name = mn_strdup(name ? name : "");
    if (!n->name) {
        free(n);
        return NULL;
    }
    n->kind = kind;
    return n;
}

mn_node *mn_node_group(const char *name) { return node_new(name, MN_NODE_GROUP); }

static mn_node *attach(mn_node *g, mn_node *child)
{
    if (!child) return NULL;
    if (g->nchildren == g->capacity) {
        int cap = g->capacity ? 2 * g->capacity : 8;
        mn_node **c = realloc(g->children, (size_t)cap * sizeof *c);
        if (!c) {
            mn_fail(MN_ERR_OOM, "out of memory growing group '%s'", g->name);
            mn_node_free(child);
            return NULL;
        }
        g->children = c;
        g->capacity = cap;
    }
    g->children[g->nchildren++] = child;
    return child;
}

static mn_node *add(mn_node *g, const char *name, mn_node_kind kind)
{
    if (!g || g->kind != MN_NODE_GROUP) {
        mn_fail(MN_ERR_ARG, "tree: cannot add '%s' to a node that is not a group", name ? name : "");
        return NULL;
    }
    return attach(g, node_new(name, kind));
}

mn_node *mn_node_add_group(mn_node *g, const char *name) { return add(g, name, MN_NODE_GROUP); }

mn_node *mn_node_add_tensor(mn_node *g, const char *name, const mn_tensor *t)
{
    mn_node *n = add(g, name, MN_NODE_TENSOR);
    if (n && t) mn_tensor_share(&n->tensor, t);
    return n;
}

mn_node *mn_node_add_number(mn_node *g, const char *name, double v)
{
    mn_node *n = add(g, name, MN_NODE_NUMBER);
    if (n) n->number = v;
    return n;
}

mn_node *mn_node_add_integer(mn_node *g, const char *name, int64_t v)
{
    mn_node *n = add(g, name, MN_NODE_INTEGER);
    if (n) n->integer = v;
    return n;
}

mn_node *mn_node_add_string(mn_node *g, const char *name, const char *s)
{
    char *copy = mn_strdup(s ? s : "");
    if (!copy) return NULL;
    mn_node *n = add(g, name, MN_NODE_STRING);
    if (!n) {
        free(copy);
        return NULL;
    }
    n->string = copy;
    return n;
}

static mn_node *child_named(const mn_node *g, const char *name, size_t len)
{
    if (!g || g->kind != MN_NODE_GROUP) return NULL;
    for (int i = 0; i < g->nchildren; i++) {
        const char *cn = g->children[i]->name;
        if (strlen(cn) == len && memcmp(cn, name, len) == 0) return g->children[i];
    }
    return NULL;
}

/* Empty segments ("a//b", a leading or trailing '/') are skipped, so "" and
 * "/" name g itself. */
mn_node *mn_node_find(const mn_node *g, const char *path)
{
    if (!g || !path) return NULL;
    const mn_node *cur = g;
    const char *p = path;
    while (*p) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len > 0 && !(cur = child_named(cur, p, len))) return NULL;
        p += len;
        if (*p == '/') p++;
    }
    return (mn_node *)cur;
}

void mn_node_free(mn_node *n)
{
    if (!n) return;
    for (int i = 0; i < n->nchildren; i++) mn_node_free(n->children[i]);
    free(n->children);
    mn_tensor_release(&n->tensor);
    free(n->string);
    free(n->name);
    free(n);
}
