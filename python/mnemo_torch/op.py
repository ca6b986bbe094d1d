"""op: one run of a rule as a differentiable PyTorch op.

run(rule, k, v, theta, ...) calls the engine's forward on the tensors' own
memory (CPU, or CUDA in the caller's stream order) and, through a
torch.autograd.Function, the engine's backward of SPEC.md section 7 for k, v,
q, the gates, the initial parameters and momenta, and out_norm's ln_g, ln_b.
lengths (ragged batches) is an int64 CPU tensor beside them, not
differentiable; with CUDA tensors the engine copies it to the GPU for each
call (so a ragged call is not one a CUDA graph can capture). With torch >= 2.4 the
same forward and backward are also registered as custom ops (mnemo::run,
mnemo::run_backward) with fake implementations, so torch.compile(fullgraph=
True) traces a model that calls run()."""

import collections
import ctypes
import numbers
import warnings

import torch

from . import _native as nat
from .rule import Rule, by_op_id

OUTPUTS = ("y", "loss", "grad_norm", "clip_scale", "skipped")
INPUTS = ("k", "v", "q", "theta", "eta", "alpha")
OUTER = ("ln_g", "ln_b")  # out_norm's outer parameters: given to the run, never updated

_warned = set()


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


def _prep(t, name, like):
    """t as the engine takes it: a float32 contiguous tensor on like's
    device. Others are converted (differentiably) with a warning."""
    if t is None:
        return None
    if not torch.is_tensor(t):
        return torch.tensor(float(t), dtype=torch.float32, device=like.device)
    if t.device != like.device:
        raise ValueError("mnemo_torch.run: %s is on %s, k on %s" % (name, t.device, like.device))
    if t.dtype != torch.float32:
        _warn_once(("dtype", name, t.dtype),
                   "mnemo_torch.run: %s is %s; converted to float32 (a copy)" % (name, t.dtype))
        t = t.float()
    if not t.is_contiguous():
        _warn_once(("contig", name), "mnemo_torch.run: %s is not contiguous; copied" % name)
        t = t.contiguous()
    return t


# y, loss, grad_norm, clip_scale, skipped, and params / momenta (dicts of
# the final W^(S), S^(S), [B,H,...]). A namedtuple: torch.compile traces it.
Result = collections.namedtuple("Result", OUTPUTS + ("params", "momenta"))


# ---- the two engine calls on plain tensors ----

def _dims(rule, k, v, params):
    B, H, T, dk = k.shape
    dv = v.shape[3]
    dh = rule.hidden
    if rule.layers >= 2 and dh == 0:
        w1 = params[0]
        if w1 is None or w1.dim() < 2:
            raise ValueError("mnemo_torch.run: the rule's hidden is 0 and W1 does not give it")
        dh = w1.shape[-2]
    return [B, H, T, dk, dv, dh]


def _shapes(rule, dims):
    B, H, T, dk, dv, dh = dims
    S = (T + rule.step - 1) // rule.step if T else 0
    outs = [(B, H, T, dv), (B, H, T), (B, H, S), (B, H, S), (B, H, S)]
    finals = [(B, H) + shape for _, shape in rule.params(dk, dv, dh)]
    return outs, finals


def _stream_of(t):
    if not t.is_cuda:
        return None
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)


def forward_tensors(rule, inputs, params, momenta, outer=(None, None), lengths=None):
    """inputs: k, v, q, theta, eta, alpha (prepared; q, eta, alpha may be
    None); params, momenta: lists in the rule's order (None: zeros); outer:
    ln_g, ln_b (None: 1 and 0 with out_norm); lengths: an int64 CPU tensor
    [B] or None. Returns the five outputs, then the final parameters, then
    the final momenta."""
    k = inputs[0]
    dims = _dims(rule, k, inputs[1], params)
    outs, finals = _shapes(rule, dims)
    dev = k.device
    y = [torch.empty(s, dtype=torch.float32, device=dev) for s in outs]
    fp = [torch.empty(s, dtype=torch.float32, device=dev) for s in finals]
    fm = [torch.empty(s, dtype=torch.float32, device=dev) for s in finals]
    if k.is_cuda and not nat.lib.mnt_cuda_available():
        raise nat.MnemoError("mnemo_torch.run: CUDA tensors, but the engine has no usable CUDA device "
                             "(a CPU-only build, or no driver)")
    nat.check(nat.lib.mnt_forward(rule.handle, nat.int64s(dims), nat.CUDA if k.is_cuda else nat.CPU,
                                  _stream_of(k), nat.arg_array(list(inputs) + [lengths]), nat.arg_array(params),
                                  nat.arg_array(momenta), nat.arg_array(outer), nat.arg_array(y), nat.arg_array(fp),
                                  nat.arg_array(fm)))
    return y + fp + fm


