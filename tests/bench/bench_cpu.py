#!/usr/bin/env python3
"""CPU benchmark (not a test): mnemo's CPU engine against PyTorch on the CPU,
same rule, same inputs, same thread count.

Case (issue 3): B*H = 8 memories, T = 4096 tokens, d = 64, an MLP memory
64-256-64 (silu, biases), mse loss, step c = 64 (refresh = c, retrieve
after), momentum 0.9, decay 0.001, theta 0.05, global norm clip 1.0.

mnemo: the engine call timed in-process (rule:run under mnemo.profile, the
same footing as the in-process PyTorch timing), and also the whole `mnemo run`
process (start-up and HDF5 I/O included). PyTorch: the eager form that
titans-pytorch style code uses: per step, a batched forward over all
memories, torch.autograd.grad, clip, momentum and decay; retrieval reuses the
step's forward for all but its last token, as the engine does.
Both outputs are compared (relative L2 of y and of the final weights).

With --grad, also the backward of SPEC.md section 7 (issue 12): rule:run
alone against rule:run{grad = true} plus res:backward{dy = ...} in-process,
with the backward's memory report (target: forward plus backward at most 3x
the forward).

Usage: bench_cpu.py [--threads N] [--repeat R] [--T T] [--grad] [--out RESULTS.md]
"""
import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F


def make_inputs(BH, T, d, dh, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, BH, T, d)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = (0.5 * rng.standard_normal((1, BH, T, d))).astype(np.float32)
    W1 = (rng.standard_normal((BH, dh, d)) / np.sqrt(d)).astype(np.float32)
    W2 = (rng.standard_normal((BH, d, dh)) / np.sqrt(dh)).astype(np.float32)
    b1 = np.zeros((BH, dh), np.float32)
    b2 = np.zeros((BH, d), np.float32)
    return k, v, dict(W1=W1, b1=b1, W2=W2, b2=b2)


RULE = dict(layers=2, activation="silu", bias=1, loss="mse", step=64, refresh=64, retrieve="after",
            clip="norm", clip_max=1.0, clip_scope="global")
GATES = dict(theta=0.05, eta=0.9, alpha=0.001)


def write_experiment(path, k, v, params, dh):
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        for key, val in RULE.items():
            r.attrs[key] = val
        r.attrs["hidden"] = dh
        i = f.create_group("inputs")
        i["k"], i["v"] = k, v
        g = f.create_group("gates")
        for key, val in GATES.items():
            g[key] = np.float32(val)
        init = f.create_group("init")
        for key, val in params.items():
            init[key] = val[None]  # [B=1, H, ...]


def torch_run(k, v, params, c):
    """Eager autograd, batched over memories: [BH, ...] parameters."""
    k = torch.from_numpy(k[0])
    v = torch.from_numpy(v[0])
    P = {n: torch.from_numpy(p.copy()) for n, p in params.items()}
    S = {n: torch.zeros_like(p) for n, p in P.items()}
    names = ["W1", "b1", "W2", "b2"]
    theta, eta, alpha, cmax = GATES["theta"], GATES["eta"], GATES["alpha"], RULE["clip_max"]
    BH, T, d = k.shape
    y_out = torch.empty(BH, T, v.shape[-1])

    def forward(p, x):
        h = F.silu(torch.baddbmm(p["b1"].unsqueeze(1), x, p["W1"].transpose(1, 2)))
        return torch.baddbmm(p["b2"].unsqueeze(1), h, p["W2"].transpose(1, 2))

    for s0 in range(0, T, c):
        ks, vs = k[:, s0:s0 + c], v[:, s0:s0 + c]
        p = {n: P[n].requires_grad_(True) for n in names}
        y = forward(p, ks)
        loss = ((y - vs) ** 2).mean(-1)
        grads = torch.autograd.grad((theta * loss).sum(), [p[n] for n in names])
        with torch.no_grad():
            y_out[:, s0:s0 + c - 1] = y[:, :-1]
            sq = sum(g.pow(2).flatten(1).sum(1) for g in grads)
            scale = torch.clamp(cmax / sq.sqrt(), max=1.0)
            for n, g in zip(names, grads):
                sh = (BH,) + (1,) * (g.dim() - 1)
                S[n] = eta * S[n] - g * scale.view(sh)
                P[n] = (1 - alpha) * P[n].detach() + S[n]
            y_out[:, s0 + c - 1:s0 + c] = forward(P, ks[:, -1:])
    return y_out.numpy(), {n: P[n].detach().numpy() for n in names}


