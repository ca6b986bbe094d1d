/* module_memo.h: a rule's loaded kernels found again without generating
 * their source. A run looks its module up by the hash of a generated
 * source (kernels/cuda_module.h); generating and hashing the 50-60 KB of a
 * path's source costs about 80 us a run, more than the host's whole share
 * of a small run should be (issue 14: P2's and P1-lin's rule:run). The memo
 * remembers, for the last few (rule, dims, precision, templates, defines),
 * the module their source gave, and answers a later call whose source
 * would be the same text (mn_cuda_same_source_rule) without generating it. */
#ifndef MN_MODULE_MEMO_H
#define MN_MODULE_MEMO_H

#include "codegen.h"
#include "cuda_module.h"

/* As mn_cuda_module_get(mn_cuda_source_for(r, d, p, templates, defines),
 * names, work, out). templates and names identify a path by their address
 * (each path passes its own static lists); defines are compared as text.
 * Only dk, dv and dh of d (dh with two layers or more) reach the source. */
mn_status mn_cuda_module_for(const mn_rule *r, const mn_dims *d, mn_precision p, const char *const *templates,
                             const char *defines, const char *const *names, double work, mn_cuda_module **out);

#endif