def backward_tensors(rule, inputs, params, momenta, upstream, wanted, outer=(None, None), lengths=None):
    """The gradients of <dy, y> + <dloss, loss> + sum <dP, P^(S)> for every
    input, parameter, momentum and ln_g, ln_b; upstream: dy, dloss,
    dparams..., dmomenta... (None: zero). wanted: booleans in the order
    inputs, params, momenta, outer. With CUDA tensors the engine's backward
    runs on the GPU (on torch's current stream; every option of the rule:
    rule:plan's backward line says which kernel; MNEMO_CUDA_BACKWARD=cpu
    sends it to the CPU from copies); the gradients come back on the
    inputs' device."""
    like = inputs[0]
    dev = like.device
    prep = lambda t: None if t is None else t.detach().to(dev, torch.float32).contiguous()  # noqa: E731
    inputs_c = [prep(t) for t in inputs]
    params_c = [prep(t) for t in params]
    momenta_c = [prep(t) for t in momenta]
    upstream_c = [prep(t) for t in upstream]
    outer_c = [prep(t) for t in outer]
    dims = _dims(rule, inputs_c[0], inputs_c[1], params_c)
    given = inputs_c + params_c + momenta_c + outer_c
    if len(inputs_c) != 6 or len(outer_c) != 2 or len(wanted) != len(given):
        # the shim reads 6 inputs, 2 outer and 6 + 2 np + 2 gradient slots
        raise ValueError("mnemo_torch: internal: %d inputs, %d outer, %d wanted for %d tensors"
                         % (len(inputs_c), len(outer_c), len(wanted), len(given)))
    # on the inputs' device: the engine's gradients of a CUDA run stay on the GPU (model/grad.h)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=like.device) if (t is not None and w) else None
             for t, w in zip(given, wanted)]
    if like.is_cuda and not nat.lib.mnt_cuda_available():
        raise nat.MnemoError("mnemo_torch: CUDA tensors, but the engine has no usable CUDA device")
    # the gradients, summed to these tensors' shapes, are copied into them
    nat.check(nat.lib.mnt_backward(rule.handle, nat.int64s(dims), nat.CUDA if like.is_cuda else nat.CPU,
                                   _stream_of(like), nat.arg_array(inputs_c + [lengths]),
                                   nat.arg_array(params_c), nat.arg_array(momenta_c), nat.arg_array(outer_c),
                                   nat.arg_array(upstream_c), nat.arg_array(grads)))
    return grads


# ---- autograd ----

class RunFunction(torch.autograd.Function):
    """apply(rule, n_params, lengths, k, v, q, theta, eta, alpha, *params,
    *momenta, ln_g, ln_b); lengths (int64, or None) is not differentiable."""

    @staticmethod
    def forward(ctx, rule, nparams, lengths, *tensors):
        inputs = list(tensors[:6])
        params = list(tensors[6:6 + nparams])
        momenta = list(tensors[6 + nparams:6 + 2 * nparams])
        outer = list(tensors[6 + 2 * nparams:])
        outs = forward_tensors(rule, inputs, params, momenta, outer, lengths)
        ctx.rule, ctx.nparams, ctx.lengths = rule, nparams, lengths
        ctx.save_for_backward(*[t if t is not None else torch.empty(0) for t in tensors])
        ctx.given = [t is not None for t in tensors]
        ctx.mark_non_differentiable(outs[2], outs[3], outs[4])
        ctx.set_materialize_grads(False)  # an unused output's upstream is None: zero to the engine
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        saved = [t if g else None for t, g in zip(ctx.saved_tensors, ctx.given)]
        n = ctx.nparams
        inputs, params, momenta, outer = saved[:6], saved[6:6 + n], saved[6 + n:6 + 2 * n], saved[6 + 2 * n:]
        upstream = [douts[0], douts[1]] + list(douts[5:5 + n]) + list(douts[5 + n:5 + 2 * n])
        wanted = list(ctx.needs_input_grad[3:])
        if not any(wanted):
            return (None, None, None) + (None,) * len(saved)
        grads = backward_tensors(ctx.rule, inputs, params, momenta, upstream, wanted, outer, ctx.lengths)
        return (None, None, None) + tuple(grads)


