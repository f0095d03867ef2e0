"""Muon vs AdamW under ZeRO-1 and ZeRO-3 at 2 ranks (gloo, CPU): step time, optimizer-state
bytes per rank (counted from the base optimizer's state tensors) and bytes each rank sends per
step (deepspeed.comm's counter; Muon's two all-to-alls also shown apart).

    python benchmarks/bench_muon.py [--steps 12] [--dim 256] [--layers 4] [--repeats 3]

Cases run round-robin `repeats` times (the machine is shared: interleaving spreads its load over
all of them); the table gives the median of the per-run medians and their range.

The model: an embedding and an LM head (AdamW under "Muon", by upstream's name rule) around
`layers` MLP blocks of two dim x 4dim matrices (Muon) with biases and a LayerNorm (AdamW).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_ranks  # noqa: E402

VOCAB, SEQ, BATCH = 1024, 16, 8


def _model(dim: int, layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, h):
            return h + self.down(torch.relu(self.up(self.norm(h))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.lm_head = nn.Linear(dim, VOCAB)

        def forward(self, x, y):
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    return Net()


def _rank(rank: int, world: int, port: int, cases: list, steps: int, dim: int, layers: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rows = []
    for name, optimizer, stage in cases:
        config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": optimizer,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
        engine, opt, _, _ = deepspeed.initialize(model=_model(dim, layers), config=config)
        g = torch.Generator().manual_seed(rank)
        times, sent, a2a = [], [], []
        for step in range(steps):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            dist.comms_counter.reset()
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            times.append(time.perf_counter() - start)
            summary = dist.comms_counter.summary()
            # what this rank puts on the wire: the counter's wire_bytes for the collectives of
            # equal splits; Muon's all-to-all never sends to its own rank, so all its input goes
            a2a.append(summary.get("all_to_all_single", {}).get("bytes", 0))
            sent.append(sum(s["wire_bytes"] for op, s in summary.items()
                            if op not in ("barrier", "all_to_all_single")) + a2a[-1])
        state = sum(t.numel() * t.element_size() for s in opt.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        muon = sum(p.numel() for p in engine.module.parameters() if getattr(p, "use_muon", False))
        row = {"case": name, "stage": stage, "step_s": statistics.median(times[2:]), "state": state,
               "sent": statistics.median(sent[2:]), "a2a": statistics.median(a2a[2:]), "muon_numel": muon,
               "numel": sum(p.numel() for p in engine.module.parameters())}
        everyone = [None] * world
        dist.all_gather_object(everyone, row)
        rows.append(everyone)
        del engine, opt
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}
    cases = []
    for stage in (1, 3):
        cases.append(("AdamW", adamw, stage))
        for method in ("standard", "gram"):
            cases.append((f"Muon ({method})",
                          {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "ns_method": method}}, stage))
    runs = run_ranks(_rank, 2, cases * args.repeats, args.steps, args.dim, args.layers)
    first = max((ranks[0] for ranks in runs), key=lambda r: r["muon_numel"])
    print(f"model: {first['numel']:,} parameters, {first['muon_numel']:,} in Muon matrices; 2 ranks x 1 thread, "
          f"median of steps 3-{args.steps}")
    print("| optimizer | ZeRO stage | median step (s), rank 0 | repeat medians (s) | optimizer state / rank "
          "(bytes), rank 0 / 1 | sent / step / rank (bytes) | of which Muon all-to-all |")
    print("|---|---|---|---|---|---|---|")
    for i in range(len(cases)):
        same = runs[i::len(cases)]
        r0, r1 = same[0]
        medians = sorted(ranks[0]["step_s"] for ranks in same)
        print(f"| {r0['case']} | {r0['stage']} | {statistics.median(medians):.4f} | "
              f"{medians[0]:.4f}-{medians[-1]:.4f} | {r0['state']:,} / {r1['state']:,} | "
              f"{r0['sent']:,.0f} / {r1['sent']:,.0f} | {r0['a2a']:,.0f} / {r1['a2a']:,.0f} |")

if __name__ == "__main__":
    main()
