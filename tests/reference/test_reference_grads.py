#!/usr/bin/env python3
"""test_reference_grads: the reference's gradients of a run (SPEC.md section
7, mnemo_ref.run with /upstream) against central finite differences of its
own float64 forward, on small cases covering every axis: each loss,
activation (custom too), clip and scope, gate layouts, refresh 0 / = c /
multiple of c, retrieve modes, token and feature reduce, residual, bias,
depth 1..3, skipped steps, T not a multiple of c, odd widths, q given or
not, momenta given or not, upstream subsets, and SPEC v2's out_norm (with
its ln_g, ln_b), qk_norm, ragged batches (lengths; padding tokens get no
gradient) and newton_schulz.

Each case checks, for every tensor X the gradients are taken with respect to
(k, v, q, theta, eta, alpha, W1.., S_W1.., ln_g, ln_b), that <dL/dX, u> matches
(L(X + e u) - L(X - e u)) / 2e along two random directions u; a few tiny
cases compare every entry. L is SPEC.md's <dy, y> + <dloss, loss> +
sum_P <dP, P^(S)>, with the terms at non-finite outputs left out (their
gradients are unspecified; SPEC.md section 7), and entries at non-finite
inputs are not perturbed. Prints PASS/FAIL lines; exits 1 on a failure.

    /usr/bin/python3 tests/reference/test_reference_grads.py [-k SUBSTRING]
"""

import copy
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_experiments as gen  # noqa: E402
import mnemo_ref  # noqa: E402

torch.set_num_threads(1)
ONLY = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv[:-1] else None
EPS = 1e-6          # finite-difference step (inputs are of order 0.1 to 1)
DIR_TOL = 2e-6      # directional derivative: |fd - an| / scale
FULL_TOL = 1e-6     # entrywise: relative L2 over the whole tensor


