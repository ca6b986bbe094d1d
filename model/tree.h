/* tree.h: an in-memory tree of named values, the engine-side shape of an
 * HDF5 file and of a Lua table of results: groups hold children in order;
 * leaves are tensors (datasets), numbers or strings (attributes). It lets
 * model/ read and write files with no Lua in sight. */
#ifndef MN_TREE_H
#define MN_TREE_H

#include "tensor.h"

typedef enum { MN_NODE_GROUP, MN_NODE_TENSOR, MN_NODE_NUMBER, MN_NODE_INTEGER, MN_NODE_STRING } mn_node_kind;

typedef struct mn_node {
    char *name;
    mn_node_kind kind;
    mn_tensor tensor;          /* MN_NODE_TENSOR (owns one storage reference) */
    double number;             /* MN_NODE_NUMBER */
    int64_t integer;           /* MN_NODE_INTEGER */
    char *string;              /* MN_NODE_STRING */
    struct mn_node **children; /* MN_NODE_GROUP */
    int nchildren, capacity;
} mn_node;

mn_node *mn_node_group(const char *name);
/* Adders append to a group and return the new child (NULL on OOM). The
 * tensor adder takes a new reference to t's storage. */
mn_node *mn_node_add_group(mn_node *g, const char *name);
mn_node *mn_node_add_tensor(mn_node *g, const char *name, const mn_tensor *t);
mn_node *mn_node_add_number(mn_node *g, const char *name, double v);
mn_node *mn_node_add_integer(mn_node *g, const char *name, int64_t v);
mn_node *mn_node_add_string(mn_node *g, const char *name, const char *s);
/* Direct child by name, or a path "a/b/c" relative to g; NULL if absent. */
mn_node *mn_node_find(const mn_node *g, const char *path);
void mn_node_free(mn_node *n);

#endif
