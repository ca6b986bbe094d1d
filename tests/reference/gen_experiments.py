#!/usr/bin/env python3
"""gen_experiments: random experiment files (SPEC.md section 5) covering every
axis of the spec, for conformance runs of the engines against mnemo_ref.py.

    gen_experiments.py --seed S --count N --out DIR [--max-T 64] [--min-width W] [--v1] [--describe]

writes DIR/exp_00000.h5 ... . File i depends only on (seed, i), so --count 10
gives the first ten files of --count 300, and the same seed gives the same
files. Each file has root attrs `config` (one line saying what it tests),
`seed` and `index`. --describe prints the config lines (with or without --out).

Coverage: the main axes are stratified: within every block of n consecutive
files an axis with n values takes each value once (in a per-block random
order), so any 300 files cover every value; the pairing between axes is
random.

Conditioning: the numbers are chosen so that an fp32 engine agrees with the
fp64 reference to 1e-5 relative over up to 64 steps: keys of norm about 1,
values of order 1, learning rates scaled down by the number of tokens summed
into a step and by dv when features are summed (so a step is a small
fraction of the local curvature), eta <= 0.8, alpha in [0, min(0.2, 3/S)]
(weights are never decayed to nothing), weights at fan-in scale, and smooth
custom expressions without cancellation near 0 (kinks only where the
built-in parts have them too: relu, l1, value clip). Measured with torch's
fp32 as the stand-in engine, the worst relative error over 1800 configs is
below 4e-6 (test_reference.py checks 120 of them against 1e-5).

Gradients (SPEC.md section 7): 17 of every 20 files (stratified) carry
/upstream, a random non-empty subset of dy, dloss and d<final tensor>, drawn
from random streams of their own so that the rest of a file does not depend
on it. The conditioning above serves the gradients too: torch's float32
gradients stay within 1e-4 of float64 on these files (test_reference_grads.py
checks 85 of them), except tensors that cancel to rounding noise (theta's
gradient under an active norm clip with one token per step: the update does
not depend on theta's scale).

SPEC v2: a quarter of the files (stratified) use precondition =
newton_schulz (ns_steps 1, 2, 3 or 5) and a quarter carry /inputs/lengths
(any length 0..T per sequence), drawn from a stream of their own. Newton-
Schulz is the exception to the 1e-5 above: where a step's G has fewer
nonzero singular values than its smaller side (one token per step, a layer
wider than the step), the iteration multiplies G's fp32 rounding in those
directions by about 3.4445^ns_steps; torch's fp32 run is then off by up to
about 4e-5 in the forward and 5e-5 in the gradients (measured over seed 77's
files; test_reference.py and test_reference_grads.py print it), and
conformance holds such tensors to ten times the float32 reference's error,
naming them.
Needs numpy and h5py only (no torch), so it starts fast.
"""

import argparse
import os
import sys

import numpy as np
import h5py

# Stratified axes: name -> values. Order matters only for reproducibility.
AXES = [
    ("layers", [1, 2, 3]),
    ("activation", ["silu", "gelu", "relu", "tanh", "identity", "custom"]),
    ("bias", [0, 1]),
    ("residual", [0, 1]),
    ("loss", ["mse", "l1", "huber", "lp", "dot", "logcosh", "custom"]),
    ("feature_reduce", ["mean", "sum"]),
    ("token_reduce", ["sum", "mean"]),
    ("clip", ["none", "norm/global", "norm/tensor", "softnorm/global", "softnorm/tensor",
              "value", "softvalue", "scale/global", "scale/tensor", "elementwise"]),
    ("step_kind", ["one", "short", "divides", "whole"]),
    ("refresh_kind", ["default", "zero", "c", "multiple"]),
    ("retrieve", ["after", "before"]),
    ("theta_shape", ["scalar", "[1]", "[T]", "[H,1]", "[H,T]", "[B,H,1]", "[B,H,T]"]),
    ("eta_shape", ["missing", "scalar", "[S]", "[H,1]", "[H,S]", "[B,H,S]"]),
    ("alpha_shape", ["missing", "scalar", "[S]", "[H,1]", "[H,S]", "[B,H,S]"]),
    ("init_layout", ["[...]", "[H,...]", "[B,H,...]", "mixed"]),
    ("momentum_init", [0, 1]),
    ("q", [0, 1]),
    ("nonfinite", ["none", "none", "none", "none", "none", "k", "v", "theta"]),
    ("strings", ["vlen", "fixed"]),
    ("precondition", ["none", "none", "none", "newton_schulz"]),   # SPEC v2
    ("ragged", [0, 0, 0, 1]),                                      # SPEC v2: /inputs/lengths
]

