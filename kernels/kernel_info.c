/* kernel_info.c: the resources of generated kernels (kernels/kernel_info.h):
 * parsing ptxas's -v log and the launch bounds of PTX, and the kernels of a
 * rule as the GPU engine would compile them. No CUDA runtime here: the
 * device's part is kernels/engine_cuda.c. */
#include "kernel_info.h"
#include "plan.h"
#include "codegen.h"
#include "cuda.h"
#include "nvrtc.h"
#include "rule_kernel.cuh" /* MN_RULE_THREADS: the engine's block size */

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void info_init(mn_kernel_info *k, const char *name, size_t len)
{
    memset(k, 0, sizeof *k);
    if (len >= sizeof k->name) len = sizeof k->name - 1;
    memcpy(k->name, name, len);
    k->registers = -1;
    k->shared_bytes = k->stack_bytes = k->spill_stores = k->spill_loads = -1;
    k->barriers = -1;
}

/* The number written just before phrase in line[0..len) ("40 registers"),
 * or -1 when phrase is not there or no number precedes it. */
static long number_before(const char *line, size_t len, const char *phrase)
{
    size_t pn = strlen(phrase);
    for (size_t i = 0; i + pn <= len; i++) {
        if (memcmp(line + i, phrase, pn) != 0) continue;
        size_t e = i;
        while (e > 0 && line[e - 1] == ' ') e--;
        size_t b = e;
        while (b > 0 && isdigit((unsigned char)line[b - 1])) b--;
        if (b == e) return -1;
        return strtol(line + b, NULL, 10);
    }
    return -1;
}

static const char *find_in(const char *line, size_t len, const char *what)
{
    size_t wn = strlen(what);
    for (size_t i = 0; i + wn <= len; i++)
        if (memcmp(line + i, what, wn) == 0) return line + i;
    return NULL;
}

static mn_kernel_info *find_named(mn_kernel_info *k, int n, const char *name, size_t len)
{
    for (int i = 0; i < n; i++)
        if (strlen(k[i].name) == len && memcmp(k[i].name, name, len) == 0) return &k[i];
    return NULL;
}

int mn_ptxas_parse(const char *log, mn_kernel_info *out, int max, int *arch)
{
    int n = 0;
    mn_kernel_info *cur = NULL;
    const char *props = NULL; /* the function of the last "Function properties for" line */
    size_t props_len = 0;
    if (arch) *arch = 0;
    for (const char *line = log; line && *line;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        const char *p;
        if ((p = find_in(line, len, "Compiling entry function '"))) {
            const char *name = p + strlen("Compiling entry function '");
            const char *q = memchr(name, '\'', len - (size_t)(name - line));
            size_t nlen = q ? (size_t)(q - name) : len - (size_t)(name - line);
            /* the constants' setter (kernels/codegen.c) is one thread's copy,
             * the engine's plumbing rather than the rule's kernel: not listed */
            bool setter = nlen == strlen(MN_SET_CONSTANTS_KERNEL) && !strncmp(name, MN_SET_CONSTANTS_KERNEL, nlen);
            cur = !setter && n < max ? &out[n++] : NULL;
            if (cur) info_init(cur, name, nlen);
            const char *sm = find_in(line, len, "'sm_");
            if (arch && *arch == 0 && sm) *arch = atoi(sm + 4);
            props = NULL;
        } else if ((p = find_in(line, len, "Function properties for "))) {
            props = p + strlen("Function properties for ");
            props_len = len - (size_t)(props - line);
            while (props_len > 0 && isspace((unsigned char)props[props_len - 1])) props_len--;
        } else if (find_in(line, len, "bytes stack frame")) {
            /* a device function's properties (not an entry) have no record */
            mn_kernel_info *k = props ? find_named(out, n, props, props_len) : cur;
            if (k) {
                k->stack_bytes = number_before(line, len, " bytes stack frame");
                k->spill_stores = number_before(line, len, " bytes spill stores");
                k->spill_loads = number_before(line, len, " bytes spill loads");
            }
        } else if (cur && (p = find_in(line, len, "Used ")) && find_in(p, len - (size_t)(p - line), " registers")) {
            size_t rest = len - (size_t)(p - line);
            cur->registers = (int)number_before(p, rest, " registers");
            /* ptxas leaves out the items that are zero */
            long smem = number_before(p, rest, " bytes smem");
            long bars = number_before(p, rest, " barriers");
            cur->shared_bytes = smem >= 0 ? smem : 0;
            cur->barriers = bars >= 0 ? (int)bars : 0;
        }
        line = nl ? nl + 1 : NULL;
    }
    return n;
}