class CheckFailed(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise CheckFailed(msg)


# ---------------------------------------------------------------------------
# Building a case
# ---------------------------------------------------------------------------

def make_case(seed, B=1, H=2, T=7, dk=3, dv=3, L=2, dh=5, c=2, refresh=None, loss="mse",
              activation="silu", clip="none", clip_max=1.0, clip_scope="global", clip_expr=None,
              loss_expr=None, act_expr=None, constants=None, bias=None, residual=0,
              feature_reduce="mean", token_reduce="sum", retrieve="after", q=False,
              momentum=True, theta_shape="full", eta_shape="full", alpha_shape="full",
              upstream=("dy", "dloss", "final"), theta_scale=0.15, loss_delta=0.5, loss_p=1.5,
              nan_at=None, out_norm=None, qk_norm=None, lengths=None, ns_steps=None, glu=False):
    """A small experiment as gen_experiments.write_config takes it. upstream
    lists the upstream gradients given: dy, dloss, final (all final tensors)
    or single names such as dW1 / dS_W1. nan_at = (tensor, b, h, t, value)
    puts a non-finite value in k, v or theta. lengths: SPEC v2's
    /inputs/lengths; ns_steps: precondition = newton_schulz with them. glu
    gates the hidden layers (U_i, c_i drawn after everything else, so other
    cases keep their draws)."""
    rng = np.random.default_rng(seed)
    S = (T + c - 1) // c
    f32 = lambda x: np.asarray(x, dtype=np.float32)
    rule = {"layers": L, "step": c, "loss": loss, "feature_reduce": feature_reduce,
            "token_reduce": token_reduce, "retrieve": retrieve, "clip": clip,
            "clip_max": clip_max, "clip_scope": clip_scope, "residual": residual,
            "loss_delta": loss_delta, "loss_p": loss_p}
    if refresh is not None:
        rule["refresh"] = refresh
    if bias is None:
        bias = 1 if L >= 2 else 0
    rule["bias"] = bias
    if L >= 2:
        rule["hidden"] = dh
        rule["activation"] = activation
    if act_expr:
        rule["activation_expr"] = act_expr
    if loss_expr:
        rule["loss_expr"] = loss_expr
    if clip_expr:
        rule["clip_expr"] = clip_expr
    if qk_norm:
        rule["qk_norm"] = qk_norm
    if ns_steps:
        rule["precondition"] = "newton_schulz"
        rule["ns_steps"] = ns_steps
    k = rng.standard_normal((B, H, T, dk)) / np.sqrt(dk)
    v = rng.standard_normal((B, H, T, dv)) * 0.8
    inputs = {"k": f32(k), "v": f32(v)}
    if q:
        inputs["q"] = f32(rng.standard_normal((B, H, T, dk)) / np.sqrt(dk))
    if lengths is not None:
        inputs["lengths"] = np.asarray(lengths, dtype=np.int64)
    n_sum = c if token_reduce == "sum" else 1
    f_sum = dv if feature_reduce == "sum" else 1
    base = theta_scale / (n_sum * f_sum)
    shapes = {"theta": {"scalar": (), "[T]": (T,), "[H,T]": (H, T), "full": (B, H, T)},
              "eta": {"scalar": (), "[S]": (S,), "[H,1]": (H, 1), "full": (B, H, S), "missing": None},
              "alpha": {"scalar": (), "[S]": (S,), "[H,1]": (H, 1), "full": (B, H, S), "missing": None}}
    gates = {"theta": f32(rng.uniform(0.5 * base, 1.5 * base, shapes["theta"][theta_shape]))}
    for g, lo, hi, kind in (("eta", 0.2, 0.8, eta_shape), ("alpha", 0.0, 0.15, alpha_shape)):
        shp = shapes[g][kind]
        if shp is not None:
            gates[g] = f32(rng.uniform(lo, hi, shp))
    init = {}
    for li in range(1, L + 1):
        out_d = dv if li == L else dh
        in_d = dk if li == 1 else dh
        init["W%d" % li] = f32(rng.standard_normal((H, out_d, in_d)) * 0.8 / np.sqrt(in_d))
        if bias:
            init["b%d" % li] = f32(rng.standard_normal((out_d,)) * 0.1)
    if momentum:
        for n in list(init):
            init["S_" + n] = f32(rng.standard_normal(init[n].shape) * 0.02)
    if out_norm:
        rule["out_norm"] = out_norm
        init["ln_g"] = f32(1 + 0.4 * rng.uniform(-1, 1, (H, dv)))
        init["ln_b"] = f32(0.3 * rng.uniform(-1, 1, (B, H, dv)))
    gate_names = []
    if glu:
        rule["glu"] = 1
        grng = np.random.default_rng([seed, 300])
        for li in range(1, L):
            in_d = dk if li == 1 else dh
            init["U%d" % li] = f32(grng.standard_normal((H, dh, in_d)) * 0.8 / np.sqrt(in_d))
            gate_names.append("U%d" % li)
            if bias:
                init["c%d" % li] = f32(1.0 + 0.2 * grng.standard_normal((dh,)))
                gate_names.append("c%d" % li)
            if momentum:
                for n in gate_names[-2:] if bias else gate_names[-1:]:
                    init["S_" + n] = f32(grng.standard_normal(init[n].shape) * 0.02)
    if nan_at is not None:
        name, b, h, t, val = nan_at
        arr = inputs[name] if name in inputs else gates[name]
        if name == "theta":
            arr[b, h, t] = val
        else:
            arr[b, h, t, 0] = val
    names = []
    for li in range(1, L + 1):
        names += ["W%d" % li] + (["b%d" % li] if bias else [])
    names += gate_names
    full = {n: (B, H) + (init[n].shape[1:] if n[0] in "WU" else init[n].shape) for n in names}
    up = {}
    for u in upstream:
        if u == "dy":
            up["dy"] = f32(rng.standard_normal((B, H, T, dv)))
        elif u == "dloss":
            up["dloss"] = f32(rng.standard_normal((B, H, T)))
        elif u == "final":
            for n in names:
                up["d" + n] = f32(rng.standard_normal(full[n]))
                up["dS_" + n] = f32(rng.standard_normal(full[n]))
        else:
            n = u[3:] if u.startswith("dS_") else u[1:]
            up[u] = f32(rng.standard_normal(full[n]))
    return {"rule": rule, "constants": constants or {}, "inputs": inputs, "gates": gates,
            "init": init, "upstream": up, "desc": "grad case", "strings": "vlen", "seed": seed,
            "index": 0}


# ---------------------------------------------------------------------------
# L and its finite differences
# ---------------------------------------------------------------------------

def objective(exp, res):
    """L of SPEC.md section 7, without the terms at non-finite outputs."""
    total = 0.0
    for key, up in exp.upstream.items():
        out = res[key[1:]]
        ok = np.isfinite(out)
        total += float(np.sum(np.where(ok, up * np.where(ok, out, 0.0), 0.0)))
    return total


def tensor_of(exp, name):
    if name in ("k", "v", "q", "theta", "eta", "alpha"):
        return getattr(exp, name)
    if name.startswith("S_"):
        return exp.momenta[name[2:]]
    if name in exp.outer:
        return exp.outer[name]
    return exp.params[name]


def with_tensor(exp, name, value):
    """A shallow copy of exp whose tensor `name` is value (q follows k when
    the file has no q: k's gradient holds both uses)."""
    e = copy.copy(exp)
    if name in ("k", "v", "q", "theta", "eta", "alpha"):
        setattr(e, name, value)
        if name == "k" and not exp.has_q:
            e.q = value
    elif name.startswith("S_"):
        e.momenta = dict(exp.momenta)
        e.momenta[name[2:]] = value
    elif name in exp.outer:
        e.outer = dict(exp.outer)
        e.outer[name] = value
    else:
        e.params = dict(exp.params)
        e.params[name] = value
    return e


def L_at(exp, name, value):
    e = with_tensor(exp, name, value)
    return objective(exp, mnemo_ref.run(e, grads=False))


def directional(exp, grads, rng, n_dirs=2):
    """Worst directional mismatch over every gradient tensor: (err, detail)."""
    worst = (0.0, "")
    for name, g in grads.items():
        x = tensor_of(exp, name)
        for _ in range(n_dirs):
            u = rng.standard_normal(x.shape) * np.isfinite(x)
            an = float(np.sum(np.where(np.isfinite(x), g, 0.0) * u))
            fd = (L_at(exp, name, x + EPS * u) - L_at(exp, name, x - EPS * u)) / (2 * EPS)
            scale = max(abs(an), abs(fd), float(np.sum(np.abs(np.where(np.isfinite(x), g, 0.0) * u))),
                        1e-4)
            err = abs(fd - an) / scale
            if not math.isfinite(err) or err > worst[0]:
                worst = (err if math.isfinite(err) else math.inf,
                         "%s: analytic %.10g, finite difference %.10g" % (name, an, fd))
    return worst


def entrywise(exp, grads, names=None):
    """Worst relative L2 error of the full finite-difference gradient."""
    worst = (0.0, "")
    for name, g in grads.items():
        if names and name not in names:
            continue
        x = tensor_of(exp, name)
        fd = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            if not np.isfinite(x[idx]):
                continue
            xp, xm = x.copy(), x.copy()
            xp[idx] += EPS
            xm[idx] -= EPS
            fd[idx] = (L_at(exp, name, xp) - L_at(exp, name, xm)) / (2 * EPS)
        ga = np.where(np.isfinite(x), g, 0.0)
        err = np.linalg.norm(ga - fd) / max(np.linalg.norm(fd), 1e-8)
        if err > worst[0] or not math.isfinite(err):
            worst = (err, "%s: |an - fd| / |fd| over %d entries (|fd| = %.3g)"
                     % (name, x.size, np.linalg.norm(fd)))
    return worst


TMP = None


def load(cfg, tag):
    path = os.path.join(TMP, tag + ".h5")
    gen.write_config(path, cfg)
    return mnemo_ref.load_experiment(path)


def check_case(tag, cfg, seed, full=False):
    exp = load(cfg, tag)
    res = mnemo_ref.run(exp)
    grads = res["grads"]
    want = set(mnemo_ref.grad_names(exp))
    expect(set(grads) == want, "grads %s, want %s" % (sorted(grads), sorted(want)))
    for name, g in grads.items():
        x = tensor_of(exp, name)
        expect(g.shape == x.shape, "%s gradient shape %s, want %s" % (name, g.shape, x.shape))
        bad = ~np.isfinite(g) & np.isfinite(x)
        expect(not bad.any(), "%s gradient not finite at %d finite inputs" % (name, bad.sum()))
    if exp.rule["clip"] in ("norm", "softnorm", "scale") and "inactive" not in tag:
        expect(np.nanmin(np.where(res["skipped"] > 0, np.nan, res["clip_scale"])) < 0.999,
               "the %s clip never acts (clip_scale 1 everywhere)" % exp.rule["clip"])
    plain = mnemo_ref.run(exp, grads=False)
    for key in plain:
        a, b = res[key], plain[key]
        ok = np.array_equal(np.isnan(a), np.isnan(b)) and np.allclose(a, b, rtol=1e-12, atol=1e-14,
                                                                      equal_nan=True)
        expect(ok, "forward %s differs with and without gradients" % key)
    rng = np.random.default_rng(1000 + seed)
    err, where = entrywise(exp, grads) if full else directional(exp, grads, rng)
    tol = FULL_TOL if full else DIR_TOL
    expect(err <= tol, "%s (error %.3g > %.3g)" % (where, err, tol))
    return exp, res


# ---------------------------------------------------------------------------
# The cases: (name, make_case options). Every axis of the brief appears.
# ---------------------------------------------------------------------------

CASES = [
    ("linear_mse_c1", dict(L=1, c=1, T=5, dv=2)),
    ("linear_l1_value_clip", dict(L=1, loss="l1", clip="value", clip_max=0.01, dk=3, dv=5)),
    ("linear_bias_dot_c_is_T", dict(L=1, bias=1, loss="dot", c=7, T=7)),
    ("mlp2_silu_huber_norm_global", dict(loss="huber", loss_delta=0.4, clip="norm", clip_max=0.02)),
    ("mlp2_gelu_lp_norm_tensor", dict(activation="gelu", loss="lp", loss_p=1.4, clip="norm",
                                      clip_max=0.02, clip_scope="tensor")),
    ("mlp2_norm_clip_inactive", dict(clip="norm", clip_max=100.0)),
    ("mlp3_tanh_dot_softnorm_global", dict(L=3, activation="tanh", loss="dot", clip="softnorm",
                                           clip_max=0.03, dk=3, dv=5, dh=7)),
    ("mlp2_relu_mse_softnorm_tensor", dict(activation="relu", clip="softnorm", clip_max=0.02,
                                           clip_scope="tensor")),
    ("mlp2_identity_custom_loss_scale_global",
     dict(activation="identity", loss="custom", loss_expr="sqrt(r^2 + eps)",
          clip="scale", clip_expr="1/sqrt(1 + (n/m)^2)", constants={"eps": 0.05, "m": 0.03})),
    ("mlp2_custom_act_scale_tensor",
     dict(activation="custom", act_expr="z/(1 + abs(z))", clip="scale", clip_scope="tensor",
          clip_expr="exp(-n/(n + m))", constants={"m": 0.05})),
    ("mlp2_custom_act_where_elementwise_clip",
     dict(activation="custom", act_expr="where(z > 0, z, z/(1 + abs(z)))", clip="elementwise",
          clip_expr="m*tanh(g/m)", constants={"m": 0.01})),
    ("mlp2_max_act_custom_where_loss",
     dict(activation="custom", act_expr="max(z, a*z)", loss="custom",
          loss_expr="where(abs(r) <= d, 0.5*r^2, d*(abs(r) - 0.5*d))", constants={"a": 0.1, "d": 0.3})),
    ("mlp2_custom_loss_abs_value_clip",
     dict(loss="custom", loss_expr="0.5*r^2 + c3*abs(r)^3", constants={"c3": 0.1}, clip="value",
          clip_max=0.005)),
    ("mlp2_custom_loss_sign_min",
     dict(loss="custom", loss_expr="min(r^2, 0.5) + 0.1*sign(r)*r", clip="elementwise",
          clip_expr="max(min(g, m), -m)", constants={"m": 0.01})),
    ("refresh_0", dict(refresh=0, c=1, T=6)),
    ("refresh_eq_c", dict(refresh=2, c=2, T=8)),
    ("refresh_multiple_of_c_short_last", dict(refresh=6, c=2, T=11)),
    ("refresh_multiple_c1", dict(refresh=3, c=1, T=7, L=1)),
    ("retrieve_before_q_given", dict(retrieve="before", q=True, c=3, T=8)),
    ("retrieve_after_q_given", dict(retrieve="after", q=True)),
    ("token_mean_feature_sum", dict(token_reduce="mean", feature_reduce="sum", c=3, T=8)),
    ("residual_bias_L3", dict(L=3, residual=1, dk=3, dv=3, dh=4)),
    ("residual_no_bias_L2", dict(L=2, residual=1, bias=0, dk=5, dv=5, dh=3)),
    ("gate_shapes_broadcast", dict(theta_shape="[H,T]", eta_shape="[S]", alpha_shape="[H,1]", B=2)),
    ("gates_scalar_no_momentum", dict(theta_shape="scalar", eta_shape="scalar", alpha_shape="scalar",
                                      momentum=False)),
    ("eta_alpha_missing", dict(eta_shape="missing", alpha_shape="missing", momentum=False, c=1, T=5)),
    ("upstream_dy_only", dict(upstream=("dy",), q=True)),
    ("upstream_dloss_only", dict(upstream=("dloss",), c=3, T=8)),
    ("upstream_final_W_only", dict(upstream=("dW2",), L=2)),
    ("upstream_final_momentum_only", dict(upstream=("dS_W1", "db2"))),
    ("odd_widths_T_not_multiple", dict(B=2, H=1, T=9, c=4, dk=1, dv=7, dh=3)),
    ("skipped_step_nan_v", dict(nan_at=("v", 0, 1, 3, np.nan), c=2, T=8)),
    ("skipped_step_inf_theta", dict(nan_at=("theta", 0, 0, 2, np.inf), c=3, T=8, clip="norm",
                                    clip_max=0.02)),
    ("skipped_step_nan_k_no_q", dict(nan_at=("k", 0, 1, 4, np.nan), L=1, c=2, T=7)),
    # SPEC v2: TTT's LN-l2 memory (residual + layernorm), rmsnorm, qk_norm
    ("ttt_ln_l2_residual_layernorm", dict(L=2, residual=1, dk=4, dv=4, dh=5, out_norm="layernorm")),
    ("rmsnorm_linear_q_before", dict(L=1, out_norm="rmsnorm", q=True, retrieve="before", c=3, T=8)),
    ("qk_l2_mlp_refresh", dict(qk_norm="l2", refresh=4, c=2, T=9)),
    ("qk_rms_q_layernorm_norm_clip", dict(qk_norm="rms", q=True, out_norm="layernorm", clip="norm",
                                          clip_max=0.02, theta_scale=0.05)),
    ("qk_l2_skipped_nan_v_rmsnorm", dict(qk_norm="l2", out_norm="rmsnorm", nan_at=("v", 0, 1, 3, np.nan),
                                         c=2, T=8)),
    # SPEC v2
    ("ragged_mean_B3", dict(B=3, T=8, c=3, token_reduce="mean", lengths=(5, 8, 0))),
    ("ragged_before_q_refresh", dict(B=2, T=9, c=2, retrieve="before", q=True, refresh=4, lengths=(3, 6))),
    ("ragged_lp_nan_key_in_padding", dict(B=2, loss="lp", loss_p=1.4, lengths=(4, 7),
                                          nan_at=("k", 0, 1, 5, np.nan))),
    ("ragged_softnorm_c1", dict(B=2, c=1, T=6, clip="softnorm", clip_max=0.03, lengths=(2, 5))),
    ("ns5_mlp2", dict(ns_steps=5, c=3, T=9)),
    ("ns2_linear_norm_clip", dict(L=1, ns_steps=2, clip="norm", clip_max=0.02, dk=4, dv=3)),
    ("ns1_mlp3_tensor_clip", dict(L=3, dh=4, ns_steps=1, clip="softnorm", clip_scope="tensor", clip_max=0.03)),
    ("ns3_tall_ragged", dict(L=3, dk=3, dv=5, dh=2, ns_steps=3, B=2, lengths=(5, 2), c=2)),
]

FULL_CASES = [   # tiny, every entry compared
    ("full_linear_mse", dict(B=1, H=1, T=4, dk=2, dv=2, L=1, c=1, q=True)),
    ("full_mlp2_silu_norm_clip", dict(B=1, H=1, T=5, dk=2, dv=3, L=2, dh=3, c=2, clip="norm",
                                      clip_max=0.02, refresh=4)),
    ("full_mlp3_skipped", dict(B=1, H=2, T=5, dk=2, dv=2, L=3, dh=2, c=2,
                               nan_at=("theta", 0, 1, 1, np.nan))),
    ("full_layernorm_qk_l2", dict(B=1, H=1, T=4, dk=2, dv=3, L=1, c=2, out_norm="layernorm", qk_norm="l2")),
    ("full_ns3_ragged", dict(B=2, H=1, T=5, dk=2, dv=3, L=2, dh=3, c=2, ns_steps=3, lengths=(3, 5))),
]


GLU_CASES = [   # SPEC v2's gated hidden layers (seeds after the cases above)
    ("glu_swiglu_mlp2", dict(glu=True, activation="silu", c=2, T=7)),
    ("glu_gelu_L3_no_bias_norm_global", dict(glu=True, activation="gelu", L=3, dh=4, bias=0, clip="norm", theta_scale=0.5,
                                             clip_max=0.005)),
    ("glu_tanh_residual_q_before_refresh0", dict(glu=True, activation="tanh", residual=1, dk=3, dv=3, q=True,
                                                 retrieve="before", refresh=0, c=2, T=8)),
    ("glu_custom_act_huber_softnorm_tensor", dict(glu=True, activation="custom", act_expr="z*sigmoid(1.5*z)",
                                                  loss="huber", clip="softnorm", clip_scope="tensor",
                                                  clip_max=0.005)),
    ("glu_skipped_step_nan_v", dict(glu=True, nan_at=("v", 0, 1, 3, np.nan), c=2, T=8)),
    ("full_glu_swiglu", dict(B=1, H=1, T=5, dk=2, dv=2, L=2, dh=3, c=2, glu=True)),
]


def main():
    global TMP
    TMP = tempfile.mkdtemp(prefix="mnemo_grads_test_")
    failed = 0
    t0 = time.time()
    try:
        jobs = ([(n, o, False) for n, o in CASES] + [(n, o, True) for n, o in FULL_CASES]
                + [(n, o, n.startswith("full_")) for n, o in GLU_CASES])
        for seed, (name, opts, full) in enumerate(jobs):
            label = "grads/" + name
            if ONLY and ONLY not in label:
                continue
            try:
                exp, res = check_case(name, make_case(seed, **opts), seed, full)
                extra = EXTRA.get(name)
                if extra:
                    extra(exp, res)
                print("PASS %s" % label)
            except CheckFailed as e:
                print("FAIL %s: %s" % (label, e))
                failed += 1
            except Exception as e:
                tb = traceback.extract_tb(e.__traceback__)[-1]
                print("FAIL %s: %s: %s (%s:%d)" % (label, type(e).__name__, str(e).splitlines()[0] if str(e)
                                                   else "", os.path.basename(tb.filename), tb.lineno))
                failed += 1
            sys.stdout.flush()
        for name, fn in STANDALONE:
            label = "grads/" + name
            if ONLY and ONLY not in label:
                continue
            try:
                fn()
                print("PASS %s" % label)
            except CheckFailed as e:
                print("FAIL %s: %s" % (label, e))
                failed += 1
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    print("test_reference_grads: %.1f s" % (time.time() - t0))
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# Extra checks on some cases, and checks of their own
# ---------------------------------------------------------------------------

def _skipped_identity(exp, res):
    """A skipped step's tokens and gates get no gradient through the update
    (SPEC.md section 7): with no dloss, theta, eta and alpha of the skipped
    memory's step have exactly zero gradient."""
    sk = np.argwhere(res["skipped"] > 0)
    expect(len(sk) > 0, "no step was skipped")
    c, T = exp.rule["step"], exp.T
    g = res["grads"]
    for b, h, s in sk:
        lo, hi = s * c, min((s + 1) * c, T)
        expect(np.all(g["theta"][b, h, lo:hi][np.isfinite(exp.theta[b, h, lo:hi])] == 0),
               "theta of skipped step %d has gradient %s" % (s, g["theta"][b, h, lo:hi]))
        expect(g["eta"][b, h, s] == 0 and g["alpha"][b, h, s] == 0,
               "eta/alpha of skipped step %d: %g %g" % (s, g["eta"][b, h, s], g["alpha"][b, h, s]))


def _padding_zero(exp, res):
    """Padding tokens (t >= lengths_b) get exactly zero gradient for k, v, q
    and theta; steps that start in the padding none for eta and alpha."""
    g = res["grads"]
    pad = np.arange(exp.T)[None, :] >= exp.lengths[:, None]                 # [B,T]
    for name in ("k", "v", "q", "theta"):
        if name in g:
            x = g[name] if name == "theta" else np.abs(g[name]).max(-1)
            expect(np.all(np.where(pad[:, None, :], x, 0) == 0), "%s: gradient at a padding token" % name)
    spad = np.arange(exp.S)[None, :] * exp.rule["step"] >= exp.lengths[:, None]
    for name in ("eta", "alpha"):
        expect(np.all(np.where(spad[:, None, :], g[name], 0) == 0), "%s: gradient at a padding step" % name)
    expect(np.abs(np.where(pad[:, None, :], 0, g["theta"])).max() > 0, "no real token has a theta gradient")


EXTRA = {"skipped_step_nan_v": _skipped_identity, "skipped_step_inf_theta": _skipped_identity,
         "skipped_step_nan_k_no_q": _skipped_identity, "full_mlp3_skipped": _skipped_identity,
         "ragged_mean_B3": _padding_zero, "ragged_before_q_refresh": _padding_zero,
         "ragged_lp_nan_key_in_padding": _padding_zero, "ragged_softnorm_c1": _padding_zero,
         "ns3_tall_ragged": _padding_zero, "full_ns3_ragged": _padding_zero}


def _kink_conventions():
    """Section 7 at the kinks: d|r|/dr = sign(r) = 0 at r = 0 (l1), relu' = 0
    at 0, and a value clip passes the gradient at G = +-c exactly."""
    # l1: a linear memory with W = 0 and v = 0 at token 0 has r = 0 there.
    cfg = make_case(7, B=1, H=1, T=2, dk=2, dv=2, L=1, c=2, loss="l1", upstream=("dloss",),
                    momentum=False)
    cfg["init"]["W1"][:] = 0
    cfg["inputs"]["v"][0, 0, 0] = 0
    exp = load(cfg, "kink_l1")
    g = mnemo_ref.run(exp)["grads"]
    expect(np.all(g["v"][0, 0, 0] == 0), "l1 at r = 0: dv = %s, want 0" % g["v"][0, 0, 0])
    expect(np.all(g["v"][0, 0, 1] != 0), "l1 at r != 0: dv = %s, want nonzero" % g["v"][0, 0, 1])
    # relu: b1 = -W1 k_0 puts token 0's pre-activations at exactly 0, so
    # relu'(0) = 0 and y_0 does not depend on W1 or k_0 through them.
    cfg = make_case(8, B=1, H=1, T=1, dk=2, dv=2, L=2, dh=2, c=1, activation="relu",
                    upstream=("dy",), momentum=False, q=True)
    cfg["inputs"]["q"][0, 0, 0] = [1.0, 0.0]
    cfg["init"]["W1"][:] = [[[0.5, 0.25], [0.125, -0.5]]]
    cfg["init"]["b1"][:] = [-0.5, -0.125]
    cfg["rule"]["retrieve"] = "before"
    exp = load(cfg, "kink_relu")
    g = mnemo_ref.run(exp)["grads"]
    expect(np.all(g["q"] == 0) and np.all(g["W1"] == 0) and np.all(g["b1"] == 0),
           "relu at 0: dq %s dW1 %s db1 %s, want 0" % (g["q"].ravel(), g["W1"].ravel(), g["b1"].ravel()))
    expect(np.any(g["b2"] != 0), "relu case: db2 is zero, the test tests nothing")
    # value clip at |G| = c exactly: with theta = c / |G_00| the (0,0) element
    # sits on the bound, and the gradient passes (torch's clamp, SPEC.md).
    cfg = make_case(9, B=1, H=1, T=1, dk=1, dv=1, L=1, c=1, clip="value", clip_max=0.25,
                    upstream=("dW1",), momentum=False, theta_shape="full", eta_shape="missing",
                    alpha_shape="missing")
    cfg["inputs"]["k"][:] = 1.0
    cfg["inputs"]["v"][:] = 0.0
    cfg["init"]["W1"][:] = 0.5      # G = theta * 2 (W k - v) k = theta
    cfg["gates"]["theta"][:] = 0.25
    exp = load(cfg, "kink_value")
    res = mnemo_ref.run(exp)
    expect(abs(res["W1"][0, 0, 0, 0] - 0.25) < 1e-15, "value clip case: W1 = %s" % res["W1"].ravel())
    dW = float(cfg["upstream"]["dW1"].ravel()[0])
    # dW1_final/dtheta = -dG/dtheta = -1 when the clip passes the gradient
    expect(abs(res["grads"]["theta"].ravel()[0] + dW) < 1e-12,
           "value clip at G = c: dtheta %g, want %g" % (res["grads"]["theta"].ravel()[0], -dW))


def _result_file_has_grads():
    """mnemo_ref.py writes /grads (SPEC.md section 5) when the experiment has
    /upstream, and only then; bad /upstream is a one-line input error."""
    import h5py
    cfg = make_case(11, q=False)
    path = os.path.join(TMP, "file_grads.h5")
    gen.write_config(path, cfg)
    out = os.path.join(TMP, "file_grads_res.h5")
    expect(mnemo_ref.main([path, "-o", out, "--dtype", "float64"]) == 0, "mnemo_ref.py failed")
    exp = mnemo_ref.load_experiment(path)
    res = mnemo_ref.run(exp)
    with h5py.File(out, "r") as f:
        expect("grads" in f, "no /grads")
        expect(list(f["grads"]) == sorted(mnemo_ref.grad_names(exp)), "grads %s" % list(f["grads"]))
        expect("q" not in f["grads"], "/grads/q written for a file without q")
        for n in mnemo_ref.grad_names(exp):
            expect(np.array_equal(f["grads/" + n][()], res["grads"][n]), "/grads/%s differs" % n)
    cfg["upstream"] = {}
    gen.write_config(path, cfg)
    expect(mnemo_ref.main([path, "-o", out]) == 0, "mnemo_ref.py failed without upstream")
    with h5py.File(out, "r") as f:
        expect("grads" not in f, "/grads written without /upstream")
    for bad, msg in (({"dy": np.zeros((1, 2, 7, 2), np.float32)}, "dataset /upstream/dy: shape [1,2,7,2]"),
                     ({"dW9": np.zeros((1, 2, 3, 3), np.float32)}, "unexpected dataset /upstream/dW9")):
        cfg["upstream"] = bad
        gen.write_config(path, cfg)
        try:
            mnemo_ref.load_experiment(path)
            raise CheckFailed("bad /upstream accepted: %s" % msg)
        except mnemo_ref.InputError as e:
            expect(msg in str(e) and path in str(e), "message %r lacks %r" % (str(e), msg))


def _generator_upstream():
    """gen_experiments gives /upstream to 17 of every 20 files (conformance:
    170 of its 200), as random non-empty subsets of dy, dloss and final
    tensors of the right shapes, without changing the rest of a file."""
    kinds = {"dy only": 0, "dloss only": 0, "final only": 0, "dy+dloss": 0, "all three": 0,
             "W": 0, "S": 0, "b": 0, "U": 0, "c": 0}   # U, c: glu's gates
    n_up = 0
    for i in range(200):
        cfg = gen.make_config(1, i, 64)
        up = cfg["upstream"]
        if not up:
            expect("upstream=" not in cfg["desc"], "config %d: desc names an upstream it lacks" % i)
            continue
        n_up += 1
        expect("upstream=" + ",".join(up) in cfg["desc"], "config %d: desc lacks its upstream" % i)
        has = ("dy" in up, "dloss" in up, any(k not in ("dy", "dloss") for k in up))
        kinds["dy only"] += has == (True, False, False)
        kinds["dloss only"] += has == (False, True, False)
        kinds["final only"] += has == (False, False, True)
        kinds["dy+dloss"] += has == (True, True, False)
        kinds["all three"] += has == (True, True, True)
        for key in up:
            if key not in ("dy", "dloss"):
                kinds[key[1] if key[1] != "S" else "S"] += 1
        if i < 40:   # shapes, through the reference's own reader
            path = os.path.join(TMP, "gen_up_%d.h5" % i)
            gen.write_config(path, cfg)
            exp = mnemo_ref.load_experiment(path)
            expect(set(exp.upstream) == set(up), "config %d: upstream read back as %s" % (i, sorted(exp.upstream)))
    expect(n_up == 170, "%d of 200 files have /upstream, want 170" % n_up)
    missing = [k for k, n in kinds.items() if n == 0]
    expect(not missing, "never generated: %s (%s)" % (missing, kinds))
    print("  upstream in 200 configs: %d; %s" % (n_up, " ".join("%s:%d" % kv for kv in kinds.items())))


def _generator_grads_fp32():
    """The generator's files are conditioned so that fp32 gradients can meet
    1e-4: torch's float32 run of the reference stands in for an fp32 engine
    on 100 files of seed 77. Tensors whose float64 norm is below 1e-10, or
    below 1e-9 of the file's largest gradient, cancel to rounding noise (e.g.
    theta's gradient under an active norm clip with one token per step, where
    the update does not depend on theta's scale: 1.1e-10 beside 78 in seed
    77's file 16); they are counted, not held. newton_schulz files (SPEC v2) are measured
    apart and held to 1e-2: the iteration multiplies G's fp32 rounding in
    the directions where G has no singular value by about 3.4445^ns_steps
    (see test_reference.py's generator_configs_fp32_agrees_with_fp64)."""
    worst, where, cancel, n = 0.0, "", 0, 0
    worst_ns, where_ns = 0.0, ""
    for i in range(100):
        cfg = gen.make_config(77, i, 64)
        if not cfg["upstream"]:
            continue
        n += 1
        exp = load(cfg, "gen77_%d" % i)
        r64 = mnemo_ref.run(exp)["grads"]
        r32 = mnemo_ref.run(exp, dtype=torch.float32)["grads"]
        largest = max(np.linalg.norm(g[np.isfinite(g)]) for g in r64.values())
        for name, b in r64.items():
            m = mnemo_ref.grad_compare_mask(exp, name)
            a, bb = r32[name][m], b[m]
            expect(np.array_equal(np.isfinite(a), np.isfinite(bb)),
                   "config %d %s: non-finite places differ (%s)" % (i, name, cfg["desc"]))
            nb = np.linalg.norm(bb[np.isfinite(bb)])
            if nb < max(1e-10, 1e-9 * largest):
                cancel += 1
                continue
            e = np.linalg.norm((a - bb)[np.isfinite(bb)]) / nb
            if exp.rule["precondition"] == "newton_schulz":
                if e > worst_ns:
                    worst_ns, where_ns = e, "config %d %s (%s)" % (i, name, cfg["desc"])
            elif e > worst:
                worst, where = e, "config %d %s (%s)" % (i, name, cfg["desc"])
    expect(worst < 1e-4, "fp32 vs float64 gradient error %.3g at %s" % (worst, where))
    expect(where_ns, "no newton_schulz file among them")
    expect(worst_ns < 1e-2, "newton_schulz: fp32 vs float64 gradient error %.3g at %s" % (worst_ns, where_ns))
    print("  worst fp32 vs float64 gradient error over %d configs: %.2g (%d tensors cancel); "
          "with newton_schulz %.2g (%s)" % (n, worst, cancel, worst_ns, where_ns))


def _infinite_value_saturated_loss():
    """l1 and huber against v = +-Inf: the step is not skipped (their
    derivative stays finite) and autograd's gradient of the token's infinite
    loss is finite too, so the run's gradients are those with v = +-1e6 there
    (same derivative, same G) except the entry at the infinite input."""
    for loss in ("huber", "l1"):
        cfg = make_case(12, loss=loss, loss_delta=0.3, c=3, T=8, L=2)
        runs = []
        for val in (np.inf, 1e6):
            cfg["inputs"]["v"][0, 1, 4, 1] = val
            cfg["inputs"]["v"][0, 0, 2, 0] = -val
            exp = load(cfg, "satur_%s_%g" % (loss, val))
            runs.append(mnemo_ref.run(exp))
        a, b = runs
        expect(a["skipped"].sum() == 0, "%s: a step was skipped" % loss)
        for name, g in a["grads"].items():
            ga, gb = g.copy(), b["grads"][name].copy()
            if name == "v":
                ga[0, 1, 4, 1] = gb[0, 1, 4, 1] = ga[0, 0, 2, 0] = gb[0, 0, 2, 0] = 0
            expect(np.all(np.isfinite(ga)), "%s: %s gradient not finite" % (loss, name))
            err = np.linalg.norm(ga - gb) / max(np.linalg.norm(gb), 1e-300)
            expect(err < 1e-12, "%s: %s differs with v = Inf and v = 1e6 (%.3g)" % (loss, name, err))


STANDALONE = [("infinite_value_saturated_loss", _infinite_value_saturated_loss),
              ("kink_conventions", _kink_conventions), ("result_file_grads", _result_file_has_grads),
              ("generator_upstream", _generator_upstream), ("generator_grads_fp32", _generator_grads_fp32)]


if __name__ == "__main__":
    sys.exit(main())
