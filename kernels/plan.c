/* plan.c: which CUDA path runs a rule (kernels/plan.h). */
#include "plan.h"
#include "codegen.h"
#include "engine_large.h"
#include "grad_large.h"
#include "rule_kernel.cuh" /* its first part is C: the workspace layout, and param_layout.h */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUSED_THREADS 512
#define SM90_SMEM_OPTIN (227L * 1024)
#define PAD 4 /* floats added to each shared-memory row: conflict-free fragment loads */

const char *mn_cuda_path_name(mn_cuda_path p)
{
    switch (p) {
    case MN_PATH_FUSED: return "fused";
    case MN_PATH_LARGE: return "large";
    default: return "general";
    }
}

static long up16(long x) { return (x + 15) / 16 * 16; }

/* Floats of the parameters in the kernel's padded layout: per layer W
 * [pout x (pin + PAD)] then b [pout] (fused_kernel.cuh's mn_pset_init). */
static long padded_param_floats(const mn_rule *r, const mn_dims *d)
{
    long f = 0;
    for (int i = 0; i < r->layers; i++) {
        long pin = up16(mn_layer_in(i, d->dk, d->dh)), pout = up16(mn_layer_out(i, r->layers, d->dv, d->dh));
        f += pout * (pin + PAD) + (r->bias ? pout : 0);
    }
    return f;
}

/* Must match the carve-up at the top of mn_fused_step_kernel. out_norm adds
 * nothing: its statistics live in the registers of the warp that takes a
 * row (fused_norm.cuh, mn_fused_norm_row), and the one-row forward's
 * output (dv floats) is already here. */
long mn_fused_smem_bytes(const mn_rule *r, const mn_dims *d, int rows)
{
    long dk = up16(d->dk), dv = up16(d->dv), dh = r->layers > 1 ? up16(d->dh) : 0;
    long f = padded_param_floats(r, d);
    f += rows * (dk + PAD);                                    /* x */
    if (r->layers > 1) f += 2L * rows * (dh + PAD);            /* z (then dz), h */
    f += 2L * rows * (dv + PAD);                               /* y (then loss terms), dy */
    f += dk + dh + dv + rows;                                  /* one row's forward, row losses */
    return f * (long)sizeof(float);
}

/* The step kernel's static shared memory: the block sums' partials (and
 * newton_schulz's, mn_ns_block_sum's 32 doubles; a cluster's sums,
 * mn_cl_sums's: the parameters' gradient squares, the step's loss and the
 * last step's weight squares), and a little. */
static long fused_static_smem(const mn_rule *r, int threads, int cluster)
{
    long fixed = 64 + 8L * r->layers * (r->bias ? 2 : 1) * (threads / 32);
    if (r->precondition != MN_PRECOND_NONE) fixed += 8L * 32;
    if (cluster > 1) fixed += 8L * (r->layers * (r->bias ? 2 : 1) + 2);
    return fixed;
}

/* The dims of one block's share of a memory: with a cluster, its slice of
 * the hidden units (fused_kernel.cuh's MN_DH). */
static mn_dims block_slice(const mn_dims *d, int cluster)
{
    mn_dims slice = *d;
    if (cluster > 1) slice.dh = d->dh / cluster;
    return slice;
}

/* Floats of a block's step gradient G (unpadded, every parameter in order;
 * a cluster's block: its slice's), each parameter's rounded up to whole
 * float4s, as mn_fused_step_kernel lays them out. */
static long fused_grad_floats(const mn_rule *r, const mn_dims *d, int cluster)
{
    const mn_dims slice = block_slice(d, cluster);
    mn_param_layout lo;
    mn_param_layout_init(&lo, r->layers, r->bias, r->glu, slice.dk, slice.dv, slice.dh);
    long floats = 0;
    for (int p = 0; p < lo.nparams; p++) floats += (long)((lo.numel[p] + 3) & ~3LL);
    return floats;
}

/* Whether the fused kernel holds one memory of the rule at the dims, in one
 * block or, cluster > 1, split by hidden units over that many blocks (the
 * dims' hidden the whole memory's): the rows per chunk and the shared
 * memory of a block if so, why not if not. */
