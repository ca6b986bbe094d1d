/* test_fused_emulated.c: the GPU's fused forward (kernels/fused_step.cuh's
 * mn_fused_step_kernel) against the CPU engine on a machine without a GPU.
 * For each case (an MLP with biases and a norm clip, a short last step; a
 * plain linear memory, whose retrieval row is summed in the update; q given;
 * lengths given, a sequence ending inside a step and one inside the first;
 * a refresh block of two steps, the gradient point the anchor) it generates
 * the rule's fused source as the CUDA backend plans it for sm_90, compiles
 * it as C++ with tests/emu/cuda_shim.h (threads as pthreads; the products
 * as plain fp32 loops over the same tiles) and runs tests/emu/step_emu.cpp
 * on the inputs and initial state of a CPU run made here, which compares y,
 * the losses, the per-step outputs and the final weights and momenta. The
 * same algorithm in fp32 agrees to about 1e-7 (the bound is 1e-5). Needs a
 * C++ compiler (g++ or $CXX): without one, SKIP. Run from the repository
 * root (tests/run.sh does). */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "rule_cases.h"
#include "emu_case.h"
#include "../../kernels/codegen.h"
#include "../../kernels/plan.h"

#include <stdlib.h>

typedef struct {
    const char *name;
    rule_case rule;
    long long n;  /* tokens a memory */
    bool q;       /* a query input */
    bool lengths; /* ragged: lengths {n - 5, 3} */
    long long split; /* > 0: also fed in two writes, the first of this many tokens (whole steps) */
} fused_case;

static const fused_case cases[] = {
    {"mlp_gelu_bias_norm_clip",
     {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8, MN_RETRIEVE_AFTER,
      MN_PREC_FP32, 16, 16, 32, false, false},
     37, false, false, 16},
    {"linear_row_in_update",
     {"", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 16, 16,
      MN_RETRIEVE_AFTER, MN_PREC_FP32, 32, 32, 0, false, false},
     48, false, false, 0},
    {"mlp_q", {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8,
                MN_RETRIEVE_AFTER, MN_PREC_FP32, 16, 16, 32, false, false},
     37, true, false, 0},
    {"mlp_lengths", {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8,
                      MN_RETRIEVE_AFTER, MN_PREC_FP32, 16, 16, 32, false, false},
     37, false, true, 0},
    /* steps as long as the chunk (no spare row) and W in the workspace
     * (refresh 2 steps: the gradient point is the anchor), so each step's
     * last token is read at W^(s+1) inside the update (MN_ROWRET2), with
     * biases; 48 tokens: the run ends in a refresh block */
    {"mlp_row_in_update",
     {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 16, 32,
      MN_RETRIEVE_AFTER, MN_PREC_FP32, 32, 32, 64, false, false},
     48, false, false, 16},
    /* the same without biases, a row of W2 a whole warp */
    {"mlp_row_in_update_anchor",
     {"", 2, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 16, 32,
      MN_RETRIEVE_AFTER, MN_PREC_FP32, 32, 16, 128, false, false},
     64, false, false, 48},
    /* odd sizes: parameters of odd length (G's next one padded to a float4,
     * mn_gacc's pairs where the rows' length is even) and odd rows (single
     * floats) */
    {"mlp_odd_sizes",
     {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8, MN_RETRIEVE_AFTER,
      MN_PREC_FP32, 9, 7, 14, false, false},
     29, false, false, 0},
    {"mlp_silu_huber_refresh_block",
     {"", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL, NULL, 6, 12,
      MN_RETRIEVE_BEFORE, MN_PREC_FP32, 12, 8, 24, false, true},
     41, false, false, 18},
};

/* The rule's fused source as the backend plans it (with its run-time
 * constants' values: write_emu_source). */
static bool write_source(const mn_rule *r, const mn_dims *d, bool with_q, bool with_lengths, const char *path,
                         long long *work_floats, char *why, size_t wlen)
{
    mn_cuda_plan pl;
    if (mn_cuda_plan_rule(r, d, MN_PREC_FP32, d->B * d->H, 90, 0, &pl) != MN_OK || pl.path != MN_PATH_FUSED) {
        snprintf(why, wlen, "not planned on the fused path: %s", pl.why);
        return false;
    }
    pl.with_q = with_q; /* as kernels/engine_cuda.c sets them from a run's inputs */
    pl.with_lengths = with_lengths;
    *work_floats = (long long)mn_fused_work_floats(r, d, &pl);
    char *src = mn_cuda_plan_source(r, d, MN_PREC_FP32, &pl);
    const bool ok = write_emu_source(path, src, r);
    free(src);
    if (!ok) snprintf(why, wlen, "no source: %s", mn_last_error());
    return ok;
}

/* The case's inputs and initial state, a CPU run of them, and the file
 * step_emu.cpp reads; also the generated source. Returns false with why. */
