/* large_grad.cuh: the elementwise and reduction kernels of the large path's
 * backward (kernels/grad_large.c), which does the memory model's products
 * with cuBLAS, batched over the M = B*H memories, and everything between
 * them here: the statement of model/mlp_grad_cpu.c's mn_mlp_step_adjoint
 * and mn_mlp_vjp and of grad_cpu.c's step_reverse, split at the products.
 * Every kernel spans all memories (grid y or x = memory) and the rows of
 * one chunk of a step.
 *
 * Buffers. A state "image" holds one tensor of every memory, parameter by
 * parameter: parameter p of memory m at image + ioff[p] + m * numel[p] (the
 * layout of the forward's per-parameter [M, numel] tensors, one after the
 * other). Chunk buffers are [M, CR, width] row-major with a per-memory
 * stride of ld floats (CR rows of the widest layer).
 *
 * Arithmetic as the CPU's: the loss's and the activation's derivatives in
 * double (the backward's hooks mn_ghook_*), every sum of a reduction in
 * double, each value stored as float where the CPU stores one.
 *
 * Two parts, as large_kernels.cuh: plain C shared with the host (the
 * argument structs), then the NVRTC part, after the MN_* constants, the
 * rule's hooks (forward and backward: kernels/codegen.c's
 * mn_cuda_grad_source_for) and large_common.cuh (the block size, the sums). */
#ifndef MN_LGRAD_ARGS
#define MN_LGRAD_ARGS

#ifndef __CUDACC_RTC__
#include "large_common.cuh" /* MN_LARGE_THREADS; NVRTC gets its text ahead of this one */
#endif
#define MN_LGRAD_MAX_PARAMS 32
#define MN_LGRAD_COL_ROWS 64 /* rows per block of a bias gradient's column sums */

/* Fixed for a whole backward. Optional inputs are NULL when absent. */
typedef struct mn_lgrad_kargs {
    long long numel[MN_LGRAD_MAX_PARAMS], ioff[MN_LGRAD_MAX_PARAMS]; /* the image layout */
    long long memories, n, nsteps, ld;
    const float *k, *v, *theta, *eta, *alpha; /* [M,n,dk], [M,n,dv], [M,n], [M,nsteps] x 2 */
    const float *dy, *dloss;                 /* upstream [M,n,dv], [M,n] */
    const float *skipped;                    /* [M,nsteps]: the recompute's (1: step skipped) */
    float *gk, *gv, *gtheta, *geta, *galpha; /* gradients, zeroed by the host: passes accumulate */
    float *dW, *dS, *dA, *dG, *dGt;          /* adjoint images: of W^(s+1), S^(s+1), the anchor, G, clip(G) */
    float *gW[MN_LGRAD_MAX_PARAMS], *gS[MN_LGRAD_MAX_PARAMS]; /* the initial tensors' gradients [M, numel] */
    int *flag;                               /* the finite check's answer */
    /* in a captured block's launches, the first step of the block being walked, on the
     * device: o.step and o.t count from it, so the graph serves every block alike
     * (mn_lgrad_base_kernel sets it). NULL in direct launches: o.step and o.t are the
     * step and row themselves, and no kernel waits on a load for them. */
    long long *base;
    /* the update's adjoint: parameter p's slices [slice_start[p], slice_start[p + 1]) of
     * MN_LARGE_SLICE elements, nslices a memory; each slice's partial sums (deta, dalpha,
     * |G|^2, <dGt, G>) in part [M, nslices, 4], the clip adjoint's (sc, through) per
     * parameter in coef [M, NP, 2] */
    long long slice_start[MN_LGRAD_MAX_PARAMS + 1], nslices;
    double *part, *coef;
    double *colpart; /* a bias gradient's column sums per block of rows [M, nrb, width] */
} mn_lgrad_kargs;

