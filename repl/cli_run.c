/* cli_run.c: `mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision P]
 * [--trace]` (SPEC.md section 6): one experiment file in, one result file out,
 * no Lua involved. Exit 0 on success, 2 on bad usage or bad input, 1 when the
 * run itself fails. */
#include "../model/experiment.h"
#include "../model/grad_files.h"
#include "../model/h5.h"
#include "../model/progress.h"
#ifdef MN_HAVE_CUDA
#include "../kernels/cuda.h"
#endif

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static const char run_usage[] =
    "usage: mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision fp32|tf32|bf16] [--trace]\n"
    "  Runs the experiment file EXP.h5 (docs/files.md) and writes the result file RES.h5.\n"
    "  --device     engine to run on (default: cpu)\n"
    "  --precision  matrix precision (default fp32; tf32 and bf16 need cuda)\n"
    "  --trace      also write /trace (per-step mean loss and weight norm)\n"
    "  An experiment with /upstream also gets the run's backward (on the device where it covers the rule, else the cpu), written to /grads.\n"
    "  -q, --quiet  no progress line (it only shows on a terminal, for runs over a second)\n";

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

int mn_cli_run(int argc, char **argv)
{
    const char *exp_path = NULL, *out_path = NULL, *device = "cpu", *precision = "fp32";
    bool trace = false, quiet = false;
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
#ifdef MN_HAVE_CUDA
    /* Only a cuda run needs the driver: a cpu run starts no faster with it.
     * Without a device every cuda request fails with the reason it records. */
    if (dev == MN_CUDA) mn_cuda_register();
#endif
    if (dev == MN_CPU && strcmp(precision, "fp32") != 0) {
        fprintf(stderr, "mnemo run: --precision %s: the cpu engine computes in fp32 only\n", precision);
        return 2;
    }

    mn_experiment e;
    if (mn_experiment_load(exp_path, &e) != MN_OK) {
        fprintf(stderr, "mnemo run: %s\n", mn_last_error());
        return 2;
    }
    mn_memory_state final;
    mn_segment_outputs out;
    mn_precision prec = MN_PREC_FP32;
    (void)mn_precision_lookup(precision, &prec); /* checked above */
    if (!quiet) mn_progress_stderr_begin("mnemo run", e.rule.step);
    /* With /upstream on the cpu, the forward keeps the backward's checkpoints. */
    mn_run_checkpoints ck = {0};
    mn_status s = e.upstream && dev == MN_CPU ? mn_experiment_run_checkpointed(&e, &final, &out, &ck)
                                              : mn_experiment_run(&e, dev, prec, &final, &out);
    if (!quiet) mn_progress_stderr_end();
    if (s != MN_OK) {
        /* Shape and gate errors come from the engine: say which file. */
        fprintf(stderr, "mnemo run: %s: %s\n", exp_path, mn_last_error());
        mn_experiment_free(&e);
        return s == MN_ERR_ARG || s == MN_ERR_DEVICE ? 2 : 1;
    }
    mn_node *root = NULL;
    s = mn_result_tree(&e.rule, e.rule_group, &final, &out, device, precision, trace, &root);
    mn_run_grads grads = {0};
    if (s == MN_OK && e.upstream) {
        s = mn_experiment_backward(&e, exp_path, dev, ck.data ? &ck : NULL, &grads);
        if (s == MN_OK) s = mn_grads_to_tree(&e.rule, &grads, root);
    }
    if (s == MN_OK) s = mn_h5_save(out_path, root);
    mn_run_grads_free(&grads);
    mn_run_checkpoints_free(&ck);
    if (s != MN_OK) fprintf(stderr, "mnemo run: %s\n", mn_last_error());
    mn_node_free(root);
    mn_segment_outputs_free(&out);
    mn_memory_free(&final);
    mn_experiment_free(&e);
    return s == MN_OK ? 0 : (s == MN_ERR_IO || s == MN_ERR_ARG ? 2 : 1);
}
