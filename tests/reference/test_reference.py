#!/usr/bin/env python3
"""test_reference: self-tests of the Python reference (mnemo_ref.py), its
expression parser (mnemo_expr.py) and the experiment generator
(gen_experiments.py).

Prints one line per check, "PASS name", "FAIL name: detail" or
"SKIP name: reason" (tests/run.sh counts them); exits non-zero on failure.
Hand computations here are numpy, written from SPEC.md directly, so that they
check the autograd-based reference rather than repeat it.

    /usr/bin/python3 tests/reference/test_reference.py [-k SUBSTRING]
"""

import contextlib
import io
import math
import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import h5py
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mnemo_expr  # noqa: E402
import mnemo_ref  # noqa: E402
import gen_experiments as gen  # noqa: E402

torch.set_num_threads(1)
FAILED = []
# -k SUBSTRING runs only the checks whose names contain it
ONLY = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv[:-1] else None


class CheckFailed(Exception):
    pass


CHECKS = []


def check(name):
    """Decorator: register the function as one named check."""
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


def run_checks():
    """Run every check in order; one passes unless it raises (CheckFailed
    carries the detail, anything else is a crash)."""
    for name, fn in CHECKS:
        if ONLY and ONLY not in name:
            continue
        try:
            skip = fn()
            if isinstance(skip, str):
                print("SKIP %s: %s" % (name, skip))
            else:
                print("PASS %s" % name)
        except CheckFailed as e:
            print("FAIL %s: %s" % (name, e))
            FAILED.append(name)
        except Exception as e:  # a crash in a check is a failure, with where
            tb = traceback.extract_tb(e.__traceback__)[-1]
            print("FAIL %s: %s: %s (%s:%d)" % (name, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                                               os.path.basename(tb.filename), tb.lineno))
            FAILED.append(name)
        sys.stdout.flush()