static bool prepare(const fused_case *c, const char *dir, char *why, size_t wlen)
{
    mn_rule r;
    if (make_rule(&c->rule, &r) != MN_OK) {
        snprintf(why, wlen, "the rule is invalid: %s", mn_last_error());
        mn_rule_free(&r);
        return false;
    }
    const int64_t B = 2, H = 2, n = c->n, S = (n + c->rule.step - 1) / c->rule.step;
    mn_dims d = {B, H, n, c->rule.dk, c->rule.dv, c->rule.dh, S};
    char path[512];
    long long work_floats = 0;
    snprintf(path, sizeof path, "%s/step.cu", dir);
    bool ok = write_source(&r, &d, c->q, c->lengths, path, &work_floats, why, wlen);
    /* and the source of a run that gives q and lengths, for the same inputs
     * where they give neither: the code for them compiled in, never taken;
     * and with G's rows swizzled where G is in shared memory (MN_G_SWZ,
     * the plan's choice in tf32 and bf16; these cases are fp32): a layout,
     * so the same bits again */
    snprintf(path, sizeof path, "%s/step_all.cu", dir);
    const char *gswz = getenv("MNEMO_FUSED_GSWZ");
    char gswz_was[8] = "";
    if (gswz) snprintf(gswz_was, sizeof gswz_was, "%s", gswz);
    setenv("MNEMO_FUSED_GSWZ", "1", 1);
    if (ok) ok = write_source(&r, &d, true, true, path, &work_floats, why, wlen);
    if (gswz_was[0]) setenv("MNEMO_FUSED_GSWZ", gswz_was, 1);
    else unsetenv("MNEMO_FUSED_GSWZ");
    if (!ok) {
        mn_rule_free(&r);
        return false;
    }
    int64_t ks[4] = {B, H, n, d.dk}, vs[4] = {B, H, n, d.dv}, ts[3] = {B, H, n}, ss[3] = {B, H, S};
    mn_segment_inputs in = {0};
    mn_tensor init[MN_MAX_PARAMS] = {{0}}, mom[MN_MAX_PARAMS] = {{0}};
    mn_memory_state st = {0};
    mn_segment_outputs out = {0};
    mn_status s = random_tensor(&in.k, 4, ks, 0.5, 0);
    if (s == MN_OK) s = random_tensor(&in.v, 4, vs, 0.5, 0);
    if (s == MN_OK && c->q) s = random_tensor(&in.q, 4, ks, 0.5, 0);
    if (s == MN_OK) s = random_tensor(&in.theta, 3, ts, 0.03, 0.1);
    if (s == MN_OK) s = random_tensor(&in.eta, 3, ss, 0.05, 0.5);
    if (s == MN_OK) s = random_tensor(&in.alpha, 3, ss, 0.005, 0.01);
    long long lengths[2] = {(long long)n - 5, 3};
    if (s == MN_OK && c->lengths) {
        s = mn_tensor_empty(&in.lengths, MN_I64, 1, &B, MN_CPU);
        if (s == MN_OK) memcpy(mn_tensor_data(&in.lengths), lengths, sizeof lengths);
    }
    in.want_y = true;
    const int np = mn_rule_param_count(&r);
    for (int p = 0; p < np && s == MN_OK; p++) {
        int64_t sh[4] = {B, H};
        int pd = mn_rule_param_shape(&r, &d, p, sh + 2);
        s = random_tensor(&init[p], pd + 2, sh, 0.4, 0);
        if (s == MN_OK) s = random_tensor(&mom[p], pd + 2, sh, 0.05, 0);
    }
    if (s == MN_OK) s = mn_memory_create(&st, &r, &d, init, mom, MN_CPU);
    if (s == MN_OK) s = mn_segment_run(&st, &in, &out);
    snprintf(path, sizeof path, "%s/case.bin", dir);
    FILE *f = s == MN_OK ? fopen(path, "wb") : NULL;
    ok = f != NULL;
    if (ok) {
        long long h[7] = {B, H, n, S, np, c->lengths ? B : 0, work_floats};
        ok = fwrite(h, 8, 7, f) == 7 && (!c->lengths || fwrite(lengths, 8, 2, f) == 2);
        const mn_tensor *ins[] = {&in.k, &in.v, &in.q, &in.theta, &in.eta, &in.alpha};
        for (int i = 0; i < 6 && ok; i++) ok = write_tensor(f, ins[i]);
        for (int p = 0; p < np && ok; p++) ok = write_tensor(f, &init[p]) && write_tensor(f, &mom[p]);
        const mn_tensor *outs[] = {&out.y, &out.loss, &out.grad_norm, &out.clip_scale, &out.skipped, &out.step_loss,
                                   &out.weight_norm};
        for (int i = 0; i < 7 && ok; i++) ok = write_tensor(f, outs[i]);
        for (int p = 0; p < np && ok; p++) ok = write_tensor(f, &st.params[p]) && write_tensor(f, &st.momenta[p]);
        ok = fclose(f) == 0 && ok;
    }
    if (!ok) snprintf(why, wlen, "%s", s != MN_OK ? mn_last_error() : "cannot write the case file");
    mn_tensor *ts_[] = {&in.k, &in.v, &in.q, &in.theta, &in.eta, &in.alpha, &in.lengths};
    for (size_t i = 0; i < sizeof ts_ / sizeof *ts_; i++) mn_tensor_release(ts_[i]);
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&init[p]);
        mn_tensor_release(&mom[p]);
    }
    mn_segment_outputs_free(&out);
    mn_memory_free(&st);
    mn_rule_free(&r);
    return ok;
}

