"""mnemo_torch: a rule designed at the mnemo prompt, run inside a PyTorch model.

    import mnemo_torch as mt
    rule = mt.Rule("rule.h5")        # rule:save("rule.h5") at the prompt, or a dict
    out = mt.run(rule, k, v, theta=0.1, eta=0.9, alpha=0.01, params={"W1": W1})
    out.y.sum().backward()           # gradients for k, v, q, gates, W1, ... (engine's backward)

out_norm's scale and shift go as run(..., ln_g=g, ln_b=b) ([dv], [H,dv] or
[B,H,dv]; default 1 and 0; differentiable, never updated), a ragged batch's
lengths as run(..., lengths=[...]) (a [B] integer tensor on the CPU or a
list, with CPU or CUDA k and v; not differentiable).

The native part (libmnemo_torch.so, `make python`) is the engine library and
a C shim called through ctypes; no Lua at run time."""

from ._native import MnemoError, lib_path  # noqa: F401
from .rule import Rule  # noqa: F401
from .op import HAVE_CUSTOM_OP, OUTPUTS, Result, run  # noqa: F401

__all__ = ["Rule", "run", "Result", "MnemoError", "HAVE_CUSTOM_OP"]
