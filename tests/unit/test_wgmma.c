/* test_wgmma.c: kernels/wgmma.cuh, Hopper's warpgroup products in tf32,
 * against exact products. A probe kernel lays A [64 x K] and B [N x K] out
 * in shared memory as mn_wg_offset says, takes the products K / 8 k-steps at
 * a time, 64 columns of D per batch, with A from registers (rs) or from
 * shared memory (ss), and writes D = A B^T. The inputs are multiples of 1/8
 * in [-1, 1], so every product and sum is exact in fp32 and the check is
 * for equality: a wrong layout, descriptor or fragment gives errors of order
 * one. Where a case fails, the same run with LBO and SBO exchanged is
 * reported too (the one reading of the descriptor that is easy to get
 * backwards). Without a GPU of compute capability 9.0 only the compile is
 * checked: NVRTC for sm_90a (ptxas assembles the instructions, and keeps
 * each kernel's products in flight together). */
#include "check.h"
#include "random.h"
#include "../../kernels/codegen.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef MN_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nvrtc.h>

/* The probe, with A from registers (rs) or from shared memory (ss), for K
 * of 8, 32 and 64: template arguments, not branches, so that each kernel's
 * products issue back to back (ptxas serialises wgmmas that follow a branch
 * it cannot see is uniform). */
static const char *probe_kernel =
    "template <bool SS, int K>\n"
    "__device__ void mn_wg_probe(const float *A, const float *B, float *C, int N, unsigned lbo, unsigned sbo)\n"
    "{\n"
    "    extern __shared__ float4 mn_wg_smem4[];\n"
    "    float *sa = (float *)mn_wg_smem4, *sb = sa + 64 * K;\n"
    "    for (int e = threadIdx.x; e < 64 * K; e += 128) sa[mn_wg_offset(e / K, e % K, K)] = A[e];\n"
    "    for (int e = threadIdx.x; e < N * K; e += 128) sb[mn_wg_offset(e / K, e % K, K)] = B[e];\n"
    "    mn_wg_fence_smem();\n"
    "    __syncthreads();\n"
    "    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, r0 = 16 * w + (l >> 2), t = l & 3;\n"
    "    /* A's fragments of every k-step (K <= 64), loaded before the products and\n"
    "     * left alone until their wait: wgmma reads them asynchronously */\n"
    "    unsigned a[8][4];\n"
    "#pragma unroll\n"
    "    for (int s = 0; s < 8; s++) {\n"
    "        const float *p0 = A + r0 * K + 8 * s, *p1 = p0 + 8 * K;\n"
    "        const bool in = !SS && 8 * s < K; /* K a constant: no branch */\n"
    "        a[s][0] = in ? __float_as_uint(p0[t]) : 0u;\n"
    "        a[s][1] = in ? __float_as_uint(p1[t]) : 0u;\n"
    "        a[s][2] = in ? __float_as_uint(p0[t + 4]) : 0u;\n"
    "        a[s][3] = in ? __float_as_uint(p1[t + 4]) : 0u;\n"
    "    }\n"
    "    for (int nb = 0; nb < N / 64; nb++) {\n"
    "        float d[32];\n"
    "#pragma unroll\n"
    "        for (int i = 0; i < 32; i++) d[i] = 0.0f;\n"
    "        mn_wg_fence();\n"
    "#pragma unroll\n"
    "        for (int s = 0; s < 8; s++) {\n"
    "            if (8 * s >= K) break; /* K a constant: no branch */\n"
    "            const unsigned long long bd = mn_wg_desc(sb + nb * 64 * K + s * 64, lbo, sbo);\n"
    "            if (SS) mn_wg_tf32_n64_ss(d, mn_wg_desc(sa + s * 64, lbo, sbo), bd, s > 0);\n"
    "            else mn_wg_tf32_n64_rs(d, a[s][0], a[s][1], a[s][2], a[s][3], bd, s > 0);\n"
    "        }\n"
    "        mn_wg_commit();\n"
    "        mn_wg_wait<0>();\n"
    "        mn_wg_pin(d, 32);\n"
    "#pragma unroll\n"
    "        for (int j = 0; j < 8; j++) {\n"
    "            const int c = nb * 64 + 8 * j + 2 * t;\n"
    "            C[r0 * N + c] = d[4 * j];\n"
    "            C[r0 * N + c + 1] = d[4 * j + 1];\n"
    "            C[(r0 + 8) * N + c] = d[4 * j + 2];\n"
    "            C[(r0 + 8) * N + c + 1] = d[4 * j + 3];\n"
    "        }\n"
    "    }\n"
    "}\n"
    "#define MN_WG_PROBE(name, ss, k)                                                                \\\n"
    "    extern \"C\" __global__ void __launch_bounds__(128) name(const float *A, const float *B, float *C, \\\n"
    "        int N, unsigned lbo, unsigned sbo)                                                          \\\n"
    "    {                                                                                               \\\n"
    "        mn_wg_probe<ss, k>(A, B, C, N, lbo, sbo);                                                   \\\n"
    "    }\n"
    "MN_WG_PROBE(mn_wg_probe_rs_k8, false, 8)\n"
    "MN_WG_PROBE(mn_wg_probe_ss_k8, true, 8)\n"
    "MN_WG_PROBE(mn_wg_probe_rs_k32, false, 32)\n"
    "MN_WG_PROBE(mn_wg_probe_ss_k32, true, 32)\n"
    "MN_WG_PROBE(mn_wg_probe_rs_k64, false, 64)\n"
    "MN_WG_PROBE(mn_wg_probe_ss_k64, true, 64)\n";


