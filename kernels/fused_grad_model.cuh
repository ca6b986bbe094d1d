/* fused_grad_model.cuh: the memory model's side of the fused backward
 * (fused_grad.cuh, which comes after it in the source and holds the run's
 * side: the recompute, the update's and clip's adjoints, the walk in
 * reverse and the kernel). Here: the backward's chunk buffers in shared
 * memory and the shared slots' copies, one chunk's pass (the forward at
 * W^(s), its tangent along dG, the loss's seeds and the reverse into the
 * gradient point's adjoint and the rows' gradients, grad_kernel.cuh's
 * mn_gstep_adjoint on tensor cores) and one row's retrieval vjp. NVRTC
 * only: it comes after fused_kernel.cuh and grad_common.cuh. */
#ifdef __CUDACC_RTC__

/* Elements per thread whose loads a flat-vector loop issues before its
 * stores. These loops wait on global memory's latency, not its bandwidth:
 * with one element at a time, the update's adjoint alone took a ninth of
 * P1's backward (MNEMO_FG_PROFILE). */
#define MN_FG_U 4

/* Floats of one padded parameter set (mn_pset_init's carve-up). */
__device__ __forceinline__ long long mn_pset_floats()
{
    long long f = 0;
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) f += (long long)MN_LPOUT(i) * MN_LLD(i) + (MN_BIAS ? MN_LPOUT(i) : 0);
    return f;
}

/* The backward's chunk buffers in shared memory, [MN_FR x ld] each. */
struct mn_gbuf {
    float *x;        /* the rows' inputs (a non-finite row zeroed) */
    float *z, *h;    /* forward; h then hbar, then zbar */
    float *zd, *hd;  /* tangent; hd then hdbar, then zdbar */
    float *y, *u;    /* y then ybar; the tangent's output */
    float *dy;       /* ubar = theta R f'(y, v) */
    float *bad;      /* [MN_FR]: 1 where the row's x is not finite */
};

/* The forward's chunk view of the same buffers (mn_fused_forward's). */
__device__ __forceinline__ mn_fbuf mn_gbuf_fwd(const mn_gbuf &gb)
{
    mn_fbuf fb;
    fb.x = gb.x;
    fb.z = gb.z;
    fb.h = gb.h;
    fb.y = gb.y;
    fb.dy = gb.dy;
    fb.xs = fb.hs = fb.ys = fb.lrow = 0;
    return fb;
}

/* Layer i's padded weights and bias (contiguous in a pset) from src into
 * dst by float4s: the shared slot of a layer takes W's or dG's in turn.
 * The caller's barriers fence it. */
__device__ __forceinline__ void mn_fg_copy_layer(const mn_pset &dst, const mn_pset &src, int i)
{
    const int n4 = (MN_LPOUT(i) * MN_LLD(i) + (MN_BIAS ? MN_LPOUT(i) : 0)) / 4;
    constexpr int U = 4; /* loads in flight per thread before their stores: the copy waits on latency, not bandwidth */
    float4 *d = reinterpret_cast<float4 *>(dst.w[i]);
    const float4 *sv = reinterpret_cast<const float4 *>(src.w[i]);
    for (int e0 = threadIdx.x; e0 < n4; e0 += U * MN_FT) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MN_FT < n4) v[u] = sv[e0 + u * MN_FT];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MN_FT < n4) d[e0 + u * MN_FT] = v[u];
    }
}

/* W^(s) from its flat copy (global) into the shared slots and the padded
 * global copy the slots take it back from, in one pass. */
