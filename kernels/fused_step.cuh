/* fused_step.cuh: the fused path's step kernel, mn_fused_step_kernel (the
 * design is in fused_kernel.cuh's header, whose pieces it puts together: a
 * chunk's forward, loss and backward on tensor cores, then the step's norm,
 * clip, newton_schulz where the rule has it, and update), and the tail of a
 * memory's segment once its sequence's padding starts. NVRTC only: it comes
 * after fused_kernel.cuh in the fused source (kernels/plan.c). */
#ifdef __CUDACC_RTC__

/* Ragged batches: steps sl .. nsteps - 1 of memory blockIdx.x start in the
 * padding, so none changes S or W (SPEC.md section 2): y = 0 and loss = 0
 * from the first of them on, and each reports grad_norm 0, clip_scale 1, not
 * skipped and the unchanged weights' norm. A refresh block that would open
 * among them sets the anchor to W, as the general path's walk does. */
__device__ void mn_fused_padding_tail(const mn_rule_kargs &a, const mn_pset &Wp, float *const *A, long long sl,
                                      float *y_out, float *loss_out)
{
    const long long m = MN_MEMORY, n = a.n, nsteps = a.nsteps;
    const int tid = threadIdx.x;
    const bool lead = MN_CL_LEAD;
    if (lead) mn_zero_padding(y_out, loss_out, sl * MN_STEP, n);
    bool anchor = false;
    if (!MN_P_AT_W && MN_REFRESH > 0)
        for (long long s = sl; s < nsteps; s++)
            if (mn_refresh_start(a.steps_done + s)) anchor = true;
    double wsq = 0.0;
#pragma unroll
    for (int p = 0; p < MN_NPARAMS; p++)
        if (mn_owns(p, lead))
            for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) {
                const float w = *mn_pset_el(Wp, p, e);
                if (anchor) A[p][mn_gel(p, e)] = w;
                wsq += (double)w * w;
            }
    mn_block_sums<1>(&wsq);
    mn_cl_sums<1>(&wsq);
    for (long long s = sl + tid; s < nsteps && lead; s += MN_FT) {
        const long long o = m * nsteps + s;
        mn_padding_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, o);
        a.weight_norm[o] = (float)sqrt(wsq);
    }
}

#if MN_CLUSTER > 1
#define MN_CLUSTER_DIMS __cluster_dims__(MN_CLUSTER, 1, 1)
#else
#define MN_CLUSTER_DIMS
#endif

#ifndef MN_G_SHARED
#define MN_G_SHARED 0 /* kernels/plan.c defines it 1 where G fits in shared memory */
#endif
static_assert(!MN_W16 || (MN_PREC == 2 && !MN_P_AT_W && MN_LAYERS == 2 && MN_CLUSTER == 1 && MN_VEC4 &&
                          !MN_PRECOND && !MN_G_SHARED),
              "bf16 weights (fused_kernel.cuh's MN_W16): bf16, W in the workspace, two layers, no cluster");

/* Whether the run gives q, and lengths (kernels/plan.c defines them from
 * the run's inputs): without, the code that reads them is not compiled in
 * (the retrieval pass at q, the padding's tail), which NVRTC spent about a
 * fifth of a fused source's compile on. a.q and a.lengths are null then. */
#ifndef MN_WITH_Q
#define MN_WITH_Q 0
#endif
#ifndef MN_WITH_LENGTHS
#define MN_WITH_LENGTHS 0
#endif

/* Under retrieve = after, a step's last token is read at W^(s+1), after
 * the update: on its own, by mn_fused_row (two layers of dot products on
 * the CUDA cores and their barriers, 8% of M1's instructions at c = 8).
 * When W^(s+1) is the next step's gradient point (refresh = step) and that
 * step's first chunk has a spare row (c not a multiple of the chunk's rows:
 * its padding is computed anyway), the token rides in that row instead:
 * its h and y come out of the chunk's products, its phi' is 0, and its h
 * and x are zeroed before the gradient's products, so that the step's G,
 * loss and dL/dy are those of the real rows alone, bit for bit. Not with
 * out_norm (its rows are normalised by their own pass). */
#define MN_FOLD (MN_P_AT_W && !MN_RETRIEVE_BEFORE && !MN_OUT_NORM && MN_STEP % MN_FR != 0)

/* A plain linear memory's retrieval row (retrieve = after: y of a step's
 * last token at W^(s+1)) is summed inside the update, from the new W's
 * registers: the group of MN_DK / 4 adjacent threads that updates one
 * output row's float4s adds their products with the row's x and shuffles
 * the sums together, where mn_fused_row read the new W back from shared
 * memory after the weight norm's barriers, for a row layer on the CUDA
 * cores and one more barrier, every step. Needs a row's float4s within one
 * warp in every pass of the update (MN_DK of 32, 64 or 128; with dv a
 * multiple of 4, the float4 count is then a multiple of 32), no bias,
 * residual, out_norm, cluster or newton_schulz. */
#define MN_ROWRET                                                                                                  \
    (MN_LAYERS == 1 && !MN_BIAS && !MN_RESIDUAL && !MN_OUT_NORM && MN_CLUSTER == 1 && !MN_PRECOND &&          \
     !MN_RETRIEVE_BEFORE && MN_VEC4 && (MN_DK == 32 || MN_DK == 64 || MN_DK == 128))
#if MN_ROWRET
static_assert((MN_DV * MN_DK / 4) % 32 == 0, "every lane of a warp in each pass of the update");
#endif