static int fused_fit(const mn_rule *r, const mn_dims *d, int cluster, long limit, int threads, char *why, size_t wlen,
                     int *rows_out, long *smem_out)
{
    if (r->layers > 2) {
        snprintf(why, wlen, "%d layers: the fused path covers 1 and 2", r->layers);
        return 0;
    }
    if (d->dk > 128 || d->dv > 128) {
        snprintf(why, wlen, "dk=%lld, dv=%lld: the fused path needs both <= 128", (long long)d->dk,
                 (long long)d->dv);
        return 0;
    }
    long wide = d->dk > d->dv ? d->dk : d->dv;
    if (r->layers == 2 && d->dh > 4 * wide) {
        snprintf(why, wlen, "hidden=%lld > 4 x max(dk, dv) = %ld: outside the fused path", (long long)d->dh,
                 4 * wide);
        return 0;
    }
    long first = up16(r->step < 64 ? r->step : 64);
    long fixed = fused_static_smem(r, threads, cluster);
    const mn_dims slice = block_slice(d, cluster);
    for (int rows = 64; rows >= 16; rows /= 2) {
        if (rows > first) continue;
        long need = mn_fused_smem_bytes(r, &slice, rows);
        if (need + fixed <= limit) {
            *rows_out = rows;
            *smem_out = need;
            return 1;
        }
    }
    snprintf(why, wlen, "the weights and 16 rows of activations need %ld KB of shared memory, the device has %ld KB",
             mn_fused_smem_bytes(r, d, 16) / 1024, limit / 1024);
    return 0;
}

/* The cluster sizes tried, smallest first: 8 is the portable maximum. */
#define MAX_CLUSTER 8

/* An experiment's knob that takes 1, 2, 4 or 8 (MNEMO_FUSED_CLUSTER,
 * MNEMO_FUSED_KUNROLL): its value, or 0 when unset or anything else. */
static int power_knob(const char *name)
{
    const char *v = getenv(name);
    if (v && (!strcmp(v, "1") || !strcmp(v, "2") || !strcmp(v, "4") || !strcmp(v, "8"))) return atoi(v);
    return 0;
}

/* Splits a 2-layer memory that one block cannot hold over a cluster
 * (sm_90): the smallest cluster whose blocks take chunks of at least 32
 * rows (or the step's, if shorter), else the smallest that fits at all; 0
 * if none does. MNEMO_FUSED_CLUSTER=N (1, 2, 4 or 8), an experiment's and
 * the tests' knob, asks for N blocks a memory wherever a cluster can run the
 * rule, even one that fits a block (1: never a cluster). */
static int cluster_fit(const mn_rule *r, const mn_dims *d, int arch, long limit, int threads, bool one_fits,
                       int *rows_out, long *smem_out)
{
    const int want = power_knob("MNEMO_FUSED_CLUSTER");
    if (want == 1 || (one_fits && want == 0)) return 0;
    /* what the cluster kernel splits: a 2-layer memory without gates or newton_schulz (fused_kernel.cuh) */
    if (arch < 90 || r->layers != 2 || r->glu || r->precondition != MN_PRECOND_NONE) return 0;
    char why[256];
    long first = up16(r->step < 64 ? r->step : 64), enough = first < 32 ? first : 32;
    int best = 0, best_rows = 0;
    long best_smem = 0;
    for (int c = want ? want : 2; c <= (want ? want : MAX_CLUSTER); c *= 2) {
        int rows = 0;
        long smem = 0;
        if (d->dh % c || !fused_fit(r, d, c, limit, threads, why, sizeof why, &rows, &smem)) continue;
        if (!best || (best_rows < enough && rows >= enough)) best = c, best_rows = rows, best_smem = smem;
        if (rows >= enough) break;
    }
    if (best) *rows_out = best_rows, *smem_out = best_smem;
    return best;
}

/* The opt-in shared memory per block of an sm, when no device says. */
static long smem_of_arch(int arch)
{
    if (arch >= 90) return SM90_SMEM_OPTIN;
    if (arch == 80 || arch == 87) return 163L * 1024;
    if (arch >= 86) return 99L * 1024;
    return 48L * 1024;
}

/* Whether two blocks of smem bytes of dynamic shared memory each fit on an
 * SM whose blocks may opt into smem_limit: the SM has 1 KB more than that,
 * and keeps 1 KB a block. */
static bool two_blocks_fit(long smem, long smem_limit) { return 2 * (smem + 2048) <= smem_limit + 1024; }

/* Appends text to the "; "-separated list of reasons in buf. */
static void add_text(char *buf, size_t len, const char *text)
{
    size_t used = strlen(buf);
    snprintf(buf + used, len - used, "%s%s", used ? "; " : "", text);
}

/* Appends "what[ value]: the fused and general paths run it|them" to the list in buf. */
static void add_reason(char *buf, size_t len, const char *what, const char *value, const char *pronoun)
{
    char one[128];
    snprintf(one, sizeof one, "%s%s%s: the fused and general paths run %s", what, value ? " " : "", value ? value : "",
             pronoun);
    add_text(buf, len, one);
}

