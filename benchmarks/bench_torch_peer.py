"""A plain PyTorch (eager) peer of the library's train step, for the throughput comparison at the peer shapes.

    python benchmarks/bench_torch_peer.py --shapes tiny-peer,small-peer \
        --variants standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7 --rounds 12 --out peer_torch.json

Not part of the library and not a dependency: it needs `torch` (e.g. `pip install torch==2.13.0`, CPU build) in the
environment that runs it. The model is written the obvious way a PyTorch user would write it, at the peer shapes of
`bench_attention.PEER_SHAPES` (4 layers, d_model 128 / 256, 4 heads, T 256, batch 8, vocab 8192): learned positions,
pre-LayerNorm blocks, no bias on the q/k/v/o projections, GELU (tanh) MLP 4·d with biases, a tied head,
`F.scaled_dot_product_attention(is_causal=True)`, AdamW (foreach) after global-norm clipping at 1.0. The coupled
variants evolve q and k per head with f a two-layer SiLU MLP d_head -> 4·d_head -> d_head shared by the heads and a
learnable Δt per head (Euler: q += Δt·k, k += Δt·f(q); leapfrog: half-kick, drift, half-kick), with autograd through
the n steps. One process times every variant in interleaved rounds (A B C A B C ...), as bench_attention does, so the
×standard ratios are taken within one run; compare tokens/s with bench_attention in alternating processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PEER_SHAPES = {"tiny-peer": 128, "small-peer": 256}  # d_model; the rest is shared (see the docstring)
N_LAYERS, N_HEADS, SEQ, BATCH, VOCAB = 4, 4, 256, 8, 8192


class Coupling(nn.Module):
    """q, k [B, H, T, dh] -> n steps of the coupled dynamics; f shared by the heads, Δt per head."""

    def __init__(self, dh: int, n_heads: int, integrator: str, n_steps: int):
        super().__init__()
        self.w1 = nn.Linear(dh, 4 * dh)
        self.w2 = nn.Linear(4 * dh, dh)
        nn.init.zeros_(self.w2.weight)  # f = 0 at init, as in the library
        nn.init.zeros_(self.w2.bias)
        self.dt = nn.Parameter(torch.full((1, n_heads, 1, 1), 0.1))
        self.integrator, self.n_steps = integrator, n_steps

    def f(self, q: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(q)))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.dt
        for _ in range(self.n_steps):
            if self.integrator == "euler":
                q, k = q + dt * k, k + dt * self.f(q)
            else:
                k_half = k + 0.5 * dt * self.f(q)
                q = q + dt * k_half
                k = k_half + 0.5 * dt * self.f(q)
        return q, k


class Block(nn.Module):
    def __init__(self, d: int, coupling: tuple[str, int] | None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.coupling = Coupling(d // N_HEADS, N_HEADS, *coupling) if coupling else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, N_HEADS, d // N_HEADS).transpose(1, 2) for z in (q, k, v))
        if self.coupling is not None:
            q, k = self.coupling(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, d: int, coupling: tuple[str, int] | None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, coupling) for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(d)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.embed.weight.T  # tied head
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def parse_variant(spec: str) -> tuple[str, tuple[str, int] | None]:
    name, *opts = spec.split(":")
    n_steps = 1
    for opt in opts:
        key, _, value = opt.partition("=")
        if key != "n_steps":
            raise SystemExit(f"error: option {key!r} of {spec!r} is not supported here (only n_steps)")
        n_steps = int(value)
    table = {"standard": None, "coupled_euler": ("euler", n_steps), "coupled_leapfrog": ("leapfrog", n_steps)}
    if name not in table:
        raise SystemExit(f"error: variant {name!r} is not in the PyTorch peer; use one of {sorted(table)}")
    return spec, table[name]


def make_step(d: int, coupling, seed: int):
    torch.manual_seed(seed)
    model = GPT(d, coupling)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()  # one host sync per step, as a training loop that logs the loss has

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny-peer,small-peer")
    ap.add_argument("--variants", default="standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", required=True, help="JSON results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"command": "python benchmarks/bench_torch_peer.py " + " ".join(sys.argv[1:]), "torch": torch.__version__, "threads": args.threads, "rows": []}
    for shape in args.shapes.split(","):
        d = PEER_SHAPES[shape]
        steps = {spec: make_step(d, coupling, 0) for spec, coupling in map(parse_variant, args.variants.split(","))}
        for step in steps.values():  # warm-up: allocator, first-call paths
            step(), step()
        times: dict[str, list[float]] = {spec: [] for spec in steps}
        for r in range(args.rounds):
            for spec, step in steps.items():
                t0 = time.perf_counter()
                loss = step()
                times[spec].append(time.perf_counter() - t0)
                if not math.isfinite(loss):
                    raise RuntimeError(f"{shape} {spec}: non-finite loss {loss}")
            line = " ".join(f"{s}={1e3 * t[-1]:.0f}ms" for s, t in times.items())
            print(f"[{shape}] round {r + 1}/{args.rounds} load {os.getloadavg()[0]:.1f} {line}", flush=True)
        base_med, base_min = statistics.median(times["standard"]), min(times["standard"])
        for spec, t in times.items():
            med = statistics.median(t)
            results["rows"].append({"shape": shape, "variant": spec, "step_ms": 1e3 * med,
                                    "x_standard": med / base_med, "x_standard_minmin": min(t) / base_min,
                                    "tokens_per_s": BATCH * SEQ / med, "load": os.getloadavg()[0]})
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    for row in results["rows"]:
        print(f"{row['shape']:11s} {row['variant']:26s} {row['step_ms']:8.1f} ms  x{row['x_standard']:.3f} "
              f"(min/min x{row['x_standard_minmin']:.3f})  {row['tokens_per_s']:,.0f} tok/s")


if __name__ == "__main__":
    main()