/* The same for a 2-layer memory in one block whose W lives in the
 * workspace (refresh > step: the gradient point, the anchor, has the
 * shared memory): the threads that update a row of W1 sum that hidden
 * unit's z for the token (into fb.hs); after the first layer's
 * parameters, a barrier, h = phi(z + b1) for each unit and another
 * barrier; then the threads that update a row of W2 sum their part of its
 * output (a warp's share of the row into fb.dy, which the step's sums are
 * done with), added up in a fixed order after the update's last barrier.
 * mn_fused_row read the new W back from global memory: 16-20% of P1-c16's
 * kernel (MNEMO_FUSED_PROFILE, 2026-11-28), which is 7.5-10% faster with
 * this (tests/bench/RESULTS.md). Where W
 * is in shared memory (P1: 6% of its kernel in mn_fused_row) the update's
 * longer loop and two more barriers cost more than they saved (P1 +1 to
 * +4%, M1 +2 to +5%, whose steps mostly fold the token into the next
 * chunk), so mn_fused_row stays there. Operands rounded as the row's
 * products round them. Needs a row of W1 (dk / 4 float4s) within a warp,
 * a row of W2 (dh / 4) within a warp or whole warps, and full warps in
 * every pass. */
#define MN_ROW_GROUP_OK(n4) ((n4) == 4 || (n4) == 8 || (n4) == 16 || (n4) == 32)
#define MN_ROWRET2                                                                                                 \
    (MN_LAYERS == 2 && !MN_P_AT_W && !MN_GLU && !MN_OUT_NORM && MN_CLUSTER == 1 && !MN_PRECOND &&             \
     !MN_RETRIEVE_BEFORE &&                                                                                    \
     MN_VEC4 && MN_ROW_GROUP_OK(MN_DK / 4) && (MN_ROW_GROUP_OK(MN_DH / 4) || (MN_DH / 4) % 32 == 0) &&          \
     (MN_DH * MN_DK / 4) % 32 == 0 && (MN_DV * MN_DH / 4) % 32 == 0)
#if MN_ROWRET2
/* the W2 row's partials: one a row, or one for each of its warps */
#define MN_RR2_SEG ((MN_DH / 4) < 32 ? (MN_DH / 4) : 32)
#define MN_RR2_PARTS (MN_DH / 4 / MN_RR2_SEG)
static_assert(MN_DV * MN_RR2_PARTS <= MN_FR * MN_LDV, "the W2 rows' partials fit fb.dy");
#endif

/* Where W lives in the workspace (refresh > step), a step's rows other
 * than retrieve = after's last are read at W^(s), by a forward pass of
 * their own that reads W from global memory. W^(s) is what the last step's
 * update wrote; run at the step's own time, its lines had left L2 (P1-c16:
 * the retrieval was 24% of the kernel). So where a step is one chunk, the
 * next step's rows (already in flight in registers) are retrieved right
 * after this step's update, while the new W is in L2: the same products of
 * the same values, so the same bits. Not before a refresh block's first step
 * (its forward at the new anchor is the retrieval), nor with q, out_norm,
 * or a next step that reaches the padding. */
#define MN_EARLY_RET (!MN_P_AT_W && MN_STEP <= MN_FR && !MN_OUT_NORM)

/* In tf32, the chunk's x rows and h are stored rounded as the products
 * round them, where nothing but products reads them (no residual, no
 * out_norm): each product then takes them as they are, not converting each
 * element again at every tile that loads it (P1: x's elements went through
 * 8 to 16 conversions a chunk, h's 4 to 8). The products, and so every
 * output, are the same bits (rounding twice is rounding once), and the
 * fused backward, which stores them unrounded and rounds at its loads,
 * recomputes the same G. */
#define MN_PRE (MN_PREC == 1 && !MN_RESIDUAL && !MN_OUT_NORM)

/* The step's sums over the block (mn_block_sums_in): each parameter's
 * gradient squares, the step's loss, the last step's weight squares. Their
 * warps' partials go to fb.dy, which no one reads between the chunks'
 * gradients and the next chunk's loss pass. */
#define MN_SUM_LOSS MN_NPARAMS
#define MN_SUM_WSQ (MN_NPARAMS + 1)
#define MN_SUMS (MN_NPARAMS + 2)
static_assert((long long)MN_SUMS * MN_FWARPS * 2 <= (long long)MN_FR * MN_LDV, "the sums' partials fit in fb.dy");
__device__ __forceinline__ double (*mn_sums_scratch(const mn_fbuf &fb))[MN_FWARPS]
{
    return reinterpret_cast<double(*)[MN_FWARPS]>(fb.dy); /* fb.dy: 16-byte aligned rows */
}

/* Step s's weight norm (wsq: this thread's squares of its W^(s+1)) where
 * no later step's sums take it: summed as the step kernel sums it with the
 * next step's values (the same slot of the same MN_SUMS), so that a
 * segment's last step gets the bits a longer run gives it. */
__device__ void mn_fused_weight_norm_out(const mn_rule_kargs &a, const mn_fbuf &fb, double wsq, long long s, bool lead)
{
    double sums[MN_SUMS];
#pragma unroll
    for (int i = 0; i < MN_SUMS; i++) sums[i] = 0.0;
    sums[MN_SUM_WSQ] = wsq;
    mn_block_sums_in<MN_SUMS>(sums, mn_sums_scratch(fb));
    mn_cl_sums<MN_SUMS>(sums);
    if (threadIdx.x == 0 && lead) a.weight_norm[MN_MEMORY * a.nsteps + s] = (float)sqrt(sums[MN_SUM_WSQ]);
}

/* The update's read of G, the step's last: evict-first where G is in global
 * memory, so that the dead gradient leaves L2 to S and W, which the next
 * step reads again. P1-c16 (W, S and G in the workspace, 384 KB a memory,
 * 48 MB in all against a 50 MB L2, every block in its update at once) was
 * HBM-bound there: its kernel 13.6 -> 12.05 ms (tf32) on an H100. */
__device__ __forceinline__ float4 mn_ld_g4(const float4 *g)
{
    return MN_G_SHARED ? *g : mn_ld4_once(reinterpret_cast<const float *>(g));
}
__device__ __forceinline__ float mn_ld_g(const float *g) { return MN_G_SHARED ? *g : mn_ld_once(g); }

/* Whether G holds parameter p as it is (no swizzle, or a bias) */
__device__ __forceinline__ constexpr bool mn_g_plain(int p) { return !MN_G_SWZ || (MN_BIAS && p % 2 == 1); }
/* Where G holds element e of parameter p: mn_g_col's map for a weight
 * matrix (rows of MN_LIN floats), the identity for a bias. */
