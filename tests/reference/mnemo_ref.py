#!/usr/bin/env python3
"""mnemo_ref: the float64 Python reference for SPEC.md (update rules of neural
memories), written the way a PyTorch user would write it.

It is deliberately independent of the C engine: the memory is a small
functional module of its parameters, per-token losses come from torch.nn.functional
(or from a custom expression mapped onto torch functions by mnemo_expr), and
each step's gradient comes from torch.autograd.grad. Nothing here derives a
gradient by hand.

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
import glob
import os
import sys
import time

import numpy as np
import h5py
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnemo_expr import ExprError, abs_nan, compile_expr, gelu  # noqa: E402

VERSION = "1.0"
SCHEMA = 1


class InputError(Exception):
    """Bad input: the message is one line naming the file, dataset or attribute."""


# ---------------------------------------------------------------------------
# Reading and validating an experiment file (SPEC.md section 5)
# ---------------------------------------------------------------------------

# attr -> (kind, default). A default of None is resolved later (it depends on
# other attrs or on the parameter shapes).
RULE_ATTRS = {
    "layers": ("int", 1),
    "hidden": ("int", None),          # from W1's shape when missing
    "activation": ("str", "silu"),
    "bias": ("bool", None),           # 1 if layers >= 2 else 0
    "residual": ("bool", 0),
    "loss": ("str", "mse"),
    "loss_delta": ("float", 1.0),
    "loss_p": ("float", 1.5),
    "feature_reduce": ("str", "mean"),
    "token_reduce": ("str", "sum"),
    "step": ("int", 1),
    "refresh": ("int", None),         # = step when missing
    "retrieve": ("str", "after"),
    "clip": ("str", "none"),
    "clip_max": ("float", 1.0),
    "clip_scope": ("str", "global"),
    "loss_expr": ("str", None),
    "activation_expr": ("str", None),
    "clip_expr": ("str", None),
}

CHOICES = {
    "activation": ("silu", "gelu", "relu", "tanh", "identity", "custom"),
    "loss": ("mse", "l1", "huber", "lp", "dot", "custom"),
    "feature_reduce": ("mean", "sum"),
    "token_reduce": ("sum", "mean"),
    "retrieve": ("after", "before"),
    "clip": ("none", "norm", "softnorm", "value", "scale", "elementwise"),
    "clip_scope": ("global", "tensor"),
}


def _attr_value(where, name, raw, kind):
    """Convert an HDF5 attribute to a Python value of the wanted kind."""
    if isinstance(raw, np.ndarray):
        if raw.size != 1:
            raise InputError("%s attribute %s: expected one value, got shape %s"
                             % (where, name, raw.shape))
        raw = raw.reshape(()).item() if raw.dtype.kind != "O" else raw.reshape(-1)[0]
    if isinstance(raw, (bytes, np.bytes_)):
        raw = raw.decode("utf-8")
    if kind == "str":
        if not isinstance(raw, str):
            raise InputError("%s attribute %s: expected a string, got %r" % (where, name, raw))
        return raw
    if isinstance(raw, str) or isinstance(raw, (bool, np.bool_)) and kind != "bool":
        raise InputError("%s attribute %s: expected a number, got %r" % (where, name, raw))
    try:
        val = float(raw)
    except (TypeError, ValueError):
        raise InputError("%s attribute %s: expected a number, got %r" % (where, name, raw))
    if kind == "float":
        if not np.isfinite(val):
            raise InputError("%s attribute %s: must be finite, got %r" % (where, name, val))
        return val
    # int and bool: integers, but an integral float (e.g. written from Lua,
    # where numbers may be doubles) is accepted too.
    if not np.isfinite(val) or val != int(val):
        raise InputError("%s attribute %s: expected an integer, got %r" % (where, name, raw))
    val = int(val)
    if kind == "bool" and val not in (0, 1):
        raise InputError("%s attribute %s: expected 0 or 1, got %d" % (where, name, val))
    return val


def _read_array(f, path, fname):
    """A numeric dataset as a float64 numpy array (NaN and Inf allowed)."""
    obj = f.get(path)
    if obj is None:
        return None
    if not isinstance(obj, h5py.Dataset):
        raise InputError("%s: %s is not a dataset" % (fname, path))
    if obj.dtype.kind not in "fiu":
        raise InputError("%s: dataset %s: expected numbers, got dtype %s" % (fname, path, obj.dtype))
    return np.asarray(obj[()], dtype=np.float64)


def _shape_str(shape):
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


class Experiment:
    """Everything a run needs, validated: `rule` (dict of resolved attrs),
    `constants`, compiled expressions, and float64 numpy arrays broadcast to
    their full shapes (k, v, q: [B,H,T,d]; theta [B,H,T]; eta, alpha [B,H,S];
    params and momenta [B,H,...])."""

    def __init__(self, path):
        self.path = path
        try:
            f = h5py.File(path, "r")
        except (OSError, ValueError) as e:
            raise InputError("%s: cannot open as HDF5: %s" % (path, str(e).splitlines()[0]))
        with f:
            self._read(f, path)

    # -- the pieces of a file, in order ------------------------------------

    def _read(self, f, fn):
        if "mnemo_schema" not in f.attrs:
            raise InputError("%s: missing root attribute mnemo_schema" % fn)
        schema = _attr_value(fn + ":", "/mnemo_schema", f.attrs["mnemo_schema"], "int")
        if schema != SCHEMA:
            raise InputError("%s: root attribute mnemo_schema is %d, this reference reads %d"
                             % (fn, schema, SCHEMA))
        self._read_rule(f, fn)
        self._read_inputs(f, fn)
        self._read_init(f, fn)
        self._read_gates(f, fn)
        self._read_upstream(f, fn)
        self._compile_exprs(fn)

    def _read_rule(self, f, fn):
        g = f.get("rule")
        if not isinstance(g, h5py.Group):
            raise InputError("%s: missing group /rule" % fn)
        where = fn + ": /rule"
        for name in g.attrs:
            if name not in RULE_ATTRS:
                # A misspelt attribute would silently take a default; refuse it.
                raise InputError("%s attribute %s: unknown attribute" % (where, name))
        rule = {}
        for name, (kind, default) in RULE_ATTRS.items():
            if name in g.attrs:
                val = _attr_value(where, name, g.attrs[name], kind)
                if name in CHOICES and val not in CHOICES[name]:
                    raise InputError("%s attribute %s: %r is not one of %s"
                                     % (where, name, val, ", ".join(CHOICES[name])))
                rule[name] = val
            else:
                rule[name] = default
        if rule["layers"] < 1:
            raise InputError("%s attribute layers: must be >= 1, got %d" % (where, rule["layers"]))
        if rule["bias"] is None:
            rule["bias"] = 1 if rule["layers"] >= 2 else 0
        if rule["step"] < 1:
            raise InputError("%s attribute step: must be >= 1, got %d" % (where, rule["step"]))
        if rule["refresh"] is None:
            rule["refresh"] = rule["step"]
        r, c = rule["refresh"], rule["step"]
        if r < 0 or r % c != 0:
            raise InputError("%s attribute refresh: %d is not 0 or a multiple of step %d"
                             % (where, r, c))
        if rule["loss"] == "lp" and not rule["loss_p"] > 1:
            raise InputError("%s attribute loss_p: must be > 1, got %r" % (where, rule["loss_p"]))
        if rule["loss"] == "huber" and not rule["loss_delta"] > 0:
            raise InputError("%s attribute loss_delta: must be > 0, got %r"
                             % (where, rule["loss_delta"]))
        if rule["clip"] in ("norm", "softnorm", "value") and not rule["clip_max"] > 0:
            raise InputError("%s attribute clip_max: must be > 0, got %r" % (where, rule["clip_max"]))
        for part, attr in (("loss", "loss_expr"), ("activation", "activation_expr")):
            if rule[part] == "custom" and rule[attr] is None:
                raise InputError("%s attribute %s: missing (%s = custom)" % (where, attr, part))
        if rule["clip"] in ("scale", "elementwise") and rule["clip_expr"] is None:
            raise InputError("%s attribute clip_expr: missing (clip = %s)" % (where, rule["clip"]))
        self.rule = rule

        self.constants = {}
        cg = g.get("constants")
        if cg is not None:
            if not isinstance(cg, h5py.Group):
                raise InputError("%s: /rule/constants is not a group" % fn)
            for name in cg.attrs:
                self.constants[name] = _attr_value(fn + ": /rule/constants", name,
                                                   cg.attrs[name], "float")

    def _read_inputs(self, f, fn):
        k = _read_array(f, "inputs/k", fn)
        v = _read_array(f, "inputs/v", fn)
        q = _read_array(f, "inputs/q", fn)
        if k is None:
            raise InputError("%s: missing dataset /inputs/k" % fn)
        if v is None:
            raise InputError("%s: missing dataset /inputs/v" % fn)
        if k.ndim != 4:
            raise InputError("%s: dataset /inputs/k: expected [B,H,T,dk], got %s" % (fn, _shape_str(k.shape)))
        B, H, T, dk = k.shape
        if v.ndim != 4 or v.shape[:3] != (B, H, T):
            raise InputError("%s: dataset /inputs/v: expected [%d,%d,%d,dv], got %s"
                             % (fn, B, H, T, _shape_str(v.shape)))
        dv = v.shape[3]
        if min(B, H, T, dk, dv) < 1:
            raise InputError("%s: dataset /inputs/k or /inputs/v has an empty dimension: k %s, v %s"
                             % (fn, _shape_str(k.shape), _shape_str(v.shape)))
        if q is not None and q.shape != k.shape:
            raise InputError("%s: dataset /inputs/q: expected %s like /inputs/k, got %s"
                             % (fn, _shape_str(k.shape), _shape_str(q.shape)))
        if self.rule["residual"] and dk != dv:
            raise InputError("%s: /rule attribute residual: needs dk = dv, got dk=%d dv=%d"
                             % (fn, dk, dv))
        self.k, self.v = k, v
        self.q = q if q is not None else k
        self.has_q = q is not None
        self.B, self.H, self.T, self.dk, self.dv = B, H, T, dk, dv
        c = self.rule["step"]
        self.S = (T + c - 1) // c

    def param_names(self):
        names = []
        for i in range(1, self.rule["layers"] + 1):
            names.append("W%d" % i)
            if self.rule["bias"]:
                names.append("b%d" % i)
        return names

    def param_shape(self, name):
        """Per-memory shape of a parameter (SPEC.md section 1)."""
        L, dh, dk, dv = self.rule["layers"], self.dh, self.dk, self.dv
        i = int(name[1:])
        out_dim = dv if i == L else dh
        in_dim = dk if i == 1 else dh
        return (out_dim, in_dim) if name[0] == "W" else (out_dim,)

    def _read_init(self, f, fn):
        L = self.rule["layers"]
        g = f.get("init")
        if not isinstance(g, h5py.Group):
            raise InputError("%s: missing group /init" % fn)
        # hidden width: the attribute, or W1's first per-memory dimension.
        if L >= 2:
            if self.rule["hidden"] is None:
                w1 = g.get("W1")
                if not isinstance(w1, h5py.Dataset) or len(w1.shape) < 2:
                    raise InputError("%s: /rule attribute hidden is missing and dataset /init/W1 "
                                     "does not give it" % fn)
                self.rule["hidden"] = int(w1.shape[-2])
            if self.rule["hidden"] < 1:
                raise InputError("%s: /rule attribute hidden: must be >= 1, got %d"
                                 % (fn, self.rule["hidden"]))
            self.dh = self.rule["hidden"]
        else:
            self.dh = None
        names = self.param_names()
        allowed = set(names) | {"S_" + n for n in names}
        for key in g:
            if key not in allowed:
                raise InputError("%s: unexpected dataset /init/%s (expected %s)"
                                 % (fn, key, ", ".join(sorted(allowed))))
        self.params, self.momenta, self.given = {}, {}, set()
        for n in names:
            for key, store in ((n, self.params), ("S_" + n, self.momenta)):
                arr = _read_array(f, "init/" + key, fn)
                shape = self.param_shape(n)
                if arr is None:
                    if key[0] == "W":
                        raise InputError("%s: missing dataset /init/%s" % (fn, key))
                    arr = np.zeros(shape)  # missing bias or momentum: zeros
                else:
                    self.given.add(key)
                store[n] = self._broadcast_param(fn, "/init/" + key, arr, shape)

    def _broadcast_param(self, fn, path, arr, shape):
        nd = len(shape)
        want = "%s, [H,...] or [B,H,...] with ... = %s" % (_shape_str(shape), _shape_str(shape))
        if arr.ndim < nd or arr.ndim > nd + 2 or tuple(arr.shape[arr.ndim - nd:]) != shape:
            raise InputError("%s: dataset %s: shape %s, expected %s"
                             % (fn, path, _shape_str(arr.shape), want))
        try:
            return np.array(np.broadcast_to(arr, (self.B, self.H) + shape))  # a writable copy
        except ValueError:
            raise InputError("%s: dataset %s: shape %s does not broadcast to [B,H,...] = %s"
                             % (fn, path, _shape_str(arr.shape),
                                _shape_str((self.B, self.H) + shape)))

    def _read_gates(self, f, fn):
        B, H, T, S = self.B, self.H, self.T, self.S
        self.gate_shapes = {}
        for name, last, required in (("theta", T, True), ("eta", S, False), ("alpha", S, False)):
            arr = _read_array(f, "gates/" + name, fn)
            full = (B, H, last)
            if arr is None:
                if required:
                    raise InputError("%s: missing dataset /gates/%s" % (fn, name))
                arr = np.zeros(())
            self.gate_shapes[name] = arr.shape
            # numpy broadcasting, right-aligned against [B,H,T] or [B,H,S].
            if arr.ndim > 3:
                ok = False
            else:
                try:
                    out = np.array(np.broadcast_to(arr, full))  # a writable copy
                    ok = True
                except ValueError:
                    ok = False
            if not ok:
                raise InputError("%s: dataset /gates/%s: shape %s does not broadcast to %s = %s"
                                 % (fn, name, _shape_str(arr.shape),
                                    "[B,H,T]" if name == "theta" else "[B,H,S]", _shape_str(full)))
            setattr(self, name, out)

    def final_names(self):
        """Final tensors of a run: W1, b1, ..., then S_W1, S_b1, ..."""
        names = self.param_names()
        return names + ["S_" + n for n in names]

    def _read_upstream(self, f, fn):
        """/upstream (SPEC.md sections 5 and 7): dy, dloss and d<final tensor>,
        any subset, each at its output's full shape. None when absent."""
        self.upstream = None
        g = f.get("upstream")
        if g is None:
            return
        if not isinstance(g, h5py.Group):
            raise InputError("%s: /upstream is not a group" % fn)
        B, H, T = self.B, self.H, self.T
        shapes = {"dy": (B, H, T, self.dv), "dloss": (B, H, T)}
        for n in self.final_names():
            shapes["d" + n] = (B, H) + self.param_shape(n[2:] if n.startswith("S_") else n)
        up = {}
        for key in g:
            if key not in shapes:
                raise InputError("%s: unexpected dataset /upstream/%s (expected %s)"
                                 % (fn, key, ", ".join(shapes)))
            arr = _read_array(f, "upstream/" + key, fn)
            if arr is None:
                raise InputError("%s: /upstream/%s is not a dataset" % (fn, key))
            if arr.shape != shapes[key]:
                raise InputError("%s: dataset /upstream/%s: shape %s, expected %s"
                                 % (fn, key, _shape_str(arr.shape), _shape_str(shapes[key])))
            up[key] = arr
        self.upstream = up

    def _compile_exprs(self, fn):
        rule = self.rule
        self.loss_expr = self.act_expr = self.clip_expr = None
        todo = []
        if rule["loss"] == "custom":
            todo.append(("loss_expr", ("y", "v", "r")))
        if rule["activation"] == "custom" and rule["layers"] >= 2:
            todo.append(("activation_expr", ("z",)))
        if rule["clip"] == "scale":
            todo.append(("clip_expr", ("n",)))
        if rule["clip"] == "elementwise":
            todo.append(("clip_expr", ("g",)))
        for attr, names in todo:
            try:
                e = compile_expr(rule[attr], names, self.constants)
            except ExprError as err:
                raise InputError("%s: /rule attribute %s: %s" % (fn, attr, err))
            setattr(self, {"loss_expr": "loss_expr", "activation_expr": "act_expr",
                           "clip_expr": "clip_expr"}[attr], e)


