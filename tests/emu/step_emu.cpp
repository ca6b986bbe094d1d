/* step_emu.cpp: kernels/fused_step.cuh's mn_fused_step_kernel, as generated
 * for one rule (the source file is -DMN_EMU_SOURCE="path"), run on the CPU
 * through cuda_shim.h, one block (memory) after another. Reads CASE.bin as
 * tests/unit/test_fused_emulated.c writes it (sizes, inputs, the initial
 * state, and the CPU engine's outputs and final state), runs the kernel and
 * prints one line per output "NAME relative-error", then "worst E NAME" and
 * "bits H": a hash of every output and final tensor, so that two sources of
 * the same rule can be compared to the bit. The workspace starts as NaN, so
 * that a read of scratch the kernel did not write shows. */
#include "cuda_shim.h"
#include MN_EMU_SOURCE
#include "emu_common.h"

static mn_rule_kargs args;

static void *thread_main(void *tid)
{
    threadIdx.x = (unsigned)(intptr_t)tid;
    mn_fused_step_kernel(args);
    return NULL;
}

static unsigned long long hash_floats(unsigned long long h, const std::vector<float> &v)
{
    const unsigned char *p = (const unsigned char *)v.data();
    for (size_t i = 0; i < v.size() * sizeof(float); i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

int main(int argc, char **argv)
{
    long long h[7];
    FILE *f = open_case(argc, argv, h, 7);
    const long long B = h[0], H = h[1], n = h[2], S = h[3], np = h[4], nlen = h[5], work_floats = h[6];
    if (np != MN_NPARAMS) return 3; /* the case and the source disagree */
    std::vector<long long> lengths((size_t)nlen);
    if (nlen && fread(lengths.data(), 8, (size_t)nlen, f) != (size_t)nlen) return 3;
    std::vector<float> in[6]; /* k, v, q, theta, eta, alpha */
    for (int i = 0; i < 6; i++) in[i] = read_tensor(f);
    std::vector<float> W[MN_RULE_MAX_PARAMS], Sm[MN_RULE_MAX_PARAMS], A[MN_RULE_MAX_PARAMS];
    for (int p = 0; p < np; p++) {
        W[p] = read_tensor(f);
        Sm[p] = read_tensor(f);
        A[p] = W[p]; /* the anchor: the refresh block's start writes it first */
    }
    static const char *const names[] = {"y", "loss", "grad_norm", "clip_scale", "skipped", "step_loss", "weight_norm"};
    std::vector<float> want[7], got[7], want_W[MN_RULE_MAX_PARAMS], want_S[MN_RULE_MAX_PARAMS];
    for (int i = 0; i < 7; i++) {
        want[i] = read_tensor(f);
        got[i].assign(want[i].size(), NAN);
    }
    for (int p = 0; p < np; p++) {
        want_W[p] = read_tensor(f);
        want_S[p] = read_tensor(f);
    }
    fclose(f);

    const long long memories = B * H;
    std::vector<float> work((size_t)(work_floats * memories + 4), NAN);
    memset(&args, 0, sizeof args);
    for (int p = 0; p < np; p++) {
        args.W[p] = W[p].data();
        args.S[p] = Sm[p].data();
        args.A[p] = A[p].data();
    }
    set_inputs(args, in);
    args.y = got[0].data();
    args.loss = got[1].data();
    args.grad_norm = got[2].data();
    args.clip_scale = got[3].data();
    args.skipped = got[4].data();
    args.step_loss = got[5].data();
    args.weight_norm = got[6].data();
    args.work = work.data();
    args.work_floats = work_floats;
    args.lengths = nlen ? lengths.data() : NULL;
    args.heads = H;
    args.n = n;
    args.nsteps = S;
    args.steps_done = 0;

    pthread_barrier_init(&mn_shim_block_barrier, NULL, MN_RULE_THREADS);
    for (int w = 0; w < MN_RULE_THREADS / 32; w++) pthread_barrier_init(&mn_shim_warp_barrier[w], NULL, 32);
    if (!run_blocks(memories, thread_main)) return 4;

    double worst = 0;
    char worst_name[32] = "none";
    unsigned long long bits = 0xcbf29ce484222325ULL;
    for (int i = 0; i < 7; i++) {
        double e = rel(got[i], want[i]);
        printf("%s %.3g\n", names[i], e);
        if (e > worst) worst = e, snprintf(worst_name, sizeof worst_name, "%s", names[i]);
        bits = hash_floats(bits, got[i]);
    }
    for (int p = 0; p < np; p++) {
        const double ew = rel(W[p], want_W[p]), es = rel(Sm[p], want_S[p]);
        printf("W%d %.3g\nS%d %.3g\n", p, ew, p, es);
        if (ew > worst) worst = ew, snprintf(worst_name, sizeof worst_name, "W%d", p);
        if (es > worst) worst = es, snprintf(worst_name, sizeof worst_name, "S%d", p);
        bits = hash_floats(hash_floats(bits, W[p]), Sm[p]);
    }
    printf("bits %016llx\n", bits);
    printf("worst %.3g %s\n", worst, worst_name);
    return 0;
}
