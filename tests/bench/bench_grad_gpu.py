#!/usr/bin/env python3
"""bench_grad_gpu.py: training through an update rule, forward plus
backward, mnemo against PyTorch in one job on one GPU (issue 15). Not a test.

The rule is bench_gpu.py's (MLP with gelu and biases or linear, mse with the
feature mean, theta 0.02, eta 0.9, alpha 0.001, a global norm clip at 1,
refresh = step, retrieve after, q = k). The objective is
    L = <dy, y> + <dW1, W1^(S)>
with dy and dW1 fixed random tensors; every side computes dL/dk and dL/dW1
(the initial weights) and their agreement with mnemo's is printed.

  mnemo       rule:run{grad = true} and res:backward on the device
              (tests/bench/bench_grad_run.lua, in-process wall clock)
  (a) autograd   torch.autograd.grad(create_graph=True) per step, then
                 L.backward() (titans-pytorch's way)
  (b) func       torch.func: vmap over memories of grad of one memory's
                 weighted loss, then L.backward()
  (c) compile    torch.compile of (b)'s step
  (d) graph      (b) captured whole (forward and backward) in a CUDA graph
Peak memory: torch.cuda.max_memory_allocated over one forward plus
backward for the baselines; mnemo's res:backward reports its own
backward's bytes (g.memory.backward_bytes) beside the forward's state.

Floor of forward plus backward (grad_floor): the ceilings measured as
bench_gpu.py measures them (a 1 GiB copy, an 8192^3 matmul at the
precision); FLOPs = 3x bench_gpu.flop_count (the forward's products, and
for each product the two of its adjoint, one for each operand; recompute
not counted); bytes = bench_gpu.byte_count plus dy read, dL/dk written,
dW1 read and dL/dW1 written (fp32); floor = max(FLOPs / rate, bytes /
bandwidth), "% floor" = floor / time.

  python3 tests/bench/bench_grad_gpu.py [--cases P1,P1-lin,P1-c16,P2,G1] [--repeat 3]
      [--precision tf32] [--no-compile] [--no-graph]
      [--mnemo BIN [--mnemo OLD ...] [--rounds 2]] [--mnemo-only]

Two builds in one job (an A/B of a change): name each with --mnemo; the
first is the table's mnemo, the others are printed beside it, and with
--rounds N the builds take turns N times (medians over all their runs), so
that a drift of the GPU's clocks over the job falls on each alike.
--mnemo-only skips the PyTorch baselines.
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_gpu  # noqa: E402

THETA, ETA, ALPHA, CLIP_MAX = bench_gpu.THETA, bench_gpu.ETA, bench_gpu.ALPHA, bench_gpu.CLIP_MAX


def rule_pieces(cfg):
    """forward(P, x) and the weighted loss of one step, differentiable."""
    layers, dv = cfg["layers"], cfg["dv"]

    def forward(P, x):
        if layers == 1:
            return torch.bmm(x, P[0].mT)
        # bmm + bias rather than baddbmm: torch 1.13's CPU double backward of
        # baddbmm gave garbage in float32 (float64 agreed with mnemo)
        h = F.gelu(torch.bmm(x, P[0].mT) + P[1].unsqueeze(1))
        return torch.bmm(h, P[2].mT) + P[3].unsqueeze(1)

    def forward1(P, x):   # one memory: P[i] without the memory dimension
        if layers == 1:
            return x @ P[0].T
        h = F.gelu(x @ P[0].T + P[1])
        return h @ P[2].T + P[3]

    def weighted_loss1(P, x, v):
        return THETA * (forward1(P, x) - v).pow(2).mean(-1).sum()

    return forward, weighted_loss1


def update(W, S, G):
    sq = sum(g.square().flatten(1).sum(1) for g in G)
    scale = (CLIP_MAX / sq.sqrt()).clamp(max=1.0)
    W1, S1 = [], []
    for w, s, g in zip(W, S, G):
        sh = (-1,) + (1,) * (g.dim() - 1)
        s = ETA * s - g * scale.view(sh)
        S1.append(s)
        W1.append((1.0 - ALPHA) * w + s)
    return W1, S1


def make_step(cfg, way):
    forward, wl1 = rule_pieces(cfg)
    grad_vmapped = torch.func.vmap(torch.func.grad(wl1), in_dims=(0, 0, 0)) if way != "autograd" else None

    def step(W, S, A, x, v):
        # the gradient at the refresh block's anchor A (W itself when r = c),
        # retrieval at W (retrieve = after: the last token at the new W)
        y = forward(W, x)
        if way == "autograd":
            yA = y if A is W else forward(A, x)
            loss = THETA * (yA - v).pow(2).mean(-1).sum()
            G = torch.autograd.grad(loss, A, create_graph=True)
        else:
            G = grad_vmapped(tuple(A), x, v)
        W1, S1 = update(W, S, list(G))
        return W1, S1, y[:, :-1], forward(W1, x[:, -1:])
    return step


def objective(step, cfg, W0, k, v, dy, dW1):
    T, c = cfg["T"], cfg["c"]
    r = cfg.get("r", c)
    W, S = list(W0), [torch.zeros_like(w) for w in W0]
    A = W
    ys = []
    for s, lo in enumerate(range(0, T, c)):
        hi = min(T, lo + c)
        if r > 0 and (s * c) % r == 0:
            A = W   # a new refresh block: its gradient point is W^(s)
        W, S, y_first, y_last = step(W, S, A, k[:, lo:hi], v[:, lo:hi])
        ys += [y_first, y_last]
    y = torch.cat(ys, 1)
    return (dy * y).sum() + (dW1 * W[0]).sum()


def time_baseline(way, cfg, k, v, W0, dy, dW1, repeat, compile_=False):
    step = make_step(cfg, "autograd" if way == "autograd" else "func")
    if compile_:
        step = torch.compile(step)

    def once():
        kk = k.detach().requires_grad_(True)
        P0 = [w.detach().requires_grad_(True) for w in W0]
        L = objective(step, cfg, P0, kk, v, dy, dW1)
        gk, gW1 = torch.autograd.grad(L, [kk, P0[0]])
        return gk, gW1

    once()   # warm-up (and compile)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ts, out = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = once()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    return sorted(ts)[len(ts) // 2], peak, out


def time_graph(cfg, k, v, W0, dy, dW1, repeat):
    """(b) captured whole: static inputs, the forward and both backwards in
    one CUDA graph, replayed."""
    step = make_step(cfg, "func")
    kk = k.detach().clone().requires_grad_(True)
    P0 = [w.detach().clone().requires_grad_(True) for w in W0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm-up on a side stream, as torch.cuda.graph wants
        for _ in range(2):
            L = objective(step, cfg, P0, kk, v, dy, dW1)
            gk, gW1 = torch.autograd.grad(L, [kk, P0[0]])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.cuda.graph(g):
        L = objective(step, cfg, P0, kk, v, dy, dW1)
        gk, gW1 = torch.autograd.grad(L, [kk, P0[0]])
    ts = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    return sorted(ts[1:])[len(ts[1:]) // 2], peak, (gk, gW1)


def rel(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def grad_floor(cfg, bw, rate):
    """(floor seconds, FLOPs, bytes, bound) of a forward plus backward:
    the module docstring says what is counted."""
    flops = 3 * bench_gpu.flop_count(cfg)
    numel_w1 = cfg["dk"] * (cfg["dh"] if cfg["layers"] >= 2 else cfg["dv"])
    per_memory = cfg["T"] * (cfg["dv"] + cfg["dk"]) + 2 * numel_w1
    nbytes = bench_gpu.byte_count(cfg) + 4 * cfg["B"] * cfg["H"] * per_memory
    t_fl, t_by = flops / rate, nbytes / bw
    return max(t_fl, t_by), flops, nbytes, "FLOP" if t_fl >= t_by else "bytes"


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def run_mnemo(binary, exp, up, save, args):
    """One process of bench_grad_run.lua: its MNEMO_GRAD values by key, or
    the failure's text."""
    try:
        p = subprocess.run([binary, "-q", os.path.join(HERE, "bench_grad_run.lua"), exp, up, "cuda",
                            str(args.repeat), save, args.precision], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:  # a --mnemo that is no binary, or a hung run
        return str(e)
    got = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "MNEMO_GRAD":
            got.setdefault(parts[1], []).append(parts[2])
    if p.returncode != 0 or "MNEMO_GRAD_DONE" not in p.stdout:
        return "exit %d: %s" % (p.returncode, (p.stderr + p.stdout)[-600:])
    return got


def pct(row, t):
    """' [x.x%]' of the floor for a time, or '' without ceilings."""
    return " [%.1f%%]" % (100 * row["floor"] / t) if "floor" in row else ""


def print_table(rows):
    """The markdown table for tests/bench/RESULTS.md: a row per case."""
    heads = ["(a) autograd", "(b) func", "(c) compile(b)", "(d) graph(b)"]
    print("\n| case | floor (ms) | mnemo fwd + bwd (ms) [% floor] | backward path | " + " | ".join(heads) + " |")
    print("|---|---|---|---|" + "---|" * len(heads))
    for r in rows:
        cells = []
        for h in heads:
            x = r.get(h)
            if x is None:
                cells.append("not run")
            elif isinstance(x, str):
                cells.append("failed: " + x)
            else:
                cells.append("%.1f (%.2fx)%s, %.0f MB" % (1e3 * x[0], x[0] / r["mnemo"], pct(r, x[0]),
                                                          x[1] / 2**20))
        print("| %s | %s | %.2f + %.2f%s | %s | %s |" % (
            r["case"], "%.3f" % (1e3 * r["floor"]) if "floor" in r else "-", 1e3 * r["mnemo_fwd"],
            1e3 * r["mnemo_bwd"], pct(r, r["mnemo"]), r["plan"], " | ".join(cells)))
    print("(ratios: baseline time / mnemo's forward plus backward; above 1 = mnemo faster; [%% floor] = floor / "
          "time. "
          "mnemo's backward bytes: %s)" % ", ".join("%s %.1f MB" % (r["case"], r["mnemo_mem"] / 2**20) for r in rows))



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="P1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32"],
                    help="mnemo's precision and PyTorch's matmul mode (bf16 would need autocast)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--mnemo", action="append", default=None,
                    help="a mnemo binary; repeat it to time several builds in turn")
    ap.add_argument("--rounds", type=int, default=1, help="turns of the builds (each a process of --repeat runs)")
    ap.add_argument("--mnemo-only", action="store_true", help="no PyTorch baselines")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grad_gpu.py: needs a CUDA GPU (torch %s sees none)" % torch.__version__)
    builds = args.mnemo or [bench_gpu.find_mnemo()]
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    print("bench_grad_gpu: %s, torch %s, precision %s" % (torch.cuda.get_device_name(), torch.__version__,
                                                          args.precision))
    bw, rates = (None, None) if args.mnemo_only else bench_gpu.measure_ceilings("cuda")
    if bw:
        print("ceilings: copy %.0f GB/s; matmul %s" % (bw / 1e9, ", ".join("%s %.1f TFLOP/s" % (p, r / 1e12)
                                                                          for p, r in rates.items())))
    # bench_gpu's cases, and issue 15's head-128 one
    known = [c for c in args.cases.split(",") if c != "G1"]
    cases = bench_gpu.make_cases(argparse.Namespace(cases=",".join(known), device="cuda", quick=False, p3_T=None)) \
        if known else []
    if "G1" in args.cases.split(","):
        cases.append(("G1", dict(B=4, H=16, T=4096, dk=128, dv=128, dh=256, layers=2, c=64, r=64)))
    work = tempfile.mkdtemp(prefix="mnemo_gradbench_")
    rows = []
    for name, cfg in cases:
        B, H, T, dv = cfg["B"], cfg["H"], cfg["T"], cfg["dv"]
        BH = B * H
        k, v, W0 = bench_gpu.make_data(cfg, "cuda", 1)
        g = torch.Generator(device="cuda")
        g.manual_seed(2)
        dy = torch.randn(BH, T, dv, generator=g, device="cuda") * 1e-2
        dW1 = torch.randn(W0[0].shape, generator=g, device="cuda") * 1e-2
        exp = os.path.join(work, name + ".exp.h5")
        up = os.path.join(work, name + ".up.h5")
        save = os.path.join(work, name + ".grads.h5")
        bench_gpu.write_experiment(exp, cfg, k, v, W0)
        with h5py.File(up, "w") as f:
            f["dy"] = dy.cpu().numpy().reshape(B, H, T, dv)
            f["dW1"] = dW1.cpu().numpy().reshape((B, H) + tuple(W0[0].shape[1:]))
        row = {"case": name, "desc": bench_gpu.describe(cfg)}
        print("== %s: %s" % (name, row["desc"]))
        if bw:
            row["floor"], fl, nb, bound = grad_floor(cfg, bw, rates[args.precision])
            print("   floor of forward plus backward: %.3g GFLOP, %.0f MB -> %.3f ms (%s-bound)"
                  % (fl / 1e9, nb / 1e6, 1e3 * row["floor"], bound))
        timings = {b: {"forward": [], "backward": []} for b in builds}
        failed = None
        for _ in range(max(1, args.rounds)):
            for b in builds:
                got = run_mnemo(b, exp, up, save if b == builds[0] else save + ".other", args)
                if isinstance(got, str):
                    failed = "%s: %s" % (b, got)
                    break
                timings[b]["forward"] += [float(x) for x in got["forward"]]
                timings[b]["backward"] += [float(x) for x in got["backward"]]
                if b == builds[0]:
                    row["mnemo_mem"] = int(got["backward_bytes"][0])
                    row["plan"] = got.get("plan", ["?"])[0].replace("_", " ")
            if failed:
                break
        if failed:
            print("   mnemo failed %s" % failed)
            continue
        for b in builds:
            t_fw, t_bw = median(timings[b]["forward"]), median(timings[b]["backward"])  # not bw: the bandwidth
            if b == builds[0]:
                row["mnemo_fwd"], row["mnemo_bwd"], row["mnemo"] = t_fw, t_bw, t_fw + t_bw
                print("   mnemo: forward %.2f ms + backward %.2f ms (backward: %s; its bytes %.1f MB)"
                      % (1e3 * t_fw, 1e3 * t_bw, row["plan"], row["mnemo_mem"] / 2**20))
            else:
                with h5py.File(save, "r") as f, h5py.File(save + ".other", "r") as o:
                    agree = rel(o["gk"][()], f["gk"][()]), rel(o["gW1"][()], f["gW1"][()])
                print("   mnemo %s: forward %.2f ms + backward %.2f ms (%d runs each), against the first: "
                      "dk %.1e dW1 %.1e" % ((b, 1e3 * t_fw, 1e3 * t_bw, len(timings[b]["forward"])) + agree))
        if args.mnemo_only:
            rows.append(row)
            continue
        with h5py.File(save, "r") as f:
            mk = np.asarray(f["gk"][()]).reshape(BH, T, -1)
            mw = np.asarray(f["gW1"][()]).reshape(W0[0].shape)
        ways = [("(a) autograd", "autograd", False), ("(b) func", "func", False)]
        if not args.no_compile:
            ways.append(("(c) compile(b)", "func", True))
        for label, way, comp in ways:
            try:
                t, peak, (gk, gw) = time_baseline(way, cfg, k, v, W0, dy, dW1, args.repeat, comp)
                row[label] = (t, peak, rel(mk, gk.cpu().numpy()), rel(mw, gw.cpu().numpy()))
                print("   %s: %.1f ms, peak %.0f MB, agreement dk %.1e dW1 %.1e"
                      % ((label, 1e3 * t, peak / 2**20) + row[label][2:]))
            except Exception as e:   # a baseline PyTorch cannot run is reported, not fatal
                row[label] = str(e).splitlines()[0][:120]
                print("   %s: failed: %s" % (label, row[label]))
            torch.cuda.empty_cache()
        if not args.no_graph:
            try:
                t, peak, (gk, gw) = time_graph(cfg, k, v, W0, dy, dW1, args.repeat)
                row["(d) graph(b)"] = (t, peak, rel(mk, gk.cpu().numpy()), rel(mw, gw.cpu().numpy()))
                print("   (d) graph(b): %.1f ms, peak %.0f MB, agreement dk %.1e dW1 %.1e"
                      % ((1e3 * t, peak / 2**20) + row["(d) graph(b)"][2:]))
            except Exception as e:
                row["(d) graph(b)"] = str(e).splitlines()[0][:120]
                print("   (d) graph(b): failed: %s" % row["(d) graph(b)"])
            torch.cuda.empty_cache()
        rows.append(row)
    print_table(rows)

if __name__ == "__main__":
    main()
