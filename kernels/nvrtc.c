/* nvrtc.c: NVRTC compilation of generated kernels, the disk cache of their
 * CUBINs, and the kernels' resources as ptxas reported them, kept in memory
 * and beside each CUBIN (kernels/nvrtc.h). Only NVRTC and the C library: no
 * CUDA runtime here, so CI compiles generated source without a GPU or driver. */
#include "nvrtc.h"

#include <nvrtc.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The message of the buffer is 2 KB: the start of a log says what failed. */
#define LOG_IN_MESSAGE 1500

static mn_status nvrtc_status(nvrtcResult r, const char *call, const char *file, int line)
{
    if (r == NVRTC_SUCCESS) return MN_OK;
    return mn_fail(MN_ERR_DEVICE, "nvrtc: %s in %s at %s:%d", nvrtcGetErrorString(r), call, file, line);
}
#define NVRTC_ST(call) nvrtc_status((call), #call, __FILE__, __LINE__)

int mn_nvrtc_version(void)
{
    int major = 0, minor = 0;
    if (nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return 0;
    return 1000 * major + 10 * minor;
}

/* -default-device: every function is a device function, so the generated
 * text needs no __device__ on helpers; no host headers are needed.
 * --ptxas-options=-v: the log reports each kernel's registers, shared
 * memory, stack and spills (rule:kernel_info) at no cost to the code.
 * The fast tier adds --Ofast-compile=mid: NVVM and ptxas skip the costly
 * optimisations (most inlining, register promotion of the tiles), about a
 * third of the full compile's time for P1's fused kernel, for a kernel about
 * 4x slower. Both tiers compile the same float operations (no fast-math,
 * the same contraction): on an H100 their outputs and gradients were equal
 * to the bit (tests/gpu/same_bits.sh). */
#define N_OPTIONS 6
static int options_of(int arch, mn_tier tier, char arch_opt[32], const char *opts[N_OPTIONS])
{
    snprintf(arch_opt, 32, "--gpu-architecture=sm_%d", arch);
    opts[0] = arch_opt;
    opts[1] = "-default-device";
    opts[2] = "--std=c++17";
    opts[3] = "-lineinfo";
    opts[4] = "--ptxas-options=-v";
    opts[5] = "--Ofast-compile=mid";
    return tier == MN_TIER_FAST ? 6 : 5;
}

const char *mn_nvrtc_options(int arch, mn_tier tier, char *buf, size_t len)
{
    char arch_opt[32];
    const char *opts[N_OPTIONS];
    int n = options_of(arch, tier, arch_opt, opts), at = 0;
    buf[0] = 0;
    for (int i = 0; i < n && at >= 0 && (size_t)at < len; i++)
        at += snprintf(buf + at, len - (size_t)at, "%s%s", i ? " " : "", opts[i]);
    return buf;
}

/* NVRTC 12.9 and later keep compiles in a cache of their own: a hit skips
 * ptxas, and its -v report is missing from the log (on the lent H100s, the
 * second compile of a source in a fresh MNEMO_CACHE took 60 ms and reported
 * no kernel). --no-cache (not part of the cache key: the same CUBIN) asks
 * for the whole compile where the report is what is wanted. */
#define NVRTC_NO_CACHE_SINCE 12090

/* ---- the key: two unrelated 64-bit hashes of the same bytes ---- */

typedef struct { uint64_t a, b; } hash128;

/* Eight bytes a round (every run hashes its ~100 KB source to find its
 * loaded module: byte by byte that was 0.2-0.3 ms of a run's host time on
 * the H100 machine), the tail a byte at a time. */
static void hash_bytes(hash128 *h, const void *data, size_t n)
{
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h->a = (h->a ^ w) * 0x100000001b3ULL;
        h->a ^= h->a >> 32;
        h->b = (h->b ^ w) * 0x9e3779b97f4a7c15ULL;
        h->b = (h->b << 29) | (h->b >> 35);
    }
    for (; i < n; i++) {
        h->a = (h->a ^ p[i]) * 0x100000001b3ULL;
        h->b = (h->b ^ p[i]) * 0x9e3779b97f4a7c15ULL;
        h->b = (h->b << 29) | (h->b >> 35);
    }
}

static uint64_t mix64(uint64_t x) /* splitmix64's finaliser */
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

