"""mnemo_exp: reading and validating an experiment file (SPEC.md section 5)
for the Python reference (mnemo_ref.py): every attribute, dataset and shape
checked, defaults resolved, gates and initial tensors broadcast to their full
shapes. Bad input raises InputError with one line naming the file and the
dataset or attribute at fault.

    exp = load_experiment("exp.h5")      # validated, broadcast numpy arrays
"""

import numpy as np
import h5py

from mnemo_expr import ExprError, compile_expr

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
    "glu": ("bool", 0),               # v2: gated hidden layers (U_i, c_i)
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
    "out_norm": ("str", "none"),      # v2: the last layer's output normalised
    "qk_norm": ("str", "none"),       # v2: keys and queries normalised
    "loss_expr": ("str", None),
    "activation_expr": ("str", None),
    "clip_expr": ("str", None),
    "precondition": ("str", "none"),  # SPEC v2
    "ns_steps": ("int", 5),
}

CHOICES = {
    "activation": ("silu", "gelu", "relu", "tanh", "identity", "custom"),
    "loss": ("mse", "l1", "huber", "lp", "dot", "logcosh", "custom"),
    "feature_reduce": ("mean", "sum"),
    "token_reduce": ("sum", "mean"),
    "retrieve": ("after", "before"),
    "clip": ("none", "norm", "softnorm", "value", "softvalue", "scale", "elementwise"),
    "clip_scope": ("global", "tensor"),
    "out_norm": ("none", "layernorm", "rmsnorm"),
    "qk_norm": ("none", "l2", "rms"),
    "precondition": ("none", "newton_schulz"),
}

# out_norm's outer parameters (SPEC.md section 1): name -> default; [dv] per
# memory, never updated by the rule.
OUTER = {"ln_g": 1.0, "ln_b": 0.0}


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
        if rule["glu"] and rule["layers"] < 2:
            raise InputError("%s attribute glu: gates the hidden layers and needs layers >= 2, got %d"
                             % (where, rule["layers"]))
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
        if rule["clip"] in ("norm", "softnorm", "value", "softvalue") and not rule["clip_max"] > 0:
            raise InputError("%s attribute clip_max: must be > 0, got %r" % (where, rule["clip_max"]))
        for part, attr in (("loss", "loss_expr"), ("activation", "activation_expr")):
            if rule[part] == "custom" and rule[attr] is None:
                raise InputError("%s attribute %s: missing (%s = custom)" % (where, attr, part))
        if not 1 <= rule["ns_steps"] <= 100:
            raise InputError("%s attribute ns_steps: must be from 1 to 100, got %d" % (where, rule["ns_steps"]))
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
        # /inputs/lengths (SPEC v2, ragged batches): [B] integers 0..T
        lengths = _read_array(f, "inputs/lengths", fn)
        if lengths is not None:
            if lengths.shape != (B,):
                raise InputError("%s: dataset /inputs/lengths: expected [B] = [%d], got %s"
                                 % (fn, B, _shape_str(lengths.shape)))
            if not (np.all(lengths == np.floor(lengths)) and np.all(lengths >= 0) and np.all(lengths <= T)):
                raise InputError("%s: dataset /inputs/lengths: each length must be an integer from 0 to T = %d"
                                 % (fn, T))
            lengths = lengths.astype(np.int64)
        self.lengths = lengths

    def param_names(self):
        names = []
        for i in range(1, self.rule["layers"] + 1):
            names.append("W%d" % i)
            if self.rule["bias"]:
                names.append("b%d" % i)
        if self.rule["glu"]:  # the gates U_i, c_i of the hidden layers, after all W, b
            for i in range(1, self.rule["layers"]):
                names.append("U%d" % i)
                if self.rule["bias"]:
                    names.append("c%d" % i)
        return names

    def param_shape(self, name):
        """Per-memory shape of a parameter (SPEC.md section 1)."""
        L, dh, dk, dv = self.rule["layers"], self.dh, self.dk, self.dv
        i = int(name[1:])
        out_dim = dv if i == L else dh
        in_dim = dk if i == 1 else dh
        return (out_dim, in_dim) if name[0] in "WU" else (out_dim,)

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
        allowed = set(names) | {"S_" + n for n in names} | set(self.outer_names())
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
                    if key[0] in "WU":
                        raise InputError("%s: missing dataset /init/%s" % (fn, key))
                    arr = np.zeros(shape)  # missing bias or momentum: zeros
                else:
                    self.given.add(key)
                store[n] = self._broadcast_param(fn, "/init/" + key, arr, shape)
        self.outer = {}
        for n in self.outer_names():
            arr = _read_array(f, "init/" + n, fn)
            if arr is None:
                arr = np.full((self.dv,), OUTER[n])
            else:
                self.given.add(n)
            self.outer[n] = self._broadcast_param(fn, "/init/" + n, arr, (self.dv,))

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

    def outer_names(self):
        """out_norm's ln_g, ln_b, or nothing."""
        return list(OUTER) if self.rule["out_norm"] != "none" else []

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
