/* test_codegen.c: the generated CUDA source of the rule engine compiles with
 * NVRTC for sm_90 (no GPU needed) for rules covering every loss, activation
 * and clip kind, custom expressions with constants, 1-3 layers, residual,
 * both retrieve modes, refresh 0 / c / a multiple, long steps (chunked rows)
 * and the three precisions; constants are folded into literals; the cache
 * key changes with each of its inputs; a broken source fails with NVRTC's
 * log; the disk cache writes and reads a CUBIN; newton_schulz sources
 * compile and plan to the general path; out_norm sources compile on the
 * general and fused paths and plan to the fused path where it fits, its
 * backward's on the general path, where the backward's plan sends it. */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "rule_cases.h"
#include "engine.h"
#include "../../kernels/codegen.h"
#include "../../kernels/engine_large.h"
#include "../../kernels/grad_large.h"
#include "../../kernels/nvrtc.h"
#include "../../kernels/plan.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>


static const rule_case cases[] = {
    {"linear_mse", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 1, -1,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 8, 8, 0, false, false},
    {"linear_l1_norm_tf32", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_L1, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 4, 0,
     MN_RETRIEVE_BEFORE, MN_PREC_TF32, 16, 4, 0, true, true},
    {"mlp2_gelu_huber_softnorm_tensor", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 3, 6, MN_RETRIEVE_AFTER, MN_PREC_FP32, 5, 7, 9, false, false},
    {"mlp2_relu_lp_value_bf16", 2, 0, 1, MN_ACT_RELU, NULL, MN_LOSS_LP, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL, NULL, 2,
     2, MN_RETRIEVE_BEFORE, MN_PREC_BF16, 6, 6, 12, false, true},
    {"mlp3_tanh_dot_residual", 3, 1, 1, MN_ACT_TANH, NULL, MN_LOSS_DOT, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 1,
     0, MN_RETRIEVE_AFTER, MN_PREC_TF32, 4, 4, 16, true, false},
    {"mlp2_identity_custom_scale", 2, 1, 0, MN_ACT_IDENTITY, NULL, MN_LOSS_CUSTOM, "w*(y - v)^2 + c3*abs(r)^3",
     MN_CLIP_SCALE, MN_SCOPE_GLOBAL, "exp(-n/(n + m))", 5, 10, MN_RETRIEVE_AFTER, MN_PREC_FP32, 3, 2, 5, false, false},
    {"mlp3_custom_act_elementwise", 3, 0, 0, MN_ACT_CUSTOM, "max(z, a*z)", MN_LOSS_CUSTOM,
     "where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL,
     "m*tanh(g/m)", 1, 1, MN_RETRIEVE_BEFORE, MN_PREC_BF16, 8, 3, 4, false, true},
    {"mlp2_silu_custom_act_scale_tensor", 2, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_CUSTOM,
     "log(1 + r^2)", MN_CLIP_SCALE, MN_SCOPE_TENSOR, "where(n > m, m/n, 1)", 7, 0, MN_RETRIEVE_AFTER, MN_PREC_TF32,
     2, 9, 3, true, false},
    {"linear_long_step_chunked", 1, 1, 1, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_TENSOR, NULL,
     150, 300, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 32, 32, 0, false, true},
    {"mlp2_wide_gelu_custom_expr_act", 2, 1, 0, MN_ACT_CUSTOM, "sqrt(z^2 + 1) + 0.5*z", MN_LOSS_MSE, NULL,
     MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 64, 64, MN_RETRIEVE_AFTER, MN_PREC_BF16, 128, 128, 256, false, false},
};


static mn_dims dims_of(const rule_case *c)
{
    mn_dims d = {2, 3, 10, c->dk, c->dv, c->dh, 0};
    return d;
}


/* NVRTC compiles src for sm_90: one PASS line with the time, or FAIL with
 * the start of the log. */
static void compile_line(const char *label, const char *src)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    char *log = NULL;
    mn_status s = mn_cuda_compile_check(src, 90, &log);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (s == MN_OK) printf("PASS %s (%.2f s)\n", label, secs);
    else {
        printf("FAIL %s: %s\n", label, mn_last_error());
        print_log(log);
        check_failures_++;
    }
    free(log);
}

/* A generated source that holds its marks (mark2 may be NULL) and compiles:
 * two checks, source_label's and nvrtc_label's; frees src. */
static void check_source(const char *source_label, const char *nvrtc_label, char *src, const char *mark1,
                         const char *mark2)
{
    CHECK(source_label, src && strstr(src, mark1) && (!mark2 || strstr(src, mark2)));
    if (src) compile_line(nvrtc_label, src);
    free(src);
}

/* Whether the plan (6 memories, sm_90) with MNEMO_CUDA_PATH=force is made
 * and takes path want; pl keeps it, and the variable is unset after. */
static bool forced_plan_is(const mn_rule *r, const mn_dims *d, mn_precision p, const char *force, mn_cuda_path want,
                           mn_cuda_plan *pl)
{
    setenv("MNEMO_CUDA_PATH", force, 1);
    bool ok = mn_cuda_plan_rule(r, d, p, 6, 90, 0, pl) == MN_OK && pl->path == want;
    unsetenv("MNEMO_CUDA_PATH");
    return ok;
}

static void test_compile_cases(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const rule_case *c = &cases[i];
        char name[160];
        mn_rule r;
        snprintf(name, sizeof name, "codegen/rule/%s", c->name);
        if (make_rule(c, &r) != MN_OK) {
            printf("FAIL %s: the rule is invalid: %s\n", name, mn_last_error());
            check_failures_++;
            mn_rule_free(&r);
            continue;
        }
        mn_dims d = dims_of(c);
        char *src = mn_cuda_rule_source(&r, &d, c->prec);
        if (!src) {
            printf("FAIL %s: no source: %s\n", name, mn_last_error());
            check_failures_++;
            mn_rule_free(&r);
            continue;
        }
        bool hooks = strstr(src, "mn_hook_loss_grad(float y, float v, float r)") &&
                     strstr(src, "mn_hook_act_grad(float z)") && strstr(src, "mn_hook_clip_scale(double n)") &&
                     strstr(src, "mn_hook_clip_elem(float g)") && strstr(src, "mn_rule_step_kernel");
        CHECK(name, hooks);
        snprintf(name, sizeof name, "codegen/nvrtc_sm90/%s", c->name);
        compile_line(name, src);
        free(src);
        /* the fast path the plan picks for it (kernels/plan.h): its source compiles too */
        mn_cuda_plan pl;
        if (mn_cuda_plan_rule(&r, &d, c->prec, 1, 90, 0, &pl) == MN_OK && pl.path != MN_PATH_GENERAL) {
            char *fast = mn_cuda_plan_source(&r, &d, c->prec, &pl);
            const char *kname = pl.path == MN_PATH_FUSED ? "mn_fused_step_kernel" : "mn_large_";
            snprintf(name, sizeof name, "codegen/nvrtc_sm90/%s/%s path", c->name, mn_cuda_path_name(pl.path));
            CHECK(name, fast && strstr(fast, kname));
            if (fast) compile_line(name, fast);
            free(fast);
        }
        /* the backward's source (kernels/grad_kernel.cuh) for the same rule */
        char *gsrc = mn_cuda_grad_source(&r, &d);
        snprintf(name, sizeof name, "codegen/grad_source/%s", c->name);
        CHECK(name, gsrc && strstr(gsrc, "mn_grad_kernel") && strstr(gsrc, "mn_ghook_loss_dyy(double y") &&
                        strstr(gsrc, "mn_ghook_act_dd(double z)") && strstr(gsrc, "#define MN_GRAD_SOURCE 1"));
        snprintf(name, sizeof name, "codegen/nvrtc_sm90/%s/backward", c->name);
        if (gsrc) compile_line(name, gsrc);
        free(gsrc);
        /* and the fused backward's (kernels/fused_grad.cuh) where it takes the rule */
        mn_cuda_plan bp;
        if (mn_cuda_plan_backward(&r, &d, c->prec, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED) {
            char *fsrc = mn_cuda_fused_grad_source(&r, &d, c->prec, &bp);
            snprintf(name, sizeof name, "codegen/nvrtc_sm90/%s/fused backward", c->name);
            CHECK(name, fsrc && strstr(fsrc, "mn_fused_grad_kernel") && strstr(fsrc, "#define MN_FUSED_GRAD 1"));
            if (fsrc) compile_line(name, fsrc);
            free(fsrc);
        }
        mn_rule_free(&r);
    }
}

/* The backward's plan (kernels/plan.h mn_cuda_plan_backward): fused where
 * the forward is fused, whatever the refresh; MNEMO_CUDA_BACKWARD forces. */
static void test_backward_plan(void)
{
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.hidden = 256;
    r.step = 64;
    r.refresh = 64;
    mn_dims d = {4, 32, 4096, 64, 64, 256, 0};
    mn_cuda_plan bp;
    bool ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/backward_plan/p1_fused", ok && bp.path == MN_PATH_FUSED && bp.rows == 16 &&
                                                bp.smem_bytes == mn_fused_grad_smem_bytes(&r, &d, 16) &&
                                                bp.smem_bytes <= 227 * 1024);
    /* refresh != step (P1-c16's r = 4c, and 0): the anchor in the slots, the same shared memory */
    const int refreshes[] = {256, 0};
    for (int i = 0; i < 2; i++) {
        r.refresh = refreshes[i];
        ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
        char label[96];
        snprintf(label, sizeof label, "codegen/backward_plan/refresh%d_fused", refreshes[i]);
        CHECK(label, ok && bp.path == MN_PATH_FUSED && bp.rows == 16 &&
                         bp.smem_bytes == mn_fused_grad_smem_bytes(&r, &d, 16) && strstr(bp.why, "anchor"));
    }
    /* P1-c16 (issue 15: c = 16, r = 4c): its fused backward's source compiles */
    r.step = 16;
    r.refresh = 64;
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
    char *csrc = ok ? mn_cuda_fused_grad_source(&r, &d, MN_PREC_TF32, &bp) : NULL;
    CHECK("codegen/backward_plan/p1_c16_fused", csrc && strstr(csrc, "#define MN_REFRESH 64"));
    if (csrc) compile_line("codegen/nvrtc_sm90/p1_c16/fused backward", csrc);
    free(csrc);
    r.step = 64;
    r.refresh = 64;
    /* a forward off the fused path (3 layers, hidden 256: the large one): forcing the fused
     * backward is refused in one line naming why */
    r.layers = 3;
    setenv("MNEMO_CUDA_BACKWARD", "fused", 1);
    CHECK("codegen/backward_plan/forced_fused_refused",
          mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_ERR_UNSUPPORTED &&
              strstr(mn_last_error(), "MNEMO_CUDA_BACKWARD=fused: the forward takes the large path") &&
              strstr(mn_last_error(), "3 layers") && !strchr(mn_last_error(), '\n'));
    r.layers = 2;
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/backward_plan/forced_fused", ok && bp.path == MN_PATH_FUSED && bp.forced);
    setenv("MNEMO_CUDA_BACKWARD", "general", 1);
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/backward_plan/forced_general", ok && bp.path == MN_PATH_GENERAL && bp.forced);
    /* the one way left to a cpu backward for a rule the GPU covers */
    char why_cpu[128];
    CHECK("codegen/backward_plan/covered", mn_cuda_backward_covers(&r, why_cpu, sizeof why_cpu) && !why_cpu[0]);
    setenv("MNEMO_CUDA_BACKWARD", "cpu", 1);
    CHECK("codegen/backward_plan/forced_cpu", !mn_cuda_backward_covers(&r, why_cpu, sizeof why_cpu) &&
                                                 strcmp(why_cpu, "MNEMO_CUDA_BACKWARD=cpu") == 0);
    setenv("MNEMO_CUDA_BACKWARD", "bogus", 1);
    CHECK("codegen/backward_plan/bad_name", mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_ERR_ARG &&
                                               strstr(mn_last_error(), "MNEMO_CUDA_BACKWARD=bogus"));
    unsetenv("MNEMO_CUDA_BACKWARD");
    /* the forward off the fused path takes the backward with it */
    setenv("MNEMO_CUDA_PATH", "general", 1);
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    unsetenv("MNEMO_CUDA_PATH");
    CHECK("codegen/backward_plan/forward_forced_general", ok && bp.path == MN_PATH_GENERAL &&
                                                              strstr(bp.why, "the forward takes the general path"));
    /* MNEMO_FG_PROFILE=1: the phase counters' source compiles too */
    setenv("MNEMO_FG_PROFILE", "1", 1);
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    char *psrc = ok ? mn_cuda_fused_grad_source(&r, &d, MN_PREC_TF32, &bp) : NULL;
    unsetenv("MNEMO_FG_PROFILE");
    CHECK("codegen/backward_plan/profile_source", psrc && strstr(psrc, "#define MN_PROFILE 1"));
    if (psrc) compile_line("codegen/nvrtc_sm90/p1/fused backward, MNEMO_FG_PROFILE", psrc);
    free(psrc);
    /* MNEMO_FUSED_PROFILE=1: the forward's step kernel with its phase
     * counters compiles, and only that knob puts them in its source */
    mn_cuda_plan fp;
    ok = mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 128, 90, 0, &fp) == MN_OK && fp.path == MN_PATH_FUSED;
    char *plain = ok ? mn_cuda_plan_source(&r, &d, MN_PREC_TF32, &fp) : NULL;
    setenv("MNEMO_FUSED_PROFILE", "1", 1);
    char *fsrc = ok ? mn_cuda_plan_source(&r, &d, MN_PREC_TF32, &fp) : NULL;
    unsetenv("MNEMO_FUSED_PROFILE");
    CHECK("codegen/forward_plan/profile_source", plain && fsrc && strstr(fsrc, "#define MN_PROFILE 1") &&
                                                     !strstr(plain, "#define MN_PROFILE 1"));
    if (fsrc) compile_line("codegen/nvrtc_sm90/p1/fused forward, MNEMO_FUSED_PROFILE", fsrc);
    free(plain);
    free(fsrc);
    /* sm_80's 163 KB: P1's fused forward (179 KB) does not fit; the forward
     * takes the large path, and the backward with it */
    ok = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 80, 0, &bp) == MN_OK;
    CHECK("codegen/backward_plan/sm80_large", ok && bp.path == MN_PATH_LARGE && strstr(bp.why, "163 KB") &&
                                                  strstr(bp.why, "the forward's large path"));
    mn_rule_free(&r);
}

