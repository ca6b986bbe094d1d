/* grad_emu.cpp: kernels/grad_kernel.cuh's mn_grad_kernel, or with a fused
 * backward's source (MN_FUSED_GRAD) fused_grad.cuh's mn_fused_grad_kernel,
 * as generated for one rule (the source file is -DMN_EMU_SOURCE="path"), run on the CPU
 * through cuda_shim.h, one block after another. Reads CASE.bin as
 * tests/unit/test_grad_emulated.c writes it (sizes, inputs, upstream, and
 * the CPU backward's gradients), runs the kernel, and prints one line per
 * gradient "NAME relative-error" and last "worst E NAME". The workspace
 * starts as NaN, so that a read of scratch the kernel did not write shows.
 * A case with qk_norm (its header's last word) runs as kernels/grad_cuda.c
 * does: k and q normalised by one emulated warp (kernels/rownorm_warp.cuh,
 * the code of ops.cu's kernels), the kernel on them, and its gradients of k
 * and q back through the normalisation's adjoint. */
#include "cuda_shim.h"
#include MN_EMU_SOURCE
#include "../../kernels/rownorm_warp.cuh"
#include "emu_common.h"

static mn_grad_kargs args;

/* One emulated warp over every row of a [rows, n] tensor: the normalisation
 * (x to nhat in place, with scales) or its adjoint (a in place). */
struct rownorm_job {
    bool vjp, center, sum;
    float *x, *scale;
    const float *nhat;
    long long rows, n;
};
static rownorm_job job;

static void *rownorm_thread(void *tid)
{
    threadIdx.x = (unsigned)(intptr_t)tid;
    const int lane = (int)threadIdx.x;
    for (long long r = 0; r < job.rows; r++) {
        float *row = job.x + r * job.n;
        if (job.vjp) {
            mn_rownorm_warp_vjp(row, job.nhat + r * job.n, job.scale[r], row, job.n, lane, job.center, job.sum);
        } else {
            const double sc = mn_rownorm_warp_row(row, row, job.n, lane, job.center, job.sum, MN_EMU_ROWNORM_EPS);
            if (lane == 0) job.scale[r] = (float)sc;
        }
    }
    return NULL;
}

static bool rownorm_pass(const rownorm_job &j)
{
    job = j;
    pthread_t t[32];
    for (int i = 0; i < 32; i++)
        if (pthread_create(&t[i], NULL, rownorm_thread, (void *)(intptr_t)i) != 0) return false;
    for (int i = 0; i < 32; i++) pthread_join(t[i], NULL);
    return true;
}

static void *thread_main(void *tid)
{
    threadIdx.x = (unsigned)(intptr_t)tid;
#ifdef MN_FUSED_GRAD
    mn_fused_grad_kernel(args);
#else
    mn_grad_kernel(args);
#endif
    return NULL;
}

