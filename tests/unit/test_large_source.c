/* test_large_source.c: the kernels of the large-memory path
 * (kernels/engine_large.c, kernels/large_kernels.cuh) compile with NVRTC
 * for sm_90 (no GPU needed) for rules covering every loss kind, every clip
 * mode and scope, 1-3 layers, biases on and off, residual, built-in and
 * custom activations, both retrieve modes, refresh 0 / c / a multiple of c,
 * odd and large sizes and the three precisions, each rule of 2 or 3 layers
 * also with glu's gated hidden layers; every kernel the engine
 * looks up is in the source and is an entry point of the compiled code; a
 * rule that does not validate has no source; every kernel but the
 * arguments' copy waits for the kernel ahead before it returns (the
 * programmatic dependent launches). Correctness on a GPU is the
 * conformance suite's (tests/reference/test_conformance.py with
 * MNEMO_CUDA_PATH=large). */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "rule_cases.h"
#include "engine.h"
#include "../../kernels/engine_large.h"
#include "../../kernels/nvrtc.h"

#include <stdlib.h>
#include <string.h>


static const rule_case cases[] = {
    {"linear_mse_large", 1, 0, 0, MN_ACT_SILU, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 2048, -1,
     MN_RETRIEVE_AFTER, MN_PREC_FP32, 512, 512, 0, false, false},
    {"linear_bias_residual_l1_norm_tf32", 1, 1, 1, MN_ACT_SILU, NULL, MN_LOSS_L1, NULL, MN_CLIP_NORM, MN_SCOPE_GLOBAL,
     NULL, 4, 0, MN_RETRIEVE_BEFORE, MN_PREC_TF32, 256, 256, 0, true, true},
    {"mlp2_silu_huber_softnorm_tensor", 2, 1, 0, MN_ACT_SILU, NULL, MN_LOSS_HUBER, NULL, MN_CLIP_SOFTNORM,
     MN_SCOPE_TENSOR, NULL, 64, 64, MN_RETRIEVE_AFTER, MN_PREC_FP32, 512, 512, 512, false, false},
    {"mlp2_gelu_lp_value_bf16_nobias", 2, 0, 0, MN_ACT_GELU, NULL, MN_LOSS_LP, NULL, MN_CLIP_VALUE, MN_SCOPE_GLOBAL,
     NULL, 16, 32, MN_RETRIEVE_BEFORE, MN_PREC_BF16, 256, 128, 1024, false, true},
    {"mlp3_tanh_dot_residual_odd", 3, 1, 1, MN_ACT_TANH, NULL, MN_LOSS_DOT, NULL, MN_CLIP_NONE, MN_SCOPE_GLOBAL, NULL, 1,
     0, MN_RETRIEVE_AFTER, MN_PREC_TF32, 3, 3, 5, true, false},
    {"mlp2_relu_custom_loss_scale", 2, 1, 0, MN_ACT_RELU, NULL, MN_LOSS_CUSTOM, "w*(y - v)^2 + c3*abs(r)^3",
     MN_CLIP_SCALE, MN_SCOPE_GLOBAL, "exp(-n/(n + m))", 5, 10, MN_RETRIEVE_AFTER, MN_PREC_FP32, 300, 7, 257, false,
     false},
    {"mlp3_custom_act_elementwise_bf16", 3, 0, 0, MN_ACT_CUSTOM, "max(z, a*z)", MN_LOSS_CUSTOM,
     "where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", MN_CLIP_ELEMENTWISE, MN_SCOPE_GLOBAL,
     "m*tanh(g/m)", 1, 1, MN_RETRIEVE_BEFORE, MN_PREC_BF16, 8, 3, 4, false, true},
    {"mlp2_identity_custom_act_scale_tensor", 2, 1, 0, MN_ACT_CUSTOM, "z*tanh(softplus(z))", MN_LOSS_MSE, NULL,
     MN_CLIP_SCALE, MN_SCOPE_TENSOR, "where(n > m, m/n, 1)", 7, 0, MN_RETRIEVE_AFTER, MN_PREC_TF32, 256, 256, 768,
     true, false},
    {"mlp2_identity_norm_tensor_bf16", 2, 1, 1, MN_ACT_IDENTITY, NULL, MN_LOSS_MSE, NULL, MN_CLIP_NORM, MN_SCOPE_TENSOR,
     NULL, 4096, 4096, MN_RETRIEVE_BEFORE, MN_PREC_BF16, 512, 512, 2048, false, false},
};



