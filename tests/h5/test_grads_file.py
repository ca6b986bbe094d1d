#!/usr/bin/env python3
"""test_grads_file.py: the backward through files (SPEC.md sections 5-7).

An experiment with /upstream makes `mnemo run` write /grads: names and shapes
as the schema says (k, v, q only when the experiment had q, theta [B,H,T],
eta and alpha [B,H,S] at full shape even when the file gave scalars, W1 ...
and S_W1 ... at [B,H,...]); the values against torch autograd in float64
(create_graph through the inner gradient) on a small MLP run (tolerance:
relative L2 error < 1e-4 per tensor, SPEC section 3's fp32 bound for
gradients); an unknown /upstream name is an error naming file and dataset;
`mnemo compare` walks /grads.

Prints PASS/FAIL/SKIP lines; SKIPs everything without h5py, torch or the binary.
"""
import os
import subprocess
import sys
import tempfile

failures = 0


def report(name, ok, detail=""):
    global failures
    if ok:
        print(f"PASS {name}")
    else:
        failures += 1
        print(f"FAIL {name}: {detail}")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MNEMO = os.environ.get("MNEMO") or os.path.join(ROOT, "mnemo")
CHECKS = ["grads file: run", "grads file: names and shapes", "grads file: values vs torch",
          "grads file: outputs unchanged by /upstream",
          "grads file: unknown upstream", "grads file: compare walks /grads"]
try:
    import h5py
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    for n in CHECKS:
        print(f"SKIP {n}: python lacks h5py/numpy/torch ({e})")
    sys.exit(0)
if not (os.path.isfile(MNEMO) and os.access(MNEMO, os.X_OK)):
    for n in CHECKS:
        print(f"SKIP {n}: no mnemo binary at {MNEMO}")
    sys.exit(0)

B, H, T, dk, dv, dh, c = 2, 1, 7, 3, 3, 4, 2
S = (T + c - 1) // c
rng = np.random.default_rng(5)
f32 = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
data = {
    "k": f32(B, H, T, dk), "v": f32(B, H, T, dv), "q": f32(B, H, T, dk),
    "theta": (0.2 + 0.1 * rng.random((H, T))).astype(np.float32),   # [H,T]
    "eta": np.float32(0.7), "alpha": np.float32(0.05),               # scalars
    "W1": f32(dh, dk, scale=0.5), "b1": f32(dh, scale=0.1), "W2": f32(dv, dh, scale=0.5), "b2": f32(dv, scale=0.1),
}
up = {"dy": f32(B, H, T, dv), "dloss": f32(B, H, T), "dW1": f32(B, H, dh, dk), "dS_b2": f32(B, H, dv)}


def write_experiment(path, upstream, with_q=True):
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        r.attrs.update({"layers": 2, "hidden": dh, "activation": "silu", "step": c, "clip": "norm",
                        "clip_max": 0.5})
        for n in ["k", "v"] + (["q"] if with_q else []):
            f.create_dataset("inputs/" + n, data=data[n])
        for n in ["theta", "eta", "alpha"]:
            f.create_dataset("gates/" + n, data=data[n])
        for n in ["W1", "b1", "W2", "b2"]:
            f.create_dataset("init/" + n, data=data[n])
        for n, a in upstream.items():
            f.create_dataset("upstream/" + n, data=a)


def reference():
    """float64 autograd of the run: y, loss, final W, S, then L and its gradient."""
    t = {n: torch.tensor(np.broadcast_to(data[n], data[n].shape).astype(np.float64), requires_grad=True)
         for n in data}
    theta = t["theta"].expand(B, H, T)
    eta = t["eta"].expand(B, H, S)
    alpha = t["alpha"].expand(B, H, S)
    names = ["W1", "b1", "W2", "b2"]
    W = [t[n].expand(B, H, *t[n].shape) for n in names]
    M = [torch.zeros_like(w) for w in W]

    def model(x, P):
        h = torch.nn.functional.silu(torch.einsum("bhod,bhtd->bhto", P[0], x) + P[1][:, :, None])
        return torch.einsum("bhod,bhtd->bhto", P[2], h) + P[3][:, :, None]

    ys, losses = [None] * T, [None] * T
    for s in range(S):
        t0, t1 = s * c, min(s * c + c, T)
        x, v = t["k"][:, :, t0:t1], t["v"][:, :, t0:t1]
        yk = model(x, W)
        loss = ((yk - v) ** 2).mean(-1)
        for i in range(t1 - t0):
            losses[t0 + i] = loss[:, :, i]
        for i in range(t1 - t0 - 1):   # retrieve after: all but the last token see W^(s)
            ys[t0 + i] = model(t["q"][:, :, t0 + i:t0 + i + 1], W)[:, :, 0]
        obj = (theta[:, :, t0:t1] * loss).sum()
        G = torch.autograd.grad(obj, W, create_graph=True)
        n = torch.sqrt(sum((g ** 2).sum(dim=tuple(range(2, g.dim()))) for g in G))   # [B,H]
        scale = torch.clamp(0.5 / n, max=1.0)
        for i in range(4):
            sc = scale.reshape(B, H, *([1] * (G[i].dim() - 2)))
            e = eta[:, :, s].reshape(sc.shape)
            a = alpha[:, :, s].reshape(sc.shape)
            M[i] = e * M[i] - G[i] * sc
            W[i] = (1 - a) * W[i] + M[i]
        ys[t1 - 1] = model(t["q"][:, :, t1 - 1:t1], W)[:, :, 0]
    y = torch.stack(ys, 2)
    loss = torch.stack(losses, 2)
    tu = {n: torch.tensor(a.astype(np.float64)) for n, a in up.items()}
    L = (y * tu["dy"]).sum() + (loss * tu["dloss"]).sum() + (W[0] * tu["dW1"]).sum() + (M[3] * tu["dS_b2"]).sum()
    L.backward()
    return {n: t[n].grad.numpy() for n in t}