/* The large backward's walk over its checkpoint blocks, last first
 * (mn_large_grad_block_modes): the modes as a string, block 0 first, d
 * direct, c captured, r replayed. */
static void block_modes(int64_t n, int64_t nsteps, int64_t step, int64_t refresh, int64_t K, char *out)
{
    mn_large_grad_block_mode modes[64];
    const int64_t nblocks = (nsteps + K - 1) / K;
    mn_large_grad_block_modes(n, nsteps, step, refresh, K, modes);
    for (int64_t b = 0; b < nblocks; b++) out[b] = "dcr"[modes[b]];
    out[nblocks] = 0;
}

/* Which blocks' reverse is captured in a CUDA graph and which replay it:
 * G1's 64 steps in blocks of 8 (the last block walked first runs direct,
 * the next is captured, six replay); a short last step (its block direct,
 * the next full one direct, then the capture); refresh blocks of 3 steps
 * walked in blocks of 2 (only blocks at the captured one's phase replay);
 * refresh blocks of 2 in blocks of 4 (every phase the same); too few
 * blocks for a capture to pay (one, two, or two full behind a short one);
 * refresh 0 (one anchor, no phases). */
static void test_large_backward_blocks(void)
{
    char got[65];
    block_modes(4096, 64, 64, 64, 8, got);
    CHECK_STR_EQ("codegen/large_backward/blocks_g1", got, "rrrrrrcd");
    block_modes(41, 21, 2, 2, 2, got); /* steps of 2 rows, the last 1 */
    CHECK_STR_EQ("codegen/large_backward/blocks_short_last", got, "rrrrrrrrcdd");
    block_modes(32, 16, 2, 6, 2, got); /* refresh 3 steps: phases 0 2 1 0 2 1 0 2 of blocks 0..7 */
    CHECK_STR_EQ("codegen/large_backward/blocks_refresh_phases", got, "rddrddcd");
    block_modes(100, 13, 8, 16, 4, got); /* 12 full steps of 8 and 4 rows: the sanitizer's file */
    CHECK_STR_EQ("codegen/large_backward/blocks_refresh_even", got, "rcdd");
    block_modes(2048, 1, 2048, 2048, 1, got);
    CHECK_STR_EQ("codegen/large_backward/blocks_one", got, "d");
    block_modes(16, 4, 4, 4, 2, got);
    CHECK_STR_EQ("codegen/large_backward/blocks_two", got, "dd");
    block_modes(18, 5, 4, 4, 2, got);
    CHECK_STR_EQ("codegen/large_backward/blocks_two_behind_short", got, "ddd");
    block_modes(60, 20, 3, 0, 5, got);
    CHECK_STR_EQ("codegen/large_backward/blocks_refresh0", got, "rrcd");
}

/* The large path's backward (kernels/grad_large.c): planned where the
 * forward is large (P2, the head-128 case), forced by
 * MNEMO_CUDA_BACKWARD=large on any rule without out_norm, glu or
 * newton_schulz (refused in one line naming the option), and its kernels'
 * source compiles in every precision for rules that use each part of it
 * (biases or not, residual, custom loss, each clip kind, refresh modes). */
static void test_large_backward(void)
{
    mn_rule r;
    mn_cuda_plan bp;
    mn_rule_init(&r);
    r.layers = 2;
    r.hidden = 512;
    r.step = 2048;
    r.refresh = 2048;
    mn_dims p2 = {1, 1, 2048, 512, 512, 512, 0};
    bool ok = mn_cuda_plan_backward(&r, &p2, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/large_backward/p2_planned", ok && bp.path == MN_PATH_LARGE && !bp.forced &&
                                                   strstr(bp.why, "the forward's large path"));
    r.hidden = 256;
    r.step = r.refresh = 64;
    mn_dims g1 = {4, 16, 4096, 128, 128, 256, 0};
    ok = mn_cuda_plan_backward(&r, &g1, MN_PREC_BF16, 90, 0, &bp) == MN_OK;
    CHECK("codegen/large_backward/g1_planned", ok && bp.path == MN_PATH_LARGE);
    /* newton_schulz on a large forward: the general backward, saying why */
    r.precondition = MN_PRECOND_NEWTON_SCHULZ;
    ok = mn_cuda_plan_backward(&r, &g1, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/large_backward/ns_general", ok && bp.path == MN_PATH_GENERAL && strstr(bp.why, "newton_schulz"));
    setenv("MNEMO_CUDA_BACKWARD", "large", 1);
    CHECK("codegen/large_backward/ns_forced_refused",
          mn_cuda_plan_backward(&r, &g1, MN_PREC_TF32, 90, 0, &bp) == MN_ERR_UNSUPPORTED &&
              strstr(mn_last_error(), "MNEMO_CUDA_BACKWARD=large: newton_schulz") && !strchr(mn_last_error(), '\n'));
    r.precondition = MN_PRECOND_NONE;
    /* forced on P1, whose forward is fused */
    mn_dims p1 = {4, 32, 4096, 64, 64, 256, 0};
    ok = mn_cuda_plan_backward(&r, &p1, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/large_backward/forced", ok && bp.path == MN_PATH_LARGE && bp.forced);
    unsetenv("MNEMO_CUDA_BACKWARD");
    /* the sources: one rule per part, each compiled in every precision */
    static const rule_case cases[] = {
        {"mlp2_gelu_norm", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 64, 64,
         MN_RETRIEVE_AFTER, MN_PREC_FP32, 128, 128, 256, false, false},
        {"lin_residual_value", 1, 0, 1, MN_ACT_IDENTITY, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL,
         NULL, 64, 0, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 256, 256, 0, true, false},
        {"mlp3_custom_loss_softnorm", 3, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_CUSTOM, "log(1 + r^2)", MN_CLIP_SOFTNORM,
         MN_SCOPE_TENSOR, NULL, 64, 128, MN_RETRIEVE_AFTER, MN_PREC_FP32, 256, 128, 512, false, true},
        {"mlp2_custom_act_elementwise", 2, 0, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_MSE, NULL,
         MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL, "m*tanh(g/m)", 64, 64, MN_RETRIEVE_AFTER, MN_PREC_FP32, 256, 256, 256,
         false, false},
    };
    static const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_TF32, MN_PREC_BF16};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        mn_rule_free(&r);
        mn_status st = make_rule(&cases[i], &r);
        mn_dims d = {2, 2, 256, cases[i].dk, cases[i].dv, cases[i].dh, 0};
        char name[160];
        for (size_t k = 0; k < 3; k++) {
            char *src = st == MN_OK ? mn_cuda_large_grad_source(&r, &d, precs[k]) : NULL;
            snprintf(name, sizeof name, "codegen/nvrtc_sm90/large_backward/%s/%s", cases[i].name,
                     mn_precision_name(precs[k]));
            CHECK(name, src && strstr(src, "mn_lgrad_update_kernel") && strstr(src, "mn_ghook_loss_dyy"));
            if (src) compile_line(name, src);
            free(src);
        }
    }
    mn_rule_free(&r);
}

/* qk_norm's backward (kernels/grad_cuda.c): the CUDA backward covers it
 * and plans it as without qk_norm (P1 with qk_norm: fused), and the kernels
 * never normalise, the keys arriving normalised: the general and the fused
 * backward's sources of a rule with qk_norm are those of the rule without
 * it, byte for byte; each compiles in every precision. */
