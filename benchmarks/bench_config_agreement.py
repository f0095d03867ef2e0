"""Cost of agreeing the resolved config across ranks at deepspeed.initialize (runtime/agreement.py).

    python benchmarks/bench_config_agreement.py              # 2 ranks, gloo
    python benchmarks/bench_config_agreement.py --ranks 4 --reps 200

Per rank, milliseconds, median over `reps` (the slowest rank's median is reported), with the
config of examples/gpt/ds_config.json (ZeRO-2, AdamW, WarmupDecayLR):

* ``all_reduce alone``  deepspeed.comm.all_reduce of 5 int64 (MAX), for reference
* ``validate``          DeepSpeedConfig(...): loading and validation, which initialize did before too
* ``view + digest``     the agreement's local work: resolved values, canonical view, sha256
* ``agree (match)``     agree_config of a built config: view + digest + the one all-reduce (5 int64);
                        what the agreement adds to initialize
* ``agree (mismatch)``  until every rank has raised ConfigMismatchError (rank 1's micro batch differs):
                        the all-reduce, an all_gather_object of the views, the diff
* ``initialize``        deepspeed.initialize of examples/gpt's model (19.3M parameters), agreement included
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _ranks import run_ranks  # noqa: E402 - benchmarks/ is this script's directory
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _rank_main(rank: int, world: int, port: int, reps: int, init_reps: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.agreement import agree_config, resolved_config
    from deepspeed.runtime.config import ConfigMismatchError, DeepSpeedConfig
    from deepspeed.runtime.config.agreement import agreement_view, digest
    from model import GPT, GPTConfig

    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=120))
    with open(os.path.join(ROOT, "examples", "gpt", "ds_config.json")) as f:
        config = json.load(f)
    other = {**config, "train_micro_batch_size_per_gpu": config["train_micro_batch_size_per_gpu"] * (1 + rank % 2)}
    built, built_other = DeepSpeedConfig(config, world_size=world), DeepSpeedConfig(other, world_size=world)
    world_group = ds_comm.get_world_group()   # an explicit group: agreed every call (no "agreed already" skip)

    def mismatch() -> None:
        try:
            agree_config(built_other, "bench", group=world_group)
        except ConfigMismatchError:
            return
        raise AssertionError("the configs agreed")

    def initialize() -> None:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    results = {}
    five = torch.zeros(5, dtype=torch.int64)
    variants = {"all_reduce alone": (lambda: ds_comm.all_reduce(five, op=ds_comm.ReduceOp.MAX), reps),
                "validate": (lambda: DeepSpeedConfig(config, world_size=world), reps),
                "view + digest": (lambda: digest(agreement_view(resolved_config(built))), reps),
                "agree (match)": (lambda: agree_config(built, "bench", group=world_group), reps),
                "agree (mismatch)": (mismatch, reps),
                "initialize": (initialize, init_reps)}
    for name, (fn, n) in variants.items():
        fn()   # warm up (imports, first collective)
        ds_comm.barrier()
        results[name] = _median_ms(fn, n)
    gathered: list = [None] * world
    ds_comm.all_gather_object(gathered, results)
    if rank == 0:
        queue.put({name: max(r[name] for r in gathered) for name in results})
    ds_comm.barrier()
    ds_comm.destroy_process_group()


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--init-reps", type=int, default=5)
    args = parser.parse_args()
    results = run_ranks(_rank_main, args.ranks, args.reps, args.init_reps)
    print(f"ms per call (gloo, {args.ranks} ranks, slowest rank's median of {args.reps} calls; "
          f"initialize: of {args.init_reps})\n")
    print("| step | ms |\n|---|---:|")
    for name, ms in results.items():
        print(f"| {name} | {ms:.3f} |")
    share = results["agree (match)"] / results["initialize"] * 100
    print(f"\nadded to deepspeed.initialize: {results['agree (match)']:.3f} ms ({share:.2f}% of initialize)")


if __name__ == "__main__":
    main()