/* One launch; each kernel's comment says which fields it reads. */
typedef struct mn_lgrad_op {
    const float *in, *in2;     /* chunk inputs */
    const float *d1, *d2, *zd; /* a hidden layer's phi'(z), phi''(z), tangent zd */
    const float *bias, *dbias; /* a layer's bias at the gradient point and its direction in dG, [M, width] */
    const float *Wimg, *Simg, *Gimg; /* a step's images: W^(s), S^(s), G_s */
    const float *x;            /* rows of k or q [M, n, dk] */
    float *out, *out2, *out3;  /* chunk outputs */
    float *g;                  /* a gradient: [M, n, width] rows, or a bias's [M, width] */
    long long step, t, rows, width, count; /* step and t: from the block's first step where a.base */
    long long merge_rows; /* loss: the step's rows below this are retrievals at W^(s) = the gradient point */
    int flags, pad_;
} mn_lgrad_op;

#define MN_LGRAD_TANGENT 1 /* reverse act: the tangent's adjoint too */

#endif /* MN_LGRAD_ARGS */

#ifdef __CUDACC_RTC__

#define MN_LGRAD_NP mn_param_count(MN_LAYERS, MN_BIAS)
/* A launch's step and first row of the sequence: in a captured block, o.step
 * and o.t count from the walked block's first step, which the device holds
 * (a.base); in a direct launch they are the step and the row. */
__device__ __forceinline__ long long mn_lgrad_step(const mn_lgrad_kargs &a, const mn_lgrad_op &o)
{
    return a.base ? *a.base + o.step : o.step;
}
__device__ __forceinline__ long long mn_lgrad_row(const mn_lgrad_kargs &a, const mn_lgrad_op &o)
{
    return a.base ? *a.base * MN_STEP + o.t : o.t;
}

/* The walked block's first step, before a captured block's replay:
 * *a.base = o.step. One thread. */
extern "C" __global__ void mn_lgrad_base_kernel(const mn_lgrad_kargs a, const mn_lgrad_op o)
{
    *a.base = o.step;
}