__device__ __forceinline__ int mn_g_el(int p, int e)
{
    if (mn_g_plain(p)) return e;
    const int cols = MN_LIN(p / MN_PER);
    return e / cols * cols + mn_g_col(e / cols, e % cols, cols);
}
/* Whether that map moves float4 e4 + MN_FT as it moves e4 (its row advances
 * by a multiple of 8): then the update's loop XORs by a constant. */
__device__ __forceinline__ constexpr bool mn_g_steady(int p)
{
    return mn_g_plain(p) || MN_FT % (2 * MN_LIN(p / MN_PER)) == 0;
}

/* Whether W's turned rows (MN_WROT, mn_wcol) move float4 e4 + MN_FT as they
 * move e4 (its row advances by an even count, its column stays): then the
 * update's loop steps its pointer into W by a constant, where mn_pset_el's
 * turned index cost P1's update 7% (MNEMO_FUSED_PROFILE, H200: 670k cycles
 * in plain rows, 718k turned, 658k with this). Not in a cluster: H1's
 * kernel then spilled (ptxas: a 24-byte frame became 48) and ran 3% slower. */
__device__ __forceinline__ constexpr bool mn_w_steady(int p)
{
    return MN_WROT && MN_CLUSTER == 1 && ((MN_BIAS && p % 2 == 1) || (4 * MN_FT) % (2 * MN_LIN(p / MN_PER)) == 0);
}

extern "C" __global__ void __launch_bounds__(MN_FT, MN_FUSED_MINB) MN_CLUSTER_DIMS
mn_fused_step_kernel(const mn_rule_kargs a)
{
    MN_DYNAMIC_SMEM(mn_smem4);
    const long long m = MN_MEMORY, n = a.n, nsteps = a.nsteps;
    const int tid = threadIdx.x;
    const bool lead = MN_CL_LEAD; /* writes the memory's outputs (every block, without a cluster) */
    MN_PROF_START();

    /* shared memory: P, then the chunk buffers (kernels/plan.c counts the same) */
    float *sp = (float *)mn_smem4;
    mn_pset P;
    mn_fbuf fb;
    sp = mn_pset_init<MN_W16>(&P, sp);
#if MN_W16
    /* (P's weights are bf16 rows, and the current W's follow them) */
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        fb.wh[i] = sp;
        sp += MN_W16_FLOATS(i);
    }
#endif
    fb.x = sp;
    sp += MN_FR * MN_LDK;
#if MN_LAYERS == 2
    fb.z = sp;
    sp += MN_FR * MN_LDZ;
    fb.h = sp;
    sp += MN_FR * MN_LDH;
#else
    fb.z = fb.h = 0;
#endif
    fb.y = sp;
    sp += MN_FR * MN_LDV;
    fb.dy = sp;
    sp += MN_FR * MN_LDV;
    fb.xs = sp;
    sp += MN_PDK;
    fb.hs = sp;
    sp += MN_PDH;
    fb.ys = sp;
    sp += MN_PDV;
    fb.lrow = sp;

    /* G per parameter: in shared memory after the chunk buffers where the
     * plan found room for it (MN_G_SHARED, counted in its shared memory),
     * else first in the workspace; then, in the workspace, W padded when P
     * is the anchor */
    float *work = a.work + (long long)blockIdx.x * a.work_floats; /* a block's own, in a cluster too */
    float *G[MN_NPARAMS];
    long long gfloats = 0;
    {
        float *gbase = MN_G_SHARED ? fb.lrow + MN_FR : work;
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) {
            G[p] = gbase + gfloats;
            gfloats += (MN_NUMEL(p) + 3) & ~3LL; /* each on a float4: mn_gacc's pairs are aligned */
        }
    }
    mn_pset Wp; /* where the current W lives: P itself, or the padded global copy */
    if (MN_P_AT_W) Wp = P;
    else mn_pset_init(&Wp, work + (MN_G_SHARED ? 0 : ((gfloats + 3) & ~3LL)));
    mn_pset Wr = Wp; /* what the retrieval at W reads: with MN_W16, the weights' bf16 rows and W's biases */
#if MN_W16
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) Wr.w[i] = fb.wh[i];
#endif

    float *W[MN_NPARAMS], *Sm[MN_NPARAMS], *A[MN_NPARAMS];
    mn_memory_params(a.W, m, W);
    mn_memory_params(a.S, m, Sm);
    mn_memory_params(a.A, m, A);
    mn_cl_params(W);
    mn_cl_params(Sm);
    mn_cl_params(A);
    const float *k = a.k + m * n * MN_DK, *v = a.v + m * n * MN_DV;
    const float *q = MN_WITH_Q && a.q ? a.q + m * n * MN_DK : 0;
    const float *theta = a.theta + m * n, *eta = a.eta + m * nsteps, *alpha = a.alpha + m * nsteps;
    float *y_out = a.y ? a.y + m * n * MN_DV : 0;
    float *loss_out = a.loss + m * n;
    const double R = MN_FEATURE_SCALE;
    /* Ragged batches: tokens at and after real_end are padding (SPEC.md section 2) */
    const long long real_end = MN_WITH_LENGTHS && a.lengths ? a.lengths[m / a.heads] : n;
    /* wide loads and stores of v and y where their rows are 16-byte aligned (MN_QW) */
    const bool v_al = mn_al16(v), y_al = y_out && mn_al16(y_out);
    (void)v_al, (void)y_al;
    /* out_norm's gain and shift of this memory [dv] (never updated), formed
     * where used from the kernel's arguments: registers are short */
