#!/usr/bin/env python3
"""mnemo_ref: the float64 Python reference for SPEC.md (update rules of neural
memories), written the way a PyTorch user would write it.

It is deliberately independent of the C engine: the memory is a small
functional module of its parameters, per-token losses come from torch.nn.functional
(or from a custom expression mapped onto torch functions by mnemo_expr), and
each step's gradient comes from torch.autograd.grad. Nothing here derives a
gradient by hand. Reading and checking experiment files is mnemo_exp.py.

Command line:
    mnemo_ref.py EXP.h5 -o RES.h5 [--dtype float64]
    mnemo_ref.py --batch IN_DIR OUT_DIR [--dtype float64] [-j JOBS]
Bad input exits with status 2 and a one-line error naming the file and the
dataset or attribute at fault.

As a module:
    exp = load_experiment("exp.h5")      # validated, broadcast numpy arrays
    res = run(exp)                       # dict of float64 numpy outputs
    write_result("res.h5", exp, res)

Gradients (SPEC.md section 7): an experiment with /upstream gets res["grads"]
and a /grads group in its result. The run is then one autograd graph whose
step gradients come from torch.autograd.grad(..., create_graph=True), as
titans-pytorch computes them; test_reference_grads.py checks it against
finite differences.
"""

import argparse
import math
import glob
import os
import sys
import time

import numpy as np
import h5py
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnemo_expr import abs_nan, gelu  # noqa: E402
from mnemo_exp import (CHOICES, RULE_ATTRS, SCHEMA, Experiment, InputError,  # noqa: E402,F401
                       load_experiment)

VERSION = "1.0"


# ---------------------------------------------------------------------------
# The model, the loss and the run (SPEC.md sections 1 and 2)
# ---------------------------------------------------------------------------

class Memory:
    """The memory model M(x; W) as a functional module: forward(params, x)
    with params a dict of [B,H,...] tensors and x [B,H,N,d_in]. All B x H
    memories are evaluated at once; they share no parameter, so autograd of a
    sum over memories gives each memory its own gradient."""

    def __init__(self, exp):
        self.L = exp.rule["layers"]
        self.bias = bool(exp.rule["bias"])
        self.residual = bool(exp.rule["residual"])
        self.glu = bool(exp.rule.get("glu", 0))
        act = exp.rule["activation"]
        self.phi = {
            "silu": F.silu,
            "gelu": gelu,              # exact erf form (see mnemo_expr.gelu)
            "relu": F.relu,
            "tanh": torch.tanh,
            "identity": lambda z: z,
            "custom": (lambda z: exp.act_expr(z=z)) if exp.act_expr is not None else None,
        }[act]
        self.out_norm = exp.rule.get("out_norm", "none")
        self.outer = None   # ln_g, ln_b [B,H,dv] with out_norm: set by run()

    @staticmethod
    def linear(x, W, b):
        # x [B,H,N,in], W [B,H,out,in], b [B,H,out] -> [B,H,N,out]
        y = torch.matmul(x, W.transpose(-1, -2))
        return y if b is None else y + b.unsqueeze(-2)

    def forward(self, params, x):
        h = x
        for i in range(1, self.L + 1):
            z = self.linear(h, params["W%d" % i], params.get("b%d" % i) if self.bias else None)
            if i < self.L and self.glu:  # glu: phi(W h + b) * (U h + c)
                g = self.linear(h, params["U%d" % i], params.get("c%d" % i) if self.bias else None)
                h = self.phi(z) * g
            else:
                h = self.phi(z) if i < self.L else z
        if self.out_norm != "none":
            # SPEC.md section 1: o -> g N(o) + beta before the residual
            c = h - h.mean(-1, keepdim=True) if self.out_norm == "layernorm" else h
            h = c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-6)
            h = h * self.outer["ln_g"].unsqueeze(-2) + self.outer["ln_b"].unsqueeze(-2)
        return h + x if self.residual else h

    __call__ = forward


