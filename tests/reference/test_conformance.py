#!/usr/bin/env python3
"""Conformance: random experiments through `mnemo run` against the Python
reference (SPEC.md sections 2-5 and 7), compared with `mnemo compare` (the
forward) and per /grads tensor here (the gradients).

Runs COUNT random configurations from gen_experiments.py (every axis of the
SPEC) plus the fixed configurations in regressions.txt (each once failed), on
the device and precision given, and prints one PASS/FAIL line per
configuration, and for each configuration with /upstream (about 85% of them)
one more line, LABEL/grads: every /grads tensor against the reference's at
SPEC.md section 3's gradient bound (relative L2 per tensor, non-finite values at the
same places), or SKIP when mnemo wrote no /grads. A failure prints the
configuration and the failing rows.

Precision (SPEC.md section 3): fp32 holds every rule to the bounds. In tf32
and bf16, a rule with a kink that rounding can flip (kinked_rule: l1, huber,
lp with p < 2, relu, value clips, custom expressions with abs, sign, min,
max, relu, where or comparisons) is held to the bounds only when its widths
(dk, dv and the hidden width) are all >= 16; on smaller ones the outputs,
final tensors and gradients are checked for finiteness and NaN placement.

A gradient tensor (or, in the same way, a forward output or final tensor)
that is sensitive to rounding, i.e. whose float32 rerun of
the reference (torch, the same algorithm) is off by more than a tenth of the
fp32 bound, is held to ten times that error instead (the PASS line names it):
a tensor can cancel to rounding noise, for example theta's gradient when an
active norm clip with one token per step makes the update independent of
theta's scale. A wrong gradient is still off by far more. In tf32 and bf16,
a forward tensor that the float64 reference itself moves by more than half
the bound when its products round their operands to that format
(mnemo_ref.rounded_products) is held to the bound against that rounded
reference instead: the format's error on this rule is not the engine's.
A gradient tensor that this rounding moves by more than half the bound is
held to twice that move: through the second derivatives a kinked loss or
activation turns a rounding into a jump that no two implementations make
alike, so the engine cannot be held to the rounded reference itself, but
a wrong gradient is still off by far more.
Also in tf32 and bf16, newton_schulz on a step with fewer rows than a
weight matrix's smaller side (ns_rank_deficient) is held to the bounds, and
where it misses them, to finiteness and NaN placement (the PASS line says
so): the iteration lifts the format's rounding in the gradient's missing
directions to O(1), differently for each implementation.

Environment (all optional):
  MNEMO                       the binary (default ./mnemo)
  MNEMO_CONFORMANCE_SEED      generator seed (default 1); printed for replay
  MNEMO_CONFORMANCE_COUNT     number of random configurations (default 200)
  MNEMO_CONFORMANCE_MAX_T     longest sequence (default 64)
  MNEMO_CONFORMANCE_WIDE      more configurations with every width in [16, 32]
                              (default 20): where tf32 and bf16 hold kinked
                              rules to the bounds
  MNEMO_CONFORMANCE_SHARD     k/n: only the configurations whose place in
                              the list is k modulo n (0 <= k < n), so that
                              n processes share one run (each is CPU-bound
                              on the reference); labels are unchanged
  MNEMO_CONFORMANCE_CLUSTER   N (2, 4 or 8; cuda): only the configurations
                              that the fused kernel splits over a cluster of
                              N blocks when asked (2 layers, a hidden width
                              divisible by N, no glu or precondition), run
                              with MNEMO_FUSED_CLUSTER=N;
                              the others are left out, not counted
  MNEMO_DEVICE                cpu (default) or cuda
  MNEMO_PRECISION             fp32 (default), tf32 or bf16; sets the bounds of
                              SPEC.md section 3 (outputs 1e-5, 5e-3, 3e-2;
                              gradients 1e-4, 1e-2, 5e-2)
  MNEMO_CONFORMANCE_V2        1: the generator's SPEC v2 options (glu,
                              out_norm, qk_norm, precondition, lengths) in
                              its files; 0: the same files without them.
                              Default: 1 on the cpu; on cuda the options
                              the CUDA engine runs (CUDA_V2 below; with
                              MNEMO_CUDA_PATH=fused or large, without those
                              that path does not run)
The CUDA engine of this version runs every v2 option: qk_norm on every
path; glu on the general and large paths; out_norm on the general and
fused paths; precondition and lengths on the general path only. So with
MNEMO_CUDA_PATH=fused the files leave out glu, precondition and lengths,
and with MNEMO_CUDA_PATH=large out_norm, precondition and lengths. With
MNEMO_CONFORMANCE_V2=1 on cuda and a fast path forced, a configuration with
an option that path does not run runs with --device cpu in fp32 and its
PASS line says so (cuda_pinned below).

Replay one configuration: gen_experiments.py --seed S --count N+1 --out D
(with --min-width 16 for one labelled wide16/), then `mnemo run
D/exp_0000N.h5 -o r.h5` and `mnemo_ref.py` on the same file.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import h5py  # noqa: E402
import torch  # noqa: E402

import gen_experiments  # noqa: E402
import mnemo_expr  # noqa: E402
import mnemo_ref  # noqa: E402

RTOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 3e-2}
GRAD_RTOL = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 5e-2}
KINK_WIDTH = 16           # kinked rules are held to the bounds from this width on
KINK_FUNCTIONS = ("abs", "sign", "min", "max", "relu", "where")


# ---------------------------------------------------------------------------
# Which rules have a kink that rounding can flip (SPEC.md section 3)
# ---------------------------------------------------------------------------

def _expr_kinks(src):
    """The kinked parts of an expression: functions of KINK_FUNCTIONS it calls
    and comparisons it makes, from its syntax tree (not from a substring
    search, which would see 'max' in a constant named 'max1')."""
    found = []

    def walk(node):
        kind = node[0]
        if kind == "cmp":
            found.append("comparison " + node[1])
            walk(node[2])
            walk(node[3])
        elif kind == "call":
            if node[1] in KINK_FUNCTIONS:
                found.append(node[1])
            for a in node[2]:
                walk(a)
        elif kind == "neg":
            walk(node[1])
        elif kind == "bin":
            walk(node[2])
            walk(node[3])

    walk(mnemo_expr.parse(src))
    return found


def kinked_rule(rule):
    """Why a rule has a kink (a short string), or None for a smooth rule.
    rule: /rule's attributes; those missing take SPEC.md's defaults."""
    r = {name: default for name, (_, default) in mnemo_ref.RULE_ATTRS.items()}
    r.update(rule)
    why = []
    if r["loss"] in ("l1", "huber"):
        why.append("loss " + r["loss"])
    elif r["loss"] == "lp" and float(r["loss_p"]) < 2:
        why.append("loss lp(%g)" % float(r["loss_p"]))
    elif r["loss"] == "custom":
        why += ["loss_expr %s" % k for k in _expr_kinks(r["loss_expr"])]
    if int(r["layers"]) >= 2:   # a linear memory has no activation
        if r["activation"] == "relu":
            why.append("activation relu")
        elif r["activation"] == "custom":
            why += ["activation_expr %s" % k for k in _expr_kinks(r["activation_expr"])]
    if r["clip"] == "value":
        why.append("value clip")
    elif r["clip"] in ("scale", "elementwise"):
        why += ["clip_expr %s" % k for k in _expr_kinks(r["clip_expr"])]
    return ", ".join(dict.fromkeys(why)) or None


def ns_rank_deficient(exp):
    """Why newton_schulz cannot be compared in a reduced precision (a short
    string), or None: a step with fewer real rows than a weight matrix's
    smaller side has a gradient of rank below it, and the iteration lifts
    the format's rounding in the missing directions by about 3.4445 per
    iteration (docs/rules.md) to O(1), differently in every implementation
    of the same products. The shortest step: c, the last short one, or (with
    lengths) a single row."""
    r = exp.rule
    if r.get("precondition", "none") != "newton_schulz":
        return None
    c = int(r["step"])
    rows = [c] + ([exp.T % c] if exp.T % c else []) + ([1] if getattr(exp, "lengths", None) is not None else [])
    fewest = min(rows)
    L = int(r["layers"])
    dims = [exp.dk] + [exp.dh] * (L - 1) + [exp.dv]
    side = max(min(dims[i], dims[i + 1]) for i in range(L))
    if fewest < side:
        return "newton_schulz on a step of %d row%s < a matrix's smaller side %d" % (
            fewest, "" if fewest == 1 else "s", side)
    return None


def rule_width(exp):
    """The smallest width of the memory: dk, dv and (layers >= 2) hidden."""
    widths = [exp.dk, exp.dv] + ([exp.dh] if exp.rule["layers"] >= 2 else [])
    return min(widths)


# ---------------------------------------------------------------------------
# Comparing result files
# ---------------------------------------------------------------------------

def relerr(a, b):
    """|a - b| / |b| in L2 norms over the entries where b is finite
    (|a - b| when |b| = 0)."""
    fin = np.isfinite(b)
    d = float(np.linalg.norm((a - b)[fin]))
    nb = float(np.linalg.norm(b[fin]))
    return d / nb if nb > 0 else d


def placement(a, b):
    """None when a is non-finite exactly where b is, else what differs. NaN
    and Inf stand for each other, as in `mnemo compare`: which one a skipped
    step's gradient norm holds depends on the order of 0 * Inf products."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if np.array_equal(fa, fb):
        return None
    return ("non-finite at %d entries where the reference is finite, finite at %d where it is not"
            % (int((~fa & fb).sum()), int((fa & ~fb).sum())))