/* Whether an input holds a non-finite number: count floats of in; flag set
 * to 1 where one does (the host zeroed it). Grid-stride, grid (x). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_finite_kernel(const mn_lgrad_kargs a,
                                                                                      const mn_lgrad_op o)
{
    bool bad = false;
    MN_LG_GRID_STRIDE(e, o.count) bad = bad || !isfinite(o.in[e]);
    if (bad) atomicOr(a.flag, 1);
}

/* Rows of an input into a chunk: out[m, r, :] = in[m, t + r, :] for r <
 * rows, width floats a row (in: k, q or dy, [M, n, width]). Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_stage_kernel(const mn_lgrad_kargs a,
                                                                                     const mn_lgrad_op o)
{
    const long long m = blockIdx.y;
    const float *src = o.in + (m * a.n + mn_lgrad_row(a, o)) * o.width;
    float *dst = o.out + m * a.ld;
    MN_LG_GRID_STRIDE(e, o.rows * o.width) dst[e] = src[e];
}

/* g[m, t + r, :] += in[m, r, :] for r < rows (a chunk's adjoint of its
 * input rows into gk or gq). Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_addrows_kernel(const mn_lgrad_kargs a,
                                                                                       const mn_lgrad_op o)
{
    const long long m = blockIdx.y;
    const float *src = o.in + m * a.ld;
    float *dst = o.g + (m * a.n + mn_lgrad_row(a, o)) * o.width;
    MN_LG_GRID_STRIDE(e, o.rows * o.width) dst[e] += src[e];
}

/* A hidden layer after its product at the gradient point, as mn_mlp_forward
 * and act_derivs: z = out + bias in place, out2 = phi(z), out3 = phi'(z),
 * and g (when not NULL) = phi''(z). Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_act_kernel(const mn_lgrad_kargs a,
                                                                                   const mn_lgrad_op o)
{
    const long long m = blockIdx.y, base = m * a.ld;
    const float *b = o.bias ? o.bias + m * o.width : 0;
    MN_LG_GRID_STRIDE(e, o.rows * o.width)
    {
        float z = o.out[base + e];
        if (b) z += b[e % o.width];
        o.out[base + e] = z;
        o.out2[base + e] = mn_hook_act(z);
        o.out3[base + e] = (float)mn_ghook_act_d((double)z);
        if (o.g) o.g[base + e] = (float)mn_ghook_act_dd((double)z);
    }
}

/* A hidden layer's tangent after its products: zd = out + dbias in place,
 * out2 = hd = phi'(z) zd (d1). Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_tangent_kernel(const mn_lgrad_kargs a,
                                                                                       const mn_lgrad_op o)
{
    const long long m = blockIdx.y, base = m * a.ld;
    const float *db = o.dbias ? o.dbias + m * o.width : 0;
    MN_LG_GRID_STRIDE(e, o.rows * o.width)
    {
        float zd = o.out[base + e];
        if (db) zd += db[e % o.width];
        o.out[base + e] = zd;
        o.out2[base + e] = (float)((double)o.d1[base + e] * zd);
    }
}

/* The loss's pointwise terms of a step's chunk (mn_mlp_step_adjoint), one
 * warp per row, grid (ceil(rows/8), M). in: the last product at the
 * gradient point, in2: its tangent's; bias, dbias: b_L and its direction
 * (NULL without biases). Step s, rows t .. t + o.rows - 1 of the
 * sequence (mn_lgrad_step, mn_lgrad_row), o.count: the step's rows (the
 * mean's count). Writes out = ybar (dloss's term and, where the step ran,
 * the second-order one), out2 = ubar (0 where the step was skipped; ybar
 * takes dy too for the step's rows below merge_rows, retrievals that were
 * this forward), and adds the v, theta and (residual) k gradients. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_loss_kernel(const mn_lgrad_kargs a,
                                                                                    const mn_lgrad_op o)
{
    const long long m = blockIdx.y, r = (long long)blockIdx.x * MN_LG_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= o.rows) return; /* the whole warp */
    const long long s = mn_lgrad_step(a, o), t = mn_lgrad_row(a, o) + r, row = m * a.ld + r * MN_DV;
    const bool ran = a.skipped[m * a.nsteps + s] == 0.0f;
    const double R = MN_FEATURE_SCALE, tscale = MN_TOKEN_MEAN ? 1.0 / (double)o.count : 1.0;
    const double wt = (double)(float)((double)a.theta[m * a.n + t] * tscale);
    const double dl = a.dloss ? (double)a.dloss[m * a.n + t] : 0.0;
    const float *b = o.bias ? o.bias + m * MN_DV : 0, *db = o.dbias ? o.dbias + m * MN_DV : 0;
    const float *xr = a.k + (m * a.n + t) * MN_DK, *vr = a.v + (m * a.n + t) * MN_DV;
    float *gvr = a.gv + (m * a.n + t) * MN_DV, *gkr = a.gk + (m * a.n + t) * MN_DK;
    /* a retrieval row whose output is this forward's (q = k, the gradient point W^(s)) */
    const bool merged = a.dy && t - s * MN_STEP < o.merge_rows;
    const float *dyr = merged ? a.dy + (m * a.n + t) * MN_DV : 0;
    double acc = 0.0;
    for (int j = lane; j < MN_DV; j += 32) {
        float y = o.in[row + j];
        if (b) y += b[j];
        if (MN_RESIDUAL) y += xr[j];
        float u = 0.0f;
        if (ran) {
            u = o.in2[row + j];
            if (db) u += db[j];
        }
        const double yd = y, vd = vr[j], rd = yd - vd;
        const double fy = mn_ghook_loss_dy(yd, vd, rd);
        float ybar = (float)(dl * R * fy), ubar = 0.0f;
        if (ran) {
            ubar = (float)(wt * R * fy);
            acc += fy * u;
            ybar += (float)(wt * R * mn_ghook_loss_dyy(yd, vd, rd) * u);
            gvr[j] += (float)(wt * R * mn_ghook_loss_dyv(yd, vd, rd) * u);
        }
        if (a.dloss) gvr[j] += (float)(dl * R * mn_ghook_loss_dv(yd, vd, rd));
        if (merged) ybar += dyr[j];
        o.out[row + j] = ybar;
        o.out2[row + j] = ubar;
        if (MN_RESIDUAL) gkr[j] += ybar;
    }
    acc = mn_lg_warp_sum(acc);
    if (ran && lane == 0) a.gtheta[m * a.n + t] += (float)(tscale * (double)(float)(R * acc));
}

