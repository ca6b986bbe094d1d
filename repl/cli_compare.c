/* cli_compare.c: the `mnemo compare A.h5 B.h5 [options]` subcommand: argument
 * handling, loading both files, printing the table of model/compare.h.
 * Exit status: 0 all passed, 1 any failed, 2 bad usage or unreadable input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/compare.h"
#include "../model/h5.h"
#include "cli.h"

static const char usage[] =
    "usage: mnemo compare A.h5 B.h5 [--rtol X] [--atol X] [--all] [-q]\n"
    "Compares the datasets of A with those of B, the reference, one row each:\n"
    "shape, max abs error, relative L2 error |A - B| / |B| (|A - B| where\n"
    "|B| = 0), status. When both are mnemo result files only /outputs, /final\n"
    "and /grads are compared, otherwise every dataset. Attributes (/rule, engine,\n"
    "precision, ...) are not compared. Where B holds NaN or Inf, A must hold a\n"
    "non-finite value (NaN or Inf) at the same places, and a non-finite value in\n"
    "A where B is finite fails.\n"
    "  --rtol X    pass when rel_l2 <= X (default 1e-05, the fp32 bound)\n"
    "  --atol X    pass also when max_abs <= X (default 0)\n"
    "  --all       compare every dataset, even in result files\n"
    "  -q          print only the failed rows and the summary\n"
    "  -h, --help  this text\n"
    "Exit status: 0 all passed, 1 any failed, 2 bad usage or unreadable input.\n";

static int usage_error(const char *fmt, const char *what)
{
    fputs("mnemo compare: ", stderr);
    fprintf(stderr, fmt, what);
    fputs(" (see mnemo compare --help)\n", stderr);
    return 2;
}

/* A tolerance: a finite number >= 0, the whole string. */
static bool parse_tol(const char *s, double *out)
{
    char *end;
    if (!s || !*s) return false;
    double x = strtod(s, &end);
    if (*end || !(x >= 0) || x > 1e300) return false;
    *out = x;
    return true;
}

static mn_status load(const char *path, mn_node **out)
{
    mn_status st = mn_h5_load(path, out);
    /* The one-line error must name the file, whatever the loader said. */
    if (st != MN_OK && !strstr(mn_last_error(), path)) mn_fail_context(st, "%s: ", path);
    return st;
}

int mn_cli_compare(int argc, char **argv)
{
    mn_compare_options opt = MN_COMPARE_DEFAULTS;
    const char *files[2] = { NULL, NULL };
    int nfiles = 0;
    bool quiet = false, options_done = false;

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (options_done || arg[0] != '-' || arg[1] == 0) {
            if (nfiles == 2) return usage_error("too many arguments at '%s'; expected A.h5 B.h5", arg);
            files[nfiles++] = arg;
            continue;
        }
        if (!strcmp(arg, "--")) {
            options_done = true;
        } else if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            fputs(usage, stdout);
            return 0;
        } else if (!strcmp(arg, "-q") || !strcmp(arg, "--quiet")) {
            quiet = true;
        } else if (!strcmp(arg, "--all")) {
            opt.all = true;
        } else if (!strncmp(arg, "--rtol", 6) || !strncmp(arg, "--atol", 6)) {
            const char *val;
            char name[8];
            snprintf(name, sizeof name, "%.6s", arg);
            if (arg[6] == '=') val = arg + 7;
            else if (arg[6] == 0) val = i + 1 < argc ? argv[++i] : NULL;
            else return usage_error("unknown option '%s'", arg);
            if (!val) return usage_error("%s needs a number", name);
            double *dst = name[2] == 'r' ? &opt.rtol : &opt.atol;
            if (!parse_tol(val, dst)) {
                fprintf(stderr, "mnemo compare: %s: '%s' is not a number >= 0\n", name, val);
                return 2;
            }
        } else {
            return usage_error("unknown option '%s'", arg);
        }
    }
    if (nfiles < 2) return usage_error("%s", nfiles ? "needs a second file, B.h5" : "needs two files, A.h5 B.h5");

    mn_node *a = NULL, *b = NULL;
    mn_compare_report rep;
    mn_status st = load(files[0], &a);
    if (st == MN_OK) st = load(files[1], &b);
    if (st == MN_OK) st = mn_compare_trees(a, b, &opt, &rep);
    if (a) mn_node_free(a);
    if (b) mn_node_free(b);
    if (st != MN_OK) {
        fprintf(stderr, "mnemo compare: %s\n", mn_last_error());
        return 2;
    }
    mn_compare_print(stdout, &rep, files[0], files[1], quiet);
    int rc = mn_compare_passed(&rep) ? 0 : 1;
    mn_compare_report_free(&rep);
    return rc;
}
