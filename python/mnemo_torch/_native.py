"""_native: the ctypes face of libmnemo_torch.so (python/native/mnemo_torch.c).

The library is the engine archive plus a small C shim; it is found, in order,
at $MNEMO_TORCH_LIB, next to this file, in the repository's build/ (what
`make python` writes) and in .carry/bin/ (what tests/gpu/pack.sh carries to a
GPU machine). Tensors cross as descriptors of their own memory (MntArg): no
copy, no Python.h, no torch C++ headers."""

import ctypes
import os

import torch

MAX_DIMS = 8
F32, F64, I64 = 0, 1, 2
CPU, CUDA = 0, 1


class MnemoError(RuntimeError):
    """An error from the engine; the message names the field, tensor or
    expression at fault."""


class MntArg(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("ndim", ctypes.c_int64),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("stride", ctypes.c_int64 * MAX_DIMS),
                ("dtype", ctypes.c_int64), ("device", ctypes.c_int64)]


def _candidates():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    env = os.environ.get("MNEMO_TORCH_LIB")
    if env:
        yield env
    yield os.path.join(here, "libmnemo_torch.so")
    yield os.path.join(repo, os.environ.get("BUILD", "build"), "libmnemo_torch.so")
    yield os.path.join(repo, "build", "libmnemo_torch.so")
    yield os.path.join(repo, ".carry", "bin", "libmnemo_torch.so")


def _load():
    tried = []
    for path in _candidates():
        if os.path.exists(path):
            return ctypes.CDLL(path), path
        tried.append(path)
    raise ImportError("mnemo_torch: libmnemo_torch.so not found (run `make python` in the repository, "
                      "or set MNEMO_TORCH_LIB); looked in " + ", ".join(tried))


lib, lib_path = _load()

_P = ctypes.c_void_p
_I64P = ctypes.POINTER(ctypes.c_int64)
_ARGP = ctypes.POINTER(MntArg)
for name, res, args in [
    ("mnt_last_error", ctypes.c_char_p, []),
    ("mnt_version", ctypes.c_char_p, []),
    ("mnt_cuda_available", ctypes.c_int, []),
    ("mnt_group_new", _P, [ctypes.c_char_p]),
    ("mnt_group_add_group", _P, [_P, ctypes.c_char_p]),
    ("mnt_group_add_integer", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_int64]),
    ("mnt_group_add_number", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_double]),
    ("mnt_group_add_string", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p]),
    ("mnt_node_free", None, [_P]),
    ("mnt_rule_from_group", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.POINTER(_P)]),
    ("mnt_rule_load", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    ("mnt_rule_free", None, [_P]),
    ("mnt_rule_info", None, [_P, _I64P, _I64P, _I64P, _I64P]),
    ("mnt_rule_attrs", ctypes.c_int, [_P, ctypes.POINTER(_P)]),
    ("mnt_node_count", ctypes.c_int, [_P]),
    ("mnt_node_child", ctypes.c_char_p, [_P, ctypes.c_int, ctypes.POINTER(ctypes.c_int), _I64P,
                                         ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_char_p),
                                         ctypes.POINTER(_P)]),
    ("mnt_param_info", ctypes.c_int, [_P, _I64P, ctypes.c_int, ctypes.c_char_p, _I64P]),
    ("mnt_forward", ctypes.c_int, [_P, _I64P, ctypes.c_int, _P, _ARGP, _ARGP, _ARGP, _ARGP, _ARGP, _ARGP, _ARGP]),
    ("mnt_backward", ctypes.c_int, [_P, _I64P, ctypes.c_int, _P, _ARGP, _ARGP, _ARGP, _ARGP, _ARGP, _ARGP]),
]:
    fn = getattr(lib, name)
    fn.restype = res
    fn.argtypes = args


def check(status):
    if status != 0:
        raise MnemoError(lib.mnt_last_error().decode("utf-8", "replace"))


def int64s(values):
    return (ctypes.c_int64 * len(values))(*values)


def describe(t):
    """An MntArg over t's memory (None: not given). t must already be a
    float32 tensor (or int64: lengths); strides are passed as they are."""
    a = MntArg()
    if t is None:
        return a
    if t.dtype not in (torch.float32, torch.int64):
        raise TypeError("mnemo_torch: internal: %s tensor reached the engine" % t.dtype)
    if t.dim() > MAX_DIMS:
        raise ValueError("mnemo_torch: %d dims (at most %d)" % (t.dim(), MAX_DIMS))
    a.data = t.data_ptr() if t.numel() > 0 else 1  # empty tensors still count as given
    a.ndim = t.dim()
    for d in range(t.dim()):
        a.shape[d] = t.shape[d]
        a.stride[d] = t.stride(d)
    a.dtype = I64 if t.dtype == torch.int64 else F32
    a.device = CUDA if t.is_cuda else CPU
    return a


def arg_array(tensors):
    arr = (MntArg * max(1, len(tensors)))()
    for i, t in enumerate(tensors):
        arr[i] = describe(t)
    return arr