# Custom expressions: (text, constants). All smooth where it matters (see the
# module comment); constants exercise /rule/constants. None of them subtracts
# nearly equal numbers near 0 (softplus(z) - log(2), 2*sigmoid(2*z) - 1,
# exp(z) - 1, 1 - exp(-r^2)): in fp32 those lose most of their digits for
# small arguments, and small arguments are common once weights decay.
ACT_EXPRS = [
    ("z*sigmoid(z)", {}),
    ("tanh(z) + 0.1*z", {}),
    ("softplus(z)", {}),
    ("z/(1 + abs(z))", {}),
    ("where(z > 0, z, z/(1 + abs(z)))", {}),
    ("max(z, a*z)", {"a": 0.1}),
    ("gelu(z)", {}),
    ("z*tanh(softplus(z))", {}),
    ("sqrt(z^2 + 1) + 0.5*z", {}),
]
LOSS_EXPRS = [
    ("r^2", {}),
    ("0.5*r^2 + c3*abs(r)^3", {"c3": 0.1}),
    ("sqrt(r^2 + eps)", {"eps": 0.05}),
    ("log(1 + r^2)", {}),
    ("r^2/(1 + abs(r))", {}),
    ("where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", {"delta": 0.3}),
    ("-y*v + 0.5*y^2", {}),
    ("w*(y - v)^2", {"w": 0.7}),
    ("abs(r)", {}),
    ("r^2/(1 + r^2/s)", {"s": 2.0}),
    ("tanh(r)^2", {}),
]
SCALE_EXPRS = [   # in n, the norm
    ("min(1, m/(n + 1e-12))", {"m": None}),
    ("1/(1 + n)", {}),
    ("exp(-n/(n + m))", {"m": None}),   # exponent in [-1, 0]: exp(-n/m) magnifies rounding by n/m
    ("1/sqrt(1 + (n/m)^2)", {"m": None}),
    ("where(n > m, m/n, 1)", {"m": None}),
]
ELEM_EXPRS = [    # in g, one element
    ("m*tanh(g/m)", {"m": None}),
    ("g/(1 + abs(g)/m)", {"m": None}),
    ("max(min(g, m), -m)", {"m": None}),
    ("sign(g)*min(abs(g), m)", {"m": None}),
    ("0.5*g", {}),
]

DEFAULTS = {"layers": 1, "activation": "silu", "residual": 0, "loss": "mse",
            "loss_delta": 1.0, "loss_p": 1.5, "feature_reduce": "mean",
            "token_reduce": "sum", "step": 1, "retrieve": "after", "clip": "none",
            "clip_max": 1.0, "clip_scope": "global"}