mn_status mn_cuda_plan_rule(const mn_rule *r, const mn_dims *d, mn_precision p, int64_t memories, int arch,
                            long smem_limit, mn_cuda_plan *out)
{
    (void)p;
    memset(out, 0, sizeof *out);
    if (arch <= 0) arch = 90;
    if (smem_limit <= 0) smem_limit = smem_of_arch(arch);
    out->threads = FUSED_THREADS;
    /* an experiment's knob: the fused block size (256 or 512) */
    const char *ft = getenv("MNEMO_FUSED_THREADS");
    if (ft && (strcmp(ft, "256") == 0 || strcmp(ft, "512") == 0)) out->threads = atoi(ft);
    out->pdk = (int)up16(d->dk);
    out->pdv = (int)up16(d->dv);
    out->pdh = r->layers > 1 ? (int)up16(d->dh) : 0;
    out->cluster = 1;
    char nofuse[256];
    int rows = 0;
    long smem = 0;
    int fused = fused_fit(r, d, 1, smem_limit, out->threads, nofuse, sizeof nofuse, &rows, &smem);
    {
        int crows = 0;
        long csmem = 0;
        int c = cluster_fit(r, d, arch, smem_limit, out->threads, fused, &crows, &csmem);
        if (c > 1) {
            fused = 1, rows = crows, smem = csmem;
            out->cluster = c;
            out->dh = (int)d->dh;
            out->pdh = (int)up16(d->dh / c);
        }
    }
    if (fused && arch < 80) { /* mma.sync on tf32 and bf16 operands came with sm_80 */
        snprintf(nofuse, sizeof nofuse, "sm_%d: the fused path's tensor-core products need sm_80 or newer", arch);
        fused = 0;
    }
    long big = d->dk;
    if (d->dv > big) big = d->dv;
    if (r->layers > 1 && d->dh > big) big = d->dh;

    /* glu: the fused path cannot hold the gates (1.5x the weights) in shared
     * memory; the general and large paths run it (the large path from a
     * dimension of 256, as any rule) */
    const bool glu = r->glu && r->layers > 1;
    /* What the fused path runs but the large path does not: where the fused
     * path does not fit, the general path takes it instead of the large one. */
    char no_large[400] = "";
    if (r->out_norm != MN_NORM_NONE)
        add_reason(no_large, sizeof no_large, "out_norm", mn_part_name(&mn_norm_set, r->out_norm), "it");
    /* qk_norm, newton_schulz and lengths (an input) run on every path */
    char no_fast[256] = "";
    if (glu)
        add_text(no_fast, sizeof no_fast,
                 no_large[0] ? "glu: the general path runs it" : "glu: the general and large paths run it");
    if (no_fast[0]) {
        /* a rule the fused path could not hold anyway keeps that reason too */
        if (!fused) add_text(nofuse, sizeof nofuse, no_fast);
        else snprintf(nofuse, sizeof nofuse, "%s", no_fast);
        fused = 0;
    }

    const char *force = getenv("MNEMO_CUDA_PATH");
    if (force && *force && strcmp(force, "auto") != 0) {
        out->forced = true;
        if (strcmp(force, "general") == 0) {
            out->path = MN_PATH_GENERAL;
            snprintf(out->why, sizeof out->why, "MNEMO_CUDA_PATH=general");
        } else if (no_fast[0] && strcmp(force, "fused") == 0) {
            return mn_fail(MN_ERR_UNSUPPORTED, "MNEMO_CUDA_PATH=fused: %s, not the fused path", no_fast);
        } else if (no_large[0] && strcmp(force, "large") == 0) {
            return mn_fail(MN_ERR_UNSUPPORTED, "MNEMO_CUDA_PATH=large: %s, not the large path", no_large);
        } else if (strcmp(force, "fused") == 0) {
            if (!fused) return mn_fail(MN_ERR_UNSUPPORTED, "MNEMO_CUDA_PATH=fused: %s", nofuse);
            out->path = MN_PATH_FUSED;
            snprintf(out->why, sizeof out->why, "MNEMO_CUDA_PATH=fused");
        } else if (strcmp(force, "large") == 0) {
            out->path = MN_PATH_LARGE;
            snprintf(out->why, sizeof out->why, "MNEMO_CUDA_PATH=large");
        } else {
            return mn_fail(MN_ERR_ARG, "MNEMO_CUDA_PATH=%s: expected general, fused, large or auto", force);
        }
    } else if (fused && out->cluster > 1) {
        out->path = MN_PATH_FUSED;
        snprintf(out->why, sizeof out->why,
                 "2 layers, dk=%lld, dv=%lld, hidden %lld split over a cluster of %d blocks: each keeps %lld hidden "
                 "unit%s' weights in shared memory (%ld KB with %d-row chunks)",
                 (long long)d->dk, (long long)d->dv, (long long)d->dh, out->cluster, (long long)d->dh / out->cluster,
                 d->dh / out->cluster == 1 ? "" : "s", smem / 1024, rows);
    } else if (fused) {
        out->path = MN_PATH_FUSED;
        snprintf(out->why, sizeof out->why,
                 "%d layer%s, dk=%lld, dv=%lld%s: the weights stay in shared memory (%ld KB with %d-row chunks)",
                 r->layers, r->layers == 1 ? "" : "s", (long long)d->dk, (long long)d->dv,
                 r->layers > 1 ? ", hidden within 4 d" : "", smem / 1024, rows);
    } else if (big >= 256 && !no_large[0]) {
        out->path = MN_PATH_LARGE;
        snprintf(out->why, sizeof out->why, "a dimension of %ld >= 256 (%s): cuBLAS products, steps from a CUDA graph",
                 big, nofuse);
    } else if (glu && !no_large[0] && big < 256) {
        out->path = MN_PATH_GENERAL;
        snprintf(out->why, sizeof out->why, "%s; every dimension below 256 (the largest %ld): the general path", nofuse,
                 big);
    } else {
        out->path = MN_PATH_GENERAL;
        /* where the large path would have taken it, say what kept it away too */
        bool large_size = big >= 256;
        snprintf(out->why, sizeof out->why, "%s%s%s", nofuse, large_size ? "; " : "", large_size ? no_large : "");
    }
    if (out->path == MN_PATH_FUSED) {
        out->rows = rows;
        out->smem_bytes = smem;
        /* Two blocks an SM where both fit (two_blocks_fit): at 256 threads
         * and at most 128 registers a thread each, two memories' barriers
         * and latencies interleave on one SM instead of one memory's 16
         * warps. */
        out->min_blocks = 1;
        if (out->threads == 256 && out->cluster == 1 && two_blocks_fit(smem, smem_limit)) out->min_blocks = 2;
        /* The step's gradient G in shared memory, after the chunk buffers,
         * where it fits beside them without costing a block an SM (M1's
         * 64-128-64 memory, a linear 64 x 64 one; not P1's): the update then
         * reads G at shared memory's latency, not L2's, and no step writes
         * it out. MNEMO_FUSED_GSHARED=0, an experiment's knob, keeps it in
         * the workspace. */
        const char *gs = getenv("MNEMO_FUSED_GSHARED");
        const long gbytes = (long)sizeof(float) * fused_grad_floats(r, d, out->cluster),
                   fixed = fused_static_smem(r, out->threads, out->cluster);
        if (!(gs && !strcmp(gs, "0")) && out->min_blocks == 1 && smem + gbytes + fixed <= smem_limit) {
            out->g_shared = true;
            out->smem_bytes += gbytes;
            const size_t used = strlen(out->why);
            snprintf(out->why + used, sizeof out->why - used, "; the step's gradient beside them (%ld KB)",
                     gbytes / 1024);
            /* its rows swizzled (fused_wgrad.cuh's MN_G_SWZ) in tf32 and
             * bf16, measured faster on an H200 (kernel ms, 2026-11-28):
             * M1 tf32 5.16 -> 5.13, bf16 5.44 -> 5.35; P1-lin tf32 0.367 ->
             * 0.357, bf16 0.429 -> 0.421. fp32 not measured. MNEMO_FUSED_GSWZ
             * =0 or 1, an experiment's knob, sets it. */
            const char *sw = getenv("MNEMO_FUSED_GSWZ");
            out->g_swizzle = sw && (!strcmp(sw, "0") || !strcmp(sw, "1"))
                                 ? !strcmp(sw, "1")
                                 : p == MN_PREC_TF32 || p == MN_PREC_BF16;
            if (r->precondition != MN_PRECOND_NONE) out->g_swizzle = false;
        }
        /* bf16's weights in shared memory as bf16 rows, the anchor's and
         * the current W's (fused_kernel.cuh's MN_W16), where W lives in the
         * workspace (refresh > step) and they fit, ahead of MN_ZPAD below:
         * they take P's room but for the rows' pads (4 floats a row). The
         * retrieval at W then reads no weights from L2 (measured, H200,
         * 2026-11-29: tests/bench/RESULTS.md). MNEMO_FUSED_W16=0, an
         * experiment's knob, keeps the floats. */
        const char *w16 = getenv("MNEMO_FUSED_W16");
        const long w16bytes = 16L * (up16(d->dh) + up16(d->dv)); /* the two layers' rows: 4 floats more each */
        if (!(w16 && !strcmp(w16, "0")) && p == MN_PREC_BF16 && r->layers == 2 && mn_rule_refresh(r) != r->step &&
            out->cluster == 1 && !out->g_shared && r->precondition == MN_PRECOND_NONE && d->dk % 4 == 0 &&
            d->dv % 4 == 0 && d->dh % 4 == 0 && out->min_blocks == 1 &&
            out->smem_bytes + w16bytes + fixed <= smem_limit) {
            out->w16 = true;
            out->smem_bytes += w16bytes;
        }
        /* bf16's z rows 4 floats wider (fused_kernel.cuh's MN_ZPAD: the
         * epilogues' pairs then meet no bank conflicts), decided last: only
         * where they fit beside the rows and the blocks an SM chosen above,
         * and not beside G (measured, H200, 2026-11-29, step kernel: H1
         * and H2 0.8% faster, P1-c16 0.2-0.4%; M1, whose G is here, 3.5%
         * slower, and as slow with the 256 bytes allocated and its z rows
         * as before: the allocation, not the layout, which the SM's
         * carve-out steps do not explain). Not P1 either, whose 32 rows
         * fill the SM: there MN_ZROT turns z's odd rows instead.
         * MNEMO_FUSED_ZPAD=0, an experiment's knob, keeps them PAD wide. */
        const char *zp = getenv("MNEMO_FUSED_ZPAD");
        const long zbytes = (long)sizeof(float) * 4 * rows;
        if (!(zp && !strcmp(zp, "0")) && p == MN_PREC_BF16 && r->layers == 2 && !out->g_shared &&
            out->smem_bytes + zbytes + fixed <= smem_limit &&
            (out->min_blocks == 1 || two_blocks_fit(out->smem_bytes + zbytes, smem_limit))) {
            out->z_pad = true;
            out->smem_bytes += zbytes;
        }
        /* The unroll of the products' K loops, as measured fastest on an H100
         * (tests/bench/RESULTS.md): fp32 4 (P1 -5% and M1 -13% against 8,
         * 2026-11-26), tf32 8 (M1's forward 16% slower at 4). bf16 takes k
         * in steps of 16, so 8 unrolls a linear memory's K loops in full, and
         * ptxas spilled 152 bytes of P1-lin's step kernel (none at 2); kernel
         * ms at 8 -> 2 (2026-11-28): P1-lin 0.506 -> 0.464, P1 3.84 -> 3.78,
         * P1-c16 16.5 -> 16.0, H1 4.36 -> 4.32 (hidden 256, a slice of 128 a
         * block), but M1 (hidden 128) 5.73 -> 6.01: 2 for a linear memory
         * and hidden widths from 256, else 8. tf32 after the kernels compiled
         * their q and lengths code only where given (2026-11-28, 4 against
         * 8, two rounds): P1 3.18, 3.22 against 3.25, 3.28, H1 3.53 against
         * 3.57, 3.60, H2 5.36, 5.39 against 5.45, 5.45; but M1 5.80 against
         * 5.10, P1-c16 15.6, 15.7 against 15.2, 15.7 and P1-lin 0.379
         * against 0.366: 4 for hidden widths from 256 on steps of 64 rows and
         * more, else 8. MNEMO_FUSED_KUNROLL sets it. */
        if (p == MN_PREC_FP32) out->kunroll = 4;
        else if (p == MN_PREC_TF32) out->kunroll = r->layers > 1 && d->dh >= 256 && r->step >= 64 ? 4 : 8;
        else out->kunroll = r->layers == 1 || d->dh >= 256 ? 2 : 8;
        const int knob = power_knob("MNEMO_FUSED_KUNROLL");
        if (knob) out->kunroll = knob;
    } else {
        out->cluster = 1;
        out->pdh = r->layers > 1 ? (int)up16(d->dh) : 0;
    }
    (void)memories;
    return MN_OK;
}

