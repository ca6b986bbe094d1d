#!/usr/bin/env python3
"""GPU benchmark (issue 6; a benchmark, not a test): mnemo's CUDA engine
against PyTorch baselines of the same update rule, same inputs, same
precision, run in one job on one GPU.

Cases (SPEC.md rule: retrieve after, q = k, mse with feature mean, token sum,
global norm clip 1.0, momentum eta 0.9, decay alpha 0.001, theta 0.02):
  P1      B=4, H=32 (128 memories), T=4096, dk=dv=64, MLP 64-256-64 gelu with
          biases, step c=64, refresh r=64
  P1-lin  P1 with a linear memory (layers=1, no bias)
  P1-c16  P1 with c=16 (r stays 64: the gradient point lags up to 3 steps)
  P2      one memory (B=H=1), dk=dv=hidden=512, 2 layers, N=2048 tokens, one
          step (c=N)
  P3      P1 at T = 1K, 2K, 4K, 8K, 16K (time per token: linear in T?)
  P1-qk   P1 with qk_norm = l2 (SPEC v2): keys normalised to unit length
          before use, inside the timed region on both sides (mnemo
          normalises them on the device before its kernels; the baselines
          as their first op). Issue 13's target: within 25% of P1.
  P1-glu  P1 with glu (SPEC v2): the hidden layer gated, h = gelu(W1 x + b1) *
          (U1 x + c1) (the memory has 1.5x P1's weights)
  P1-ln   P1 with out_norm = layernorm (SPEC v2): the output o = W2 h + b2
          becomes (o - mean o) / sqrt(var o + 1e-6) (ln_g = 1, ln_b = 0: the
          defaults); the baselines use F.layer_norm and its hand backward
  The shapes researchers use (issue 14; r = c in each):
  H1      B=8, H=8, T=4096, MLP 128-256-128, c=64 (head size 128)
  H2      B=8, H=8, T=2048, MLP 128-512-128, c=64 (hidden 4x)
  L1      B=1, H=8, T=16384, MLP 256-512-256, c=1024 (LaCT-style large steps)
  M1      B=32, H=16, T=1024, MLP 64-128-64, c=8 (many small memories, short steps)
Inputs: keys with RMS 1 per feature (norm sqrt(dk)), so the gelu works in
its curved range; values a fixed random linear map of the keys per memory
(RMS ~1) plus noise 0.1, so the memory has something to learn; W ~ N(0,
1/fan_in), biases N(0, 0.01). theta is 0.02, not the 0.05 first planned:
at 0.05, P1-c16 (gradient point up to 3 steps stale, momentum 0.9) is close
to unstable and amplifies fp32 rounding over its 256 steps: on the CPU,
mnemo and PyTorch fp32 each land ~1e-3 from a float64 run of the same math
and 1.7e-3 / 4.2e-3 (y / W1) from each other, so no fp32 pair could pass
1e-3. At 0.02 every case is well conditioned (full-size CPU runs: P1-c16,
P1 and P3 at T=16K agree to < 1e-6) and the memory still learns (P1 loss
1.45 -> 0.07). The clip then bites only in P2 (one step over 2048 tokens);
P1 computes it every step at scale 1. --theta changes it.
The script prints skipped steps, clip activity and first/last step loss of
mnemo's result for each case.

Baselines (PyTorch, the B*H memories batched on a leading dim):
  (a) eager, torch.autograd.grad per step (titans-pytorch's way)
  (b) eager, hand-written backward (bmm for dW, sums for db, gelu' by
      aten.gelu_backward)
  (c) torch.compile of (b)'s step function (default mode; --compile-mode)
  (d) (b)'s whole sequence loop captured in one CUDA graph, replayed
fp32 is plain IEEE fp32 (no TF32); --precision tf32 allows TF32 matmuls
(torch.set_float32_matmul_precision("high")); bf16 runs the baselines under
torch.autocast(bfloat16) (products in bf16, their outputs cast back to fp32
before the elementwise work) and mnemo with --precision bf16 (operands
rounded to bf16, fp32 accumulation and outputs).

mnemo is timed three ways, all printed and labelled:
  rule:run  in-process: tests/bench/bench_gpu_run.lua loads the experiment,
            warms up on a tiny T (same generated kernel), then times
            rule:run{device=...} with mnemo.profile (wall clock). Includes
            the engine's input staging (a host copy of k, v and a
            host-to-device copy; estimated separately as "staging"), the
            output allocations and the wait for the kernel; excludes
            start-up, CUDA init, NVRTC and file I/O. This is the number the
            ratios and floor fractions use (conservative for mnemo).
  CLI raw   wall time of the whole `mnemo run EXP.h5 -o RES.h5` process
            (start-up, CUDA init, kernel load from the disk cache, HDF5 read
            and write, staging, kernel).
  CLI - tiny  CLI raw minus a `mnemo run` of the same rule on T = min(c, 64)
            tokens: removes start-up, CUDA init and kernel load, not the
            HDF5 I/O or staging that grow with T.
PyTorch times are CUDA-event times of a whole sequence (all steps), inputs
already on the device, median of the repeats after a warm-up run.

Agreement: relative L2 error of y and of the final W1 of every baseline
against mnemo's result (fp32 must be < 1e-3; tf32 5e-3; bf16 3e-2).

Floors: the device's two ceilings are measured once (device-to-device copy
of 1 GiB, bytes read + written; an 8192^3 matmul in fp32, tf32 and bf16);
floor = max(FLOPs / matmul rate at the precision, bytes / bandwidth), with
the counts of flop_count() and byte_count() below. "% floor" = floor / time.

Limits of the timing method:
  - rule:run is a host wall clock around an engine call that synchronises
    before it returns, so the kernel is all inside it. Its inputs (k, v,
    gates, initial weights) are moved to the device before the timing, as
    PyTorch's are; what it still pays that the baselines do not: the gates'
    broadcast on the device, the output allocations and the host side of
    the call (about 0.3 ms: the intercept of P3's times over T). The
    "staging est." column is what a host copy and upload of k and v would
    add (k:clone(), v:clone() and their :cuda(), timed separately).
  - CLI - tiny still holds the HDF5 read of the inputs and write of y,
    which grow with T; it is printed for completeness, not for ratios.
  - Repeats rotate no inputs: P1/P3 inputs (>= 67 MB) exceed the L2, and
    P2's 8 MB of inputs are read a handful of times against 5.4 GFLOP
    (FLOP-bound), so a warm L2 does not change its floor or its times much.
  - torch.compile runs in its default mode (max-autotune-no-cudagraphs
    would take minutes per shape; --compile-mode asks for it); its compile
    time is printed, not counted.
  - Eager baselines are launch-bound by nature at these sizes: their times
    include the Python and launch overhead (that is what (d) removes).
  - Long mnemo runs are repeated fewer times (--cap seconds of repeats per
    method), and a P3 point whose predicted cost does not fit the budget
    left is skipped with a note; all this is printed.

Usage (GPU machine, after tests/gpu/pack.sh here and `. tests/gpu/env.sh`
there; Python with torch, h5py, numpy):
  PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu.py [--cases P1,P1-lin,P1-c16,P2,P3,P1-qk]
      [--precision fp32|tf32|bf16] [--repeat 5] [--quick] [--out tests/bench/RESULTS.md]
  CPU check of the math (tiny sizes; mnemo's CPU engine, baselines (a), (b)):
  MNEMO=/path/to/mnemo /usr/bin/python3 tests/bench/bench_gpu.py --device cpu --quick
The binary is $MNEMO, else .carry/bin/mnemo, ./mnemo or mnemo on PATH.
The whole list is planned to fit --budget seconds (default 330): method
repeats stop after --cap seconds each, and cases that would not fit the time
left are skipped with a note (mnemo runs first, then the baselines).
"""
import argparse
import contextlib
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
LUA_HELPER = os.path.join(HERE, "bench_gpu_run.lua")

