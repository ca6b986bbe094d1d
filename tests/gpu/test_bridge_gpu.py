#!/usr/bin/env python3
"""test_bridge_gpu.py: the PyTorch bridge (python/mnemo_torch) on a GPU.

  - cuda tensors against the same call on cpu tensors (outputs, final state,
    gradients; the backward of these covered rules runs on the GPU, no
    warning), the same with lengths (ragged batches: padding outputs 0),
    with out_norm (ln_g, ln_b cuda tensors, their gradients too, on cuda:
    its backward runs on the GPU's general backward kernel) and with
    qk_norm (its backward on the GPU);
  - the caller's stream: the op on a side stream right after a long kernel
    that writes its input there, and its output read on that stream;
  - torch.compile(fullgraph=True) of a small model that calls the op
    (torch >= 2.4: the custom op mnemo::run and its fake implementation),
    forward and backward against eager;
  - CUDA-graph capture and replay of the op's forward; a captured graph
    keeps its rule's constants (clip_max, huber's delta, read by the kernels
    at run time) when a rule with other values ran on the same kernels in
    between.
Run by tests/gpu/run_gpu_tests.sh; needs libmnemo_torch.so built with CUDA
(make python; tests/gpu/pack.sh carries it). Prints PASS/FAIL/SKIP lines."""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

failures = 0


def report(ok, name, why=""):
    global failures
    if ok:
        print("PASS %s" % name)
    else:
        failures += 1
        print("FAIL %s: %s" % (name, why))


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    nb = float(b.norm())
    return float((a - b).norm()) / (nb if nb > 0 else 1.0)