def _param_lists(rule, k, v, params, momenta):
    if not isinstance(params, dict):
        raise TypeError("mnemo_torch.run: params must be a dict {'W1': tensor, ...}")
    dims = _dims(rule, k, v, [params.get("W1")])
    names = [n for n, _ in rule.params(dims[3], dims[4], dims[5])]
    for key in list(params) + list(momenta or {}):
        if key in OUTER:
            raise KeyError("mnemo_torch.run: %s is not a parameter the rule updates: pass it as run(..., %s=tensor)"
                           % (key, key))
        if key not in names:
            raise KeyError("mnemo_torch.run: no parameter %r in this rule (it has %s)" % (key, ", ".join(names)))
    p = [_prep(params.get(nm), nm, k) for nm in names]
    m = [_prep((momenta or {}).get(nm), "momenta " + nm, k) for nm in names]
    return names, p, m


def _outer_list(rule, k, v, ln_g, ln_b):
    """ln_g, ln_b prepared, after the checks that name them: only with
    out_norm, shape [dv], [H,dv] or [B,H,dv]."""
    B, H, _, _ = k.shape
    dv = v.shape[3]
    out = []
    for name, t in zip(OUTER, (ln_g, ln_b)):
        if t is None:
            out.append(None)
            continue
        if rule.out_norm == "none":
            raise ValueError("mnemo_torch.run: %s is given but the rule has out_norm none "
                             "(ln_g, ln_b are out_norm's scale and shift)" % name)
        if not torch.is_tensor(t):
            raise TypeError("mnemo_torch.run: %s must be a tensor [dv], [H,dv] or [B,H,dv], got %s"
                            % (name, type(t).__name__))
        full = (B, H, dv)
        if not (1 <= t.dim() <= 3 and tuple(t.shape) == full[3 - t.dim():]):
            raise ValueError("mnemo_torch.run: %s has shape %s; expected [dv], [H,dv] or [B,H,dv] "
                             "(B=%d, H=%d, dv=%d)" % (name, list(t.shape), B, H, dv))
        out.append(_prep(t, name, k))
    return out


def _lengths(lengths, k):
    """lengths as the engine takes it: an int64 CPU tensor [B]. Its values
    (integers from 0 to T) are the engine's check: a tensor's values are not
    looked at here, so that torch.compile traces the call."""
    if lengths is None:
        return None
    B = k.shape[0]
    if isinstance(lengths, (list, tuple)):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in lengths):
            raise TypeError("mnemo_torch.run: lengths must be a list of integers, got %r" % (list(lengths),))
        lengths = torch.tensor([int(x) for x in lengths], dtype=torch.int64)
    if not torch.is_tensor(lengths):
        raise TypeError("mnemo_torch.run: lengths must be a [B] integer tensor or a list of integers, got %s"
                        % type(lengths).__name__)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError("mnemo_torch.run: lengths must be an integer tensor, got %s" % lengths.dtype)
    if lengths.device.type != "cpu":
        raise ValueError("mnemo_torch.run: lengths must be on the cpu (it is on %s)" % lengths.device)
    if lengths.dim() != 1 or lengths.shape[0] != B:
        raise ValueError("mnemo_torch.run: lengths has shape %s; expected [B] = [%d], one length per sequence"
                         % (list(lengths.shape), B))
    return lengths.detach().to(torch.int64).contiguous()


