/* step_emu.cpp: kernels/fused_step.cuh's mn_fused_step_kernel, as generated
 * for one rule (the source file is -DMN_EMU_SOURCE="path"), run on the CPU
 * through cuda_shim.h, one block (memory) after another. Reads CASE.bin as
 * tests/unit/test_fused_emulated.c writes it (sizes, inputs, the initial
 * state, and the CPU engine's outputs and final state), runs the kernel and
 * prints one line per output "NAME relative-error", then "worst E NAME" and
 * "bits H": a hash of every output and final tensor, so that two sources of
 * the same rule can be compared to the bit. The workspace starts as NaN, so
 * that a read of scratch the kernel did not write shows. Built with
 * -DMN_EMU_SPLIT=N (N tokens, whole steps), it runs as a memory fed in two
 * writes: a launch over the first N tokens, then one over the rest with the
 * state carried (W, S and the anchor, which the emulation keeps apart from
 * W, so that a second launch that starts inside a refresh block reads what
 * the first wrote there). */
#include "cuda_shim.h"
#include MN_EMU_SOURCE
#include "emu_common.h"

#include <algorithm>

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
        A[p] = W[p]; /* the anchor, its own copy: the first refresh block's start writes it */
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
    pthread_barrier_init(&mn_shim_block_barrier, NULL, MN_RULE_THREADS);
    for (int w = 0; w < MN_RULE_THREADS / 32; w++) pthread_barrier_init(&mn_shim_warp_barrier[w], NULL, 32);
#ifdef MN_EMU_SPLIT
    const long long first = MN_EMU_SPLIT;
    if (nlen || first <= 0 || first >= n || first % MN_STEP) return 3; /* whole steps, no lengths */
    const long long writes[2][2] = {{0, first}, {first, n}};
#else
    const long long writes[1][2] = {{0, n}};
#endif
    for (const auto &wr : writes) {
        /* one write: tokens t0 .. t1 - 1, steps s0 .. s1 - 1, its inputs and
         * outputs laid out as a launch of its own takes them ([B, H, ...]) */
        const long long t0 = wr[0], len = wr[1] - wr[0], s0 = t0 / MN_STEP, ns = (len + MN_STEP - 1) / MN_STEP;
        auto rows = [&](const std::vector<float> &x, long long per, long long total, long long at, long long count) {
            std::vector<float> out((size_t)(memories * count * per));
            for (long long m = 0; m < memories; m++)
                std::copy(x.begin() + (m * total + at) * per, x.begin() + (m * total + at + count) * per,
                          out.begin() + m * count * per);
            return out;
        };
        std::vector<float> seg[6] = {rows(in[0], MN_DK, n, t0, len), rows(in[1], MN_DV, n, t0, len),
                                     in[2].size() ? rows(in[2], MN_DK, n, t0, len) : std::vector<float>(),
                                     rows(in[3], 1, n, t0, len), rows(in[4], 1, S, s0, ns), rows(in[5], 1, S, s0, ns)};
        const long long per_out[7] = {MN_DV, 1, 0, 0, 0, 0, 0}; /* y and loss by token, the rest by step */
        std::vector<float> seg_out[7];
        for (int i = 0; i < 7; i++) seg_out[i].assign((size_t)(memories * (per_out[i] ? len * per_out[i] : ns)), NAN);
        std::vector<float> work((size_t)(work_floats * memories + 4), NAN);
        memset(&args, 0, sizeof args);
        for (int p = 0; p < np; p++) {
            args.W[p] = W[p].data();
            args.S[p] = Sm[p].data();
            args.A[p] = A[p].data();
        }
        set_inputs(args, seg);
        args.y = seg_out[0].data();
        args.loss = seg_out[1].data();
        args.grad_norm = seg_out[2].data();
        args.clip_scale = seg_out[3].data();
        args.skipped = seg_out[4].data();
        args.step_loss = seg_out[5].data();
        args.weight_norm = seg_out[6].data();
        args.work = work.data();
        args.work_floats = work_floats;
        args.lengths = nlen ? lengths.data() : NULL;
        args.heads = H;
        args.n = len;
        args.nsteps = ns;
        args.steps_done = s0;
        if (!run_blocks(memories, thread_main)) return 4;
        for (int i = 0; i < 7; i++) { /* into the whole run's places */
            const long long per = per_out[i] ? per_out[i] : 1, total = per_out[i] ? n : S, at = per_out[i] ? t0 : s0,
                            count = per_out[i] ? len : ns;
            for (long long m = 0; m < memories; m++)
                std::copy(seg_out[i].begin() + m * count * per, seg_out[i].begin() + (m + 1) * count * per,
                          got[i].begin() + (m * total + at) * per);
        }
    }

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