/* Every kernel name in the text, each once as a definition. */
static const char *missing_kernel(const char *text, bool as_entry)
{
    for (const char *const *k = mn_large_kernel_names; *k; k++) {
        char want[96];
        /* ptxas -v names each entry it compiles: "Compiling entry function 'NAME'" */
        snprintf(want, sizeof want, as_entry ? "'%s'" : "%s(", *k);
        if (!text || !strstr(text, want)) return *k;
    }
    return NULL;
}

/* Every case; with glu (SPEC v2's gated hidden layers), every case of 2 or
 * more layers again with the gates on (names with a glu_ prefix). */
static void test_compile_cases(bool glu)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const rule_case *c0 = &cases[i];
        if (glu && c0->layers < 2) continue;
        char cname[120];
        snprintf(cname, sizeof cname, "%s%s", glu ? "glu_" : "", c0->name);
        rule_case gc = *c0;
        gc.name = cname;
        const rule_case *c = &gc;
        char name[160];
        mn_rule r;
        mn_status made = make_rule(c, &r);
        if (made == MN_OK && glu) {
            r.glu = true;
            made = mn_rule_validate(&r);
        }
        if (made != MN_OK) {
            printf("FAIL large/rule/%s: the rule is invalid: %s\n", c->name, mn_last_error());
            check_failures_++;
            mn_rule_free(&r);
            continue;
        }
        mn_dims d = {1, 1, 4096, c->dk, c->dv, c->dh, 0};
        char *src = mn_cuda_large_source(&r, &d, c->prec);
        snprintf(name, sizeof name, "large/source/%s", c->name);
        if (src && strstr(src, glu ? "#define MN_GLU 1" : "#define MN_GLU 0") == NULL) {
            printf("FAIL %s: the source's MN_GLU is not %d\n", name, glu ? 1 : 0);
            check_failures_++;
        }
        if (!src) {
            printf("FAIL %s: no source: %s\n", name, mn_last_error());
            check_failures_++;
            mn_rule_free(&r);
            continue;
        }
        const char *miss = missing_kernel(src, false);
        bool hooks = strstr(src, "mn_hook_loss_grad(float y, float v, float r)") &&
                     strstr(src, "mn_hook_act_grad(float z)") && strstr(src, "mn_hook_clip_scale(double n)") &&
                     strstr(src, "mn_hook_clip_elem(float g)");
        if (miss) {
            printf("FAIL %s: kernel %s is not in the source\n", name, miss);
            check_failures_++;
        } else {
            CHECK(name, hooks && !strstr(src, "mn_rule_step_kernel"));
        }
        char *log = NULL;
        mn_status s = mn_cuda_compile_check(src, 90, &log);
        snprintf(name, sizeof name, "large/nvrtc_sm90/%s", c->name);
        if (s == MN_OK) printf("PASS %s\n", name);
        else {
            printf("FAIL %s: %s\n", name, mn_last_error());
            print_log(log);
            check_failures_++;
        }
        if (s == MN_OK) {
            snprintf(name, sizeof name, "large/entries/%s", c->name);
            miss = missing_kernel(log, true);
            if (miss) {
                printf("FAIL %s: %s is not an entry of the compiled code\n", name, miss);
                check_failures_++;
            } else {
                printf("PASS %s\n", name);
            }
        }
        free(log);
        free(src);
        mn_rule_free(&r);
    }
}

/* The body of the kernel name in text (from its opening brace to the
 * matching closing one) as [*begin, *end), or false. */
static bool kernel_body(const char *text, const char *name, const char **begin, const char **end)
{
    char want[96];
    snprintf(want, sizeof want, "%s(", name);
    const char *p = text ? strstr(text, want) : NULL;
    p = p ? strchr(p, '{') : NULL;
    if (!p) return false;
    int depth = 0;
    for (const char *q = p; *q; q++) {
        if (*q == '{') depth++;
        if (*q == '}' && --depth == 0) {
            *begin = p;
            *end = q + 1;
            return true;
        }
    }
    return false;
}