__device__ void mn_fg_load_w(const mn_pset &P, const mn_pset &Wg, const float *Wflat)
{
    float *src[MN_NPARAMS];
    mn_gptrs((float *)Wflat, src);
#pragma unroll
    for (int i = 0; i < MN_LAYERS; i++) {
        const int ni = MN_LIN(i), no = MN_LOUT(i), ld = MN_LLD(i);
        const float *w = src[i * MN_PER];
        const int ne = MN_LPOUT(i) * ld;
        /* MN_FG_U loads in flight before their stores */
        for (int base = threadIdx.x; base < ne; base += MN_FG_U * MN_FT) {
            float v[MN_FG_U];
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT, o = e / ld, j = e % ld;
                v[u] = (e < ne && o < no && j < ni) ? w[o * ni + j] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < MN_FG_U; u++) {
                const int e = base + u * MN_FT;
                if (e >= ne) break;
                P.w[i][e] = v[u];
                Wg.w[i][e] = v[u];
            }
        }
        if (MN_BIAS) {
            const float *b = src[i * MN_PER + 1];
            for (int o = threadIdx.x; o < MN_LPOUT(i); o += MN_FT) {
                const float v = o < no ? b[o] : 0.0f;
                P.b[i][o] = v;
                Wg.b[i][o] = v;
            }
        }
    }
}

/* Rows [0, cr) of x (global, dk floats a row) into gb.x, zero beyond; a row
 * with a non-finite entry is zeroed and marked in gb.bad. Starts and ends
 * with a barrier. */
__device__ void mn_fg_load_rows(const mn_gbuf &gb, const float *x, int cr)
{
    float xr[MN_NX];
    mn_rows_fetch(xr, x, cr);
    __syncthreads();
    mn_rows_store(gb.x, xr, cr);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < MN_FR; r += MN_FWARPS) {
        bool bad = false;
        for (int j = lane; j < MN_DK; j += 32) bad = bad || !isfinite(gb.x[r * MN_LDK + j]);
        bad = __any_sync(0xffffffffu, bad);
        if (bad)
            for (int j = lane; j < MN_DK; j += 32) gb.x[r * MN_LDK + j] = 0.0f;
        if (lane == 0) gb.bad[r] = bad ? 1.0f : 0.0f;
    }
    __syncthreads();
}

/* ---- the memory model's adjoints on one chunk (grad_kernel.cuh's mn_gstep_adjoint) ---- */

/* What one chunk pass computes. */
struct mn_fg_chunk_args {
    const mn_pset *dG;      /* the tangent's direction (padded, global), or NULL: none */
    bool loss;              /* the loss's terms (ubar, ybar from dloss and the tangent, gv, gtheta) */
    const float *v, *theta, *dloss; /* the chunk's rows (dloss may be NULL) */
    double tscale;
    const float *dyret;     /* upstream of outputs that read M(x; P) on the first ret rows, or NULL */
    int ret;
    float *gx, *gv, *gtheta; /* the rows' gradients (+=) */
    float *const *dA;       /* adjoint of P, flat per parameter: written (first) or added to */
    bool first;
};

/* Pairs of a product's output tile into an adjoint of P (flat [rows x cols]):
 * the value before (unless first) comes in through pre, the sum is stored. */
__device__ __forceinline__ mn_gacc mn_fg_acc(float *g, int rows, int cols, bool first)
{
    const mn_gacc acc = {g, rows, cols, first, false, 0};
    return acc;
}

/* Adds a product's tile into rows of a global gradient [rows x MN_DK]. */
struct mn_fg_add_rows {
    float *g;
    int rows;
    __device__ __forceinline__ void operator()(int r, int j, float a0, float a1) const
    {
        if (r >= rows) return;
        if (j < MN_DK) g[(long long)r * MN_DK + j] += a0;
        if (j + 1 < MN_DK) g[(long long)r * MN_DK + j + 1] += a1;
    }
};

/* The chunk's cr rows, x already in gb.x (mn_fg_load_rows): forward at P,
 * tangent with dG, the loss's seeds, and the reverse into dA and the rows'
 * gradients. P's shared slots hold W^(s) on entry and on return; with a
 * tangent, a layer's slot takes dG's copy of the layer (from c.dG, global)
 * while its products need it and W's back (from Wg, global) after: two
 * copies of each layer a chunk, in place of products that would read dG
 * from global memory at its latency. Ends with a barrier. */