def qk_normalise(exp, x):
    """qk_norm (SPEC.md section 1): l2 x / sqrt(sum x^2 + 1e-6), rms x / sqrt(mean x^2 + 1e-6)."""
    kind = exp.rule.get("qk_norm", "none")
    if kind == "none":
        return x
    sq = (x * x).sum(-1, keepdim=True) if kind == "l2" else (x * x).mean(-1, keepdim=True)
    return x / torch.sqrt(sq + 1e-6)


class rounded_products:
    """Within `with rounded_products("bf16"):` (or "tf32") every product of
    the memory (forward, and both products of its backward) rounds its
    operands to that format and accumulates in the run's dtype, as a tensor
    core does. Used by conformance to tell a tensor that reduced precision
    itself moves (the same algorithm, rounded the same way, is off too) from
    an engine that is wrong. "fp32" leaves the products alone."""

    def __init__(self, precision):
        self.round = {"fp32": None, "tf32": _round_tf32, "bf16": _round_bf16}[precision]

    def __enter__(self):
        self.saved = Memory.__dict__["linear"]  # the staticmethod itself
        if self.round is not None:
            Memory.linear = staticmethod(_rounded_linear(self.round))
        return self

    def __exit__(self, *exc):
        Memory.linear = self.saved
        return False


def _straight_through(t, rounded):
    """rounded's values with t's derivatives. Rounding is a step function:
    its derivative (0, or a cut where it goes through integer bits) would
    stop every gradient through the products, and a cast's backward would
    round the gradient too. The probe wants the products' operands rounded
    and the rule's own derivatives. (rounded - t is exact for nearby
    numbers, so the values are rounded's to the bit.)"""
    return t + (rounded - t).detach()


def _round_bf16(t):
    return _straight_through(t, t.detach().to(torch.bfloat16).to(t.dtype))


def _round_tf32(t):
    # nearest of the 10-bit mantissa (ties away), through float32's bits
    i = t.detach().to(torch.float32).view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF
    return _straight_through(t, i.view(torch.float32).to(t.dtype))


def _rounded_linear(rnd):
    class RoundedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, wt):
            ctx.save_for_backward(x, wt)
            return torch.matmul(rnd(x), rnd(wt))

        @staticmethod
        def backward(ctx, g):
            x, wt = ctx.saved_tensors
            return (torch.matmul(rnd(g), rnd(wt).transpose(-1, -2)),
                    torch.matmul(rnd(x).transpose(-1, -2), rnd(g)))

    def linear(x, W, b):
        y = RoundedMatmul.apply(x, W.transpose(-1, -2))
        return y if b is None else y + b.unsqueeze(-2)
    return linear


def make_token_loss(exp):
    """Per-token loss l_t = R_j f(y_tj, v_tj) -> [B,H,N] (before theta)."""
    rule = exp.rule
    kind = rule["loss"]
    if kind == "mse":
        f = lambda y, v: F.mse_loss(y, v, reduction="none")
    elif kind == "l1":
        # |r| with derivative sign(r): 0 at r = 0 and NaN at a NaN residual
        # (torch's l1_loss gives 0 there; see mnemo_expr.abs_nan)
        f = lambda y, v: abs_nan(y - v)
    elif kind == "huber":
        delta = rule["loss_delta"]
        f = lambda y, v: F.huber_loss(y, v, reduction="none", delta=delta)
    elif kind == "lp":
        p = rule["loss_p"]
        f = lambda y, v: abs_nan(y - v).pow(p)
    elif kind == "dot":
        f = lambda y, v: -(y * v)
    elif kind == "logcosh":
        # log cosh r in the form that autograd differentiates to tanh(r) even
        # at an infinite residual (log(cosh(r)) gives inf/inf = NaN there)
        f = lambda y, v: (y - v).abs() + F.softplus(-2 * (y - v).abs()) - math.log(2.0)
    else:
        expr = exp.loss_expr
        f = lambda y, v: expr(y=y, v=v, r=y - v)
    if rule["feature_reduce"] == "mean":
        return lambda y, v: f(y, v).mean(dim=-1)
    return lambda y, v: f(y, v).sum(dim=-1)


