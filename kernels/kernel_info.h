/* kernel_info.h: what the generated kernels use and how long they take.
 *   Resources, without a GPU: NVRTC compiles with ptxas -v, whose log says
 *   per kernel its registers, static shared memory, stack frame and spill
 *   bytes; the PTX says the launch bounds (.maxntid). Parsed here
 *   (kernels/kernel_info.c), kept beside the CUBIN cache (kernels/nvrtc.c).
 *   On a GPU, the driver's attributes of the loaded kernel and its occupancy
 *   at the block size the engine launches with (kernels/engine_cuda.c).
 *   Per-launch GPU times: when profiling is switched on, the engine times
 *   each launch with a pair of CUDA events into a small ring and per-kernel
 *   totals; off by default, so the hot path records no events.
 * Plain C, no CUDA types. */
#ifndef MN_KERNEL_INFO_H
#define MN_KERNEL_INFO_H

#include "../model/engine.h"

#define MN_KERNEL_NAME_MAX 64
#define MN_KERNEL_INFO_MAX 8 /* kernels of one module */

/* One kernel. Sizes in bytes; -1 where ptxas did not say (a log that is not
 * ptxas's, or a line format it changed). */
typedef struct mn_kernel_info {
    char name[MN_KERNEL_NAME_MAX];
    int registers;        /* per thread */
    long shared_bytes;    /* static shared memory per block */
    long stack_bytes;     /* stack frame per thread */
    long spill_stores;    /* per thread */
    long spill_loads;
    int barriers;
    int max_threads;      /* launch bounds (.maxntid x*y*z), 0 when it has none */
    /* from the driver, on a GPU (mn_cuda_rule_kernel_occupancy); else 0 */
    bool on_device;
    int device_registers, device_max_threads;
    long device_shared_bytes, device_local_bytes;
    int block_threads;    /* the block size the engine launches with */
    int blocks_per_sm;    /* resident blocks per SM at that size */
    int warps_per_sm, max_warps_per_sm;
    double occupancy;     /* warps_per_sm / max_warps_per_sm */
    int sms;              /* multiprocessors of the device */
    int active_clusters;  /* a cluster kernel: clusters resident on the device at once (its wave), else 0 */
} mn_kernel_info;

/* The kernels of one compiled module. */
typedef struct mn_kernel_set {
    char key[33];         /* the CUBIN cache key (kernels/nvrtc.h) */
    int arch;             /* 90 for sm_90 */
    double compile_ms;    /* NVRTC's time for the compile that produced it */
    bool cached;          /* this request compiled nothing (memory or disk) */
    char step_kernel[48]; /* the kernel that walks the steps on the rule's path (kernels/plan.h) */
    char path[16];        /* general, fused or large */
    int cluster;          /* fused: blocks a memory (a cluster on sm_90; kernels/plan.h), else 1 */
    int n;
    mn_kernel_info k[MN_KERNEL_INFO_MAX];
} mn_kernel_set;

/* Parse a ptxas -v log ("Compiling entry function 'k' for 'sm_90'", "Used
 * 40 registers, used 1 barriers, 256 bytes smem", "0 bytes stack frame, 0
 * bytes spill stores, 0 bytes spill loads"; older and newer orders of the
 * items alike) into out[0..max): entry functions only, in log order.
 * Returns how many; *arch (when not NULL) gets the sm of the first. */
int mn_ptxas_parse(const char *log, mn_kernel_info *out, int max, int *arch);
/* Launch bounds from PTX (".entry name(" ... ".maxntid 256, 1, 1") into
 * max_threads of the kernels named in k[0..n). */
void mn_ptx_launch_bounds(const char *ptx, mn_kernel_info *k, int n);
/* The kernel named name in set, or NULL. */
mn_kernel_info *mn_kernel_set_find(mn_kernel_set *set, const char *name);

/* The kernels the GPU engine would run for rule r at dims d and precision p,
 * compiled for arch (0: the device's own, else sm_90): from the cache, or
 * compiled now with NVRTC (no GPU needed). On a usable GPU whose arch is
 * arch, also the driver's attributes and the occupancy at the engine's block
 * size (the module is loaded, as a run would load it). */
mn_status mn_cuda_rule_kernel_info(const mn_rule *r, const mn_dims *d, mn_precision p, int arch, mn_kernel_set *out);
/* That GPU part alone (kernels/engine_cuda.c): fills the device fields of
 * the kernels of set; MN_ERR_DEVICE without a usable device. */
mn_status mn_cuda_rule_kernel_occupancy(const mn_rule *r, const mn_dims *d, mn_precision p, mn_kernel_set *set);

/* ---- per-launch GPU times (kernels/engine_cuda.c) ---- */

#define MN_PROFILE_RING 64
#define MN_PROFILE_KERNELS 32

/* A launch: its kernel ("mn_rule_step_kernel [1a2b3c4d]": the function and
 * the start of its module's cache key), GPU milliseconds, grid and block. */
typedef struct mn_kernel_launch {
    char name[48];
    double ms;
    unsigned grid[3], block[3];
} mn_kernel_launch;

/* Totals per kernel name since the process started. */
typedef struct mn_kernel_total {
    char name[48];
    long long calls;
    double ms;
    unsigned grid[3], block[3]; /* of its last launch */
} mn_kernel_total;

/* Switch timing on or off. On needs a usable device (it creates the two
 * events once); off is always fine. */
mn_status mn_cuda_profile_set(bool on);
bool mn_cuda_profile_on(void);
/* The last launches recorded (at most MN_PROFILE_RING), oldest first, into
 * out[0..max); returns how many. *total (when not NULL) gets the number
 * recorded since the process started. */
int mn_cuda_profile_recent(mn_kernel_launch *out, int max, long long *total);
/* The totals, one per kernel name (at most MN_PROFILE_KERNELS names; later
 * names share the last slot, "(other kernels)"); returns how many. */
int mn_cuda_profile_totals(mn_kernel_total *out, int max);

#endif
