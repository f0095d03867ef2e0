"""ZeRO++ on 4 ranks (gloo, CPU) as 2 simulated nodes x 2: plain ZeRO-3 vs qwZ, qgZ, qwZ+qgZ, hpZ
and hpZ+qwZ+qgZ. Per optimizer step (GAS 2) and rank: bytes sent (deepspeed.comm's counter,
`wire_bytes`: a ring's (N-1)/N of each all-gather / reduce-scatter / all-to-all message), the
all-gather bytes that cross the node boundary (groups of the whole ZeRO group) and those that
stay inside a node (hpZ's node groups of 2), and the step time.

    python benchmarks/bench_zeropp_weights.py [--steps 8] [--dim 256] [--layers 4] [--repeats 2]

Cases run round-robin `repeats` times (the machine is shared); the table gives the median of
the per-run medians (steps 3..) and their range. `stage3_max_reuse_distance: 0` and
`stage3_param_persistence_threshold: 0`, so every unit is gathered in forward and again in
backward, the regime hpZ targets (large models). Times on a loaded 2-core host with 4 ranks say
little about a network; the bytes are the point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_ranks  # noqa: E402
from bench_muon import BATCH, SEQ, VOCAB, _model  # noqa: E402

GAS = 2


def _rank(rank: int, world: int, port: int, cases: list, steps: int, dim: int, layers: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm.counting import WIRE_FACTOR

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    dist.comms_counter.keep_records = True
    rows = []
    for name, zeropp in cases:
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                        "stage3_param_persistence_threshold": 0, **zeropp}}
        engine, _, _, _ = deepspeed.initialize(model=_model(dim, layers), config=config)
        g = torch.Generator().manual_seed(rank)
        times, sent, crossing, inside = [], [], [], []
        for step in range(steps):
            batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(GAS)]
            dist.comms_counter.reset()
            dist.barrier()
            start = time.perf_counter()
            for x in batches:
                engine.backward(engine(x, x))
                engine.step()
            times.append(time.perf_counter() - start)
            records = [r for r in dist.comms_counter.records if r.op != "barrier"]
            wire = [(r, r.nbytes * WIRE_FACTOR.get(r.op, lambda n: 1.0)(max(r.world_size, 1))) for r in records]
            sent.append(sum(w for _, w in wire))
            crossing.append(sum(w for r, w in wire if r.op == "all_gather_into_tensor" and r.world_size == world))
            inside.append(sum(w for r, w in wire if r.op == "all_gather_into_tensor" and r.world_size < world))
        row = {"case": name, "step_s": statistics.median(times[2:]), "sent": statistics.median(sent[2:]),
               "crossing": statistics.median(crossing[2:]), "inside": statistics.median(inside[2:]),
               "numel": sum(p.ds_numel for p in engine.module.parameters())}
        rows.append(row)
        del engine
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    qw, qg, hp = {"zero_quantized_weights": True}, {"zero_quantized_gradients": True}, {"zero_hpz_partition_size": 2}
    cases = [("ZeRO-3", {}), ("qwZ", qw), ("qgZ", qg), ("qwZ + qgZ", {**qw, **qg}), ("hpZ (2)", hp),
             ("hpZ (2) + qwZ + qgZ", {**hp, **qw, **qg})]
    runs = run_ranks(_rank, 4, cases * args.repeats, args.steps, args.dim, args.layers)
    base = runs[0]
    print(f"model: {base['numel']:,} parameters; 4 ranks x 1 thread as 2 nodes x 2, GAS {GAS}, "
          f"median of steps 3-{args.steps}; bytes per optimizer step, rank 0")
    print("| case | sent / step (bytes) | vs ZeRO-3 | all-gather crossing nodes | all-gather inside a node | "
          "median step (s) | repeat medians (s) |")
    print("|---|---|---|---|---|---|---|")
    for i in range(len(cases)):
        same = runs[i::len(cases)]
        r = same[0]
        medians = sorted(s["step_s"] for s in same)
        print(f"| {r['case']} | {r['sent']:,.0f} | {r['sent'] / base['sent']:.3f}x | {r['crossing']:,.0f} | "
              f"{r['inside']:,.0f} | {statistics.median(medians):.3f} | {medians[0]:.3f}-{medians[-1]:.3f} |")


if __name__ == "__main__":
    main()