def load_experiment(path):
    return Experiment(path)


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
        act = exp.rule["activation"]
        self.phi = {
            "silu": F.silu,
            "gelu": gelu,              # exact erf form (see mnemo_expr.gelu)
            "relu": F.relu,
            "tanh": torch.tanh,
            "identity": lambda z: z,
            "custom": (lambda z: exp.act_expr(z=z)) if exp.act_expr is not None else None,
        }[act]

    @staticmethod
    def linear(x, W, b):
        # x [B,H,N,in], W [B,H,out,in], b [B,H,out] -> [B,H,N,out]
        y = torch.matmul(x, W.transpose(-1, -2))
        return y if b is None else y + b.unsqueeze(-2)

    def forward(self, params, x):
        h = x
        for i in range(1, self.L + 1):
            z = self.linear(h, params["W%d" % i], params.get("b%d" % i) if self.bias else None)
            h = self.phi(z) if i < self.L else z
        return h + x if self.residual else h

    __call__ = forward


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
    token_loss = make_token_loss(exp)
    if diff:
        # Tokens with a non-finite key or value (query for retrieval): their
        # loss or output is not finite, and its gradient is left out (SPEC.md
        # section 7: entries at non-finite inputs are unspecified, all others
        # must be finite).
        bad_kv = ~(_finite_rows(k.detach()) & _finite_rows(v.detach()))
        bad_q = ~_finite_rows(q.detach())

    def step_gradient(Wbar, ks, vs, ths, n_tok):
        """G_s at Wbar (SPEC.md section 2) and the step's per-token losses."""
        y = model(Wbar, ks)
        l_t = token_loss(y, vs)                                # [B,H,n], before theta
        objective = (ths * l_t).sum()
        if rule["token_reduce"] == "mean":
            objective = objective / n_tok
        params = [Wbar[n] for n in names]
        if objective.requires_grad:
            g = torch.autograd.grad(objective, params, allow_unused=True, create_graph=diff)
        else:  # a custom loss that does not depend on y at all
            g = [None] * len(params)
        G = {n: (gi if gi is not None else torch.zeros_like(p)) for n, gi, p in zip(names, g, params)}
        if not diff:
            G = {n: G[n].detach() for n in names}
        return G, l_t

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
        G, l_t = step_gradient(Wbar, ks, vs, ths, hi - lo)

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
            G, _ = step_gradient(Wh, _hold(ks, skip[:, :, None, None]), _hold(vs, skip[:, :, None, None]),
                                 _hold(ths, skip[:, :, None]), hi - lo)
        if diff:
            bad = bad_kv[:, :, lo:hi]
            if bool(bad.any()):
                # the loss keeps its value; its gradient comes from zeroed
                # inputs at the bad tokens, where where() then blocks it
                clean = token_loss(model(Wbar, _zero_rows(ks, bad)), _zero_rows(vs, bad))
                l_t = torch.where(bad, l_t.detach(), clean)
        Gt, scale = clip_step(exp, names, G)

        eta_s, alpha_s = eta[:, :, s], alpha[:, :, s]
        W_prev, S_prev = W_hist[-1], S_hist[-1]
        W_new, S_new = {}, {}
        for n in names:
            S_upd = _per_memory(eta_s, S_prev[n]) * S_prev[n] - Gt[n]
            W_upd = _per_memory(1 - alpha_s, W_prev[n]) * W_prev[n] + S_upd
            keep = _per_memory(finite, S_prev[n])
            # skipped step: momentum and weights keep their values
            S_new[n] = torch.where(keep, S_upd, S_prev[n])
            W_new[n] = torch.where(keep, W_upd, W_prev[n])
        W_hist.append(W_new)
        S_hist.append(S_new)

        loss_parts.append(l_t if diff else l_t.detach())
        grad_norm[:, :, s] = torch.sqrt(sq)
        clip_scale[:, :, s] = torch.where(finite, scale.detach(), torch.zeros_like(scale.detach()))
        skipped[:, :, s] = (~finite).to(dtype)

    # Retrieval: y_out_t = M(q_t; W^(a(t))), grouped by the weights used.
    a_of_t = retrieval_index(exp)
    y_out = torch.zeros(B, H, T, exp.dv, dtype=dtype)
    for a in sorted(set(a_of_t)):
        idx = torch.tensor([tt for tt in range(T) if a_of_t[tt] == a])
        ya = model(W_hist[a], q[:, :, idx])
        if diff and bool(bad_q[:, :, idx].any()):
            bad = bad_q[:, :, idx]
            ya = torch.where(bad[..., None], ya.detach(), model(W_hist[a], _zero_rows(q[:, :, idx], bad)))
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
            + exp.final_names())


def grad_compare_mask(exp, name):
    """Which entries of gradient `name` an engine's /grads is held to: all but
    those at non-finite inputs (SPEC.md section 7 leaves them unspecified)
    and, for k, v and q, all features of a token whose key, value or query
    has a non-finite entry (its loss or output is not finite; this reference
    cuts that token's loss and output from the gradient, and an engine may
    treat its other features differently)."""
    if name in ("k", "v", "q"):
        rows = np.isfinite(exp.k).all(-1) & np.isfinite(exp.v).all(-1) & np.isfinite(exp.q).all(-1)
        return np.broadcast_to(rows[..., None], getattr(exp, name).shape)
    if name in ("theta", "eta", "alpha"):
        return np.isfinite(getattr(exp, name))
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