__device__ void mn_fg_chunk(const mn_pset &P, const mn_pset &Wg, const mn_gbuf &gb, int cr, const mn_fg_chunk_args &c)
{
    const int tid = threadIdx.x, lane = tid & 31;
    const double R = MN_FEATURE_SCALE;
    const bool tangent = c.dG != 0;
    const mn_fbuf fb = mn_gbuf_fwd(gb);
    /* z stays z: the adjoint's phi' and phi'' take it in double */
    mn_fused_forward<false>(P, fb, cr, [&](int r, int j, float y0, float y1) {
        *reinterpret_cast<float2 *>(gb.y + r * MN_LDV + j) = make_float2(y0, y1);
    });
    MN_PROF_MARK(10);

    /* the tangent u = J_P(y) dG; the slots end as (dG1, dG2) */
    if (tangent) {
        mn_fg_copy_layer(P, *c.dG, 0);
        __syncthreads();
#if MN_LAYERS == 2
        mn_gemm<MN_FR, MN_PDH, MN_PDK, false, false>(gb.x, MN_LDK, P.w[0], MN_LLD(0),
                                                     [&](int r, int j, float a0, float a1) {
            const float zd[2] = {MN_BIAS ? __fadd_rn(P.b[0][j], a0) : a0, MN_BIAS ? __fadd_rn(P.b[0][j + 1], a1) : a1};
            float hd[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                hd[i] = r < cr && j + i < MN_DH
                            ? (float)(mn_ghook_act_d((double)gb.z[r * MN_LDH + j + i]) * (double)zd[i])
                            : 0.0f;
            *reinterpret_cast<float2 *>(gb.zd + r * MN_LDH + j) = make_float2(zd[0], zd[1]);
            *reinterpret_cast<float2 *>(gb.hd + r * MN_LDH + j) = make_float2(hd[0], hd[1]);
        });
        __syncthreads();
        MN_PROF_MARK(19);
        /* u = hd W2^T, then + h dG2^T + db2: the same tiles, so the second
         * product's pre reads what this thread stored */
        mn_gemm<MN_FR, MN_PDV, MN_PDH, false, false>(gb.hd, MN_LDH, P.w[1], MN_LLD(1),
                                                     [&](int r, int j, float a0, float a1) {
            *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
        });
        __syncthreads();
        mn_fg_copy_layer(P, *c.dG, 1);
        __syncthreads();
        MN_PROF_MARK(20);
        mn_gemm<MN_FR, MN_PDV, MN_PDH, false, false>(
            gb.h, MN_LDH, P.w[1], MN_LLD(1),
            [&](int r, int j, float a0, float a1) {
                if (MN_BIAS) a0 = __fadd_rn(a0, P.b[1][j]), a1 = __fadd_rn(a1, P.b[1][j + 1]);
                *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
            },
            [&](int r, int j) { return *reinterpret_cast<const float2 *>(gb.u + r * MN_LDV + j); });
#else
        mn_gemm<MN_FR, MN_PDV, MN_PDK, false, false>(gb.x, MN_LDK, P.w[0], MN_LLD(0),
                                                     [&](int r, int j, float a0, float a1) {
            if (MN_BIAS) a0 = __fadd_rn(P.b[0][j], a0), a1 = __fadd_rn(P.b[0][j + 1], a1);
            *reinterpret_cast<float2 *>(gb.u + r * MN_LDV + j) = make_float2(a0, a1);
        });
#endif
        __syncthreads();
    }
    MN_PROF_MARK(11);

    /* the seeds, a warp per row (grad_kernel.cuh's loss loop, term for term):
     * ybar into gb.y, ubar into gb.dy, zero on rows past cr and cut rows */
    for (int r = tid >> 5; r < MN_FR; r += MN_FWARPS) {
        float *yr = gb.y + r * MN_LDV, *ur = gb.dy + r * MN_LDV;
        const float *u = gb.u + r * MN_LDV;
        if (r >= cr) {
            for (int j = lane; j < MN_PDV; j += 32) yr[j] = ur[j] = 0.0f;
            continue;
        }
        const bool xbad = gb.bad[r] != 0.0f;
        bool cut = xbad;
        if (c.loss && !cut) {
            const float *vr = c.v + (long long)r * MN_DV;
            bool vfinite = true;
            for (int j = lane; j < MN_DV; j += 32) vfinite = vfinite && isfinite(vr[j]);
            vfinite = __all_sync(0xffffffffu, vfinite);
            if (!vfinite) {
                bool dbad = false;
                for (int j = lane; j < MN_DV; j += 32) {
                    const double yy = yr[j], vv = vr[j];
                    dbad = dbad || !isfinite(mn_ghook_loss_dy(yy, vv, yy - vv));
                }
                cut = __any_sync(0xffffffffu, dbad);
            }
        }
        const float *dyr = c.dyret && r < c.ret && !xbad ? c.dyret + (long long)r * MN_DV : 0;
        if (!c.loss || cut) {
            for (int j = lane; j < MN_PDV; j += 32) {
                const float yb = dyr && j < MN_DV ? dyr[j] : 0.0f;
                if (MN_RESIDUAL && j < MN_DV) c.gx[(long long)r * MN_DK + j] += yb; /* dk = dv */
                yr[j] = yb;
                ur[j] = 0.0f;
            }
            continue;
        }
        const float *vr = c.v + (long long)r * MN_DV;
        const float wt = tangent ? (float)((double)c.theta[r] * c.tscale) : 0.0f;
        const double dl = c.dloss ? (double)c.dloss[r] : 0.0;
        double acc = 0.0;
        float ybv[(MN_PDV + 31) / 32], ubv[(MN_PDV + 31) / 32];
#pragma unroll
        for (int q = 0; q < (MN_PDV + 31) / 32; q++) {
            const int j = lane + 32 * q;
            ybv[q] = ubv[q] = 0.0f;
            if (j < MN_DV) {
                const double yy = yr[j], vv = vr[j], d = mn_ghook_loss_dy(yy, vv, yy - vv);
                if (tangent) ubv[q] = (float)((double)wt * R * d);
                ybv[q] = (float)(dl * R * d);
                if (tangent) acc += d * (double)u[j];
            }
        }
        if (tangent) {
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            const float gweight = (float)(R * acc);
            if (lane == 0) c.gtheta[r] += (float)(c.tscale * (double)gweight);
        }
#pragma unroll
        for (int q = 0; q < (MN_PDV + 31) / 32; q++) {
            const int j = lane + 32 * q;
            if (j < MN_DV) {
                const double yy = yr[j], vv = vr[j];
                float *gvj = c.gv + (long long)r * MN_DV + j;
                if (tangent) {
                    ybv[q] += (float)((double)wt * R * mn_ghook_loss_dyy(yy, vv, yy - vv) * (double)u[j]);
                    *gvj += (float)((double)wt * R * mn_ghook_loss_dyv(yy, vv, yy - vv) * (double)u[j]);
                }
                if (c.dloss) *gvj += (float)(dl * R * mn_ghook_loss_dv(yy, vv, yy - vv));
                if (dyr) ybv[q] += dyr[j];
                if (MN_RESIDUAL) c.gx[(long long)r * MN_DK + j] += ybv[q];
            }
            if (j < MN_PDV) {
                yr[j] = ybv[q];
                ur[j] = ubv[q];
            }
        }
    }
    __syncthreads();
    MN_PROF_MARK(12);

    /* the reverse; with a tangent the slots hold (dG1, dG2) here */
#if MN_LAYERS == 2
    float *const *dA = c.dA;
    {
        const mn_gacc a2 = mn_fg_acc(dA[1 * MN_PER], MN_DV, MN_DH, c.first);
        mn_gemm<MN_PDV, MN_PDH, MN_FR, true, true>(gb.y, MN_LDV, gb.h, MN_LDH, a2, a2.pre());
        if (tangent) {
            const mn_gacc a2t = mn_fg_acc(dA[1 * MN_PER], MN_DV, MN_DH, false);
            mn_gemm<MN_PDV, MN_PDH, MN_FR, true, true>(gb.dy, MN_LDV, gb.hd, MN_LDH, a2t, a2t.pre());
        }
        if (MN_BIAS) mn_bias_grad<MN_DV>(dA[1 * MN_PER + 1], gb.y, MN_LDV, cr, c.first, false, 0);
    }
    __syncthreads(); /* h and hd are read: now they take hbar and hdbar */
    /* hbar = ubar dG2 (+ ybar W2, the slot back to W2 between) and hdbar = ubar W2 */
    auto into_h = [&](int r, int j, float a0, float a1) {
        *reinterpret_cast<float2 *>(gb.h + r * MN_LDH + j) = make_float2(a0, a1);
    };
    if (tangent) {
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[1], MN_LLD(1), into_h);
        __syncthreads();
        mn_fg_copy_layer(P, Wg, 1);
        __syncthreads();
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.y, MN_LDV, P.w[1], MN_LLD(1), into_h,
            [&](int r, int j) { return *reinterpret_cast<const float2 *>(gb.h + r * MN_LDH + j); });
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[1], MN_LLD(1),
                                                    [&](int r, int j, float a0, float a1) {
            *reinterpret_cast<float2 *>(gb.hd + r * MN_LDH + j) = make_float2(a0, a1);
        });
    } else {
        mn_gemm<MN_FR, MN_PDH, MN_PDV, false, true>(gb.y, MN_LDV, P.w[1], MN_LLD(1), into_h);
    }
    __syncthreads();
    MN_PROF_MARK(13);
    /* through the activation: zbar into gb.h, zdbar into gb.hd */
    for (int e = tid; e < MN_FR * MN_PDH; e += MN_FT) {
        const int r = e / MN_PDH, j = e % MN_PDH, i = r * MN_LDH + j;
        if (r >= cr || j >= MN_DH) {
            gb.h[i] = 0.0f;
            if (tangent) gb.hd[i] = 0.0f;
            continue;
        }
        const double d1 = mn_ghook_act_d((double)gb.z[i]);
        if (tangent) {
            const double d2 = mn_ghook_act_dd((double)gb.z[i]), hdb = gb.hd[i];
            gb.h[i] = (float)(d1 * (double)gb.h[i] + d2 * (double)gb.zd[i] * hdb);
            gb.hd[i] = (float)(d1 * hdb);
        } else {
            gb.h[i] = (float)(d1 * (double)gb.h[i]);
        }
    }
    __syncthreads();
    MN_PROF_MARK(14);
    {
        const mn_gacc a1 = mn_fg_acc(dA[0], MN_DH, MN_DK, c.first);
        mn_gemm<MN_PDH, MN_PDK, MN_FR, true, true>(gb.h, MN_LDH, gb.x, MN_LDK, a1, a1.pre());
        if (MN_BIAS) mn_bias_grad<MN_DH>(dA[1], gb.h, MN_LDH, cr, c.first, false, 0);
    }
    MN_PROF_MARK(21);
    /* dx += zdbar dG1 (the slot still dG1), then W1 back and dx += zbar W1 */
    {
        const mn_fg_add_rows add = {c.gx, cr};
        if (tangent) {
            mn_gemm<MN_FR, MN_PDK, MN_PDH, false, true>(gb.hd, MN_LDH, P.w[0], MN_LLD(0), add);
            __syncthreads();
            mn_fg_copy_layer(P, Wg, 0);
            __syncthreads();
        }
        MN_PROF_MARK(22);
        mn_gemm<MN_FR, MN_PDK, MN_PDH, false, true>(gb.h, MN_LDH, P.w[0], MN_LLD(0), add);
    }