def torch_grad_run(k, v, params, c, dy):
    """The same rule as one autograd graph, titans-pytorch's way: per step
    torch.autograd.grad(..., create_graph=True), the norm clip
    differentiated through |G|, then .backward() of L = <dy, y> (what
    res:backward{dy = dy} returns). Returns the gradient of W1 (initial)."""
    k = torch.from_numpy(k[0]).requires_grad_(True)
    v = torch.from_numpy(v[0]).requires_grad_(True)
    dy = torch.from_numpy(dy)
    names = ["W1", "b1", "W2", "b2"]
    P0 = {n: torch.from_numpy(p.copy()).requires_grad_(True) for n, p in params.items()}
    P = dict(P0)
    S = {n: torch.zeros_like(p) for n, p in P.items()}
    theta, eta, alpha, cmax = GATES["theta"], GATES["eta"], GATES["alpha"], RULE["clip_max"]
    BH, T, d = k.shape

    def forward(p, x):
        h = F.silu(torch.baddbmm(p["b1"].unsqueeze(1), x, p["W1"].transpose(1, 2)))
        return torch.baddbmm(p["b2"].unsqueeze(1), h, p["W2"].transpose(1, 2))

    ys = []
    for s0 in range(0, T, c):
        ks, vs = k[:, s0:s0 + c], v[:, s0:s0 + c]
        y = forward(P, ks)
        loss = ((y - vs) ** 2).mean(-1)
        grads = torch.autograd.grad((theta * loss).sum(), [P[n] for n in names], create_graph=True)
        sq = sum(g.pow(2).flatten(1).sum(1) for g in grads)
        scale = torch.clamp(cmax / sq.sqrt(), max=1.0)
        for n, g in zip(names, grads):
            sh = (BH,) + (1,) * (g.dim() - 1)
            S[n] = eta * S[n] - g * scale.view(sh)
            P[n] = (1 - alpha) * P[n] + S[n]
        ys.append(y[:, :-1])
        ys.append(forward(P, ks[:, -1:]))
    y_out = torch.cat(ys, dim=1)
    (dy[0] * y_out).sum().backward()
    return P0["W1"].grad.numpy()


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def grad_lines(mnemo, env, work, exp, args, k, v, params, c):
    """Forward alone vs forward (grad = true) plus backward, in-process, best
    of R; and PyTorch's autograd through the same rule (torch_grad_run) on the
    same dy, its W1 gradient compared with mnemo's."""
    dy = np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
    dyfile = os.path.join(work, "dy.h5")
    with h5py.File(dyfile, "w") as f:
        f["dy"] = dy
    gfile = os.path.join(work, "gW1.h5")
    lua = (
        "local rule, inputs = mnemo.load_experiment(arg[1]) "
        "local dy = mnemo.load(arg[2]).dy "
        "for i = 1, %d do "
        "  local t0 = mnemo._clock() rule:run(inputs) local t1 = mnemo._clock() "
        "  inputs.grad = true local res = rule:run(inputs) local g = res:backward{dy = dy} inputs.grad = nil "
        "  local t2 = mnemo._clock() "
        "  print(string.format('grad %%.6f %%.6f %%d %%d %%d', t1 - t0, t2 - t1, g.memory.block, "
        "    g.memory.backward_bytes, g.memory.forward_bytes)) "
        "  if i == 1 then mnemo.save(arg[3], {W1 = g.init.W1}) end "
        "end" % (args.repeat + 1))
    script = os.path.join(work, "grad.lua")
    with open(script, "w") as f:
        f.write(lua)
    out = subprocess.run([mnemo, "-q", script, exp, dyfile, gfile], check=True, env=env, capture_output=True,
                         text=True).stdout
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("grad ")][1:]
    fwd = min(float(r[0]) for r in rows)
    both = min(float(r[1]) for r in rows)
    block, bwd_bytes, fwd_bytes = (int(x) for x in rows[-1][2:])
    t_torch = []
    for _ in range(args.repeat + 1):
        t0 = time.perf_counter()
        gW1_t = torch_grad_run(k, v, params, c, dy)
        t_torch.append(time.perf_counter() - t0)
    tt = min(t_torch[1:])
    with h5py.File(gfile, "r") as f:
        gW1_m = np.asarray(f["W1"]).reshape(gW1_t.shape)
    return [
        "",
        "| backward (issue 12) | threads | forward best (s) | forward + backward best (s) | ratio (target <= 3) "
        "| PyTorch %s autograd fwd + bwd best (s) | speed-up | rel err dW1 | block K | backward memory (MB) "
        "| forward state (MB) |" % torch.__version__,
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| B*H=8, T=%d, MLP 64-256-64 silu, c=64, norm clip | %d | %.3f | %.3f | %.2fx | %.3f | %.2fx | %.1e | %d "
        "| %.1f | %.1f |"
        % (args.T, args.threads, fwd, both, both / fwd, tt, tt / both, rel(gW1_m, gW1_t), block, bwd_bytes / 1e6,
           fwd_bytes / 1e6),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--grad", action="store_true", help="also time the backward (forward + backward vs forward)")
    args = ap.parse_args()
    mnemo = os.environ.get("MNEMO", os.path.join(os.getcwd(), "mnemo"))
    BH, d, dh, c = 8, 64, 256, 64
    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))

    k, v, params = make_inputs(BH, args.T, d, dh)
    work = tempfile.mkdtemp(prefix="mnemo-bench-")
    exp, res = os.path.join(work, "exp.h5"), os.path.join(work, "res.h5")
    write_experiment(exp, k, v, params, dh)

    t_cli = []
    for _ in range(args.repeat + 1):
        t0 = time.perf_counter()
        subprocess.run([mnemo, "run", exp, "-o", res], check=True, env=env)
        t_cli.append(time.perf_counter() - t0)
    # The engine alone, in-process: rule:run timed by mnemo.profile.
    lua = ("local rule, inputs = mnemo.load_experiment(arg[1]) "
           "for i = 1, %d do local p = mnemo.profile(function() rule:run(inputs) end, {quiet = true}) "
           "print(string.format('engine %%.6f', p.engine)) end" % (args.repeat + 1))
    script = os.path.join(work, "engine.lua")
    with open(script, "w") as f:
        f.write(lua)
    out = subprocess.run([mnemo, "-q", script, exp], check=True, env=env, capture_output=True, text=True).stdout
    t_mnemo = [float(line.split()[1]) for line in out.splitlines() if line.startswith("engine ")]
    t_torch = []
    for _ in range(args.repeat + 1):
        t0 = time.perf_counter()
        y_t, P_t = torch_run(k, v, params, c)
        t_torch.append(time.perf_counter() - t0)
    # first run of each is a warm-up
    tm, tt = float(np.median(t_mnemo[1:])), float(np.median(t_torch[1:]))
    bm, bt = min(t_mnemo[1:]), min(t_torch[1:])
    tc = float(np.median(t_cli[1:]))
    with h5py.File(res, "r") as f:
        y_m = f["outputs/y"][0]
        W1_m = f["final/W1"][0]
    err_y, err_w = rel(y_m, y_t), rel(W1_m, P_t["W1"])
    flops = 3 * 2 * 2 * BH * args.T * d * dh  # forward, two backward products per layer
    lines = [
        "| case | threads | mnemo engine median / best (s) | PyTorch %s eager autograd median / best (s) "
        "| speed-up median / best | `mnemo run` whole process (s) | rel err y | rel err W1 |" % torch.__version__,
        "|---|---|---|---|---|---|---|---|",
        "| B*H=%d, T=%d, MLP %d-%d-%d silu, c=%d, norm clip | %d | %.3f / %.3f | %.3f / %.3f | %.2fx / %.2fx | %.3f | %.1e | %.1e |"
        % (BH, args.T, d, dh, d, c, args.threads, tm, bm, tt, bt, tt / tm, bt / bm, tc, err_y, err_w),
    ]
    print("\n".join(lines))
    print("mnemo engine runs: %s s; mnemo run processes: %s s; torch runs: %s s; ~%.1f GFLOP/s for mnemo"
          % (", ".join("%.3f" % x for x in t_mnemo), ", ".join("%.3f" % x for x in t_cli),
             ", ".join("%.3f" % x for x in t_torch), flops / tm / 1e9))
    if args.grad:
        lines += grad_lines(mnemo, env, work, exp, args, k, v, params, c)
        print("\n".join(lines[3:]))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n## CPU engine vs PyTorch CPU (%s, %s, %d cores)\n\n" % (
                time.strftime("%Y-%m-%d"), platform.processor() or platform.machine(), os.cpu_count()))
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
