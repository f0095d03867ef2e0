"""ZeRO++ on CPU (4 ranks, gloo): bytes each rank sends per step (counted) and step time for plain
ZeRO-3 and the ZeRO++ variants, ours and, where /tmp/ds-venv holds it, DeepSpeed 0.19.8's; and the
loss drift of quantised gradients (qgZ) against the unquantised run over a longer run.

    python benchmarks/bench_zeropp.py [--steps 8] [--repeats 2] [--cases zero3,qgz,hpz,qwz+qgz]
                                      [--impls ours,ds] [--drift-steps 200]

The model is examples/gpt/model.py (loaded by path in both interpreters), fp32, AdamW, stage 3 with
`stage3_param_persistence_threshold: 0` (every parameter sharded), one torch thread per rank, on
learnable sequences (token t+1 = token t + stride) so the loss falls and drift is measured where
training happens. Cases (each a fresh set of 4 processes):

* ``zero3``    plain ZeRO-3
* ``qgz``      ``zero_quantized_gradients: true``
* ``hpz``      ``zero_hpz_partition_size: 2`` (2 simulated nodes x 2 ranks)
* ``qwz+qgz``  ``zero_quantized_weights`` and ``zero_quantized_gradients``

A case the implementation refuses or that fails is a row with its error. DeepSpeed's qgZ cases run
with LOCAL_SIZE=2, so that its CPU accelerator reports 2 devices per "node": it only quantises when
world / devices-per-node > 1 (with LOCAL_SIZE=4 it silently runs the fp32 reduce-scatter).

Bytes: what one rank puts on the wire per step, message bytes x (N-1)/N for the reduce-scatter,
all-gather, all-to-all and broadcast, x 2(N-1)/N for the all-reduce (deepspeed/comm/counting.py). Ours
from deepspeed.comm's counter; DeepSpeed's by wrapping torch.distributed's collectives in its
processes with the same formula (its gloo collectives all go through them). "grad" is the gradient
reduce-scatter (or qgZ's all-to-all), "gather" the parameter all-gathers (or broadcasts).

Step time: forward + backward + step after a barrier, wall and CPU seconds of the process
(time.process_time: the least disturbed by other jobs on a shared machine); the slowest rank per
step, median over the timed steps, median over repeats. Cases run interleaved.

Drift (``--drift-steps``): zero3 and qgz (each implementation where its qgZ runs) for that many
steps; the largest and final |loss_qgz - loss_zero3| / loss_zero3 over the mean-over-ranks losses.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _ds_child import ds_available, run_child  # noqa: E402
from _ranks import run_ranks  # noqa: E402

WORLD = 4
CASES = {"zero3": {}, "qgz": {"zero_quantized_gradients": True}, "hpz": {"zero_hpz_partition_size": 2},
         "qwz+qgz": {"zero_quantized_weights": True, "zero_quantized_gradients": True}}
GRAD_OPS = ("reduce_scatter_tensor", "reduce_scatter", "all_to_all_single")
GATHER_OPS = ("all_gather_into_tensor", "all_gather", "broadcast")
WIRE = {"all_reduce": lambda n: 2.0 * (n - 1) / n}   # the rest: (N-1)/N


def _gpt(cfg: dict):
    import torch

    spec = importlib.util.spec_from_file_location("bench_gpt_model", os.path.join(ROOT, "examples", "gpt", "model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt_model"] = module
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(module.GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                                       n_head=4, n_embd=cfg["hidden"], bias=True))


def _batches(cfg: dict, steps: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, cfg["vocab"], (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        idx = (start + stride * torch.arange(cfg["seq"] + 1)) % cfg["vocab"]
        yield idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


class _TorchCounter:
    """DeepSpeed's side: torch.distributed's collectives wrapped to tally message bytes per op."""

    OPS = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_reduce": 0,
           "broadcast": 0, "all_gather": 1, "reduce_scatter": 0}   # which argument is the message

    def __init__(self) -> None:
        import torch.distributed as td

        self.stats: dict[str, float] = {}
        for op, arg in self.OPS.items():
            setattr(td, op, self._wrap(op, arg, getattr(td, op)))

    def _wrap(self, op: str, arg: int, fn):
        import torch
        import torch.distributed as td

        def counted(*args, **kwargs):
            t = args[arg] if len(args) > arg else None
            if isinstance(t, (list, tuple)):
                nbytes = sum(x.numel() * x.element_size() for x in t)
            else:
                nbytes = t.numel() * t.element_size() if torch.is_tensor(t) else 0
            n = td.get_world_size(kwargs.get("group"))
            self.stats[op] = self.stats.get(op, 0.0) + nbytes * WIRE.get(op, lambda w: (w - 1) / w)(n)
            return fn(*args, **kwargs)

        return counted

    def reset(self) -> None:
        self.stats = {}

    def summary(self) -> dict[str, float]:
        return dict(self.stats)


def _rank(rank: int, world: int, port: int, case: str, cfg: dict, out: str, queue) -> None:
    impl = os.environ["BENCH_IMPL"]
    local = 2 if impl == "ds" and CASES[case].get("zero_quantized_gradients") else world   # see the docstring
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local), LOCAL_SIZE=str(local),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    counter = _TorchCounter() if impl == "ds" else None
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if counter is None:
        counter = _OursCounter(dist.comms_counter)
    row = {"rank": rank, "losses": [], "wall": [], "cpu": [], "bytes": []}
    try:
        config = {"train_micro_batch_size_per_gpu": cfg["micro"], "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **CASES[case]}}
        engine, _, _, _ = deepspeed.initialize(model=_gpt(cfg), config=config)
        micro = cfg["micro"]
        for step, (x, y) in enumerate(_batches(cfg, cfg["warmup"] + cfg["steps"], micro * world)):
            x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
            dist.barrier()
            counter.reset()
            wall, cpu = time.perf_counter(), time.process_time()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            sent = counter.summary()
            row["losses"].append(float(loss.detach()))
            if step >= cfg["warmup"]:
                row["wall"].append(wall)
                row["cpu"].append(cpu)
                row["bytes"].append(sent)
    except Exception as exc:   # a refused or failing case is a row with its error
        lines = [line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
        row["error"] = " ".join(lines)[:600]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    if "error" not in row:
        dist.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm leaves these
        os.unlink(path)
    if rank == 0:
        queue.put("done")


class _OursCounter:
    def __init__(self, counter) -> None:
        self.counter = counter

    def reset(self) -> None:
        self.counter.reset()

    def summary(self) -> dict[str, float]:
        return {op: s["wire_bytes"] for op, s in self.counter.summary().items()}


def child(args) -> None:
    """Inside one interpreter (ours or the DeepSpeed venv): one case on 4 ranks, prints RESULT json."""
    cfg = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq, micro=args.micro,
               steps=args.steps, warmup=args.warmup)
    out = tempfile.mkdtemp(prefix="bench_zeropp_")
    try:
        run_ranks(_rank, WORLD, args.child_case, cfg, out, timeout=args.job_timeout)
        rows = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    import deepspeed

    print("RESULT " + json.dumps({"version": deepspeed.__version__, "ranks": rows}), flush=True)


def launch(args, impl: str, case: str, steps: int) -> dict:
    argv = ["--child-case", case, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
            str(args.vocab), "--seq", str(args.seq), "--micro", str(args.micro), "--steps", str(steps),
            "--warmup", str(args.warmup), "--job-timeout", str(args.job_timeout)]
    result = run_child(impl, __file__, argv, args.ds_venv, args.job_timeout, extra_env={"BENCH_IMPL": impl})
    errors = [r["error"] for r in result.get("ranks", []) if "error" in r]
    return {"error": errors[0]} if errors else result


def _per_step(result: dict, ops: tuple[str, ...] | None) -> float:
    """Bytes rank 0 sends per timed step (median), restricted to `ops`."""
    steps = result["ranks"][0]["bytes"]
    return statistics.median(sum(v for op, v in s.items() if ops is None or op in ops) for s in steps)


def _slowest(results: list[dict], key: str) -> float:
    return statistics.median(statistics.median(max(v) for v in zip(*(rk[key] for rk in r["ranks"])))
                             for r in results)


def _mean_losses(result: dict) -> list[float]:
    return [statistics.fmean(x) for x in zip(*(rk["losses"] for rk in result["ranks"]))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--impls", default="ours,ds")
    p.add_argument("--drift-steps", type=int, default=200, help="0: no drift run")
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--job-timeout", type=float, default=1200)
    p.add_argument("--child-case", choices=tuple(CASES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_case:
        child(args)
        return 0
    impls = [i for i in args.impls.split(",") if i]
    cases = [c for c in args.cases.split(",") if c]
    if "ds" in impls and ds_available(args.ds_venv) is None:
        print(f"DeepSpeed 0.19.8 not importable from {args.ds_venv}/bin/python (benchmarks/ds_venv.sh builds it): "
              "ours only")
        impls.remove("ds")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for impl in impls:
            for case in cases:
                runs.setdefault((impl, case), []).append(launch(args, impl, case, args.steps))
    print(f"GPT: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, micro batch "
          f"{args.micro}; ZeRO-3 fp32 AdamW; {WORLD} ranks x 1 thread, gloo; steps {args.warmup + 1}-"
          f"{args.warmup + args.steps} timed, {args.repeats} repeats")
    print("| impl | case | sent / rank / step (MiB) | of which grad reduce | param gather | vs zero3 (grad) "
          "| wall s/step | CPU s/step (rank max) | first losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (impl, case), results in runs.items():
        good = [r for r in results if "ranks" in r]
        name = "ours" if impl == "ours" else "DeepSpeed 0.19.8"
        if not good:
            print(f"| {name} | {case} | error: {results[0]['error'][:500]} |||||||")
            continue
        base = [r for r in runs.get((impl, "zero3"), []) if "ranks" in r]
        grad = _per_step(good[0], GRAD_OPS)
        ratio = f"{grad / _per_step(base[0], GRAD_OPS):.3f}" if base else "-"
        losses = ", ".join(f"{v:.4f}" for v in _mean_losses(good[0])[:3])
        print(f"| {name} | {case} | {_per_step(good[0], None) / 2**20:.3f} | {grad / 2**20:.3f} | "
              f"{_per_step(good[0], GATHER_OPS) / 2**20:.3f} | {ratio} | {_slowest(good, 'wall'):.3f} | "
              f"{_slowest(good, 'cpu'):.3f} | {losses} |")
    if args.drift_steps:
        print(f"\nqgZ loss drift over {args.drift_steps} steps (mean-over-ranks loss, relative to zero3):")
        print("| impl | zero3 loss first / last | qgz loss last | max relative drift | final relative drift |")
        print("|---|---|---|---|---|")
        for impl in impls:
            name = "ours" if impl == "ours" else "DeepSpeed 0.19.8"
            pair = [launch(args, impl, case, args.drift_steps - args.warmup) for case in ("zero3", "qgz")]
            bad = [r["error"] for r in pair if "error" in r]
            if bad:
                print(f"| {name} | error: {bad[0][:500]} ||||")
                continue
            ref, got = _mean_losses(pair[0]), _mean_losses(pair[1])
            drift = [abs(g - r) / r for g, r in zip(got, ref)]
            print(f"| {name} | {ref[0]:.4f} / {ref[-1]:.4f} | {got[-1]:.4f} | {max(drift):.5f} | {drift[-1]:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