static void test_qk_norm_backward(void)
{
    static const mn_qknorm kinds[] = {MN_QKNORM_L2, MN_QKNORM_RMS};
    static const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_TF32, MN_PREC_BF16};
    mn_rule plain, r;
    mn_rule_init(&plain);
    plain.layers = 2;
    plain.hidden = 256;
    plain.step = 64;
    plain.refresh = 64;
    mn_dims d = {4, 32, 4096, 64, 64, 256, 0};
    char *gplain = mn_cuda_grad_source(&plain, &d);
    for (int k = 0; k < 2; k++) {
        const char *kind = mn_part_name(&mn_qknorm_set, kinds[k]);
        char name[160], why[256];
        if (mn_rule_copy(&r, &plain) != MN_OK) {
            printf("FAIL codegen/qk_norm_backward/%s: %s\n", kind, mn_last_error());
            check_failures_++;
            continue;
        }
        r.qk_norm = kinds[k];
        snprintf(name, sizeof name, "codegen/qk_norm_backward/%s/covered", kind);
        CHECK(name, mn_cuda_backward_rule_covers(&r, why, sizeof why));
        char *gsrc = mn_cuda_grad_source(&r, &d);
        snprintf(name, sizeof name, "codegen/qk_norm_backward/%s/general_source_as_without", kind);
        CHECK(name, gsrc && gplain && strcmp(gsrc, gplain) == 0);
        if (k == 0 && gsrc) {
            snprintf(name, sizeof name, "codegen/nvrtc_sm90/p1_qk_norm_%s/backward", kind);
            compile_line(name, gsrc);
        }
        free(gsrc);
        for (int p = 0; p < 3; p++) {
            const char *pname = mn_precision_name(precs[p]);
            mn_cuda_plan bq, bp;
            bool ok = mn_cuda_plan_backward(&r, &d, precs[p], 90, 0, &bq) == MN_OK &&
                      mn_cuda_plan_backward(&plain, &d, precs[p], 90, 0, &bp) == MN_OK;
            snprintf(name, sizeof name, "codegen/qk_norm_backward/%s/%s/fused_plan", kind, pname);
            CHECK(name, ok && bq.path == MN_PATH_FUSED && bq.rows == bp.rows && bq.smem_bytes == bp.smem_bytes);
            if (!ok || bq.path != MN_PATH_FUSED) continue;
            char *fq = mn_cuda_fused_grad_source(&r, &d, precs[p], &bq);
            char *fp = mn_cuda_fused_grad_source(&plain, &d, precs[p], &bp);
            snprintf(name, sizeof name, "codegen/qk_norm_backward/%s/%s/fused_source_as_without", kind, pname);
            CHECK(name, fq && fp && strcmp(fq, fp) == 0);
            snprintf(name, sizeof name, "codegen/nvrtc_sm90/p1_qk_norm_%s/%s/fused backward", kind, pname);
            if (k == 0 && fq) compile_line(name, fq);
            free(fq);
            free(fp);
        }
        mn_rule_free(&r);
    }
    free(gplain);
    mn_rule_free(&plain);
}

/* The body of hook name ("mn_hook_loss(float y") in src, up to its "}". */
static char *hook_body(const char *src, const char *name)
{
    const char *h = src ? strstr(src, name) : NULL;
    const char *b = h ? strstr(h, "return ") : NULL;
    const char *e = b ? strchr(b, '}') : NULL;
    if (!e) return NULL;
    char *out = malloc((size_t)(e - b) + 1);
    if (!out) return NULL;
    memcpy(out, b, (size_t)(e - b));
    out[e - b] = 0;
    return out;
}

/* Constants are read at run time (slots of mn_rule_k), so the source follows
 * every input but their values; 0, 1 and -1 are bound into it. */
static void test_source_contents(void)
{
    mn_rule r;
    const rule_case *c = &cases[5]; /* loss w*(y - v)^2 + c3*abs(r)^3; w, c3, a, m, delta: slots 3..7 */
    mn_status s = make_rule(c, &r);
    mn_dims d = dims_of(c);
    char *src = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    char *body = hook_body(src, "mn_hook_loss(float y");
    CHECK("codegen/constants_read_at_run_time", body && strstr(body, "MN_KF(3) * ") && strstr(body, "MN_KF(4) * ") &&
                                                    !strstr(body, "0.7f") && !strstr(body, "0.1f"));
    free(body);
    body = hook_body(src, "mn_hook_clip_scale(double n"); /* the custom clip's m is the rule's constant m */
    CHECK("codegen/constants_read_in_double", body && strstr(body, "MN_KD(6)") && !strstr(body, "0.25"));
    free(body);
    CHECK("codegen/constants_block", src && strstr(src, "__device__ mn_rule_constants mn_rule_k;") &&
                                         strstr(src, "void " MN_SET_CONSTANTS_KERNEL "(mn_rule_constants k)") &&
                                         strstr(src, " *   3: the rule's constant w\n") &&
                                         !strstr(src, " *   7: the rule's constant delta")); /* unused: no slot */
    char *tf = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_TF32) : NULL;
    mn_dims d2 = d;
    d2.dk += 1;
    char *wider = s == MN_OK ? mn_cuda_rule_source(&r, &d2, MN_PREC_FP32) : NULL;
    char *again = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    mn_rule_set_const(&r, "w", 0.75);
    mn_rule_set_const(&r, "m", 4.5);
    char *other = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    mn_rule_set_const(&r, "w", 1.0);
    char *one = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    mn_rule_set_const(&r, "w", 0.0);
    char *zero = s == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    CHECK("codegen/source_deterministic", src && again && strcmp(src, again) == 0);
    CHECK("codegen/source_follows_precision", src && tf && strcmp(src, tf) != 0 && strstr(tf, "#define MN_PREC 1"));
    CHECK("codegen/source_follows_dims", src && wider && strcmp(src, wider) != 0);
    CHECK("codegen/source_ignores_constant_values", src && other && strcmp(src, other) == 0);
    body = hook_body(one, "mn_hook_loss(float y"); /* 1 * (y - v)^2: the factor goes */
    CHECK("codegen/constant_one_bound", one && strcmp(one, src) != 0 && body && !strstr(body, "MN_KF(3)") &&
                                            strstr(body, "MN_KF(4)") && strncmp(body, "return mn_f_pow(y - v", 21) == 0);
    free(body);
    body = hook_body(zero, "mn_hook_loss(float y"); /* the w term drops out */
    CHECK("codegen/constant_zero_bound", body && !strstr(body, "MN_KF(3)") && !strstr(body, "y - v") &&
                                             strstr(body, "MN_KF(4)"));
    free(body);
    free(src);
    free(tf);
    free(wider);
    free(again);
    free(other);
    free(one);
    free(zero);
    mn_rule_free(&r);

    /* A built-in part's parameter: huber's delta at slot 0 and the clip's m
     * at slot 2 in float and double; the values the engine passes. */
    mn_rule h;
    mn_rule_init(&h);
    h.loss = MN_LOSS_HUBER;
    h.loss_delta = 0.3;
    h.clip = MN_CLIP_NORM;
    h.clip_max = 2.5;
    mn_dims dh = {1, 1, 4, 8, 8, 0, 1};
    char *hs = mn_cuda_rule_source(&h, &dh, MN_PREC_FP32);
    h.loss_delta = 7;
    h.clip_max = 0.125;
    char *hs2 = mn_cuda_rule_source(&h, &dh, MN_PREC_FP32);
    CHECK("codegen/parameters_read_at_run_time", hs && hs2 && strcmp(hs, hs2) == 0 && strstr(hs, "MN_KF(0)") &&
                                                     strstr(hs, "MN_KD(2) / n") && !strstr(hs, "0.3f") &&
                                                     !strstr(hs, "2.5") && !strstr(hs, "MN_KF(1)"));
    mn_rule_constants k;
    mn_cuda_rule_constants(&h, &k);
    CHECK("codegen/parameter_values", k.d[0] == 7 && k.d[1] == 0 && k.d[2] == 0.125 && k.f[2] == 0.125f &&
                                          k.d[MN_RULE_PARAM_SLOTS] == 0);
    h.loss = MN_LOSS_LP;
    h.loss_p = 1.1;
    mn_cuda_rule_constants(&h, &k);
    CHECK("codegen/parameter_values_lp", k.d[0] == 0 && k.d[1] == 1.1 && k.f[1] == (float)1.1);
    free(hs);
    free(hs2);
    mn_rule_free(&h);
    mn_rule cr;
    if (make_rule(c, &cr) == MN_OK) {
        mn_cuda_rule_constants(&cr, &k);
        CHECK("codegen/constant_values", k.d[3] == 0.7 && k.d[4] == 0.1 && k.d[6] == 0.25 && k.d[7] == 0.3 &&
                                             k.f[4] == 0.1f && k.d[0] == 0 && k.d[2] == 0);
        mn_rule_free(&cr);
    } else {
        CHECK("codegen/constant_values", false);
    }

    /* a rule that does not validate has no source, and says why */
    mn_rule bad;
    mn_rule_init(&bad);
    bad.loss = MN_LOSS_CUSTOM; /* no expression */
    mn_dims db = {1, 1, 1, 4, 4, 0, 1};
    char *none = mn_cuda_rule_source(&bad, &db, MN_PREC_FP32);
    CHECK("codegen/invalid_rule_no_source", none == NULL);
    CHECK_STR_CONTAINS("codegen/invalid_rule_message", mn_last_error(), "loss_expr");
    free(none);
    mn_rule_free(&bad);
}

/* The module memo's test (kernels/module_memo.h): where it says two rules
 * give the same source, they do, to the byte; it says so across a sweep of
 * a part's parameter or a constant (the point of it) and not across 0, 1
 * or -1, a field, a constant's name, or separate expression objects. */
static void test_same_source_rule(void)
{
    enum { NR = 2 * 3 * 3 * 3 };
    static const mn_loss losses[2] = {MN_LOSS_MSE, MN_LOSS_HUBER};
    static const mn_clip clips[3] = {MN_CLIP_NONE, MN_CLIP_NORM, MN_CLIP_VALUE};
    static const double values[3] = {0.5, 1.0, 2.0};
    mn_rule rs[NR];
    char *srcs[NR];
    mn_dims d = {1, 1, 4, 8, 8, 16, 1};
    int n = 0;
    for (int l = 0; l < 2; l++)
        for (int c = 0; c < 3; c++)
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++, n++) {
                    mn_rule_init(&rs[n]);
                    rs[n].layers = 2;
                    rs[n].loss = losses[l];
                    rs[n].clip = clips[c];
                    rs[n].clip_max = values[i];
                    rs[n].loss_delta = values[j];
                    srcs[n] = mn_cuda_rule_source(&rs[n], &d, MN_PREC_FP32);
                }
    int same = 0, wrong = 0, missing = 0;
    for (int a = 0; a < NR; a++) {
        if (!srcs[a]) missing++;
        for (int b = a + 1; b < NR; b++)
            if (srcs[a] && srcs[b] && mn_cuda_same_source_rule(&rs[a], &rs[b])) {
                same++;
                wrong += strcmp(srcs[a], srcs[b]) != 0;
            }
    }
    /* the pairs it calls the same: within each (loss, clip), the rules whose
     * two numbers are 1 alike and the others 0.5 or 2 (4 rules with neither 1:
     * 6 pairs; m = 1 or delta = 1 alone: 1 pair each), 8 x 6 */
    CHECK("codegen/same_source_rule_implies_same_text", missing == 0 && wrong == 0);
    CHECK("codegen/same_source_rule_sweeps", same == 48);
    mn_rule *h05 = &rs[1 * 27 + 1 * 9 + 0 * 3 + 0], *h2 = &rs[1 * 27 + 1 * 9 + 2 * 3 + 2], *h1 = &rs[1 * 27 + 1 * 9 + 1 * 3 + 0];
    CHECK("codegen/same_source_rule_parameters", mn_cuda_same_source_rule(h05, h2) && !mn_cuda_same_source_rule(h05, h1));
    mn_rule other = *h05;
    other.step = 4;
    CHECK("codegen/same_source_rule_fields", !mn_cuda_same_source_rule(h05, &other));
    for (int a = 0; a < NR; a++) {
        free(srcs[a]);
        mn_rule_free(&rs[a]);
    }

    /* custom parts: a copy shares its expressions; a rule made again does not */
    mn_rule r, copy, again;
    const rule_case *c = &cases[5]; /* constants w, c3, a, m, delta */
    bool made = make_rule(c, &r) == MN_OK && mn_rule_copy(&copy, &r) == MN_OK && make_rule(c, &again) == MN_OK;
    CHECK("codegen/same_source_rule_copy", made && mn_cuda_same_source_rule(&r, &copy));
    CHECK("codegen/same_source_rule_other_objects", made && !mn_cuda_same_source_rule(&r, &again));
    if (made) {
        mn_rule_set_const(&copy, "w", 4.5);
        char *x = mn_cuda_rule_source(&r, &d, MN_PREC_FP32), *y = mn_cuda_rule_source(&copy, &d, MN_PREC_FP32);
        CHECK("codegen/same_source_rule_constant_values",
              mn_cuda_same_source_rule(&r, &copy) && x && y && strcmp(x, y) == 0);
        free(x);
        free(y);
        mn_rule_set_const(&copy, "w", 1.0);
        CHECK("codegen/same_source_rule_constant_one", !mn_cuda_same_source_rule(&r, &copy));
        mn_rule_set_const(&copy, "w", 0.7);
        CHECK("codegen/same_source_rule_back", mn_cuda_same_source_rule(&r, &copy));
        mn_rule_set_const(&copy, "extra", 0.7);
        CHECK("codegen/same_source_rule_constant_names", !mn_cuda_same_source_rule(&r, &copy));
    }
    mn_rule_free(&r);
    mn_rule_free(&copy);
    mn_rule_free(&again);
}