def forward_placement(res_path, ref_path):
    """Rows for /outputs and /final whose NaN/Inf placement differs."""
    rows = []
    with h5py.File(res_path, "r") as a, h5py.File(ref_path, "r") as b:
        for group in ("outputs", "final"):
            for name in b[group]:
                path = "/%s/%s" % (group, name)
                if path[1:] not in a:
                    rows.append("%s: missing" % path)
                    continue
                x, y = np.asarray(a[path][()], np.float64), np.asarray(b[path][()], np.float64)
                if x.shape != y.shape:
                    rows.append("%s: shape %s, the reference %s" % (path, x.shape, y.shape))
                    continue
                why = placement(x, y)
                if why:
                    rows.append("%s: %s" % (path, why))
    return rows


def compare_grads(res_path, exp, ref, tol, hold, probe, rounded=None):
    """Compare mnemo's /grads with the reference's (ref: name -> float64).
    hold: whether the bound applies (else placement only); probe: name ->
    float32 reference error, or None; rounded: name -> the reference's
    gradient with tf32 or bf16 products (rounded_probe), or None. Returns
    (failing rows, notes)."""
    rows, notes = [], []
    with h5py.File(res_path, "r") as f:
        g = f["grads"]
        for name in mnemo_ref.grad_names(exp):
            if name not in g:
                rows.append("/grads/%s: missing" % name)
                continue
            a = np.asarray(g[name][()], np.float64)
            b = ref[name]
            if a.shape != b.shape:
                rows.append("/grads/%s: shape %s, the reference %s" % (name, a.shape, b.shape))
                continue
            m = mnemo_ref.grad_compare_mask(exp, name)
            a, b = a[m], b[m]
            why = placement(a, b)
            if why:
                rows.append("/grads/%s: %s" % (name, why))
                continue
            if not hold:
                continue
            err = relerr(a, b)
            bound = tol
            if probe is not None and probe[name] > GRAD_RTOL["fp32"] / 10:
                bound = max(tol, 10 * probe[name])
                notes.append("%s held to %.1e, not %g: the float32 reference is off by %.1e; mnemo %.1e"
                             % (name, bound, tol, probe[name], err))
            if not err <= bound and rounded is not None:
                mv = relerr(rounded[name][m], b)
                if mv > tol / 2 and err <= 2 * mv:
                    notes.append("%s held to %.1e, not %g: the format's products alone move the reference by "
                                 "%.1e; mnemo %.1e" % (name, 2 * mv, tol, mv, err))
                    continue
            if not err <= bound:
                rows.append("/grads/%s: relative error %.3g > %.3g (|ref| %.3g)"
                            % (name, err, bound, float(np.linalg.norm(b[np.isfinite(b)]))))
    return rows, notes