int main(int argc, char **argv)
{
    long long h[9];
    FILE *f = open_case(argc, argv, h, 9);
    const long long B = h[0], H = h[1], n = h[2], S = h[3], np = h[4], K = h[5], nlen = h[6], nouter = h[7];
    const long long qk = h[8];
    std::vector<long long> lengths((size_t)nlen);
    if (nlen && fread(lengths.data(), 8, (size_t)nlen, f) != (size_t)nlen) return 3;
    std::vector<float> in[8]; /* k, v, q, theta, eta, alpha, dy, dloss */
    for (int i = 0; i < 8; i++) in[i] = read_tensor(f);
    std::vector<float> param[MN_RULE_MAX_PARAMS][4]; /* W0, S0, dW, dS */
    for (int p = 0; p < np; p++)
        for (int j = 0; j < 4; j++) param[p][j] = read_tensor(f);
    std::vector<float> outer[2], want_outer[2]; /* out_norm's ln_g, ln_b and their gradients */
    if (nouter != 0 && nouter != 2) return 3;
    for (int j = 0; j < nouter; j++) outer[j] = read_tensor(f);
    std::vector<float> want[6], want_param[MN_RULE_MAX_PARAMS][2];
    for (int i = 0; i < 6; i++) want[i] = read_tensor(f);
    for (int p = 0; p < np; p++)
        for (int j = 0; j < 2; j++) want_param[p][j] = read_tensor(f);
    for (int j = 0; j < nouter; j++) want_outer[j] = read_tensor(f);
    fclose(f);

    const long long memories = B * H, nblocks = (S + K - 1) / K;
#ifdef MN_FUSED_GRAD
    mn_fgrad_layout lo;
    mn_fgrad_layout_init(&lo, mn_goff(MN_NPARAMS), mn_pset_floats(), K, nblocks, !MN_P_AT_W);
    mn_fgrad_layout_add_ns(&lo, MN_LAYERS, MN_DK, MN_DV, MN_DH, MN_PRECOND ? MN_NS_STEPS : 0);
#else
    mn_grad_layout lo;
    mn_grad_layout_init(&lo, MN_LAYERS, MN_BIAS, MN_GLU, MN_DK, MN_DV, MN_DH, MN_ROWS, K, nblocks);
    mn_grad_layout_add_ns(&lo, MN_LAYERS, MN_DK, MN_DV, MN_DH, MN_PRECOND ? MN_NS_STEPS : 0);
    if (MN_OUT_NORM) mn_grad_layout_out_norm(&lo, MN_DV, MN_ROWS);
#endif
    if ((MN_OUT_NORM != 0) != (nouter != 0)) return 3; /* the case and the source disagree */
    std::vector<float> work((size_t)(lo.total * memories), NAN);
    std::vector<float> got[6], got_param[MN_RULE_MAX_PARAMS][2];
    for (int i = 0; i < 6; i++) got[i].assign(in[i].size(), 0.0f);
    memset(&args, 0, sizeof args);
    for (int p = 0; p < np; p++) {
        args.W0[p] = param[p][0].data();
        args.S0[p] = param[p][1].data();
        args.dWf[p] = param[p][2].size() ? param[p][2].data() : NULL;
        args.dSf[p] = param[p][3].size() ? param[p][3].data() : NULL;
        got_param[p][0].assign(param[p][0].size(), 0.0f);
        got_param[p][1].assign(param[p][0].size(), 0.0f);
        args.gW[p] = got_param[p][0].data();
        args.gS[p] = got_param[p][1].data();
    }
    float *gin[6];
    for (int i = 0; i < 6; i++) gin[i] = got[i].size() ? got[i].data() : NULL;
    set_inputs(args, in);
    args.dy = in[6].size() ? in[6].data() : NULL;
    args.dloss = in[7].size() ? in[7].data() : NULL;
    args.gk = gin[0], args.gv = gin[1], args.gq = gin[2], args.gtheta = gin[3], args.geta = gin[4], args.galpha = gin[5];
    args.lengths = nlen ? lengths.data() : NULL;
    std::vector<float> got_outer[2];
    for (int j = 0; j < nouter; j++) got_outer[j].assign(outer[j].size(), 0.0f);
    if (nouter) {
        args.ln_g = outer[0].data();
        args.ln_b = outer[1].data();
        args.gln_g = got_outer[0].data();
        args.gln_b = got_outer[1].data();
    }
    args.heads = H;
    args.work = work.data();
    args.work_floats = lo.total;
    args.n = n;
    args.nsteps = S;
    args.K = K;
    args.nblocks = nblocks;

    pthread_barrier_init(&mn_shim_block_barrier, NULL, MN_RULE_THREADS);
    for (int w = 0; w < MN_RULE_THREADS / 32; w++) pthread_barrier_init(&mn_shim_warp_barrier[w], NULL, 32);
    /* qk_norm: the kernel reads the normalised keys and queries (in[0], in[2]) */
    const long long krows = B * H * n;
    const bool center = (qk & 2) != 0, sum = (qk & 4) != 0;
    std::vector<float> nhat[2], scale[2];
    for (int i = 0; i < 2 && qk; i++) {
        std::vector<float> &x = in[i == 0 ? 0 : 2];
        if (!x.size()) continue;
        scale[i].assign((size_t)krows, NAN);
        if (!rownorm_pass({false, center, sum, x.data(), scale[i].data(), NULL, krows, MN_DK})) return 4;
        nhat[i] = x;
    }
    if (!run_blocks(memories, thread_main)) return 4;
    for (int i = 0; i < 2 && qk; i++) {
        std::vector<float> &gx = got[i == 0 ? 0 : 2];
        if (!nhat[i].size()) continue;
        if (!rownorm_pass({true, center, sum, gx.data(), scale[i].data(), nhat[i].data(), krows, MN_DK})) return 4;
    }

    static const char *const names[] = {"k", "v", "q", "theta", "eta", "alpha"};
    double worst = 0;
    char worst_name[32] = "none";
    for (int i = 0; i < 6; i++) {
        if (!want[i].size()) continue;
        double e = rel(got[i], want[i]);
        printf("%s %.3g\n", names[i], e);
        if (e > worst) worst = e, snprintf(worst_name, sizeof worst_name, "%s", names[i]);
    }
    for (int p = 0; p < np; p++)
        for (int j = 0; j < 2; j++) {
            char name[32];
            snprintf(name, sizeof name, "%s%d", j ? "S_param" : "param", p);
            double e = rel(got_param[p][j], want_param[p][j]);
            printf("%s %.3g\n", name, e);
            if (e > worst) worst = e, snprintf(worst_name, sizeof worst_name, "%s", name);
        }
    static const char *const outer_names[] = {"ln_g", "ln_b"};
    for (int j = 0; j < nouter; j++) {
        double e = rel(got_outer[j], want_outer[j]);
        printf("%s %.3g\n", outer_names[j], e);
        if (e > worst) worst = e, snprintf(worst_name, sizeof worst_name, "%s", outer_names[j]);
    }
    printf("worst %.3g %s\n", worst, worst_name);
    return 0;
}