static void run_case(const fused_case *c, const char *cxx, const char *dir)
{
    char name[128], why[512] = "", source[512], source_all[512], all[2048], worst_name[64] = "", bits[32],
        bits_all[32];
    double worst, worst_all;
    snprintf(name, sizeof name, "fused_emulated/%s", c->name);
    snprintf(source, sizeof source, "%s/step.cu", dir);
    snprintf(source_all, sizeof source_all, "%s/step_all.cu", dir);
    if (!prepare(c, dir, why, sizeof why) ||
        !emulate(cxx, dir, "step_emu", source_all, "", &worst_all, worst_name, all, sizeof all, bits_all, why,
                 sizeof why) ||
        !emulate(cxx, dir, "step_emu", source, "", &worst, worst_name, all, sizeof all, bits, why, sizeof why)) {
        printf("FAIL %s: %s\n", name, why);
        check_failures_++;
        return;
    }
    /* the run's own source (without the code for q or lengths where the
     * case gives neither) and the one with it: the same bits */
    if (strcmp(bits, bits_all) != 0) {
        printf("FAIL %s: the outputs of the run's source (%s) and of the one with the code for q and lengths and G "
               "swizzled (%s) differ\n",
               name, bits, bits_all);
        check_failures_++;
    } else if (!c->q && !c->lengths) {
        printf("PASS %s/without the code for q and lengths, G as planned: the same bits as with them, G swizzled\n",
               name);
    }
    check_worst(name, worst, worst_name, "output", all);
    /* W's rows stored turned (MN_WROT, bf16's layout on the GPU) where every
     * layer's padded input is a multiple of 32, and z's where there is a
     * hidden layer, both of bf16's layouts at once (its odd rows turned,
     * MN_ZROT, and its rows wider, MN_ZPAD): the same bits */
    const rule_case *rc = &c->rule;
    if (rc->dk % 32 == 0 && (rc->layers == 1 || rc->dh % 32 == 0)) {
        char bits_rot[32], wname[256];
        const bool z = rc->layers == 2;
        snprintf(wname, sizeof wname, "%s/W's rows turned (MN_WROT)%s", name,
                 z ? ", z's turned and wide (MN_ZROT, MN_ZPAD)" : "");
        const char *flags = z ? "-DMN_WROT=1 -DMN_ZROT=1 -DMN_ZPAD=1" : "-DMN_WROT=1";
        if (!emulate(cxx, dir, "step_emu", source, flags, &worst, worst_name, all, sizeof all, bits_rot, why,
                     sizeof why)) {
            printf("FAIL %s: %s\n", wname, why);
            check_failures_++;
        } else if (strcmp(bits_rot, bits) != 0) {
            printf("FAIL %s: outputs %s, plain rows %s\n", wname, bits_rot, bits);
            check_failures_++;
        } else {
            printf("PASS %s: the same bits as plain rows\n", wname);
        }
    }
    if (c->split <= 0) return;
    /* a memory fed in two writes (a refresh block split by them reads the
     * anchor the first wrote) against the CPU's one run */
    char flag[64];
    snprintf(flag, sizeof flag, "-DMN_EMU_SPLIT=%lld", c->split);
    snprintf(name + strlen(name), sizeof name - strlen(name), "/two writes, the first of %lld tokens", c->split);
    if (!emulate(cxx, dir, "step_emu", source, flag, &worst, worst_name, all, sizeof all, NULL, why, sizeof why)) {
        printf("FAIL %s: %s\n", name, why);
        check_failures_++;
    } else {
        check_worst(name, worst, worst_name, "output", all);
    }
}

int main(void)
{
    (void)print_log; /* rule_cases.h's, for the NVRTC tests */
    char dir[] = "/tmp/mnemo_fused_emu_XXXXXX";
    const char *cxx = emu_setup("fused_emulated", "step_emu", dir);
    if (!cxx) return CHECK_DONE();
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(&cases[i], cxx, dir);
    return emu_finish(dir);
}

#else

int main(void)
{
    SKIP("fused_emulated", "built without CUDA (no code generator)");
    return CHECK_DONE();
}

#endif