def compare_rows(binary, a, b, rtol):
    """mnemo compare's table as {dataset: relative error}."""
    out = subprocess.run([binary, "compare", "-q", a, b, "--rtol", repr(rtol)], capture_output=True, text=True)
    rows = {}
    for line in out.stdout.splitlines():
        w = line.split()
        if len(w) >= 4 and w[0].startswith("/"):
            try:
                rows[w[0]] = float(w[3])
            except ValueError:
                rows[w[0]] = float("inf")
    return rows


def sensitive_forward(exp, ref_path, res_path, failing, rtol, precision):
    """The forward's twin of the gradients' rule above: a failing dataset
    whose float32 reference (torch, the same algorithm) is itself off by
    more than a tenth of the fp32 bound is held to ten times that error.
    In tf32 and bf16 one more probe: the float64 reference with every
    product's operands rounded to that format (mnemo_ref.rounded_products).
    A dataset that this rounding alone moves by more than half the bound is
    held to the bound against that reference instead: the format's own error
    on this rule is not the engine's, but the engine must still agree with
    the same algorithm at its precision. Returns (rows still failing, notes)."""
    binary = os.environ.get("MNEMO", os.path.join(os.getcwd(), "mnemo"))
    r32_path = ref_path.replace(".ref.h5", ".ref32.h5")
    mnemo_ref.write_result(r32_path, exp, mnemo_ref.run(exp, dtype=torch.float32), np.float64)
    probe = compare_rows(binary, r32_path, ref_path, RTOL["fp32"])
    mine = compare_rows(binary, res_path, ref_path, rtol)
    moved, against_rounded = {}, {}  # fp32: no rounded probe (mv = 0 below)
    if precision != "fp32":
        rp_path = ref_path.replace(".ref.h5", ".ref_%s.h5" % precision)
        with mnemo_ref.rounded_products(precision):
            res = mnemo_ref.run(exp, dtype=torch.float64, grads=False)
        mnemo_ref.write_result(rp_path, exp, res, np.float64)
        moved = compare_rows(binary, rp_path, ref_path, rtol)
        against_rounded = compare_rows(binary, res_path, rp_path, rtol)
    still, notes = [], []
    for row in failing:
        name = row.split()[0]
        p, m = probe.get(name, 0.0), mine.get(name, float("inf"))
        # compare -q lists only the rows over its rtol: a row it leaves out passed
        mv, ar = moved.get(name, 0.0), against_rounded.get(name)
        if p > RTOL["fp32"] / 10 and m <= max(rtol, 10 * p):
            notes.append("%s held to %.1e, not %g: the float32 reference is off by %.1e; mnemo %.1e"
                         % (name, max(rtol, 10 * p), rtol, p, m))
        elif mv > rtol / 2 and (ar is None or ar <= rtol):
            notes.append("%s: %s products alone move the reference by %.1e (mnemo %.1e); "
                         "mnemo is within %g of the reference with %s products"
                         % (name, precision, mv, m, rtol, precision))
        else:
            still.append(row)
    return still, notes