void mn_cuda_cache_key(const char *src, const char *options, int arch, int nvrtc_version, char out[33])
{
    hash128 h = {0xcbf29ce484222325ULL, 0x243f6a8885a308d3ULL};
    char tail[64];
    /* lengths first: no two (src, options) pairs give the same byte stream */
    int tn = snprintf(tail, sizeof tail, "|%zu|%zu|sm_%d|nvrtc %d", strlen(src), strlen(options), arch, nvrtc_version);
    hash_bytes(&h, src, strlen(src));
    hash_bytes(&h, options, strlen(options));
    hash_bytes(&h, tail, (size_t)tn);
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)mix64(h.a), (unsigned long long)mix64(h.b ^ h.a));
}

/* ---- compiling ---- */

static char *program_log(nvrtcProgram prog)
{
    size_t n = 0;
    if (nvrtcGetProgramLogSize(prog, &n) != NVRTC_SUCCESS || n <= 1) return NULL;
    char *log = malloc(n);
    if (log && nvrtcGetProgramLog(prog, log) != NVRTC_SUCCESS) {
        free(log);
        return NULL;
    }
    return log;
}

static char *program_ptx(nvrtcProgram prog)
{
    size_t n = 0;
    if (nvrtcGetPTXSize(prog, &n) != NVRTC_SUCCESS || n <= 1) return NULL;
    char *ptx = malloc(n);
    if (ptx && nvrtcGetPTX(prog, ptx) != NVRTC_SUCCESS) {
        free(ptx);
        return NULL;
    }
    return ptx;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e3 * (double)t.tv_sec + 1e-6 * (double)t.tv_nsec;
}

/* Compile src; on success *cubin (when wanted) gets the CUBIN, and *info
 * (when wanted) the kernels' resources from the log and the PTX. */
static mn_status compile(const char *src, int arch, mn_tier tier, bool no_cache, char **log_out, void **cubin,
                         size_t *size, mn_kernel_set *info)
{
    if (log_out) *log_out = NULL;
    if (arch < 50) return mn_fail(MN_ERR_DEVICE, "nvrtc: no device architecture to compile for (sm_%d)", arch);
    nvrtcProgram prog;
    MN_TRY(NVRTC_ST(nvrtcCreateProgram(&prog, src, "mnemo_rule.cu", 0, NULL, NULL)));
    char arch_opt[32];
    const char *opts[N_OPTIONS + 1];
    int nopts = options_of(arch, tier, arch_opt, opts);
    if (no_cache && mn_nvrtc_version() >= NVRTC_NO_CACHE_SINCE) opts[nopts++] = "--no-cache";
    double t0 = now_ms();
    nvrtcResult res = nvrtcCompileProgram(prog, nopts, opts);
    double ms = now_ms() - t0;
    char *log = program_log(prog);
    mn_status st = MN_OK;
    if (res != NVRTC_SUCCESS) {
        st = mn_fail(MN_ERR_DEVICE, "nvrtc: the generated kernel did not compile for sm_%d (%s):\n%.*s%s", arch,
                     nvrtcGetErrorString(res), LOG_IN_MESSAGE, log ? log : "(no log)",
                     log && strlen(log) > LOG_IN_MESSAGE ? "\n[log cut; print the source with rule:source()]" : "");
    } else if (cubin) {
        size_t n = 0;
        st = NVRTC_ST(nvrtcGetCUBINSize(prog, &n));
        if (st == MN_OK) {
            *cubin = malloc(n);
            if (!*cubin) st = mn_fail(MN_ERR_OOM, "nvrtc: out of memory for a %zu-byte CUBIN", n);
        }
        if (st == MN_OK) st = NVRTC_ST(nvrtcGetCUBIN(prog, *cubin));
        if (st == MN_OK) *size = n;
        else if (*cubin) {
            free(*cubin);
            *cubin = NULL;
        }
    }
    if (st == MN_OK && info) {
        memset(info, 0, sizeof *info);
        info->arch = arch;
        info->compile_ms = ms;
        info->n = log ? mn_ptxas_parse(log, info->k, MN_KERNEL_INFO_MAX, NULL) : 0;
        char *ptx = program_ptx(prog);
        mn_ptx_launch_bounds(ptx, info->k, info->n);
        free(ptx);
    }
    (void)nvrtcDestroyProgram(&prog);
    if (log_out) *log_out = log;
    else free(log);
    return st;
}