/* The probe's cubin for sm_90a, or NULL with the reason in why. */
static void *compile_probe(size_t *size, char *why, size_t wlen)
{
    const char *lib = mn_cuda_template("wgmma");
    if (!lib) {
        snprintf(why, wlen, "kernels/wgmma.cuh is not among the embedded CUDA templates");
        return NULL;
    }
    size_t n = strlen(lib) + strlen(probe_kernel) + 2;
    char *src = malloc(n);
    if (!src) {
        snprintf(why, wlen, "out of memory");
        return NULL;
    }
    snprintf(src, n, "%s\n%s", lib, probe_kernel);
    nvrtcProgram prog;
    nvrtcResult r = nvrtcCreateProgram(&prog, src, "wgmma_probe.cu", 0, NULL, NULL);
    free(src);
    if (r != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcCreateProgram: %s", nvrtcGetErrorString(r));
        return NULL;
    }
    const char *opts[] = {"--gpu-architecture=sm_90a", "--std=c++17", "-default-device"};
    r = nvrtcCompileProgram(prog, 3, opts);
    size_t loglen = 0;
    char *log = NULL;
    if (nvrtcGetProgramLogSize(prog, &loglen) == NVRTC_SUCCESS && loglen > 1 && (log = malloc(loglen))) {
        if (nvrtcGetProgramLog(prog, log) != NVRTC_SUCCESS) log[0] = 0;
    }
    void *cubin = NULL;
    if (r != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcCompileProgram: %s: %.400s", nvrtcGetErrorString(r), log ? log : "");
    } else if (nvrtcGetCUBINSize(prog, size) != NVRTC_SUCCESS || !(cubin = malloc(*size)) ||
               nvrtcGetCUBIN(prog, cubin) != NVRTC_SUCCESS) {
        snprintf(why, wlen, "nvrtcGetCUBIN failed");
        free(cubin);
        cubin = NULL;
    }
    /* ptxas serialises wgmmas it cannot keep in flight together (C7520):
     * the products would then wait for each other, which the kernels built
     * on this file must never do */
    if (log && strstr(log, "serialized")) printf("FAIL wgmma/not_serialised: ptxas: %.400s\n", log), check_failures_++;
    else if (cubin) printf("PASS wgmma/not_serialised\n");
    free(log);
    nvrtcDestroyProgram(&prog);
    return cubin;
}