#define MN_LN_G (a.ln_g + m * MN_DV)
#define MN_LN_B (a.ln_b + m * MN_DV)

    if (MN_P_AT_W) {
        mn_pset_from(P, W);
    } else {
#if MN_W16
#pragma unroll
        for (int i = 0; i < MN_LAYERS; i++) {
            mn_w16_from(P.w[i], i, A[i * MN_PER]);
            mn_w16_from(fb.wh[i], i, W[i * MN_PER]);
            if (MN_BIAS)
                for (int o = tid; o < MN_LPOUT(i); o += MN_FT) P.b[i][o] = o < MN_LOUT(i) ? A[i * MN_PER + 1][o] : 0.0f;
        }
#else
        mn_pset_from(P, A);
#endif
        mn_pset_from(Wp, W);
    }
    __syncthreads();
    MN_PROF_MARK(1);

    float xnext[MN_NX]; /* the next chunk's k rows, in flight */
    mn_rows_fetch(xnext, k, n < MN_FR ? (int)n : MN_FR);
    bool pending = false; /* MN_FOLD: the last step's last token waits in fb.xs for this step's first chunk */
    bool early = false;   /* MN_EARLY_RET: this step's rows were retrieved right after the last update */
    /* A step's weight norm (of W^(s+1), the outputs' statistic) is summed
     * over the block with the next step's gradient norm and loss, in one
     * mn_block_sums_in (MN_SUMS values): a step's own sums of W's squares
     * after its update were a second pass of shuffles and two more barriers
     * every step, on the critical path of short steps (P1-lin, M1).
     * wsq_prev: this thread's squares of the last step's W^(s+1), where a
     * step came before (sl > 0). */
    double wsq_prev = 0.0;

    long long sl = 0;
    for (; sl < nsteps; sl++) {
        const long long s_global = a.steps_done + sl, t0 = sl * MN_STEP;
        const int rows = (int)mn_step_rows_at(t0, n);
        bool at_current = MN_P_AT_W;
        if (!MN_P_AT_W && mn_refresh_start(s_global)) {
            /* a new refresh block: the gradient point becomes W^(s). One
             * pass a parameter reads each element of W (in the workspace)
             * once, into P and the anchor: float4s, several in flight
             * before any store. As two scalar loops, one load at a time
             * each, the copy waited on global memory's latency for 10-16%
             * of P1-c16's kernel (MNEMO_FUSED_PROFILE). P's padding stays
             * the zeros its set-up gave it. The anchor in global memory
             * is stored evict-first: nothing reads it before the segment's
             * end (P is the copy the products use), and its lines in L2
             * pushed out S and W (P1-c16 tf32 12.05 -> 11.7 ms). */
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++) {
                const bool own = mn_owns(p, lead); /* the anchor's b2: rank 0's in a cluster */
                const int numel = (int)MN_NUMEL(p);
                if (MN_VEC4) {
                    constexpr int U = 4;
                    const int n4 = numel / 4;
                    for (int base = tid; base < n4; base += U * MN_FT) {
                        float4 v[U];
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const int e4 = base + u * MN_FT;
                            if (e4 < n4) v[u] = *reinterpret_cast<const float4 *>(mn_pset_el(Wp, p, 4 * e4));
                        }
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const int e4 = base + u * MN_FT;
                            if (e4 >= n4) break;
#if MN_W16
                            if (!(MN_BIAS && p % 2 == 1)) mn_w16_put4(P.w[p / MN_PER], p / MN_PER, 4 * e4, v[u]);
                            else
#endif
                                *reinterpret_cast<float4 *>(mn_pset_el(P, p, 4 * e4)) = v[u];
                            if (own) mn_st4_once(A[p] + mn_gel(p, 4 * e4), v[u]);
                        }
                    }
                } else {
                    for (int e = tid; e < numel; e += MN_FT) {
                        const float v = *mn_pset_el(Wp, p, e);
                        *mn_pset_el(P, p, e) = v;
                        if (own) mn_st_once(A[p] + mn_gel(p, e), v);
                    }
                }
            }
            __syncthreads();
            at_current = true;
            MN_PROF_MARK(2);
        }
        /* A step that starts in the padding leaves S and W as they are, and so
         * does every later one: the segment's tail is written at once. A step
         * that ends in it takes its grows real rows only. */
        const int grows = (int)mn_real_rows_at(t0, rows, real_end);
        if (MN_WITH_LENGTHS && grows == 0) { /* without lengths, every step has real rows */
            if (sl > 0) mn_fused_weight_norm_out(a, fb, wsq_prev, sl - 1, lead);
            mn_fused_padding_tail(a, Wp, A, sl, y_out, loss_out);
            break;
        }
        const double tscale = MN_TOKEN_MEAN ? 1.0 / (double)grows : 1.0;
        const int before_all = MN_RETRIEVE_BEFORE ? rows : rows - 1;
        const int before_rows = before_all < grows ? before_all : grows;
        double ss[MN_NPARAMS];
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) ss[p] = 0.0;
        double lpart = 0.0; /* the loss of this thread's row of each chunk: the step's sum over the block */
        int last_cr = 0;

        for (int r0 = 0; r0 < grows; r0 += MN_FR) {
            const int cr = grows - r0 < MN_FR ? grows - r0 : MN_FR;
            const long long t = t0 + r0;
            /* (a step that fits one chunk has one: known here at compile time) */
            const bool first = r0 == 0, last = MN_STEP <= MN_FR || r0 + MN_FR >= grows;
            const bool fold = MN_FOLD && pending && first; /* row cr: the last step's last token */
            last_cr = cr;
            mn_rows_store<MN_PRE>(fb.x, xnext, cr, fold ? fb.xs : 0);
            {
                const long long tn = t + cr;
                mn_rows_fetch(xnext, k + tn * MN_DK, tn >= n ? 0 : (n - tn < MN_FR ? (int)(n - tn) : MN_FR));
            }
            /* this thread's v and theta of the loss pass, loaded while the forward runs */
#if MN_OUT_NORM
            /* (the norm's row pass loads its own: registers are short in the forward) */
#else
            /* by groups of MN_QW: element e of the pass is group (r, j .. j + MN_QW - 1) */
            constexpr int NG = MN_PDV / MN_QW, NL = (MN_FR * NG + MN_FT - 1) / MN_FT;
            float vl[MN_QW * NL], th[NL];
#pragma unroll
            for (int u = 0; u < NL; u++) {
                const int e = tid + u * MN_FT, r = e / NG, j = MN_QW * (e % NG);
                const bool real = e < MN_FR * NG && r < cr && j < MN_DV;
                mn_ld_group<MN_QW>(vl + MN_QW * u, v + (t + r) * MN_DV + j, real, v_al);
                th[u] = real ? mn_ld_once(theta + t + r) : 0.0f;
            }
#endif
            __syncthreads();
            MN_PROF_MARK(3);
            mn_fused_forward<true, true, MN_FOLD, MN_PRE, MN_W16>(P, fb, cr, [&](int r, int j, float y0, float y1) {
                *reinterpret_cast<float2 *>(fb.y + r * MN_LDV + j) = make_float2(y0, y1);
            }, fold ? cr + 1 : cr);
            MN_PROF_MARK(4);

            /* loss terms (into fb.y) and dL/dy, token weights theta (and 1/rows for mean) */
            const bool y_here = y_out && !q && at_current;
#if MN_OUT_NORM
            /* fb.y holds o: a warp per row forms nhat, y = g nhat + beta (+ x),
             * the row's loss, dL/dy, and dL/do = s (a - nhat <a, nhat> / dv)
             * (centred for layernorm, a = g dL/dy) into fb.dy, as
             * mn_out_norm_forward and mn_out_norm_backward do; o stays in fb.y */
            for (int r = tid >> 5; r < MN_FR; r += MN_FWARPS) {
                const int lane = tid & 31;
                float *dyr = fb.dy + r * MN_LDV;
                if (r >= cr) {
                    for (int j = lane; j < MN_PDV; j += 32) dyr[j] = 0.0f;
                    continue;
                }
                float vl[MN_NCW], nh[MN_NCW], d[MN_NCW];
                const float th = theta[t + r];
#pragma unroll
                for (int u = 0; u < MN_NCW; u++)
                    vl[u] = lane + 32 * u < MN_DV ? v[(t + r) * MN_DV + lane + 32 * u] : 0.0f;
                /* the backward takes s as the general path keeps it, in a float */
                const double sc = (double)(float)mn_fused_norm_row(fb.y + r * MN_LDV, nh);
                const float wt = (float)((double)th * tscale);
                const float *xr = fb.x + r * MN_LDK;
                double lsum = 0.0;
#pragma unroll
                for (int u = 0; u < MN_NCW; u++) {
                    const int j = lane + 32 * u;
                    d[u] = 0.0f;
                    if (j < MN_DV) {
                        const float yy = mn_fused_norm_y(MN_LN_G, MN_LN_B, j, nh[u], xr), vv = vl[u], rr = yy - vv;
                        if (y_here && lead && r0 + r < before_rows) y_out[(t + r) * MN_DV + j] = yy;
                        lsum += (double)(float)mn_hook_loss(yy, vv, rr);
                        d[u] = (float)((double)wt * R * (double)mn_hook_loss_grad(yy, vv, rr));
                    }
                }
                lsum = mn_warp_sum(lsum);
                if (lane == 0) {
                    const float l = (float)(R * lsum);
                    if (lead) loss_out[t + r] = l;
                    fb.lrow[r] = l;
                }
                mn_fused_norm_vjp(d, nh, sc, MN_LN_G, dyr);
            }
            __syncthreads();
#else
#pragma unroll
            for (int u = 0; u < NL; u++) {
                const int e = tid + u * MN_FT, r = e / NG, j = MN_QW * (e % NG);
                if (e >= MN_FR * NG) break;
                float *yp = fb.y + r * MN_LDV + j;
                float yy[MN_QW], d[MN_QW];
#pragma unroll
                for (int i = 0; i < MN_QW; i++) d[i] = 0.0f;
                if (r < cr && j < MN_DV) {
                    mn_sh_get<MN_QW>(yy, yp);
                    const float wt = (float)((double)th[u] * tscale);
                    float l[MN_QW];
#pragma unroll
                    for (int i = 0; i < MN_QW; i++) {
                        const float vv = vl[MN_QW * u + i], rr = yy[i] - vv;
                        l[i] = mn_hook_loss(yy[i], vv, rr);
                        d[i] = (float)((double)wt * R * (double)mn_hook_loss_grad(yy[i], vv, rr));
                    }
                    if (y_here && lead && r0 + r < before_rows) mn_st_group<MN_QW>(y_out + (t + r) * MN_DV + j, yy, y_al);
                    mn_sh_put<MN_QW>(yp, l);
                } else if (fold && r == cr && j < MN_DV && lead) {
                    mn_sh_get<MN_QW>(yy, yp);
                    mn_st_group<MN_QW>(y_out + (t0 - 1) * MN_DV + j, yy, y_al); /* the last step's last token */
                }
                mn_sh_put<MN_QW>(fb.dy + r * MN_LDV + j, d);
#if MN_DY16
                mn_sh_put16<MN_QW>(reinterpret_cast<unsigned short *>(fb.x + r * MN_LDK + MN_DY16_AT) + j, d);
#endif
            }
            if (fold) { /* the retrieval row out of the gradient's products */
                for (int j = tid; j < MN_LDH && MN_LAYERS == 2; j += MN_FT) fb.h[cr * MN_LDH + j] = 0.0f;
                for (int j = tid; j < MN_LDK; j += MN_FT) fb.x[cr * MN_LDK + j] = 0.0f;
            }
            __syncthreads();
            {
                /* the rows' loss sums, LP adjacent lanes a row (each every
                 * LP-th column, in double, then shuffles in a fixed order):
                 * one thread a row left the block waiting on a chain of dv
                 * dependent adds (ncu on P1-lin) */
                constexpr int LP = mn_group_lanes(MN_FR, 32);
                const int part = tid % LP;
                for (int rb = 0; rb < MN_FR; rb += MN_FT / LP) {
                    const int r = rb + tid / LP;
                    double acc = 0.0;
                    if (r < cr)
                        for (int j = part; j < MN_DV; j += LP) acc += fb.y[r * MN_LDV + j];
#pragma unroll
                    for (int off = LP / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off, LP);
                    if (r < cr && part == 0) {
                        const float l = (float)(R * acc);
                        if (lead) mn_st_once(loss_out + t + r, l);
                        fb.lrow[r] = l;
                    }
                }
            }
#endif
            MN_PROF_MARK(5); /* with the rows' loss sums as thread 0 sees them */

            /* backward at P */
            mn_fused_chunk_grad<MN_PRE>(P, fb, G, cr, first, last, ss);
            __syncthreads();
            MN_PROF_MARK(6);

            /* the step's loss sum (trace): thread r takes row r's (rows of a
             * chunk <= threads), summed with the gradient norm's sums */
            static_assert(MN_FR <= MN_FT, "a thread a chunk row");
            if (tid < cr) lpart += fb.lrow[tid];

            /* retrieval at W^(s) where the forward above was not it on q */
            const int ret_rows = before_rows - r0 < cr ? before_rows - r0 : cr;
            if (y_out && ret_rows > 0 && (q || !at_current) && !early) {
                {
                    float xq[MN_NX];
                    mn_rows_fetch(xq, (q ? q : k) + t * MN_DK, cr);
                    mn_rows_store<MN_PRE>(fb.x, xq, cr);
                }
                __syncthreads();
                float *yo = y_out + t * MN_DV;
#if MN_OUT_NORM
                /* o into fb.y (free: the loss pass is done with it), then the norm by rows */
                mn_fused_forward<false, MN_P_AT_W, false, false, MN_W16>(
                    Wr, fb, cr, [&](int r, int j, float y0, float y1) {
                    *reinterpret_cast<float2 *>(fb.y + r * MN_LDV + j) = make_float2(y0, y1);
                });
                mn_fused_norm_rows(fb, ret_rows, MN_LN_G, MN_LN_B, yo);
#else
                mn_fused_forward<false, MN_P_AT_W, false, MN_PRE, MN_W16>(
                    Wr, fb, cr, [&](int r, int j, float y0, float y1) {
                    if (lead && r < ret_rows && j < MN_DV) mn_st_once(yo + r * MN_DV + j, y0);
                    if (lead && r < ret_rows && j + 1 < MN_DV) mn_st_once(yo + r * MN_DV + j + 1, y1);
                });
#endif
                MN_PROF_MARK(7);
            }
        }

        if (grows < rows && lead) mn_zero_padding(y_out, loss_out, t0 + grows, t0 + rows);

        /* MN_FOLD: this step's last token rides in the next step's first
         * chunk where it is real and has a spare row; its k row waits in
         * fb.xs (the block sums' barriers below publish it) */
        bool defer = false;
        if (MN_FOLD && y_out && !q && grows == rows && sl + 1 < nsteps) {
            const long long tn = t0 + MN_STEP;
            const int rows_n = (int)mn_step_rows_at(tn, n), grows_n = (int)mn_real_rows_at(tn, rows_n, real_end);
            defer = grows_n > 0 && grows_n < MN_FR;
            if (defer && !MN_X16) /* (with MN_X16, below) */
                for (int j = tid; j < MN_DK; j += MN_FT) fb.xs[j] = fb.x[(last_cr - 1) * MN_LDK + j];
        }
        pending = defer;