mn_status mn_cuda_compile_check(const char *src, int arch, char **log)
{
    return compile(src, arch, MN_TIER_FULL, true, log, NULL, NULL, NULL); /* the log with ptxas's report */
}

/* ---- the disk cache ---- */

/* The cache directory, created if missing; false when there is none. */
static bool cache_dir(char *buf, size_t len)
{
    const char *root = getenv("MNEMO_CACHE");
    int n;
    if (root && root[0]) n = snprintf(buf, len, "%s/kernels", root);
    else {
        const char *home = getenv("HOME");
        if (!home || !home[0]) return false;
        n = snprintf(buf, len, "%s/.cache/mnemo/kernels", home);
    }
    if (n < 0 || (size_t)n >= len) return false;
    for (char *p = buf + 1; *p; p++) { /* mkdir -p */
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
            *p = '/';
            return false;
        }
        *p = '/';
    }
    return mkdir(buf, 0755) == 0 || errno == EEXIST;
}

static bool read_file(const char *path, void **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    bool ok = fseek(f, 0, SEEK_END) == 0;
    long n = ok ? ftell(f) : -1;
    ok = n > 0 && fseek(f, 0, SEEK_SET) == 0;
    char *buf = ok ? malloc((size_t)n) : NULL;
    ok = buf && fread(buf, 1, (size_t)n, f) == (size_t)n;
    fclose(f);
    if (!ok) {
        free(buf);
        return false;
    }
    *data = buf;
    *size = (size_t)n;
    return true;
}

/* Write then rename: a concurrent reader sees the old file or the whole new
 * one (the background compile's child may write the same key). */
static void write_file(const char *path, const void *data, size_t size)
{
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) return;
    FILE *f = fopen(tmp, "wb");
    if (!f) return;
    bool ok = fwrite(data, 1, size, f) == size;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

/* ---- kernel resources: in memory by key, and <key>.info beside the CUBIN ---- */

typedef struct info_entry {
    mn_kernel_set set;
    struct info_entry *next;
} info_entry;

static info_entry *infos;

static void remember(const mn_kernel_set *set)
{
    if (set->n == 0) return; /* no report (NVRTC's cache): nothing to recall */
    info_entry *e = infos;
    while (e && strcmp(e->set.key, set->key) != 0) e = e->next;
    if (!e) {
        if (!(e = calloc(1, sizeof *e))) return; /* only a cache */
        e->next = infos;
        infos = e;
    }
    e->set = *set;
}

static bool recall(const char *key, mn_kernel_set *out)
{
    for (info_entry *e = infos; e; e = e->next)
        if (strcmp(e->set.key, key) == 0) {
            *out = e->set;
            return true;
        }
    return false;
}

#define INFO_HEADER "mnemo kernel info 1\n"

static void write_info(const char *path, const mn_kernel_set *set)
{
    char buf[256 * (MN_KERNEL_INFO_MAX + 1)];
    int n = snprintf(buf, sizeof buf, INFO_HEADER "arch %d\ncompile_ms %.3f\n", set->arch, set->compile_ms);
    for (int i = 0; i < set->n && n > 0 && (size_t)n < sizeof buf; i++) {
        const mn_kernel_info *k = &set->k[i];
        n += snprintf(buf + n, sizeof buf - (size_t)n,
                      "kernel %s registers %d shared %ld stack %ld spill_stores %ld spill_loads %ld barriers %d "
                      "max_threads %d\n",
                      k->name, k->registers, k->shared_bytes, k->stack_bytes, k->spill_stores, k->spill_loads,
                      k->barriers, k->max_threads);
    }
    if (n > 0 && (size_t)n < sizeof buf) write_file(path, buf, (size_t)n);
}

