/* cli_run.c: `mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision P]
 * [--trace]` (SPEC.md section 6): one experiment file in, one result file out,
 * no Lua involved. Exit 0 on success, 2 on bad usage or bad input, 1 when the
 * run itself fails. */
#include "../model/experiment.h"
#include "../model/grad_files.h"
#include "../model/h5.h"
#include "../model/phase_timing.h"
#include "../model/progress.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/cuda.h"
#endif

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static const char run_usage[] =
    "usage: mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision fp32|tf32|bf16] [--trace] [--timing]\n"
    "  Runs the experiment file EXP.h5 (docs/files.md) and writes the result file RES.h5.\n"
    "  --device     engine to run on (default: cpu)\n"
    "  --precision  matrix precision (default fp32; tf32 and bf16 need cuda)\n"
    "  --trace      also write /trace (per-step mean loss and weight norm)\n"
    "  An experiment with /upstream also gets the run's backward (on the device where it covers the rule, else the cpu), written to /grads.\n"
    "  -q, --quiet  no progress line (it only shows on a terminal, for runs over a second)\n"
    "  --timing     print the time of each phase on stderr at the end (read inputs, upload, run,\n"
    "               write outputs, sync and rename, ...) with the megabytes moved and their rate\n";

/* Whether two paths name one file: same device and inode, so that "e.h5",
 * "./e.h5", a symbolic or a hard link are all caught. A path that does not
 * exist yet names no existing file. */
static bool same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    if (stat(a, &sa) != 0 || stat(b, &sb) != 0) return false;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "mnemo run: %s%s%s\n", msg, arg ? " " : "", arg ? arg : "");
    fprintf(stderr, "try 'mnemo run --help'\n");
    return 2;
}

/* The run after its arguments are checked, a phase of the timer at a time
 * (phase_timing.h: marks of a timer that is off record nothing). On cuda
 * the big inputs go from the file straight to the device while it is read
 * (h5.h's staged datasets), and the outputs come back the same way while the
 * result is written: "read inputs" includes their upload and "write
 * outputs" their download; "upload" is what is left (small datasets,
 * conversions). An experiment with /upstream keeps its inputs on the host,
 * where the backward takes them from (to the device, where it covers the
 * rule: model/grad.h). */
static int run_timed(const char *exp_path, const char *out_path, mn_device dev, const char *device,
                     const char *precision, bool trace, bool quiet, mn_phase_timer *timer)
{
    bool on_device = false; /* a usable device: its context made now, so that "run" holds no start-up */
#ifdef MN_HAVE_CUDA
    /* Only a cuda run needs the driver: a cpu run starts no faster with it.
     * Without a device every cuda request fails with the reason it records. */
    if (dev == MN_CUDA && mn_cuda_register()) {
        if (mn_cuda_ensure_device() != MN_OK) {
            fprintf(stderr, "mnemo run: %s: %s\n", exp_path, mn_last_error());
            return 2;
        }
        on_device = true;
        mn_phase_mark(timer, "device init", 0);
    }
#endif
    if (dev == MN_CPU && strcmp(precision, "fp32") != 0) {
        fprintf(stderr, "mnemo run: --precision %s: the cpu engine computes in fp32 only\n", precision);
        return 2;
    }

    mn_experiment e;
    mn_h5_io in = {.device = dev, .on_device = on_device ? mn_experiment_path_on_device : NULL};
    if (mn_experiment_load_io(exp_path, &e, &in) != MN_OK) {
        fprintf(stderr, "mnemo run: %s\n", mn_last_error());
        return 2;
    }
    mn_status s = MN_OK;
    if (e.upstream && in.staged_bytes > 0) s = mn_experiment_to_device(&e, MN_CPU, NULL);
    mn_phase_mark(timer, "read inputs", in.bytes);
    if (in.staged_bytes > 0 && !e.upstream) mn_phase_note(timer, "%.1f MB of it uploaded while reading", in.staged_bytes / 1e6);
    if (on_device && !e.upstream && s == MN_OK) {
        double up = 0;
        s = mn_experiment_to_device(&e, dev, &up);
        mn_phase_mark(timer, "upload", up);
    }
    if (s != MN_OK) {
        fprintf(stderr, "mnemo run: %s: %s\n", exp_path, mn_last_error());
        mn_experiment_free(&e);
        return s == MN_ERR_ARG || s == MN_ERR_DEVICE ? 2 : 1;
    }
    mn_memory_state final;
    mn_segment_outputs out;
    mn_precision prec = MN_PREC_FP32;
    (void)mn_precision_lookup(precision, &prec); /* checked above */
    if (!quiet) mn_progress_stderr_begin("mnemo run", e.rule.step);
    /* With /upstream on the cpu, the forward keeps the backward's checkpoints. */
    mn_run_checkpoints ck = {0};
    s = e.upstream && dev == MN_CPU ? mn_experiment_run_checkpointed(&e, &final, &out, &ck)
                                    : mn_experiment_run(&e, dev, prec, &final, &out);
#ifdef MN_HAVE_CUDA
    if (s == MN_OK && on_device && timer->on) s = mn_cuda_synchronize(); /* the kernels inside "run" */
#endif
    if (!quiet) mn_progress_stderr_end();
    mn_phase_mark(timer, "run", 0);
    if (s != MN_OK) {
        /* Shape and gate errors come from the engine: say which file. */
        fprintf(stderr, "mnemo run: %s: %s\n", exp_path, mn_last_error());
        mn_run_checkpoints_free(&ck);
        mn_experiment_free(&e);
        return s == MN_ERR_ARG || s == MN_ERR_DEVICE ? 2 : 1;
    }
    mn_node *root = NULL;
    s = mn_result_tree(&e.rule, e.rule_group, &final, &out, device, precision, trace, &root);
    mn_run_grads grads = {0};
    if (s == MN_OK && e.upstream) {
        s = mn_experiment_backward(&e, exp_path, dev, prec, ck.data ? &ck : NULL, &grads);
        if (s == MN_OK) s = mn_grads_to_tree(&e.rule, &grads, root);
        mn_phase_mark(timer, "backward", 0);
    }
    mn_h5_io res = {.timer = timer}; /* marks "write outputs" and "sync, rename" */
    if (s == MN_OK) s = mn_h5_save_io(out_path, root, &res);
    mn_run_grads_free(&grads);
    mn_run_checkpoints_free(&ck);
    if (s != MN_OK) fprintf(stderr, "mnemo run: %s\n", mn_last_error());
    mn_node_free(root);
    mn_segment_outputs_free(&out);
    mn_memory_free(&final);
    mn_experiment_free(&e);
    mn_phase_mark(timer, "clean up", 0);
    return s == MN_OK ? 0 : (s == MN_ERR_IO || s == MN_ERR_ARG ? 2 : 1);
}