#if MN_X16
        /* the last chunk's last k row, widened from its bf16 (the value every
         * product of it rounds to): the folded token's, and the one the
         * last token's retrieval reads below */
        for (int j = tid; j < MN_DK; j += MN_FT)
            fb.xs[j] = __uint_as_float((unsigned)reinterpret_cast<const unsigned short *>(fb.x + (last_cr - 1) * MN_LDK)[j]
                                       << 16);
#endif

        /* the step's gradient norm, clip and update; with them, its loss and
         * the last step's weight norm */
        double sums[MN_SUMS];
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++)
            sums[p] = mn_owns(p, lead) ? ss[p] : 0.0; /* b2's gradient: rank 0's alone */
        sums[MN_SUM_LOSS] = lead ? lpart : 0.0;     /* in a cluster every block has the rows' losses */
        sums[MN_SUM_WSQ] = wsq_prev;
        mn_block_sums_in<MN_SUMS>(sums, mn_sums_scratch(fb));
        mn_cl_sums<MN_SUMS>(sums);
        MN_PROF_MARK(8);
        if (tid == 0 && lead && sl > 0) a.weight_norm[m * nsteps + sl - 1] = (float)sqrt(sums[MN_SUM_WSQ]);
#pragma unroll
        for (int p = 0; p < MN_NPARAMS; p++) ss[p] = sums[p];
        mn_step_control ctl = mn_step_control_of<MN_NPARAMS>(ss);
        double wsq = 0.0;