def main():
    if not torch.cuda.is_available():
        print("SKIP bridge_gpu: torch sees no CUDA device")
        return 0
    try:
        import mnemo_torch as mt
    except ImportError as e:
        print("FAIL bridge_gpu/import: %s" % e)
        return 1
    print("# %s, torch %s, custom op: %s, %s" % (mt.lib_path, torch.__version__, mt.HAVE_CUSTOM_OP,
                                                 torch.cuda.get_device_name()))
    torch.manual_seed(0)
    # clip_max not 1: the kernels read it at run time (1 would be folded into the source)
    rule = mt.Rule({"layers": 2, "hidden": 16, "step": 4, "activation": "gelu", "clip": "norm", "clip_max": 0.83})
    B, H, T, dk, dv = 2, 4, 37, 16, 16
    cpu = {"k": torch.randn(B, H, T, dk) * 0.5, "v": torch.randn(B, H, T, dv) * 0.5,
           "q": torch.randn(B, H, T, dk) * 0.5, "theta": torch.full((H, 1), 0.05),
           "eta": torch.full((1,), 0.7), "alpha": torch.full((B, H, 1), 0.01),
           "W1": torch.randn(16, dk) * 0.2, "W2": torch.randn(dv, 16) * 0.2}

    def call(x, r=None):
        return mt.run(r or rule, x["k"], x["v"], x["theta"], q=x["q"], eta=x["eta"], alpha=x["alpha"],
                      params={"W1": x["W1"], "W2": x["W2"]})

    # ---- cuda against cpu, forward and backward ----
    try:
        xc = {n: t.clone().requires_grad_(True) for n, t in cpu.items()}
        xg = {n: t.cuda().requires_grad_(True) for n, t in cpu.items()}
        rc, rg = call(xc), call(xg)
        rows = ["%s %.2g" % (n, rel(getattr(rg, n), getattr(rc, n))) for n in mt.OUTPUTS if rel(getattr(rg, n), getattr(rc, n)) > 1e-5]
        rows += ["final %s %.2g" % (n, rel(rg.params[n], rc.params[n]))
                 for n in rc.params if rel(rg.params[n], rc.params[n]) > 1e-5]
        report(not rows and rg.y.is_cuda, "bridge_gpu/forward", "; ".join(rows) or "y not on cuda")
        up = torch.randn(B, H, T, dv)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            (rg.y * up.cuda()).sum().backward()
        (rc.y * up).sum().backward()
        rows = ["%s %.2g" % (n, rel(xg[n].grad, xc[n].grad)) for n in cpu if rel(xg[n].grad, xc[n].grad) > 1e-4]
        rows += ["%s not on cuda" % n for n in cpu if not xg[n].grad.is_cuda]
        report(not rows, "bridge_gpu/backward", "; ".join(rows))
        # the GPU's backward (kernels/grad_kernel.cuh) took it: no CPU copies, no warning
        report(not any("backward runs on the CPU" in str(x.message) for x in w), "bridge_gpu/backward_no_warning",
               "a warning that the backward ran on CPU copies")
    except Exception as e:  # one failure line, not a traceback, per part
        report(False, "bridge_gpu/forward", "%s: %s" % (type(e).__name__, e))

    def on_both(run, inputs):
        """run on cpu copies and on cuda copies of inputs (leaves with
        gradients): both argument dicts, both results, and the outputs and
        final tensors that differ by more than 1e-4."""
        xc = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        xg = {n: t.cuda().requires_grad_(True) for n, t in inputs.items()}
        rc, rg = run(xc), run(xg)
        rows = ["%s %.2g" % (n, rel(getattr(rg, n), getattr(rc, n))) for n in mt.OUTPUTS
                if rel(getattr(rg, n), getattr(rc, n)) > 1e-4]
        rows += ["final %s %.2g" % (n, rel(rg.params[n], rc.params[n]))
                 for n in rc.params if rel(rg.params[n], rc.params[n]) > 1e-4]
        return xc, xg, rc, rg, rows

    # ---- lengths (ragged batches) with cuda tensors: a cpu int64 [B] beside
    # them, run by the engine on the GPU (the general path) ----
    try:
        lens = torch.tensor([T, 6])  # 6: inside the second step of 4

        def rcall(x):
            return mt.run(rule, x["k"], x["v"], x["theta"], q=x["q"], eta=x["eta"], alpha=x["alpha"],
                          params={"W1": x["W1"], "W2": x["W2"]}, lengths=lens)

        xc, xg, rc, rg, rows = on_both(rcall, cpu)
        if float(rg.y[1, :, 6:].abs().max()) != 0 or float(rg.loss[1, :, 6:].abs().max()) != 0:
            rows.append("padding y or loss not 0")
        report(not rows and rg.y.is_cuda, "bridge_gpu/lengths/forward", "; ".join(rows) or "y not on cuda")
        up = torch.randn(B, H, T, dv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (rg.y * up.cuda() + rg.loss.unsqueeze(-1)).sum().backward()
        (rc.y * up + rc.loss.unsqueeze(-1)).sum().backward()
        rows = ["%s %.2g" % (n, rel(xg[n].grad, xc[n].grad)) for n in cpu if rel(xg[n].grad, xc[n].grad) > 1e-4]
        if float(xg["k"].grad[1, :, 6:].abs().max()) != 0:
            rows.append("padding keys have a gradient")
        report(not rows, "bridge_gpu/lengths/backward", "; ".join(rows))
    except Exception as e:
        report(False, "bridge_gpu/lengths", "%s: %s" % (type(e).__name__, e))

    # ---- out_norm (the general path): ln_g, ln_b as cuda tensors ----
    try:
        nrule = mt.Rule({"layers": 2, "hidden": 16, "step": 4, "residual": True, "out_norm": "layernorm"})
        base = dict(cpu, ln_g=1 + 0.3 * torch.randn(H, dv), ln_b=0.2 * torch.randn(dv))

        def ncall(x):
            return mt.run(nrule, x["k"], x["v"], x["theta"], q=x["q"], eta=x["eta"], alpha=x["alpha"],
                          params={"W1": x["W1"], "W2": x["W2"]}, ln_g=x["ln_g"], ln_b=x["ln_b"])

        xc, xg, rc, rg, rows = on_both(ncall, base)
        report(not rows and rg.y.is_cuda, "bridge_gpu/out_norm_forward", "; ".join(rows) or "y not on cuda")
        up = torch.randn(B, H, T, dv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (rg.y * up.cuda()).sum().backward()
        (rc.y * up).sum().backward()
        rows = ["%s %.2g" % (n, rel(xg[n].grad, xc[n].grad)) for n in base if rel(xg[n].grad, xc[n].grad) > 1e-4]
        rows += ["%s not on cuda" % n for n in base if not xg[n].grad.is_cuda]
        report(not rows, "bridge_gpu/out_norm_backward", "; ".join(rows))
    except Exception as e:
        report(False, "bridge_gpu/out_norm", "%s: %s" % (type(e).__name__, e))

    # ---- qk_norm: the backward on the GPU too (the keys normalised around
    # the backward kernel, kernels/grad_cuda.c) ----
    try:
        qrule = mt.Rule({"layers": 2, "hidden": 16, "step": 4, "activation": "gelu", "qk_norm": "rms"})

        def qcall(x):
            return mt.run(qrule, x["k"], x["v"], x["theta"], q=x["q"], eta=x["eta"], alpha=x["alpha"],
                          params={"W1": x["W1"], "W2": x["W2"]})

        xc, xg, rc, rg, rows = on_both(qcall, cpu)
        report(not rows and rg.y.is_cuda, "bridge_gpu/qk_norm_forward", "; ".join(rows) or "y not on cuda")
        up = torch.randn(B, H, T, dv)
        (rg.y * up.cuda() + rg.loss.unsqueeze(-1)).sum().backward()
        (rc.y * up + rc.loss.unsqueeze(-1)).sum().backward()
        rows = ["%s %.2g" % (n, rel(xg[n].grad, xc[n].grad)) for n in cpu if rel(xg[n].grad, xc[n].grad) > 1e-4]
        rows += ["%s not on cuda" % n for n in cpu if not xg[n].grad.is_cuda]
        report(not rows, "bridge_gpu/qk_norm_backward", "; ".join(rows))
    except Exception as e:
        report(False, "bridge_gpu/qk_norm", "%s: %s" % (type(e).__name__, e))

    # ---- the caller's stream ----
    try:
        side = torch.cuda.Stream()
        ref = call({n: t.cuda() for n, t in cpu.items()}).y
        big = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            k = torch.zeros(B, H, T, dk, device="cuda")
            for _ in range(8):
                big = big @ big * 1e-2  # keeps the side stream busy
            k.copy_(cpu["k"].cuda(non_blocking=False))
            x = {n: t.cuda() for n, t in cpu.items()}
            x["k"] = k + 0 * big[0, 0]  # written last on the side stream
            y = call(x).y
            out = y.clone()  # read on the side stream, with no wait in between
        torch.cuda.synchronize()
        report(rel(out, ref) < 1e-6, "bridge_gpu/stream", "result on a side stream differs: rel %.2g" % rel(out, ref))
    except Exception as e:
        report(False, "bridge_gpu/stream", "%s: %s" % (type(e).__name__, e))

    # ---- torch.compile(fullgraph=True) ----
    if not mt.HAVE_CUSTOM_OP or not hasattr(torch, "compile"):
        print("SKIP bridge_gpu/compile: torch %s (needs >= 2.4)" % torch.__version__)
    else:
        try:
            class Layer(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.qkv = torch.nn.Linear(dk, 3 * dk)
                    self.gate = torch.nn.Linear(dk, 1)
                    self.W1 = torch.nn.Parameter(torch.randn(16, dk) * 0.2)
                    self.W2 = torch.nn.Parameter(torch.randn(dv, 16) * 0.2)

                def forward(self, x):
                    q, k, v = self.qkv(x).chunk(3, dim=-1)
                    theta = 0.1 * torch.sigmoid(self.gate(x)).squeeze(-1)
                    r = mt.run(rule, k.contiguous(), v.contiguous(), theta.contiguous(), q=q.contiguous(),
                               eta=0.7, alpha=0.01, params={"W1": self.W1, "W2": self.W2})
                    return r.y.square().mean() + r.loss.mean()

            model = Layer().cuda()
            x = torch.randn(B, H, T, dk, device="cuda")
            eager = model(x)
            ge = torch.autograd.grad(eager, list(model.parameters()))
            compiled = torch.compile(model, fullgraph=True)
            got = compiled(x)
            gc = torch.autograd.grad(got, list(model.parameters()))
            rows = [] if rel(got, eager) < 1e-5 else ["loss rel %.2g" % rel(got, eager)]
            rows += ["grad %d rel %.2g" % (i, rel(a, b)) for i, (a, b) in enumerate(zip(gc, ge)) if rel(a, b) > 1e-4]
            report(not rows, "bridge_gpu/compile_fullgraph", "; ".join(rows))
        except Exception as e:
            report(False, "bridge_gpu/compile_fullgraph", "%s: %s" % (type(e).__name__, str(e).splitlines()[0]))

    def captured(static, r=None):
        """The op on static captured in a CUDA graph after a warm-up on a
        side stream (kernels compiled, memory cached): the graph, its y."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                call(static, r)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = call(static, r).y
        return g, y

    # ---- CUDA-graph capture and replay ----
    try:
        static = {n: t.cuda() for n, t in cpu.items()}
        g, y_static = captured(static)
        new_k = torch.randn(B, H, T, dk) * 0.5
        static["k"].copy_(new_k.cuda())
        g.replay()
        torch.cuda.synchronize()
        want = call(dict(static)).y
        report(rel(y_static, want) < 1e-6, "bridge_gpu/cuda_graph", "replay differs: rel %.2g" % rel(y_static, want))
    except Exception as e:
        report(False, "bridge_gpu/cuda_graph", "%s: %s" % (type(e).__name__, str(e).splitlines()[0]))

    # ---- a captured graph keeps its constants ----
    # Two rules that differ only in clip_max and delta share one kernel; the
    # graph of the first, replayed after the second ran eagerly, must give
    # the first's result (its setter launch was captured with its values).
    try:
        def huber(clip_max, delta):
            return mt.Rule({"layers": 2, "hidden": 16, "step": 4, "activation": "gelu", "loss": "huber",
                            "loss_delta": delta, "clip": "norm", "clip_max": clip_max})
        ra, rb = huber(0.0731, 0.213), huber(2.9, 1.7)
        static = {n: t.cuda() for n, t in cpu.items()}
        static["theta"] = torch.full((H, 1), 0.6, device="cuda")  # steps large enough for the clip to bite
        g, y_static = captured(static, ra)
        y_b = call(dict(static), rb).y
        g.replay()
        torch.cuda.synchronize()
        want = call(dict(static), ra).y
        apart = rel(y_b, want)
        report(rel(y_static, want) < 1e-6 and apart > 1e-2, "bridge_gpu/cuda_graph_constants",
               "replay against eager %.2g, the other rule's y %.2g apart" % (rel(y_static, want), apart))
    except Exception as e:
        report(False, "bridge_gpu/cuda_graph_constants", "%s: %s" % (type(e).__name__, str(e).splitlines()[0]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