def rounded_probe(exp, precision):
    """The float64 reference's gradients with every product's operands
    rounded to tf32 or bf16 (mnemo_ref.rounded_products), name -> array:
    how far the format alone moves each gradient on this rule."""
    with mnemo_ref.rounded_products(precision):
        return mnemo_ref.run(exp, dtype=torch.float64)["grads"]


def float32_probe(exp, ref):
    """Per gradient tensor, how far torch's float32 run of the reference is
    from its float64 run: the tensor's own sensitivity to rounding."""
    r32 = mnemo_ref.run(exp, dtype=torch.float32)["grads"]
    out = {}
    for name, b in ref.items():
        m = mnemo_ref.grad_compare_mask(exp, name)
        a, bb = r32[name][m], b[m]
        out[name] = relerr(a, bb) if placement(a, bb) is None else np.inf
    return out


# ---------------------------------------------------------------------------

def env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        print("FAIL conformance/setup: %s must be an integer" % name)
        sys.exit(1)


def regressions():
    """(seed, index, max_T, width 1) of each line of regressions.txt. A
    regression is generated as it failed: without the out_norm and qk_norm
    that later generators draw (make_config's v2 = False)."""
    out = []
    path = os.path.join(HERE, "regressions.txt")
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                seed, index, max_t = (int(x) for x in line.split()[:3])
                out.append((seed, index, max_t, 1, False))
    return out