/* Largest |got - want| of one run of the probe, or -1 with why set. */
static double run_probe(cudaKernel_t k, int N, int K, unsigned lbo, unsigned sbo, const float *A,
                        const float *B, const double *want, char *why, size_t wlen)
{
    float *dA = NULL, *dB = NULL, *dC = NULL, *C = malloc((size_t)64 * N * sizeof(float));
    double worst = -1.0;
    cudaError_t e = C ? cudaSuccess : cudaErrorMemoryAllocation;
    if (e == cudaSuccess) e = cudaMalloc((void **)&dA, (size_t)64 * K * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&dB, (size_t)N * K * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&dC, (size_t)64 * N * sizeof(float));
    if (e == cudaSuccess) e = cudaMemcpy(dA, A, (size_t)64 * K * sizeof(float), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dB, B, (size_t)N * K * sizeof(float), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemset(dC, 0xff, (size_t)64 * N * sizeof(float)); /* NaN where never written */
    const size_t smem = (size_t)(64 + N) * K * sizeof(float);
    if (e == cudaSuccess) e = cudaKernelSetAttributeForDevice(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem, 0);
    void *args[] = {&dA, &dB, &dC, &N, &lbo, &sbo};
    const dim3 grid = {1, 1, 1}, block = {128, 1, 1}; /* one warpgroup */
    if (e == cudaSuccess) e = cudaLaunchKernel((const void *)k, grid, block, args, smem, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(C, dC, (size_t)64 * N * sizeof(float), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        snprintf(why, wlen, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        (void)cudaGetLastError();
    } else {
        worst = 0.0;
        for (int i = 0; i < 64 * N; i++) {
            const double d = fabs((double)C[i] - want[i]);
            if (!(d <= worst)) worst = isnan(d) ? INFINITY : d;
        }
    }
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
    free(C);
    return worst;
}
#endif

int main(void)
{
#ifndef MN_HAVE_CUDA
    SKIP("wgmma/all", "this build has no CUDA (nvcc was not found)");
    return 0;
#else
    char why[600] = "";
    size_t size = 0;
    void *cubin = compile_probe(&size, why, sizeof why);
    if (!cubin) printf("FAIL wgmma/nvrtc_sm90a: %s\n", why), check_failures_++;
    else printf("PASS wgmma/nvrtc_sm90a\n");

    int dev = -1;
    struct cudaDeviceProp prop;
    const bool gpu = cubin && cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess;
    if (!gpu || prop.major != 9) {
        (void)cudaGetLastError();
        SKIP("wgmma/products", !cubin ? "the probe did not compile" : !gpu ? "no GPU" : "the GPU is not a Hopper (sm_90)");
        free(cubin);
        return CHECK_DONE();
    }
    cudaLibrary_t lib;
    cudaKernel_t kern[3][2]; /* K 8, 32, 64; rs, ss */
    static const int ks[3] = {8, 32, 64};
    cudaError_t e = cudaLibraryLoadData(&lib, cubin, NULL, NULL, 0, NULL, NULL, 0);
    for (int i = 0; i < 3 && e == cudaSuccess; i++)
        for (int j = 0; j < 2 && e == cudaSuccess; j++) {
            char kname[40];
            snprintf(kname, sizeof kname, "mn_wg_probe_%s_k%d", j ? "ss" : "rs", ks[i]);
            e = cudaLibraryGetKernel(&kern[i][j], lib, kname);
        }
    free(cubin);
    if (e != cudaSuccess) {
        printf("FAIL wgmma/load: %s (%s)\n", cudaGetErrorString(e), cudaGetErrorName(e));
        return 1;
    }
    static const struct { int N, K; } shapes[] = {{64, 64}, {128, 32}, {128, 64}, {256, 64}, {64, 8}};
    mn_rng rng;
    mn_rng_seed(&rng, 14);
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int N = shapes[si].N, K = shapes[si].K;
        float *A = malloc((size_t)64 * K * sizeof(float)), *B = malloc((size_t)N * K * sizeof(float));
        double *want = malloc((size_t)64 * N * sizeof(double));
        if (!A || !B || !want) return 1;
        for (int i = 0; i < 64 * K; i++) A[i] = (float)((int)(mn_rng_u64(&rng) % 17) - 8) / 8.0f;
        for (int i = 0; i < N * K; i++) B[i] = (float)((int)(mn_rng_u64(&rng) % 17) - 8) / 8.0f;
        for (int m = 0; m < 64; m++)
            for (int n = 0; n < N; n++) {
                double s = 0.0;
                for (int q = 0; q < K; q++) s += (double)A[m * K + q] * B[n * K + q];
                want[m * N + n] = s;
            }
        for (int a_smem = 0; a_smem < 2; a_smem++) {
            char name[96];
            snprintf(name, sizeof name, "wgmma/tf32_%s_n%d_k%d", a_smem ? "ss" : "rs", N, K);
            const unsigned lbo = 128u, sbo = (unsigned)K * 32u; /* mn_wg_lbo, mn_wg_sbo */
            cudaKernel_t k = kern[K == 8 ? 0 : K == 32 ? 1 : 2][a_smem];
            const double err = run_probe(k, N, K, lbo, sbo, A, B, want, why, sizeof why);
            if (err == 0.0) {
                printf("PASS %s\n", name);
                continue;
            }
            check_failures_++;
            if (err < 0) {
                printf("FAIL %s: %s\n", name, why);
                continue;
            }
            const double swapped = run_probe(k, N, K, sbo, lbo, A, B, want, why, sizeof why);
            printf("FAIL %s: largest error %.6g (with LBO and SBO exchanged: %.6g)\n", name, err, swapped);
        }
        free(A);
        free(B);
        free(want);
    }
    (void)cudaLibraryUnload(lib);
    return CHECK_DONE();
#endif
}
