#!/usr/bin/env python3
"""grad_drift: how far fp32 gradients of a run (SPEC.md section 7) drift from
float64 as the number of steps grows, so that the reach of the fp32 gradient
bound (1e-4 relative L2 per tensor, SPEC.md section 3) is known.

    grad_drift.py [--steps 1,16,64,256] [--configs 12] [--step-size 1]
                  [--mnemo PATH [--device cpu|cuda] [--precision fp32]]

For each step count S and each of --configs rules (losses, activations,
depths and clips in turn, conditioned as gen_experiments.py conditions its
files: keys of norm about 1, theta scaled down by the tokens and features
summed, eta <= 0.8, alpha <= min(0.2, 3/S)), it builds one experiment with
T = S * step-size tokens and every upstream gradient given, runs the float64
reference and compares, per /grads tensor, the relative L2 error of

  - torch's float32 run of the same reference (always), and
  - `mnemo run`'s /grads (with --mnemo; "-" where mnemo wrote none).

It prints, per S, the median, 90th percentile and maximum over the rules of
each rule's worst tensor, the tensor that was worst, and the share of rules
whose worst tensor passes 1e-4, separately for smooth rules and for rules
with a kink (test_conformance.kinked_rule: here l1, huber, lp(1.6), relu and
the value clip; lp's curvature |r|^(p-2) is unbounded near r = 0). Tensors that cancel to rounding noise (float64
norm below 1e-10) are left out and counted.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import h5py
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_experiments as gen  # noqa: E402
import mnemo_ref  # noqa: E402
from test_conformance import kinked_rule  # noqa: E402

TOL = 1e-4
RULES = [  # (layers, activation, loss, clip): cycled through
    (1, "silu", "mse", "none"),
    (2, "silu", "mse", "norm"),
    (2, "gelu", "huber", "none"),
    (2, "tanh", "lp", "softnorm"),
    (1, "silu", "l1", "value"),
    (2, "relu", "mse", "none"),
    (2, "silu", "dot", "norm"),
    (3, "gelu", "custom", "none"),
    (2, "custom", "mse", "scale"),
    (1, "silu", "huber", "elementwise"),
    (2, "tanh", "mse", "none"),
    (3, "silu", "lp", "norm"),
]


def make_experiment(S, c, i, seed=0):
    """Experiment i (a config dict for gen_experiments.write_config) of S steps of c tokens."""
    rng = np.random.default_rng([seed, S, c, i])
    L, act, loss, clip = RULES[i % len(RULES)]
    B, H, dk, dv, dh = 2, 2, 8, 8, 16
    T = S * c
    f32 = lambda x: np.asarray(x, np.float32)
    rule = {"layers": L, "step": c, "loss": loss, "clip": clip, "feature_reduce": "mean",
            "token_reduce": "sum"}
    constants = {}
    if L >= 2:
        rule.update(hidden=dh, activation=act)
        if act == "custom":
            rule["activation_expr"] = "z*tanh(softplus(z))"
    if loss == "huber":
        rule["loss_delta"] = 0.5
    elif loss == "lp":
        rule["loss_p"] = 1.6
    elif loss == "custom":
        rule["loss_expr"] = "log(1 + r^2)"
    if clip in ("norm", "softnorm"):
        rule["clip_max"] = 0.1
    elif clip == "value":
        rule["clip_max"] = 0.01
    elif clip == "scale":
        rule["clip_expr"] = "1/sqrt(1 + (n/m)^2)"
        constants["m"] = 0.1
    elif clip == "elementwise":
        rule["clip_expr"] = "m*tanh(g/m)"
        constants["m"] = 0.01
    base = rng.uniform(0.02, 0.25) / c * (0.5 if loss == "dot" else 1.0)
    gates = {"theta": f32(rng.uniform(0.5 * base, 1.5 * base, (B, H, T))),
             "eta": f32(rng.uniform(0.0, 0.8, (B, H, S))),
             "alpha": f32(rng.uniform(0.0, min(0.2, 3.0 / S), (B, H, S)))}
    k = rng.standard_normal((B, H, T, dk)) / np.sqrt(dk) * rng.uniform(0.5, 1.5, (B, H, T, 1))
    inputs = {"k": f32(k), "v": f32(rng.standard_normal((B, H, T, dv)) * 0.8)}
    init, shapes = {}, {}
    gain = rng.uniform(0.3, 1.0)
    for li in range(1, L + 1):
        out_d, in_d = (dv if li == L else dh), (dk if li == 1 else dh)
        init["W%d" % li] = f32(rng.standard_normal((B, H, out_d, in_d)) * gain / np.sqrt(in_d))
        shapes["W%d" % li] = (B, H, out_d, in_d)
        if L >= 2:
            init["b%d" % li] = f32(rng.standard_normal((B, H, out_d)) * 0.1)
            shapes["b%d" % li] = (B, H, out_d)
    up = {"dy": f32(rng.standard_normal((B, H, T, dv))), "dloss": f32(rng.standard_normal((B, H, T)))}
    for n, shp in shapes.items():
        up["d" + n] = f32(rng.standard_normal(shp))
        up["dS_" + n] = f32(rng.standard_normal(shp))
    desc = "L=%d act=%s loss=%s clip=%s" % (L, act if L >= 2 else "-", loss, clip)
    return {"rule": rule, "constants": constants, "inputs": inputs, "gates": gates, "init": init,
            "upstream": up, "desc": desc, "strings": "vlen", "seed": seed, "index": i}


def relerr(a, b):
    d, nb = np.linalg.norm(a - b), np.linalg.norm(b)
    return d / nb if nb > 0 else d


def worst_tensor(exp, ref, other):
    """(worst relative error, its tensor, tensors left out as cancelling)."""
    worst, which, left = 0.0, "", 0
    for name, b in ref.items():
        m = mnemo_ref.grad_compare_mask(exp, name)
        a, bb = np.asarray(other[name], np.float64)[m], b[m]
        if np.linalg.norm(bb) < 1e-10:
            left += 1
            continue
        e = relerr(a, bb) if np.array_equal(np.isfinite(a), np.isfinite(bb)) else np.inf
        if not e <= worst:
            worst, which = e, name
    return worst, which, left


def engine_grads(binary, path, device, precision):
    out = path + ".res.h5"
    p = subprocess.run([binary, "run", path, "-o", out, "--device", device, "--precision", precision],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("mnemo run exited %d: %s" % (p.returncode, p.stderr.strip()))
    with h5py.File(out, "r") as f:
        if "grads" not in f:
            return None
        return {n: f["grads/" + n][()] for n in f["grads"]}


def summary(rows):
    errs = np.array([r[0] for r in rows])
    worst = max(rows, key=lambda r: r[0])
    return "%9.1e %9.1e %9.1e  %-6s %-34s %5.0f%%" % (
        np.median(errs), np.percentile(errs, 90), errs.max(), worst[1], worst[2],
        100.0 * np.mean(errs <= TOL))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="grad_drift.py", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="1,16,64,256")
    ap.add_argument("--configs", type=int, default=12)
    ap.add_argument("--step-size", type=int, default=1, dest="c")
    ap.add_argument("--mnemo", help="also compare `mnemo run`'s /grads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    steps = [int(s) for s in args.steps.split(",")]
    work = tempfile.mkdtemp(prefix="mnemo-drift-")
    print("fp32 gradient drift from float64: %d rules per row, step size %d, B=H=2, dk=dv=8, "
          "hidden 16; per rule its worst /grads tensor (relative L2)" % (args.configs, args.c))
    head = "%5s %-13s %9s %9s %9s  %-6s %-34s %6s" % ("steps", "what", "median", "p90", "max", "tensor",
                                                   "worst rule", "<=1e-4")
    print(head)
    print("-" * len(head))
    t0 = time.time()
    for S in steps:
        rows32, rows_eng, left, no_grads = [], [], 0, 0
        for i in range(args.configs):
            cfg = make_experiment(S, args.c, i)
            path = os.path.join(work, "drift_%d_%d.h5" % (S, i))
            gen.write_config(path, cfg)
            exp = mnemo_ref.load_experiment(path)
            ref = mnemo_ref.run(exp)["grads"]
            g32 = mnemo_ref.run(exp, dtype=torch.float32)["grads"]
            kink = kinked_rule(exp.rule) is not None
            e, which, n_left = worst_tensor(exp, ref, g32)
            rows32.append((e, which, cfg["desc"], kink))
            left += n_left
            if args.mnemo:
                g = engine_grads(args.mnemo, path, args.device, args.precision)
                if g is None:
                    no_grads += 1
                else:
                    e, which, _ = worst_tensor(exp, ref, g)
                    rows_eng.append((e, which, cfg["desc"], kink))
        for who, rows in (("torch", rows32), ("mnemo", rows_eng)):
            if who == "mnemo" and not args.mnemo:
                continue
            if not rows:
                print("%5d %-13s %9s %9s %9s  (mnemo wrote no /grads for %d rules)" % (S, who, "-", "-", "-", no_grads))
                continue
            for part, sel in (("smooth", False), ("kinked", True)):
                some = [r for r in rows if r[3] == sel]
                if some:
                    print("%5d %-13s %s" % (S, who + " " + part, summary(some)))
        if left:
            print("      (%d tensors cancel to rounding noise and are left out)" % left)
        sys.stdout.flush()
    print("%.1f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
