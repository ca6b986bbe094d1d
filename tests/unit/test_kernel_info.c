/* test_kernel_info.c: the resources of generated kernels
 * (kernels/kernel_info.h): ptxas -v logs parsed (a captured CUDA 13 log of
 * the rule kernels, an older CUDA 12 layout with spills and device
 * functions, odd and cut logs), launch bounds from PTX, the live NVRTC log
 * of a generated rule, the memory and disk caches of the resources, and a
 * rule's kernels as rule:kernel_info sees them. No GPU needed; on a GPU the
 * occupancy and the launch timing are checked too (SKIP lines without). */
#include "check.h"

#ifdef MN_HAVE_CUDA
#include "engine.h"
#include "../../kernels/codegen.h"
#include "../../kernels/cuda.h"
#include "../../kernels/kernel_info.h"
#include "../../kernels/nvrtc.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* NVRTC 13.0's log for a two-layer rule (dk 64, --ptxas-options=-v, sm_90). */
static const char *const log_cuda13 =
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'mn_rule_read_kernel' for 'sm_90'\n"
    "ptxas info    : Function properties for mn_rule_read_kernel\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 30 registers, used 1 barriers, 360 bytes cmem[0]\n"
    "ptxas info    : Compile time = 61.204 ms\n"
    "ptxas info    : Compiling entry function 'mn_rule_step_kernel' for 'sm_90'\n"
    "ptxas info    : Function properties for mn_rule_step_kernel\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 58 registers, used 1 barriers, 64 bytes smem, 360 bytes cmem[0]\n"
    "ptxas info    : Compile time = 402.113 ms\n";

/* The CUDA 12 layout: items in another order, cmem banks, a device
 * function's own properties (not an entry), spills, a C++ mangled entry. */
static const char *const log_cuda12 =
    "ptxas info    : 8 bytes gmem\n"
    "ptxas info    : Compiling entry function '_Z5heavyPfi' for 'sm_80'\n"
    "ptxas info    : Function properties for _Z6helperf\n"
    "    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Function properties for _Z5heavyPfi\n"
    "    96 bytes stack frame, 44 bytes spill stores, 52 bytes spill loads\n"
    "ptxas info    : Used 255 registers, 2048 bytes smem, 368 bytes cmem[0], 4 bytes cmem[2]\n"
    "ptxas info    : Compiling entry function 'light' for 'sm_80'\n"
    "ptxas info    : Function properties for light\n"
    "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 8 registers, 352 bytes cmem[0]\n";

static const char *const ptx_sample =
    ".version 9.0\n.target sm_90\n.address_size 64\n\n"
    "\t// .globl\tbounded\n.visible .entry bounded(\n\t.param .u64 bounded_param_0\n)\n.maxntid 128, 2, 1\n{\n"
    "\tret;\n}\n"
    "\t// .globl\tfree\n.visible .entry free(\n\t.param .u64 free_param_0\n)\n{\n\tret;\n}\n"
    "\t// .globl\tflat\n.visible .entry flat(\n)\n.maxntid 256\n{\n\tret;\n}\n";