def _per_memory(x, like):
    """Reshape a [B,H] tensor to broadcast against a [B,H,...] parameter."""
    return x.reshape(x.shape + (1,) * (like.dim() - 2))


def _sqnorm(g):
    """Squared L2 norm of each memory's slice of a [B,H,...] tensor -> [B,H]."""
    return g.pow(2).flatten(2).sum(-1) if g.dim() > 2 else g.pow(2)


def _safe_sqrt(sq):
    """sqrt(sq) with value 0 and gradient 0 at sq = 0 (and at NaN): torch's
    sqrt has an infinite derivative at 0, and 0 * inf would turn the backward
    of a zero step gradient into NaN. SPEC.md section 7: at |G| = 0 the clip
    scale has no gradient."""
    pos = sq > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, sq, torch.ones_like(sq))),
                       torch.zeros_like(sq))


def _hold(x, mask):
    """x's value, with no gradient flowing back to x where mask (broadcast
    against x) is true. A select, not a product: a NaN cotangent there becomes
    an exact zero instead of spreading."""
    return torch.where(mask, x.detach(), x)


def clip_step(exp, names, G):
    """Clip the step gradient (SPEC.md section 2). Returns (Gt, scale [B,H])
    where scale is what clip_scale reports for a step that is not skipped.
    Written so that autograd follows SPEC.md section 7 at the kinks: a norm
    clip with |G| <= m has scale 1 and no gradient through it, |G| = 0 gives
    scale 1 without gradient, a value clip passes the gradient where
    -c <= G <= c (torch's clamp)."""
    rule = exp.rule
    kind, m, scope = rule["clip"], rule["clip_max"], rule["clip_scope"]
    some = G[names[0]]
    ones = torch.ones(some.shape[:2], dtype=some.dtype)
    if kind == "none":
        return dict(G), ones
    if kind == "value":
        return {n: G[n].clamp(-m, m) for n in names}, ones
    if kind == "softvalue":
        return {n: m * torch.tanh(G[n] / m) for n in names}, ones
    if kind == "elementwise":
        return {n: exp.clip_expr(g=G[n]) for n in names}, ones

    def scale_of(norm):
        # Each division sits behind a where on its own denominator too: the
        # branch that where does not select still gets a zero cotangent, and
        # zero times the derivative of m / 0 is NaN.
        one = torch.ones_like(norm)
        if kind == "norm":
            big = norm > m
            return torch.where(big, m / torch.where(big, norm, one), one)
        if kind == "softnorm":
            pos = norm > 0
            n1 = torch.where(pos, norm, one)
            return torch.where(pos, m * torch.tanh(n1 / m) / n1, one)
        return exp.clip_expr(n=norm)  # scale: evaluated as written, even at n = 0

    if scope == "global":
        s = scale_of(_safe_sqrt(sum(_sqnorm(G[n]) for n in names)))
        return {n: G[n] * _per_memory(s, G[n]) for n in names}, s
    scales = {n: scale_of(_safe_sqrt(_sqnorm(G[n]))) for n in names}
    smallest = torch.stack([scales[n] for n in names]).min(dim=0).values
    return {n: G[n] * _per_memory(scales[n], G[n]) for n in names}, smallest


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def precondition(exp, names, Gt):
    """SPEC.md section 2's preconditioner (v2), after the clip. newton_schulz:
    each 2-D parameter's Gt [B,H,m,n] (biases are [B,H,m] and stay as they
    are) becomes its quintic Newton-Schulz orthogonalisation, transposed to
    wide first, rescaled to Gt's Frobenius norm. A zero Gt stays zero with no
    gradient: both norms go through _safe_sqrt and the rescale sits behind a
    where on its own denominator."""
    if exp.rule["precondition"] == "none":
        return Gt
    a, b, c = NS_COEFFS
    out = dict(Gt)
    for n in names:
        G = Gt[n]
        if G.dim() != 4:
            continue
        tall = G.shape[-2] > G.shape[-1]
        X = G.transpose(-1, -2) if tall else G
        nu = _safe_sqrt(_sqnorm(X))[..., None, None]
        X = X / (nu + 1e-7)
        for _ in range(exp.rule["ns_steps"]):
            A = X @ X.transpose(-1, -2)
            X = a * X + (b * A + c * (A @ A)) @ X
        rho = _safe_sqrt(_sqnorm(X))[..., None, None]
        pos = rho > 0
        X = X * torch.where(pos, nu / torch.where(pos, rho, torch.ones_like(rho)), torch.zeros_like(rho))
        out[n] = X.transpose(-1, -2) if tall else X
    return out


