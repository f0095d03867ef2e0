"""Activation checkpointing: saved-activation bytes and step time, ours vs torch.utils.checkpoint.

    python benchmarks/bench_activation_checkpointing.py --repeats 3 --steps 10

A 12-layer GPT (examples/gpt/model.py; width 256, 8 heads, block 128, batch 8, dropout 0.1) in one
process, every block checkpointed (or none). Variants, alternating step by step so drifts
of a shared machine hit all alike:
- none: no checkpointing;
- ds / ds_nonreentrant: deepspeed.checkpointing.checkpoint / non_reentrant_checkpoint;
- torch / torch_nonreentrant: torch.utils.checkpoint.checkpoint(use_reentrant=True / False).

Saved bytes: distinct storages packed by `torch.autograd.graph.saved_tensors_hooks` during one
forward, parameters excluded (they are not activations). A region's inputs are included: the
reentrant Function saves them with save_for_backward, torch's non-reentrant checkpoint through a
no-op Function that does the same. Step time: forward + backward + SGD step; the variants
alternate step by step and the ratio to torch is the median of the paired steps' ratios.
First, the machinery's own cost: CPU time per region on a tiny Linear (`--overhead-only`: just that).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt"))
from model import GPT, GPTConfig  # noqa: E402

import deepspeed  # noqa: E402
from torch.utils.checkpoint import checkpoint as torch_checkpoint  # noqa: E402

VARIANTS = {
    "none": None,
    "ds": deepspeed.checkpointing.checkpoint,
    "ds_nonreentrant": deepspeed.checkpointing.non_reentrant_checkpoint,
    "torch": lambda f, x: torch_checkpoint(f, x, use_reentrant=True),
    "torch_nonreentrant": lambda f, x: torch_checkpoint(f, x, use_reentrant=False),
}


class Checkpointed(torch.nn.Module):
    """The GPT's forward with each block run through `fn`."""

    def __init__(self, gpt: GPT, fn) -> None:
        super().__init__()
        self.gpt, self.fn = gpt, fn

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.drop(g.tok_emb(idx) + g.pos_emb(torch.arange(idx.shape[1])))
        for block in g.blocks:
            x = block(x) if self.fn is None else self.fn(block, x)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def saved_bytes(model: Checkpointed, batch: tuple) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def one_step(model: Checkpointed, opt, batch: tuple) -> float:
    start = time.perf_counter()
    model(*batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def region_overhead_us(names: list[str], repeats: int = 5, iters: int = 200) -> dict[str, float]:
    """CPU time (process_time: insensitive to other processes' load) per region forward+backward
    on a tiny Linear(8, 8), where the checkpointing machinery is all there is to measure."""
    lin, x0 = torch.nn.Linear(8, 8), torch.randn(2, 8, requires_grad=True)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:
            fn = VARIANTS[n] or (lambda f, x: f(x))
            start = time.process_time()
            for _ in range(iters):
                h = x0
                for _ in range(12):
                    h = fn(lin, h)
                h.sum().backward()
            samples[n].append((time.process_time() - start) / iters / 12 * 1e6)
    return {n: statistics.median(v) for n, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--overhead-only", action="store_true", help="only the per-region overhead table")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    names = a.variants.split(",")
    overhead = region_overhead_us(names)
    print("| variant | CPU us per tiny region (forward + backward) |\n|---|---|")
    for n in names:
        print(f"| {n} | {overhead[n]:.1f} |")
    print()
    if a.overhead_only:
        return
    cfg = GPTConfig(n_layer=a.layers, n_head=8, n_embd=a.width, block_size=128, dropout=0.1)
    torch.manual_seed(0)
    base = GPT(cfg)
    data = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 256, (a.batch, 128), generator=data) for _ in range(2))
    models = {}
    for n in names:
        torch.manual_seed(0)
        models[n] = Checkpointed(GPT(cfg), VARIANTS[n])
        models[n].gpt.load_state_dict(base.state_dict())
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    nbytes = {n: saved_bytes(models[n], batch) for n in names}
    for n in names:   # warm up every variant
        for _ in range(a.warmup):
            one_step(models[n], opts[n], batch)
    # Variants alternate step by step (in a rotating order), so a load change on the shared
    # machine hits neighbours alike; ratios are medians of the paired steps' ratios.
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(a.repeats * a.steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            times[n].append(one_step(models[n], opts[n], batch))
    print(f"GPT {a.layers} layers, width {a.width}, 8 heads, block 128, batch {a.batch}, dropout 0.1, "
          f"{sum(p.numel() for p in base.parameters()):,} parameters; {a.threads} thread(s), "
          f"{a.repeats * a.steps} timed steps per variant, alternating step by step\n")
    print("| variant | saved activation bytes | vs none | median step (s) | p25-p75 (s) "
          "| vs torch, same kind (paired) |")
    print("|---|---|---|---|---|---|")
    for n in names:
        q = statistics.quantiles(times[n], n=4)
        ref = {"ds": "torch", "ds_nonreentrant": "torch_nonreentrant"}.get(n)
        ratio = (f"{statistics.median(x / y for x, y in zip(times[n], times[ref])):.3f}x" if ref in times else "")
        vs_none = f"{nbytes[n] / nbytes['none']:.3f}" if "none" in nbytes else ""
        print(f"| {n} | {nbytes[n]:,} | {vs_none} | {statistics.median(times[n]):.4f} | {q[0]:.3f}-{q[2]:.3f} "
              f"| {ratio} |")

if __name__ == "__main__":
    main()