/* An experiment's knob that defines a macro into the fused source: env set
 * to "0" (or to "1" where ones) appends "#define MACRO VALUE" to the used
 * bytes of buf (len in all); unset or anything else, nothing. Returns the
 * bytes used, as snprintf counts them. */
static int knob_define(char *buf, size_t len, int used, const char *env, const char *macro, bool ones)
{
    const char *v = getenv(env);
    if (used <= 0 || (size_t)used >= len || !v || !(!strcmp(v, "0") || (ones && !strcmp(v, "1")))) return used;
    return used + snprintf(buf + used, len - (size_t)used, "#define %s %s\n", macro, v);
}

void mn_fused_defines(const mn_cuda_plan *pl, char *buf, size_t len)
{
    int used = snprintf(buf, len,
                        "#define MN_FUSED_ROWS %d\n#define MN_FUSED_THREADS %d\n#define MN_PDK %d\n#define MN_PDV %d\n"
                        "#define MN_PDH %d\n#define MN_FUSED_PAD %d\n#define MN_RULE_THREADS %d\n",
                        pl->rows, pl->threads, pl->pdk, pl->pdv, pl->pdh, PAD, pl->threads);
    if (used > 0 && (size_t)used < len && pl->min_blocks > 1)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_FUSED_MINB %d\n", pl->min_blocks);
    if (used > 0 && (size_t)used < len && pl->g_shared)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_G_SHARED 1\n");
    if (used > 0 && (size_t)used < len && pl->g_swizzle)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_G_SWZ 1\n");
    if (used > 0 && (size_t)used < len && pl->z_pad)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_ZPAD 1\n");
    if (used > 0 && (size_t)used < len && pl->w16)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_W16 1\n");
    /* the step kernel's code for q and for lengths only where the run gives
     * them: a run without either (most) compiles without a retrieval pass
     * and the padding's tail it never takes (P1's quick compile 0.57 ->
     * 0.45 s on the 2-core VM, the optimised one 1.32 -> 1.10 s without q) */
    if (used > 0 && (size_t)used < len && pl->with_q)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_WITH_Q 1\n");
    if (used > 0 && (size_t)used < len && pl->with_lengths)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_WITH_LENGTHS 1\n");
    if (used > 0 && (size_t)used < len && pl->cluster > 1)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_CLUSTER %d\n#define MN_DH_FULL %d\n", pl->cluster,
                         pl->dh);
    /* the unroll of the products' K loops the plan chose (0: fused_gemm.cuh's
     * default, the backward's 1); MNEMO_FUSED_KUNROLL, an experiment's knob
     * (1, 2, 4 or 8), sets it for the forward and the backward: it trades
     * NVRTC time and stack for overlap of the loads with the tensor cores */
    if (used > 0 && (size_t)used < len && pl->kunroll)
        used += snprintf(buf + used, len - (size_t)used, "#define MN_KUNROLL %d\n", pl->kunroll);
    /* and MNEMO_FUSED_LDSM=0 or 1: the products' operands loaded by
     * ldmatrix or not (fused_gemm.cuh's mn_gemm; by default in tf32 only) */
    used = knob_define(buf, len, used, "MNEMO_FUSED_LDSM", "MN_LDSM", true);
    /* and MNEMO_FUSED_ZROT=0: z's odd rows not turned (fused_kernel.cuh's
     * MN_ZROT, bf16 where the plan has no room for MN_ZPAD), to measure */
    used = knob_define(buf, len, used, "MNEMO_FUSED_ZROT", "MN_ZROT", false);
    /* and MNEMO_FUSED_WROT=0: bf16's weights in plain rows in shared memory
     * (fused_gemm.cuh's MN_WROT turns their odd rows), to measure */
    used = knob_define(buf, len, used, "MNEMO_FUSED_WROT", "MN_WROT", false);
    /* and MNEMO_FUSED_H16: bf16's operands kept in floats (0), as before
     * their producers stored them as bf16 (fused_gemm.cuh's MN_H16); or h
     * alone stored so (h), or all but dL/dy (hx); 1: the default, all: to
     * measure */
    const char *h16 = getenv("MNEMO_FUSED_H16");
    const char *h16_def = !h16                  ? 0
                          : !strcmp(h16, "0")  ? "#define MN_H16 0\n"
                          : !strcmp(h16, "h")  ? "#define MN_H16_X 0\n"
                          : !strcmp(h16, "hx") ? "#define MN_H16_DY 0\n"
                                               : 0;
    if (used > 0 && (size_t)used < len && h16_def) snprintf(buf + used, len - (size_t)used, "%s", h16_def);
}

