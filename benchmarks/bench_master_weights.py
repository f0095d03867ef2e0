"""Bytes per parameter per rank held by the ZeRO optimizer for each master-weight setting
(`fp16/bf16_master_weights_and_grads`, `bf16_optimizer_states`), counted on 2 gloo ranks.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_master_weights.py [--ranks 2] [--width 512]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_master_weights.py --impls ours,ds [--steps 8]

For each setting and ZeRO stage: per element of the rank's master partition, the bytes of the
master, of the gradient partition the optimizer reads, and of the Adam moments; then their sum per
parameter of the model per rank (divided by the rank count, plus padding).

With `--impls`, side by side with DeepSpeed 0.19.8 (benchmarks/ds_venv.sh; its CPU Adam op, which
the offload settings need, JIT-builds into the venv's torch_extensions): the losses of every step for
each setting and stage on the same model and batches, and how far each setting's losses are from the
same implementation's fp32-master run (its own low-precision noise)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_child import add_impl_args, chosen_impls, run_case_and_report, run_child  # noqa: E402
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


def _join(rank: int, ranks: int, port: int):
    """This process as rank `rank` of a gloo world on the CPU, one thread; returns (torch, deepspeed)
    (imported here: ours or DeepSpeed's, whichever the interpreter finds)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=300))
    return torch, deepspeed


def _rank(rank: int, ranks: int, port: int, width: int, queue) -> None:
    torch, deepspeed = _join(rank, ranks, port)
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


def _loss_rank(rank: int, ranks: int, port: int, steps: int, width: int, out: str, queue) -> None:
    """One implementation's losses for every setting and stage (in the interpreter run_child started)."""
    import glob
    import json

    torch, deepspeed = _join(rank, ranks, port)
    rows = []
    for name, (dtype, keys, offload) in SETTINGS.items():
        for stage in (1, 2, 3):
            zero: dict = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
            config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                      dtype: {"enabled": True, **keys, **({"initial_scale_power": 8} if dtype == "fp16" else {})},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10**6}
            row = {"name": name, "stage": stage, "losses": []}
            try:
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                            torch.nn.Linear(width, width))
                engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                                       model_parameters=model.parameters())
                dt = next(engine.module.parameters()).dtype
                for step in range(steps):
                    g = torch.Generator().manual_seed(1000 * step + rank)
                    x, y = torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)
                    loss = (engine(x.to(dt)).float() - y).pow(2).mean()
                    engine.backward(loss)
                    engine.step()
                    total = loss.detach().float().clone()
                    torch.distributed.all_reduce(total)
                    row["losses"].append(float(total) / ranks)
                del engine
            except Exception as exc:   # an unsupported setting is a row, not the end of the run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    torch.distributed.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm
        os.unlink(path)
    if rank == 0:
        queue.put("done")


def _side_by_side(args) -> None:
    impls = chosen_impls(args)
    results = {}
    for impl in impls:
        argv = ["--child", "--steps", str(args.steps), "--width", str(args.width), "--ranks", str(args.ranks)]
        results[impl] = run_child(impl, __file__, argv, args.ds_venv, args.job_timeout)
    names = {"ours": "ours", "ds": "DeepSpeed 0.19.8"}
    print(f"{args.ranks} ranks x 1 thread, gloo; {args.steps} steps, AdamW lr 1e-2, Linear({args.width})-Tanh-Linear; "
          "mean loss over ranks. 'vs fp32 masters': max |loss - loss of the same implementation's fp32-master run| "
          "over the steps (its own low-precision noise); 'vs DeepSpeed': max |ours - DeepSpeed's| on the same setting")
    print("| setting | stage | impl | loss step 1 | loss last | vs fp32 masters | vs DeepSpeed |")
    print("|---|---|---|---|---|---|---|")
    table = {impl: {(r["name"], r["stage"]): r for r in res["ranks"][0]} for impl, res in results.items()
             if "error" not in res}
    for impl, res in results.items():
        if "error" in res:
            print(f"| - | - | {names[impl]} | error: {res['error'][:300]} ||||")
    first = next(iter(SETTINGS))
    for name in SETTINGS:
        for stage in (1, 2, 3):
            for impl, rows in table.items():
                row = rows[(name, stage)]
                if "error" in row:
                    print(f"| {name} | {stage} | {names[impl]} | error: `{row['error']}` ||||")
                    continue
                base = rows[(first, stage)].get("losses") or []
                noise = max((abs(a - b) for a, b in zip(row["losses"], base)), default=float("nan"))
                other = table.get("ds", {}).get((name, stage), {}) if impl == "ours" else {}
                gap = max((abs(a - b) for a, b in zip(row["losses"], other.get("losses") or [])), default=None)
                print(f"| {name} | {stage} | {names[impl]} | {row['losses'][0]:.6f} | {row['losses'][-1]:.6f} | "
                      f"{noise:.2e} | {'-' if gap is None else f'{gap:.2e}'} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    add_impl_args(parser)
    parser.set_defaults(impls="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_case_and_report(_loss_rank, args.ranks, args.steps, args.width, timeout=args.job_timeout)
        return
    if args.impls:
        _side_by_side(args)
        return
    rows = run_ranks(_rank, args.ranks, args.width)
    print(f"| setting | stage | master B/elem | grad B/elem | moments B/elem | bytes per param per rank "
          f"({args.ranks} ranks) |")
    print("|---|---|---|---|---|---|")
    for name, stage, c in rows:
        print(f"| {name} | {stage} | {c['master']:g} | {c['grad']:g} | {c['states']:g} | {c['per_param']:.2f} |")


if __name__ == "__main__":
    main()