/* The seed of a retrieval output's adjoint (mn_mlp_vjp): out[m, r, :] =
 * dy[m, t + r, :], and with a residual g (gk or gq) rows += dy. Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_seed_kernel(const mn_lgrad_kargs a,
                                                                                    const mn_lgrad_op o)
{
    const long long m = blockIdx.y;
    const long long t = mn_lgrad_row(a, o);
    const float *src = a.dy + (m * a.n + t) * MN_DV;
    float *dst = o.out + m * a.ld;
    float *gx = o.g + (m * a.n + t) * MN_DK;
    MN_LG_GRID_STRIDE(e, o.rows * MN_DV)
    {
        dst[e] = src[e];
        if (MN_RESIDUAL) gx[e] += src[e];
    }
}

/* A bias's gradient, g[m, j] += column sums of in over the rows, in two
 * launches with a fixed order of sums (in double, as the CPU's colsum_acc):
 * this one sums each block's MN_LGRAD_COL_ROWS rows of 32 columns into
 * a.colpart [M, nrb, width] (block 32 x 8; grid (ceil(width/32), nrb, M)),
 * mn_lgrad_colsum_kernel adds the nrb partials of each column in order
 * (one thread a column, grid (ceil(width/256), M)). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_colpart_kernel(const mn_lgrad_kargs a,
                                                                                       const mn_lgrad_op o)
{
    const long long m = blockIdx.z, rb = blockIdx.y, nrb = gridDim.y;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long c = (long long)blockIdx.x * 32 + tx;
    const long long r1 = (rb + 1) * MN_LGRAD_COL_ROWS < o.rows ? (rb + 1) * MN_LGRAD_COL_ROWS : o.rows;
    const float *src = o.in + m * a.ld;
    double acc = 0.0;
    if (c < o.width)
        for (long long r = rb * MN_LGRAD_COL_ROWS + ty; r < r1; r += 8) acc += src[r * o.width + c];
    __shared__ double part[8][32];
    part[ty][tx] = acc;
    __syncthreads();
    if (ty != 0 || c >= o.width) return;
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < 8; i++) s += part[i][tx];
    a.colpart[(m * nrb + rb) * o.width + c] = s;
}

extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_colsum_kernel(const mn_lgrad_kargs a,
                                                                                      const mn_lgrad_op o)
{
    const long long m = blockIdx.y, j = (long long)blockIdx.x * MN_LARGE_THREADS + threadIdx.x;
    if (j >= o.width) return;
    const long long nrb = (o.rows + MN_LGRAD_COL_ROWS - 1) / MN_LGRAD_COL_ROWS;
    double s = 0.0;
    for (long long i = 0; i < nrb; i++) s += a.colpart[(m * nrb + i) * o.width + j];
    o.g[m * o.width + j] += (float)s;
}

/* From the adjoints of a hidden layer's output to those of its
 * pre-activation (mn_mlp_step_adjoint's reverse): in = hbar, in2 = hdbar;
 * out = zbar = phi' hbar + phi'' zd hdbar, out2 = zdbar = phi' hdbar, or
 * (no MN_LGRAD_TANGENT: mn_mlp_vjp) out = phi' hbar. Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_reverse_act_kernel(const mn_lgrad_kargs a,
                                                                                           const mn_lgrad_op o)
{
    const long long m = blockIdx.y, base = m * a.ld;
    const bool tangent = (o.flags & MN_LGRAD_TANGENT) != 0;
    MN_LG_GRID_STRIDE(e, o.rows * o.width)
    {
        const long long i = base + e;
        const double d1 = o.d1[i], hb = o.in[i];
        if (tangent) {
            const double hdb = o.in2[i];
            o.out[i] = (float)(d1 * hb + (double)o.d2[i] * o.zd[i] * hdb);
            o.out2[i] = (float)(d1 * hdb);
        } else {
            o.out[i] = (float)(d1 * hb);
        }
    }
}

/* The adjoint of step s's update (grad_cpu.c step_reverse), grid
 * (nslices, M): where the step ran, with W^(s), S^(s) and G_s in Wimg,
 * Simg, Gimg, from dW, dS (of W^(s+1), S^(s+1)): dGt = -(dS + dW), dW *=
 * 1 - alpha, dS = eta (dS + dW), and the slice's partial sums of deta =
 * <dS + dW, S>, dalpha = -<dW, W> and, for a norm-type clip, |G|^2 and
 * <dGt, G>. Without a norm-type clip dG follows here (clip_adjoint's
 * elementwise forms); with one, mn_lgrad_dg_kernel after mn_lgrad_clip_kernel.
 * A skipped step is the identity: dG = 0, partials 0. */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_update_kernel(const mn_lgrad_kargs a,
                                                                                      const mn_lgrad_op o)
{
    const long long m = blockIdx.y, si = m * a.nsteps + mn_lgrad_step(a, o);
    long long e0, e1;
    const int p = mn_lg_slice<MN_LGRAD_NP>(a.slice_start, a.numel, blockIdx.x, &e0, &e1);
    const long long off = a.ioff[p] + m * a.numel[p];
    double *part = a.part + (m * a.nslices + blockIdx.x) * 4;
    if (a.skipped[si] != 0.0f) {
        for (long long e = e0 + threadIdx.x; e < e1; e += MN_LARGE_THREADS) a.dG[off + e] = 0.0f;
        if (threadIdx.x < 4) part[threadIdx.x] = 0.0;
        return; /* the whole block */
    }
    const float e_s = a.eta[si], keep = 1.0f - a.alpha[si];
    double deta = 0.0, dalpha = 0.0, sq = 0.0, dot = 0.0;
    for (long long e = e0 + threadIdx.x; e < e1; e += MN_LARGE_THREADS) {
        const long long i = off + e;
        const float dW = a.dW[i], dSt = a.dS[i] + dW;
        deta += (double)dSt * o.Simg[i];
        dalpha -= (double)dW * o.Wimg[i];
        a.dW[i] = keep * dW;
        a.dS[i] = e_s * dSt;
        const float dGt = -dSt;
#if MN_CLIP_MODE == 1
        const double g = o.Gimg[i];
        a.dGt[i] = dGt;
        sq += g * g;
        dot += (double)dGt * g;
#elif MN_CLIP_MODE == 2
        a.dG[i] = (float)(dGt * mn_ghook_clip_delem((double)o.Gimg[i]));
#else
        a.dG[i] = dGt;
#endif
    }
    deta = mn_lg_block_sum(deta);
    dalpha = mn_lg_block_sum(dalpha);
#if MN_CLIP_MODE == 1
    sq = mn_lg_block_sum(sq);
    dot = mn_lg_block_sum(dot);
#endif
    if (threadIdx.x == 0) {
        part[0] = deta;
        part[1] = dalpha;
        part[2] = sq;
        part[3] = dot;
    }
}