static void test_cache_key(void)
{
    const char *src = "extern \"C\" __global__ void k() {}";
    char base[33], k1[33], k2[33], k3[33], k4[33], k5[33], k6[33];
    mn_cuda_cache_key(src, "-a -b", 90, 13000, base);
    mn_cuda_cache_key(src, "-a -b", 90, 13000, k1);
    mn_cuda_cache_key("extern \"C\" __global__ void k() { }", "-a -b", 90, 13000, k2);
    mn_cuda_cache_key(src, "-a -c", 90, 13000, k3);
    mn_cuda_cache_key(src, "-a -b", 100, 13000, k4);
    mn_cuda_cache_key(src, "-a -b", 90, 13010, k5);
    /* moving bytes between source and options changes the key too */
    mn_cuda_cache_key("extern \"C\" __global__ void k() {}-", "a -b", 90, 13000, k6);
    CHECK("codegen/cache_key_stable", strcmp(base, k1) == 0 && strlen(base) == 32);
    CHECK("codegen/cache_key_source", strcmp(base, k2) != 0);
    CHECK("codegen/cache_key_options", strcmp(base, k3) != 0);
    CHECK("codegen/cache_key_arch", strcmp(base, k4) != 0);
    CHECK("codegen/cache_key_nvrtc_version", strcmp(base, k5) != 0);
    CHECK("codegen/cache_key_boundaries", strcmp(base, k6) != 0);
    char opts[256];
    CHECK_STR_CONTAINS("codegen/options_arch", mn_nvrtc_options(90, MN_TIER_FULL, opts, sizeof opts),
                       "--gpu-architecture=sm_90");
    CHECK("codegen/options_full_optimises", strstr(opts, "Ofast-compile") == NULL);
    CHECK_STR_CONTAINS("codegen/options_fast_tier", mn_nvrtc_options(90, MN_TIER_FAST, opts, sizeof opts),
                       "--gpu-architecture=sm_90 -default-device --std=c++17 -lineinfo --ptxas-options=-v "
                       "--Ofast-compile=mid");
    CHECK("codegen/nvrtc_version", mn_nvrtc_version() >= 12000);
}

static void test_broken_source(void)
{
    const char *src = "extern \"C\" __global__ void k(float *x) { x[0] = undefined_name_here; }\n";
    char *log = NULL;
    mn_status s = mn_cuda_compile_check(src, 90, &log);
    CHECK("codegen/broken_source_fails", s == MN_ERR_DEVICE);
    CHECK_STR_CONTAINS("codegen/broken_source_log", log, "undefined_name_here");
    CHECK_STR_CONTAINS("codegen/broken_source_message", mn_last_error(), "undefined_name_here");
    CHECK_STR_CONTAINS("codegen/broken_source_message_says", mn_last_error(), "did not compile for sm_90");
    free(log);
}

/* The disk cache under $MNEMO_CACHE: a compile writes <key>.cubin, the next
 * request reads the same bytes back. */
static void test_disk_cache(void)
{
    char dir[] = "/tmp/mnemo-codegen-XXXXXX";
    if (!mkdtemp(dir)) {
        SKIP("codegen/disk_cache", "no temporary directory");
        return;
    }
    setenv("MNEMO_CACHE", dir, 1);
    const char *src = "extern \"C\" __global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n";
    char key[33], key2[33], path[512];
    void *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    char full_key[33], fast_tier_key[33];
    mn_nvrtc_key(src, 90, MN_TIER_FULL, full_key);
    mn_nvrtc_key(src, 90, MN_TIER_FAST, fast_tier_key);
    CHECK("codegen/disk_cache_empty", !mn_nvrtc_in_cache(full_key));
    mn_status s = mn_nvrtc_cubin(src, 90, MN_TIER_FULL, false, key, &a, &na);
    snprintf(path, sizeof path, "%s/kernels/%s.cubin", dir, key);
    struct stat sb;
    CHECK("codegen/disk_cache_written", s == MN_OK && stat(path, &sb) == 0 && (size_t)sb.st_size == na);
    CHECK("codegen/disk_cache_in_cache", strcmp(full_key, key) == 0 && mn_nvrtc_in_cache(key) &&
                                             !mn_nvrtc_in_cache(fast_tier_key));
    /* the fast tier: a key and a file of its own, a different CUBIN */
    char fast_key[33], fast_path[512];
    void *fast = NULL;
    size_t nfast = 0;
    s = mn_nvrtc_cubin(src, 90, MN_TIER_FAST, false, fast_key, &fast, &nfast);
    snprintf(fast_path, sizeof fast_path, "%s/kernels/%s.cubin", dir, fast_key);
    CHECK("codegen/disk_cache_fast_tier", s == MN_OK && strcmp(fast_key, key) != 0 && nfast > 0 &&
                                              stat(fast_path, &sb) == 0 && strcmp(fast_key, fast_tier_key) == 0 &&
                                              mn_nvrtc_in_cache(fast_key));
    free(fast);
    unlink(fast_path);
    snprintf(fast_path, sizeof fast_path, "%s/kernels/%s.info", dir, fast_key);
    unlink(fast_path);
    /* a planted file under the key is what the next request returns */
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs("planted", f);
        fclose(f);
    }
    s = mn_nvrtc_cubin(src, 90, MN_TIER_FULL, false, key2, &b, &nb);
    CHECK("codegen/disk_cache_read", s == MN_OK && strcmp(key, key2) == 0 && nb == 7 && memcmp(b, "planted", 7) == 0);
    free(b);
    b = NULL;
    s = mn_nvrtc_cubin(src, 90, MN_TIER_FULL, true, key2, &b, &nb);
    CHECK("codegen/disk_cache_fresh_replaces", s == MN_OK && nb == na && memcmp(a, b, na) == 0 &&
                                                   stat(path, &sb) == 0 && (size_t)sb.st_size == na);
    free(a);
    free(b);
    unlink(path);
    snprintf(path, sizeof path, "%s/kernels/%s.info", dir, key); /* the kernels' resources, beside it */
    CHECK("codegen/disk_cache_info_written", stat(path, &sb) == 0 && sb.st_size > 0);
    unlink(path);
    snprintf(path, sizeof path, "%s/kernels", dir);
    rmdir(path);
    rmdir(dir);
    unsetenv("MNEMO_CACHE");
}

/* precondition = newton_schulz: the general path's source carries the
 * iteration and compiles; the plan sends it to the general path (a tall and a
 * wide matrix, a layer of 256 that would take the large path otherwise) and
 * refuses a forced fast path by name. */
static void test_newton_schulz(void)
{
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.bias = true;
    r.precondition = MN_PRECOND_NEWTON_SCHULZ;
    r.ns_steps = 3;
    r.step = 4;
    mn_dims d = {2, 3, 10, 16, 8, 256, 0};
    char *src = mn_cuda_rule_source(&r, &d, MN_PREC_TF32);
    CHECK("codegen/newton_schulz/source", src && strstr(src, "#define MN_PRECOND 1") &&
                                              strstr(src, "#define MN_NS_STEPS 3") && strstr(src, "mn_newton_schulz"));
    if (src) compile_line("codegen/nvrtc_sm90/newton_schulz", src);
    free(src);
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    /* hidden 256: too wide for the fused path, the large path's; its source
     * has the ns kernel, in each precision */
    bool planned = mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/newton_schulz/plan_large", planned && pl.path == MN_PATH_LARGE);
    const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_TF32, MN_PREC_BF16};
    for (int i = 0; i < 3; i++) {
        char label[96], nvrtc[96];
        snprintf(label, sizeof label, "codegen/newton_schulz/large_source_%s", mn_precision_name(precs[i]));
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/newton_schulz/large_%s", mn_precision_name(precs[i]));
        check_source(label, nvrtc, mn_cuda_large_source(&r, &d, precs[i]), "#define MN_PRECOND 1", "mn_large_ns_kernel");
    }
    CHECK("codegen/newton_schulz/forced_large_taken",
          forced_plan_is(&r, &d, MN_PREC_TF32, "large", MN_PATH_LARGE, &pl));
    CHECK("codegen/newton_schulz/forced_general_taken",
          forced_plan_is(&r, &d, MN_PREC_TF32, "general", MN_PATH_GENERAL, &pl));
    /* a rule the fused path holds keeps it: the step kernel orthogonalises
     * G in its workspace, in each precision, 1 and 2 layers, with bias */
    for (int layers = 1; layers <= 2; layers++)
        for (int i = 0; i < 3; i++) {
            mn_dims small = {2, 3, 10, 16, 8, layers > 1 ? 32 : 0, 0};
            r.layers = layers;
            r.bias = layers > 1;
            planned = mn_cuda_plan_rule(&r, &small, precs[i], 6, 90, 0, &pl) == MN_OK;
            char label[96], nvrtc[96];
            snprintf(label, sizeof label, "codegen/newton_schulz/fused_plan_%dlayer_%s", layers, mn_precision_name(precs[i]));
            CHECK(label, planned && pl.path == MN_PATH_FUSED);
            if (!planned || pl.path != MN_PATH_FUSED) continue;
            snprintf(label, sizeof label, "codegen/newton_schulz/fused_source_%dlayer_%s", layers,
                     mn_precision_name(precs[i]));
            snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/newton_schulz/fused_%dlayer_%s", layers,
                     mn_precision_name(precs[i]));
            check_source(label, nvrtc, mn_cuda_plan_source(&r, &small, precs[i], &pl), "#define MN_PRECOND 1",
                         "mn_newton_schulz(G[p]");
        }
    /* the backward: both kernels run the iteration's adjoint. The general
     * one (fp32 whatever the run's precision) for 1 and 2 layers, with and
     * without bias; the plan takes a rule the fused forward holds with
     * refresh = step to the fused one, whose source compiles in each
     * precision, and a forced fused backward is taken */
    for (int layers = 1; layers <= 2; layers++) {
        mn_dims small = {2, 3, 10, 16, 8, layers > 1 ? 12 : 0, 0};
        r.layers = layers;
        r.bias = layers == 2;
        r.refresh = 2 * r.step;
        char label[96], nvrtc[96], why[256];
        snprintf(label, sizeof label, "codegen/newton_schulz/backward_source_%dlayer", layers);
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/newton_schulz/backward_%dlayer", layers);
        check_source(label, nvrtc, mn_cuda_grad_source(&r, &small), "#define MN_PRECOND 1", "mn_grad_kernel");
        snprintf(label, sizeof label, "codegen/newton_schulz/backward_covered_%dlayer", layers);
        CHECK(label, mn_cuda_backward_rule_covers(&r, why, sizeof why));
        mn_cuda_plan bp;
        bool ok = mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
        /* the fused backward takes it at the refresh block's anchor too */
        snprintf(label, sizeof label, "codegen/newton_schulz/backward_plan_refresh2c_fused_%dlayer", layers);
        CHECK(label, ok && bp.path == MN_PATH_FUSED);
        if (ok && bp.path == MN_PATH_FUSED) {
            snprintf(label, sizeof label, "codegen/newton_schulz/fused_backward_source_refresh2c_%dlayer", layers);
            snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/newton_schulz/fused_backward_refresh2c_%dlayer", layers);
            check_source(label, nvrtc, mn_cuda_fused_grad_source(&r, &small, MN_PREC_TF32, &bp), "#define MN_PRECOND 1",
                         "mn_fused_grad_kernel");
        }
    }
    r.refresh = r.step;
    mn_dims small = {2, 3, 10, 16, 8, 12, 0};
    for (int i = 0; i < 3; i++) {
        mn_cuda_plan bp;
        bool ok = mn_cuda_plan_backward(&r, &small, precs[i], 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
        char label[96], nvrtc[96];
        snprintf(label, sizeof label, "codegen/newton_schulz/backward_plan_fused_%s", mn_precision_name(precs[i]));
        CHECK(label, ok);
        if (!ok) continue;
        snprintf(label, sizeof label, "codegen/newton_schulz/fused_backward_source_%s", mn_precision_name(precs[i]));
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/newton_schulz/fused_backward_%s", mn_precision_name(precs[i]));
        check_source(label, nvrtc, mn_cuda_fused_grad_source(&r, &small, precs[i], &bp), "#define MN_PRECOND 1",
                     "#define MN_FUSED_GRAD 1");
    }
    mn_cuda_plan bp;
    setenv("MNEMO_CUDA_BACKWARD", "fused", 1);
    CHECK("codegen/newton_schulz/backward_forced_fused_taken",
          mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED && bp.forced);
    unsetenv("MNEMO_CUDA_BACKWARD");
    mn_rule_free(&r);
}

