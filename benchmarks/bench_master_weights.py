"""Bytes per parameter per rank held by the ZeRO optimizer for each master-weight setting
(`fp16/bf16_master_weights_and_grads`, `bf16_optimizer_states`), counted on 2 gloo ranks.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_master_weights.py [--ranks 2] [--width 512]

For each setting and ZeRO stage: per element of the rank's master partition, the bytes of the
master, of the gradient partition the optimizer reads, and of the Adam moments; then their sum per
parameter of the model per rank (divided by the rank count, plus padding)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_ranks  # noqa: E402

SETTINGS = {   # name: (dtype section, section keys, offload_optimizer)
    "bf16, fp32 masters (default)": ("bf16", {}, True),
    "bf16_master_weights_and_grads": ("bf16", {"bf16_master_weights_and_grads": True}, True),
    "+ bf16_optimizer_states, offload": ("bf16", {"bf16_master_weights_and_grads": True,
                                                  "bf16_optimizer_states": True}, True),
    "+ bf16_optimizer_states, on device": ("bf16", {"bf16_master_weights_and_grads": True,
                                                    "bf16_optimizer_states": True}, False),
    "fp16_master_weights_and_grads": ("fp16", {"fp16_master_weights_and_grads": True}, True),
}


def _count(engine) -> dict:
    import torch

    opt = engine.optimizer
    shards = list(getattr(opt, "units", None) or opt.buckets)
    numel = sum(s.master.numel() for s in shards)
    master = sum(s.master.numel() * s.master.element_size() for s in shards)
    grad = sum(s.grad.numel() * s.grad.element_size() for s in shards)
    states = sum(v.numel() * v.element_size() for st in opt.optimizer.state.values() for k, v in st.items()
                 if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq"))
    model = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    return {"master": master / numel, "grad": grad / numel, "states": states / numel,
            "per_param": (master + grad + states) / model}


def _rank(rank: int, ranks: int, port: int, width: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=300))
    rows = []
    for name, (dtype, keys, offload) in SETTINGS.items():
        for stage in (1, 2, 3):
            zero: dict = {"stage": stage}
            if offload:
                zero["offload_optimizer"] = {"device": "cpu"}
            config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                      dtype: {"enabled": True, **keys, **({"initial_scale_power": 8} if dtype == "fp16" else {})},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6}
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
            engine, _, _, _ = deepspeed.initialize(model=model, config=config)
            x = torch.randn(2, width, dtype=engine.module[0].weight.dtype)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
            rows.append((name, stage, _count(engine)))
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    rows = run_ranks(_rank, args.ranks, args.width)
    print(f"| setting | stage | master B/elem | grad B/elem | moments B/elem | bytes per param per rank "
          f"({args.ranks} ranks) |")
    print("|---|---|---|---|---|---|")
    for name, stage, c in rows:
        print(f"| {name} | {stage} | {c['master']:g} | {c['grad']:g} | {c['states']:g} | {c['per_param']:.2f} |")


if __name__ == "__main__":
    main()
