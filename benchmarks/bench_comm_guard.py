"""Cost of deepspeed.comm's collective guard (deepspeed/comm/guard.py) per training step.

    python benchmarks/bench_comm_guard.py                     # 2 ranks, gloo, ZeRO-2 and ZeRO-3
    python benchmarks/bench_comm_guard.py --steps 40 --rounds 7 --hidden 512

Each rank trains the same MLP (`--layers` Linear(hidden, hidden) + Tanh, micro-batch 8, Adam,
gradient clipping on, so the step has its gradient-norm all-reduce) and times `--steps`
engine steps with the guard on (DEEPSPEED_COMM_GUARD_S=30, the default) and off (0),
alternating within each round; the table gives the median over rounds of the mean step time,
the difference, and the collectives per step. `bookkeeping` is the guard's work on the issuing
thread alone (journal entry at issue, done at return; the watcher thread's ticks are not on
that path), measured in the rank with its real ledger, times the collectives per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _ranks import run_ranks  # noqa: E402 - benchmarks/ is this script's directory


def _engine(stage: int, layers: int, hidden: int):
    import torch

    import deepspeed

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods)
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-4,
              "torch_adam": True}}, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _bookkeeping_us(calls: int = 50000) -> float:
    """begin + end of one synchronous collective's journal entry, with this rank's real ledger."""
    import torch

    from deepspeed.comm import guard

    t = torch.ones(4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            guard.end(guard.begin("all_reduce", t, None), None, None)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.comm import guard

    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=300))
    results = {}
    for stage in args.stages:
        engine = _engine(stage, args.layers, args.hidden)
        x = torch.randn(8, args.hidden, generator=torch.Generator().manual_seed(rank))

        def steps(n: int) -> float:
            ds_comm.barrier()
            start = time.perf_counter()
            for _ in range(n):
                engine.backward(engine(x).square().mean())
                engine.step()
            return (time.perf_counter() - start) / n

        steps(3)   # warm-up (and the prefetch trace at ZeRO-3)
        ds_comm.comms_counter.reset()
        steps(1)
        per_step = sum(s["count"] for s in ds_comm.comms_counter.summary().values()) - 1   # minus the barrier
        times = {"on": [], "off": []}
        for _ in range(args.rounds):
            for mode, seconds in (("on", 30.0), ("off", 0.0)):
                guard.configure(stuck_s=seconds)
                times[mode].append(steps(args.steps))
        guard.configure(stuck_s=30.0)
        results[stage] = {"on": statistics.median(times["on"]) * 1e3, "off": statistics.median(times["off"]) * 1e3,
                          "collectives": per_step, "bookkeeping_us": _bookkeeping_us()}
        del engine
    if rank == 0:
        queue.put(results)
    ds_comm.barrier()


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    results = run_ranks(_rank_main, args.ranks, args, timeout=3600)
    print(f"per step, ms (gloo, {args.ranks} ranks, {args.layers} x Linear({args.hidden}), micro-batch 8, "
          f"median of {args.rounds} rounds of {args.steps} steps)\n")
    print("| stage | collectives/step | guard off | guard on | difference | bookkeeping (us/collective) "
          "| bookkeeping per step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for stage, r in results.items():
        book = r["bookkeeping_us"] * r["collectives"] / 1e3
        print(f"| ZeRO-{stage} | {r['collectives']} | {r['off']:.2f} | {r['on']:.2f} | {r['on'] - r['off']:+.2f} "
              f"| {r['bookkeeping_us']:.2f} | {book:.3f} ms |")


if __name__ == "__main__":
    main()