void mn_ptx_launch_bounds(const char *ptx, mn_kernel_info *k, int n)
{
    for (const char *p = ptx ? strstr(ptx, ".entry ") : NULL; p; p = strstr(p, ".entry ")) {
        p += strlen(".entry ");
        const char *e = p;
        while (*e && *e != '(' && !isspace((unsigned char)*e)) e++;
        mn_kernel_info *ki = find_named(k, n, p, (size_t)(e - p));
        const char *body = strchr(e, '{');
        const char *next = strstr(e, ".entry ");
        const char *mx = strstr(e, ".maxntid");
        if (!ki) continue;
        ki->max_threads = 0;
        if (mx && (!body || mx < body) && (!next || mx < next)) {
            long dim[3] = {1, 1, 1};
            const char *q = mx + strlen(".maxntid");
            for (int i = 0; i < 3; i++) {
                char *end;
                dim[i] = strtol(q, &end, 10);
                for (q = end; *q == ' ' || *q == '\t'; q++) {}
                if (*q != ',') break;
                q++;
            }
            ki->max_threads = (int)(dim[0] * (dim[1] > 0 ? dim[1] : 1) * (dim[2] > 0 ? dim[2] : 1));
        }
    }
}

mn_kernel_info *mn_kernel_set_find(mn_kernel_set *set, const char *name)
{
    return find_named(set->k, set->n, name, strlen(name));
}

mn_status mn_cuda_rule_kernel_info(const mn_rule *r, const mn_dims *d, mn_precision p, int arch, mn_kernel_set *out)
{
    int device_arch = mn_cuda_arch();
    if (arch <= 0) arch = device_arch > 0 ? device_arch : 90;
    mn_cuda_plan pl;
    MN_TRY(mn_cuda_plan_rule(r, d, p, d->B * d->H, arch, arch == device_arch ? mn_cuda_smem_optin() : 0, &pl));
    if (pl.path == MN_PATH_LARGE) pl.path = MN_PATH_GENERAL; /* its kernels are elementwise; the general one is shown */
    char *src = mn_cuda_plan_source(r, d, p, &pl);
    if (!src) return MN_ERR_ARG; /* the code generator said why */
    mn_status s = mn_nvrtc_kernel_info(src, arch, out);
    free(src);
    MN_TRY(s);
    const char *step = mn_cuda_plan_step_kernel(&pl);
    snprintf(out->step_kernel, sizeof out->step_kernel, "%s", step);
    snprintf(out->path, sizeof out->path, "%s", mn_cuda_path_name(pl.path));
    out->cluster = pl.cluster;
    if (!mn_kernel_set_find(out, step))
        return mn_fail(MN_ERR_DEVICE, "kernel info: NVRTC's log for sm_%d names no %s (ptxas -v said nothing)", arch,
                       step);
    for (int i = 0; i < out->n; i++)
        out->k[i].block_threads = strcmp(out->k[i].name, MN_FUSED_STEP_KERNEL) == 0 ? pl.threads : MN_RULE_THREADS;
    if (device_arch == arch && mn_cuda_available()) MN_TRY(mn_cuda_rule_kernel_occupancy(r, d, p, out));
    return MN_OK;
}
