/* rule_io.h: a rule to and from its attribute tree (SPEC.md section 5's
 * /rule group). Files give the tree through HDF5; Lua builds the same tree
 * from a table (dsl/l_rule.c); both then go through one reader, which walks
 * the rule table (rule.def). */
#ifndef MN_RULE_IO_H
#define MN_RULE_IO_H

#include "rule.h"
#include "tree.h"

/* Rule from a /rule group's attributes (and its constants subgroup); where
 * names the place for messages ("exp.h5: /rule"), noun what its entries are
 * called there ("attribute" in files, "field" in Lua). Missing entries take
 * their defaults; unknown ones are errors (they are usually typos). */
mn_status mn_rule_from_tree_as(const mn_node *group, const char *where, const char *noun, mn_rule *out);
mn_status mn_rule_from_tree(const mn_node *group, const char *where, mn_rule *out); /* noun "attribute" */
/* The rule's attributes into group: every v1 field (defaults included),
 * v2 fields where they differ from their default, expressions, constants. */
mn_status mn_rule_to_tree(const mn_rule *r, mn_node *group);
/* True for the fields SPEC v2 added (their doc starts "(v2)"). */
bool mn_field_is_v2(const mn_field *f);

#endif