def expect(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def relerr(a, b):
    """|a - b| / |b| in L2 norms (SPEC.md section 3); non-finite entries must
    sit at the same places and are left out."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb) or not np.array_equal(np.isnan(a), np.isnan(b)):
        return math.inf
    d = np.linalg.norm(a[fb] - b[fb])
    nb = np.linalg.norm(b[fb])
    return d / nb if nb > 0 else d


def expect_close(a, b, tol, what):
    e = relerr(a, b)
    expect(e <= tol, "%s: relative error %.3g > %.3g" % (what, e, tol))


TMP = None   # a fresh temporary directory, made when the checks run
_counter = [0]


def write_exp(rule, inputs, gates, init, constants=None, name=None):
    """Write an experiment file through the generator's writer (plain h5py)."""
    _counter[0] += 1
    path = os.path.join(TMP, name or "exp_%d.h5" % _counter[0])
    gen.write_config(path, {"rule": rule, "constants": constants or {}, "inputs": inputs,
                            "gates": gates, "init": init, "desc": "test", "strings": "vlen",
                            "seed": 0, "index": 0})
    return path


def run_file(path, trace=False):
    exp = mnemo_ref.load_experiment(path)
    return exp, mnemo_ref.run(exp, trace=trace)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def linear_setup(rng, B=2, H=2, T=12, dk=4, dv=3):
    k = f32(rng.standard_normal((B, H, T, dk)) / 2)
    v = f32(rng.standard_normal((B, H, T, dv)))
    W = f32(rng.standard_normal((B, H, dv, dk)) * 0.3)
    theta = f32(rng.uniform(0.05, 0.2, (B, H, T)))
    return k, v, W, theta


def hand_linear(k, v, W0, theta, c, r, eta=None, alpha=None, token_mean=False):
    """SPEC.md section 2 for a linear memory with mse (feature mean), from the
    closed-form gradient d/dW mean_j (W k - v)_j^2 = (2/dv) (W k - v) k^T.
    Returns final W, S, loss [B,H,T], grad_norm [B,H,S], skipped [B,H,S] and
    the weight history [S+1][B,H,dv,dk]."""
    k, v, W0, theta = (np.asarray(a, np.float64) for a in (k, v, W0, theta))
    B, H, T, dk = k.shape
    dv = v.shape[3]
    S = (T + c - 1) // c
    eta = np.zeros((B, H, S)) if eta is None else np.asarray(eta, np.float64)
    alpha = np.zeros((B, H, S)) if alpha is None else np.asarray(alpha, np.float64)
    Wh = [W0.copy()]
    Sm = np.zeros_like(W0)
    loss = np.zeros((B, H, T))
    gnorm = np.zeros((B, H, S))
    skipped = np.zeros((B, H, S))
    for s in range(S):
        j = 0 if r == 0 else (s * c // r) * (r // c)
        Wbar = Wh[j]
        W = Wh[-1].copy()
        Snew = Sm.copy()
        for b in range(B):
            for h in range(H):
                G = np.zeros((dv, dk))
                toks = range(s * c, min((s + 1) * c, T))
                for t in toks:
                    res = Wbar[b, h] @ k[b, h, t] - v[b, h, t]
                    loss[b, h, t] = np.mean(res ** 2)
                    G += theta[b, h, t] * (2.0 / dv) * np.outer(res, k[b, h, t])
                if token_mean:
                    G /= len(toks)
                gnorm[b, h, s] = np.sqrt(np.sum(G ** 2))
                if not np.all(np.isfinite(G)):
                    skipped[b, h, s] = 1
                    continue
                Snew[b, h] = eta[b, h, s] * Sm[b, h] - G
                W[b, h] = (1 - alpha[b, h, s]) * W[b, h] + Snew[b, h]
        Sm = Snew
        Wh.append(W)
    return Wh[-1], Sm, loss, gnorm, skipped, Wh


# ---------------------------------------------------------------------------
# (a) linear memory, mse, c = 1, no momentum or decay: closed form
# ---------------------------------------------------------------------------

@check("linear_closed_form")
def _():
    rng = np.random.default_rng(1)
    k, v, W, theta = linear_setup(rng)
    path = write_exp({"layers": 1, "loss": "mse", "step": 1}, {"k": k, "v": v},
                     {"theta": theta}, {"W1": W})
    exp, res = run_file(path)
    Wf, _, loss, gnorm, skipped, Wh = hand_linear(k, v, W, theta, c=1, r=1)
    # the per-token rule, written out once more as the brief states it
    Wt = np.asarray(W, np.float64).copy()
    kk, vv, th = (np.asarray(a, np.float64) for a in (k, v, theta))
    dv = v.shape[3]
    for t in range(k.shape[2]):
        for b in range(k.shape[0]):
            for h in range(k.shape[1]):
                Wt[b, h] -= th[b, h, t] * (2.0 / dv) * np.outer(Wt[b, h] @ kk[b, h, t] - vv[b, h, t],
                                                                kk[b, h, t])
    expect_close(Wf, Wt, 1e-13, "hand loops disagree")
    expect_close(res["W1"], Wt, 1e-12, "W1")
    expect_close(res["S_W1"], Wh[-1] - Wh[-2], 1e-12, "S_W1 (= W^(S) - W^(S-1))")
    expect_close(res["loss"], loss, 1e-12, "loss")
    expect_close(res["grad_norm"], gnorm, 1e-12, "grad_norm")
    y = np.stack([np.einsum("bhij,bhj->bhi", Wh[t + 1], kk[:, :, t]) for t in range(k.shape[2])], 2)
    expect_close(res["y"], y, 1e-12, "y (retrieve after)")
    expect(np.all(res["clip_scale"] == 1) and np.all(res["skipped"] == 0), "clip_scale/skipped")


# ---------------------------------------------------------------------------
# (a2) an independent per-memory loop with torch.nn modules and .backward()
# ---------------------------------------------------------------------------

def newton_schulz_by_columns(G, steps):
    """SPEC v2's Newton-Schulz written the other way round: a tall matrix is
    not transposed but iterated as X' = a X + X (b A + c A^2), A = X^T X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    nu = float(G.norm())
    if nu == 0:
        return G
    X = G / (nu + 1e-7)
    for _ in range(steps):
        if X.shape[0] > X.shape[1]:
            A = X.T @ X
            X = a * X + X @ (b * A + c * A @ A)
        else:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
    return X * (nu / float(X.norm()))


def per_memory_nn(exp):
    """One memory at a time: nn.Linear layers, loss.backward(), norm clip by
    hand. Built-in activations, losses and clips none/norm(global) only;
    out_norm through F.layer_norm (rmsnorm by hand) and qk_norm by hand;
    SPEC v2's lengths (a loop that stops at the sequence's length) and
    newton_schulz (newton_schulz_by_columns)."""
    nn, F = torch.nn, torch.nn.functional
    rule = exp.rule
    L, c, r, T, S = rule["layers"], rule["step"], rule["refresh"], exp.T, exp.S
    names = exp.param_names()
    act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh,
           "identity": lambda z: z}[rule["activation"]]
    out = {n: np.zeros(exp.params[n].shape) for n in names}
    outS = {n: np.zeros(exp.params[n].shape) for n in names}
    y_out = np.zeros((exp.B, exp.H, T, exp.dv))
    a_of_t = mnemo_ref.retrieval_index(exp)
    for b in range(exp.B):
        for h in range(exp.H):
            dims = [exp.dk] + [exp.dh] * (L - 1) + [exp.dv]
            net = nn.ModuleList([nn.Linear(dims[i], dims[i + 1], bias=bool(rule["bias"])).double()
                                 for i in range(L)])
            # glu: a gate nn.Linear beside each hidden layer
            gates = nn.ModuleList([nn.Linear(dims[i], dims[i + 1], bias=bool(rule["bias"])).double()
                                   for i in range(L - 1)] if rule.get("glu") else [])

            on = rule.get("out_norm", "none")
            if on != "none":
                g_ln = torch.tensor(exp.outer["ln_g"][b, h])
                b_ln = torch.tensor(exp.outer["ln_b"][b, h])

            def forward(x):
                z = x
                for i, lin in enumerate(net):
                    z_in, z = z, lin(z)
                    if i < L - 1:
                        z = act(z) * gates[i](z_in) if gates else act(z)
                if on == "layernorm":
                    z = F.layer_norm(z, (exp.dv,), g_ln, b_ln, eps=1e-6)
                elif on == "rmsnorm":
                    z = z * torch.rsqrt((z * z).mean() + 1e-6) * g_ln + b_ln
                return z + x if rule["residual"] else z

            def qk(x):
                kind = rule.get("qk_norm", "none")
                if kind == "none":
                    return x
                sq = (x * x).sum(-1, keepdim=True) if kind == "l2" else (x * x).mean(-1, keepdim=True)
                return x * torch.rsqrt(sq + 1e-6)

            plist = []
            for i, lin in enumerate(net):
                plist.append(("W%d" % (i + 1), lin.weight))
                if rule["bias"]:
                    plist.append(("b%d" % (i + 1), lin.bias))
            for i, lin in enumerate(gates):
                plist.append(("U%d" % (i + 1), lin.weight))
                if rule["bias"]:
                    plist.append(("c%d" % (i + 1), lin.bias))
            hist = [{n: torch.tensor(exp.params[n][b, h]) for n, _ in plist}]
            mom = {n: torch.tensor(exp.momenta[n][b, h]) for n, _ in plist}
            k = qk(torch.tensor(exp.k[b, h]))
            v = torch.tensor(exp.v[b, h])
            real = T if exp.lengths is None else int(exp.lengths[b])
            for s in range(S):
                if s * c >= real:   # a step in the padding: nothing changes
                    hist.append(hist[-1])
                    continue
                j = 0 if r == 0 else (s * c // r) * (r // c)
                with torch.no_grad():
                    for n, p in plist:
                        p.copy_(hist[j][n])
                net.zero_grad()
                gates.zero_grad()
                lo, hi = s * c, min((s + 1) * c, real)
                total = 0
                for t in range(lo, hi):
                    yt = forward(k[t])
                    if rule["loss"] == "mse":
                        lt = F.mse_loss(yt, v[t], reduction=rule["feature_reduce"])
                    elif rule["loss"] == "l1":
                        lt = F.l1_loss(yt, v[t], reduction=rule["feature_reduce"])
                    elif rule["loss"] == "huber":
                        lt = F.huber_loss(yt, v[t], reduction=rule["feature_reduce"],
                                          delta=rule["loss_delta"])
                    elif rule["loss"] == "lp":
                        e = (yt - v[t]).abs() ** rule["loss_p"]
                        lt = e.mean() if rule["feature_reduce"] == "mean" else e.sum()
                    elif rule["loss"] == "logcosh":
                        e = torch.log(torch.cosh(yt - v[t]))
                        lt = e.mean() if rule["feature_reduce"] == "mean" else e.sum()
                    elif rule["loss"] == "dot":
                        e = -(yt * v[t])
                        lt = e.mean() if rule["feature_reduce"] == "mean" else e.sum()
                    total = total + float(exp.theta[b, h, t]) * lt
                if rule["token_reduce"] == "mean":
                    total = total / (hi - lo)
                total.backward()
                G = {n: p.grad.detach().clone() for n, p in plist}
                gn = math.sqrt(sum(float((g ** 2).sum()) for g in G.values()))
                if not math.isfinite(gn):
                    hist.append(hist[-1])
                    continue
                if rule["clip"] == "norm":
                    sc = min(1.0, rule["clip_max"] / gn) if gn > 0 else 1.0
                    G = {n: g * sc for n, g in G.items()}
                if rule["precondition"] == "newton_schulz":
                    G = {n: newton_schulz_by_columns(g, rule["ns_steps"]) if g.dim() == 2 else g
                         for n, g in G.items()}
                new = {}
                for n in G:
                    mom[n] = float(exp.eta[b, h, s]) * mom[n] - G[n]
                    new[n] = (1 - float(exp.alpha[b, h, s])) * hist[-1][n] + mom[n]
                hist.append(new)
            for n, _ in plist:
                out[n][b, h] = hist[-1][n].numpy()
                outS[n][b, h] = mom[n].numpy()
            with torch.no_grad():
                for t in range(T):
                    for n, p in plist:
                        p.copy_(hist[a_of_t[t]][n])
                    if t < real:
                        y_out[b, h, t] = forward(qk(torch.tensor(exp.q[b, h, t]))).numpy()
    return out, outS, y_out


@check("mlp_matches_per_memory_nn_loop")
def _():
    picked = 0
    n_v2 = {"lengths": 0, "newton_schulz": 0, "glu": 0}
    for i in range(400):
        cfg = gen.make_config(11, i, max_T=24)
        rule = cfg["rule"]
        if (rule.get("activation", "silu") == "custom" or rule.get("loss") == "custom"
                or rule.get("clip", "none") not in ("none", "norm")
                or rule.get("clip_scope", "global") != "global" or "nonfinite=none" not in cfg["desc"]
                or rule.get("layers", 1) < 2 and picked >= 2):
            continue
        path = os.path.join(TMP, "nnloop_%d.h5" % i)
        gen.write_config(path, cfg)
        exp, res = run_file(path)
        W, S, y = per_memory_nn(exp)
        for n in exp.param_names():
            expect_close(res[n], W[n], 1e-10, "config %d (%s): %s" % (i, cfg["desc"], n))
            expect_close(res["S_" + n], S[n], 1e-10, "config %d (%s): S_%s" % (i, cfg["desc"], n))
        expect_close(res["y"], y, 1e-10, "config %d (%s): y" % (i, cfg["desc"]))
        picked += 1
        n_v2["lengths"] += exp.lengths is not None
        n_v2["newton_schulz"] += exp.rule["precondition"] == "newton_schulz"
        n_v2["glu"] += bool(rule.get("glu"))
        if picked >= 12 and min(n_v2.values()) >= 2:
            break
    expect(picked >= 8, "only %d configs qualified" % picked)
    expect(min(n_v2.values()) >= 2, "SPEC v2 options among them: %s" % n_v2)


# ---------------------------------------------------------------------------
# (b) expression parser
# ---------------------------------------------------------------------------

def ev(src, **vals):
    env = {k: torch.tensor(float(x), dtype=torch.float64) for k, x in vals.items()}
    if not env:
        env = {"x": torch.tensor(0.0, dtype=torch.float64)}
    return float(mnemo_expr.compile_expr(src, tuple(env))(**env))


@check("expr_precedence_associativity")
def _():
    cases = [
        ("-x^2", {"x": 3}, -9.0), ("-2^2", {}, -4.0), ("(-2)^2", {}, 4.0),
        ("2^3^2", {}, 512.0), ("2^-1", {}, 0.5), ("2^-x^2", {"x": 1}, 0.5),
        ("x^-y^2", {"x": 2, "y": 1}, 0.5), ("--x", {"x": 2}, 2.0), ("2*-3", {}, -6.0),
        ("1-2-3", {}, -4.0), ("8/4/2", {}, 1.0), ("2*3+4*5", {}, 26.0), ("2+3*4^2", {}, 50.0),
        ("-x*y", {"x": 2, "y": 3}, -6.0), ("(1+2)*3", {}, 9.0),
        ("1+2<4", {}, 1.0), ("3 >= 4", {}, 0.0), ("1 <= 1", {}, 1.0), ("2 > 1+1", {}, 0.0),
        ("1 < 2", {}, 1.0), ("-1 < -2", {}, 0.0), ("(1<2)+(2<1)", {}, 1.0),
        ("where(x-3, 1, 2)", {"x": 3}, 2.0), ("where(x-3, 1, 2)", {"x": 4}, 1.0),
        ("where(x > 0, x, 0)", {"x": -5}, 0.0),
        ("min(x, 2) + max(x, 2)", {"x": 3}, 5.0), ("max(-x, x)", {"x": -4}, 4.0),
        ("1e-3*2", {}, 0.002), (".5 + 1.", {}, 1.5), ("2.5E+1", {}, 25.0),
        ("  x\t* 2 ", {"x": 1.5}, 3.0),
        ("abs(x)", {"x": -1.5}, 1.5), ("sqrt(x)", {"x": 2.25}, 1.5),
        ("exp(x)", {"x": 0.3}, math.exp(0.3)), ("log(x)", {"x": 3}, math.log(3)),
        ("tanh(x)", {"x": -0.7}, math.tanh(-0.7)),
        ("sigmoid(x)", {"x": -0.7}, 1 / (1 + math.exp(0.7))),
        ("softplus(x)", {"x": 1.3}, math.log1p(math.exp(1.3))),
        ("softplus(x)", {"x": 100}, 100.0), ("softplus(x)", {"x": -100}, math.exp(-100)),
        ("sign(x)", {"x": -0.2}, -1.0), ("sign(x)", {"x": 0}, 0.0),
        ("relu(x)", {"x": -0.2}, 0.0), ("relu(x)", {"x": 0.2}, 0.2),
        ("silu(x)", {"x": 1.3}, 1.3 / (1 + math.exp(-1.3))),
        ("gelu(x)", {"x": -0.7}, -0.7 * 0.5 * (1 + math.erf(-0.7 / math.sqrt(2)))),
        ("gelu(x)", {"x": 1.3}, 1.3 * 0.5 * (1 + math.erf(1.3 / math.sqrt(2)))),
    ]
    for src, vals, want in cases:
        got = ev(src, **vals)
        expect(abs(got - want) <= 1e-12 * max(1.0, abs(want)) or got == want,
               "%r with %s: got %r, want %r" % (src, vals, got, want))
    # constants, and a constant expression broadcast to the variables' shape
    e = mnemo_expr.compile_expr("d*r", ("r",), {"d": 0.5})
    expect(float(e(r=torch.tensor(4.0, dtype=torch.float64))) == 2.0, "named constant")
    out = mnemo_expr.compile_expr("2", ("y",))(y=torch.zeros(3, 2, dtype=torch.float64))
    expect(tuple(out.shape) == (3, 2) and float(out.sum()) == 12.0, "constant expression shape")


@check("expr_errors_name_what_and_where")
def _():
    cases = [  # (source, names, constants, substrings the message must hold)
        ("foo + 1", ("r",), {}, ["unknown name 'foo'", "position 1"]),
        ("r + sin(r)", ("r",), {}, ["unknown function 'sin'", "position 5"]),
        ("y - $v", ("y", "v"), {}, ["unexpected character '$'", "position 5"]),
        ("abs(q - v)", ("y", "v", "r"), {}, ["unknown name 'q'", "position 5"]),
        ("r +", ("r",), {}, ["end of expression", "position 4"]),
        ("(r", ("r",), {}, ["expected ')'", "position 3"]),
        ("max(r)", ("r",), {}, ["'max' takes 2 arguments", "position 1"]),
        ("where(r, 1)", ("r",), {}, ["'where' takes 3 arguments"]),
        ("1 < r < 2", ("r",), {}, ["comparisons do not chain", "position 7"]),
        ("exp + 1", ("r",), {}, ["function 'exp' used without '('", "position 1"]),
        ("r r", ("r",), {}, ["unexpected 'r'", "position 3"]),
        ("r == 1", ("r",), {}, ["unexpected character '='", "position 3"]),
        ("", ("r",), {}, ["unexpected end of expression", "position 1"]),
        ("r*d", ("r",), {"r": 1.0}, ["shadows"]),
    ]
    for src, names, consts, subs in cases:
        try:
            mnemo_expr.compile_expr(src, names, consts)
        except mnemo_expr.ExprError as e:
            msg = str(e)
            for sub in subs:
                expect(sub in msg, "%r: message %r lacks %r" % (src, msg, sub))
            expect("\n" not in msg, "%r: message is not one line" % src)
            continue
        raise CheckFailed("%r: no error" % src)


@check("expr_autograd_derivatives")
def _():
    # autograd through expressions: the derivative conventions SPEC.md names
    def d(src, x, var="x"):
        t = torch.tensor(float(x), dtype=torch.float64, requires_grad=True)
        out = mnemo_expr.compile_expr(src, (var,))(**{var: t})
        (g,) = torch.autograd.grad(out, t)
        return float(g)
    cases = [("abs(x)", 0.0, 0.0), ("abs(x)", -2.0, -1.0), ("relu(x)", 0.0, 0.0),
             ("x^3", 2.0, 12.0), ("-x^2", 3.0, -6.0), ("sign(x)", 0.5, 0.0),
             ("where(x > 0, x^2, -x)", 2.0, 4.0), ("where(x > 0, x^2, -x)", -2.0, -1.0),
             ("softplus(x)", 0.3, 1 / (1 + math.exp(-0.3))),
             ("gelu(x)", 0.4, 0.5 * (1 + math.erf(0.4 / math.sqrt(2)))
              + 0.4 * math.exp(-0.08) / math.sqrt(2 * math.pi)),
             ("abs(x)^1.5", 0.0, 0.0), ("(x > 1)*x", 2.0, 1.0)]
    for src, x, want in cases:
        got = d(src, x)
        expect(abs(got - want) <= 1e-12 * max(1, abs(want)), "d/dx %s at %g: got %r, want %r"
               % (src, x, got, want))


# ---------------------------------------------------------------------------
# (c) built-in parts equal the same parts written as custom expressions
# ---------------------------------------------------------------------------

def mlp_setup(seed, L=2, dk=4, dv=3, dh=5, B=2, H=2, T=11, c=3):
    rng = np.random.default_rng(seed)
    k = f32(rng.standard_normal((B, H, T, dk)) / 2)
    v = f32(rng.standard_normal((B, H, T, dv)))
    init = {}
    dims = [dk] + [dh] * (L - 1) + [dv]
    for i in range(L):
        init["W%d" % (i + 1)] = f32(rng.standard_normal((H, dims[i + 1], dims[i])) / math.sqrt(dims[i]))
        init["b%d" % (i + 1)] = f32(rng.standard_normal((dims[i + 1],)) * 0.1)
        init["S_W%d" % (i + 1)] = f32(rng.standard_normal((dims[i + 1], dims[i])) * 0.01)
    S = (T + c - 1) // c
    gates = {"theta": f32(rng.uniform(0.05, 0.2, (B, H, T))), "eta": f32(rng.uniform(0, 0.8, (S,))),
             "alpha": f32(rng.uniform(0, 0.2, (H, S)))}
    return {"k": k, "v": v}, gates, init


def same_outputs(res_a, res_b, names, tol, what):
    for key in list(mnemo_ref.OUTPUT_NAMES) + names + ["S_" + n for n in names]:
        expect_close(res_a[key], res_b[key], tol, "%s: %s" % (what, key))


@check("builtin_losses_equal_custom_expressions")
def _():
    inputs, gates, init = mlp_setup(3)
    base = {"layers": 2, "hidden": 5, "activation": "tanh", "step": 3, "clip": "norm",
            "clip_max": 0.05}
    pairs = [("mse", {}, "r^2", {}), ("l1", {}, "abs(r)", {}),
             ("huber", {"loss_delta": 0.4},
              "where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", {"delta": 0.4}),
             ("lp", {"loss_p": 1.7}, "abs(r)^p", {"p": 1.7}), ("dot", {}, "-y*v", {}),
             ("logcosh", {}, "log(exp(r) + exp(-r)) - log(2)", {})]
    for fr in ("mean", "sum"):
        for loss, extra, expr, consts in pairs:
            ra = run_file(write_exp(dict(base, loss=loss, feature_reduce=fr, **extra), inputs, gates, init))
            rb = run_file(write_exp(dict(base, loss="custom", loss_expr=expr, feature_reduce=fr),
                                    inputs, gates, init, consts))
            same_outputs(ra[1], rb[1], ra[0].param_names(), 1e-12, "%s vs %r (%s)" % (loss, expr, fr))
    # a different loss must give different numbers (the check can see a
    # difference; not a multiple of r^2, which the norm clip would undo)
    ra = run_file(write_exp(dict(base, loss="mse"), inputs, gates, init))[1]
    rb = run_file(write_exp(dict(base, loss="custom", loss_expr="abs(r)^2.1"), inputs, gates, init))[1]
    expect(relerr(ra["W1"], rb["W1"]) > 1e-6, "abs(r)^2.1 gave the same weights as mse")


@check("builtin_activations_and_clips_equal_custom_expressions")
def _():
    inputs, gates, init = mlp_setup(4, L=3)
    base = {"layers": 3, "hidden": 5, "step": 3, "loss": "huber", "loss_delta": 0.5}
    for act, expr in (("silu", "z*sigmoid(z)"), ("gelu", "gelu(z)"), ("relu", "max(z, 0)"),
                      ("tanh", "tanh(z)"), ("identity", "z")):
        ra = run_file(write_exp(dict(base, activation=act), inputs, gates, init))
        rb = run_file(write_exp(dict(base, activation="custom", activation_expr=expr), inputs, gates, init))
        same_outputs(ra[1], rb[1], ra[0].param_names(), 1e-12, "%s vs %r" % (act, expr))
    base["activation"] = "silu"
    for scope in ("global", "tensor"):
        for clip, m, kind, expr in (("norm", 0.03, "scale", "min(1, m/n)"),
                                    ("softnorm", 0.03, "scale", "m*tanh(n/m)/n"),
                                    ("value", 0.002, "elementwise", "max(min(g, m), -m)")):
            ra = run_file(write_exp(dict(base, clip=clip, clip_max=m, clip_scope=scope), inputs, gates, init))
            rb = run_file(write_exp(dict(base, clip=kind, clip_expr=expr, clip_scope=scope),
                                    inputs, gates, init, {"m": m}))
            same_outputs(ra[1], rb[1], ra[0].param_names(), 1e-12, "%s/%s vs %r" % (clip, scope, expr))
            rn = run_file(write_exp(base, inputs, gates, init))[1]
            expect(relerr(ra[1]["W1"], rn["W1"]) > 1e-6, "%s/%s clip changed nothing" % (clip, scope))
            if clip != "value":
                expect(np.min(ra[1]["clip_scale"]) < 1, "%s/%s: clip_scale never below 1" % (clip, scope))


@check("clip_kinds_and_scopes_by_hand")
def _():
    # linear memory with a bias (two tensors, so the scopes differ), c = 2
    rng = np.random.default_rng(14)
    B, H, T, c, dk, dv = 2, 2, 6, 2, 4, 3
    k, v, W, theta = linear_setup(rng, B=B, H=H, T=T, dk=dk, dv=dv)
    b0 = f32(rng.standard_normal((dv,)) * 0.1)
    kk, vv, th = (np.asarray(a, np.float64) for a in (k, v, theta))
    for clip, m in (("norm", 0.08), ("softnorm", 0.08), ("value", 0.01)):
        for scope in ("global", "tensor"):
            path = write_exp({"layers": 1, "bias": 1, "step": c, "clip": clip, "clip_max": m,
                              "clip_scope": scope}, {"k": k, "v": v}, {"theta": theta},
                             {"W1": W, "b1": b0})
            res = run_file(path)[1]
            Wt = np.asarray(W, np.float64).copy()
            bt = np.broadcast_to(np.asarray(b0, np.float64), (B, H, dv)).copy()
            want_scale = np.ones((B, H, T // c))
            bit = False
            for s in range(T // c):
                for b in range(B):
                    for h in range(H):
                        GW, Gb = np.zeros((dv, dk)), np.zeros(dv)
                        for t in range(s * c, (s + 1) * c):
                            res_t = Wt[b, h] @ kk[b, h, t] + bt[b, h] - vv[b, h, t]
                            GW += th[b, h, t] * (2.0 / dv) * np.outer(res_t, kk[b, h, t])
                            Gb += th[b, h, t] * (2.0 / dv) * res_t
                        if clip == "value":
                            bit = bit or np.max(np.abs(GW)) > m
                            GW, Gb = np.clip(GW, -m, m), np.clip(Gb, -m, m)
                        else:
                            def sc(n):
                                if clip == "norm":
                                    return min(1.0, m / n)
                                return m * math.tanh(n / m) / n
                            if scope == "global":
                                sW = sb = sc(math.sqrt(np.sum(GW ** 2) + np.sum(Gb ** 2)))
                            else:
                                sW, sb = sc(np.linalg.norm(GW)), sc(np.linalg.norm(Gb))
                            GW, Gb = GW * sW, Gb * sb
                            want_scale[b, h, s] = min(sW, sb)
                        Wt[b, h] -= GW
                        bt[b, h] -= Gb
            what = "%s/%s" % (clip, scope)
            expect_close(res["W1"], Wt, 1e-12, what + " W1")
            expect_close(res["b1"], bt, 1e-12, what + " b1")
            expect_close(res["clip_scale"], want_scale, 1e-12, what + " clip_scale")
            expect(bit or np.min(want_scale) < 0.99, what + ": the clip never bit")


# ---------------------------------------------------------------------------
# (d) refresh semantics: gradient points
# ---------------------------------------------------------------------------

@check("refresh_zero_uses_initial_weights")
def _():
    rng = np.random.default_rng(5)
    k, v, W, theta = linear_setup(rng, T=7)
    W0 = np.asarray(W, np.float64)
    kk, vv, th = (np.asarray(a, np.float64) for a in (k, v, theta))
    B, H, T, dk = k.shape
    dv = v.shape[3]
    # plain SGD, c = 1, r = 0: W^(S) = W^(0) - sum_t theta_t (2/dv)(W^(0) k_t - v_t) k_t^T
    path = write_exp({"layers": 1, "step": 1, "refresh": 0}, {"k": k, "v": v}, {"theta": theta}, {"W1": W})
    res = run_file(path)[1]
    want = W0 - sum(th[:, :, t, None, None] * (2.0 / dv)
                    * np.einsum("bhi,bhj->bhij", np.einsum("bhij,bhj->bhi", W0, kk[:, :, t]) - vv[:, :, t],
                                kk[:, :, t]) for t in range(T))
    expect_close(res["W1"], want, 1e-12, "r=0, c=1: W1")
    loss0 = np.mean((np.einsum("bhij,bhtj->bhti", W0, kk) - vv) ** 2, axis=-1)
    expect_close(res["loss"], loss0, 1e-12, "r=0: every loss at W^(0)")
    # with momentum, decay, c = 2 (short last step), r = 0 and r = 2c
    S = (T + 1) // 2
    eta = f32(rng.uniform(0, 0.8, (B, H, S)))
    alpha = f32(rng.uniform(0, 0.2, (S,)))
    for r in (0, 4, 2):
        path = write_exp({"layers": 1, "step": 2, "refresh": r}, {"k": k, "v": v},
                         {"theta": theta, "eta": eta, "alpha": alpha}, {"W1": W})
        res = run_file(path)[1]
        Wf, Sf, loss, gnorm, _, _ = hand_linear(k, v, W, theta, c=2, r=r, eta=eta,
                                                alpha=np.broadcast_to(alpha, (B, H, S)))
        for key, want in (("W1", Wf), ("S_W1", Sf), ("loss", loss), ("grad_norm", gnorm)):
            expect_close(res[key], want, 1e-12, "c=2 r=%d: %s" % (r, key))
    # and the three gradient points really differ
    r0 = run_file(write_exp({"layers": 1, "step": 2, "refresh": 0}, {"k": k, "v": v},
                            {"theta": theta}, {"W1": W}))[1]
    r2 = run_file(write_exp({"layers": 1, "step": 2, "refresh": 2}, {"k": k, "v": v},
                            {"theta": theta}, {"W1": W}))[1]
    expect(relerr(r0["W1"], r2["W1"]) > 1e-6, "r=0 and r=c gave the same weights")


# ---------------------------------------------------------------------------
# (e) non-finite guard
# ---------------------------------------------------------------------------

@check("nonfinite_skips_exactly_the_affected_steps")
def _():
    rng = np.random.default_rng(6)
    B, H, T, c = 2, 2, 9, 2
    k, v, W, theta = linear_setup(rng, B=B, H=H, T=T)
    S = (T + c - 1) // c
    k[0, 1, 3, 2] = np.nan           # step 1 of memory (0,1)
    v[1, 0, 6, 0] = np.inf           # step 3 of memory (1,0)
    theta[1, 1, 0] = np.nan          # step 0 of memory (1,1)
    theta[1, 1, 8] = np.inf          # step 4 (the short last step) of memory (1,1)
    eta = f32(rng.uniform(0.1, 0.8, (B, H, S)))
    path = write_exp({"layers": 1, "step": c, "clip": "norm", "clip_max": 0.5},
                     {"k": k, "v": v}, {"theta": theta, "eta": eta}, {"W1": W})
    exp, res = run_file(path, trace=True)
    want_skip = np.zeros((B, H, S))
    want_skip[0, 1, 1] = want_skip[1, 0, 3] = want_skip[1, 1, 0] = want_skip[1, 1, 4] = 1
    expect(np.array_equal(res["skipped"], want_skip), "skipped = %s" % res["skipped"].tolist())
    expect(np.all(res["clip_scale"][want_skip == 1] == 0), "clip_scale not 0 on skipped steps")
    expect(np.all(res["clip_scale"][want_skip == 0] > 0), "clip_scale 0 on a good step")
    expect(np.all(~np.isfinite(res["grad_norm"][want_skip == 1])), "grad_norm finite on a skipped step")
    for b, h, s in zip(*np.nonzero(want_skip)):
        expect(np.array_equal(res["W_hist"][s + 1]["W1"][b, h], res["W_hist"][s]["W1"][b, h]),
               "W changed over skipped step %d of memory (%d,%d)" % (s, b, h))
        expect(np.array_equal(res["S_hist"][s + 1]["W1"][b, h], res["S_hist"][s]["W1"][b, h]),
               "S changed over skipped step %d of memory (%d,%d)" % (s, b, h))
    for s in range(S):  # every other memory-step moved
        for b in range(B):
            for h in range(H):
                if not want_skip[b, h, s]:
                    expect(not np.array_equal(res["W_hist"][s + 1]["W1"][b, h], res["W_hist"][s]["W1"][b, h]),
                           "W did not move at step %d of (%d,%d)" % (s, b, h))
    expect(np.all(np.isfinite(res["W1"])) and np.all(np.isfinite(res["S_W1"])), "final weights not finite")
    bad_loss = ~np.isfinite(res["loss"])
    want_bad = np.zeros((B, H, T), bool)
    want_bad[0, 1, 3] = want_bad[1, 0, 6] = True   # theta does not enter the loss
    expect(np.array_equal(bad_loss, want_bad), "non-finite loss at %s" % np.argwhere(bad_loss).tolist())
    bad_y = ~np.isfinite(res["y"]).all(-1)
    want_y = np.zeros((B, H, T), bool)
    want_y[0, 1, 3] = True                          # q = k there
    expect(np.array_equal(bad_y, want_y), "non-finite y at %s" % np.argwhere(bad_y).tolist())
    # and the numbers: the hand computation with the same skips (no clip hit: max 0.5)
    Wf, Sf, _, _, skipped, _ = hand_linear(k, v, W, theta, c=c, r=c, eta=eta)
    expect(np.array_equal(skipped, want_skip), "hand computation skipped differently")
    if np.all(res["clip_scale"][want_skip == 0] == 1):
        expect_close(res["W1"], Wf, 1e-12, "W1 vs hand computation")
        expect_close(res["S_W1"], Sf, 1e-12, "S_W1 vs hand computation")
    else:
        raise CheckFailed("the norm clip bit; the test expects it not to")


# ---------------------------------------------------------------------------
# (f) generator: determinism and coverage
# ---------------------------------------------------------------------------

def file_content(path):
    """Every attribute and dataset of a file, for equality tests."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            for a, val in obj.attrs.items():
                out[(name, "@" + a)] = (repr(val), str(type(val)))
            if isinstance(obj, h5py.Dataset):
                out[(name, "data")] = (obj.dtype.str, obj[()].tobytes(), obj.shape)
        visit("/", f)
        f.visititems(visit)
    return out


@check("generator_deterministic")
def _():
    d1, d2, d3 = (os.path.join(TMP, "gen_det_%d" % i) for i in range(3))
    for d, seed, count in ((d1, 42, 12), (d2, 42, 12), (d3, 43, 12)):
        rc = gen.main(["--seed", str(seed), "--count", str(count), "--out", d])
        expect(rc == 0, "generator exit %s" % rc)
    names = sorted(os.listdir(d1))
    expect(names == ["exp_%05d.h5" % i for i in range(12)], "file names %s" % names)
    expect(names == sorted(os.listdir(d2)), "different file lists")
    for n in names:
        a, b = open(os.path.join(d1, n), "rb").read(), open(os.path.join(d2, n), "rb").read()
        expect(a == b, "%s: same seed, different bytes" % n)
    differ = sum(file_content(os.path.join(d1, n)) != file_content(os.path.join(d3, n)) for n in names)
    expect(differ == len(names), "seed 43 repeated %d files of seed 42" % (len(names) - differ))
    # file i depends on (seed, i) only: a shorter run is a prefix
    d4 = os.path.join(TMP, "gen_det_prefix")
    gen.main(["--seed", "42", "--count", "5", "--out", d4])
    for n in sorted(os.listdir(d4)):
        expect(open(os.path.join(d4, n), "rb").read() == open(os.path.join(d1, n), "rb").read(),
               "%s: --count 5 differs from --count 12" % n)


def shape_kind(shape, B, H, N):
    """Name a gate layout from its shape (N is T or S)."""
    if shape is None:
        return "missing"
    shape = tuple(shape)
    if shape == ():
        return "scalar"
    if shape == (1,):
        return "[1]"
    if len(shape) == 1 and shape[0] == N:
        return "[N]"
    if len(shape) == 2 and shape == (H, 1):
        return "[H,1]"
    if len(shape) == 2 and shape == (H, N):
        return "[H,N]"
    if len(shape) == 3 and shape == (B, H, 1):
        return "[B,H,1]"
    if len(shape) == 3 and shape == (B, H, N):
        return "[B,H,N]"
    return "other %s" % (shape,)


def classify(path):
    """The axis values one experiment file exercises, read from the file
    itself (not from the generator's own description)."""
    exp = mnemo_ref.load_experiment(path)   # also: every generated file must load
    rule = exp.rule
    got = set()
    with h5py.File(path, "r") as f:
        attrs = dict(f["rule"].attrs)
        consts = set(f["rule/constants"].attrs) if "rule/constants" in f else set()
        shapes = {g: (f["gates/" + g].shape if "gates/" + g in f else None)
                  for g in ("theta", "eta", "alpha")}
        init_nd = {n: f["init/" + n].ndim for n in f["init"]}
        strings = {type(attrs[a]).__name__ for a in attrs if isinstance(attrs[a], (str, bytes, np.bytes_))}
        cfg = f.attrs.get("config")
        has_seed = "seed" in f.attrs
    L = rule["layers"]
    got.add("layers=%d" % L)
    if L >= 2:
        got.add("activation=%s" % rule["activation"])
        if "hidden" not in attrs:
            got.add("hidden=from_W1")
    got.add("bias=%d" % rule["bias"])
    got.add("residual=%d" % rule["residual"])
    got.add("loss=%s" % rule["loss"])
    if rule["loss"] == "custom" and exp.loss_expr.uses & consts:
        got.add("loss_expr_uses_constant")
    got.add("feature_reduce=%s" % rule["feature_reduce"])
    got.add("token_reduce=%s" % rule["token_reduce"])
    got.add("retrieve=%s" % rule["retrieve"])
    clip = rule["clip"]
    if clip in ("norm", "softnorm", "scale"):
        got.add("clip=%s/%s" % (clip, rule["clip_scope"]))
    else:
        got.add("clip=%s" % clip)
    c, T, r = rule["step"], exp.T, rule["refresh"]
    if c == 1:
        got.add("step=1")
    if c == T and T > 1:
        got.add("step=T")
    if T % c != 0:
        got.add("step=short_last")
    if 1 < c < T and T % c == 0:
        got.add("step=divides_T")
    if "refresh" not in attrs:
        got.add("refresh=missing")
    elif r == 0:
        got.add("refresh=0")
    elif r == c:
        got.add("refresh=c")
    else:
        got.add("refresh=multiple_of_c")
    got.add("theta=%s" % shape_kind(shapes["theta"], exp.B, exp.H, exp.T))
    for g in ("eta", "alpha"):
        got.add("%s=%s" % (g, shape_kind(shapes[g], exp.B, exp.H, exp.S)))
    for n, nd in init_nd.items():
        base = 2 if (n[2:] if n.startswith("S_") else n)[0] in "WU" else 1
        got.add("init=%s" % {0: "[...]", 1: "[H,...]", 2: "[B,H,...]"}[nd - base])
    got.add("momentum_init=%s" % ("yes" if any(n.startswith("S_") for n in init_nd) else "no"))
    if rule["bias"] and any("b%d" % i not in init_nd for i in range(1, L + 1)):
        got.add("bias_init_missing")
    got.add("q=%s" % ("yes" if exp.has_q else "no"))
    bad = False
    for name, arr in (("k", exp.k), ("v", exp.v), ("theta", exp.theta)):
        if not np.all(np.isfinite(arr)):
            got.add("nonfinite=%s" % name)
            bad = True
    if not bad:
        got.add("nonfinite=none")
    for s in strings:
        got.add("strings=%s" % ("vlen" if s == "str" else "fixed"))
    if cfg is not None and has_seed:
        got.add("has_config_and_seed")
    got.add("out_norm=%s" % rule["out_norm"])
    got.add("qk_norm=%s" % rule["qk_norm"])
    if "ln_g" in exp.given or "ln_b" in exp.given:
        got.add("ln_init_given")
    elif rule["out_norm"] != "none":
        got.add("ln_init_default")
    got.add("precondition=%s" % rule["precondition"])   # SPEC v2
    if exp.lengths is not None:
        got.add("lengths")
        if np.any(exp.lengths < exp.T):
            got.add("lengths_with_padding")
    return got


REQUIRED = (["layers=%d" % i for i in (1, 2, 3)]
            + ["activation=%s" % a for a in ("silu", "gelu", "relu", "tanh", "identity", "custom")]
            + ["bias=0", "bias=1", "residual=0", "residual=1", "hidden=from_W1", "bias_init_missing"]
            + ["loss=%s" % x for x in ("mse", "l1", "huber", "lp", "dot", "logcosh", "custom")]
            + ["loss_expr_uses_constant"]
            + ["clip=none", "clip=value", "clip=softvalue", "clip=elementwise"]
            + ["clip=%s/%s" % (c, s) for c in ("norm", "softnorm", "scale") for s in ("global", "tensor")]
            + ["step=1", "step=T", "step=short_last", "step=divides_T"]
            + ["refresh=missing", "refresh=0", "refresh=c", "refresh=multiple_of_c"]
            + ["retrieve=after", "retrieve=before", "token_reduce=sum", "token_reduce=mean",
               "feature_reduce=mean", "feature_reduce=sum"]
            + ["theta=%s" % s for s in ("scalar", "[1]", "[N]", "[H,1]", "[H,N]", "[B,H,1]", "[B,H,N]")]
            + ["%s=%s" % (g, s) for g in ("eta", "alpha")
               for s in ("missing", "scalar", "[N]", "[H,1]", "[H,N]", "[B,H,N]")]
            + ["init=[...]", "init=[H,...]", "init=[B,H,...]", "momentum_init=yes", "momentum_init=no",
               "q=yes", "q=no", "nonfinite=none", "nonfinite=k", "nonfinite=v", "nonfinite=theta",
               "strings=vlen", "strings=fixed", "has_config_and_seed"]
            + ["out_norm=none", "out_norm=layernorm", "out_norm=rmsnorm", "ln_init_given", "ln_init_default",
               "qk_norm=none", "qk_norm=l2", "qk_norm=rms"]
            + ["precondition=none", "precondition=newton_schulz", "lengths", "lengths_with_padding"])


@check("generator_covers_every_axis_in_300_configs")
def _():
    d = os.path.join(TMP, "gen_cov")
    gen.main(["--seed", "2024", "--count", "300", "--out", d, "--max-T", "64"])
    counts = {}
    for n in sorted(os.listdir(d)):
        for key in classify(os.path.join(d, n)):
            counts[key] = counts.get(key, 0) + 1
    missing = [key for key in REQUIRED if counts.get(key, 0) == 0]
    odd = sorted(key for key in counts if "other" in key)
    expect(not odd, "gate layouts outside SPEC: %s" % odd)
    expect(not missing, "never generated: %s" % ", ".join(missing))
    print("  coverage (300 configs): " + " ".join("%s:%d" % (k, counts[k]) for k in REQUIRED))


@check("generator_grad_configs_cover_every_axis")
def _():
    # the configurations of the conformance run (seed 1, 200 files) that
    # carry /upstream cover every axis too, so /grads is compared on each
    d = os.path.join(TMP, "gen_cov_grads")
    gen.main(["--seed", "1", "--count", "200", "--out", d, "--max-T", "64"])
    counts, n_up = {}, 0
    for n in sorted(os.listdir(d)):
        path = os.path.join(d, n)
        with h5py.File(path, "r") as f:
            if "upstream" not in f:
                continue
        n_up += 1
        for key in classify(path):
            counts[key] = counts.get(key, 0) + 1
    missing = [key for key in REQUIRED if counts.get(key, 0) == 0]
    expect(n_up >= 150, "only %d of 200 configs carry /upstream" % n_up)
    expect(not missing, "no gradient config has: %s" % ", ".join(missing))
    print("  %d gradient configs; rarest axis values: %s" % (n_up, " ".join(
        "%s:%d" % kv for kv in sorted(counts.items(), key=lambda kv: kv[1])[:6])))


@check("generator_configs_fp32_agrees_with_fp64")
def _():
    # The generator promises numbers that an fp32 engine can match to 1e-5.
    # torch's own fp32 arithmetic stands in for such an engine here.
    # Except newton_schulz (SPEC v2): where G has fewer nonzero singular
    # values than its smaller side (one token per step, a narrow layer), the
    # iteration multiplies G's fp32 rounding noise in the empty directions by
    # about 3.4445^ns_steps, so those configurations are measured and printed,
    # held to 3e-3 only (a wrong iteration is off by order 1).
    worst, worst_ns = (0.0, None), (0.0, None)
    for i in range(120):
        cfg = gen.make_config(77, i, max_T=64)
        path = os.path.join(TMP, "fp32_%d.h5" % i)
        gen.write_config(path, cfg)
        exp = mnemo_ref.load_experiment(path)
        r64 = mnemo_ref.run(exp, dtype=torch.float64, grads=False)
        r32 = mnemo_ref.run(exp, dtype=torch.float32, grads=False)
        ns = exp.rule["precondition"] == "newton_schulz"
        for key in r64:
            e = relerr(r32[key], r64[key])
            if ns and e > worst_ns[0]:
                worst_ns = (e, "config %d %s (%s)" % (i, key, cfg["desc"]))
            elif not ns and e > worst[0]:
                worst = (e, "config %d %s (%s)" % (i, key, cfg["desc"]))
    expect(worst[0] < 1e-5, "fp32 vs fp64 relative error %.3g at %s" % worst)
    expect(worst_ns[1] is not None, "no newton_schulz configuration among the 120")
    expect(worst_ns[0] < 3e-3, "newton_schulz: fp32 vs fp64 relative error %.3g at %s" % worst_ns)
    print("  worst fp32 vs fp64 relative error over 120 configs: %.2g; with newton_schulz %.2g (%s)"
          % (worst[0], worst_ns[0], worst_ns[1]))


# ---------------------------------------------------------------------------
# (g) result files: schema names, round trip, CLI and batch mode
# ---------------------------------------------------------------------------

@check("result_file_round_trip")
def _():
    inputs, gates, init = mlp_setup(8, L=2)
    path = write_exp({"layers": 2, "hidden": 5, "step": 3, "loss": "custom", "loss_expr": "w*r^2"},
                     inputs, gates, init, {"w": 0.5})
    exp, res = run_file(path)
    out32 = os.path.join(TMP, "res32.h5")
    out64 = os.path.join(TMP, "res64.h5")
    expect(mnemo_ref.main([path, "-o", out32]) == 0, "CLI failed")
    expect(mnemo_ref.main([path, "-o", out64, "--dtype", "float64"]) == 0, "CLI --dtype float64 failed")
    B, H, T, S, dv = exp.B, exp.H, exp.T, exp.S, exp.dv
    shapes = {"y": (B, H, T, dv), "loss": (B, H, T), "grad_norm": (B, H, S),
              "clip_scale": (B, H, S), "skipped": (B, H, S)}
    names = exp.param_names()
    for n in names:
        shapes[n] = shapes["S_" + n] = (B, H) + exp.param_shape(n)
    for out, dt in ((out32, np.float32), (out64, np.float64)):
        with h5py.File(out, "r") as f, h5py.File(path, "r") as src:
            expect(int(f.attrs["mnemo_schema"]) == 1, "mnemo_schema")
            eng = f.attrs["engine"]
            expect(eng == "mnemo-reference %s torch %s" % (mnemo_ref.VERSION, torch.__version__),
                   "engine %r" % eng)
            expect(f.attrs["device"] == "cpu" and f.attrs["precision"] == "fp64", "device/precision")
            expect(set(f) == {"rule", "outputs", "final"}, "groups %s" % sorted(f))
            expect(dict(f["rule"].attrs) == dict(src["rule"].attrs), "/rule attrs not copied")
            expect(dict(f["rule/constants"].attrs) == {"w": 0.5}, "/rule/constants not copied")
            expect(set(f["outputs"]) == set(mnemo_ref.OUTPUT_NAMES), "outputs %s" % sorted(f["outputs"]))
            want_final = set(names) | {"S_" + n for n in names}
            expect(set(f["final"]) == want_final, "final %s" % sorted(f["final"]))
            for key, shp in shapes.items():
                ds = f[("outputs/" if key in mnemo_ref.OUTPUT_NAMES else "final/") + key]
                expect(ds.shape == shp, "%s shape %s, want %s" % (key, ds.shape, shp))
                expect(ds.dtype == np.dtype(dt).newbyteorder("<"), "%s dtype %s" % (key, ds.dtype))
                expect(np.array_equal(ds[()], res[key].astype(dt)), "%s values changed in the file" % key)
    # batch mode gives the same files as single runs, and a bad file does not stop it
    ind, outd = os.path.join(TMP, "batch_in"), os.path.join(TMP, "batch_out")
    gen.main(["--seed", "9", "--count", "4", "--out", ind, "--max-T", "16"])
    with h5py.File(os.path.join(ind, "exp_00002.h5"), "a") as f:
        del f["gates/theta"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = mnemo_ref.main(["--batch", ind, outd, "-j", "2"])
    expect(rc == 2, "batch with a bad file: exit %s" % rc)
    expect("exp_00002.h5: missing dataset /gates/theta" in err.getvalue(), "batch error %r" % err.getvalue())
    expect(sorted(os.listdir(outd)) == ["exp_00000.h5", "exp_00001.h5", "exp_00003.h5"],
           "batch outputs %s" % sorted(os.listdir(outd)))
    for n in ("exp_00000.h5", "exp_00003.h5"):
        single = os.path.join(TMP, "single_" + n)
        mnemo_ref.main([os.path.join(ind, n), "-o", single])
        expect(file_content(single) == file_content(os.path.join(outd, n)), "%s: batch != single" % n)


@check("bad_input_exit_2_with_one_line_error")
def _():
    inputs, gates, init = mlp_setup(9, L=1)
    init1 = {"W1": init["W1"]}
    good = {"layers": 1, "step": 3}
    cases = [  # (rule, inputs, gates, init, constants, substrings of the message)
        (good, inputs, {}, init1, {}, ["missing dataset /gates/theta"]),
        (good, inputs, dict(gates, theta=f32(np.ones((5,)))), init1, {}, ["/gates/theta", "[5]", "[B,H,T]"]),
        (good, inputs, dict(gates, eta=f32(np.ones((2, 3)))), init1, {}, ["/gates/eta", "[2,3]", "[B,H,S]"]),
        (good, inputs, gates, {}, {}, ["missing dataset /init/W1"]),
        (good, inputs, gates, {"W1": f32(np.ones((4, 4)))}, {}, ["/init/W1", "[4,4]"]),
        (good, inputs, gates, dict(init1, W2=init["W1"]), {}, ["unexpected dataset /init/W2"]),
        (dict(good, refresh=4), inputs, gates, init1, {}, ["attribute refresh", "multiple of step 3"]),
        (dict(good, loss="custom", loss_expr="abs(q - v)"), inputs, gates, init1, {},
         ["attribute loss_expr", "unknown name 'q'", "position 5"]),
        (dict(good, loss="custom"), inputs, gates, init1, {}, ["attribute loss_expr: missing"]),
        (dict(good, loss="l3"), inputs, gates, init1, {}, ["attribute loss", "'l3'"]),
        (dict(good, activaton="relu"), inputs, gates, init1, {}, ["attribute activaton: unknown"]),
        (dict(good, residual=1), inputs, gates, init1, {}, ["residual", "dk=4 dv=3"]),
        (dict(good, clip="scale", clip_expr="min(1, m/n)"), inputs, gates, init1, {},
         ["attribute clip_expr", "unknown name 'm'"]),
        (dict(good, step=0), inputs, gates, init1, {}, ["attribute step"]),
        (good, {"k": inputs["k"], "v": inputs["v"][:, :, :5]}, gates, init1, {}, ["/inputs/v"]),
    ]
    for rule, inp, gat, ini, consts, subs in cases:
        path = write_exp(rule, inp, gat, ini, consts)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = mnemo_ref.main([path, "-o", os.path.join(TMP, "bad_out.h5")])
        msg = err.getvalue()
        expect(rc == 2, "%s: exit %s (%r)" % (subs[0], rc, msg))
        expect(msg.count("\n") == 1, "not one line: %r" % msg)
        expect(path in msg, "message does not name the file: %r" % msg)
        for sub in subs:
            expect(sub in msg, "message %r lacks %r" % (msg, sub))
        expect(not os.path.exists(os.path.join(TMP, "bad_out.h5")), "a result was written for bad input")
    # once through a real process, for the exit status
    path = write_exp(good, inputs, {}, init1)
    p = subprocess.run([sys.executable, os.path.join(HERE, "mnemo_ref.py"), path, "-o",
                        os.path.join(TMP, "bad_out.h5")], capture_output=True, text=True)
    expect(p.returncode == 2, "process exit %d: %s" % (p.returncode, p.stderr))
    expect("missing dataset /gates/theta" in p.stderr and p.stderr.count("\n") == 1, "stderr %r" % p.stderr)


@check("gate_and_param_broadcasting")
def _():
    # every legal gate layout gives the same run as the full [B,H,*] array
    rng = np.random.default_rng(10)
    B, H, T, c = 2, 3, 7, 2
    S = 4
    k, v, W, _ = linear_setup(rng, B=B, H=H, T=T)
    full = {"theta": (B, H, T), "eta": (B, H, S), "alpha": (B, H, S)}
    layouts = {"theta": [(), (1,), (T,), (H, 1), (H, T), (B, H, 1), (B, 1, T), (1, H, T)],
               "eta": [(), (S,), (H, 1), (H, S), (B, H, 1), (B, 1, 1)],
               "alpha": [(), (S,), (H, S), (B, H, S)]}
    lo = {"theta": 0.05, "eta": 0.1, "alpha": 0.0}
    for g, shapes in layouts.items():
        for shp in shapes:
            small = f32(rng.uniform(lo[g], lo[g] + 0.2, shp))
            gates = {"theta": f32(np.full((T,), 0.1)), g: small}
            r1 = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates, {"W1": W}))[1]
            gates[g] = f32(np.broadcast_to(small, full[g]))
            r2 = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates, {"W1": W}))[1]
            same_outputs(r1, r2, ["W1"], 0.0, "%s %s" % (g, shp))
    # parameters as [...], [H,...] and [B,H,...]
    Wf = f32(np.broadcast_to(W[:1, :, :, :], W.shape))
    gates = {"theta": f32(np.full((T,), 0.1))}
    ra = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates, {"W1": W[0]}))[1]
    rb = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates, {"W1": Wf}))[1]
    same_outputs(ra, rb, ["W1"], 0.0, "W1 [H,...] vs [B,H,...]")
    W00 = W[0, 0]
    ra = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates, {"W1": W00}))[1]
    rb = run_file(write_exp({"layers": 1, "step": c}, {"k": k, "v": v}, gates,
                            {"W1": f32(np.broadcast_to(W00, W.shape))}))[1]
    same_outputs(ra, rb, ["W1"], 0.0, "W1 [...] vs [B,H,...]")