/* lengths (ragged batches) are a run's input, read by the kernels of every
 * path at run time: the source does not change with them, and a run with
 * lengths keeps the path the same rule has without them (fused for a small
 * rule, large for a wide one); a forced path takes them. */
/* The step's gradient G in shared memory (issue 14): M1's memory (64-128-64,
 * c = 8) has room beside its weights and chunk buffers, so its plan counts G
 * in the shared memory, says so, leaves it out of the workspace and defines
 * MN_G_SHARED (the source compiles, with the retrieval row folded into the
 * next step's chunk too, c = 8 < 16 rows); P1's memory (64-256-64) has no
 * room, nor M1's on sm_80 (163 KB), nor with MNEMO_FUSED_GSHARED=0. */
/* A 2-layer memory with biases on steps of step rows (the plan tests' P1 and M1 rules). */
static void mlp_rule_init(mn_rule *r, int step)
{
    mn_rule_init(r);
    r->layers = 2;
    r->bias = true;
    r->step = step;
}

static void test_grad_in_shared(void)
{
    mn_rule r;
    mlp_rule_init(&r, 8);
    mn_dims m1 = {32, 16, 1024, 64, 64, 128, 0}, p1 = {4, 32, 4096, 64, 64, 256, 0};
    const long m1_grad = 128 * 64 + 128 + 64 * 128 + 64, p1_grad = 256 * 64 + 256 + 64 * 256 + 64;
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    unsetenv("MNEMO_FUSED_GSHARED");
    bool ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
    CHECK("codegen/grad_in_shared/m1", ok && pl.g_shared && pl.rows == 16 &&
                                           pl.smem_bytes == mn_fused_smem_bytes(&r, &m1, 16) + 4 * m1_grad &&
                                           strstr(pl.why, "the step's gradient beside them (64 KB)") &&
                                           mn_fused_work_floats(&r, &m1, &pl) == 0);
    char *src = ok ? mn_cuda_plan_source(&r, &m1, MN_PREC_TF32, &pl) : NULL;
    CHECK("codegen/grad_in_shared/m1_source", src && strstr(src, "#define MN_G_SHARED 1\n") &&
                                                  strstr(src, "#define MN_FOLD ("));
    if (src) compile_line("codegen/nvrtc_sm90/grad_in_shared_m1", src);
    free(src);
    r.refresh = 16; /* the anchor: the workspace keeps W's padded copy only */
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_in_shared/m1_anchor_workspace",
          ok && pl.g_shared && mn_fused_work_floats(&r, &m1, &pl) == mn_fused_padded_floats(&r, &m1));
    r.refresh = -1; /* = step again */
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 80, 0, &pl) == MN_OK;
    CHECK("codegen/grad_in_shared/m1_sm80_no_room", ok && pl.path == MN_PATH_FUSED && !pl.g_shared &&
                                                        pl.smem_bytes == mn_fused_smem_bytes(&r, &m1, 16) &&
                                                        mn_fused_work_floats(&r, &m1, &pl) == m1_grad);
    /* G's rows swizzled (MN_G_SWZ) where measured faster: tf32 and bf16,
     * not fp32 (not measured); never with newton_schulz, nor in the fused
     * backward; MNEMO_FUSED_GSWZ sets it either way */
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_FP32, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/m1_fp32_not", ok && pl.g_shared && !pl.g_swizzle);
    src = ok ? mn_cuda_plan_source(&r, &m1, MN_PREC_FP32, &pl) : NULL;
    CHECK("codegen/grad_swizzled/m1_fp32_source", src && !strstr(src, "#define MN_G_SWZ 1\n"));
    free(src);
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/m1_tf32", ok && pl.g_shared && pl.g_swizzle);
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_BF16, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/m1_bf16", ok && pl.g_shared && pl.g_swizzle);
    src = ok ? mn_cuda_plan_source(&r, &m1, MN_PREC_BF16, &pl) : NULL;
    CHECK("codegen/grad_swizzled/m1_bf16_source", src && strstr(src, "#define MN_G_SWZ 1\n"));
    if (src) compile_line("codegen/nvrtc_sm90/grad_swizzled_m1_bf16", src);
    free(src);
    mn_cuda_plan bw;
    CHECK("codegen/grad_swizzled/not_in_the_backward",
          ok && mn_cuda_plan_backward(&r, &m1, MN_PREC_BF16, 90, 0, &bw) == MN_OK && bw.path == MN_PATH_FUSED &&
              bw.g_shared && !bw.g_swizzle);
    src = ok && bw.path == MN_PATH_FUSED ? mn_cuda_fused_grad_source(&r, &m1, MN_PREC_BF16, &bw) : NULL;
    CHECK("codegen/grad_swizzled/not_in_the_backward_source", src && !strstr(src, "#define MN_G_SWZ 1\n"));
    free(src);
    setenv("MNEMO_FUSED_GSWZ", "1", 1);
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_FP32, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/knob_on", ok && pl.g_swizzle);
    src = ok ? mn_cuda_plan_source(&r, &m1, MN_PREC_FP32, &pl) : NULL;
    if (src) compile_line("codegen/nvrtc_sm90/grad_swizzled_m1_fp32", src);
    free(src);
    setenv("MNEMO_FUSED_GSWZ", "0", 1);
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_BF16, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/knob_off", ok && pl.g_shared && !pl.g_swizzle);
    unsetenv("MNEMO_FUSED_GSWZ");
    r.precondition = MN_PRECOND_NEWTON_SCHULZ;
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_BF16, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_swizzled/not_with_newton_schulz", ok && !pl.g_swizzle);
    r.precondition = MN_PRECOND_NONE;
    {
        mn_rule lin;
        mn_rule_init(&lin);
        lin.layers = 1;
        lin.step = 64;
        mn_dims p1 = {4, 32, 4096, 64, 64, 0, 0};
        ok = mn_cuda_plan_rule(&lin, &p1, MN_PREC_TF32, 128, 90, 0, &pl) == MN_OK;
        CHECK("codegen/grad_swizzled/linear_tf32", ok && pl.g_shared && pl.g_swizzle);
        mn_rule_free(&lin);
    }
    setenv("MNEMO_FUSED_GSHARED", "0", 1);
    ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_in_shared/m1_knob_off", ok && !pl.g_shared && !pl.g_swizzle && !strstr(pl.why, "gradient"));
    unsetenv("MNEMO_FUSED_GSHARED");
    r.step = 64;
    ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_TF32, 128, 90, 0, &pl) == MN_OK;
    CHECK("codegen/grad_in_shared/p1_no_room", ok && pl.path == MN_PATH_FUSED && !pl.g_shared && pl.rows == 32 &&
                                                   mn_fused_work_floats(&r, &p1, &pl) == p1_grad);
    /* odd lengths: each parameter's G starts on a float4 (the step kernel's
     * mn_gacc takes its pairs as aligned), so the workspace holds 9 x 14 ->
     * 128, 14 -> 16, 7 x 14 = 98 -> 100 and 7 -> 8 floats, not their sum 245
     * rounded once */
    r.step = 8;
    mn_dims odd = {1, 2, 29, 9, 7, 14, 0};
    setenv("MNEMO_FUSED_GSHARED", "0", 1); /* small enough for shared memory: the workspace instead */
    ok = mn_cuda_plan_rule(&r, &odd, MN_PREC_TF32, 2, 90, 0, &pl) == MN_OK;
    unsetenv("MNEMO_FUSED_GSHARED");
    CHECK("codegen/grad_in_shared/odd_sizes_on_float4s",
          ok && pl.path == MN_PATH_FUSED && !pl.g_shared && mn_fused_work_floats(&r, &odd, &pl) == 128 + 16 + 100 + 8);
    /* z's rows 4 floats wider in bf16 (MN_ZPAD) where they fit beside
     * everything else and G is not in shared memory: P1-c16's (16 rows);
     * not M1's (G beside them), nor P1's, whose 32 rows fill the SM (its
     * rows stay 32; fused_kernel.cuh turns z's odd rows there); never in
     * tf32, nor in the fused backward */
    {
        mn_cuda_plan t, b, bw16;
        ok = mn_cuda_plan_rule(&r, &m1, MN_PREC_TF32, 512, 90, 0, &t) == MN_OK &&
             mn_cuda_plan_rule(&r, &m1, MN_PREC_BF16, 512, 90, 0, &b) == MN_OK;
        CHECK("codegen/z_pad/m1_bf16_not_beside_g",
              ok && b.g_shared && !b.z_pad && b.rows == t.rows && b.smem_bytes == t.smem_bytes);
        r.step = 16;
        ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_TF32, 128, 90, 0, &t) == MN_OK &&
             mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK;
        CHECK("codegen/z_pad/p1_c16_bf16", ok && !t.z_pad && b.z_pad && b.rows == t.rows && !b.g_shared &&
                                               b.smem_bytes == t.smem_bytes + 4 * 4 * b.rows);
        char *zs = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &b) : NULL;
        CHECK("codegen/z_pad/p1_c16_bf16_source", zs && strstr(zs, "#define MN_ZPAD 1\n"));
        if (zs) compile_line("codegen/nvrtc_sm90/z_wide_p1_c16_bf16", zs);
        free(zs);
        CHECK("codegen/z_pad/not_in_the_backward",
              mn_cuda_plan_backward(&r, &p1, MN_PREC_BF16, 90, 0, &bw16) == MN_OK && bw16.path == MN_PATH_FUSED &&
                  !bw16.z_pad);
        setenv("MNEMO_FUSED_ZPAD", "0", 1);
        ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK;
        unsetenv("MNEMO_FUSED_ZPAD");
        CHECK("codegen/z_pad/knob_off", ok && !b.z_pad && b.smem_bytes == t.smem_bytes);
        r.step = 64;
        ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_TF32, 128, 90, 0, &t) == MN_OK &&
             mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK;
        CHECK("codegen/z_pad/p1_bf16_no_room",
              ok && !b.z_pad && b.rows == 32 && t.rows == 32 && b.smem_bytes == t.smem_bytes);
        zs = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &b) : NULL;
        CHECK("codegen/z_pad/p1_bf16_source", zs && !strstr(zs, "#define MN_ZPAD 1"));
        if (zs) compile_line("codegen/nvrtc_sm90/z_turned_p1_bf16", zs); /* MN_ZROT's code */
        free(zs);
    }
    /* G's L2 lines dropped as the update reads them (fused_kernel.cuh's
     * MN_DISCARD): the template's default where W is in the workspace
     * (P1-c16: refresh 64 on steps of 16), nothing in the source's defines;
     * MNEMO_FUSED_DISCARD=0 or 1 defines it either way, and the source with
     * it forced on where W is in shared memory compiles too */
    {
        mn_cuda_plan d;
        r.step = 16;
        r.refresh = 64;
        ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &d) == MN_OK && d.path == MN_PATH_FUSED;
        char *ds = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &d) : NULL;
        CHECK("codegen/discard/p1_c16_default", ds && strstr(ds, "#define MN_DISCARD (!MN_P_AT_W)") &&
                                                   !strstr(ds, "#define MN_DISCARD 0") &&
                                                   !strstr(ds, "#define MN_DISCARD 1"));
        if (ds) compile_line("codegen/nvrtc_sm90/discard_p1_c16_bf16", ds);
        free(ds);
        setenv("MNEMO_FUSED_DISCARD", "0", 1);
        ds = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &d) : NULL;
        CHECK("codegen/discard/knob_off", ds && strstr(ds, "#define MN_DISCARD 0\n"));
        free(ds);
        r.step = 64;
        r.refresh = -1;
        setenv("MNEMO_FUSED_DISCARD", "1", 1);
        ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_TF32, 128, 90, 0, &d) == MN_OK && d.path == MN_PATH_FUSED;
        ds = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_TF32, &d) : NULL;
        unsetenv("MNEMO_FUSED_DISCARD");
        CHECK("codegen/discard/knob_on_w_in_shared_memory", ds && strstr(ds, "#define MN_DISCARD 1\n"));
        if (ds) compile_line("codegen/nvrtc_sm90/discard_forced_p1_tf32", ds);
        free(ds);
    }
    mn_rule_free(&r);
}

