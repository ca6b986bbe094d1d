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
#include "../../kernels/codegen.h"
#include "../../kernels/plan.h"

#include <stdlib.h>
#include <unistd.h>

typedef struct {
    const char *name;
    rule_case rule;
    long long n;  /* tokens a memory */
    bool q;       /* a query input */
    bool lengths; /* ragged: lengths {n - 5, 3} */
} fused_case;

static const fused_case cases[] = {
    {"mlp_gelu_bias_norm_clip",
     {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8, MN_RETRIEVE_AFTER,
      MN_PREC_FP32, 16, 16, 32, false, false},
     37, false, false},
    {"linear_row_in_update",
     {"", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 16, 16,
      MN_RETRIEVE_AFTER, MN_PREC_FP32, 32, 32, 0, false, false},
     48, false, false},
    {"mlp_q", {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8,
                MN_RETRIEVE_AFTER, MN_PREC_FP32, 16, 16, 32, false, false},
     37, true, false},
    {"mlp_lengths", {"", 2, 1, 0, MN_ACT_GELU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL, NULL, 8, 8,
                      MN_RETRIEVE_AFTER, MN_PREC_FP32, 16, 16, 32, false, false},
     37, false, true},
    {"mlp_silu_huber_refresh_block",
     {"", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL, NULL, 6, 12,
      MN_RETRIEVE_BEFORE, MN_PREC_FP32, 12, 8, 24, false, true},
     41, false, false},
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static double uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static double normal(void)
{
    double u = uniform() + 1e-12, v = uniform();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* A new f32 CPU tensor of offset + scale N(0, 1) entries. */
static mn_status random_tensor(mn_tensor *t, int ndim, const int64_t *shape, double scale, double offset)
{
    MN_TRY(mn_tensor_empty(t, MN_F32, ndim, shape, MN_CPU));
    float *p = mn_tensor_data(t);
    for (int64_t i = 0; i < mn_tensor_numel(t); i++) p[i] = (float)(offset + scale * normal());
    return MN_OK;
}

static bool write_tensor(FILE *f, const mn_tensor *t)
{
    long long n = t->storage ? (long long)mn_tensor_numel(t) : 0;
    return fwrite(&n, 8, 1, f) == 1 && (n == 0 || fwrite(mn_tensor_data(t), 4, (size_t)n, f) == (size_t)n);
}

/* The rule's fused source as the backend plans it, with the values of its
 * run-time constants appended (hex: exact) for step_emu.cpp's setter call. */
static bool write_source(const mn_rule *r, const mn_dims *d, const char *path, long long *work_floats, char *why,
                         size_t wlen)
{
    mn_cuda_plan pl;
    if (mn_cuda_plan_rule(r, d, MN_PREC_FP32, d->B * d->H, 90, 0, &pl) != MN_OK || pl.path != MN_PATH_FUSED) {
        snprintf(why, wlen, "not planned on the fused path: %s", pl.why);
        return false;
    }
    *work_floats = (long long)mn_fused_work_floats(r, d, &pl);
    char *src = mn_cuda_plan_source(r, d, MN_PREC_FP32, &pl);
    FILE *f = src ? fopen(path, "w") : NULL;
    bool ok = f && fputs(src, f) >= 0;
    if (ok && strstr(src, "#define MN_RULE_CONSTANTS 1")) {
        mn_rule_constants k;
        mn_cuda_rule_constants(r, &k);
        ok = fputs("\nstatic const mn_rule_constants mn_emu_constants = {{", f) >= 0;
        for (int i = 0; i < MN_RULE_CONSTANT_SLOTS && ok; i++) ok = fprintf(f, "%s%a", i ? ", " : "", k.d[i]) > 0;
        ok = ok && fputs("}, {", f) >= 0;
        for (int i = 0; i < MN_RULE_CONSTANT_SLOTS && ok; i++)
            ok = fprintf(f, "%s%af", i ? ", " : "", (double)k.f[i]) > 0;
        ok = ok && fputs("}};\n", f) >= 0;
    }
    if (f) ok = fclose(f) == 0 && ok;
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
    if (!write_source(&r, &d, path, &work_floats, why, wlen)) {
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
    bool ok = f != NULL;
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
    char name[128], why[512] = "", cmd[2048];
    snprintf(name, sizeof name, "fused_emulated/%s", c->name);
    if (!prepare(c, dir, why, sizeof why)) {
        printf("FAIL %s: %s\n", name, why);
        check_failures_++;
        return;
    }
    snprintf(cmd, sizeof cmd,
             "%s -std=c++17 -O1 -ffp-contract=off -Itests/emu -DMN_EMU_SOURCE='\"%s/step.cu\"' "
             "tests/emu/step_emu.cpp -o %s/step_emu -lpthread > %s/cxx.log 2>&1",
             cxx, dir, dir, dir);
    if (system(cmd) != 0) {
        printf("FAIL %s: the emulated kernel does not compile (%s/cxx.log)\n", name, dir);
        check_failures_++;
        return;
    }
    snprintf(cmd, sizeof cmd, "%s/step_emu %s/case.bin", dir, dir);
    FILE *p = popen(cmd, "r");
    char line[256], all[2048] = "";
    double worst = -1;
    char worst_name[64] = "";
    while (p && fgets(line, sizeof line, p)) {
        if (sscanf(line, "worst %lf %63s", &worst, worst_name) == 2) continue;
        if (!strncmp(line, "bits ", 5)) continue;
        line[strcspn(line, "\n")] = '\0';
        size_t used = strlen(all);
        snprintf(all + used, sizeof all - used, "%s%s", used ? ", " : "", line);
    }
    int rc = p ? pclose(p) : -1;
    if (rc != 0 || worst < 0) {
        printf("FAIL %s: the emulated kernel did not finish (status %d)\n", name, rc);
        check_failures_++;
    } else if (!(worst <= 1e-5)) {
        printf("FAIL %s: worst relative error %.3g in %s (bound 1e-5); every output: %s\n", name, worst, worst_name,
               all);
        check_failures_++;
    } else {
        printf("PASS %s (worst %.2g, %s)\n", name, worst, worst_name);
    }
}

int main(void)
{
    (void)print_log; /* rule_cases.h's, for the NVRTC tests */
    const char *cxx = getenv("CXX");
    if (!cxx || !*cxx) cxx = "g++";
    char probe[256];
    snprintf(probe, sizeof probe, "command -v %s > /dev/null 2>&1", cxx);
    if (system(probe) != 0 || access("tests/emu/step_emu.cpp", R_OK) != 0) {
        SKIP("fused_emulated", "no C++ compiler, or not run from the repository root");
        return CHECK_DONE();
    }
    char dir[] = "/tmp/mnemo_fused_emu_XXXXXX";
    if (!mkdtemp(dir)) {
        printf("FAIL fused_emulated: no temporary directory\n");
        return 1;
    }
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(&cases[i], cxx, dir);
    /* a failure's files stay for a look (the source, the case, the compiler's log) */
    if (check_failures_) {
        printf("# kept %s\n", dir);
    } else {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (system(cmd) != 0) printf("# could not remove %s\n", dir);
    }
    return CHECK_DONE();
}

#else

int main(void)
{
    SKIP("fused_emulated", "built without CUDA (no code generator)");
    return CHECK_DONE();
}

#endif
