/* nvrtc_time.c: how long NVRTC takes to compile P1's generated sources
 * (issue 14: a new rule's first run waits for it). NVRTC, ptxas included
 * (the engine asks for a CUBIN), runs on the host, so this needs no GPU; the
 * GPU's module load is not in these numbers. P1's rule: 2 layers with
 * biases, hidden 256, gelu, step 64, clip norm (max 1), dk = dv = 64
 * (theta, eta and alpha are inputs, not in the source). For each arch, path
 * (fused, general, large) and precision it compiles the source with the
 * engine's own options (kernels/nvrtc.c, mn_cuda_compile_check: no disk
 * cache) REPEAT times and prints the median of the wall and CPU
 * milliseconds, and the resources that ptxas reported (registers, stack,
 * spill bytes) of the kernel with the most registers, so a change that cuts
 * the time can show what it did to the kernel. On sm_80 P1's weights do not
 * fit the fused path's shared memory: its line says so. Not a test.
 *   make bench-tools && build/bench/nvrtc_time [REPEAT (3)] [ARCH ... (90 80)] */
#include "engine.h"
#include "../../kernels/codegen.h"
#include "../../kernels/engine_large.h"
#include "../../kernels/kernel_info.h"
#include "../../kernels/nvrtc.h"
#include "../../kernels/plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double ms_of(clockid_t clock)
{
    struct timespec t;
    clock_gettime(clock, &t);
    return 1e3 * (double)t.tv_sec + 1e-6 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static mn_status p1_rule(mn_rule *r)
{
    mn_rule_init(r);
    r->layers = 2;
    r->hidden = 256;
    r->bias = true; /* mnemo.rule's default (mn_rule_init's is none) */
    r->activation = MN_ACT_GELU;
    r->step = 64;
    r->clip = MN_CLIP_NORM;
    r->clip_max = 1.0;
    return mn_rule_validate(r);
}

/* The source of one path at P1's sizes for arch, or NULL (error set). */
static char *source_of(const mn_rule *r, const mn_dims *d, mn_precision p, const char *path, int arch)
{
    if (strcmp(path, "large") == 0) return mn_cuda_large_source(r, d, p);
    if (strcmp(path, "general") == 0) return mn_cuda_rule_source(r, d, p);
    mn_cuda_plan pl;
    if (strcmp(path, "fused_grad") == 0) /* the backward of the fused forward (the plan's) */
        return mn_cuda_plan_backward(r, d, p, arch, 0, &pl) == MN_OK && pl.path == MN_PATH_FUSED
                   ? mn_cuda_fused_grad_source(r, d, p, &pl)
                   : NULL;
    setenv("MNEMO_CUDA_PATH", "fused", 1);
    mn_status s = mn_cuda_plan_rule(r, d, p, d->B * d->H, arch, 0, &pl);
    unsetenv("MNEMO_CUDA_PATH");
    return s == MN_OK ? mn_cuda_plan_source(r, d, p, &pl) : NULL;
}

/* One line: arch, path, precision, median wall and CPU ms, the source's
 * size, and the largest kernel's registers, stack and spills. */
static int time_one(const mn_rule *r, const mn_dims *d, mn_precision p, const char *path, int arch, int repeat)
{
    char *src = source_of(r, d, p, path, arch);
    if (!src && strncmp(path, "fused", 5) == 0) { /* P1 does not fit an sm_80's shared memory */
        printf("NVRTC sm_%d %-7s %-4s not compiled: %s\n", arch, path, mn_precision_name(p), mn_last_error());
        return 0;
    }
    if (!src) {
        fprintf(stderr, "nvrtc_time: no %s source: %s\n", path, mn_last_error());
        return 1;
    }
    double wall[64], cpu[64];
    char *log = NULL;
    for (int i = 0; i < repeat; i++) {
        free(log);
        log = NULL;
        double w0 = ms_of(CLOCK_MONOTONIC), c0 = ms_of(CLOCK_PROCESS_CPUTIME_ID);
        mn_status s = mn_cuda_compile_check(src, arch, &log);
        cpu[i] = ms_of(CLOCK_PROCESS_CPUTIME_ID) - c0;
        wall[i] = ms_of(CLOCK_MONOTONIC) - w0;
        if (s != MN_OK) {
            fprintf(stderr, "nvrtc_time: %s did not compile: %s\n", path, mn_last_error());
            free(log);
            free(src);
            return 1;
        }
    }
    mn_kernel_info k[MN_KERNEL_INFO_MAX];
    int parsed = log ? mn_ptxas_parse(log, k, MN_KERNEL_INFO_MAX, NULL) : 0, n = 0;
    for (const char *e = log; e && (e = strstr(e, "Compiling entry function")) != NULL; e++) n++;
    int big = 0;
    for (int i = 1; i < parsed; i++)
        if (k[i].registers > k[big].registers) big = i;
    printf("NVRTC sm_%d %-7s %-4s wall %7.1f ms  cpu %7.1f ms  (median of %d; source %zu bytes, %d kernel%s",
           arch, path, mn_precision_name(p), median(wall, repeat), median(cpu, repeat), repeat, strlen(src), n,
           n == 1 ? "" : "s");
    if (parsed > 0)
        printf("; %s: %d registers, %ld B stack, %ld B spill stores, %ld B spill loads", k[big].name, k[big].registers,
               k[big].stack_bytes, k[big].spill_stores, k[big].spill_loads);
    printf(")\n");
    fflush(stdout);
    free(log);
    free(src);
    return 0;
}

int main(int argc, char **argv)
{
    int repeat = argc > 1 ? atoi(argv[1]) : 3;
    if (repeat < 1 || repeat > 64) {
        fprintf(stderr, "usage: nvrtc_time [REPEAT (1..64, default 3)] [ARCH ... (default 90 80)]\n");
        return 2;
    }
    int archs[8] = {90, 80}, narch = 2;
    if (argc > 2) {
        narch = 0;
        for (int i = 2; i < argc && narch < 8; i++) archs[narch++] = atoi(argv[i]);
    }
    mn_rule r;
    if (p1_rule(&r) != MN_OK) {
        fprintf(stderr, "nvrtc_time: P1's rule: %s\n", mn_last_error());
        return 1;
    }
    mn_dims d = {4, 32, 4096, 64, 64, 256, 0};
    printf("NVRTC %d.%d, P1's sources (2 layers, hidden 256, gelu, step 64, clip norm; dk = dv = 64)\n",
           mn_nvrtc_version() / 1000, mn_nvrtc_version() % 1000 / 10);
    static const char *const paths[] = {"fused", "fused_grad", "general", "large"};
    static const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_TF32, MN_PREC_BF16};
    int failed = 0;
    for (int a = 0; a < narch; a++)
        for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
            for (size_t j = 0; j < sizeof precs / sizeof *precs; j++)
                failed |= time_one(&r, &d, precs[j], paths[i], archs[a], repeat);
    mn_rule_free(&r);
    return failed;
}