@check("retrieve_before_and_short_last_step")
def _():
    rng = np.random.default_rng(12)
    k, v, W, theta = linear_setup(rng, T=7)
    kk = np.asarray(k, np.float64)
    # c = 2, T = 7: steps [0,1] [2,3] [4,5] [6]. Retrieve after: token 0 sees
    # W^(0) (its step has not ended), token 6 sees W^(4) (the short last step
    # ends at it). Before: each token sees the weights before its own step.
    for retrieve, a_of_t in (("after", [0, 1, 1, 2, 2, 3, 4]), ("before", [0, 0, 1, 1, 2, 2, 3])):
        path = write_exp({"layers": 1, "step": 2, "retrieve": retrieve}, {"k": k, "v": v},
                         {"theta": theta}, {"W1": W})
        res = run_file(path)[1]
        Wh = hand_linear(k, v, W, theta, c=2, r=2)[5]
        y = np.stack([np.einsum("bhij,bhj->bhi", Wh[a_of_t[t]], kk[:, :, t]) for t in range(7)], 2)
        expect_close(res["y"], y, 1e-12, "retrieve %s" % retrieve)


@check("token_reduce_mean_and_feature_sum")
def _():
    rng = np.random.default_rng(13)
    k, v, W, theta = linear_setup(rng, T=7)
    res_mean = run_file(write_exp({"layers": 1, "step": 3, "token_reduce": "mean"}, {"k": k, "v": v},
                                  {"theta": theta}, {"W1": W}))[1]
    Wf = hand_linear(k, v, W, theta, c=3, r=3, token_mean=True)[0]
    expect_close(res_mean["W1"], Wf, 1e-12, "token_reduce mean")
    # feature sum = dv times feature mean, for every output that scales
    dv = v.shape[3]
    res_sum = run_file(write_exp({"layers": 1, "step": 3, "feature_reduce": "sum"}, {"k": k, "v": v},
                                 {"theta": f32(theta / dv)}, {"W1": W}))[1]
    res_m = run_file(write_exp({"layers": 1, "step": 3}, {"k": k, "v": v}, {"theta": theta}, {"W1": W}))[1]
    # the first step's losses are at W^(0) in both runs; later ones at weights
    # that differ by the f32 rounding of theta/dv
    expect_close(res_sum["loss"][:, :, :3], res_m["loss"][:, :, :3] * dv, 1e-12, "feature sum loss")
    expect_close(res_sum["loss"], res_m["loss"] * dv, 1e-6, "feature sum loss")
    expect_close(res_sum["W1"], res_m["W1"], 1e-6, "feature sum with theta/dv")  # theta rounded to f32