/* The update's sums, one warp per memory in a block of 8, grid
 * (ceil(M/8)): deta, dalpha into geta, galpha (where the step ran), and
 * for a norm-type clip each parameter's (sc, through) into coef: Gt = G
 * sc(|G|) gives dG = sc dGt + sc'(n) <dGt, G> / n G (n = 0: the second term
 * 0), n over every parameter or each one (scope tensor). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_clip_kernel(const mn_lgrad_kargs a,
                                                                                    const mn_lgrad_op o)
{
    const long long m = (long long)blockIdx.x * MN_LG_WARPS + (threadIdx.x >> 5), si = m * a.nsteps + mn_lgrad_step(a, o);
    const int lane = threadIdx.x & 31;
    if (m >= a.memories || a.skipped[si] != 0.0f) return; /* the whole warp */
    const double *part = a.part + m * a.nslices * 4;
    double sums[4][MN_LGRAD_NP];
    for (int q = 0; q < MN_LGRAD_NP; q++)
        for (int k = 0; k < 4; k++) {
            double s = 0.0;
            for (long long i = a.slice_start[q] + lane; i < a.slice_start[q + 1]; i += 32) s += part[i * 4 + k];
            sums[k][q] = mn_lg_warp_sum(s);
        }
    double deta = 0.0, dalpha = 0.0, sq = 0.0, dot = 0.0;
    for (int q = 0; q < MN_LGRAD_NP; q++) {
        deta += sums[0][q];
        dalpha += sums[1][q];
        sq += sums[2][q];
        dot += sums[3][q];
    }
    if (lane != 0) return;
    a.geta[si] = (float)deta;
    a.galpha[si] = (float)dalpha;