def retrieval_index(exp):
    """a(t): which weights W^(a) token t reads from (SPEC.md section 2)."""
    T, c, S = exp.T, exp.rule["step"], exp.S
    if exp.rule["retrieve"] == "before":
        return [t // c for t in range(T)]
    a = [(t + 1) // c for t in range(T)]
    a[T - 1] = S  # the short last step ends at T-1 too
    return a


def _zero_rows(x, rows):
    """x [B,H,N,d] with the tokens where rows [B,H,N] is true set to zero: a
    finite stand-in, so that the zero cotangent of a token whose output is
    not used meets no NaN or Inf in a product (0 * NaN is NaN)."""
    return torch.where(rows[..., None], torch.zeros_like(x), x)


def _finite_rows(x):
    """[B,H,N,d] -> [B,H,N]: whether every feature of a token is finite."""
    return torch.isfinite(x).all(dim=-1)


def run(exp, dtype=torch.float64, trace=False, grads=True):
    """Run the experiment; returns a dict of numpy float64 arrays: y, loss,
    grad_norm, clip_scale, skipped, and W1.. / S_W1.. (final). With trace=True
    also 'W_hist' and 'S_hist': lists of per-step parameter dicts.

    When the experiment has /upstream (and grads is true) the result also
    holds 'grads': SPEC.md section 7's gradients of
    L = <dy, y> + <dloss, loss> + sum_P <dP, P^(S)> with respect to k, v, q
    (q only when the file has q), theta, eta, alpha (full [B,H,T] / [B,H,S]
    shapes) and every initial parameter and momentum ([B,H,...]). The run is
    then one autograd graph, as titans-pytorch builds it: each step's
    gradient G_s comes from torch.autograd.grad(..., create_graph=True), so
    the backward of L runs through G_s into its gradient point, the step's
    tokens and theta (second derivatives of the loss and of phi included)."""
    rule = exp.rule
    B, H, T, S = exp.B, exp.H, exp.T, exp.S
    c, r = rule["step"], rule["refresh"]
    names = exp.param_names()
    upstream = exp.upstream if grads else None
    diff = upstream is not None
    t = lambda a: torch.as_tensor(a, dtype=dtype)

    leaves = {}   # the tensors the gradients are taken with respect to

    def leaf(name, arr):
        x = t(arr)
        if diff:
            x = x.clone().requires_grad_(True)
            leaves[name] = x
        return x

    k, v = leaf("k", exp.k), leaf("v", exp.v)
    q = leaf("q", exp.q) if exp.has_q else k      # no q: k's gradient holds both uses
    theta, eta, alpha = leaf("theta", exp.theta), leaf("eta", exp.eta), leaf("alpha", exp.alpha)
    W = {n: leaf(n, exp.params[n]) for n in names}
    Sm = {n: leaf("S_" + n, exp.momenta[n]) for n in names}
    model = Memory(exp)
    model.outer = {n: leaf(n, exp.outer[n]) for n in exp.outer_names()}
    # the keys and queries the rule uses (the leaves stay the given ones)
    k = qk_normalise(exp, k)
    q = qk_normalise(exp, q) if exp.has_q else k
    token_loss = make_token_loss(exp)
    if diff:
        # Tokens with a non-finite key or value (query for retrieval): SPEC.md
        # section 7 leaves the gradient entries at non-finite inputs
        # unspecified and wants all others finite (see the step loop).
        bad_kv = ~(_finite_rows(k.detach()) & _finite_rows(v.detach()))
        bad_q = ~_finite_rows(q.detach())

    # Ragged batches (SPEC v2): pad [B,H,T] marks the tokens at and after
    # lengths_b. A padding token is as if theta were 0, has loss 0 and y 0,
    # and is not counted by token_reduce = mean; a step that starts in the
    # padding leaves S and W as they are.
    pad = None
    if exp.lengths is not None:
        pos_t = torch.arange(T)[None, None, :]
        pad = (pos_t >= torch.as_tensor(exp.lengths)[:, None, None]).expand(B, H, T)

    def step_gradient(Wbar, ks, vs, ths, n_tok, pad_s=None):
        """G_s at Wbar (SPEC.md section 2) and the step's per-token losses.
        n_tok: the tokens that count for mean (a number, or [B,H]). pad_s:
        the step's padding tokens (their theta is 0 already): they see the
        fixed pair y = 1, v = 0, so that every loss and its first and second
        derivatives are finite there (lp's f'' is infinite at r = 0, and
        0 * inf in the second-order backward would be NaN)."""
        y = model(Wbar, ks)
        if pad_s is not None:
            y = torch.where(pad_s[..., None], torch.ones_like(y), y)
            vs = torch.where(pad_s[..., None], torch.zeros_like(vs), vs)
        l_t = token_loss(y, vs)                                # [B,H,n], before theta
        if rule["token_reduce"] == "mean":
            objective = ((ths * l_t).sum(-1) / n_tok).sum()
        else:
            objective = (ths * l_t).sum()
        params = [Wbar[n] for n in names]
        if objective.requires_grad:
            g = torch.autograd.grad(objective, params, allow_unused=True, create_graph=diff)
        else:  # a custom loss that does not depend on y at all
            g = [None] * len(params)
        G = {n: (gi if gi is not None else torch.zeros_like(p)) for n, gi, p in zip(names, g, params)}
        if not diff:
            G = {n: G[n].detach() for n in names}
        return G, l_t, y

    loss_parts = []
    grad_norm = torch.zeros(B, H, S, dtype=dtype)
    clip_scale = torch.zeros(B, H, S, dtype=dtype)
    skipped = torch.zeros(B, H, S, dtype=dtype)
    W_hist = [W]          # W^(0), W^(1), ...: gradient points and retrieval
    S_hist = [Sm]

    for s in range(S):
        lo, hi = s * c, min((s + 1) * c, T)
        j = 0 if r == 0 else (s * c // r) * (r // c)   # first step of s's refresh block
        if diff:
            Wbar = W_hist[j]
        else:
            Wbar = {n: W_hist[j][n].detach().clone().requires_grad_(True) for n in names}
        ks, vs, ths = k[:, :, lo:hi], v[:, :, lo:hi], theta[:, :, lo:hi]
        n_tok = hi - lo
        active = torch.ones(B, H, dtype=torch.bool)
        pad_s = None
        if pad is not None:
            pad_s = pad[:, :, lo:hi]
            ks, vs = _zero_rows(ks, pad_s), _zero_rows(vs, pad_s)
            ths = torch.where(pad_s, torch.zeros_like(ths), ths)
            n_tok = (~pad_s).sum(-1).clamp(min=1).to(dtype)
            active = ~pad_s[:, :, 0]
        G, l_t, y = step_gradient(Wbar, ks, vs, ths, n_tok, pad_s)

        sq = sum(_sqnorm(G[n].detach()) for n in names)
        finite = torch.stack([torch.isfinite(G[n].detach()).flatten(2).all(-1) if G[n].dim() > 2
                              else torch.isfinite(G[n].detach()) for n in names]).all(dim=0)  # [B,H]
        if diff and not bool(finite.all()):
            # A skipped step is the identity (SPEC.md section 7). Its G is NaN
            # or Inf somewhere, and the zero cotangent that where() gives the
            # discarded update would meet those values in the backward
            # (0 * NaN): recompute G from held inputs so that nothing of the
            # skipped memories' step reaches their weights, tokens or theta.
            skip = ~finite
            Wh = {n: _hold(Wbar[n], _per_memory(skip, Wbar[n])) for n in names}
            outer = model.outer   # out_norm's ln_g, ln_b: held the same way
            model.outer = {n: _hold(x, skip[:, :, None]) for n, x in outer.items()}
            G, _, _ = step_gradient(Wh, _hold(ks, skip[:, :, None, None]), _hold(vs, skip[:, :, None, None]),
                                    _hold(ths, skip[:, :, None]), n_tok, pad_s)
            model.outer = outer
        if diff:
            bad = bad_kv[:, :, lo:hi]
            if pad is not None:
                bad = bad & ~pad_s
            if bool(bad.any()):
                # A token with a non-finite key or value keeps its loss's
                # gradient where autograd gives a finite one (l1 or huber
                # against v = +-Inf: the derivative is -+1 or -+delta). Where
                # it does not (a NaN, an Inf residual under mse, a non-finite
                # key), the loss keeps its value and its gradient comes from
                # zeroed inputs, which where() then blocks: 0 * NaN would
                # spread.
                gy = torch.autograd.grad(l_t.sum(), y, retain_graph=True, allow_unused=True)[0]
                cut = bad & ~_finite_rows(ks.detach())
                if gy is not None:
                    cut = cut | (bad & ~_finite_rows(gy.detach()))
                if bool(cut.any()):
                    clean = token_loss(model(Wbar, _zero_rows(ks, cut)), _zero_rows(vs, cut))
                    l_t = torch.where(cut, l_t.detach(), clean)
        Gt, scale = clip_step(exp, names, G)
        Gt = precondition(exp, names, Gt)
        if pad is not None:
            l_t = torch.where(pad_s, torch.zeros_like(l_t), l_t)

        eta_s, alpha_s = eta[:, :, s], alpha[:, :, s]
        W_prev, S_prev = W_hist[-1], S_hist[-1]
        W_new, S_new = {}, {}
        for n in names:
            S_upd = _per_memory(eta_s, S_prev[n]) * S_prev[n] - Gt[n]
            W_upd = _per_memory(1 - alpha_s, W_prev[n]) * W_prev[n] + S_upd
            keep = _per_memory(finite & active, S_prev[n])
            # skipped step: momentum and weights keep their values
            S_new[n] = torch.where(keep, S_upd, S_prev[n])
            W_new[n] = torch.where(keep, W_upd, W_prev[n])
        W_hist.append(W_new)
        S_hist.append(S_new)

        loss_parts.append(l_t if diff else l_t.detach())
        grad_norm[:, :, s] = torch.where(active, torch.sqrt(sq), torch.zeros_like(sq))
        clip_scale[:, :, s] = torch.where(active, torch.where(finite, scale.detach(), torch.zeros_like(scale.detach())),
                                          torch.ones_like(scale.detach()))
        skipped[:, :, s] = (~finite & active).to(dtype)

    # Retrieval: y_out_t = M(q_t; W^(a(t))), grouped by the weights used.
    a_of_t = retrieval_index(exp)
    y_out = torch.zeros(B, H, T, exp.dv, dtype=dtype)
    for a in sorted(set(a_of_t)):
        idx = torch.tensor([tt for tt in range(T) if a_of_t[tt] == a])
        qa = q[:, :, idx] if pad is None else _zero_rows(q[:, :, idx], pad[:, :, idx])
        ya = model(W_hist[a], qa)
        bad = bad_q[:, :, idx] & ~pad[:, :, idx] if diff and pad is not None else (bad_q[:, :, idx] if diff else None)
        if diff and bool(bad.any()):
            ya = torch.where(bad[..., None], ya.detach(), model(W_hist[a], _zero_rows(qa, bad)))
        if pad is not None:
            ya = torch.where(pad[:, :, idx, None], torch.zeros_like(ya), ya)
        y_out = y_out.index_copy(2, idx, ya)
    loss_out = torch.cat(loss_parts, dim=2)

    finals = {}
    for n in names:
        finals[n] = W_hist[-1][n]
        finals["S_" + n] = S_hist[-1][n]
    res = {"y": y_out, "loss": loss_out, "grad_norm": grad_norm,
           "clip_scale": clip_scale, "skipped": skipped}
    res.update(finals)
    if diff:
        res["grads"] = _backward(upstream, {"y": y_out, "loss": loss_out}, finals, leaves, t)
    res = {key: (val if key == "grads" else val.detach().to(torch.float64).numpy())
           for key, val in res.items()}
    if trace:
        res["W_hist"] = [{n: w[n].detach().numpy() for n in names} for w in W_hist]
        res["S_hist"] = [{n: w[n].detach().numpy() for n in names} for w in S_hist]
    return res


def _backward(upstream, outputs, finals, leaves, t):
    """The gradients of L = <dy, y> + <dloss, loss> + sum_P <dP, P^(S)>
    (SPEC.md section 7) w.r.t. the leaves, as float64 numpy arrays (zeros
    where L does not depend on a leaf)."""
    terms = []
    for key, val in upstream.items():
        out = outputs[key[1:]] if key in ("dy", "dloss") else finals[key[1:]]
        terms.append((t(val) * out).sum())
    inputs = list(leaves.values())
    L = sum(terms) if terms else None
    if L is not None and L.requires_grad:
        g = torch.autograd.grad(L, inputs, allow_unused=True)
    else:
        g = [None] * len(inputs)
    return {name: (gi.detach() if gi is not None else torch.zeros_like(x.detach())).to(torch.float64).numpy()
            for (name, x), gi in zip(leaves.items(), g)}


# ---------------------------------------------------------------------------
# Writing a result file
# ---------------------------------------------------------------------------

OUTPUT_NAMES = ("y", "loss", "grad_norm", "clip_scale", "skipped")


def grad_names(exp):
    """The datasets of /grads (SPEC.md section 5), in the order written."""
    return (["k", "v"] + (["q"] if exp.has_q else []) + ["theta", "eta", "alpha"]
            + exp.final_names() + exp.outer_names())


def grad_compare_mask(exp, name):
    """Which entries of gradient `name` an engine's /grads is held to: all but
    those at non-finite inputs (SPEC.md section 7 leaves them unspecified)
    and, for k, v and q, all features of a token whose key, value or query
    has a non-finite entry (its loss or output is not finite; this reference
    cuts that token's loss where its derivative is not finite and its output
    where the query is not, and an engine may treat the token's finite
    features differently)."""
    if name in ("k", "v", "q"):
        rows = np.isfinite(exp.k).all(-1) & np.isfinite(exp.v).all(-1) & np.isfinite(exp.q).all(-1)
        return np.broadcast_to(rows[..., None], getattr(exp, name).shape)
    if name in ("theta", "eta", "alpha"):
        return np.isfinite(getattr(exp, name))
    if name in exp.outer:
        return np.isfinite(exp.outer[name])
    x = exp.momenta[name[2:]] if name.startswith("S_") else exp.params[name]
    return np.isfinite(x)


def engine_name():
    return "mnemo-reference %s torch %s" % (VERSION, torch.__version__)


def _copy_attr_group(src, dst):
    """Copy a group's attributes and subgroups (/rule and /rule/constants).
    Not Group.copy: HDF5 1.10 (Debian 12) crashes in H5Ocopy on string
    attributes kept in dense storage."""
    for k, v in src.attrs.items():
        dst.attrs[k] = v
    for k, child in src.items():
        if isinstance(child, h5py.Group):
            _copy_attr_group(child, dst.create_group(k))


def write_result(path, exp, res, out_dtype=np.float32, precision="fp64"):
    """Write result.h5 (SPEC.md section 5) atomically: a temporary name, then
    a rename, so an interrupted batch never leaves a half-written file."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with h5py.File(tmp, "w") as out, h5py.File(exp.path, "r") as src:
            out.attrs["mnemo_schema"] = SCHEMA
            out.attrs["engine"] = engine_name()
            out.attrs["device"] = "cpu"
            out.attrs["precision"] = precision
            _copy_attr_group(src["rule"], out.create_group("rule"))
            g = out.create_group("outputs")
            for n in OUTPUT_NAMES:
                g.create_dataset(n, data=res[n].astype(out_dtype))
            g = out.create_group("final")
            names = exp.param_names()
            for n in names:
                g.create_dataset(n, data=res[n].astype(out_dtype))
            for n in names:
                g.create_dataset("S_" + n, data=res["S_" + n].astype(out_dtype))
            if "grads" in res:
                g = out.create_group("grads")
                for n in grad_names(exp):
                    g.create_dataset(n, data=res["grads"][n].astype(out_dtype))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

DTYPES = {"float32": np.float32, "float64": np.float64}
COMPUTE = {"float64": torch.float64, "float32": torch.float32}


def run_file(exp_path, res_path, out_dtype, compute="float64"):
    """Load, run, write one file. Raises InputError on bad input."""
    exp = load_experiment(exp_path)
    res = run(exp, dtype=COMPUTE[compute])
    write_result(res_path, exp, res, out_dtype,
                 precision="fp64" if compute == "float64" else "fp32")


def _batch_worker(job):
    exp_path, res_path, out_dtype, compute = job
    torch.set_num_threads(1)
    try:
        run_file(exp_path, res_path, out_dtype, compute)
        return None
    except InputError as e:
        return str(e)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="mnemo_ref.py",
        description="float64 PyTorch reference for mnemo experiment files (SPEC.md)")
    ap.add_argument("exp", nargs="?", help="experiment file EXP.h5")
    ap.add_argument("-o", "--output", help="result file RES.h5")
    ap.add_argument("--batch", nargs=2, metavar=("IN_DIR", "OUT_DIR"),
                    help="run every *.h5 in IN_DIR, writing the same names in OUT_DIR")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="dtype of the float datasets written (default float32)")
    ap.add_argument("--compute", choices=sorted(COMPUTE), default="float64",
                    help="arithmetic dtype (float32 only to study rounding sensitivity)")
    ap.add_argument("-j", "--jobs", type=int, default=1,
                    help="worker processes in batch mode (default 1)")
    ap.add_argument("--version", action="version", version=engine_name())
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    out_dtype = DTYPES[args.dtype]

    # Tiny tensors: threads cost more than they give. Batch mode parallelises
    # over files with processes instead (-j).
    torch.set_num_threads(1)

    if args.batch:
        if args.exp or args.output:
            print("mnemo_ref.py: --batch takes no EXP.h5 or -o", file=sys.stderr)
            return 2
        in_dir, out_dir = args.batch
        if not os.path.isdir(in_dir):
            print("mnemo_ref.py: %s: not a directory" % in_dir, file=sys.stderr)
            return 2
        os.makedirs(out_dir, exist_ok=True)
        files = sorted(glob.glob(os.path.join(in_dir, "*.h5")))
        jobs = [(p, os.path.join(out_dir, os.path.basename(p)), out_dtype, args.compute)
                for p in files]
        t0 = time.time()
        if args.jobs > 1 and len(jobs) > 1:
            import multiprocessing as mp
            # spawn, not fork: torch 2.x refuses autograd in a child forked
            # from a process that already ran autograd (e.g. a test harness)
            with mp.get_context("spawn").Pool(args.jobs) as pool:
                errors = pool.map(_batch_worker, jobs, chunksize=1)
        else:
            errors = [_batch_worker(j) for j in jobs]
        bad = [e for e in errors if e]
        for e in bad:
            print("mnemo_ref.py: " + e, file=sys.stderr)
        print("mnemo_ref.py: %d files, %d errors, %.1f s" % (len(jobs), len(bad), time.time() - t0),
              file=sys.stderr)
        return 2 if bad else 0

    if not args.exp or not args.output:
        print("mnemo_ref.py: usage: mnemo_ref.py EXP.h5 -o RES.h5 [--dtype float64] "
              "| --batch IN_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        run_file(args.exp, args.output, out_dtype, args.compute)
    except InputError as e:
        print("mnemo_ref.py: " + str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