long mn_fused_work_floats(const mn_rule *r, const mn_dims *d, const mn_cuda_plan *pl)
{
    const long g = pl->g_shared ? 0 : fused_grad_floats(r, d, pl->cluster);
    if (mn_rule_refresh(r) == r->step) return g;
    /* and W in the padded layout (a block's slice) when the gradient point is the anchor */
    const mn_dims slice = block_slice(d, pl->cluster);
    return g + padded_param_floats(r, &slice);
}

const char *const *mn_cuda_plan_parts(const mn_cuda_plan *pl, char *defs, size_t size, const char **defines)
{
    static const char *const fused[] = {"update_math", "rule_kernel", "fused_norm", "fused_gemm", "fused_cluster",
                                        "fused_kernel", "fused_wgrad", "fused_step", NULL};
    static const char *const general[] = {"update_math", "rule_kernel", NULL}; /* mn_cuda_rule_source's */
    *defines = NULL;
    if (pl->path == MN_PATH_LARGE) return mn_large_templates;
    if (pl->path != MN_PATH_FUSED) return general;
    mn_fused_defines(pl, defs, size);
    /* an experiment's knob: MNEMO_FUSED_STREAM=0 takes the step kernel's
     * evict-first hints on its inputs and outputs away (fused_kernel.cuh) */
    int used = knob_define(defs, size, (int)strlen(defs), "MNEMO_FUSED_STREAM", "MN_STREAM", false);
    /* and MNEMO_FUSED_DISCARD=0 or 1: the update's read of G drops its L2
     * lines (1) or leaves them to be written back (0); unset, where W is in
     * the workspace (fused_kernel.cuh's MN_DISCARD) */
    knob_define(defs, size, used, "MNEMO_FUSED_DISCARD", "MN_DISCARD", true);
    /* and MNEMO_FUSED_PROFILE: the step kernel's phase counters (fused_kernel.cuh's MN_PROFILE) */
    if (getenv("MNEMO_FUSED_PROFILE")) snprintf(defs + strlen(defs), size - strlen(defs), "#define MN_PROFILE 1\n");
    *defines = defs;
    return fused;
}

