"""Overhead of observability on the demo model: monitors, wall-clock breakdown, memory reports and
the FLOPs profiler, measured side by side in one process.

    python benchmarks/bench_observability.py                      # 5 repeats x 20 steps per variant
    python benchmarks/bench_observability.py --repeats 3 --steps 10 --json /tmp/obs.json

One process, one rank (gloo, world size 1), one torch thread. Every variant is its own engine on an
identically initialised demo GPT (examples/gpt defaults: 4 layers, width 128, block 64; micro batch 8,
gradient accumulation 2, AdamW, ZeRO-2 as examples/gpt/ds_config.json) and sees the same batches.
After `--warmup` untimed steps each, variants take turns step by step (one optimizer step of each,
in an order rotated every step), so a drift of the shared machine hits all of them alike. Per
variant: the median step, and the paired ratio to `base` (median over steps of variant / base at
the same step), with the median of each repeat's ratios. `base (copy, built last)` is a second engine
with nothing on: its ratio is the noise floor of the comparison. The FLOPs profiler's two profiled steps
(counted, then timed) are reported apart, as a one-time cost; its other steps are its steady state. W&B and Comet are not installed here: `wandb (no-op)` enables the W&B monitor with a
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
WARMUP = 3
PROFILE_STEP = WARMUP + 1   # inside the timed steps


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
    table["base (copy, built last)"] = {}   # control: what a variant with nothing on measures (noise floor)
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
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed steps per variant (<= {WARMUP})")
    p.add_argument("--profile-runs", type=int, default=3, help="fresh profiler engines for the one-time cost")
    p.add_argument("--variants", default=None, help="comma-separated subset (base is always included)")
    p.add_argument("--copies", type=int, default=1, help="engines per variant (name #2, #3...): per-engine spread")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    sys.modules.setdefault("wandb", types.SimpleNamespace(init=lambda **kw: None, log=lambda *a, **kw: None))
    out = tempfile.mkdtemp(prefix="bench_obs_")
    table = variants(out)
    if a.variants:
        keep = {"base", *a.variants.split(",")}
        table = {n: e for n, e in table.items() if n in keep}
    table = {(n if i == 0 else f"{n} #{i + 1}"): e for n, e in table.items() for i in range(a.copies)}
    devnull = open(os.devnull, "w")
    with contextlib.redirect_stdout(devnull):
        engines = {name: build(extra) for name, extra in table.items()}
    names = list(engines)
    with contextlib.redirect_stdout(devnull):
        for name in names:
            for step in range(min(a.warmup, WARMUP)):
                run_step(engines[name], step)
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(a.repeats)] for n in names}
    profiled: list[float] = []
    for r in range(a.repeats):
        for s in range(a.steps):
            turn = r * a.steps + s
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                engine = engines[name]
                with contextlib.redirect_stdout(devnull):
                    index = engine.global_steps
                    seconds = run_step(engine, WARMUP + turn)
                if name.startswith("flops_profiler") and index in (PROFILE_STEP, PROFILE_STEP + 1):
                    profiled.append(seconds)
                    times[name][r].append(None)
                else:
                    times[name][r].append(seconds)
    rows = report(names, times, profiled)
    with contextlib.redirect_stdout(devnull):
        one_time = [profile_cost(table["flops_profiler"]) for _ in range(a.profile_runs)] \
            if "flops_profiler" in table else []
    if one_time:
        counted, timed = (statistics.median(x[i] for x in one_time) for i in (0, 1))
        print(f"flops_profiler one-time cost, {len(one_time)} fresh engines (median extra over the engine's own "
              f"median step): counted step {counted * 1e3:+.1f} ms, timed step {timed * 1e3:+.1f} ms")
    costs = micro_costs()
    base = statistics.median(x for rep in times["base"] for x in rep)
    per_step = 5 * GAS + 2      # timer pairs per optimizer step with the breakdown (fwd, bwd, inner, reduce, step...)
    print(f"\ntimer start/stop pair: {costs['timer_pair_s'] * 1e6:.2f} us; {per_step} per step = "
          f"{per_step * costs['timer_pair_s'] / base * 100:.3f}% of the base step ({base * 1e3:.1f} ms)")
    print(f"one monitor event (recorded and resolved): {costs['event_s'] * 1e6:.2f} us; 4 per step = "
          f"{4 * costs['event_s'] / base * 100:.3f}% of the base step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "micro_costs": costs, "times": times, "profiled": profiled}, f, indent=1)


def profile_cost(extra: dict) -> tuple[float, float]:
    """Extra seconds of the counted and the timed step over the median of the engine's other steps."""
    engine = build(extra)
    steps = [run_step(engine, s) for s in range(PROFILE_STEP + 6)]
    others = steps[1:PROFILE_STEP] + steps[PROFILE_STEP + 2:]
    engine.destroy()
    return steps[PROFILE_STEP] - statistics.median(others), steps[PROFILE_STEP + 1] - statistics.median(others)


def report(names: list[str], times: dict[str, list[list[float | None]]], profiled: list[float]) -> list[dict]:
    def paired(name: str, rep: int | None = None) -> float:
        reps = range(len(times[name])) if rep is None else [rep]
        return statistics.median(v / b for r in reps for v, b in zip(times[name][r], times["base"][r])
                                 if v is not None)

    print("| variant | median step (ms) | vs base (paired by step) | per-repeat |")
    print("|---|---|---|---|")
    rows = []
    for name in names:
        ratios = [paired(name, r) for r in range(len(times[name]))]
        row = {"variant": name, "median_ms": statistics.median(x for rep in times[name] for x in rep if x is not None)
               * 1e3, "ratio": paired(name), "ratios": ratios}
        rows.append(row)
        print(f"| {name} | {row['median_ms']:.2f} | {row['ratio']:.3f}x | {', '.join(f'{x:.3f}' for x in ratios)} |")
    if len(profiled) >= 2 and "flops_profiler" in names:
        base = statistics.median(x for rep in times["base"] for x in rep)
        print(f"\nflops_profiler in the interleaved run: counted step {profiled[0] * 1e3:.1f} ms, timed step "
              f"{profiled[1] * 1e3:.1f} ms (base step {base * 1e3:.1f} ms): "
              f"{(sum(profiled[:2]) - 2 * base) * 1e3:.1f} ms once per run")
    return rows


if __name__ == "__main__":
    main()