static void test_parse_samples(void)
{
    mn_kernel_info k[4];
    int arch = -1;
    int n = mn_ptxas_parse(log_cuda13, k, 4, &arch);
    CHECK("kernel_info/parse13/count", n == 2 && arch == 90);
    CHECK("kernel_info/parse13/names", n == 2 && !strcmp(k[0].name, "mn_rule_read_kernel") &&
                                           !strcmp(k[1].name, "mn_rule_step_kernel"));
    CHECK("kernel_info/parse13/step", n == 2 && k[1].registers == 58 && k[1].shared_bytes == 64 &&
                                          k[1].stack_bytes == 0 && k[1].spill_stores == 0 && k[1].spill_loads == 0 &&
                                          k[1].barriers == 1);
    CHECK("kernel_info/parse13/read_no_smem_is_zero", n == 2 && k[0].registers == 30 && k[0].shared_bytes == 0);

    n = mn_ptxas_parse(log_cuda12, k, 4, &arch);
    CHECK("kernel_info/parse12/count", n == 2 && arch == 80);
    CHECK("kernel_info/parse12/mangled_entry", n == 2 && !strcmp(k[0].name, "_Z5heavyPfi"));
    CHECK("kernel_info/parse12/spills", n == 2 && k[0].registers == 255 && k[0].shared_bytes == 2048 &&
                                            k[0].stack_bytes == 96 && k[0].spill_stores == 44 &&
                                            k[0].spill_loads == 52);
    CHECK("kernel_info/parse12/device_function_ignored", n == 2 && k[0].stack_bytes != 24);
    CHECK("kernel_info/parse12/no_barriers_is_zero", n == 2 && k[1].registers == 8 && k[1].barriers == 0 &&
                                                         k[1].spill_stores == 0);

    /* at most max kernels; a log cut short leaves the rest unreported */
    n = mn_ptxas_parse(log_cuda12, k, 1, NULL);
    CHECK("kernel_info/parse/max", n == 1 && k[0].registers == 255);
    n = mn_ptxas_parse("ptxas info    : Compiling entry function 'cut' for 'sm_90'\n", k, 4, NULL);
    CHECK("kernel_info/parse/cut_log", n == 1 && !strcmp(k[0].name, "cut") && k[0].registers == -1 &&
                                           k[0].spill_stores == -1 && k[0].shared_bytes == -1);
    n = mn_ptxas_parse("mnemo_rule.cu(3): warning: something else\nUsed 5 registers\n", k, 4, NULL);
    CHECK("kernel_info/parse/not_ptxas", n == 0);
    CHECK("kernel_info/parse/empty", mn_ptxas_parse("", k, 4, NULL) == 0);

    mn_kernel_info b[3];
    const char *names[3] = {"bounded", "free", "flat"};
    for (int i = 0; i < 3; i++) {
        memset(&b[i], 0, sizeof b[i]);
        strcpy(b[i].name, names[i]);
        b[i].max_threads = -7;
    }
    mn_ptx_launch_bounds(ptx_sample, b, 3);
    CHECK("kernel_info/launch_bounds", b[0].max_threads == 256 && b[1].max_threads == 0 && b[2].max_threads == 256);
}

static mn_status make_rule(mn_rule *r)
{
    mn_rule_init(r);
    r->layers = 2;
    r->bias = true;
    r->hidden = 32;
    r->activation = MN_ACT_GELU;
    r->loss = MN_LOSS_HUBER;
    r->loss_delta = 0.5;
    r->clip = MN_CLIP_NORM;
    r->clip_max = 1.0;
    r->step = 4;
    return mn_rule_validate(r);
}

/* The live log of NVRTC for a generated rule: ptxas's lines are there and parse. */
static void test_live_log(void)
{
    mn_rule r;
    mn_dims d = {2, 3, 16, 64, 64, 32, 0};
    char *src = make_rule(&r) == MN_OK ? mn_cuda_rule_source(&r, &d, MN_PREC_FP32) : NULL;
    char *log = NULL;
    mn_status s = src ? mn_cuda_compile_check(src, 90, &log) : MN_ERR_ARG;
    CHECK("kernel_info/live/compiles", s == MN_OK);
    CHECK_STR_CONTAINS("kernel_info/live/log_has_ptxas_lines", log, "Compiling entry function");
    mn_kernel_info k[MN_KERNEL_INFO_MAX];
    int arch = 0;
    int n = log ? mn_ptxas_parse(log, k, MN_KERNEL_INFO_MAX, &arch) : 0;
    int step = -1, read = -1;
    for (int i = 0; i < n; i++) {
        if (!strcmp(k[i].name, MN_RULE_STEP_KERNEL)) step = i;
        if (!strcmp(k[i].name, MN_RULE_READ_KERNEL)) read = i;
    }
    CHECK("kernel_info/live/both_kernels", n == 2 && step >= 0 && read >= 0 && arch == 90);
    CHECK("kernel_info/live/registers", step >= 0 && k[step].registers > 0 && k[step].registers <= 255 &&
                                            read >= 0 && k[read].registers > 0);
    CHECK("kernel_info/live/spill_fields_present", step >= 0 && k[step].spill_stores >= 0 &&
                                                       k[step].spill_loads >= 0 && k[step].stack_bytes >= 0);
    /* the step kernel's block sum keeps a few doubles in shared memory */
    CHECK("kernel_info/live/shared", step >= 0 && k[step].shared_bytes > 0 && k[step].barriers >= 1);
    if (step >= 0)
        printf("    (step kernel: %d registers, %ld B smem, %ld B stack, spills %ld/%ld)\n", k[step].registers,
               k[step].shared_bytes, k[step].stack_bytes, k[step].spill_stores, k[step].spill_loads);
    char opts[256];
    CHECK_STR_CONTAINS("kernel_info/options_ask_ptxas", mn_nvrtc_options(90, MN_TIER_FULL, opts, sizeof opts),
                       "--ptxas-options=-v");
    free(log);
    free(src);
    mn_rule_free(&r);
}