#if MN_ROWRET || MN_ROWRET2
        /* the step's last token read at W^(s+1) in the update (see MN_ROWRET
         * and MN_ROWRET2; with q, by mn_fused_row below), from the last
         * chunk's k row */
        const bool ret_in_update = y_out && grows == rows && !defer && !q && ctl.finite;
        const float *x_last = MN_X16 ? fb.xs : fb.x + (last_cr - 1) * MN_LDK;
        const long long last_row = t0 + rows - 1;
#else
        constexpr bool ret_in_update = false;
#endif
        if (ctl.finite) {
            double scale[MN_NPARAMS];
            ctl.clip_scale = mn_clip_scales<MN_NPARAMS>(ss, ctl.gnorm, scale);
            const float e_s = eta[sl], keep = 1.0f - alpha[sl];
#if MN_PRECOND
            /* SPEC.md section 2's order, as the general path: the clip, each
             * weight matrix's Newton-Schulz (in G, global), then momentum and decay */
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++) {
                const float fs = (float)scale[p];
                for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) G[p][e] = mn_clip_elem(G[p][e], fs);
            }
            __syncthreads();
            double *ns = a.ns_work + m * a.ns_doubles;
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++)
                if (!mn_param_is_bias_glu(MN_LAYERS, MN_BIAS, p))
                    mn_newton_schulz(G[p], MN_OUT(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)),
                                     MN_IN(mn_param_layer_glu(MN_LAYERS, MN_BIAS, p)), ns);
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++)
                for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) {
                    float *wp = mn_pset_el(Wp, p, e);
                    const float w = mn_momentum_elem(G[p][e], e_s, keep, &Sm[p][e], *wp);
                    *wp = w;
                    wsq += (double)w * w;
                }