#else
    {
        const mn_gacc a1 = mn_fg_acc(c.dA[0], MN_DV, MN_DK, c.first);
        mn_gemm<MN_PDV, MN_PDK, MN_FR, true, true>(gb.y, MN_LDV, gb.x, MN_LDK, a1, a1.pre());
        if (MN_BIAS) mn_bias_grad<MN_DV>(c.dA[1], gb.y, MN_LDV, cr, c.first, false, 0);
    }
    {
        const mn_fg_add_rows add = {c.gx, cr};
        if (tangent) {
            mn_gemm<MN_FR, MN_PDK, MN_PDV, false, true>(gb.dy, MN_LDV, P.w[0], MN_LLD(0), add);
            __syncthreads();
            mn_fg_copy_layer(P, Wg, 0);
            __syncthreads();
        }
        mn_gemm<MN_FR, MN_PDK, MN_PDV, false, true>(gb.y, MN_LDV, P.w[0], MN_LLD(0), add);
    }
#endif
    __syncthreads();
    MN_PROF_MARK(15);
}

/* ---- one row's retrieval at W^(s+1) and its vector-Jacobian product ---- */

/* y = M(x; W) with W = P (shared: the slots hold W^(s+1) when step s's
 * reverse begins), given dy: adds into gW (flat, global) and gx (dk
 * floats). The row buffers are the first rows of the chunk buffers. A
 * non-finite x contributes nothing (its output is cut). */