/* Compiled once, then from memory; <key>.info on disk is read back, and a
 * malformed one is replaced by a compile. */
static void test_caches(const char *dir)
{
    const char *src = "extern \"C\" __global__ void __launch_bounds__(128) kc(float *x)\n"
                      "{ __shared__ float s[32]; s[threadIdx.x % 32] = x[threadIdx.x]; __syncthreads();\n"
                      "  x[threadIdx.x] = 2.0f * s[(threadIdx.x + 1) % 32]; }\n";
    mn_kernel_set a, b;
    mn_status s = mn_nvrtc_kernel_info(src, 90, &a);
    CHECK("kernel_info/cache/compiled", s == MN_OK && !a.cached && a.n == 1 && a.compile_ms > 0 && a.arch == 90);
    CHECK("kernel_info/cache/fields", s == MN_OK && a.n == 1 && !strcmp(a.k[0].name, "kc") && a.k[0].registers > 0 &&
                                          a.k[0].shared_bytes == 128 && a.k[0].max_threads == 128);
    s = mn_nvrtc_kernel_info(src, 90, &b);
    CHECK("kernel_info/cache/memory", s == MN_OK && b.cached && b.k[0].registers == a.k[0].registers &&
                                          !strcmp(a.key, b.key) && b.compile_ms == a.compile_ms);
    char path[600];
    struct stat sb;
    snprintf(path, sizeof path, "%s/kernels/%s.info", dir, a.key);
    CHECK("kernel_info/cache/info_file", stat(path, &sb) == 0 && sb.st_size > 0);
    snprintf(path, sizeof path, "%s/kernels/%s.cubin", dir, a.key);
    CHECK("kernel_info/cache/cubin_file_too", stat(path, &sb) == 0 && sb.st_size > 0);

    /* a source this process never compiled: a planted .info answers */
    const char *src2 = "extern \"C\" __global__ void kd(float *x) { x[0] = 1.0f; }\n";
    char key[33], opts[256];
    mn_cuda_cache_key(src2, mn_nvrtc_options(90, MN_TIER_FULL, opts, sizeof opts), 90, mn_nvrtc_version(), key);
    snprintf(path, sizeof path, "%s/kernels/%s.info", dir, key);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs("mnemo kernel info 1\narch 90\ncompile_ms 12.5\nkernel kd registers 77 shared 5 stack 6 spill_stores 7 "
              "spill_loads 8 barriers 0 max_threads 0\n",
              f);
        fclose(f);
    }
    s = mn_nvrtc_kernel_info(src2, 90, &b);
    CHECK("kernel_info/cache/disk", s == MN_OK && b.cached && b.n == 1 && b.k[0].registers == 77 &&
                                        b.k[0].spill_loads == 8 && b.compile_ms == 12.5 && !strcmp(b.key, key));
    unlink(path);

    /* a malformed file is not believed */
    const char *src3 = "extern \"C\" __global__ void ke(float *x) { x[1] = 2.0f; }\n";
    mn_cuda_cache_key(src3, opts, 90, mn_nvrtc_version(), key);
    snprintf(path, sizeof path, "%s/kernels/%s.info", dir, key);
    if ((f = fopen(path, "w"))) {
        fputs("mnemo kernel info 1\narch 90\nkernel ke registers lots\n", f);
        fclose(f);
    }
    s = mn_nvrtc_kernel_info(src3, 90, &b);
    CHECK("kernel_info/cache/malformed_recompiled", s == MN_OK && !b.cached && b.n == 1 && b.k[0].registers > 0 &&
                                                        b.k[0].registers < 77);
}