THETA, ETA, ALPHA, CLIP_MAX = 0.02, 0.9, 0.001, 1.0   # THETA: --theta
TOL = {"fp32": 1e-3, "tf32": 5e-3, "bf16": 3e-2}
METHODS = (("a", "eager autograd"), ("b", "eager manual bwd"), ("c", "torch.compile(b)"),
           ("d", "CUDA graph(b)"))


def say(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def make_cases(args):
    """[(name, cfg)] in run order. cfg: B, H, T, dk, dv, dh, layers, c, r."""
    cpu = args.device == "cpu"
    p1 = dict(B=4, H=32, T=4096, dk=64, dv=64, dh=256, layers=2, c=64, r=64)
    p2 = dict(B=1, H=1, T=2048, dk=512, dv=512, dh=512, layers=2, c=2048, r=2048)
    p3_T = [1024, 2048, 4096, 8192, 16384]
    h1 = dict(B=8, H=8, T=4096, dk=128, dv=128, dh=256, layers=2, c=64, r=64)
    h2 = dict(B=8, H=8, T=2048, dk=128, dv=128, dh=512, layers=2, c=64, r=64)
    l1 = dict(B=1, H=8, T=16384, dk=256, dv=256, dh=512, layers=2, c=1024, r=1024)
    m1 = dict(B=32, H=16, T=1024, dk=64, dv=64, dh=128, layers=2, c=8, r=8)
    if args.quick and cpu:      # the math at small sizes, in seconds
        p1.update(B=1, H=2, T=256)
        p2.update(T=512, dk=256, dv=256, dh=256, c=512, r=512)
        p3_T = [128, 256, 512]
        for cfg in (h1, h2, m1):
            cfg.update(B=1, H=2, T=256)
        l1.update(H=1, T=2048, c=512, r=512)
    elif args.quick:            # a smoke run on the GPU
        p1.update(T=1024)
        for cfg in (h1, h2, l1, m1):
            cfg.update(T=cfg["T"] // 4)
        p3_T = [256, 512, 1024, 2048]
    if args.p3_T:
        p3_T = [int(x) for x in args.p3_T.split(",")]
    table = {
        "P1": [("P1", dict(p1))],
        "P1-lin": [("P1-lin", dict(p1, layers=1, dh=0))],
        "P1-c16": [("P1-c16", dict(p1, c=16))],
        "P1-qk": [("P1-qk", dict(p1, qk_norm="l2"))],
        "P1-glu": [("P1-glu", dict(p1, glu=True))],
        "P1-ln": [("P1-ln", dict(p1, out_norm="layernorm"))],
        "P2": [("P2", dict(p2))],
        "P3": [("P3-T%d" % T, dict(p1, T=T)) for T in p3_T],
        "H1": [("H1", dict(h1))],
        "H2": [("H2", dict(h2))],
        "L1": [("L1", dict(l1))],
        "M1": [("M1", dict(m1))],
    }
    out = []
    for name in args.cases.split(","):
        name = name.strip()
        if name not in table:
            raise SystemExit("bench_gpu.py: unknown case %r (one of %s)" % (name, ", ".join(table)))
        out += table[name]
    return out


def describe(cfg):
    mem = "linear %d->%d" % (cfg["dk"], cfg["dv"]) if cfg["layers"] == 1 else \
        "MLP %d-%d-%d gelu" % (cfg["dk"], cfg["dh"], cfg["dv"])
    S = -(-cfg["T"] // cfg["c"])
    opts = "".join(" %s=%s" % (key, cfg[key]) for key in ("qk_norm", "out_norm") if cfg.get(key))
    opts += " glu" if cfg.get("glu") else ""
    return "B=%d H=%d T=%d %s c=%d r=%d%s (%d memories x %d steps)" % (
        cfg["B"], cfg["H"], cfg["T"], mem, cfg["c"], cfg["r"], opts, cfg["B"] * cfg["H"], S)


def layer_dims(cfg):
    """[(in, out)] per weight matrix (glu's U1 beside W1, last)."""
    if cfg["layers"] == 1:
        return [(cfg["dk"], cfg["dv"])]
    dims = [(cfg["dk"], cfg["dh"]), (cfg["dh"], cfg["dv"])]
    return dims + [(cfg["dk"], cfg["dh"])] if cfg.get("glu") else dims


def param_numel(cfg):
    n = sum(i * o for i, o in layer_dims(cfg))
    if cfg["layers"] >= 2:
        n += sum(o for _, o in layer_dims(cfg))  # biases
    return n


def flop_count(cfg):
    """Floating-point operations of one run (matrix products only; the
    elementwise work, O(params + tokens * width) per step, is left out).
    Per memory and step of n tokens, with sum(in*out) over the layers = P:
      gradient forward at Wbar:        2 n P
      backward: dW of every layer      2 n P
                dh of layers 2..L      2 n (P - dk*h1)   (no dx for layer 1)
      retrieval of the step's last token at W^(s+1): 2 P
      retrieval of the other n-1 tokens at W^(s): 0 when Wbar = W^(s) (r = c,
      or s opens its refresh block: the forward is reused), else 2 (n-1) P.
    P1: P = 64*256 + 256*64 = 32768 -> ~10.6 MFLOP per memory-step,
    128 memories x 64 steps = 86 GFLOP. P2: P = 2*512^2 -> 5.4 GFLOP."""
    dims = layer_dims(cfg)
    P = sum(i * o for i, o in dims)
    P_dh = P - sum(i * o for i, o in dims if i == cfg["dk"] and len(dims) > 1)   # no dx for W1, U1
    T, c, r = cfg["T"], cfg["c"], cfg["r"]
    total = 0
    for s in range(-(-T // c)):
        n = min(c, T - s * c)
        j = 0 if r == 0 else (s * c // r) * (r // c)
        total += 2 * n * P + 2 * n * P + 2 * n * P_dh + 2 * P
        if j != s:
            total += 2 * (n - 1) * P
    return total * cfg["B"] * cfg["H"]


def byte_count(cfg):
    """Fewest bytes a run must move through device memory, fp32 (4 bytes),
    each input read once, each output written once: k [B,H,T,dk] and v
    [B,H,T,dv] read (q = k); y [B,H,T,dv] and loss [B,H,T] written;
    grad_norm, clip_scale, skipped [B,H,S] written; initial W read, final W
    and S written (S starts at zero: not read); scalar gates ignored.
    P1: 4*128*(4096*(64+64+64+1) + 3*64 + 3*33088) = 456 MB."""
    T, S = cfg["T"], -(-cfg["T"] // cfg["c"])
    per_memory = T * (cfg["dk"] + 2 * cfg["dv"] + 1) + 3 * S + 3 * param_numel(cfg)
    return 4 * cfg["B"] * cfg["H"] * per_memory


# ---------------------------------------------------------------------------
# Inputs and experiment files
# ---------------------------------------------------------------------------

def param_names(cfg):
    """In the engine's order (model/param_layout.h): glu's U1, c1 last."""
    if cfg["layers"] == 1:
        return ["W1"]
    return ["W1", "b1", "W2", "b2"] + (["U1", "c1"] if cfg.get("glu") else [])


def make_data(cfg, dev, seed):
    """k, v [BH,T,d] and the initial parameters [BH,...] on dev, float32."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    BH, T, dk, dv, dh = cfg["B"] * cfg["H"], cfg["T"], cfg["dk"], cfg["dv"], cfg["dh"]
    randn = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=torch.float32)
    k = randn(BH, T, dk)
    k.mul_(math.sqrt(dk) / k.norm(dim=-1, keepdim=True))
    # values: a fixed random linear map of the keys per memory (RMS ~1 per
    # feature) plus noise, so there is something to learn
    A = randn(BH, dv, dk) / math.sqrt(dk)
    v = torch.bmm(k, A.mT)
    v.add_(0.1 * randn(BH, T, dv))
    if cfg["layers"] == 1:
        params = [randn(BH, dv, dk) / math.sqrt(dk)]
    else:
        params = [randn(BH, dh, dk) / math.sqrt(dk), 0.1 * randn(BH, dh),
                  randn(BH, dv, dh) / math.sqrt(dh), 0.1 * randn(BH, dv)]
        if cfg.get("glu"):   # the gate near 1 at the start: c1 ~ 1 + N(0, 0.01)
            params += [randn(BH, dh, dk) / math.sqrt(dk), 1.0 + 0.1 * randn(BH, dh)]
    return k, v, params


def write_experiment(path, cfg, k, v, params, T=None):
    """An experiment file (SPEC.md section 5); T < cfg T writes a prefix."""
    B, H = cfg["B"], cfg["H"]
    T = T or cfg["T"]
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        rule = dict(layers=cfg["layers"], activation="gelu", bias=1 if cfg["layers"] >= 2 else 0,
                    loss="mse", feature_reduce="mean", token_reduce="sum", step=cfg["c"],
                    refresh=cfg["r"], retrieve="after", clip="norm", clip_max=CLIP_MAX,
                    clip_scope="global")
        if cfg["layers"] >= 2:
            rule["hidden"] = cfg["dh"]
        for key in ("qk_norm", "out_norm"):
            if cfg.get(key):
                rule[key] = cfg[key]
        if cfg.get("glu"):
            rule["glu"] = 1
        for key, val in rule.items():
            r.attrs[key] = val
        i = f.create_group("inputs")
        i["k"] = k[:, :T].cpu().numpy().reshape(B, H, T, cfg["dk"])
        i["v"] = v[:, :T].cpu().numpy().reshape(B, H, T, cfg["dv"])
        g = f.create_group("gates")
        for key, val in (("theta", THETA), ("eta", ETA), ("alpha", ALPHA)):
            g[key] = np.float32(val)
        init = f.create_group("init")
        for name, p in zip(param_names(cfg), params):
            init[name] = p.cpu().numpy().reshape((B, H) + tuple(p.shape[1:]))


def read_result(path, cfg):
    """y [BH,T,dv] and final W1 [BH,...] of a result file, as numpy."""
    BH = cfg["B"] * cfg["H"]
    with h5py.File(path, "r") as f:
        y = np.asarray(f["outputs/y"][()], np.float32)
        w1 = np.asarray(f["final/W1"][()], np.float32)
        skipped = float(np.asarray(f["outputs/skipped"][()]).sum())
        clip = np.asarray(f["outputs/clip_scale"][()], np.float64)
        loss = np.asarray(f["outputs/loss"][()], np.float64)
    info = dict(skipped=skipped, clipped=float((clip < 1).mean()), loss_first=float(loss[..., :cfg["c"]].mean()),
                loss_last=float(loss[..., -cfg["c"]:].mean()))
    return y.reshape(BH, cfg["T"], cfg["dv"]), w1.reshape((BH,) + w1.shape[2:]), info


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def time_runs(fn, dev, warmup, repeat, cap_s):
    """Run fn warmup times, then up to repeat timed times (CUDA events on
    the GPU, perf_counter on the CPU), stopping once cap_s seconds were
    spent (at least one timed run). Returns (times in s, fn's last result)."""
    out = None
    for _ in range(warmup):
        out = None
        out = fn()
    sync(dev)
    times, spent = [], 0.0
    for _ in range(repeat):
        out = None
        if dev == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn()
            e1.record()
            e1.synchronize()
            t = e0.elapsed_time(e1) / 1e3
        else:
            t0 = time.perf_counter()
            out = fn()
            t = time.perf_counter() - t0
        times.append(t)
        spent += t
        if spent > cap_s:
            break
    return times, out


def median(xs):
    return float(statistics.median(xs)) if xs else None


def fmt_t(t):
    """Seconds as milliseconds, 3-4 significant digits."""
    if t is None:
        return "-"
    ms = t * 1e3
    if ms >= 100:
        return "%.0f" % ms
    if ms >= 10:
        return "%.1f" % ms
    if ms >= 1:
        return "%.2f" % ms
    return "%.3f" % ms


def spread(xs):
    return "%s..%s ms, n=%d" % (fmt_t(min(xs)), fmt_t(max(xs)), len(xs)) if xs else "-"


def set_matmul_precision(prec):
    """fp32 and bf16: IEEE fp32 for float32 matmuls; tf32: TF32 allowed
    (the same switch as torch.backends.cuda.matmul.allow_tf32)."""
    torch.set_float32_matmul_precision("high" if prec == "tf32" else "highest")


def measure_ceilings(dev):
    """Bandwidth of a device-to-device copy (bytes read + written) and
    matmul rates in fp32, tf32 and bf16 (random data, median of 10 after 3
    warm-ups)."""
    if dev == "cuda":
        n_copy, n_mm, reps = 1 << 28, 8192, 10        # 1 GiB; 1.1 TFLOP per product
    else:
        n_copy, n_mm, reps = 1 << 24, 1024, 5
    def copy_time():
        src = torch.rand(n_copy, device=dev)
        dst = torch.empty_like(src)
        return median(time_runs(lambda: dst.copy_(src), dev, 3, reps, 1e9)[0])

    def mm_time(prec):
        set_matmul_precision(prec)
        a = torch.randn(n_mm, n_mm, device=dev)
        b = torch.randn(n_mm, n_mm, device=dev)
        if prec == "bf16":
            a, b = a.bfloat16(), b.bfloat16()
        return median(time_runs(lambda: torch.mm(a, b), dev, 3, reps, 1e9)[0])

    bw = 2 * 4 * n_copy / copy_time()
    rates = {prec: 2 * n_mm ** 3 / mm_time(prec) for prec in ("fp32", "tf32", "bf16")
             if dev == "cuda" or prec == "fp32"}
    if dev == "cuda":
        torch.cuda.empty_cache()
    return bw, rates


# ---------------------------------------------------------------------------
# PyTorch baselines
# ---------------------------------------------------------------------------

def make_rule_fns(layers, dv, glu=False, out_norm=None):
    """The rule's pieces as functions of tensors (constants closed over), so
    that torch.compile and graph capture see plain tensor code. Parameter
    lists: [W1] (linear) or [W1, b1, W2, b2] (+ [U1, c1] with glu); tensors
    [BH, ...]. out_norm: None or "layernorm" (g = 1, beta = 0)."""
    theta, eta, alpha, cmax = THETA, ETA, ALPHA, CLIP_MAX
    dy_scale = 2.0 * theta / dv   # d/dy of theta * mean_j (y - v)^2

    def up(t):
        # under bf16 autocast the products return bf16: the elementwise work
        # stays fp32 (nothing to do in fp32 and tf32)
        return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t

    def norm(o):
        return F.layer_norm(o, (dv,), eps=1e-6) if out_norm else o

    def forward(P, x):
        if layers == 1:
            return up(torch.bmm(x, P[0].mT))
        h = F.gelu(up(torch.baddbmm(P[1].unsqueeze(1), x, P[0].mT)))
        if glu:
            h = h * up(torch.baddbmm(P[5].unsqueeze(1), x, P[4].mT))
        return norm(up(torch.baddbmm(P[3].unsqueeze(1), h, P[2].mT)))

    def grads_manual(P, x, v):
        """y, per-token loss [BH,n] and the step gradient, by hand."""
        if layers == 1:
            y = up(torch.bmm(x, P[0].mT))
            r = y - v
            dy = r * dy_scale
            return y, r.square().mean(-1), [up(torch.bmm(dy.mT, x))]
        W1, b1, W2, b2 = P[:4]
        z = up(torch.baddbmm(b1.unsqueeze(1), x, W1.mT))
        a = F.gelu(z)
        if glu:
            u = up(torch.baddbmm(P[5].unsqueeze(1), x, P[4].mT))
            h = a * u
        else:
            h = a
        o = up(torch.baddbmm(b2.unsqueeze(1), h, W2.mT))
        if out_norm:   # layer norm and its backward over the dv features
            mu = o.mean(-1, keepdim=True)
            rstd = torch.rsqrt((o - mu).square().mean(-1, keepdim=True) + 1e-6)
            xhat = (o - mu) * rstd
            y = xhat
        else:
            y = o
        r = y - v
        dy = r * dy_scale
        if out_norm:
            do = rstd * (dy - dy.mean(-1, keepdim=True) - xhat * (dy * xhat).mean(-1, keepdim=True))
        else:
            do = dy
        dW2 = up(torch.bmm(do.mT, h))
        dh = up(torch.bmm(do, W2))
        if glu:
            dz = torch.ops.aten.gelu_backward(dh * u, z)
            du = dh * a
            return y, r.square().mean(-1), [up(torch.bmm(dz.mT, x)), dz.sum(1), dW2, do.sum(1),
                                            up(torch.bmm(du.mT, x)), du.sum(1)]
        dz = torch.ops.aten.gelu_backward(dh, z)
        dW1 = up(torch.bmm(dz.mT, x))
        return y, r.square().mean(-1), [dW1, dz.sum(1), dW2, do.sum(1)]

    def update(W, S, G):
        """Global norm clip, momentum, decay, and the non-finite guard
        (SPEC.md section 2). Returns new lists and |G| [BH]."""
        sq = G[0].square().flatten(1).sum(1)
        for g in G[1:]:
            sq = sq + g.square().flatten(1).sum(1)
        norm = sq.sqrt()
        scale = (cmax / norm).clamp(max=1.0)   # |G| = 0: inf -> 1
        keep = torch.isfinite(sq)
        W_new, S_new = [], []
        for w, s, g in zip(W, S, G):
            shape = (-1,) + (1,) * (g.dim() - 1)
            kp = keep.view(shape)
            s1 = eta * s - g * scale.view(shape)
            w1 = (1.0 - alpha) * w + s1
            S_new.append(torch.where(kp, s1, s))
            W_new.append(torch.where(kp, w1, w))
        return W_new, S_new, norm

    def step_manual(W, S, Wbar, x, v, fresh):
        """One step with the hand-written backward; fresh: Wbar is W^(s)."""
        y, loss, G = grads_manual(Wbar, x, v)
        W1, S1, norm = update(W, S, G)
        y_first = y[:, :-1] if fresh else forward(W, x[:, :-1])
        return W1, S1, y_first, forward(W1, x[:, -1:]), loss, norm

    def step_autograd(W, S, Wbar, x, v, fresh):
        """One step as titans-pytorch does it: autograd of the weighted loss."""
        Pg = [p.detach().requires_grad_(True) for p in Wbar]
        y = forward(Pg, x)
        loss = (y - v).pow(2).mean(-1)
        G = torch.autograd.grad((theta * loss).sum(), Pg)
        with torch.no_grad():
            W1, S1, norm = update(W, S, list(G))
            y_first = y.detach()[:, :-1] if fresh else forward(W, x[:, :-1])
            return W1, S1, y_first, forward(W1, x[:, -1:]), loss.detach(), norm

    return step_manual, step_autograd


_RULE_FNS, _COMPILED = {}, {}


def rule_key(cfg):
    return cfg["layers"], cfg["dv"], bool(cfg.get("glu")), cfg.get("out_norm")


def rule_fns(cfg):
    """make_rule_fns, one set per rule shape: the same function objects for
    every case of that shape, so torch.compile's guards (on the closures)
    keep holding and P3's lengths reuse P1's compiled step."""
    key = rule_key(cfg)
    if key not in _RULE_FNS:
        _RULE_FNS[key] = make_rule_fns(*key)
    return _RULE_FNS[key]


def compiled_step(cfg, mode):
    key = rule_key(cfg) + (mode,)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(rule_fns(cfg)[0], mode=mode, dynamic=False)
    return _COMPILED[key]


def run_sequence(step, cfg, W0, S0, kc, vc, y_out, loss_out, gn):
    """The step loop of SPEC.md section 2 (retrieve after, q = k), writing
    y_out [BH,T,dv], loss_out [BH,T], gn [BH,S]; returns final W, S.
    kc, vc: the inputs by step (chunks(), contiguous [BH,n,d] each)."""
    T, c, r = cfg["T"], cfg["c"], cfg["r"]
    W, S, anchor = list(W0), list(S0), list(W0)
    for s in range(-(-T // c)):
        lo, hi = s * c, min(T, (s + 1) * c)
        j = 0 if r == 0 else (s * c // r) * (r // c)   # first step of s's refresh block
        fresh = j == s
        if fresh:
            anchor = W
        W, S, y_first, y_last, loss, norm = step(W, S, anchor, kc[s], vc[s], fresh)
        y_out[:, lo:hi - 1] = y_first
        y_out[:, hi - 1:hi] = y_last
        loss_out[:, lo:hi] = loss
        gn[:, s] = norm
    return W, S


def chunks(x, c):
    """[BH,T,d] -> the per-step inputs: one contiguous [S,BH,c,d] tensor when
    c divides T (its slices have the same strides for every T, so a compiled
    step is not specialised again for each P3 length), else slices."""
    BH, T, d = x.shape
    if T % c == 0:
        return x.view(BH, T // c, c, d).transpose(0, 1).contiguous()
    return [x[:, lo:lo + c] for lo in range(0, T, c)]


class Baselines:
    def __init__(self, cfg, k, v, params, prec, dev):
        self.cfg, self.k, self.v, self.W0, self.dev = cfg, k, v, params, dev
        self.S0 = [torch.zeros_like(p) for p in params]
        BH, T = k.shape[0], cfg["T"]
        self.y = torch.empty(BH, T, cfg["dv"], device=dev)
        self.loss = torch.empty(BH, T, device=dev)
        self.gn = torch.empty(BH, -(-T // cfg["c"]), device=dev)
        self.kc, self.vc = chunks(k, cfg["c"]), chunks(v, cfg["c"])
        self.step_manual, self.step_autograd = rule_fns(cfg)
        self.prec = prec

    def autocast(self):
        if self.prec == "bf16":
            return torch.autocast(device_type=self.dev, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def runner(self, step):
        def run():
            kc = self.kc
            if self.cfg.get("qk_norm") == "l2":
                # SPEC v2's qk_norm = l2, timed: x / sqrt(sum x^2 + 1e-6)
                kn = self.k * torch.rsqrt((self.k * self.k).sum(-1, keepdim=True) + 1e-6)
                kc = chunks(kn, self.cfg["c"])
            with self.autocast():
                return run_sequence(step, self.cfg, self.W0, self.S0, kc, self.vc, self.y, self.loss, self.gn)
        return run

    def graph_runner(self):
        """Capture (b)'s whole loop in one CUDA graph; returns replay and the
        graph's final W (valid after each replay)."""
        body = self.runner(self.step_manual)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()          # warm-up off the capture: cuBLAS handles, workspaces
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            W, S = body()
        self.graph = graph
        self.graph_out = (W, S)

        def replay():
            graph.replay()
            return self.graph_out
        return replay


def rel(a, b):
    """|a - b| / |b| (L2) of two tensors on the same device."""
    a, b = a.float(), b.float()
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return num / den if den > 0 else float("inf")


# ---------------------------------------------------------------------------
# mnemo
# ---------------------------------------------------------------------------

class MnemoError(Exception):
    pass


def find_mnemo():
    cand = [os.environ.get("MNEMO"), os.path.join(os.getcwd(), ".carry", "bin", "mnemo"),
            os.path.join(os.getcwd(), "mnemo"), shutil.which("mnemo")]
    for c in cand:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise SystemExit("bench_gpu.py: no mnemo binary: set MNEMO (tried %s)" % ", ".join(c for c in cand if c))


def mnemo_cli(mnemo, exp, res, dev, prec, env, timeout):
    """Wall seconds of one `mnemo run` process."""
    cmd = [mnemo, "run", exp, "-o", res, "--device", dev, "--precision", prec]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=max(timeout, 5))
    except subprocess.TimeoutExpired:
        raise MnemoError("%s: timed out after %.0f s" % (" ".join(cmd), timeout))
    t = time.perf_counter() - t0
    if p.returncode != 0:
        raise MnemoError("%s: exit %d: %s" % (" ".join(cmd), p.returncode,
                                              (p.stderr or p.stdout).strip()[-600:]))
    return t


def mnemo_lua(mnemo, full, tiny, dev, prec, repeat, cap, save, env, timeout):
    """Run bench_gpu_run.lua; returns {key: [seconds...]} and notes."""
    cmd = [mnemo, "-q", LUA_HELPER, full, tiny, dev, prec, str(repeat), "%.3f" % cap, save]
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=max(timeout, 5))
    except subprocess.TimeoutExpired:
        raise MnemoError("%s: timed out after %.0f s" % (" ".join(cmd), timeout))
    out, notes = {}, []
    for line in (p.stdout or "").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "MNEMO_LUA":
            out.setdefault(parts[1], []).append(float(parts[2]))
        elif line.startswith("MNEMO_LUA_NOTE"):
            notes.append(line[len("MNEMO_LUA_NOTE "):])
    if p.returncode != 0 or "MNEMO_LUA_DONE" not in p.stdout:
        raise MnemoError("%s: exit %d: %s" % (" ".join(cmd), p.returncode,
                                              (p.stderr + p.stdout).strip()[-800:]))
    return out, notes


# ---------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------

class Clock:
    def __init__(self, budget):
        self.t0, self.budget = time.time(), budget

    def left(self):
        return self.budget - (time.time() - self.t0)


def run_case(name, cfg, args, env, work, ceil, clock, cases_left, predict):
    dev, prec = args.device, args.precision
    T = cfg["T"]
    rec = dict(name=name, cfg=cfg, desc=describe(cfg), methods={}, notes=[])
    say("\n== %s: %s  [%.0f s of budget left]" % (name, rec["desc"], clock.left()))

    fl, by = flop_count(cfg), byte_count(cfg)
    t_fl, t_by = fl / ceil["rates"][prec], by / ceil["bw"]
    rec.update(flops=fl, bytes=by, floor=max(t_fl, t_by), bound="FLOP" if t_fl >= t_by else "bytes")
    say("   floor: %.3g GFLOP / %.1f TFLOP/s = %s ms; %.0f MB / %.0f GB/s = %s ms -> %s ms (%s-bound)" % (
        fl / 1e9, ceil["rates"][prec] / 1e12, fmt_t(t_fl), by / 1e6, ceil["bw"] / 1e9, fmt_t(t_by),
        fmt_t(rec["floor"]), rec["bound"]))

    # a per-method time cap that leaves room for what is still to come
    cap = max(1.0, min(args.cap, clock.left() / (3.0 * max(cases_left, 1))))

    t0 = time.time()
    k, v, params = make_data(cfg, dev, seed=args.seed)
    exp = os.path.join(work, name + ".h5")
    tiny_T = min(cfg["c"], 64, T)
    tiny = os.path.join(work, name + "_tiny.h5")
    write_experiment(exp, cfg, k, v, params)
    write_experiment(tiny, cfg, k, v, params, T=tiny_T)
    say("   inputs made and written in %.1f s (%s, %.0f MB)" % (time.time() - t0, exp, os.path.getsize(exp) / 1e6))

    # ---- mnemo
    m = dict(lua={}, cli_full=[], cli_tiny=[], notes=[])
    rec["mnemo"] = m
    res_cli, res_lua = os.path.join(work, name + "_res.h5"), os.path.join(work, name + "_lua_res.h5")
    res_tiny = os.path.join(work, name + "_tiny_res.h5")
    result_path = None
    est = predict(cfg)          # expected seconds of one full rule:run, if known
    if est is not None and 2.5 * est > clock.left() - 20:
        m["notes"].append("mnemo skipped: one run predicted at %.0f s, %.0f s of budget left" % (est, clock.left()))
        say("   " + m["notes"][-1])
    else:
        try:
            # compiles the kernel into MNEMO_CACHE (untimed); the runs below load it
            t = mnemo_cli(args.mnemo, tiny, res_tiny, dev, prec, env, clock.left())
            say("   mnemo run tiny (T=%d, first: compile/cache fill) %.2f s" % (tiny_T, t))
            lua, notes = mnemo_lua(args.mnemo, exp, tiny, dev, prec, args.repeat + 1, cap, res_lua, env,
                                   clock.left())
            m["lua"], m["notes"] = lua, m["notes"] + notes
            runs = lua.get("run", [])
            m["run_all"] = runs
            # the first full run also grows the allocator: a warm-up when there are more
            m["run"] = median(runs[1:] if len(runs) > 1 else runs)
            m["staging"] = median(lua.get("staging", []))
            result_path = res_lua
            say("   mnemo rule:run (Lua, mnemo.profile wall): %s ms [%s floor] median of %s (all: %s ms); "
                "staging est. (not in rule:run: inputs are resident) %s ms; tiny-T rule:run %s ms" % (
                    fmt_t(m["run"]), pct(rec["floor"], m["run"]),
                    "runs 2.." if len(runs) > 1 else "1 run (no full-size warm-up)",
                    ", ".join(fmt_t(x) for x in runs), fmt_t(m["staging"]),
                    fmt_t(median(lua.get("tiny_run", [])))))
            for n in notes:
                say("   note: " + n)
            # whole processes: tiny twice, full twice when that fits
            for _ in range(2):
                m["cli_tiny"].append(mnemo_cli(args.mnemo, tiny, res_tiny, dev, prec, env, clock.left()))
            n_full = 2 if m["run"] < cap else (1 if m["run"] < 3 * cap else 0)
            for _ in range(n_full):
                m["cli_full"].append(mnemo_cli(args.mnemo, exp, res_cli, dev, prec, env, clock.left()))
                result_path = res_cli
            if n_full < 2:
                m["notes"].append("mnemo run CLI timed %d time(s), not 2: one run takes %.1f s, cap %.1f s"
                                  % (n_full, m["run"], cap))
                say("   note: " + m["notes"][-1])
            m["cli_raw"] = median(m["cli_full"])
            m["cli_tiny_t"] = median(m["cli_tiny"])
            m["cli_sub"] = m["cli_raw"] - m["cli_tiny_t"] if m["cli_full"] else None
            say("   mnemo run CLI (whole process): raw %s ms; tiny-T (T=%d) %s ms; raw - tiny = %s ms" % (
                ", ".join(fmt_t(x) for x in m["cli_full"]) or "-", tiny_T,
                ", ".join(fmt_t(x) for x in m["cli_tiny"]), fmt_t(m["cli_sub"])))
        except MnemoError as e:
            m["notes"].append("mnemo failed: %s" % e)
            say("   MNEMO FAILED: %s" % e)
    y_ref = w_ref = None
    if result_path and os.path.exists(result_path):
        y_np, w_np, info = read_result(result_path, cfg)
        y_ref, w_ref = torch.from_numpy(y_np).to(dev), torch.from_numpy(w_np).to(dev)
        rec["dynamics"] = info
        say("   mnemo result: skipped steps %d, clip active on %.0f%% of steps, loss first step %.3f, last %.3f" % (
            info["skipped"], 100 * info["clipped"], info["loss_first"], info["loss_last"]))
        del y_np, w_np

    # ---- PyTorch baselines
    base = Baselines(cfg, k, v, params, prec, dev)
    for key, label in METHODS:
        mr = dict(label=label, status="ok")
        rec["methods"][key] = mr
        try:
            if key in ("c", "d") and dev != "cuda":
                mr["status"] = "skipped on cpu"
                say("   (%s) %s: skipped (CPU run: torch.compile and CUDA graphs are GPU baselines here)"
                    % (key, label))
                continue
            if clock.left() < 15:
                mr["status"] = "skipped: budget"
                say("   (%s) %s: skipped, budget spent" % (key, label))
                continue
            t0 = time.time()
            if key == "a":
                fn = base.runner(base.step_autograd)
            elif key == "b":
                fn = base.runner(base.step_manual)
            elif key == "c":
                if not hasattr(torch, "compile"):
                    raise RuntimeError("torch %s has no torch.compile" % torch.__version__)
                if clock.left() < 60:
                    mr["status"] = "skipped: budget"
                    say("   (c) %s: skipped, %.0f s left (compiling takes tens of seconds)" % (label, clock.left()))
                    continue
                fn = base.runner(compiled_step(cfg, args.compile_mode))
                fn()                 # compiles (each distinct shape or branch once)
                sync(dev)
                mr["compile_s"] = time.time() - t0
            else:
                fn = base.graph_runner()
                sync(dev)
                mr["capture_s"] = time.time() - t0
            # poison the outputs: the runs below must write every element
            for buf in (base.y, base.loss, base.gn):
                buf.fill_(float("nan"))
            times, out = time_runs(fn, dev, 1, args.repeat, cap)
            W, _ = out
            mr["times"], mr["time"] = times, median(times)
            extra = ""
            if "compile_s" in mr:
                extra = "; compile + first run %.1f s" % mr["compile_s"]
            if "capture_s" in mr:
                extra = "; warm-up + capture %.1f s" % mr["capture_s"]
            if y_ref is not None:
                mr["err_y"], mr["err_w"] = rel(base.y, y_ref), rel(W[0], w_ref)
                ok = max(mr["err_y"], mr["err_w"]) < TOL[prec]   # False on NaN: an unwritten element
                mr["agree"] = ok
                extra += "; vs mnemo: y %.1e, W1 %.1e %s" % (mr["err_y"], mr["err_w"],
                                                             "ok" if ok else "DISAGREE (tol %g)" % TOL[prec])
            ratio = ""
            if m.get("run"):
                ratio = "; %.2fx mnemo's rule:run time" % (mr["time"] / m["run"])
            say("   (%s) %-18s %s ms [%s floor] (%s)%s%s" % (key, label, fmt_t(mr["time"]),
                                                          pct(rec["floor"], mr["time"]), spread(times), ratio, extra))
        except Exception as e:  # noqa: BLE001 (a failed baseline is reported, the run goes on)
            msg = str(e).strip().splitlines()
            mr["status"] = "failed: %s: %s" % (type(e).__name__, msg[0][:200] if msg else "")
            say("   (%s) %s FAILED: %s" % (key, label, mr["status"]))
        finally:
            fn = out = W = None
            if key == "d" and hasattr(base, "graph"):
                del base.graph, base.graph_out
    del base, k, v, params, y_ref, w_ref
    if dev == "cuda":
        torch.cuda.empty_cache()
    for p in (exp, tiny, res_cli, res_lua, res_tiny):
        if os.path.exists(p):
            os.unlink(p)
    return rec


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def pct(floor, t):
    return "%.1f%%" % (100 * floor / t) if t else "-"


def tables(recs, prec, ceil):
    lines = ["Ceilings measured here: copy %.0f GB/s (read + write); matmul %s." % (
        ceil["bw"] / 1e9, ", ".join("%s %.1f TFLOP/s" % (p, r / 1e12) for p, r in ceil["rates"].items())),
        "",
        "Times in ms (median after warm-up). mnemo rule:run: in-process wall time of the engine call "
        "(mnemo.profile; inputs already on the device, as the baselines'; staging est.: what a host upload "
        "of k and v would add, not included). CLI raw: whole `mnemo run` process; "
        "- tiny: minus a T=min(c,64) run. Baselines: time (baseline / mnemo rule:run: above 1 = mnemo "
        "faster). %% floor = floor / time. Precision %s." % prec,
        "",
        "| case | floor (bound) | mnemo rule:run [% floor] | staging est. | CLI raw / - tiny "
        "| (a) eager autograd | (b) eager manual | (c) compile(b) | (d) CUDA graph(b) | best baseline % floor |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        m = r["mnemo"]
        run = m.get("run")
        cells = []
        best = None
        for key, _ in METHODS:
            mr = r["methods"].get(key, {})
            t = mr.get("time")
            if t is None:
                cells.append(mr.get("status", "-").split(":")[0])
                continue
            best = t if best is None else min(best, t)
            cells.append("%s (%s)" % (fmt_t(t), "%.2fx" % (t / run) if run else "-"))
        lines.append("| %s | %s (%s) | %s [%s] | %s | %s / %s | %s | %s |" % (
            r["name"], fmt_t(r["floor"]), r["bound"], fmt_t(run), pct(r["floor"], run), fmt_t(m.get("staging")),
            fmt_t(m.get("cli_raw")), fmt_t(m.get("cli_sub")), " | ".join(cells), pct(r["floor"], best)))
    lines += ["", "Agreement with mnemo's result, relative L2 error of y / final W1 (tolerance %g):" % TOL[prec], "",
              "| case | (a) | (b) | (c) | (d) |", "|---|---|---|---|---|"]
    for r in recs:
        cells = []
        for key, _ in METHODS:
            mr = r["methods"].get(key, {})
            if "err_y" in mr:
                cells.append("%.1e / %.1e%s" % (mr["err_y"], mr["err_w"], "" if mr["agree"] else " FAIL"))
            else:
                cells.append(mr.get("status", "-").split(":")[0] if mr.get("status") != "ok" else "no mnemo result")
        lines.append("| %s | %s |" % (r["name"], " | ".join(cells)))
    p3 = [r for r in recs if r["name"].startswith("P3-")]
    if p3:
        lines += ["", "P3: time per token (ns per memory-token = time / (B*H*T)):", "",
                  "| T | mnemo rule:run | (a) | (b) | (c) | (d) |", "|---|---|---|---|---|---|"]
        for r in p3:
            ntok = r["cfg"]["B"] * r["cfg"]["H"] * r["cfg"]["T"]
            cells = [r["mnemo"].get("run")] + [r["methods"].get(k, {}).get("time") for k, _ in METHODS]
            lines.append("| %d | %s |" % (r["cfg"]["T"], " | ".join(
                "%.2f" % (t / ntok * 1e9) if t else "-" for t in cells)))
    notes = [(r["name"], n) for r in recs for n in r["mnemo"]["notes"] + r["notes"]]
    if notes:
        lines += [""] + ["- %s: %s" % n for n in notes]
    return lines


# ---------------------------------------------------------------------------

def main():
    global THETA
    ap = argparse.ArgumentParser(
        description="GPU benchmark: mnemo vs PyTorch baselines of the same rule (see the module docstring)")
    ap.add_argument("--cases", default="P1,P1-lin,P1-c16,P2,P3,P1-qk")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats per method (after a warm-up)")
    ap.add_argument("--quick", action="store_true", help="smaller T (and, on the CPU, fewer memories)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=None, help="append the tables to this markdown file")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the whole list (default 330)")
    ap.add_argument("--cap", type=float, default=8.0, help="seconds of timed repeats per method (default 8)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode for (c): default or max-autotune-no-cudagraphs (slow to compile)")
    ap.add_argument("--p3-T", default=None, help="comma-separated T list for P3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--theta", type=float, default=THETA, help="learning rate gate (default %g)" % THETA)
    ap.add_argument("--mnemo", default=None, help="the mnemo binary (default $MNEMO, .carry/bin/mnemo, ./mnemo)")
    args = ap.parse_args()
    THETA = args.theta
    clock = Clock(args.budget)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device visible to torch (use --device cpu to check the math)")
    if dev == "cpu" and args.precision != "fp32":
        raise SystemExit("bench_gpu.py: the CPU engine computes in fp32 only: --device cpu needs --precision fp32")
    args.mnemo = os.path.abspath(args.mnemo) if args.mnemo else find_mnemo()
    if not os.path.exists(LUA_HELPER):
        raise SystemExit("bench_gpu.py: missing %s" % LUA_HELPER)
    cases = make_cases(args)
    gpu = torch.cuda.get_device_name(0) if dev == "cuda" else (platform.processor() or platform.machine())
    version = subprocess.run([args.mnemo, "--version"], stdout=subprocess.PIPE, text=True).stdout.splitlines()
    say("bench_gpu.py: %s on %s; torch %s; %s; precision %s; cases %s; budget %.0f s" % (
        version[0] if version else "mnemo", gpu, torch.__version__, args.mnemo, args.precision,
        ",".join(n for n, _ in cases), args.budget))
    if dev == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
        say("CPU run: checks the math (mnemo's CPU engine vs baselines (a), (b)); "
            "torch.compile (c) and CUDA graphs (d) are skipped on the CPU")
    t0 = time.time()
    bw, rates = measure_ceilings(dev)
    ceil = dict(bw=bw, rates=rates)
    say("ceilings (%.1f s): copy %.0f GB/s (read + write); matmul %s" % (
        time.time() - t0, bw / 1e9, ", ".join("%s %.1f TFLOP/s" % (p, r / 1e12) for p, r in rates.items())))
    set_matmul_precision(args.precision)

    work = tempfile.mkdtemp(prefix="mnemo-bench-gpu-")
    env = dict(os.environ)
    env.setdefault("MNEMO_CACHE", os.path.join(work, "kernel-cache"))
    # the timed runs use the full compile's kernels (a new rule's first run
    # would take the fast tier, kernels/cuda_module.c)
    env.setdefault("MNEMO_COMPILE", "full")
    recs, done = [], {}
    per_token = {}   # T -> seconds per token of a P1-like rule:run, to predict P3's longer runs

    def predict(cfg):
        key = (cfg["layers"], cfg["c"], cfg["dk"], cfg["dh"], cfg["B"] * cfg["H"])
        return per_token[key] * cfg["T"] if key in per_token else None

    try:
        for i, (name, cfg) in enumerate(cases):
            key = tuple(sorted(cfg.items()))
            if key in done:     # P3's T=4096 is P1: reuse it
                rec = dict(done[key], name=name)
                say("\n== %s: the same run as %s, reused" % (name, done[key]["name"]))
                recs.append(rec)
                continue
            if clock.left() < 15:
                say("\n== %s: skipped, budget spent" % name)
                continue
            rec = run_case(name, cfg, args, env, work, ceil, clock, len(cases) - i, predict)
            recs.append(rec)
            done[key] = rec
            if rec["mnemo"].get("run"):
                pk = (cfg["layers"], cfg["c"], cfg["dk"], cfg["dh"], cfg["B"] * cfg["H"])
                per_token[pk] = rec["mnemo"]["run"] / cfg["T"]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = tables(recs, args.precision, ceil)
    say("\n" + "\n".join(lines))
    say("\ntotal %.0f s" % (time.time() - clock.t0))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n## GPU benchmark: mnemo vs PyTorch (%s, %s, torch %s, %s%s)\n\n" % (
                time.strftime("%Y-%m-%d"), gpu, torch.__version__, args.precision, ", quick" if args.quick else ""))
            f.write("Cases: " + "; ".join("%s: %s" % (r["name"], r["desc"]) for r in recs) + ".\n\n")
            f.write("\n".join(lines) + "\n")
        say("appended to %s" % args.out)
    bad = [r["name"] for r in recs for mr in r["methods"].values() if mr.get("agree") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
