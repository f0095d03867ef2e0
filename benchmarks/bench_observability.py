"""Overhead of observability on the demo model: monitors, wall-clock breakdown, memory reports and
the FLOPs profiler, measured side by side in one process.

    python benchmarks/bench_observability.py                      # 5 repeats x 20 steps per variant
    python benchmarks/bench_observability.py --repeats 3 --steps 10 --json /tmp/obs.json

One process, one rank (gloo, world size 1), one torch thread. Every variant is its own engine on an
identically initialised demo GPT (examples/gpt defaults: 4 layers, width 128, block 64; micro batch 8,
gradient accumulation 2, AdamW, ZeRO-2 as examples/gpt/ds_config.json) and sees the same batches.
Variants take turns: each repeat runs `--steps` optimizer steps of every variant, in a rotated order,
timing each step. Per variant: the median step, and the ratio to `base` paired by repeat (median of
the per-repeat ratios of medians), which cancels the machine's drifts. The FLOPs profiler's two
profiled steps (counted, then timed) are reported apart, as a one-time cost; its other steps are
its steady state. W&B and Comet are not installed here: `wandb (no-op)` enables the W&B monitor with a
stand-in module that drops the data, i.e. it measures this package's side (recording events).

Also printed: the cost of one timer start/stop pair and one monitor event, timed in a tight loop;
with the number of them per step this bounds the timers' overhead without the machine's noise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("MASTER_PORT", "29671"))

import torch  # noqa: E402

import deepspeed  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

MICRO, GAS, BLOCK = 8, 2, 64
PROFILE_STEP = 2


def variants(out: str) -> dict[str, dict]:
    csv = {"csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}}
    tb = {"tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"}}
    table = {"base": {}, "wall_clock_breakdown": {"wall_clock_breakdown": True, "steps_per_print": 10},
             "csv_monitor": csv, "wandb (no-op)": {"wandb": {"enabled": True}},
             "memory_breakdown": {"memory_breakdown": True, "steps_per_print": 10},
             "flops_profiler": {"flops_profiler": {"enabled": True, "profile_step": PROFILE_STEP}}}
    if importlib.util.find_spec("tensorboard") is not None:
        table["tensorboard"] = tb
        table["all monitors + breakdown"] = {**csv, **tb, "wandb": {"enabled": True}, "wall_clock_breakdown": True,
                                             "steps_per_print": 10}
    return table


def build(extra: dict) -> object:
    torch.manual_seed(1234)
    model = GPT(GPTConfig(block_size=BLOCK, n_layer=4, n_head=4, n_embd=128))
    with open(os.path.join(ROOT, "examples", "gpt", "ds_config.json")) as f:
        cfg = json.load(f)
    cfg.update({"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": None,
                **extra})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * GAS + micro)
    x = torch.randint(0, 256, (MICRO, BLOCK + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def run_step(engine: object, step: int) -> float:
    start = time.perf_counter()
    for micro in range(GAS):
        x, y = batch(step, micro)
        engine.backward(engine(x, y))
        engine.step()
    return time.perf_counter() - start


def micro_costs() -> dict[str, float]:
    """Seconds per timer start/stop pair and per recorded monitor event (tight loops)."""
    from deepspeed.monitor.pending import PendingEvents
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    timers, n = SynchronizedWallClockTimer(), 100_000
    start = time.perf_counter()
    for _ in range(n):
        timers("fwd").start()
        timers("fwd").stop()
    pair = (time.perf_counter() - start) / n
    events, loss = PendingEvents(), torch.tensor(2.5)
    start = time.perf_counter()
    for i in range(n // 10):
        events.add("Train/Samples/train_loss", loss, i)
        events.ready()
    return {"timer_pair_s": pair, "event_s": (time.perf_counter() - start) / (n // 10)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per variant per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    sys.modules.setdefault("wandb", types.SimpleNamespace(init=lambda **kw: None, log=lambda *a, **kw: None))
    out = tempfile.mkdtemp(prefix="bench_obs_")
    table = variants(out)
    devnull = open(os.devnull, "w")
    with contextlib.redirect_stdout(devnull):
        engines = {name: build(extra) for name, extra in table.items()}
    names = list(engines)
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    profiled: list[float] = []
    for r in range(a.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            engine, steps = engines[name], []
            for _ in range(a.steps):
                with contextlib.redirect_stdout(devnull):
                    index = engine.global_steps
                    seconds = run_step(engine, r * a.steps + len(steps))
                if name == "flops_profiler" and index in (PROFILE_STEP, PROFILE_STEP + 1):
                    profiled.append(seconds)
                    continue
                steps.append(seconds)
            times[name].append(steps)
    rows = report(names, times, profiled)
    costs = micro_costs()
    base = statistics.median(s for rep in times["base"] for s in rep)
    per_step = 5 * GAS + 2      # timer pairs per optimizer step with the breakdown (fwd, bwd, inner, reduce, step...)
    print(f"\ntimer start/stop pair: {costs['timer_pair_s'] * 1e6:.2f} us; {per_step} per step = "
          f"{per_step * costs['timer_pair_s'] / base * 100:.3f}% of the base step ({base * 1e3:.1f} ms)")
    print(f"one monitor event (recorded and resolved): {costs['event_s'] * 1e6:.2f} us; 4 per step = "
          f"{4 * costs['event_s'] / base * 100:.3f}% of the base step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "micro_costs": costs, "times": times, "profiled": profiled}, f, indent=1)


def report(names: list[str], times: dict[str, list[list[float]]], profiled: list[float]) -> list[dict]:
    base_medians = [statistics.median(rep) for rep in times["base"]]
    print("| variant | median step (ms) | vs base (paired) | per-repeat ratios |")
    print("|---|---|---|---|")
    rows = []
    for name in names:
        medians = [statistics.median(rep) for rep in times[name]]
        ratios = [m / b for m, b in zip(medians, base_medians)]
        row = {"variant": name, "median_ms": statistics.median(s for rep in times[name] for s in rep) * 1e3,
               "ratio": statistics.median(ratios), "ratios": ratios}
        rows.append(row)
        print(f"| {name} | {row['median_ms']:.2f} | {row['ratio']:.3f}x | "
              f"{', '.join(f'{x:.3f}' for x in ratios)} |")
    if profiled:
        base = statistics.median(s for rep in times["base"] for s in rep)
        print(f"\nflops_profiler one-time: counted step {profiled[0] * 1e3:.1f} ms, timed step "
              f"{profiled[1] * 1e3:.1f} ms (base step {base * 1e3:.1f} ms): "
              f"{(sum(profiled[:2]) - 2 * base) * 1e3:.1f} ms once per run")
    return rows


if __name__ == "__main__":
    main()