/* False for a missing or malformed file (then the caller compiles). */
static bool read_info(const char *path, mn_kernel_set *out)
{
    void *data = NULL;
    size_t size = 0;
    if (!read_file(path, &data, &size)) return false;
    char *text = realloc(data, size + 1);
    if (!text) {
        free(data);
        return false;
    }
    text[size] = 0;
    memset(out, 0, sizeof *out);
    bool ok = strncmp(text, INFO_HEADER, strlen(INFO_HEADER)) == 0;
    int fields = 0;
    for (char *line = text + strlen(INFO_HEADER); ok && line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        mn_kernel_info *k = &out->k[out->n];
        if (sscanf(line, "arch %d", &out->arch) == 1 || sscanf(line, "compile_ms %lf", &out->compile_ms) == 1) fields++;
        else if (out->n < MN_KERNEL_INFO_MAX &&
                 sscanf(line, "kernel %63s registers %d shared %ld stack %ld spill_stores %ld spill_loads %ld "
                              "barriers %d max_threads %d",
                        k->name, &k->registers, &k->shared_bytes, &k->stack_bytes, &k->spill_stores, &k->spill_loads,
                        &k->barriers, &k->max_threads) == 8)
            out->n++;
        else ok = false;
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return ok && fields == 2 && out->n > 0;
}

void mn_nvrtc_key(const char *src, int arch, mn_tier tier, char key[33])
{
    char opts[256];
    mn_cuda_cache_key(src, mn_nvrtc_options(arch, tier, opts, sizeof opts), arch, mn_nvrtc_version(), key);
}

/* <cache dir>/<key>.<ext>, or false where there is no cache directory. */
static bool cache_path(const char *key, const char *ext, char *path, size_t len)
{
    char dir[4096];
    return cache_dir(dir, sizeof dir) && snprintf(path, len, "%s/%s.%s", dir, key, ext) < (int)len;
}

/* A compile's CUBIN and its kernels' resources into the cache (skipped
 * where there is none). */
static void cache_write(const char *key, const void *cubin, size_t size, const mn_kernel_set *info)
{
    char path[4200];
    if (!cache_path(key, "cubin", path, sizeof path)) return;
    write_file(path, cubin, size);
    if (info->n > 0 && cache_path(key, "info", path, sizeof path)) write_info(path, info); /* else no report */
}

bool mn_nvrtc_cache_writable(void)
{
    char dir[4096];
    return cache_dir(dir, sizeof dir) && access(dir, W_OK) == 0;
}

bool mn_nvrtc_cache_file(const char key[33], const char *ext, char *path, size_t len)
{
    return cache_path(key, ext, path, len);
}

bool mn_nvrtc_in_cache(const char key[33])
{
    char path[4200];
    struct stat st;
    return cache_path(key, "cubin", path, sizeof path) && stat(path, &st) == 0 && st.st_size > 0;
}

bool mn_nvrtc_read_cached(const char key[33], void **cubin, size_t *size)
{
    char path[4200];
    return cache_path(key, "cubin", path, sizeof path) && read_file(path, cubin, size);
}

mn_status mn_nvrtc_cubin(const char *src, int arch, mn_tier tier, bool fresh, char key[33], void **cubin,
                         size_t *size)
{
    mn_nvrtc_key(src, arch, tier, key);
    if (!fresh && mn_nvrtc_read_cached(key, cubin, size)) return MN_OK;
    mn_kernel_set info;
    MN_TRY(compile(src, arch, tier, false, NULL, cubin, size, &info));
    memcpy(info.key, key, sizeof info.key);
    remember(&info);
    cache_write(key, *cubin, *size, &info);
    return MN_OK;
}

mn_status mn_nvrtc_kernel_info(const char *src, int arch, mn_kernel_set *out)
{
    char path[4200], key[33];
    mn_nvrtc_key(src, arch, MN_TIER_FULL, key);
    if (recall(key, out)) {
        out->cached = true;
        return MN_OK;
    }
    if (cache_path(key, "info", path, sizeof path) && read_info(path, out)) {
        memcpy(out->key, key, sizeof out->key);
        remember(out);
        out->cached = true;
        return MN_OK;
    }
    void *cubin = NULL;
    size_t size = 0;
    MN_TRY(compile(src, arch, MN_TIER_FULL, false, NULL, &cubin, &size, out));
    if (out->n == 0) { /* NVRTC's own cache served it: no report; once more, whole */
        free(cubin);
        cubin = NULL;
        MN_TRY(compile(src, arch, MN_TIER_FULL, true, NULL, &cubin, &size, out));
    }
    memcpy(out->key, key, sizeof out->key);
    out->cached = false;
    remember(out);
    cache_write(key, cubin, size, out); /* the CUBIN too: a run of the same rule then loads it */
    free(cubin);
    return MN_OK;
}