def run(rule, k, v, theta, q=None, eta=None, alpha=None, params=None, momenta=None, ln_g=None, ln_b=None,
        lengths=None):
    """One run of rule from the initial state params (dict W1, b1, ...:
    [...], [H,...] or [B,H,...]; a missing bias is zero) and momenta (same,
    missing: zero). k [B,H,T,dk], v [B,H,T,dv], q [B,H,T,dk] or None (q = k);
    gates: numbers or tensors that broadcast to [B,H,T] (theta) or [B,H,S]
    (eta, alpha; None: 0). ln_g, ln_b: out_norm's scale and shift, [dv],
    [H,dv] or [B,H,dv] (None: 1 and 0; only for a rule with out_norm).
    lengths: ragged batches, a [B] integer tensor on the CPU or a list, each
    from 0 to T (tokens from lengths[b] on are padding: y 0, loss 0, no
    update, zero gradients); None: every token is real. Differentiable in
    every tensor argument but lengths. Returns a Result: y, loss, grad_norm,
    clip_scale, skipped, params, momenta."""
    if not isinstance(rule, Rule):
        rule = Rule(rule)
    if not torch.is_tensor(k) or k.dim() != 4:
        raise ValueError("mnemo_torch.run: k must be a [B,H,T,dk] tensor")
    if not torch.is_tensor(v) or v.dim() != 4:
        raise ValueError("mnemo_torch.run: v must be a [B,H,T,dv] tensor")
    k0 = k
    inputs = [_prep(t, n, k0) for t, n in zip((k, v, q, theta, eta, alpha), INPUTS)]
    names, p, m = _param_lists(rule, inputs[0], inputs[1], params or {}, momenta)
    outer = _outer_list(rule, inputs[0], inputs[1], ln_g, ln_b)
    lens = _lengths(lengths, inputs[0])
    if _use_custom_op(inputs + p + m):
        outs = _custom_run(rule, inputs, p, m, outer, lens)
    else:
        outs = RunFunction.apply(rule, len(names), lens, *(inputs + p + m + outer))
    n = len(names)
    return Result(*outs[:5], dict(zip(names, outs[5:5 + n])), dict(zip(names, outs[5 + n:5 + 2 * n])))


# ---- torch.library (torch >= 2.4): traceable by torch.compile ----

def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return tuple(int(x) for x in parts[:2])
    except ValueError:
        return (0, 0)


HAVE_CUSTOM_OP = _torch_version() >= (2, 4) and hasattr(torch, "library") and hasattr(torch.library, "custom_op")
def _use_custom_op(tensors):
    return HAVE_CUSTOM_OP


