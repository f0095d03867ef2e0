"""Data-parallel benchmark: plain PyTorch vs PyTorch DDP vs our DeepSpeed engine.

    python benchmarks/bench_dp.py                      # ~20M-param GPT, all three variants
    python benchmarks/bench_dp.py --quick              # tiny smoke run (seconds)
    python benchmarks/bench_dp.py --variants ddp,deepspeed --repeats 3

All variants train the same byte-level GPT (examples/gpt/model.py) from the same seed on
the same batches with the same global batch:

* ``plain``     one process, the whole global batch, ``--plain-threads`` torch threads
* ``ddp``       ``--ranks`` processes, torch DistributedDataParallel
* ``deepspeed`` ``--ranks`` processes, ``deepspeed.initialize`` with a config dict
* ``fsdp2``     ``--ranks`` processes, torch FSDP2: ``fully_shard`` per transformer block, then
                the root (parameters sharded; all-gather per block, reduce-scatter of gradients)
* ``zero3``     ``--ranks`` processes, our engine at ZeRO stage 3 (defaults for every stage3 key)
* ``zero3-noprefetch``  the same with ``stage3_prefetch_bucket_size`` 0 (no prefetch)

(not in the default set: ``--variants fsdp2,zero3``; they compare sharded training;
``--variants zero3,zero3-noprefetch`` measures prefetching, ``--max-reuse-distance 0`` releasing
every unit after its forward so that the backward gathers (and prefetches) too).

Every run is a fresh set of processes (so peak RSS belongs to one variant) and the
variants are interleaved ``--repeats`` times (ddp, ours, ddp, ours, ...) so slow drifts
of this shared machine hit every variant alike. Per step we take the slowest rank's time;
the table shows the median over all timed steps of all repeats, and "vs ddp" pairs each
repeat with DDP's run of the same repeat. "CPU s/step/rank" (process CPU time, all threads)
is the metric least disturbed by other jobs on the machine: it counts work done, not time
spent waiting for a core. "Bytes sent/step/rank" is the
message size of the collectives a rank issues per optimizer step: for DDP, the gradient
buckets seen by a counting wrapper around DDP's default allreduce hook; for ours, the
runtime's comms counter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

VARIANTS = ("plain", "ddp", "deepspeed", "fsdp2", "zero3", "zero3-noprefetch")
DEFAULT_VARIANTS = ("plain", "ddp", "deepspeed")
# ~19.3M parameters: 6 x 12 x 512^2 in the blocks plus byte and position embeddings.
FULL_MODEL = dict(n_layer=6, n_head=8, n_embd=512)
QUICK_MODEL = dict(n_layer=2, n_head=2, n_embd=64)
MODELS = {"tiny": QUICK_MODEL, "small": dict(n_layer=4, n_head=4, n_embd=256), "full": FULL_MODEL}
BF16_VARIANTS = ("deepspeed", "fsdp2", "zero3", "zero3-noprefetch")   # bf16 parameters, fp32 optimizer state


def model_config(args) -> dict:
    return MODELS[args.model or ("tiny" if args.quick else "full")]
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every variant")
    p.add_argument("--ranks", type=int, default=2, help="processes for ddp / deepspeed")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=128, help="sequence length (bytes)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch threads per rank for ddp/deepspeed (default: cores // ranks)")
    p.add_argument("--plain-threads", type=int, default=None,
                   help="torch threads for plain (default: ranks x threads-per-rank, the same cores)")
    p.add_argument("--quick", action="store_true", help="tiny model, 3+1 steps, 1 repeat: a smoke test")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="GPT size: tiny, small (~3.3M), full (~19.3M; default unless --quick)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: bf16 parameters and gradients, fp32 optimizer state (" + ", ".join(BF16_VARIANTS) +
                        " only): DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy(bf16, reduce bf16)")
    p.add_argument("--max-reuse-distance", type=int, default=None,
                   help="zero3 variants: stage3_max_reuse_distance (default: the config default)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="also write the aggregated results here")
    # Internal: a worker process runs one variant on one rank and writes its results.
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = min(args.steps, 3), min(args.warmup, 1), 1
        args.micro_batch, args.block = min(args.micro_batch, 2), min(args.block, 32)
    if args.threads_per_rank is None:
        args.threads_per_rank = max(1, (os.cpu_count() or 1) // args.ranks)
    if args.plain_threads is None:
        args.plain_threads = args.threads_per_rank * args.ranks
    return args


# ---------------------------------------------------------------------------- worker side


def make_batches(args, rank: int, world: int):
    """(x, y) for every step: the same global batches for every variant, sliced per rank."""
    import torch
    from data import TextDataset

    ds = TextDataset(block_size=args.block)
    gbs = args.micro_batch * args.ranks  # global batch is fixed; plain takes all of it
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed)).tolist()
    per_rank = gbs // world
    batches = []
    for step in range(args.warmup + args.steps):
        start = step * gbs + rank * per_rank
        xs, ys = zip(*(ds[order[(start + j) % len(order)]] for j in range(per_rank)))
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches


class ByteCountingHook:
    """State + hook for ``DDP.register_comm_hook``: DDP's default allreduce, counted.

    ``default_hooks.allreduce_hook`` is what DDP runs without a hook (divide the flat
    bucket by world size, all_reduce SUM), so the step does the same work; we only add
    the bucket's byte count.
    """

    def __init__(self):
        self.process_group = None  # None: the default group, as DDP uses
        self.calls = 0
        self.bytes = 0

    @staticmethod
    def hook(state: "ByteCountingHook", bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        state.calls += 1
        state.bytes += bucket.buffer().nbytes
        return default_hooks.allreduce_hook(state.process_group, bucket)


def our_comm_bytes(reset: bool = False) -> dict:
    """Our runtime's collective tally since the last reset: {op: {"count", "bytes", ...}}.

    The one place that knows the counter API (deepspeed.comm.comms_counter).
    """
    import deepspeed.comm as dist

    if reset:
        dist.comms_counter.reset()
        return {}
    return {op: dict(s) for op, s in dist.comms_counter.summary().items()}


def deepspeed_config(args, stage: int = 0, prefetch: bool = True) -> dict:
    """fp32 data parallelism (ZeRO `stage`) with the optimizer the other variants use (torch AdamW)."""
    zero = {"stage": stage}
    if stage == 3 and not prefetch:
        zero["stage3_prefetch_bucket_size"] = 0
    if stage == 3 and args.max_reuse_distance is not None:
        zero["stage3_max_reuse_distance"] = args.max_reuse_distance
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        # DeepSpeed 0.19.8 clips at 1.0 by default; DDP and plain do not clip, so neither do we.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                   "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == "bf16"},
    }


def build_variant(args, variant: str, model):
    """Return (step_fn(x, y) -> loss tensor, bytes_fn(reset) -> comm dict)."""
    import torch

    if variant in ("deepspeed", "zero3", "zero3-noprefetch"):
        import deepspeed

        stage = 3 if variant.startswith("zero3") else 0
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=deepspeed_config(args, stage, variant != "zero3-noprefetch"))

        def ds_step(x, y):
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            return loss

        return ds_step, our_comm_bytes
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        counter = ByteCountingHook()
        model.register_comm_hook(counter, ByteCountingHook.hook)

        def ddp_bytes(reset=False):
            if reset:
                counter.calls = counter.bytes = 0
                return {}
            return {"all_reduce": {"count": counter.calls, "bytes": counter.bytes}}
    if variant == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = torch.bfloat16 if args.dtype == "bf16" else None
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def torch_step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return torch_step, (ddp_bytes if variant == "ddp" else lambda reset=False: {})


def init_process_group(variant: str) -> None:
    import torch.distributed as tdist

    if variant in ("deepspeed", "zero3", "zero3-noprefetch"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        tdist.init_process_group("gloo")


def run_worker(args) -> None:
    """One rank of one variant: warm up, time ``args.steps`` steps, write a JSON result."""
    import torch
    import torch.distributed as tdist
    from model import GPT, GPTConfig

    distributed = args.worker != "plain"
    torch.set_num_threads(args.threads_per_rank if distributed else args.plain_threads)
    if distributed:
        init_process_group(args.worker)
    rank, world = (tdist.get_rank(), tdist.get_world_size()) if distributed else (0, 1)
    batches = make_batches(args, rank, world)
    torch.manual_seed(args.seed)  # identical initial weights in every variant and rank
    model = GPT(GPTConfig(block_size=args.block, **model_config(args)))
    n_params = model.num_parameters()
    step, comm_bytes = build_variant(args, args.worker, model)
    times, cpu_times, losses = [], [], []
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            if distributed:
                tdist.barrier()  # start the timed region together
            comm_bytes(reset=True)  # after the barrier, so it is not counted
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(x, y)
        lv = loss.item()  # forces completion of the step before the clock stops
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= args.warmup:
            times.append(dt)
            cpu_times.append(dc)
            losses.append(lv)
    comms = comm_bytes()
    result = dict(rank=rank, world=world, params=n_params, times=times, cpu_times=cpu_times, losses=losses,
                  comms=comms,
                  threads=torch.get_num_threads(),
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if distributed:
        tdist.barrier()
        tdist.destroy_process_group()


# ---------------------------------------------------------------------------- driver side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, variant: str, argv: list[str]) -> list[dict]:
    """Run one variant as fresh processes; return the per-rank result dicts."""
    world = 1 if variant == "plain" else args.ranks
    with tempfile.TemporaryDirectory(prefix=f"bench_{variant}_") as out:
        port, procs = str(free_port()), []
        for rank in range(world):
            threads = str(args.plain_threads if variant == "plain" else args.threads_per_rank)
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", variant, "--result-dir", out]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        logs = [p.communicate()[0] for p in procs]
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tail = "\n".join(logs[failed[0]].strip().splitlines()[-15:])
            raise RuntimeError(f"{variant} rank {failed[0]} exited with {procs[failed[0]].returncode}:\n{tail}")
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def aggregate(args, variant: str, runs: list[list[dict]]) -> dict:
    """Fold the runs of one variant into one table row."""
    step_times, run_medians, cpu = [], [], []
    for ranks in runs:
        cpu += [t for r in ranks for t in r["cpu_times"]]
        # A data-parallel step is as slow as its slowest rank.
        per_step = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
        step_times += per_step
        run_medians.append(statistics.median(per_step))
    last = runs[-1]
    med = statistics.median(step_times)
    world = len(last)
    comm_bytes = [sum(op["bytes"] for op in r["comms"].values()) / args.steps for r in last]
    return dict(
        variant=variant, ranks=world, threads=last[0]["threads"], params=last[0]["params"],
        median_step_s=med, median_cpu_s=statistics.median(cpu), run_medians=run_medians, spread=(min(run_medians), max(run_medians)),
        tokens_per_s=args.micro_batch * args.ranks * args.block / med,
        peak_rss_mb=[r["peak_rss_mb"] for r in last],
        bytes_per_step=comm_bytes, comms=[r["comms"] for r in last],
        losses=[sum(r["losses"][i] for r in last) / world for i in range(len(last[0]["losses"]))],
        final_loss=sum(r["losses"][-1] for r in last) / world,
    )


def paired_ratio(row: dict, ref: dict | None) -> str:
    """Median over repeats of (this run's median / the reference's run median of the same repeat).

    Runs of one repeat are minutes apart at most, so pairing them cancels the slow load
    drifts of a shared machine that a ratio of pooled medians would keep.
    """
    if ref is None or "error" in ref:
        return "-"
    ratios = [a / b for a, b in zip(row["run_medians"], ref["run_medians"])]
    return f"{statistics.median(ratios):.3f}x"


def print_table(rows: list[dict]) -> None:
    # paired against DDP where it ran, else against the first variant
    ref = next((r for r in rows if r["variant"] == "ddp"), rows[0] if rows else None)
    print(f"| variant | ranks x threads | median step (s) | repeat medians (s) | vs {ref and ref['variant']} (paired) "
          "| tokens/s "
          "| CPU s / step / rank | peak RSS per rank (MB) | bytes sent / step / rank | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | FAILED | | | | | | | | |")
            continue
        vs = paired_ratio(r, ref)
        rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mb"])
        sent = " / ".join(f"{b:,.0f}" for b in r["bytes_per_step"]) if r["variant"] != "plain" else "0"
        print(f"| {r['variant']} | {r['ranks']} x {r['threads']} | {r['median_step_s']:.4f} "
              f"| {r['spread'][0]:.4f}-{r['spread'][1]:.4f} | {vs} | {r['tokens_per_s']:,.0f} "
              f"| {r['median_cpu_s']:.4f} | {rss} "
              f"| {sent} | {r['final_loss']:.4f} |")


def print_comm_breakdown(rows: list[dict], steps: int) -> None:
    for r in rows:
        if "error" in r or r["variant"] == "plain":
            continue
        ops = ", ".join(f"{op}: {s['count'] / steps:g} calls {s['bytes'] / steps:,.0f} B"
                        for op, s in sorted(r["comms"][0].items()))
        print(f"- {r['variant']} rank 0 per step: {ops or 'no collectives recorded'}")


def driver(args, argv: list[str]) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        sys.exit(f"unknown variants: {sorted(unknown)}")
    if args.dtype == "bf16" and set(variants) - set(BF16_VARIANTS):
        sys.exit(f"--dtype bf16 runs only the variants {BF16_VARIANTS}")
    model_cfg = model_config(args)
    print(f"model {model_cfg} block {args.block}; global batch {args.micro_batch * args.ranks} x {args.block} "
          f"tokens; {args.warmup} warmup + {args.steps} timed steps x {args.repeats} repeats; "
          f"threads: plain {args.plain_threads}, per rank {args.threads_per_rank}; cpus {os.cpu_count()}",
          flush=True)
    runs: dict[str, list] = {v: [] for v in variants}
    errors: dict[str, str] = {}
    for rep in range(args.repeats):
        for v in variants:
            if v in errors:
                continue
            t0 = time.perf_counter()
            try:
                runs[v].append(launch(args, v, argv))
            except RuntimeError as e:
                errors[v] = str(e)
                print(f"[repeat {rep + 1}] {v}: FAILED\n{e}", file=sys.stderr, flush=True)
                continue
            print(f"[repeat {rep + 1}/{args.repeats}] {v}: {time.perf_counter() - t0:.1f}s", flush=True)
    rows = [dict(variant=v, error=errors[v]) if v in errors else aggregate(args, v, runs[v]) for v in variants]
    params = next((r["params"] for r in rows if "params" in r), 0)
    print(f"\nparameters: {params:,}\n")
    print_table(rows)
    print()
    print_comm_breakdown(rows, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 1 if errors else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