/* The products' K-loop unroll the plan picks for the fused forward (issue
 * 14, measured on an H100), defined into its source: fp32 4; tf32 4 for
 * hidden widths from 256 on steps of 64 rows and more (P1), else 8 (P1-c16,
 * M1, a linear memory); bf16 2 for a linear memory and for hidden widths
 * from 256, else 8 (M1). The
 * fused backward defines none (the template's 1). MNEMO_FUSED_KUNROLL sets
 * both. */
static void test_plan_kunroll(void)
{
    mn_rule r;
    mn_rule_init(&r);
    mn_dims lin = {4, 32, 4096, 64, 64, 0, 0}, p1 = {4, 32, 4096, 64, 64, 256, 0}, m1 = {32, 16, 1024, 64, 64, 128, 0};
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    unsetenv("MNEMO_FUSED_KUNROLL");
    struct { int layers, step; const mn_dims *d; mn_precision p; int want; const char *name; } cases[] = {
        {1, 64, &lin, MN_PREC_BF16, 2, "codegen/kunroll/linear_bf16"},
        {1, 64, &lin, MN_PREC_TF32, 8, "codegen/kunroll/linear_tf32"},
        {2, 64, &p1, MN_PREC_BF16, 2, "codegen/kunroll/p1_bf16"},
        {2, 64, &p1, MN_PREC_FP32, 4, "codegen/kunroll/p1_fp32"},
        {2, 64, &m1, MN_PREC_BF16, 8, "codegen/kunroll/m1_bf16"},
        {2, 64, &p1, MN_PREC_TF32, 4, "codegen/kunroll/p1_tf32"},
        {2, 64, &m1, MN_PREC_TF32, 8, "codegen/kunroll/m1_tf32"},
        {2, 16, &p1, MN_PREC_TF32, 8, "codegen/kunroll/p1_c16_tf32"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        r.layers = cases[i].layers;
        r.step = cases[i].step;
        bool ok = mn_cuda_plan_rule(&r, cases[i].d, cases[i].p, 128, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
        char *src = ok ? mn_cuda_plan_source(&r, cases[i].d, cases[i].p, &pl) : NULL;
        char want[32];
        snprintf(want, sizeof want, "#define MN_KUNROLL %d\n", cases[i].want);
        CHECK(cases[i].name, ok && pl.kunroll == cases[i].want && src && strstr(src, want));
        free(src);
    }
    r.layers = 2;
    r.step = 64;
    mn_cuda_plan bp;
    bool ok = mn_cuda_plan_backward(&r, &p1, MN_PREC_BF16, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
    char *bsrc = ok ? mn_cuda_fused_grad_source(&r, &p1, MN_PREC_BF16, &bp) : NULL;
    /* no plan's define: the first line of its kind is the template's own (1) under #ifndef */
    const char *first = bsrc ? strstr(bsrc, "#define MN_KUNROLL ") : NULL;
    CHECK("codegen/kunroll/backward_default", ok && bp.kunroll == 0 && first && strstr(bsrc, "#ifndef MN_KUNROLL") &&
                                                  first > strstr(bsrc, "#ifndef MN_KUNROLL"));
    free(bsrc);
    setenv("MNEMO_FUSED_KUNROLL", "4", 1);
    ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &pl) == MN_OK;
    char *ksrc = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &pl) : NULL;
    CHECK("codegen/kunroll/knob_wins", ksrc && pl.kunroll == 4 && strstr(ksrc, "#define MN_KUNROLL 4\n") &&
                                           !strstr(ksrc, "#define MN_KUNROLL 2\n"));
    free(ksrc);
    ok = mn_cuda_plan_backward(&r, &p1, MN_PREC_BF16, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
    CHECK("codegen/kunroll/knob_sets_backward", ok && bp.kunroll == 4);
    unsetenv("MNEMO_FUSED_KUNROLL");
    mn_rule_free(&r);
}

static void test_ragged_plan(void)
{
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.step = 4;
    mn_dims small = {2, 3, 10, 16, 8, 32, 0}, wide = {1, 1, 10, 256, 256, 64, 0};
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    bool fused = mn_cuda_plan_rule(&r, &small, MN_PREC_FP32, 6, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
    CHECK("codegen/lengths/plan_without_lengths_fused", fused);
    bool planned = mn_cuda_plan_rule(&r, &small, MN_PREC_FP32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/lengths/plan_fused", planned && pl.path == MN_PATH_FUSED);
    planned = mn_cuda_plan_rule(&r, &wide, MN_PREC_FP32, 1, 90, 0, &pl) == MN_OK;
    CHECK("codegen/lengths/plan_large", planned && pl.path == MN_PATH_LARGE);
    char *lsrc = mn_cuda_plan_source(&r, &wide, MN_PREC_FP32, &pl);
    CHECK("codegen/lengths/large_source_reads_them", lsrc && strstr(lsrc, "a.lengths[m / a.heads]"));
    free(lsrc);
    CHECK("codegen/lengths/forced_large_taken",
          forced_plan_is(&r, &small, MN_PREC_FP32, "large", MN_PATH_LARGE, &pl));
    CHECK("codegen/lengths/forced_fused_taken",
          forced_plan_is(&r, &small, MN_PREC_FP32, "fused", MN_PATH_FUSED, &pl));
    char *fsrc = mn_cuda_plan_source(&r, &small, MN_PREC_FP32, &pl);
    CHECK("codegen/lengths/fused_source_reads_them", fsrc && strstr(fsrc, "a.lengths[m / a.heads]") &&
                                                         strstr(fsrc, "mn_fused_padding_tail"));
    free(fsrc);
    CHECK("codegen/lengths/forced_general",
          forced_plan_is(&r, &small, MN_PREC_FP32, "general", MN_PATH_GENERAL, &pl));
    char *src = mn_cuda_rule_source(&r, &small, MN_PREC_FP32);
    CHECK("codegen/lengths/general_source_reads_them", src && strstr(src, "a.lengths[m / a.heads]"));
    if (src) compile_line("codegen/nvrtc_sm90/general_with_lengths", src);
    free(src);
    mn_rule_free(&r);
}

/* out_norm (layernorm, rmsnorm): the general path's source carries the norm
 * and compiles in each precision (1 to 3 layers, bias and residual on and
 * off, a step longer than a chunk); so does the fused path's (1 and 2
 * layers, dv not a multiple of 16, a step of two chunks, an anchor, both
 * retrieves); a rule without it says 0; the plan keeps a small rule on the
 * fused path (the same chunk rows as without the norm), sends a wide one to
 * the general path rather than the large one, with the reason, takes a
 * forced fused path and refuses a forced large one by name. */
static void norm_rule(mn_rule *r, mn_norm norm, int layers, int bias, int residual, int step)
{
    mn_rule_init(r);
    r->layers = layers;
    r->bias = bias;
    r->residual = residual;
    r->step = step;
    r->out_norm = norm;
}

static void test_out_norm(void)
{
    static const struct {
        const char *name;
        mn_norm norm;
        int layers, bias, residual, step;
        mn_precision prec;
        int64_t dk, dv, dh;
    } cases[] = {
        {"layernorm_mlp2_residual_fp32", MN_NORM_LAYERNORM, 2, 1, 1, 70, MN_PREC_FP32, 8, 8, 12},
        {"rmsnorm_linear_tf32", MN_NORM_RMSNORM, 1, 0, 0, 3, MN_PREC_TF32, 6, 5, 0},
        {"layernorm_mlp3_bf16", MN_NORM_LAYERNORM, 3, 0, 0, 2, MN_PREC_BF16, 4, 40, 7},
        {"rmsnorm_mlp2_residual_bias_bf16", MN_NORM_RMSNORM, 2, 1, 1, 1, MN_PREC_BF16, 33, 33, 9},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        mn_rule r;
        norm_rule(&r, cases[i].norm, cases[i].layers, cases[i].bias, cases[i].residual, cases[i].step);
        mn_dims d = {2, 3, 10, cases[i].dk, cases[i].dv, cases[i].dh, 0};
        char *src = mn_cuda_rule_source(&r, &d, cases[i].prec);
        char label[120], nvrtc[120], define[40];
        snprintf(define, sizeof define, "#define MN_OUT_NORM %d", cases[i].norm == MN_NORM_LAYERNORM ? 1 : 2);
        snprintf(label, sizeof label, "codegen/out_norm/source/%s", cases[i].name);
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/out_norm/%s", cases[i].name);
        check_source(label, nvrtc, src, define, "mn_out_norm_backward");
        /* the general backward's source (fp32 whatever the forward's precision) with the norm's adjoints */
        snprintf(label, sizeof label, "codegen/out_norm/grad_source/%s", cases[i].name);
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/out_norm/backward/%s", cases[i].name);
        check_source(label, nvrtc, mn_cuda_grad_source(&r, &d), define, "mn_gnorm_reverse");
        mn_rule_free(&r);
    }
    /* the backward's plan: the fused forward runs out_norm, the fused
     * backward does not; the general one takes it, and a forced fused
     * backward is refused, both naming out_norm */
    {
        mn_rule r;
        norm_rule(&r, MN_NORM_LAYERNORM, 2, 1, 0, 4);
        r.refresh = 4;
        mn_dims d = {2, 3, 16, 16, 16, 32, 0};
        mn_cuda_plan fwd, bp;
        unsetenv("MNEMO_CUDA_PATH");
        unsetenv("MNEMO_CUDA_BACKWARD");
        char why[256];
        bool fused = mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 6, 90, 0, &fwd) == MN_OK && fwd.path == MN_PATH_FUSED;
        bool planned = mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
        CHECK("codegen/out_norm/backward_plan_general", fused && planned && bp.path == MN_PATH_GENERAL &&
                                                            strstr(bp.why, "out_norm layernorm") &&
                                                            mn_cuda_backward_rule_covers(&r, why, sizeof why));
        setenv("MNEMO_CUDA_BACKWARD", "fused", 1);
        CHECK("codegen/out_norm/backward_forced_fused_refused",
              mn_cuda_plan_backward(&r, &d, MN_PREC_TF32, 90, 0, &bp) == MN_ERR_UNSUPPORTED &&
                  strstr(mn_last_error(), "MNEMO_CUDA_BACKWARD=fused: out_norm layernorm"));
        unsetenv("MNEMO_CUDA_BACKWARD");
        mn_rule_free(&r);
    }
    /* the fused path's source: the norm's row pass, loss and backward through it */
    static const struct {
        const char *name;
        mn_norm norm;
        int layers, bias, residual, step, refresh, after;
        mn_precision prec;
        int64_t dk, dv, dh;
    } fcases[] = {
        {"layernorm_linear_fp32", MN_NORM_LAYERNORM, 1, 0, 0, 16, 16, 0, MN_PREC_FP32, 16, 16, 0},
        {"rmsnorm_linear_residual_bias_dv40_tf32", MN_NORM_RMSNORM, 1, 1, 1, 8, 0, 1, MN_PREC_TF32, 40, 40, 0},
        {"layernorm_mlp2_residual_step64_fp32", MN_NORM_LAYERNORM, 2, 1, 1, 64, 128, 1, MN_PREC_FP32, 64, 64, 256},
        {"rmsnorm_mlp2_bf16", MN_NORM_RMSNORM, 2, 1, 0, 4, 4, 0, MN_PREC_BF16, 24, 40, 32},
        {"layernorm_mlp2_residual_anchor_bf16", MN_NORM_LAYERNORM, 2, 0, 1, 2, 0, 1, MN_PREC_BF16, 40, 40, 64},
        {"layernorm_linear_anchor_tf32", MN_NORM_LAYERNORM, 1, 1, 0, 3, 6, 0, MN_PREC_TF32, 20, 128, 0},
    };
    for (size_t i = 0; i < sizeof fcases / sizeof *fcases; i++) {
        mn_rule r;
        norm_rule(&r, fcases[i].norm, fcases[i].layers, fcases[i].bias, fcases[i].residual, fcases[i].step);
        r.refresh = fcases[i].refresh;
        r.retrieve = fcases[i].after ? MN_RETRIEVE_AFTER : MN_RETRIEVE_BEFORE;
        mn_dims d = {2, 3, 10, fcases[i].dk, fcases[i].dv, fcases[i].dh, 0};
        mn_cuda_plan pl;
        char label[120], nvrtc[120], define[40];
        unsetenv("MNEMO_CUDA_PATH");
        bool planned = mn_cuda_plan_rule(&r, &d, fcases[i].prec, 6, 90, 0, &pl) == MN_OK;
        snprintf(label, sizeof label, "codegen/out_norm/plan_fused/%s", fcases[i].name);
        CHECK(label, planned && pl.path == MN_PATH_FUSED);
        if (!planned || pl.path != MN_PATH_FUSED) {
            if (planned) printf("  plan: %s: %s\n", mn_cuda_path_name(pl.path), pl.why);
            mn_rule_free(&r);
            continue;
        }
        char *src = mn_cuda_plan_source(&r, &d, fcases[i].prec, &pl);
        snprintf(define, sizeof define, "#define MN_OUT_NORM %d", fcases[i].norm == MN_NORM_LAYERNORM ? 1 : 2);
        snprintf(label, sizeof label, "codegen/out_norm/fused_source/%s", fcases[i].name);
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/out_norm/fused/%s", fcases[i].name);
        check_source(label, nvrtc, src, define, "mn_fused_norm_row"); /* mn_fused_norm_row is the fused kernel's */
        mn_rule_free(&r);
    }
    /* every v2 option the kernel source carries, at once: glu beside out_norm
     * (their workspace slices follow each other), newton_schulz, in bf16; the
     * plan names each reason for the general path in one line (out_norm is
     * none: the fused path runs it) */
    {
        mn_rule r;
        mn_rule_init(&r);
        r.layers = 3;
        r.glu = 1;
        r.residual = 1;
        r.step = 70;
        r.out_norm = MN_NORM_RMSNORM;
        r.precondition = MN_PRECOND_NEWTON_SCHULZ;
        mn_dims d = {2, 3, 10, 12, 12, 20, 0};
        char *src = mn_cuda_rule_source(&r, &d, MN_PREC_BF16);
        CHECK("codegen/out_norm/source/with_glu_ns", src && strstr(src, "#define MN_GLU 1") &&
                                                       strstr(src, "#define MN_OUT_NORM 2"));
        if (src) compile_line("codegen/nvrtc_sm90/out_norm/with_glu_ns_bf16", src);
        free(src);
        mn_cuda_plan pl;
        unsetenv("MNEMO_CUDA_PATH");
        bool planned = mn_cuda_plan_rule(&r, &d, MN_PREC_BF16, 6, 90, 0, &pl) == MN_OK;
        CHECK("codegen/out_norm/plan_lists_every_reason",
              planned && pl.path == MN_PATH_GENERAL && strstr(pl.why, "3 layers") &&
                  strstr(pl.why, "glu: the general path runs it") && !strstr(pl.why, "out_norm"));
        mn_rule_free(&r);
    }
    mn_rule r;
    mn_rule_init(&r);
    mn_dims small = {2, 3, 10, 8, 8, 0, 0}, wide = {2, 3, 10, 16, 16, 256, 0};
    char *src = mn_cuda_rule_source(&r, &small, MN_PREC_FP32);
    CHECK("codegen/out_norm/none_is_0", src && strstr(src, "#define MN_OUT_NORM 0"));
    free(src);
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    bool fused = mn_cuda_plan_rule(&r, &small, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
    r.out_norm = MN_NORM_LAYERNORM;
    bool planned = mn_cuda_plan_rule(&r, &small, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/out_norm/plan_fused", fused && planned && pl.path == MN_PATH_FUSED &&
                                             strstr(pl.why, "the weights stay in shared memory") &&
                                             !strstr(pl.why, "out_norm"));
    /* issue 13's P1-ln: the norm keeps no rows in shared memory, so the
     * chunk rows and shared memory are P1's */
    {
        mn_rule p1;
        mn_rule_init(&p1);
        p1.layers = 2;
        p1.bias = true;
        p1.step = 64;
        mn_dims d1 = {4, 32, 4096, 64, 64, 256, 0};
        mn_cuda_plan plain, normed;
        bool ok = mn_cuda_plan_rule(&p1, &d1, MN_PREC_FP32, 128, 90, 0, &plain) == MN_OK;
        p1.out_norm = MN_NORM_LAYERNORM;
        ok = ok && mn_cuda_plan_rule(&p1, &d1, MN_PREC_FP32, 128, 90, 0, &normed) == MN_OK;
        CHECK("codegen/out_norm/plan_p1_ln_fused_as_p1", ok && plain.path == MN_PATH_FUSED &&
                                                            normed.path == MN_PATH_FUSED &&
                                                            normed.rows == plain.rows &&
                                                            normed.smem_bytes == plain.smem_bytes);
        mn_rule_free(&p1);
    }
    r.layers = 2;
    r.bias = true;
    r.out_norm = MN_NORM_RMSNORM;
    planned = mn_cuda_plan_rule(&r, &wide, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/out_norm/plan_general_not_large",
          planned && pl.path == MN_PATH_GENERAL &&
                         strstr(pl.why, "out_norm rmsnorm: the fused and general paths run it"));
    mn_dims small2 = {2, 3, 10, 8, 8, 16, 0};
    setenv("MNEMO_CUDA_PATH", "large", 1);
    CHECK("codegen/out_norm/forced_large_refused",
          mn_cuda_plan_rule(&r, &small2, MN_PREC_TF32, 6, 90, 0, &pl) != MN_OK &&
              strstr(mn_last_error(), "MNEMO_CUDA_PATH=large: out_norm rmsnorm: the fused and general paths run it"));
    CHECK("codegen/out_norm/forced_fused_taken",
          forced_plan_is(&r, &small2, MN_PREC_TF32, "fused", MN_PATH_FUSED, &pl));
    CHECK("codegen/out_norm/forced_general_taken",
          forced_plan_is(&r, &small, MN_PREC_TF32, "general", MN_PATH_GENERAL, &pl));
    mn_rule_free(&r);
}

/* glu (gated hidden layers): the general path's source compiles in each
 * precision, for 2 and 3 layers with and without bias, with newton_schulz
 * (its U_i), a custom activation, and so does the large path's (without
 * newton_schulz, which it refuses); the plan sends a small glu rule to the
 * general path and one with a dimension of 256 to the large path, each with
 * the reason, refuses a forced fused path by name, and a forced large path
 * only with newton_schulz. */
static void test_glu(void)
{
    static const rule_case gcases[] = {
        {"glu2_silu_bias_norm_fp32", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_TENSOR,
         NULL, 3, 6, MN_RETRIEVE_AFTER, MN_PREC_FP32, 6, 5, 7, false, false},
        {"glu2_gelu_residual_tf32", 2, 0, 1, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL,
         NULL, 2, 0, MN_RETRIEVE_BEFORE, MN_PREC_TF32, 6, 6, 9, false, true},
        {"glu3_custom_act_bias_bf16", 3, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_MSE, NULL,
         MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL, "m*tanh(g/m)", 4, 4, MN_RETRIEVE_AFTER, MN_PREC_BF16, 5, 3, 8, true,
         false},
        {"glu3_silu_long_step_fp32", 3, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL,
         NULL, 70, 140, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 4, 4, 6, false, false},
    };
    for (size_t i = 0; i < sizeof gcases / sizeof *gcases; i++) {
        for (int ns = 0; ns < 2; ns++) {
            mn_rule r;
            mn_status st = make_rule(&gcases[i], &r);
            r.glu = true;
            if (ns) {
                r.precondition = MN_PRECOND_NEWTON_SCHULZ;
                r.ns_steps = 2;
            }
            if (st == MN_OK) st = mn_rule_validate(&r);
            mn_dims d = dims_of(&gcases[i]);
            char *src = st == MN_OK ? mn_cuda_rule_source(&r, &d, gcases[i].prec) : NULL;
            char label[120], nvrtc[120];
            snprintf(label, sizeof label, "codegen/glu/%s%s/source", gcases[i].name, ns ? "_ns" : "");
            snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/%s%s", gcases[i].name, ns ? "_ns" : "");
            check_source(label, nvrtc, src, "#define MN_GLU 1", "mn_backward");
            if (!ns) {
                src = st == MN_OK ? mn_cuda_large_source(&r, &d, gcases[i].prec) : NULL;
                snprintf(label, sizeof label, "codegen/glu/%s/large_source", gcases[i].name);
                snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/large_%s", gcases[i].name);
                check_source(label, nvrtc, src, "#define MN_GLU 1", "mn_large_act_kernel");
            }
            mn_rule_free(&r);
        }
    }
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.glu = true;
    r.step = 4;
    mn_dims d = {2, 3, 10, 16, 16, 32, 0};
    mn_cuda_plan pl;
    unsetenv("MNEMO_CUDA_PATH");
    r.glu = false;
    bool fused = mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
    r.glu = true;
    bool planned = mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/glu/plan_general", fused && planned && pl.path == MN_PATH_GENERAL &&
                                          strstr(pl.why, "glu: the general and large paths run it") &&
                                          strstr(pl.why, "below 256") && !strchr(pl.why, '\n'));
    /* P1's shape (64-256-64): fused without glu, large with it */
    mn_dims big = {2, 3, 10, 64, 64, 256, 0};
    r.glu = false;
    bool big_fused = mn_cuda_plan_rule(&r, &big, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED;
    r.glu = true;
    planned = mn_cuda_plan_rule(&r, &big, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/glu/plan_large_at_256", big_fused && planned && pl.path == MN_PATH_LARGE &&
                                               strstr(pl.why, "glu: the general and large paths run it") &&
                                               strstr(pl.why, "256 >= 256") && !strchr(pl.why, '\n'));
    /* LaCT's memory, glu with newton_schulz: the large path; with out_norm
     * too, the general path, out_norm named */
    r.precondition = MN_PRECOND_NEWTON_SCHULZ;
    planned = mn_cuda_plan_rule(&r, &big, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/glu/plan_large_with_ns", planned && pl.path == MN_PATH_LARGE);
    r.out_norm = MN_NORM_LAYERNORM;
    planned = mn_cuda_plan_rule(&r, &big, MN_PREC_TF32, 6, 90, 0, &pl) == MN_OK;
    CHECK("codegen/glu/plan_general_with_out_norm", planned && pl.path == MN_PATH_GENERAL &&
                                                        strstr(pl.why, "out_norm layernorm") &&
                                                        strstr(pl.why, "glu: the general path runs it"));
    setenv("MNEMO_CUDA_PATH", "large", 1);
    CHECK("codegen/glu/forced_large_refuses_out_norm",
          mn_cuda_plan_rule(&r, &big, MN_PREC_TF32, 6, 90, 0, &pl) != MN_OK && strstr(mn_last_error(), "out_norm") &&
              !strchr(mn_last_error(), '\n'));
    unsetenv("MNEMO_CUDA_PATH");
    r.out_norm = MN_NORM_NONE;
    r.precondition = MN_PRECOND_NONE;
    r.glu = false;
    char *src = mn_cuda_rule_source(&r, &d, MN_PREC_FP32);
    CHECK("codegen/glu/off_define_0", src && strstr(src, "#define MN_GLU 0"));
    free(src);
    r.glu = true;
    setenv("MNEMO_CUDA_PATH", "fused", 1);
    CHECK("codegen/glu/forced_fused_refused", mn_cuda_plan_rule(&r, &d, MN_PREC_TF32, 6, 90, 0, &pl) != MN_OK &&
                                                  strstr(mn_last_error(), "glu") && !strchr(mn_last_error(), '\n'));
    CHECK("codegen/glu/forced_large_taken",
          forced_plan_is(&r, &d, MN_PREC_TF32, "large", MN_PATH_LARGE, &pl));
    CHECK("codegen/glu/forced_general",
          forced_plan_is(&r, &d, MN_PREC_TF32, "general", MN_PATH_GENERAL, &pl));
    mn_rule_free(&r);
}

/* glu's backward on the GPU (kernels/grad_kernel.cuh): the general
 * backward's source compiles for 2 and 3 layers with and without bias
 * (fp32: the general backward computes in fp32 whatever the run's
 * precision), the rule is covered (the CPU no longer takes its backward),
 * and the backward's plan sends it to the general backward naming glu, at a
 * small shape and at P1's (where the forward is large), and refuses a
 * forced fused backward by name. */
static void test_glu_backward(void)
{
    static const rule_case gcases[] = {
        {"glu2_silu_bias_norm", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_TENSOR, NULL, 3,
         6, MN_RETRIEVE_AFTER, MN_PREC_FP32, 6, 5, 7, false, false},
        {"glu2_gelu_residual", 2, 0, 1, MN_ACT_GELU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 2,
         0, MN_RETRIEVE_BEFORE, MN_PREC_TF32, 6, 6, 9, false, true},
        {"glu3_custom_act_bias", 3, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_CUSTOM, "log(1 + r^2)",
         MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL, "m*tanh(g/m)", 4, 4, MN_RETRIEVE_AFTER, MN_PREC_BF16, 5, 3, 8, true,
         false},
        {"glu3_silu_long_step", 3, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 70,
         140, MN_RETRIEVE_BEFORE, MN_PREC_FP32, 4, 4, 6, false, false},
    };
    char label[160], nvrtc[160], why[512];
    for (size_t i = 0; i < sizeof gcases / sizeof *gcases; i++) {
        mn_rule r;
        mn_status st = make_rule(&gcases[i], &r);
        r.glu = true;
        if (st == MN_OK) st = mn_rule_validate(&r);
        mn_dims d = dims_of(&gcases[i]);
        snprintf(label, sizeof label, "codegen/glu_backward/%s/source", gcases[i].name);
        snprintf(nvrtc, sizeof nvrtc, "codegen/nvrtc_sm90/glu_backward/%s", gcases[i].name);
        check_source(label, nvrtc, st == MN_OK ? mn_cuda_grad_source(&r, &d) : NULL, "#define MN_GLU 1",
                     "mn_grad_kernel");
        snprintf(label, sizeof label, "codegen/glu_backward/%s/covered", gcases[i].name);
        CHECK(label, st == MN_OK && mn_cuda_backward_rule_covers(&r, why, sizeof why) && why[0] == '\0');
        mn_rule_free(&r);
    }
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.glu = true;
    r.step = 4;
    r.refresh = 4;
    mn_dims small = {2, 3, 10, 16, 16, 32, 0}, p1 = {4, 32, 4096, 64, 64, 256, 0};
    mn_cuda_plan bp;
    unsetenv("MNEMO_CUDA_PATH");
    unsetenv("MNEMO_CUDA_BACKWARD");
    /* without glu, these two shapes take the fused backward */
    r.glu = false;
    bool fused_small = mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
    bool fused_p1 = mn_cuda_plan_backward(&r, &p1, MN_PREC_TF32, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_FUSED;
    r.glu = true;
    bool planned = mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/glu_backward/plan_general_small", fused_small && planned && bp.path == MN_PATH_GENERAL &&
                                                         strstr(bp.why, "glu: the general backward runs it") &&
                                                         !strchr(bp.why, '\n'));
    planned = mn_cuda_plan_backward(&r, &p1, MN_PREC_TF32, 90, 0, &bp) == MN_OK;
    CHECK("codegen/glu_backward/plan_general_p1", fused_p1 && planned && bp.path == MN_PATH_GENERAL &&
                                                      strstr(bp.why, "glu: the general backward runs it"));
    setenv("MNEMO_CUDA_BACKWARD", "fused", 1);
    CHECK("codegen/glu_backward/forced_fused_refused",
          mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_ERR_UNSUPPORTED &&
              strstr(mn_last_error(), "MNEMO_CUDA_BACKWARD=fused: glu") && !strchr(mn_last_error(), '\n'));
    setenv("MNEMO_CUDA_BACKWARD", "general", 1);
    CHECK("codegen/glu_backward/forced_general",
          mn_cuda_plan_backward(&r, &small, MN_PREC_TF32, 90, 0, &bp) == MN_OK && bp.path == MN_PATH_GENERAL);
    unsetenv("MNEMO_CUDA_BACKWARD");
    /* glu beside out_norm: the GPU's general backward runs both */
    r.out_norm = MN_NORM_RMSNORM;
    bool covered = mn_cuda_backward_rule_covers(&r, why, sizeof why);
    CHECK("codegen/glu_backward/covered_beside_out_norm", covered && why[0] == '\0');
    mn_rule_free(&r);
}

/* bf16's weights as bf16 rows in shared memory (fused_kernel.cuh's
 * MN_W16), the anchor's and the current W's: where W lives in the
 * workspace (refresh > step: P1-c16) in bf16, counted in the shared
 * memory (4 floats a weight row more than P's floats) and defined into the
 * source, which compiles; not in tf32, not where the gradient point is W
 * (P1), not with newton_schulz, not in a cluster (H1's head-128 memory on
 * sm_90), not in the fused backward; MNEMO_FUSED_W16=0 keeps the floats. */
static void test_w16(void)
{
    mn_rule r;
    mlp_rule_init(&r, 16);
    r.refresh = 64;
    mn_dims p1 = {4, 32, 4096, 64, 64, 256, 0}, h1 = {8, 8, 4096, 128, 128, 256, 0};
    const long rows16 = 4L * 4 * (256 + 64); /* W1's 256 rows and W2's 64, 4 floats each */
    mn_cuda_plan t, b, bw;
    unsetenv("MNEMO_CUDA_PATH");
    unsetenv("MNEMO_FUSED_W16");
    bool ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_TF32, 128, 90, 0, &t) == MN_OK &&
              mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK && b.path == MN_PATH_FUSED;
    CHECK("codegen/w16/p1_c16_bf16", ok && b.w16 && !t.w16 && b.rows == t.rows && b.min_blocks == 1 &&
                                         b.smem_bytes == t.smem_bytes + rows16 + (b.z_pad ? 16L * b.rows : 0));
    char *src = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &b) : NULL;
    CHECK("codegen/w16/p1_c16_bf16_source", src && strstr(src, "#define MN_W16 1\n"));
    if (src) compile_line("codegen/nvrtc_sm90/w16_p1_c16_bf16", src);
    free(src);
    src = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_TF32, &t) : NULL;
    CHECK("codegen/w16/p1_c16_tf32_source", src && !strstr(src, "MN_W16 1"));
    free(src);
    CHECK("codegen/w16/not_in_the_backward",
          mn_cuda_plan_backward(&r, &p1, MN_PREC_BF16, 90, 0, &bw) == MN_OK && bw.path == MN_PATH_FUSED && !bw.w16);
    setenv("MNEMO_FUSED_W16", "0", 1);
    mn_cuda_plan off;
    ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &off) == MN_OK;
    unsetenv("MNEMO_FUSED_W16");
    CHECK("codegen/w16/knob_off", ok && !off.w16 && off.smem_bytes == b.smem_bytes - rows16);
    src = ok ? mn_cuda_plan_source(&r, &p1, MN_PREC_BF16, &off) : NULL;
    CHECK("codegen/w16/knob_off_source", src && !strstr(src, "MN_W16 1"));
    free(src);
    ok = mn_cuda_plan_rule(&r, &h1, MN_PREC_BF16, 64, 90, 0, &b) == MN_OK;
    CHECK("codegen/w16/not_in_a_cluster", ok && b.path == MN_PATH_FUSED && b.cluster > 1 && !b.w16);
    r.precondition = MN_PRECOND_NEWTON_SCHULZ;
    ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK;
    CHECK("codegen/w16/not_with_newton_schulz", ok && b.path == MN_PATH_FUSED && !b.w16);
    r.precondition = MN_PRECOND_NONE;
    r.step = 64;
    ok = mn_cuda_plan_rule(&r, &p1, MN_PREC_BF16, 128, 90, 0, &b) == MN_OK;
    CHECK("codegen/w16/not_where_p_is_w", ok && b.path == MN_PATH_FUSED && !b.w16);
    mn_rule_free(&r);
}

int main(void)
{
    test_w16();
    test_grad_in_shared();
    test_plan_kunroll();
    test_ragged_plan();
    test_out_norm();
    test_glu();
    test_glu_backward();
    test_newton_schulz();
    test_cache_key();
    test_same_source_rule();
    test_broken_source();
    test_source_contents();
    test_disk_cache();
    test_backward_plan();
    test_large_backward();
    test_large_backward_blocks();
    test_qk_norm_backward();
    test_compile_cases();
    return CHECK_DONE();
}

#else

int main(void)
{
    SKIP("codegen", "built without CUDA (no NVRTC)");
    return CHECK_DONE();
}

#endif