char *mn_cuda_plan_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl)
{
    char defs[512];
    const char *defines;
    const char *const *templates = mn_cuda_plan_parts(pl, defs, sizeof defs, &defines);
    return mn_cuda_source_for(r, d, p, templates, defines);
}

const char *mn_cuda_plan_step_kernel(const mn_cuda_plan *pl)
{
    return pl->path == MN_PATH_FUSED ? MN_FUSED_STEP_KERNEL : MN_RULE_STEP_KERNEL;
}

long mn_fused_padded_floats(const mn_rule *r, const mn_dims *d) { return padded_param_floats(r, d); }

/* Must match the carve-up at the top of mn_fused_grad_kernel. */
long mn_fused_grad_smem_bytes(const mn_rule *r, const mn_dims *d, int rows)
{
    long dk = up16(d->dk), dv = up16(d->dv), dh = r->layers > 1 ? up16(d->dh) : 0;
    long f = padded_param_floats(r, d);
    f += rows * (dk + PAD);                         /* x */
    if (r->layers > 1) f += 4L * rows * (dh + PAD); /* z, h (hbar, zbar), zd, hd (hdbar, zdbar) */
    f += 3L * rows * (dv + PAD);                    /* y (ybar), u, ubar */
    f += rows;                                      /* which rows have a non-finite x */
    return f * (long)sizeof(float);
}