#if MN_CLIP_MODE == 1
    for (int q = 0; q < MN_LGRAD_NP; q++) {
        const double gs = MN_CLIP_TENSOR ? sums[2][q] : sq, gd = MN_CLIP_TENSOR ? sums[3][q] : dot;
        const double nrm = sqrt(gs);
        a.coef[(m * MN_LGRAD_NP + q) * 2] = mn_hook_clip_scale(nrm);
        a.coef[(m * MN_LGRAD_NP + q) * 2 + 1] = nrm > 0.0 ? mn_ghook_clip_dscale(nrm) * gd / nrm : 0.0;
    }
#endif
}

/* dG = sc dGt + through G where the step ran (a norm-type clip's adjoint,
 * coef from mn_lgrad_clip_kernel), grid (nslices, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_dg_kernel(const mn_lgrad_kargs a,
                                                                                  const mn_lgrad_op o)
{
    const long long m = blockIdx.y;
    if (a.skipped[m * a.nsteps + mn_lgrad_step(a, o)] != 0.0f) return; /* dG = 0 already */
    long long e0, e1;
    const int p = mn_lg_slice<MN_LGRAD_NP>(a.slice_start, a.numel, blockIdx.x, &e0, &e1);
    const long long off = a.ioff[p] + m * a.numel[p];
    const double sc = a.coef[(m * MN_LGRAD_NP + p) * 2], through = a.coef[(m * MN_LGRAD_NP + p) * 2 + 1];
    for (long long e = e0 + threadIdx.x; e < e1; e += MN_LARGE_THREADS)
        a.dG[off + e] = (float)(sc * a.dGt[off + e] + through * o.Gimg[off + e]);
}

/* At the first step of a refresh block the anchor is W^(s): dW += dA, dA =
 * 0, over count floats (whole images). Grid (x). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_refresh_kernel(const mn_lgrad_kargs a,
                                                                                       const mn_lgrad_op o)
{
    MN_LG_GRID_STRIDE(e, o.count)
    {
        a.dW[e] += a.dA[e];
        a.dA[e] = 0.0f;
    }
}

/* The gradients of the initial tensors: gW = dW + dA, gS = dS, parameter
 * by parameter. Grid (x, M). */
extern "C" __global__ void __launch_bounds__(MN_LARGE_THREADS) mn_lgrad_final_kernel(const mn_lgrad_kargs a,
                                                                                     const mn_lgrad_op o)
{
    (void)o;
    const long long m = blockIdx.y;
    for (int p = 0; p < MN_LGRAD_NP; p++) {
        const long long off = a.ioff[p] + m * a.numel[p];
        float *gW = a.gW[p] + m * a.numel[p], *gS = a.gS[p] + m * a.numel[p];
        MN_LG_GRID_STRIDE(e, a.numel[p])
        {
            gW[e] = a.dW[off + e] + a.dA[off + e];
            gS[e] = a.dS[off + e];
        }
    }
}

#endif /* __CUDACC_RTC__ */