__device__ void mn_fg_row_vjp(const mn_pset &P, const float *x, const float *dyr, float *gWf, float *gx,
                              const mn_gbuf &gb)
{
    const int tid = threadIdx.x;
    float *xs = gb.x, *ys = gb.y;
    __syncthreads();
    for (int j = tid; j < MN_DK; j += MN_FT) xs[j] = x[j];
    for (int o = tid; o < MN_DV; o += MN_FT) ys[o] = dyr[o];
    double nbad = 0.0;
    for (int j = tid; j < MN_DK; j += MN_FT) nbad += isfinite(x[j]) ? 0.0 : 1.0;
    if (mn_block_sum(nbad) != 0.0) return; /* its barriers publish xs and ys */
    float *gW[MN_NPARAMS];
    mn_gptrs(gWf, gW);
#if MN_LAYERS == 2
    float *zs = gb.z, *hs = gb.h;
    const float *W1 = P.w[0], *W2 = P.w[1];
    for (int o = tid; o < MN_DH; o += MN_FT) {
        float acc = 0.0f;
        for (int j = 0; j < MN_DK; j++) acc += W1[o * MN_LLD(0) + j] * xs[j];
        if (MN_BIAS) acc += P.b[0][o];
        zs[o] = acc;
        hs[o] = mn_hook_act(acc);
    }
    __syncthreads();
    for (int e = tid; e < MN_DV * MN_DH; e += MN_FT) gW[MN_PER][e] += ys[e / MN_DH] * hs[e % MN_DH];
    if (MN_BIAS)
        for (int o = tid; o < MN_DV; o += MN_FT) gW[MN_PER + 1][o] += ys[o];
    for (int j = tid; j < MN_DH; j += MN_FT) {
        float hb = 0.0f;
        for (int o = 0; o < MN_DV; o++) hb += ys[o] * W2[o * MN_LLD(1) + j];
        zs[j] = (float)(mn_ghook_act_d((double)zs[j]) * (double)hb); /* zbar: each thread its own j */
    }
    __syncthreads();
    for (int e = tid; e < MN_DH * MN_DK; e += MN_FT) gW[0][e] += zs[e / MN_DK] * xs[e % MN_DK];
    if (MN_BIAS)
        for (int o = tid; o < MN_DH; o += MN_FT) gW[1][o] += zs[o];
    for (int j = tid; j < MN_DK; j += MN_FT) {
        float acc = 0.0f;
        for (int o = 0; o < MN_DH; o++) acc += zs[o] * W1[o * MN_LLD(0) + j];
        if (MN_RESIDUAL) acc += ys[j];
        gx[j] += acc;
    }
#else
    const float *W1 = P.w[0];
    for (int e = tid; e < MN_DV * MN_DK; e += MN_FT) gW[0][e] += ys[e / MN_DK] * xs[e % MN_DK];
    if (MN_BIAS)
        for (int o = tid; o < MN_DV; o += MN_FT) gW[1][o] += ys[o];
    for (int j = tid; j < MN_DK; j += MN_FT) {
        float acc = 0.0f;
        for (int o = 0; o < MN_DV; o++) acc += ys[o] * W1[o * MN_LLD(0) + j];
        if (MN_RESIDUAL) acc += ys[j];
        gx[j] += acc;
    }
#endif
    __syncthreads();
}

#endif /* __CUDACC_RTC__ */