#else
            /* U elements (or float4s) per thread at a time, every load issued
             * before any store: the loop is bound by memory latency */
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++) {
                if (!mn_owns(p, lead)) continue;
                const float fs = (float)scale[p];
                const int numel = (int)MN_NUMEL(p);
                float *Gp = G[p], *Sp = Sm[p];
                if (MN_VEC4) {
                    /* restrict: G, S and W never alias, so the unrolled
                     * iterations' loads may all be issued first */
                    const float4 *__restrict__ G4 = reinterpret_cast<const float4 *>(Gp);
                    const int n4 = numel / 4, gx = mn_g_el(p, 4 * tid) / 4 ^ tid;
                    float *const w0 = mn_pset_el(Wp, p, 4 * tid);
                    const int wstep = MN_BIAS && p % 2 == 1 ? 4 * MN_FT
                                                            : 4 * MN_FT / MN_LIN(p / MN_PER) * MN_LLD(p / MN_PER);
#pragma unroll 2
                    for (int e4 = tid, it = 0; e4 < n4; e4 += MN_FT, it++) {
                        float4 *__restrict__ W4 =
                            reinterpret_cast<float4 *>(mn_w_steady(p) ? w0 + it * wstep : mn_pset_el(Wp, p, 4 * e4));
                        float4 *__restrict__ S4 = reinterpret_cast<float4 *>(Sp + mn_gel(p, 4 * e4));
                        const float4 gv = mn_ld_g4(G4 + (mn_g_steady(p) ? e4 ^ gx : mn_g_el(p, 4 * e4) / 4)), sv = *S4,
                                     wv = *W4;
                        const float g[4] = {gv.x, gv.y, gv.z, gv.w}, wo[4] = {wv.x, wv.y, wv.z, wv.w};
                        float sn[4] = {sv.x, sv.y, sv.z, sv.w}, wn[4], q = 0.0f;
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            wn[i] = mn_update_elem(g[i], fs, e_s, keep, &sn[i], wo[i]);
                            q += wn[i] * wn[i];
                        }
                        *S4 = make_float4(sn[0], sn[1], sn[2], sn[3]);
                        *W4 = make_float4(wn[0], wn[1], wn[2], wn[3]);
#if MN_W16
                        /* the new weights rounded into their bf16 rows, for the retrieval at W */
                        if (!(MN_BIAS && p % 2 == 1))
                            mn_w16_put4(fb.wh[p / MN_PER], p / MN_PER, 4 * e4, make_float4(wn[0], wn[1], wn[2], wn[3]));
#endif
#if !MN_G_SHARED
                        /* G's lines that this warp has read, dead until the next step */
                        if (MN_DISCARD && mn_g_plain(p)) mn_discard_read_line(G4 + e4, Gp + numel);
#endif
                        wsq += (double)q;
#if MN_ROWRET
                        if (ret_in_update) { /* block-uniform; every lane of a warp is in this pass */
                            constexpr int GW = MN_DK / 4; /* threads a row */
                            const float4 xv = *reinterpret_cast<const float4 *>(x_last + (4 * e4) % MN_DK);
                            float yp = wn[0] * xv.x;
                            yp = fmaf(wn[1], xv.y, yp);
                            yp = fmaf(wn[2], xv.z, yp);
                            yp = fmaf(wn[3], xv.w, yp);
#pragma unroll
                            for (int off = GW / 2; off > 0; off >>= 1) yp += __shfl_xor_sync(0xffffffffu, yp, off, GW);
                            if (e4 % GW == 0) mn_st_once(y_out + last_row * MN_DV + 4 * e4 / MN_DK, yp);
                        }
#elif MN_ROWRET2
                        if (ret_in_update && (p == 0 || p == MN_PER)) { /* block-uniform */
                            const bool first = p == 0; /* W1: z of hidden unit 4 e4 / dk; W2: output 4 e4 / dh */
                            const float4 xv = first ? *reinterpret_cast<const float4 *>(x_last + (4 * e4) % MN_DK)
                                                    : *reinterpret_cast<const float4 *>(fb.hs + (4 * e4) % MN_DH);
                            /* x's row and h hold rounded operands where the
                             * chunk's rows do (MN_PRE, MN_X16; h always) */
                            float w0 = wn[0], w1 = wn[1], w2 = wn[2], w3 = wn[3];
                            float x0 = xv.x, x1 = xv.y, x2 = xv.z, x3 = xv.w;
                            mn_round2(w0, w1), mn_round2(w2, w3);
                            if (first && !MN_PRE && !MN_X16) mn_round2(x0, x1), mn_round2(x2, x3);
                            float rp = w0 * x0;
                            rp = fmaf(w1, x1, rp);
                            rp = fmaf(w2, x2, rp);
                            rp = fmaf(w3, x3, rp);
                            const int GW = first ? MN_DK / 4 : MN_RR2_SEG;
#pragma unroll
                            for (int off = GW / 2; off > 0; off >>= 1) rp += __shfl_xor_sync(0xffffffffu, rp, off, GW);
                            if (e4 % GW == 0) {
                                if (first) fb.hs[4 * e4 / MN_DK] = rp;
                                else fb.dy[e4 / MN_RR2_SEG] = rp;
                            }
                        }
#endif
                    }
                } else {
                    constexpr int U = 16;
                    for (int base = tid; base < numel; base += U * MN_FT) {
                        float gv[U], sv[U], wv[U];
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const int e = base + u * MN_FT;
                            gv[u] = e < numel ? mn_ld_g(Gp + mn_g_el(p, e)) : 0.0f;
                            sv[u] = e < numel ? Sp[mn_gel(p, e)] : 0.0f;
                            wv[u] = e < numel ? *mn_pset_el(Wp, p, e) : 0.0f;
                        }
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const int e = base + u * MN_FT;
                            if (e >= numel) break;
                            const float w = mn_update_elem(gv[u], fs, e_s, keep, &sv[u], wv[u]);
                            Sp[mn_gel(p, e)] = sv[u];
                            *mn_pset_el(Wp, p, e) = w;
                            wsq += (double)w * w;
                        }
                    }
                }
                (void)fs;