with tempfile.TemporaryDirectory() as d:
    exp, res = os.path.join(d, "exp.h5"), os.path.join(d, "res.h5")
    write_experiment(exp, up)
    p = subprocess.run([MNEMO, "run", exp, "-o", res, "-q"], capture_output=True, text=True, timeout=120)
    report("grads file: run", p.returncode == 0, p.stderr.strip())
    if p.returncode == 0:
        with h5py.File(res, "r") as f:
            g = {n: f["grads"][n][()] for n in f["grads"]}
        want = {"k": (B, H, T, dk), "v": (B, H, T, dv), "q": (B, H, T, dk), "theta": (B, H, T), "eta": (B, H, S),
                "alpha": (B, H, S), "W1": (B, H, dh, dk), "b1": (B, H, dh), "W2": (B, H, dv, dh), "b2": (B, H, dv),
                "S_W1": (B, H, dh, dk), "S_b1": (B, H, dh), "S_W2": (B, H, dv, dh), "S_b2": (B, H, dv)}
        shapes = {n: a.shape for n, a in g.items()}
        report("grads file: names and shapes", shapes == want, f"got {shapes}")
        ref = reference()
        worst, detail = 0.0, ""
        for n, r in ref.items():
            a = g[n]
            r = np.broadcast_to(r, a.shape) if r.shape == a.shape else None
            if r is None:   # a broadcast input: the file holds the full-shape gradient; compare its sum
                a, r = a.reshape(-1, *ref[n].shape).sum(0) if ref[n].ndim else a.sum(), ref[n]
            err = np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30)
            if err > worst:
                worst, detail = err, f"{n}: relative error {err:.3g}"
        report("grads file: values vs torch", worst < 1e-4, detail)
        print(f"# worst relative error of /grads against torch: {detail}")
    # /upstream changes nothing else: /outputs and /final as without it, bit for bit
    plain = os.path.join(d, "plain.h5")
    write_experiment(exp, {})
    p2 = subprocess.run([MNEMO, "run", exp, "-o", plain, "-q"], capture_output=True, text=True, timeout=120)
    same = p.returncode == 0 and p2.returncode == 0
    if same:
        with h5py.File(res, "r") as a, h5py.File(plain, "r") as b:
            for grp in ["outputs", "final"]:
                for n in b[grp]:
                    same = same and np.array_equal(a[grp][n][()], b[grp][n][()])
            same = same and "grads" not in b
    report("grads file: outputs unchanged by /upstream", same, p2.stderr.strip())
    bad = dict(up, dW7=f32(B, H, dh, dk))
    write_experiment(exp, bad)
    p = subprocess.run([MNEMO, "run", exp, "-o", res, "-q"], capture_output=True, text=True, timeout=60)
    msg = p.stderr.strip()
    report("grads file: unknown upstream", p.returncode == 2 and "/upstream/dW7" in msg and exp in msg, msg)
    # compare: a result with one gradient changed fails on /grads/...
    write_experiment(exp, {"dy": up["dy"]}, with_q=False)
    res2 = os.path.join(d, "res2.h5")
    ok = subprocess.run([MNEMO, "run", exp, "-o", res, "-q"], capture_output=True).returncode == 0
    if ok:
        with h5py.File(res, "r") as f:
            has_q = "q" in f["grads"]
        subprocess.run(["cp", res, res2])
        with h5py.File(res2, "r+") as f:
            f["grads"]["theta"][0, 0, 0] += 1.0
        p = subprocess.run([MNEMO, "compare", res, res2], capture_output=True, text=True, timeout=60)
        report("grads file: compare walks /grads", not has_q and p.returncode == 1 and "/grads/theta" in p.stdout,
               p.stdout + p.stderr)
    else:
        report("grads file: compare walks /grads", False, "run failed")
sys.exit(1 if failures else 0)