int mn_cli_run(int argc, char **argv)
{
    const char *exp_path = NULL, *out_path = NULL, *device = "cpu", *precision = "fp32";
    bool trace = false, quiet = false, timing = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(run_usage, stdout);
            return 0;
        } else if (strcmp(a, "-o") == 0 || strcmp(a, "--output") == 0) {
            if (++i >= argc) return usage_error("-o needs a file name", NULL);
            out_path = argv[i];
        } else if (strcmp(a, "--device") == 0) {
            if (++i >= argc) return usage_error("--device needs cpu or cuda", NULL);
            device = argv[i];
        } else if (strcmp(a, "--precision") == 0) {
            if (++i >= argc) return usage_error("--precision needs fp32, tf32 or bf16", NULL);
            precision = argv[i];
        } else if (strcmp(a, "--trace") == 0) {
            trace = true;
        } else if (strcmp(a, "--timing") == 0) {
            timing = true;
        } else if (strcmp(a, "-q") == 0 || strcmp(a, "--quiet") == 0) {
            quiet = true;
        } else if (a[0] == '-' && a[1]) {
            return usage_error("unknown option", a);
        } else if (!exp_path) {
            exp_path = a;
        } else {
            return usage_error("unexpected argument", a);
        }
    }
    if (!exp_path) return usage_error("missing the experiment file", NULL);
    if (!out_path) return usage_error("missing -o RES.h5", NULL);
    /* The result replaces the output file; were it the experiment, the
     * inputs would be gone. Refuse before anything is read or written. */
    if (same_file(exp_path, out_path)) {
        fprintf(stderr, "mnemo run: -o %s is the experiment file %s itself (its inputs would be lost): "
                "write the result to another file\n", out_path, exp_path);
        return 2;
    }
    mn_device dev;
    if (strcmp(device, "cpu") == 0) dev = MN_CPU;
    else if (strcmp(device, "cuda") == 0) dev = MN_CUDA;
    else return usage_error("--device must be cpu or cuda, got", device);
    if (strcmp(precision, "fp32") != 0 && strcmp(precision, "tf32") != 0 && strcmp(precision, "bf16") != 0)
        return usage_error("--precision must be fp32, tf32 or bf16, got", precision);
    mn_phase_timer timer;
    mn_phase_timer_init(&timer, timing);
    int rc = run_timed(exp_path, out_path, dev, device, precision, trace, quiet, &timer);
    mn_phase_report(&timer, stderr);
    return rc;
}