# Rule options the CUDA engine does not run yet (MN_PART_CPU_ONLY rows of
# model/rule.def; mnemo refuses them there, naming the option): attr -> its
# default. None in this version: the CUDA engine runs every v2 option.
CPU_ONLY_ATTRS = {}
# The v2 options the CUDA engine runs (gen_experiments.V2_OPTIONS).
CUDA_V2 = ("glu", "out_norm", "qk_norm", "precondition", "lengths")
# Those of them only its general path runs (kernels/plan.c): a forced fused
# or large path (MNEMO_CUDA_PATH) refuses them by name. None in this version.
GENERAL_ONLY_V2 = ()
# Those the general and large paths run but the fused path does not.
NOT_FUSED_V2 = ("glu",)
# Those the general and fused paths run but the large path does not.
NOT_LARGE_V2 = ("out_norm",)


def path_cannot_run(path):
    """The v2 options a forced fast path ("fused" or "large") refuses."""
    return GENERAL_ONLY_V2 + (NOT_FUSED_V2 if path == "fused" else NOT_LARGE_V2)


def forced_fast_path():
    """The fused or large path when MNEMO_CUDA_PATH forces one, else None."""
    path = os.environ.get("MNEMO_CUDA_PATH", "")
    return path if path in ("fused", "large") else None


def v2_options(device):
    """make_config's v2 for this run: MNEMO_CONFORMANCE_V2, or by default
    every option on the cpu and those the CUDA engine runs on cuda (on the
    path MNEMO_CUDA_PATH forces)."""
    if "MNEMO_CONFORMANCE_V2" in os.environ:
        return env_int("MNEMO_CONFORMANCE_V2", 1) != 0
    if device == "cpu":
        return True
    fast = forced_fast_path()
    if fast:
        return tuple(o for o in CUDA_V2 if o not in path_cannot_run(fast))
    return CUDA_V2


def describe_v2(v2):
    if v2 is True:
        return "all"
    return ", ".join(v2) if v2 else "none"


def cuda_pinned(cfg):
    """The SPEC v2 options of a configuration that the cuda engine does not
    run yet (or not on the path MNEMO_CUDA_PATH forces), as 'attr=value'
    words, or []."""
    rule = cfg["rule"]
    why = ["%s=%s" % (a, rule.get(a, d)) for a, d in CPU_ONLY_ATTRS.items() if rule.get(a, d) != d]
    fast = forced_fast_path()
    if fast:
        refused = path_cannot_run(fast)
        if rule.get("glu", 0) and "glu" in refused:
            why.append("glu on the forced %s path" % fast)
        for attr in ("out_norm", "precondition"):
            if attr in refused and rule.get(attr, "none") != "none":
                why.append("%s=%s on the forced %s path" % (attr, rule[attr], fast))
        if "lengths" in cfg["inputs"]:
            why.append("lengths on the forced %s path" % fast)
    return why