/* Whether the kernel name waits for the kernel ahead (mn_lg_after_prior)
 * before its first return: under programmatic dependent launch a block
 * that returned without waiting could let the kernel behind complete
 * before the one ahead has (large_device.cuh, mn_lg_after_prior). */
static bool waits_before_return(const char *text, const char *name)
{
    const char *b, *e;
    if (!kernel_body(text, name, &b, &e)) return false;
    const char *wait = strstr(b, "mn_lg_after_prior();"), *ret = strstr(b, "return");
    return wait && wait < e && (!ret || ret >= e || wait < ret);
}

/* Every kernel of the path but the arguments' copy (the first launch of a
 * segment, plain) waits before it returns; and the check can fail. */
static void test_kernels_wait_first(void)
{
    mn_rule r;
    mn_status s = make_rule(&cases[2], &r);
    mn_dims d = {1, 1, 4096, 512, 512, 512, 0};
    char *src = s == MN_OK ? mn_cuda_large_source(&r, &d, MN_PREC_FP32) : NULL;
    CHECK("large/wait_first/source", src != NULL);
    for (const char *const *k = mn_large_kernel_names; src && *k; k++) {
        if (strcmp(*k, "mn_large_args_kernel") == 0) continue;
        char name[128];
        snprintf(name, sizeof name, "large/wait_first/%s", *k);
        CHECK(name, waits_before_return(src, *k));
    }
    const char *early = "__global__ void k_kernel(int x) { if (x) { return; } mn_lg_after_prior(); }";
    const char *late = "__global__ void k_kernel(int x) { mn_lg_after_prior(); if (x) { return; } }";
    CHECK("large/wait_first/catches_return_before_wait", !waits_before_return(early, "k_kernel"));
    CHECK("large/wait_first/passes_wait_then_return", waits_before_return(late, "k_kernel"));
    CHECK("large/wait_first/catches_no_wait", !waits_before_return("void k_kernel() { }", "k_kernel"));
    free(src);
    mn_rule_free(&r);
}

static void test_source_follows_inputs(void)
{
    mn_rule r;
    mn_status s = make_rule(&cases[2], &r);
    mn_dims d = {1, 1, 4096, 512, 512, 512, 0}, d2 = d;
    d2.dh = 1024;
    char *a = s == MN_OK ? mn_cuda_large_source(&r, &d, MN_PREC_FP32) : NULL;
    char *b = s == MN_OK ? mn_cuda_large_source(&r, &d, MN_PREC_FP32) : NULL;
    char *bf = s == MN_OK ? mn_cuda_large_source(&r, &d, MN_PREC_BF16) : NULL;
    char *wide = s == MN_OK ? mn_cuda_large_source(&r, &d2, MN_PREC_FP32) : NULL;
    CHECK("large/source_deterministic", a && b && strcmp(a, b) == 0);
    CHECK("large/source_follows_precision", a && bf && strcmp(a, bf) != 0 && strstr(bf, "#define MN_PREC 2"));
    CHECK("large/source_follows_dims", a && wide && strstr(wide, "#define MN_DH 1024"));
    free(a);
    free(b);
    free(bf);
    free(wide);
    mn_rule_free(&r);

    mn_rule bad;
    mn_rule_init(&bad);
    bad.loss = MN_LOSS_CUSTOM; /* no expression */
    mn_dims db = {1, 1, 1, 256, 256, 0, 1};
    char *none = mn_cuda_large_source(&bad, &db, MN_PREC_FP32);
    CHECK("large/invalid_rule_no_source", none == NULL);
    CHECK_STR_CONTAINS("large/invalid_rule_message", mn_last_error(), "loss_expr");
    free(none);
    mn_rule_free(&bad);
}

int main(void)
{
    test_source_follows_inputs();
    test_kernels_wait_first();
    test_compile_cases(false);
    test_compile_cases(true);
    return CHECK_DONE();
}

#else

int main(void)
{
    SKIP("large", "built without CUDA (no NVRTC)");
    return CHECK_DONE();
}

#endif