#if MN_ROWRET2
                if (ret_in_update && p == MN_PER - 1) { /* the first layer's parameters are new: h */
                    __syncthreads();
                    for (int j = tid; j < MN_DH; j += MN_FT) {
                        const float z = fb.hs[j] + (MN_BIAS ? *mn_pset_el(Wp, 1, j) : 0.0f);
                        fb.hs[j] = mn_round(mn_hook_act(z));
                    }
                    __syncthreads();
                }
#endif
            }
#endif
        } else {
#pragma unroll
            for (int p = 0; p < MN_NPARAMS; p++)
                if (mn_owns(p, lead))
                    for (int e = tid; e < (int)MN_NUMEL(p); e += MN_FT) {
                        const float w = *mn_pset_el(Wp, p, e);
                        wsq += (double)w * w;
                    }
        }
        /* the new W, for every thread (in a cluster, for the peers as well:
         * the cluster's barrier, which the weight norm's sums ended with) */
#if MN_CLUSTER > 1
        mn_cl_sync();
#else
        __syncthreads();
#endif
#if MN_ROWRET2
        if (ret_in_update) /* the W2 rows' parts in a fixed order, b2 and the residual */
            for (int o = tid; o < MN_DV; o += MN_FT) {
                float acc = 0.0f;
#pragma unroll
                for (int i = 0; i < MN_RR2_PARTS; i++) acc += fb.dy[o * MN_RR2_PARTS + i];
                if (MN_BIAS) acc += *mn_pset_el(Wp, MN_PER + 1, o);
                if (MN_RESIDUAL) acc += x_last[o];
                mn_st_once(y_out + last_row * MN_DV + o, acc);
            }
#endif
        MN_PROF_MARK(9);
        if (tid == 0 && lead)
            mn_step_outputs(a.step_loss, a.grad_norm, a.skipped, a.clip_scale, m * nsteps + sl,
                            sums[MN_SUM_LOSS], grows, ctl);
        wsq_prev = wsq;
        if (y_out && !MN_RETRIEVE_BEFORE && grows == rows && !defer && !ret_in_update) {
            /* a padding last token keeps y = 0 */
            const long long lastt = t0 + rows - 1;
            /* with q = k, the last chunk's k rows are still in fb.x */
            const float *xr = MN_X16 ? fb.xs : fb.x + (last_cr - 1) * MN_LDK;
            /* where the chunk's rows are stored rounded (MN_PRE, MN_X16:
             * products alone read them), q's row is too, and the row's
             * first layer takes them as they are */
            constexpr bool x_rounded = MN_PRE || MN_X16;
            if (q) {
                for (int j = tid; j < MN_DK; j += MN_FT)
                    fb.xs[j] = x_rounded ? mn_round(q[lastt * MN_DK + j]) : q[lastt * MN_DK + j];
                __syncthreads();
                xr = fb.xs;
            }
            mn_fused_row<x_rounded>(Wp, fb, xr, y_out + lastt * MN_DV, MN_LN_G, MN_LN_B);
            MN_PROF_MARK(10);
        }
        early = false;
#if MN_EARLY_RET
        {
            const long long tn = t0 + MN_STEP; /* the next step's rows, xnext's */
            const bool next_refresh = mn_refresh_start(s_global + 1);
            const int rows_n = sl + 1 < nsteps ? (int)mn_step_rows_at(tn, n) : 0;
            const int ret_n = MN_RETRIEVE_BEFORE ? rows_n : rows_n - 1;
            if (y_out && !q && !next_refresh && ret_n > 0 && grows == rows && tn + rows_n <= real_end) {
                __syncthreads(); /* the last token's readers are done with fb */
                mn_rows_store<MN_PRE>(fb.x, xnext, rows_n);
                __syncthreads();
                float *yo = y_out + tn * MN_DV;
                mn_fused_forward<false, false, false, MN_PRE, MN_W16>(
                    Wr, fb, rows_n, [&](int r, int j, float y0, float y1) {
                    if (lead && r < ret_n && j < MN_DV) mn_st_once(yo + r * MN_DV + j, y0);
                    if (lead && r < ret_n && j + 1 < MN_DV) mn_st_once(yo + r * MN_DV + j + 1, y1);
                });
                MN_PROF_MARK(7);
                early = true;
            }
        }
#endif
    }
    if (sl == nsteps && sl > 0) mn_fused_weight_norm_out(a, fb, wsq_prev, sl - 1, lead); /* ran to the end */
    __syncthreads();
    mn_pset_to(W, Wp);
#if MN_CLUSTER > 1
    mn_cl_sync(); /* no block leaves while a peer may still read its shared memory */
#endif
#ifdef MN_PROFILE
    MN_PROF_MARK(11);
    {
        const char *const names[] = {"",
                                     "set-up (W into shared memory)",
                                     "refresh (the anchor copied)",
                                     "chunk in (k rows stored, the next fetched, v loaded)",
                                     "forward products and activation",
                                     "loss and dL/dy, the rows' losses",
                                     "the gradient's products",
                                     "retrieval at W (q, or W away from the anchor)",
                                     "the step's sums (gradient, loss, weight norm)",
                                     "clip and update",
                                     "the last token at W^(s+1)",
                                     "the end (weight norm out, W written back)"};
        mn_prof_print("MN_FUSED_PROFILE", names, (int)(sizeof names / sizeof *names));
    }
#endif
#undef MN_LN_G
#undef MN_LN_B
}

#endif /* __CUDACC_RTC__ */