def parse_shard(text):
    """'k/n' as (k, n) with 0 <= k < n, or None."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        return None
    return (k, n) if 0 <= k < n else None


def cluster_splits(rule, n):
    """Whether MNEMO_FUSED_CLUSTER=n splits this rule over a cluster
    (kernels/plan.c's cluster_fit: the plain 2-layer memory, hidden
    divisible by n; the sizes fit shared memory at these widths)."""
    return (rule.get("layers") == 2 and not rule.get("glu")
            and rule.get("precondition", "none") in ("none", None) and rule.get("hidden")
            and rule["hidden"] % n == 0)


def main():
    binary = os.environ.get("MNEMO", os.path.join(os.getcwd(), "mnemo"))
    if not os.path.exists(binary):
        print("SKIP conformance: no mnemo binary at %s" % binary)
        return 0
    torch.set_num_threads(1)
    seed = env_int("MNEMO_CONFORMANCE_SEED", 1)
    count = env_int("MNEMO_CONFORMANCE_COUNT", 200)
    max_t = env_int("MNEMO_CONFORMANCE_MAX_T", 64)
    wide = env_int("MNEMO_CONFORMANCE_WIDE", 20)
    device = os.environ.get("MNEMO_DEVICE", "cpu")
    precision = os.environ.get("MNEMO_PRECISION", "fp32")
    if precision not in RTOL:
        print("FAIL conformance/setup: MNEMO_PRECISION must be one of %s" % ", ".join(RTOL))
        return 1
    shard = parse_shard(os.environ.get("MNEMO_CONFORMANCE_SHARD", "0/1"))
    if shard is None:
        print("FAIL conformance/setup: MNEMO_CONFORMANCE_SHARD must be k/n with 0 <= k < n, not %r"
              % os.environ["MNEMO_CONFORMANCE_SHARD"])
        return 1
    rtol, grad_rtol = RTOL[precision], GRAD_RTOL[precision]
    print("conformance: seed %d, %d random configurations (max T %d) + %d of width >= %d + %d regressions, "
          "device %s, precision %s, rtol %g, gradients %g, SPEC v2 options: %s"
          % (seed, count, max_t, wide, KINK_WIDTH, len(regressions()), device, precision, rtol, grad_rtol,
             describe_v2(v2_options(device))))
    print("replay with MNEMO_CONFORMANCE_SEED=%d MNEMO_CONFORMANCE_COUNT=%d MNEMO_CONFORMANCE_WIDE=%d"
          % (seed, count, wide))

    work = tempfile.mkdtemp(prefix="mnemo-conformance-")
    failures = n_grad = n_grad_skip = 0
    t0 = time.time()
    try:
        v2 = v2_options(device)
        cases = ([(seed, i, max_t, 1, v2) for i in range(count)]
                 + [(seed, i, max_t, KINK_WIDTH, v2) for i in range(wide)] + regressions())
        jobs = []
        cluster = env_int("MNEMO_CONFORMANCE_CLUSTER", 0)
        if cluster > 1:
            os.environ["MNEMO_FUSED_CLUSTER"] = str(cluster)  # the mnemo runs below inherit it
        for n, (s, i, mt, w, with_v2) in enumerate(cases):
            if n % shard[1] != shard[0]:
                continue
            cfg = gen_experiments.make_config(s, i, mt, min_width=w, v2=with_v2)
            if cluster > 1 and not cluster_splits(cfg["rule"], cluster):
                continue
            name = "case_%04d" % n
            exp = os.path.join(work, name + ".exp.h5")
            gen_experiments.write_config(exp, cfg)
            label = "conformance/%s/seed%d/%sexp_%05d%s" % (device + "-" + precision, s,
                                                            "wide%d/" % w if w > 1 else "", i,
                                                            "/regression" if n >= count + wide else "")
            jobs.append((label, exp, cfg["desc"], cuda_pinned(cfg) if device != "cpu" else []))
        for label, exp_path, desc, pinned in jobs:
            # configurations the cuda engine does not run: on the cpu, in fp32
            run_device, run_precision = ("cpu", "fp32") if pinned else (device, precision)
            rtol, grad_rtol = RTOL[run_precision], GRAD_RTOL[run_precision]
            pin_note = ["on the cpu: the cuda engine%s does not run %s" % (
                " (MNEMO_CUDA_PATH=%s)" % os.environ["MNEMO_CUDA_PATH"] if forced_fast_path() else "",
                " or ".join(pinned))] if pinned else []
            ref_path = exp_path.replace(".exp.h5", ".ref.h5")
            res_path = exp_path.replace(".exp.h5", ".res.h5")
            try:  # the reference must take every generated file
                exp = mnemo_ref.load_experiment(exp_path)
                ref = mnemo_ref.run(exp)
                mnemo_ref.write_result(ref_path, exp, ref, np.float64)
            except Exception as e:
                print("FAIL %s: the reference failed: %s\n    config: %s" % (label, e, desc))
                failures += 1
                continue
            run = subprocess.run([binary, "run", exp_path, "-o", res_path, "--device", run_device,
                                  "--precision", run_precision], capture_output=True, text=True)
            if run.returncode != 0:
                print("FAIL %s: mnemo run exited %d: %s\n    config: %s"
                      % (label, run.returncode, run.stderr.strip(), desc))
                failures += 1
                continue
            kink = kinked_rule(exp.rule) if run_precision != "fp32" else None
            width = rule_width(exp)
            # a rank-deficient newton_schulz is held to the bounds first, and
            # where it misses them, to finiteness and NaN placement
            ill = ns_rank_deficient(exp) if run_precision != "fp32" else None
            ill_note = ("%s: the %s rounding is lifted to O(1); finiteness and NaN placement only"
                        % (ill, run_precision)) if ill else None
            loose = kink is not None and width < KINK_WIDTH
            if loose:
                # SPEC.md section 3: rounding can move a residual across the
                # kink; on small widths such rules are held to finiteness and
                # NaN placement only
                rows = forward_placement(res_path, ref_path)
                note = " (kinked: %s; width %d < %d: finiteness and NaN placement only)" % (
                    kink, width, KINK_WIDTH)
                if rows:
                    failures += 1
                    print("FAIL %s: NaN/Inf placement differs from the reference\n    config: %s\n%s"
                          % (label, desc, "\n".join("    " + r for r in rows)))
                else:
                    print("PASS %s%s" % (label, note))
            else:
                cmp = subprocess.run([binary, "compare", "-q", res_path, ref_path, "--rtol", repr(rtol)],
                                     capture_output=True, text=True)
                # a compare that walks /grads holds them to the forward bound;
                # they are compared below, at theirs
                failing = [r for r in cmp.stdout.splitlines()
                           if r.startswith("/") and not r.rstrip().endswith("pass")]
                forward_failing = [r for r in failing if not r.startswith("/grads/")]
                notes = []
                if cmp.returncode == 1 and forward_failing:
                    forward_failing, notes = sensitive_forward(exp, ref_path, res_path, forward_failing, rtol,
                                                               run_precision)
                notes = pin_note + notes
                if cmp.returncode == 0 or (cmp.returncode == 1 and not forward_failing):
                    print("PASS %s%s" % (label, " (%s)" % "; ".join(notes) if notes else ""))
                elif ill and cmp.returncode == 1 and not forward_placement(res_path, ref_path):
                    print("PASS %s (%s)" % (label, "; ".join(notes + [ill_note])))
                else:
                    failures += 1
                    rows = "\n".join("    " + r for r in (cmp.stdout + cmp.stderr).strip().splitlines())
                    print("FAIL %s: differs from the reference\n    config: %s\n%s" % (label, desc, rows))
            if exp.upstream is None:
                continue
            n_grad += 1
            glabel = label + "/grads"
            with h5py.File(res_path, "r") as f:
                has_grads = "grads" in f
            if not has_grads:
                n_grad_skip += 1
                print("SKIP %s: engine wrote no /grads" % glabel)
                continue
            probe = float32_probe(exp, ref["grads"]) if not loose else None
            rows, notes = compare_grads(res_path, exp, ref["grads"], grad_rtol, not loose, probe)
            if rows and not loose and run_precision != "fp32":
                rows, notes = compare_grads(res_path, exp, ref["grads"], grad_rtol, True, probe,
                                            rounded_probe(exp, run_precision))
            if rows and ill and not loose:
                rows, notes = compare_grads(res_path, exp, ref["grads"], grad_rtol, False, None)
                notes = notes + [ill_note]
            if rows:
                failures += 1
                print("FAIL %s: gradients differ from the reference\n    config: %s\n%s"
                      % (glabel, desc, "\n".join("    " + r for r in rows)))
            else:
                extra = [note.strip(" ()")] if loose else []
                extra += pin_note + notes
                print("PASS %s%s" % (glabel, " (%s)" % "; ".join(extra) if extra else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    part = " (shard %d/%d of %d)" % (shard[0], shard[1], len(cases)) if shard[1] > 1 else ""
    print("conformance: %d configurations%s, %d with gradients (%d skipped: no /grads), %.1f s"
          % (len(jobs), part, n_grad, n_grad_skip, time.time() - t0))
    if failures:
        print("conformance: %d of %d configurations failed (seed %d%s)" % (failures, len(jobs), seed, part))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
