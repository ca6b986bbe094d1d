#!/usr/bin/env python3
"""titans_torch.py: a Titans-style memory layer in PyTorch, trained twice on a
recall task: once with the rule as one mnemo op (python/mnemo_torch), once
with the same rule written the usual way, torch.autograd.grad inside the
forward pass (create_graph=True, as titans-pytorch does). Same data, same
initial weights: the losses must agree to float32 rounding; the time per
training step is printed for both.

The layer: learned q, k, v projections of the input; data-dependent gates
from linear layers (theta per token, eta and alpha per step, from the step's
first token); a 2-layer MLP memory (silu, biases) updated every c tokens
with momentum and decay (SPEC.md section 2; retrieve = after: a token
reads the weights after the last step that ended at or before it);
an output projection. The task: B sequences of P (key, value) pairs, then
the P keys again in a shuffled order; the loss is the error of recalling
each key's value at its second appearance.

    /usr/bin/python3 examples/titans_torch.py [--steps 200] [--device cpu|cuda]

(With --device cuda the mnemo op's backward runs on the GPU too, one
thread block per memory: plain, not yet fast.)"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import mnemo_torch as mt  # noqa: E402


def recall_batch(gen, B, P, d):
    """x [B, 2P, 2d]: (key, value) pairs, then the keys alone, shuffled;
    target [B, P, d]: the values the second half asks for."""
    keys = torch.randn(B, P, d, generator=gen)
    vals = torch.randn(B, P, d, generator=gen)
    order = torch.stack([torch.randperm(P, generator=gen) for _ in range(B)])
    qkeys = torch.gather(keys, 1, order[..., None].expand(B, P, d))
    target = torch.gather(vals, 1, order[..., None].expand(B, P, d))
    write = torch.cat([keys, vals], -1)
    read = torch.cat([qkeys, torch.zeros_like(qkeys)], -1)
    return torch.cat([write, read], 1), target


class TitansLayer(torch.nn.Module):
    def __init__(self, d_in, H, dk, dh, c, rule):
        super().__init__()
        self.H, self.dk, self.dh, self.c, self.rule = H, dk, dh, c, rule
        self.q = torch.nn.Linear(d_in, H * dk)
        self.k = torch.nn.Linear(d_in, H * dk)
        self.v = torch.nn.Linear(d_in, H * dk)
        self.theta = torch.nn.Linear(d_in, H)
        self.eta = torch.nn.Linear(d_in, H)
        self.alpha = torch.nn.Linear(d_in, H)
        self.out = torch.nn.Linear(H * dk, d_in // 2)
        # the memory's initial fast weights (outer-loop parameters), per head
        self.W1 = torch.nn.Parameter(torch.randn(H, dh, dk) / dk ** 0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(H, dh))
        self.W2 = torch.nn.Parameter(torch.randn(H, dk, dh) / dh ** 0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(H, dk))

    def heads(self, t):  # [B, T, H*d] -> [B, H, T, d]
        B, T, _ = t.shape
        return t.view(B, T, self.H, -1).transpose(1, 2).contiguous()

    def inputs(self, x):
        q, k, v = (F.normalize(self.heads(f(x)), dim=-1) for f in (self.q, self.k, self.v))
        theta = 0.5 * torch.sigmoid(self.theta(x)).transpose(1, 2).contiguous()          # [B, H, T]
        first = x[:, ::self.c]                                                           # each step's first token
        eta = torch.sigmoid(self.eta(first)).transpose(1, 2).contiguous()                # [B, H, S]
        alpha = 0.1 * torch.sigmoid(self.alpha(first)).transpose(1, 2).contiguous()      # [B, H, S]
        return q, k, v, theta, eta, alpha

    def forward(self, x, use_mnemo):
        q, k, v, theta, eta, alpha = self.inputs(x)
        params = {"W1": self.W1, "b1": self.b1, "W2": self.W2, "b2": self.b2}
        if use_mnemo:
            y = mt.run(self.rule, k, v, theta, q=q, eta=eta, alpha=alpha, params=params).y
        else:
            y = memory_autograd(self.c, k, v, q, theta, eta, alpha, params)
        B, H, T, dv = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, H * dv))


def mlp(P, x):
    h = F.silu(torch.einsum("bhij,bhnj->bhni", P["W1"], x) + P["b1"][:, :, None])
    return torch.einsum("bhij,bhnj->bhni", P["W2"], h) + P["b2"][:, :, None]


def memory_autograd(c, k, v, q, theta, eta, alpha, init):
    """The same rule with torch.autograd.grad in the forward pass: loss mse
    (mean over features), token_reduce sum, refresh = c, retrieve after."""
    B, H, T, _ = k.shape
    P = {n: p.expand(B, H, *p.shape[1:]) for n, p in init.items()}
    S = {n: torch.zeros_like(p) for n, p in P.items()}
    ys = []
    for s, t0 in enumerate(range(0, T, c)):
        sl = slice(t0, min(t0 + c, T))
        err = (mlp(P, k[:, :, sl]) - v[:, :, sl]).square().mean(-1)                      # l_t [B, H, n]
        G = torch.autograd.grad((theta[:, :, sl] * err).sum(), list(P.values()), create_graph=True)
        y_before = mlp(P, q[:, :, sl])
        e, a = eta[:, :, s, None, None], alpha[:, :, s, None, None]
        for (n, p), g in zip(list(P.items()), G):
            e_, a_ = (e[..., 0], a[..., 0]) if p.dim() == 3 else (e, a)
            S[n] = e_ * S[n] - g
            P[n] = (1 - a_) * p + S[n]
        # retrieve = after: a token sees the update of the step that ends at it
        # (only the step's last token); the others read the weights before it
        ys += [y_before[:, :, :-1], mlp(P, q[:, :, sl.stop - 1:sl.stop])]
    return torch.cat(ys, 2)


def train(args, use_mnemo, rule):
    torch.manual_seed(args.seed)
    model = TitansLayer(2 * args.d, args.H, args.dk, args.dh, args.c, rule).to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, times = [], []
    for step in range(args.steps):
        x, target = recall_batch(gen, args.B, args.P, args.d)
        x, target = x.to(args.device), target.to(args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pred = model(x, use_mnemo)[:, args.P:]
        loss = F.mse_loss(pred, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--P", type=int, default=16, help="pairs per sequence (T = 2P)")
    ap.add_argument("--d", type=int, default=16, help="width of keys and values of the task")
    ap.add_argument("--dk", type=int, default=16)
    ap.add_argument("--dh", type=int, default=32)
    ap.add_argument("--c", type=int, default=4, help="tokens per memory step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rule = mt.Rule({"layers": 2, "hidden": args.dh, "activation": "silu", "bias": True, "step": args.c,
                    "loss": "mse", "token_reduce": "sum", "retrieve": "after"})
    runs = {}
    for name, use in (("mnemo", True), ("autograd.grad", False)):
        runs[name] = train(args, use, rule)
    (lm, tm), (la, ta) = runs["mnemo"], runs["autograd.grad"]
    print("%6s  %12s  %14s" % ("step", "loss mnemo", "loss autograd"))
    for s in sorted(set(list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1])):
        print("%6d  %12.6f  %14.6f" % (s, lm[s], la[s]))
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lm, la))
    print("largest relative difference of the losses: %.2e" % diff)
    skip = min(3, args.steps - 1)  # the first steps include one-off work (kernel builds, allocator)
    ms_m = 1e3 * sum(tm[skip:]) / max(1, len(tm) - skip)
    ms_a = 1e3 * sum(ta[skip:]) / max(1, len(ta) - skip)
    print("time per training step on %s: mnemo %.2f ms, autograd.grad %.2f ms (ratio %.2fx)"
          % (args.device, ms_m, ms_a, ms_a / ms_m))


if __name__ == "__main__":
    main()
