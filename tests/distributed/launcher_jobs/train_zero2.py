"""A tiny ZeRO-2 job whose result depends only on the global batch, not on how it is split.

Started by the multi-node launcher tests through every path (one node, two launchers, pdsh,
srun, mpirun, an elastic restart). The batch sizes come from the config's `elasticity` section
(train_batch_size 16 for any valid world size). Step s consumes the global samples
[16 s, 16 s + 16); rank r takes its micro-batches from that slice, so every split of the same
global batch gives the same mean gradient. Rank 0 writes the final parameters and the batch
triple to --out as JSON.

    train_zero2.py --out OUT --steps N [--save DIR --save-at K] [--load DIR]
"""

import argparse
import json
import os

import torch

import deepspeed

CONFIG = {
    "elasticity": {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                   "max_gpus": 4, "version": 0.1},
    "optimizer": {"type": "Adam", "params": {"lr": 0.02, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.0,
    "steps_per_print": 1000,
}


def samples(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data by global sample index."""
    i = index.double().unsqueeze(1)
    x = torch.sin(0.37 * i + 0.11 * torch.arange(8, dtype=torch.float64)).float()
    y = (x[:, :1] * 0.7 - x[:, 1:2] * 0.3 + torch.cos(0.05 * i).float())
    return x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save", default=None)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--load", default=None)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    batch, micro, gas = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps())
    first = 0
    if args.load:
        engine.load_checkpoint(args.load)
        first = engine.global_steps
    losses = []
    for step in range(first, args.steps):
        for m in range(gas):
            start = step * batch + m * micro * world + rank * micro
            x, y = samples(torch.arange(start, start + micro))
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        if step + 1 == args.save_at:
            engine.save_checkpoint(args.save)
            break
    if rank == 0:
        params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
        with open(args.out, "w") as fd:
            json.dump({"world": world, "batch": [batch, micro, gas], "steps": engine.global_steps,
                       "params": params.tolist(), "rank_env": os.environ.get("RANK")}, fd)


if __name__ == "__main__":
    main()