@check("rounded_products")
def _():
    # conformance's precision probe: bf16 products move a linear memory's
    # retrieval by about bf16's rounding (8 bits), tf32's by about 2^-11,
    # fp32 not at all, and leaving the block restores exact products
    rng = np.random.default_rng(17)
    k, v, W, theta = linear_setup(rng, B=1, H=1, T=16, dk=16, dv=16)
    exp = mnemo_ref.load_experiment(write_exp({"layers": 1, "step": 4}, {"k": k, "v": v}, {"theta": theta}, {"W1": W}))
    exact = mnemo_ref.run(exp, grads=False)["y"]
    moved = {}
    for p in ("fp32", "tf32", "bf16"):
        with mnemo_ref.rounded_products(p):
            moved[p] = relerr(mnemo_ref.run(exp, grads=False)["y"], exact)
    expect(moved["fp32"] == 0, "fp32 products changed y by %g" % moved["fp32"])
    expect(2 ** -14 < moved["tf32"] < 2 ** -8, "tf32 products moved y by %g" % moved["tf32"])
    expect(2 ** -11 < moved["bf16"] < 2 ** -5, "bf16 products moved y by %g" % moved["bf16"])
    expect(relerr(mnemo_ref.run(exp, grads=False)["y"], exact) == 0, "rounding outlived its block")


if __name__ == "__main__":
    # (guarded: batch mode's worker processes re-import this module)
    import shutil
    TMP = tempfile.mkdtemp(prefix="mnemo_ref_test_")
    try:
        run_checks()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(1 if FAILED else 0)

