"""Cost of ZeRO-3's divergence watchdog per unit collective (deepspeed/runtime/zero/stage3/watchdog.py).

    python benchmarks/bench_zero3_watchdog.py            # 2 ranks, gloo, 3 unit sizes
    python benchmarks/bench_zero3_watchdog.py --ranks 4 --rounds 7

Per call of one unit collective (fp32, world N, gloo on CPU), microseconds, median over rounds
of the mean over `reps` calls, variants interleaved within each round:

* ``plain``        deepspeed.comm.all_gather_into_tensor / reduce_scatter_tensor (before the watchdog)
* ``deadline``     the same through comm/bounded.py (per-operation timeout only)
* ``watchdog``     the ZeRO-3 path: deadline + journal + schedule check every 64 (the default)
* ``check every``  the ZeRO-3 path with a schedule check (c10d store round trips) after every collective
* ``strict``       the ZeRO-3 path with DEEPSPEED_ZERO3_STRICT=1 (a fingerprint all-gather first)

plus ``bookkeeping``: the watchdog's Python work alone (no collective, no store), in one process.
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


def _variants(numel: int, world: int):
    import torch

    from deepspeed import comm as ds_comm
    from deepspeed.comm.bounded import all_gather_into_tensor_within, reduce_scatter_tensor_within
    from deepspeed.runtime.zero.stage3 import watchdog
    from deepspeed.runtime.zero.stage3.units import UnitSpec

    spec = UnitSpec(0, "layers.0.attn", ("layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias"), (numel - 64, 64), False)
    shard, full = torch.randn(numel // world), torch.empty(numel)
    grads, out = torch.randn(numel), torch.empty(numel // world)

    def settings(every: int, strict: bool):
        return lambda: watchdog.configure(check_every=every, strict=strict)

    default, every_call, strict = settings(64, False), settings(1, False), settings(64, True)
    return {
        "all-gather plain": (default, lambda: ds_comm.all_gather_into_tensor(full, shard)),
        "all-gather deadline": (default, lambda: all_gather_into_tensor_within(full, shard, 300.0)),
        "all-gather watchdog": (default, lambda: watchdog.all_gather(full, shard, None, spec, "forward")),
        "all-gather check every": (every_call, lambda: watchdog.all_gather(full, shard, None, spec, "forward")),
        "all-gather strict": (strict, lambda: watchdog.all_gather(full, shard, None, spec, "forward")),
        "reduce-scatter plain": (default, lambda: ds_comm.reduce_scatter_tensor(out, grads)),
        "reduce-scatter watchdog": (default, lambda: watchdog.reduce_scatter(out, grads, None, spec, "gradient")),
    }


def _rank_main(rank: int, world: int, port: int, sizes: list[int], rounds: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed import comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=120))
    results = {}
    for numel in sizes:
        variants = _variants(numel, world)
        reps = max(20, min(2000, int(4e7 // numel)))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (setup, fn) in variants.items():
                setup()
                for _ in range(5):
                    fn()
                ds_comm.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - start) / reps * 1e6)
        results[numel] = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        queue.put(results)
    ds_comm.barrier()
    ds_comm.destroy_process_group()


def _bookkeeping_us(calls: int = 200000) -> float:
    """The watchdog's per-collective Python work with a no-op collective (checks off)."""
    import torch

    from deepspeed.runtime.zero.stage3 import watchdog
    from deepspeed.runtime.zero.stage3.units import UnitSpec

    watchdog.configure(check_every=0, strict=False)
    watch = watchdog._GroupWatch.__new__(watchdog._GroupWatch)   # no process group needed
    watch.group, watch.rank, watch.world, watch.prefix = None, 0, 2, "bench"
    watch.seq, watch.hash, watch.last_check, watch.hashes = 0, 0, 0, {}
    watch.journal = watchdog.deque(maxlen=watchdog._JOURNAL)
    spec = UnitSpec(0, "layers.0.attn", ("layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias"), (1000, 64), False)
    device = torch.device("cpu")
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            watch.run(watchdog.site("all-gather", "forward", spec), device, lambda t, label=None: None)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="4096,262144,4194304", help="unit sizes in elements")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = run_ranks(_rank_main, args.ranks, sizes, args.rounds)
    names = list(next(iter(results.values())))
    print(f"per call, us (gloo, {args.ranks} ranks, fp32, median of {args.rounds} rounds)\n")
    print("| variant | " + " | ".join(f"{n:,} elements" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[n][name]:.0f}" for n in sizes) + " |")
    print(f"\nbookkeeping alone (no collective, no store): {_bookkeeping_us():.2f} us per unit collective")


if __name__ == "__main__":
    main()