mn_status mn_cuda_plan_backward(const mn_rule *r, const mn_dims *d, mn_precision p, int arch, long smem_limit,
                                mn_cuda_plan *out)
{
    memset(out, 0, sizeof *out);
    out->cluster = 1;
    if (arch <= 0) arch = 90;
    if (smem_limit <= 0) smem_limit = smem_of_arch(arch);
    const char *force = getenv("MNEMO_CUDA_BACKWARD");
    const bool force_general = force && strcmp(force, "general") == 0, force_fused = force && strcmp(force, "fused") == 0;
    const bool force_large = force && strcmp(force, "large") == 0;
    if (force && *force && !force_general && !force_fused && !force_large && strcmp(force, "cpu") != 0 &&
        strcmp(force, "auto") != 0)
        return mn_fail(MN_ERR_ARG, "MNEMO_CUDA_BACKWARD=%s: expected general, fused, large, cpu or auto", force);
    out->path = MN_PATH_GENERAL;
    out->forced = force_general || force_fused || force_large;
    if (force_general) {
        snprintf(out->why, sizeof out->why, "MNEMO_CUDA_BACKWARD=general");
        return MN_OK;
    }
    /* what the large backward (kernels/grad_large.c) does not run */
    char nolarge[128] = "";
    if (r->out_norm != MN_NORM_NONE)
        snprintf(nolarge, sizeof nolarge, "out_norm %s", mn_part_name(&mn_norm_set, r->out_norm));
    else if (r->glu && r->layers > 1) snprintf(nolarge, sizeof nolarge, "glu");
    else if (r->precondition == MN_PRECOND_NEWTON_SCHULZ) snprintf(nolarge, sizeof nolarge, "newton_schulz");
    if (force_large) {
        if (nolarge[0])
            return mn_fail(MN_ERR_UNSUPPORTED, "MNEMO_CUDA_BACKWARD=large: %s: the large backward does not run it",
                           nolarge);
        out->path = MN_PATH_LARGE;
        snprintf(out->why, sizeof out->why, "MNEMO_CUDA_BACKWARD=large");
        return MN_OK;
    }
    /* why not fused, if not */
    char why[384] = "";
    mn_cuda_plan fwd;
    mn_status s = mn_cuda_plan_rule(r, d, p, d->B * d->H, arch, smem_limit, &fwd);
    if (s != MN_OK) return s;
    int rows = 0;
    long smem = 0;
    if (r->out_norm != MN_NORM_NONE) {
        /* the fused forward runs it, the fused backward does not (yet) */
        snprintf(why, sizeof why, "out_norm %s: the general backward runs it", mn_part_name(&mn_norm_set, r->out_norm));
    } else if (r->glu && r->layers > 1) {
        /* as the fused forward, the fused backward's shared memory holds no gates */
        snprintf(why, sizeof why, "glu: the general backward runs it");
    } else if (fwd.path == MN_PATH_LARGE && !nolarge[0] && !force_fused) {
        out->path = MN_PATH_LARGE;
        snprintf(out->why, sizeof out->why,
                 "the forward's large path (%.200s): cuBLAS products batched over the memories, the forward's own "
                 "steps recomputed",
                 fwd.why);
        return MN_OK;
    } else if (fwd.path == MN_PATH_FUSED && fwd.cluster > 1) {
        /* the fused backward holds a whole memory in one block (out_norm,
         * which the large backward does not run, went to the general one above) */
        snprintf(why, sizeof why,
                 "the forward splits each memory over a cluster of %d blocks, the fused backward holds one in a block",
                 fwd.cluster);
        if (!force_fused) {
            out->path = MN_PATH_LARGE;
            snprintf(out->why, sizeof out->why, "%s: the large backward, cuBLAS products batched over the memories",
                     why);
            return MN_OK;
        }
    } else if (fwd.path != MN_PATH_FUSED) {
        snprintf(why, sizeof why, "the forward takes the %s path (%.250s)%s%s%s", mn_cuda_path_name(fwd.path), fwd.why,
                 nolarge[0] ? "; " : "", nolarge, nolarge[0] ? ": the general backward runs it" : "");
    } else {
        long first = up16(r->step < 64 ? r->step : 64);
        long fixed = 64 + 8L * mn_param_count(r->layers, r->bias) * (fwd.threads / 32) + 8L * (fwd.threads / 32);
        for (int rw = 64; rw >= 16 && !rows; rw /= 2) {
            if (rw > first) continue;
            long need = mn_fused_grad_smem_bytes(r, d, rw);
            if (need + fixed <= smem_limit) rows = rw, smem = need;
        }
        if (!rows)
            snprintf(why, sizeof why,
                     "its weights and 16 rows of the backward's buffers need %ld KB of shared memory, the device has %ld KB",
                     mn_fused_grad_smem_bytes(r, d, 16) / 1024, smem_limit / 1024);
    }
    if (why[0]) {
        if (force_fused) return mn_fail(MN_ERR_UNSUPPORTED, "MNEMO_CUDA_BACKWARD=fused: %s", why);
        snprintf(out->why, sizeof out->why, "%s", why);
        return MN_OK;
    }
    *out = fwd;
    out->min_blocks = 1; /* the forward's: the backward's block is compiled for one an SM */
    out->g_swizzle = false; /* the forward's G layout: the backward keeps its own */
    out->z_pad = false;     /* and its z rows PAD wide */
    out->w16 = false;       /* and its weights in floats */
    out->kunroll = power_knob("MNEMO_FUSED_KUNROLL"); /* unset: fused_gemm.cuh's backward default */
    out->forced = force_fused;
    out->rows = rows;
    out->smem_bytes = smem;
    snprintf(out->why, sizeof out->why,
             "%sthe forward's fused path: the gradient point (%s) stays in shared memory (%ld KB with %d-row "
             "chunks), the adjoints in the workspace",
             force_fused ? "MNEMO_CUDA_BACKWARD=fused; " : "",
             mn_rule_refresh(r) == r->step ? "W^(s), refresh = step" : "the refresh block's anchor", smem / 1024, rows);
    return MN_OK;
}

