"""A job whose ranks read different config files: `--config DIR` makes rank r load DIR/rank{r}.json
(as a per-node config generator or a stale copy on one node would). Trains `--steps` steps of a
tiny model through `args.deepspeed_config` and prints "trained N steps" on each rank. The
launcher's SIGTERM (sent once the first rank exits) is ignored, so each rank's log shows how that
rank itself ended; the launcher's SIGKILL after its grace period still ends a rank that hangs.

    config_per_rank.py --config DIR --steps N
"""

import argparse
import os
import signal

import torch

import deepspeed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ["RANK"])
    args.deepspeed_config = os.path.join(args.config, f"rank{rank}.json")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 8)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    print(f"rank {rank}: trained {engine.global_steps} steps", flush=True)


if __name__ == "__main__":
    main()
