"""AutoTP tensor parallelism on CPU (2 ranks, gloo): TP=2 vs DP=2 on the same global batch, ours and,
where /tmp/ds-venv holds it, DeepSpeed 0.19.8's AutoTP side by side.

    python benchmarks/bench_tensor_parallel.py [--steps 8] [--repeats 2] [--impls ours,ds] [--ds-venv /tmp/ds-venv]

The model is a Hugging Face Llama built from a config (no download), ZeRO-0, fp32, torch AdamW, one
torch thread per rank. Cases, each a fresh pair of processes (upstream keeps its TP groups in module
state):

* ``dp2``  ``tensor_parallel`` absent: 2 data-parallel replicas, micro-batch = global / 2
* ``tp2``  ``tensor_parallel.autotp_size: 2``: one replica, both ranks see the whole global batch

Per rank, counted (not sampled from the allocator):

* model states: parameters (``engine.module.parameters()``), gradients (``p.grad`` after backward,
  before the step) and optimizer state (the tensors in the optimizer's ``state``, following wrapped
  ``.optimizer`` attributes, each storage once), by ``numel * element_size``;
* activations: the storages autograd saves for backward during one forward, seen by
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameter storages left out.

Step time: forward + backward + step after a barrier, wall and CPU seconds of the process
(``time.process_time``: work done, the number least disturbed by other jobs on a shared machine); the
slowest rank per step, median over the timed steps, median over repeats. Cases run interleaved
(ours dp2, ours tp2, ds dp2, ds tp2, then again) so machine load drifts hit all of them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _ds_child import (add_impl_args, chosen_impls, optimizer_state_bytes, run_case_and_report, run_child,  # noqa: E402
                       tensor_bytes)

CASES = ("dp2", "tp2")


def _model(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=3 * cfg["hidden"],
                         num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=cfg["layers"],
                         vocab_size=cfg["vocab"], max_position_embeddings=cfg["seq"], tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _rank(rank: int, world: int, port: int, case: str, cfg: dict, out: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    tp = 2 if case == "tp2" else 1
    dp, dp_rank = world // tp, rank // tp
    micro = cfg["batch"] // dp
    model = _model(cfg)
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    params = list(engine.module.parameters())
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
               for _ in range(cfg["warmup"] + cfg["steps"])]
    row = {"rank": rank, "numel": numel, "local_numel": sum(p.numel() for p in params), "losses": [],
           "wall": [], "cpu": []}
    for step, ids in enumerate(batches):
        x = ids[dp_rank * micro:(dp_rank + 1) * micro]
        measure = step == 0
        saved: dict[int, int] = {}
        param_storages = {p.untyped_storage().data_ptr() for p in params}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
            return t

        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if measure:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine(input_ids=x, labels=x).loss
        else:
            loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        if measure:
            row["grads"] = tensor_bytes(p.grad for p in params if p.grad is not None)
        engine.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        row["losses"].append(float(loss.detach()))
        if measure:
            row["activations"] = sum(saved.values())
            row["params"] = tensor_bytes(params)
            row["optimizer"] = optimizer_state_bytes(optimizer)
        elif step >= cfg["warmup"]:
            row["wall"].append(wall)
            row["cpu"].append(cpu)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm leaves these
        os.unlink(path)
    if rank == 0:
        queue.put("done")


def child(args) -> None:
    """Inside one interpreter (ours or the DeepSpeed venv): one case on 2 ranks, prints RESULT json."""
    cfg = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq, batch=args.batch,
               steps=args.steps, warmup=args.warmup)
    run_case_and_report(_rank, 2, args.child_case, cfg, timeout=args.job_timeout)


def launch(args, impl: str, case: str) -> dict:
    argv = ["--child-case", case, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
            str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--job-timeout", str(args.job_timeout)]
    return run_child(impl, __file__, argv, args.ds_venv, args.job_timeout)


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    add_impl_args(p)
    p.add_argument("--child-case", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_case:
        child(args)
        return 0
    impls = chosen_impls(args)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for impl in impls:
            for case in CASES:
                runs.setdefault((impl, case), []).append(launch(args, impl, case))
    print(f"tiny Llama: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
          f"global batch {args.batch}; ZeRO-0 fp32 AdamW; 2 ranks x 1 thread, gloo; steps {args.warmup + 2}-"
          f"{args.warmup + args.steps} timed, {args.repeats} repeats")
    print("| impl | case | params / rank (MiB) | grads / rank | optimizer state / rank | model states / rank "
          "| activations / rank (MiB) | per sequence (MiB) | wall s/step | CPU s/step (rank max) "
          "| first losses (mean over ranks) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (impl, case), results in runs.items():
        good = [r for r in results if "ranks" in r]
        if not good:
            print(f"| {impl} | {case} | error: {results[0]['error'][:400]} ||||||||")
            continue
        r0 = good[0]["ranks"][0]
        walls = [statistics.median(max(w) for w in zip(*(rk["wall"] for rk in r["ranks"]))) for r in good]
        cpus = [statistics.median(max(c) for c in zip(*(rk["cpu"] for rk in r["ranks"]))) for r in good]
        states = r0["params"] + r0["grads"] + r0["optimizer"]
        micro = args.batch // (2 if case == "dp2" else 1)
        losses = [statistics.fmean(x) for x in zip(*(rk["losses"] for rk in good[0]["ranks"]))]
        name = "ours" if impl == "ours" else f"DeepSpeed {good[0]['version']}"
        print(f"| {name} | {case} | {mib(r0['params'])} | {mib(r0['grads'])} | {mib(r0['optimizer'])} | "
              f"{mib(states)} | {mib(r0['activations'])} | {mib(r0['activations'] / micro)} | "
              f"{statistics.median(walls):.3f} "
              f"({min(walls):.3f}-{max(walls):.3f}) | {statistics.median(cpus):.3f} | "
              f"{', '.join(f'{x:.5f}' for x in losses[:3])} |")
        bad = [r["error"] for r in results if "error" in r]
        if bad:
            print(f"  ({len(bad)} of {len(results)} runs failed: {bad[0][:300]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