char *mn_cuda_fused_grad_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl)
{
    static const char *const parts[] = {"update_math", "rule_kernel", "fused_norm", "fused_gemm",
                                        "fused_cluster", "fused_kernel", "fused_wgrad", "grad_common",
                                        "grad_ns_adjoint", "fused_grad_model", "fused_grad", NULL};
    char defs[320];
    mn_fused_defines(pl, defs, sizeof defs);
    size_t used = strlen(defs);
    snprintf(defs + used, sizeof defs - used, "#define MN_GRAD_SOURCE 1\n#define MN_FUSED_GRAD 1\n%s",
             getenv("MNEMO_FG_PROFILE") ? "#define MN_PROFILE 1\n" : "");
    return mn_cuda_grad_source_for(r, d, p, parts, defs);
}

char *mn_cuda_plan_backward_source(const mn_rule *r, const mn_dims *d, mn_precision p, const mn_cuda_plan *pl)
{
    if (pl->path == MN_PATH_FUSED) return mn_cuda_fused_grad_source(r, d, p, pl);
    if (pl->path == MN_PATH_LARGE) return mn_cuda_large_grad_source(r, d, p);
    return mn_cuda_grad_source(r, d);
}

/* Appends "what: its backward runs on the cpu" to the "; "-separated list in why. */
static void add_cpu_backward(char *why, size_t len, const char *what)
{
    size_t used = strlen(why);
    if (used + 1 < len) snprintf(why + used, len - used, "%s%.100s: its backward runs on the cpu", used ? "; " : "", what);
}

bool mn_cuda_backward_covers(const mn_rule *r, char *why, size_t len)
{
    /* a switch for tests and comparisons, as MNEMO_CUDA_PATH is for the forward */
    const char *force = getenv("MNEMO_CUDA_BACKWARD");
    if (force && strcmp(force, "cpu") == 0) {
        snprintf(why, len, "MNEMO_CUDA_BACKWARD=cpu");
        return false;
    }
    return mn_cuda_backward_rule_covers(r, why, len);
}

bool mn_cuda_backward_rule_covers(const mn_rule *r, char *why, size_t len)
{
    why[0] = '\0';
    /* what the CUDA backward does not run in this version: the CPU's backward takes those runs */
    char one[128];
    if (mn_rule_device_check(r, MN_CUDA) != MN_OK) {
        snprintf(one, sizeof one, "%.100s", mn_last_error());
        add_cpu_backward(why, len, one);
    }
    if (mn_param_count_glu(r->layers, r->bias, r->glu && r->layers > 1) > MN_RULE_MAX_PARAMS)
        add_cpu_backward(why, len, "more parameters than the kernel takes");
    return why[0] == '\0';
}