/* A rule's kernels as rule:kernel_info sees them; occupancy only on a GPU. */
static void test_rule_kernels(void)
{
    mn_rule r;
    mn_dims d = {4, 8, 1, 32, 16, 32, 0};
    mn_kernel_set set;
    mn_status s = make_rule(&r) == MN_OK ? mn_cuda_rule_kernel_info(&r, &d, MN_PREC_TF32, 90, &set) : MN_ERR_ARG;
    /* the kernels of the rule's planned path (kernels/plan.h): the fused
     * step kernel alone, or the general step and read kernels */
    mn_kernel_info *step = s == MN_OK ? mn_kernel_set_find(&set, set.step_kernel) : NULL;
    mn_kernel_info *read = s == MN_OK ? mn_kernel_set_find(&set, MN_RULE_READ_KERNEL) : NULL;
    bool general = s == MN_OK && strcmp(set.path, "general") == 0;
    CHECK("kernel_info/rule/planned_path", s == MN_OK && strcmp(set.path, "fused") == 0 &&
                                               strcmp(set.step_kernel, "mn_fused_step_kernel") == 0);
    CHECK("kernel_info/rule/both", step && (read != NULL) == general && set.arch == 90 && strlen(set.key) == 32);
    CHECK("kernel_info/rule/launch_bounds_match_block", step && step->max_threads == step->block_threads &&
                                                            step->block_threads >= 32 && (!read || read->max_threads > 0));
    bool gpu = mn_cuda_available() && mn_cuda_arch() == 90;
    if (gpu) {
        CHECK("kernel_info/rule/occupancy", step && step->on_device && step->blocks_per_sm > 0 &&
                                                step->occupancy > 0 && step->occupancy <= 1);
        CHECK("kernel_info/rule/driver_agrees_on_registers", step && step->device_registers == step->registers);
    } else {
        CHECK("kernel_info/rule/no_occupancy_without_gpu", step && !step->on_device && step->blocks_per_sm == 0);
        SKIP("kernel_info/rule/occupancy", mn_cuda_available() ? "the GPU is not sm_90" : "no GPU");
    }
    mn_dims bad = d;
    bad.dk = 0;
    s = mn_cuda_rule_kernel_info(&r, &bad, MN_PREC_FP32, 90, &set);
    CHECK("kernel_info/rule/bad_dims_fail", s != MN_OK);
    CHECK_STR_CONTAINS("kernel_info/rule/bad_dims_say_why", mn_last_error(), "dk and dv must be >= 1");
    mn_rule_free(&r);
}

/* Launch timing: off by default; without a device it cannot be switched on. */
static void test_profile(void)
{
    mn_kernel_launch l[4];
    mn_kernel_total t[4];
    long long total = -1;
    CHECK("kernel_info/profile/off_by_default", !mn_cuda_profile_on());
    CHECK("kernel_info/profile/nothing_recorded", mn_cuda_profile_recent(l, 4, &total) == 0 && total == 0 &&
                                                      mn_cuda_profile_totals(t, 4) == 0);
    if (!mn_cuda_available()) {
        CHECK("kernel_info/profile/needs_a_device", mn_cuda_profile_set(true) != MN_OK && !mn_cuda_profile_on());
        CHECK("kernel_info/profile/off_always_works", mn_cuda_profile_set(false) == MN_OK);
        SKIP("kernel_info/profile/launch_times", "no GPU");
        return;
    }
    CHECK("kernel_info/profile/on", mn_cuda_profile_set(true) == MN_OK && mn_cuda_profile_on());
    CHECK("kernel_info/profile/off", mn_cuda_profile_set(false) == MN_OK && !mn_cuda_profile_on());
    /* launches themselves are timed from Lua (tests/lua/test_kernel_info.lua) */
}

int main(void)
{
    mn_cuda_register();
    test_parse_samples();
    test_live_log();
    char dir[] = "/tmp/mnemo-kinfo-XXXXXX";
    if (mkdtemp(dir)) {
        setenv("MNEMO_CACHE", dir, 1);
        test_caches(dir);
        test_rule_kernels();
        unsetenv("MNEMO_CACHE");
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("    (could not remove %s)\n", dir);
    } else {
        SKIP("kernel_info/cache", "no temporary directory");
    }
    test_profile();
    return CHECK_DONE();
}

#else

int main(void)
{
    SKIP("kernel_info", "built without CUDA (no NVRTC)");
    return CHECK_DONE();
}

#endif
