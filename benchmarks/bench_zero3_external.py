"""Cost of ZeRO-3's automatic external parameters per training step ([Note: automatic external
parameters] and [Note: gradients for released parameters] in deepspeed/runtime/zero/stage3/).

    python benchmarks/bench_zero3_external.py                 # 1 rank (gloo), 5 rounds
    python benchmarks/bench_zero3_external.py --rounds 7 --steps 8

One process, world size 1 (the work measured is per rank and local: the TorchFunctionMode on
every torch call of a forward, and the full-shape AccumulateGrad node made for each released
trainable parameter at the start of each grad-enabled forward). Two models:

* ``gpt``   examples/gpt's GPT (19.3M parameters, ~75 tensors): a model of realistic width;
* ``many``  400 x Linear(32, 32) (800 small tensors): the per-parameter cost made visible.

Variants interleaved within each round, each a fresh engine (ZeRO-3, AdamW, fp32):
``on`` (the default) and ``off`` (DEEPSPEED_ZERO3_AUTO_EXTERNAL=0: neither mechanism runs).
Reported: median over rounds of the mean wall and CPU seconds per step (forward + backward +
step), and on - off per step and per trainable parameter.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(kind: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "gpt":
        from model import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=128, vocab_size=256, n_layer=6, n_head=8, n_embd=512))

        def batch():
            x = torch.randint(0, 256, (4, 128))
            return (x, x)
        return model, batch, lambda loss: loss
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(400)])
    return model, (lambda: (torch.randn(8, 32),)), lambda out: out.square().mean()


def time_steps(kind: str, auto: bool, steps: int, warmup: int) -> tuple[float, float, int]:
    import deepspeed

    from deepspeed.runtime.zero.stage3 import external

    os.environ[external.ENV] = "1" if auto else "0"
    model, batch, loss_of = build(kind)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    n = sum(1 for p in engine.module.parameters() if p.requires_grad)
    for i in range(warmup + steps):
        if i == warmup:
            wall, cpu = time.perf_counter(), time.process_time()
        engine.backward(loss_of(engine(*batch())))
        engine.step()
    wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    engine.destroy()
    return wall, cpu, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--models", default="gpt,many")
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    print(f"load {os.getloadavg()}, 1 thread, {args.rounds} rounds x {args.steps} steps (+{args.warmup} warmup)")
    print("| model | trainable tensors | on: s/step | CPU s | off: s/step | CPU s | on - off per step (CPU) | per tensor (CPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.models.split(","):
        rows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        n = 0
        for r in range(args.rounds):
            for auto in ((True, False) if r % 2 == 0 else (False, True)):
                wall, cpu, n = time_steps(kind, auto, args.steps, args.warmup)
                rows[auto].append((wall, cpu))
        med = {a: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for a, v in rows.items()}
        diff = med[True][1] - med[False][1]
        print(f"| {kind} | {n} | {med[True][0]:.4f} | {med[True][1]:.4f} | {med[False][0]:.4f} | "
              f"{med[False][1]:.4f} | {diff * 1e3:+.2f} ms | {diff / n * 1e6:+.1f} µs |")


if __name__ == "__main__":
    main()
