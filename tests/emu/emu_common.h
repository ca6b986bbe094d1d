/* emu_common.h: what the emulators share (tests/emu/grad_emu.cpp,
 * tests/emu/step_emu.cpp), included after the kernel source: the shim's
 * globals (a block of MN_RULE_THREADS threads, the most shared memory an
 * sm_90 block may opt in to), a case file's tensors, and the relative
 * error the tests bound. */
#ifndef MN_EMU_COMMON_H
#define MN_EMU_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <vector>

thread_local mn_dim3 threadIdx;
mn_dim3 blockIdx, blockDim = {MN_RULE_THREADS, 1, 1};
pthread_barrier_t mn_shim_block_barrier;
pthread_barrier_t mn_shim_warp_barrier[32];
double mn_shim_warp_buffer[32][32];
float4 mn_shim_smem[227 * 1024 / 16];

/* The case file named by the one argument, its header's first n words in
 * h; exits 2 (usage, no file) or 3 (a short header). */
static FILE *open_case(int argc, char **argv, long long *h, size_t n)
{
    if (argc != 2) exit(2);
    FILE *f = fopen(argv[1], "rb");
    if (!f) exit(2);
    if (fread(h, 8, n, f) != n) exit(3);
    return f;
}

/* A tensor of the case file: its element count, then its floats. */
static std::vector<float> read_tensor(FILE *f)
{
    long long n = 0;
    if (fread(&n, 8, 1, f) != 1 || n < 0) exit(3);
    std::vector<float> v((size_t)n);
    if (n && fread(v.data(), 4, (size_t)n, f) != (size_t)n) exit(3);
    return v;
}

/* |got - want| / |want| over the entries where want is finite (a
 * non-finite input's own entries are unspecified, SPEC.md section 7) */
static double rel(const std::vector<float> &got, const std::vector<float> &want)
{
    if (got.size() != want.size()) return 1e30;
    double d = 0, w = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(want[i])) continue;
        d += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        w += (double)want[i] * want[i];
    }
    double e = w > 0 ? sqrt(d / w) : sqrt(d);
    return e == e ? e : 1e30;
}

/* The inputs k, v, q (none where empty), theta, eta, alpha (in[0..5], as
 * the case file holds them) into a kernel's arguments. */
template <class Args> static void set_inputs(Args &a, std::vector<float> *in)
{
    a.k = in[0].data();
    a.v = in[1].data();
    a.q = in[2].size() ? in[2].data() : NULL;
    a.theta = in[3].data();
    a.eta = in[4].data();
    a.alpha = in[5].data();
}

/* The kernel's blocks (one a memory) one after another, each as
 * MN_RULE_THREADS threads running body, after what the engine's setter
 * launch does before a run: the rule's constants as the test appended them
 * to the source. False where a thread cannot start. */
static bool run_blocks(long long memories, void *(*body)(void *))
{
#if MN_RULE_CONSTANTS
    mn_set_rule_constants(mn_emu_constants);
#endif
    for (long long m = 0; m < memories; m++) {
        blockIdx.x = (unsigned)m;
        pthread_t t[MN_RULE_THREADS];
        for (int i = 0; i < MN_RULE_THREADS; i++)
            if (pthread_create(&t[i], NULL, body, (void *)(intptr_t)i) != 0) return false;
        for (int i = 0; i < MN_RULE_THREADS; i++) pthread_join(t[i], NULL);
    }
    return true;
}

#endif