if HAVE_CUSTOM_OP:
    from typing import List, Optional

    # ln_g, ln_b: out_norm's outer parameters (None: defaults); lengths: an
    # int64 CPU tensor [B] or None. Neither changes the outputs' shapes.
    @torch.library.custom_op("mnemo::run", mutates_args=())
    def _op_run(rule_id: int, k: torch.Tensor, v: torch.Tensor, q: Optional[torch.Tensor], theta: torch.Tensor,
                eta: Optional[torch.Tensor], alpha: Optional[torch.Tensor], params: List[torch.Tensor],
                momenta: List[torch.Tensor], ln_g: Optional[torch.Tensor], ln_b: Optional[torch.Tensor],
                lengths: Optional[torch.Tensor]) -> List[torch.Tensor]:
        rule = by_op_id(rule_id)
        m = [t if t.numel() else None for t in momenta] if momenta else [None] * len(params)
        return forward_tensors(rule, [k, v, q, theta, eta, alpha], list(params), m, [ln_g, ln_b], lengths)

    @_op_run.register_fake
    def _op_run_fake(rule_id, k, v, q, theta, eta, alpha, params, momenta, ln_g, ln_b, lengths):
        rule = by_op_id(rule_id)
        B, H, T, dk = k.shape
        dv = v.shape[3]
        S = (T + rule.step - 1) // rule.step
        outs = [k.new_empty((B, H, T, dv)), k.new_empty((B, H, T)), k.new_empty((B, H, S)),
                k.new_empty((B, H, S)), k.new_empty((B, H, S))]
        ndims = [len(s) for _, s in rule.params(2, 2, 2)]
        finals = [k.new_empty((B, H) + tuple(p.shape[p.dim() - nd:])) for p, nd in zip(params, ndims)]
        return outs + finals + [f.new_empty(f.shape) for f in finals]

    # Gradients in the order inputs (6), params, momenta, outer (ln_g, ln_b).
    @torch.library.custom_op("mnemo::run_backward", mutates_args=())
    def _op_run_backward(rule_id: int, inputs: List[Optional[torch.Tensor]], params: List[torch.Tensor],
                         momenta: List[torch.Tensor], outer: List[Optional[torch.Tensor]],
                         lengths: Optional[torch.Tensor], upstream: List[Optional[torch.Tensor]],
                         wanted: List[bool]) -> List[torch.Tensor]:
        rule = by_op_id(rule_id)
        m = [t if t.numel() else None for t in momenta] if momenta else [None] * len(params)
        grads = backward_tensors(rule, list(inputs), list(params), m, list(upstream), list(wanted),
                                 list(outer), lengths)
        given = list(inputs) + list(params) + list(m) + list(outer)
        # the op returns a tensor for every slot: zeros-sized where not wanted
        return [g if g is not None else (t.new_zeros(0) if t is not None else inputs[0].new_zeros(0))
                for g, t in zip(grads, given)]

    @_op_run_backward.register_fake
    def _op_run_backward_fake(rule_id, inputs, params, momenta, outer, lengths, upstream, wanted):
        given = (list(inputs) + list(params) + (list(momenta) if momenta else [None] * len(params))
                 + list(outer))
        return [t.new_empty(t.shape) if (t is not None and w) else inputs[0].new_empty(0)
                for t, w in zip(given, wanted)]

    def _setup_context(ctx, inputs, output):
        rule_id, k, v, q, theta, eta, alpha, params, momenta, ln_g, ln_b, lengths = inputs
        ctx.rule_id = rule_id
        ctx.nparams = len(params)
        ctx.has_momenta = bool(momenta)
        opt = (k, v, q, theta, eta, alpha, ln_g, ln_b, lengths)
        ctx.given = [t is not None for t in opt]
        saved = [t if t is not None else k.new_empty(0) for t in opt]
        ctx.save_for_backward(*(saved + list(params) + list(momenta)))

    def _backward(ctx, douts):
        n = ctx.nparams
        saved = list(ctx.saved_tensors)
        opt = [t if g else None for t, g in zip(saved[:9], ctx.given)]
        inputs, outer, lengths = opt[:6], opt[6:8], opt[8]
        params = saved[9:9 + n]
        momenta = saved[9 + n:] if ctx.has_momenta else []
        upstream = [douts[0], douts[1]] + list(douts[5:5 + 2 * n])
        wanted = ctx.given[:6] + [True] * n + [ctx.has_momenta] * n + ctx.given[6:8]
        grads = _op_run_backward(ctx.rule_id, inputs, params, momenta, outer, lengths, upstream, wanted)
        gi = [g if w and g.numel() else None for g, w in zip(grads[:6], wanted[:6])]
        gp = list(grads[6:6 + n])
        gm = list(grads[6 + n:6 + 2 * n]) if ctx.has_momenta else []
        go = [g if w and g.numel() else None for g, w in zip(grads[6 + 2 * n:], wanted[6 + 2 * n:])]
        return (None, *gi, gp, gm, *go, None)

    _op_run.register_autograd(_backward, setup_context=_setup_context)

    def _custom_run(rule, inputs, params, momenta, outer, lengths):
        # the op's schema takes every parameter: a missing bias is zeros (as
        # the engine makes it), a missing weight the engine's own error
        names = _bias_shapes(rule, inputs, params)
        for (name, _), t in zip(names, params):
            if t is None and name.startswith("W"):
                raise nat.MnemoError("initial weight %s is missing" % name)
        p = [t if t is not None else torch.zeros(s, device=inputs[0].device) for t, (_, s) in zip(params, names)]
        m = [] if all(t is None for t in momenta) else [
            t if t is not None else torch.zeros_like(pp) for t, pp in zip(momenta, p)]
        k, v, q, theta, eta, alpha = inputs
        return _op_run(rule._op_id, k, v, q, theta, eta, alpha, p, m, outer[0], outer[1], lengths)

    def _bias_shapes(rule, inputs, params):
        dims = _dims(rule, inputs[0], inputs[1], params)
        return rule.params(dims[3], dims[4], dims[5])
else:
    def _custom_run(rule, inputs, params, momenta, outer, lengths):  # pragma: no cover - torch < 2.4
        raise RuntimeError("mnemo_torch: torch.library custom ops need torch >= 2.4 (this is %s)" % torch.__version__)