def _axis_value(seed, axis_no, values, i):
    """Stratified choice: block i // n is a random permutation of the values."""
    n = len(values)
    perm = np.random.default_rng([seed, 1000 + axis_no, i // n]).permutation(n)
    return values[perm[i % n]]


def _divisors(T):
    return [c for c in range(2, T) if T % c == 0]


def _gate_array(rng, shape_kind, B, H, N, lo, hi):
    """A gate of the given layout, values uniform in [lo, hi]."""
    shape = {"scalar": (), "[1]": (1,), "[T]": (N,), "[S]": (N,), "[H,1]": (H, 1),
             "[H,T]": (H, N), "[H,S]": (H, N), "[B,H,1]": (B, H, 1),
             "[B,H,T]": (B, H, N), "[B,H,S]": (B, H, N)}[shape_kind]
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def make_config(seed, i, max_T=64, min_width=1, v2=True):
    """Everything about file i as plain Python/numpy data (no I/O). With
    min_width = w > 1, dk, dv and the hidden width are drawn from [w, 2w]
    instead (the same draws otherwise: file i is file i with wider tensors).
    v2 = False leaves out every SPEC v2 option (glu, out_norm, qk_norm,
    precondition, lengths; the rest of the file is the same): the file as
    the generator made it before v2, for regressions met before v2. v2 may
    also name the options to keep (a collection of V2_OPTIONS, e.g. those an
    engine runs); each option's draws do not depend on which others are
    kept."""
    keep = set(V2_OPTIONS) if v2 is True else set(v2 or ())
    unknown = keep - set(V2_OPTIONS)
    if unknown:
        raise ValueError("make_config: unknown v2 options %s" % sorted(unknown))
    ax = {name: _axis_value(seed, n, vals, i) for n, (name, vals) in enumerate(AXES)}
    rng = np.random.default_rng([seed, i])

    L = ax["layers"]
    B, H = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    lo, hi = (1, 9) if min_width <= 1 else (min_width, 2 * min_width + 1)
    dk = int(rng.integers(lo, hi))
    dv = dk if ax["residual"] else int(rng.integers(lo, hi))
    dh = int(rng.integers(1, 17) if min_width <= 1 else rng.integers(lo, hi)) if L >= 2 else None

    # T and c per the step kind; T is log-uniform-ish so short runs are common
    # but long ones (up to max_T) appear too.
    T = int(np.clip(round(np.exp(rng.uniform(0, np.log(max_T)))), 1, max_T))
    kind = ax["step_kind"]
    if kind == "short" and max_T >= 3:
        T = max(T, 3)
        c = int(rng.choice([c for c in range(2, T) if T % c != 0]))
    elif kind == "divides" and max_T >= 4:
        while not _divisors(T):
            T = int(rng.integers(4, max_T + 1))
        c = int(rng.choice(_divisors(T)))
    elif kind == "whole":
        c = T
    else:
        c = 1
    S = (T + c - 1) // c
    rkind = ax["refresh_kind"]
    r = {"default": None, "zero": 0, "c": c, "multiple": c * int(rng.integers(2, 5))}[rkind]

    rule = {"layers": L, "step": c, "retrieve": ax["retrieve"],
            "feature_reduce": ax["feature_reduce"], "token_reduce": ax["token_reduce"],
            "residual": ax["residual"], "bias": ax["bias"]}
    if r is not None:
        rule["refresh"] = r
    constants = {}
    if L >= 2:
        rule["hidden"] = dh
        rule["activation"] = ax["activation"]
        if ax["activation"] == "custom":
            text, consts = ACT_EXPRS[rng.integers(len(ACT_EXPRS))]
            rule["activation_expr"] = text
            constants.update(consts)
    else:
        # activation is irrelevant to a linear memory; write it anyway sometimes
        if rng.random() < 0.5:
            rule["activation"] = ax["activation"] if ax["activation"] != "custom" else "tanh"

    loss = ax["loss"]
    rule["loss"] = loss
    if loss == "huber":
        rule["loss_delta"] = float(np.round(rng.uniform(0.1, 1.5), 3))
    elif loss == "lp":
        # p > 2 makes the curvature grow with |r|^(p-2): with stale gradients
        # (refresh > step) runs diverged even in float64 (seeds 5, 9, 10:
        # weights of 1e14 to 1e232), which tests nothing but overflow.
        rule["loss_p"] = float(np.round(rng.uniform(1.3, 2.0), 3))
    elif loss == "custom":
        text, consts = LOSS_EXPRS[rng.integers(len(LOSS_EXPRS))]
        rule["loss_expr"] = text
        constants.update(consts)

    clip = ax["clip"]
    cname, _, scope = clip.partition("/")
    rule["clip"] = cname
    if scope:
        rule["clip_scope"] = scope
    elif rng.random() < 0.3:
        rule["clip_scope"] = str(rng.choice(["global", "tensor"]))  # ignored, but legal
    m = float(np.round(10 ** rng.uniform(-2, 0), 4))
    if cname in ("norm", "softnorm"):
        rule["clip_max"] = m
    elif cname in ("value", "softvalue"):
        rule["clip_max"] = float(np.round(10 ** rng.uniform(-3, -1), 5))
    elif cname in ("scale", "elementwise"):
        pool = SCALE_EXPRS if cname == "scale" else ELEM_EXPRS
        text, consts = pool[rng.integers(len(pool))]
        rule["clip_expr"] = text
        mm = m if cname == "scale" else float(np.round(10 ** rng.uniform(-3, -1), 5))
        constants.update({k: (mm if val is None else val) for k, val in consts.items()})

    # Learning rate: a step sums up to c tokens (token_reduce sum) and, with
    # feature_reduce sum, dv features; scale theta down by both so a step stays
    # a small fraction of the curvature whatever the configuration.
    n_sum = c if ax["token_reduce"] == "sum" else 1
    f_sum = dv if ax["feature_reduce"] == "sum" else 1
    base = rng.uniform(0.02, 0.25) / (n_sum * f_sum)
    if loss == "dot":
        base *= 0.5  # unbounded below: keep the drift of W moderate
    theta_kind = ax["theta_shape"]
    if ax["nonfinite"] == "theta" and theta_kind in ("scalar", "[1]", "[H,1]", "[B,H,1]"):
        theta_kind = "[B,H,T]"  # a bad value at a few tokens, not all of them
    gates = {"theta": _gate_array(rng, theta_kind, B, H, T, 0.5 * base, 1.5 * base)}
    gate_kinds = {"theta": theta_kind}
    # alpha is at most 0.2 and at most 3/S, so that the weights are not decayed
    # to nothing over a long run (a deep memory with vanishing weights makes
    # every gradient tiny and its relative rounding error large).
    for g, lo, hi in (("eta", 0.0, 0.8), ("alpha", 0.0, min(0.2, 3.0 / S))):
        kindg = ax[g + "_shape"]
        gate_kinds[g] = kindg
        if kindg != "missing":
            gates[g] = _gate_array(rng, kindg, B, H, S, lo, hi)

    # Inputs: keys of norm about 1, values of order 1.
    k = (rng.standard_normal((B, H, T, dk)) / np.sqrt(dk)
         * rng.uniform(0.5, 1.5, size=(B, H, T, 1))).astype(np.float32)
    v = (rng.standard_normal((B, H, T, dv)) * rng.uniform(0.5, 1.0)).astype(np.float32)
    inputs = {"k": k, "v": v}
    if ax["q"]:
        inputs["q"] = (rng.standard_normal((B, H, T, dk)) / np.sqrt(dk)).astype(np.float32)

    # Parameters at fan-in scale, each laid out as [...], [H,...] or [B,H,...].
    names = []
    for li in range(1, L + 1):
        out_d = dv if li == L else dh
        in_d = dk if li == 1 else dh
        names.append(("W%d" % li, (out_d, in_d)))
        if ax["bias"]:
            names.append(("b%d" % li, (out_d,)))
    layouts = ["[...]", "[H,...]", "[B,H,...]"]
    init, init_kinds = {}, {}
    gain = rng.uniform(0.3, 1.0)
    omit_bias = ax["bias"] and rng.random() < 0.2   # a missing b_i means zeros
    for n, shp in names:
        if n[0] == "b" and omit_bias and rng.random() < 0.5:
            continue
        lay = ax["init_layout"] if ax["init_layout"] != "mixed" else layouts[rng.integers(3)]
        lead = {"[...]": (), "[H,...]": (H,), "[B,H,...]": (B, H)}[lay]
        scale = gain / np.sqrt(shp[-1]) if n[0] == "W" else 0.1
        init[n] = (rng.standard_normal(lead + shp) * scale).astype(np.float32)
        init_kinds[n] = lay
        if ax["momentum_init"]:
            lay2 = layouts[rng.integers(3)]
            lead2 = {"[...]": (), "[H,...]": (H,), "[B,H,...]": (B, H)}[lay2]
            init["S_" + n] = (rng.standard_normal(lead2 + shp) * 0.05 * scale).astype(np.float32)
            init_kinds["S_" + n] = lay2

    # Non-finite values at a few tokens. Inf goes into k only for a linear
    # memory: through an MLP, an infinite key can give a finite or a NaN output
    # depending on the order of floating-point operations, which is not what
    # a conformance test should hinge on.
    bad = []
    nf = ax["nonfinite"]
    if nf != "none":
        for _ in range(int(rng.integers(1, 4))):
            b, h, t = int(rng.integers(B)), int(rng.integers(H)), int(rng.integers(T))
            choices = [np.nan, np.inf, -np.inf] if (nf != "k" or L == 1) else [np.nan]
            # An infinite residual through a custom where(...) loss: autograd's
            # where gives 0 * inf = NaN for the unselected branch and skips the
            # step, while mnemo's symbolic derivative takes the selected branch
            # (README: known differences). NaN behaves the same in both.
            if nf == "v" and "where" in rule.get("loss_expr", ""):
                choices = [np.nan]
            val = choices[rng.integers(len(choices))]
            if nf == "theta":
                arr = gates["theta"]
                idx = (b, h, t)[3 - arr.ndim:]
                arr[idx] = np.inf if val == -np.inf else val  # theta stays >= 0
            else:
                arr = inputs[nf]
                arr[b, h, t, rng.integers(arr.shape[3])] = val
            bad.append("%s@(%d,%d,%d)=%s" % (nf, b, h, t, val))

    # Attributes equal to their default are sometimes left out, so that the
    # defaults of SPEC.md get exercised too.
    bias_default = 1 if L >= 2 else 0
    for key in list(rule):
        dflt = bias_default if key == "bias" else DEFAULTS.get(key, object())
        if key == "hidden":
            if rng.random() < 0.3:
                del rule[key]          # taken from W1's shape
        elif rule[key] == dflt and rng.random() < 0.3:
            del rule[key]

    desc = ("B=%d H=%d T=%d dk=%d dv=%d L=%d%s bias=%d res=%d act=%s loss=%s%s fr=%s tr=%s "
            "c=%d S=%d r=%s ret=%s clip=%s theta=%s eta=%s alpha=%s init=%s S0=%s q=%s "
            "nonfinite=%s str=%s" % (
                B, H, T, dk, dv, L, (" dh=%d" % dh) if L >= 2 else "", ax["bias"],
                ax["residual"], ax["activation"] if L >= 2 else "-", loss,
                ("(%s)" % rule.get("loss_expr", rule.get("loss_delta", rule.get("loss_p", ""))))
                if loss in ("custom", "huber", "lp") else "",
                ax["feature_reduce"], ax["token_reduce"], c, S,
                "default" if r is None else r, ax["retrieve"],
                clip + ("(%s)" % rule["clip_expr"] if "clip_expr" in rule else ""),
                theta_kind, gate_kinds["eta"], gate_kinds["alpha"], ax["init_layout"],
                "yes" if ax["momentum_init"] else "no", "yes" if ax["q"] else "no",
                ",".join(bad) if bad else "none", ax["strings"]))
    if "glu" in keep and L >= 2 and make_glu(seed, i, H, B, dk, dh, ax, rule, init, names):
        desc += " glu"
    norms = make_norms(seed, i, B, H, dk, dv, dh if L >= 2 else dk, rule, gates, init, keep)
    if norms:
        desc += " " + norms
    desc += v2_options(seed, i, ax, rule, inputs, B, T, keep)
    upstream = make_upstream(seed, i, B, H, T, dv, names)
    if upstream:
        desc += " upstream=" + ",".join(upstream)
    return {"rule": rule, "constants": constants, "inputs": inputs, "gates": gates,
            "init": init, "upstream": upstream, "desc": desc, "strings": ax["strings"], "seed": seed, "index": i}


# SPEC v2's normalisations, stratified like the axes (axis numbers of their
# own, so the axes above are as they were): a third of the files normalise
# the output, two fifths the keys and queries.
# SPEC v2's options, each drawn from a stream of its own (make_config's v2).
V2_OPTIONS = ("glu", "out_norm", "qk_norm", "precondition", "lengths")
OUT_NORMS = ["none", "none", "none", "none", "layernorm", "rmsnorm"]
QK_NORMS = ["none", "none", "none", "l2", "rms"]


def make_norms(seed, i, B, H, dk, dv, last_in, rule, gates, init, keep=("out_norm", "qk_norm")):
    """out_norm and qk_norm of file i (rule attrs, /init/ln_g, ln_b), drawn
    from a stream of their own so that the rest of the file is as it was
    before files had them. rms keys have norm sqrt(dk), not about 1: theta
    is scaled down by dk to keep a step a small fraction of the curvature.
    A single key feature is left alone: normalised, it is +-1, and the
    derivative, eps / (x^2 + eps)^(3/2), is all cancellation in fp32; so is
    an output of fewer than 3 features (layernorm of 2 is +-1 too, and with
    kinked losses seed 77's files 93 and 98 lost 5e-4 of the gradient to it)
    or one that is a product through fewer than 3 inputs (last_in, the last
    layer's input width): the normalised output then hardly depends on the
    input's scale, and seed 1's file 75 (dh = 1) had nothing but rounding
    left in W1's gradient.
    Returns the config's words, or ''."""
    out_norm = _axis_value(seed, 200, OUT_NORMS, i) if min(dv, last_in) >= 3 and "out_norm" in keep else "none"
    qk_norm = _axis_value(seed, 201, QK_NORMS, i) if dk >= 2 and "qk_norm" in keep else "none"
    words = []
    rng = np.random.default_rng([seed, i, 200])
    if qk_norm != "none":
        rule["qk_norm"] = qk_norm
        if qk_norm == "rms":
            gates["theta"] = (gates["theta"] / dk).astype(np.float32)
        words.append("qk_norm=" + qk_norm)
    if out_norm != "none":
        rule["out_norm"] = out_norm
        given = []
        for name, center, spread in (("ln_g", 1.0, 0.5), ("ln_b", 0.0, 0.3)):
            if rng.random() < 0.25:
                continue          # missing: its default (1 or 0)
            lead = [(), (H,), (B, H)][rng.integers(3)]
            init[name] = (center + spread * rng.uniform(-1, 1, size=lead + (dv,))).astype(np.float32)
            given.append(name)
        words.append("out_norm=%s(%s)" % (out_norm, ",".join(given) if given else "defaults"))
    return " ".join(words)


def v2_options(seed, i, ax, rule, inputs, B, T, keep=("precondition", "lengths")):
    """SPEC v2's precondition and lengths for file i, drawn from a stream of
    their own (the rest of the file is what it was before they existed).
    Returns the text added to the config line."""
    rng = np.random.default_rng([seed, i, 210])
    desc = ""
    if ax["precondition"] == "newton_schulz":
        # drawn even when left out, so that lengths' draws stay the same
        steps = int(rng.choice([1, 2, 3, 5, 5]))
        explicit = steps != 5 or rng.random() < 0.5
        if "precondition" in keep:
            rule["precondition"] = "newton_schulz"
            if explicit:
                rule["ns_steps"] = steps
            desc += " precond=ns%d" % steps
    if ax["ragged"] and "lengths" in keep:
        # any length 0..T; a full sequence and an empty one now and then
        lengths = rng.integers(0, T + 1, size=B)
        if B > 1 and rng.random() < 0.5:
            lengths[rng.integers(B)] = T
        inputs["lengths"] = lengths.astype(np.int64)
        desc += " lengths=%s" % ",".join(str(int(x)) for x in lengths)
    return desc


# SPEC v2's gated hidden layers (glu), stratified like the axes (an axis
# number of its own, so the axes above are as they were): a third of the
# files with layers >= 2.
GLUS = [0, 0, 1]


def make_glu(seed, i, H, B, dk, dh, ax, rule, init, names):
    """glu of file i: the rule attr and /init/U1, c1, ... (appended to names,
    the order of the parameter layout), drawn from a stream of their own so
    that the rest of the file is as it was before files had it. U_i at fan-in
    scale like W_i; c_i around 1, so that the gate scales phi(z) by about one
    and a step stays the small fraction of the curvature the conditioning
    above chose. Returns whether the file has glu."""
    if not _axis_value(seed, 300, GLUS, i):
        return False
    rule["glu"] = 1
    rng = np.random.default_rng([seed, i, 300])
    layouts = {"[...]": (), "[H,...]": (H,), "[B,H,...]": (B, H)}
    gain = rng.uniform(0.3, 1.0)
    for li in range(1, rule["layers"]):
        shapes = [("U%d" % li, (dh, dk if li == 1 else dh))] + ([("c%d" % li, (dh,))] if ax["bias"] else [])
        for n, shp in shapes:
            names.append((n, shp))
            if n[0] == "c" and rng.random() < 0.1:
                continue          # missing: zeros
            lay = ax["init_layout"] if ax["init_layout"] != "mixed" else list(layouts)[rng.integers(3)]
            if n[0] == "U":
                init[n] = (rng.standard_normal(layouts[lay] + shp) * gain / np.sqrt(shp[-1])).astype(np.float32)
            else:
                init[n] = (1.0 + 0.2 * rng.standard_normal(layouts[lay] + shp)).astype(np.float32)
            if ax["momentum_init"]:
                lay2 = list(layouts)[rng.integers(3)]
                init["S_" + n] = (rng.standard_normal(layouts[lay2] + shp) * 0.05 * np.abs(init[n]).mean()
                                  ).astype(np.float32)
    return True


# The share of files with /upstream (SPEC.md section 7 gradients), stratified
# like the axes: UPSTREAM_SHARE[0] of every UPSTREAM_SHARE[1] consecutive files.
UPSTREAM_SHARE = (17, 20)


def make_upstream(seed, i, B, H, T, dv, params):
    """/upstream of file i, or {}: a random non-empty subset of dy, dloss and
    d<final tensor> (final tensors picked one by one), standard normal. Drawn
    from streams of their own, so that the rest of file i is the same with or
    without it (and as it was before files had /upstream)."""
    n_up, n = UPSTREAM_SHARE
    if not _axis_value(seed, 100, [True] * n_up + [False] * (n - n_up), i):
        return {}
    rng = np.random.default_rng([seed, i, 100])
    finals = [(n, s) for n, s in params] + [("S_" + n, s) for n, s in params]
    while True:
        pick = {"dy": rng.random() < 0.6, "dloss": rng.random() < 0.6}
        p_final = rng.choice([0.0, 0.3, 1.0])
        pick.update({"d" + n: rng.random() < p_final for n, _ in finals})
        if any(pick.values()):
            break
    shapes = {"dy": (B, H, T, dv), "dloss": (B, H, T)}
    shapes.update({"d" + n: (B, H) + s for n, s in finals})
    return {key: rng.standard_normal(shapes[key]).astype(np.float32)
            for key in shapes if pick[key]}


def write_config(path, cfg):
    """Write one experiment file. Strings are stored either as variable-length
    UTF-8 (h5py's default) or as fixed-length ASCII, as the config says: both
    are plain HDF5 that engines must read."""
    def s(x):
        return np.bytes_(x.encode("ascii")) if cfg["strings"] == "fixed" else x
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = np.int64(1)
        f.attrs["config"] = s(cfg["desc"])
        f.attrs["seed"] = np.int64(cfg["seed"])
        f.attrs["index"] = np.int64(cfg["index"])
        g = f.create_group("rule")
        for key, val in cfg["rule"].items():
            if isinstance(val, str):
                g.attrs[key] = s(val)
            elif isinstance(val, float):
                g.attrs[key] = np.float64(val)
            else:
                g.attrs[key] = np.int64(val)
        if cfg["constants"]:
            cg = g.create_group("constants")
            for key, val in cfg["constants"].items():
                cg.attrs[key] = np.float64(val)
        for group in ("inputs", "gates", "init", "upstream"):
            if group == "upstream" and not cfg.get(group):
                continue
            g = f.create_group(group)
            for key, arr in cfg[group].items():
                integer = group == "inputs" and key == "lengths"
                g.create_dataset(key, data=np.asarray(arr, dtype="<i8" if integer else "<f4"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="gen_experiments.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--out", help="directory for exp_00000.h5 ...")
    ap.add_argument("--max-T", type=int, default=64, dest="max_T")
    ap.add_argument("--min-width", type=int, default=1, dest="min_width",
                    help="draw dk, dv and hidden from [W, 2W] (default: the usual 1..8, 1..16)")
    ap.add_argument("--describe", action="store_true", help="print one line per config")
    ap.add_argument("--v1", action="store_true",
                    help="no SPEC v2 option (glu, out_norm, qk_norm, precondition, lengths): "
                         "the files every CUDA path runs in this version")
    args = ap.parse_args(argv)
    if not args.out and not args.describe:
        ap.error("give --out DIR and/or --describe")
    if args.max_T < 1 or args.count < 0 or args.seed < 0:
        ap.error("--max-T must be >= 1, --count and --seed >= 0")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for i in range(args.count):
        cfg = make_config(args.seed, i, args.max_T, args.min_width, v2=not args.v1)
        name = "exp_%05d.h5" % i
        if args.out:
            write_config(os.path.join(args.out, name), cfg)
        if args.describe:
            print("%s %s" % (name, cfg["desc"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
