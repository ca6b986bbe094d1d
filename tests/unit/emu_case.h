/* emu_case.h: what the emulated-kernel tests share (test_grad_emulated.c,
 * test_fused_emulated.c): random inputs, the case file's tensors, the
 * rule's run-time constants appended to a generated source, the emulator's
 * compile and its report. Static functions: each test includes it once. */
#ifndef MN_TEST_EMU_CASE_H
#define MN_TEST_EMU_CASE_H

#include "check.h"
#include "engine.h"
#include "../../kernels/codegen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t emu_rng_state = 88172645463325252ULL;
static double emu_uniform(void)
{
    emu_rng_state ^= emu_rng_state << 13;
    emu_rng_state ^= emu_rng_state >> 7;
    emu_rng_state ^= emu_rng_state << 17;
    return (double)(emu_rng_state >> 11) / 9007199254740992.0;
}
static double emu_normal(void)
{
    double u = emu_uniform() + 1e-12, v = emu_uniform();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* A new f32 CPU tensor of offset + scale N(0, 1) entries. */
static mn_status random_tensor(mn_tensor *t, int ndim, const int64_t *shape, double scale, double offset)
{
    MN_TRY(mn_tensor_empty(t, MN_F32, ndim, shape, MN_CPU));
    float *p = mn_tensor_data(t);
    for (int64_t i = 0; i < mn_tensor_numel(t); i++) p[i] = (float)(offset + scale * emu_normal());
    return MN_OK;
}

/* A tensor in the case file: its element count, then its floats (an empty
 * tensor: 0 and nothing), as the emulators' read_tensor reads them. */
static bool write_tensor(FILE *f, const mn_tensor *t)
{
    long long n = t->storage ? (long long)mn_tensor_numel(t) : 0;
    return fwrite(&n, 8, 1, f) == 1 && (n == 0 || fwrite(mn_tensor_data(t), 4, (size_t)n, f) == (size_t)n);
}

/* src into path, and where it reads the rule's constants at run time their
 * values (hex: exact), which the emulator hands to the source's setter as
 * the engine's setter launch does before a run. */
static bool write_emu_source(const char *path, const char *src, const mn_rule *r)
{
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
    return ok;
}

/* The emulator tests/emu/EMU.cpp over the kernel source at source, built
 * into dir/EMU with extra (defines) and run on dir/case.bin: its worst
 * error and where, its other report lines joined in all, and its "bits"
 * line's hash where bits is given. False with why where it does not
 * compile or does not finish. */
static bool emulate(const char *cxx, const char *dir, const char *emu, const char *source, const char *extra,
                    double *worst, char *worst_name, char *all, size_t alen, char *bits, char *why, size_t wlen)
{
    char cmd[2048], line[256];
    snprintf(cmd, sizeof cmd,
             "%s -std=c++17 -O1 -ffp-contract=off -Itests/emu -DMN_EMU_SOURCE='\"%s\"' %s tests/emu/%s.cpp -o %s/%s "
             "-lpthread > %s/cxx.log 2>&1",
             cxx, source, extra, emu, dir, emu, dir);
    if (system(cmd) != 0) {
        snprintf(why, wlen, "the emulated kernel (%.200s) does not compile (%.200s/cxx.log)", source, dir);
        return false;
    }
    snprintf(cmd, sizeof cmd, "%s/%s %s/case.bin", dir, emu, dir);
    FILE *p = popen(cmd, "r");
    *worst = -1;
    all[0] = '\0';
    if (bits) bits[0] = '\0';
    while (p && fgets(line, sizeof line, p)) {
        if (sscanf(line, "worst %lf %63s", worst, worst_name) == 2) continue;
        if (bits && sscanf(line, "bits %31s", bits) == 1) continue;
        line[strcspn(line, "\n")] = '\0';
        size_t used = strlen(all);
        snprintf(all + used, alen - used, "%s%s", used ? ", " : "", line);
    }
    int rc = p ? pclose(p) : -1;
    if (rc != 0 || *worst < 0 || (bits && !bits[0])) {
        snprintf(why, wlen, "the emulated kernel (%.200s) did not finish (status %d)", source, rc);
        return false;
    }
    return true;
}

/* An emulated run's worst relative error against the CPU's, within 1e-5:
 * a PASS line, or a FAIL line with every output's (each a "what"). */
static void check_worst(const char *name, double worst, const char *worst_name, const char *what,
                        const char *all)
{
    if (!(worst <= 1e-5)) {
        printf("FAIL %s: worst relative error %.3g in %s (bound 1e-5); every %s: %s\n", name, worst, worst_name, what,
               all);
        check_failures_++;
    } else {
        printf("PASS %s (worst %.2g, %s)\n", name, worst, worst_name);
    }
}

/* The C++ compiler ($CXX, else g++) where it and tests/emu/EMU.cpp are
 * there (run from the repository root), with a new temporary folder for
 * the cases in dir (a template ending in XXXXXX); NULL after a SKIP or
 * FAIL line for test where not. */
static const char *emu_setup(const char *test, const char *emu, char *dir)
{
    const char *cxx = getenv("CXX");
    if (!cxx || !*cxx) cxx = "g++";
    char probe[256], file[128];
    snprintf(probe, sizeof probe, "command -v %s > /dev/null 2>&1", cxx);
    snprintf(file, sizeof file, "tests/emu/%s.cpp", emu);
    if (system(probe) != 0 || access(file, R_OK) != 0) {
        SKIP(test, "no C++ compiler, or not run from the repository root");
        return NULL;
    }
    if (!mkdtemp(dir)) {
        printf("FAIL %s: no temporary directory\n", test);
        check_failures_++;
        return NULL;
    }
    return cxx;
}

/* The test's end: after a failure its files stay for a look (the source,
 * the case, the compiler's log), else they go. */
static int emu_finish(const char *dir)
{
    if (check_failures_) {
        printf("# kept %s\n", dir);
    } else {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (system(cmd) != 0) printf("# could not remove %s\n", dir);
    }
    return CHECK_DONE();
}

#endif
