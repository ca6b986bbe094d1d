"""rule: a mnemo rule on the Python side, exactly as the engine reads it.

Rule("rule.h5") reads the /rule group of a file written at the prompt
(rule:save("rule.h5"), or an experiment file: mnemo.save("exp.h5",
rule:experiment{...})); Rule({...}) takes a dict in the same vocabulary (the
/rule attributes of the file schema: layers, hidden, loss, loss_expr, ...,
with a nested dict for constants). Both go through the engine's own reader
(mn_rule_from_tree), so an unknown key or a bad expression is the engine's
one-line message, raised as MnemoError."""

import ctypes
import os

from . import _native as nat
from ._native import MnemoError

_KIND_GROUP, _KIND_TENSOR, _KIND_NUMBER, _KIND_INTEGER, _KIND_STRING = range(5)


def _fill_group(group, mapping, where):
    for key, val in mapping.items():
        if not isinstance(key, str):
            raise TypeError("%s: keys must be strings, got %r" % (where, key))
        name = key.encode()
        if isinstance(val, bool):
            st = nat.lib.mnt_group_add_integer(group, name, int(val))
        elif isinstance(val, int):
            st = nat.lib.mnt_group_add_integer(group, name, val)
        elif isinstance(val, float):
            st = nat.lib.mnt_group_add_number(group, name, val)
        elif isinstance(val, str):
            st = nat.lib.mnt_group_add_string(group, name, val.encode())
        elif isinstance(val, dict):
            sub = nat.lib.mnt_group_add_group(group, name)
            if not sub:
                raise MemoryError("%s: out of memory" % where)
            _fill_group(sub, val, "%s.%s" % (where, key))
            st = 0
        else:
            raise TypeError("%s: %s must be a bool, int, float, str or dict (constants), got %s"
                            % (where, key, type(val).__name__))
        nat.check(st)


def _read_group(node):
    out = {}
    for i in range(nat.lib.mnt_node_count(node)):
        kind, integer, number = ctypes.c_int(), ctypes.c_int64(), ctypes.c_double()
        string, child = ctypes.c_char_p(), ctypes.c_void_p()
        name = nat.lib.mnt_node_child(node, i, ctypes.byref(kind), ctypes.byref(integer), ctypes.byref(number),
                                      ctypes.byref(string), ctypes.byref(child)).decode()
        if kind.value == _KIND_GROUP:
            out[name] = _read_group(child)
        elif kind.value == _KIND_INTEGER:
            out[name] = integer.value
        elif kind.value == _KIND_NUMBER:
            out[name] = number.value
        elif kind.value == _KIND_STRING:
            out[name] = string.value.decode()
    return out


_registry = {}  # op id -> Rule: the custom op's schema carries an int


def _register(rule):
    key = len(_registry) + 1
    _registry[key] = rule
    return key


def by_op_id(key):
    return _registry[key]


class Rule:
    """A rule, from a file saved at the prompt or from a dict of /rule keys."""

    def __init__(self, source):
        handle = ctypes.c_void_p()
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if not os.path.exists(path):
                raise FileNotFoundError("mnemo_torch.Rule: %s: no such file" % path)
            nat.check(nat.lib.mnt_rule_load(path.encode(), ctypes.byref(handle)))
            self.source = path
        elif isinstance(source, dict):
            group = nat.lib.mnt_group_new(b"rule")
            if not group:
                raise MemoryError("mnemo_torch.Rule: out of memory")
            try:
                _fill_group(group, source, "rule dict")
                nat.check(nat.lib.mnt_rule_from_group(group, b"rule dict", ctypes.byref(handle)))
            finally:
                nat.lib.mnt_node_free(group)
            self.source = "dict"
        else:
            raise TypeError("mnemo_torch.Rule: give a file path or a dict of /rule keys, got %s"
                            % type(source).__name__)
        self._handle = handle
        vals = [ctypes.c_int64() for _ in range(4)]
        nat.lib.mnt_rule_info(handle, *[ctypes.byref(v) for v in vals])
        self.layers, self.hidden, self.step, self.nparams = (v.value for v in vals)
        self.bias = bool(self.attrs().get("bias", 0))
        self.glu = bool(self.attrs().get("glu", 0))
        self.out_norm = self.attrs().get("out_norm", "none")  # ln_g, ln_b are run()'s only with one
        # params() is plain Python, so that torch.compile traces run() without
        # a call into the library; it must agree with the engine's layout
        for dims in ((3, 5, 7), (2, 2, 4)):
            if self.params(*dims) != self._params_native(*dims):
                raise MnemoError("mnemo_torch: parameter layout %r differs from the engine's %r"
                                 % (self.params(*dims), self._params_native(*dims)))
        self._op_id = _register(self)
    def __del__(self):
        h = getattr(self, "_handle", None)
        if h and nat is not None and nat.lib is not None:
            nat.lib.mnt_rule_free(h)
            self._handle = None

    @property
    def handle(self):
        return self._handle

    def attrs(self):
        """Every /rule attribute (defaults included), as the engine writes them."""
        node = ctypes.c_void_p()
        nat.check(nat.lib.mnt_rule_attrs(self._handle, ctypes.byref(node)))
        try:
            return _read_group(node)
        finally:
            nat.lib.mnt_node_free(node)

    def params(self, dk, dv, dh=0):
        """[(name, shape of one memory)] in the engine's order (W1, b1, ...,
        then glu's gates U1, c1, ... of the hidden layers)."""
        dh = dh or self.hidden
        out = []
        for i in range(1, self.layers + 1):
            rows = dv if i == self.layers else dh
            cols = dk if i == 1 else dh
            out.append(("W%d" % i, (rows, cols)))
            if self.bias:
                out.append(("b%d" % i, (rows,)))
        for i in range(1, self.layers if self.glu else 1):
            out.append(("U%d" % i, (dh, dk if i == 1 else dh)))
            if self.bias:
                out.append(("c%d" % i, (dh,)))
        return out

    def _params_native(self, dk, dv, dh=0):
        dims = nat.int64s([1, 1, 1, dk, dv, dh or self.hidden])
        out = []
        for i in range(self.nparams):
            name = ctypes.create_string_buffer(16)
            shape = (ctypes.c_int64 * nat.MAX_DIMS)()
            nd = nat.lib.mnt_param_info(self._handle, dims, i, name, shape)
            out.append((name.value.decode(), tuple(shape[d] for d in range(nd))))
        return out

    def __repr__(self):
        return "mnemo_torch.Rule(%s: layers=%d, step=%d)" % (self.source, self.layers, self.step)
