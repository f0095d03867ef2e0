"""Train a small byte-level GPT on Jane Austen with DeepSpeed data parallelism.

    deepspeed --num_gpus 2 examples/gpt/train.py --deepspeed --deepspeed_config examples/gpt/ds_config.json

The launcher starts one process per rank (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* in the
environment, ``--local_rank=N`` on the command line). Without a GPU every rank runs on
the CPU and the ranks talk over gloo. Rank 0 draws a progress bar over optimizer steps
and ends with a summary; the script is a plain DeepSpeed user script, so it also runs
unchanged on upstream DeepSpeed. ds_config.json sets ``"torch_adam": true`` so upstream
uses torch.optim.AdamW instead of JIT-compiling its fused CUDA/CPU Adam kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import psutil
import torch
from tqdm import tqdm

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py / data.py live beside us
from data import DEFAULT_CORPUS, TextDataset, decode  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Byte-level GPT on Jane Austen with DeepSpeed")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)),
                   help="set by the launcher")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: the scheduler's total_num_steps, else 300)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default=DEFAULT_CORPUS, help="UTF-8 text file")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--log-interval", type=int, default=25, help="optimizer steps between log lines")
    p.add_argument("--sample-len", type=int, default=200, help="bytes to sample at the end (0: none)")
    p.add_argument("--save-dir", default=None, help="save a checkpoint here when this run stops")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after this many optimizer steps of this run, as if interrupted")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --save-dir")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def configure_threads() -> None:
    """One intra-op thread per rank when the ranks share the CPU.

    torch defaults every process to one thread per core. Two ranks on two cores would then
    run four busy threads on two cores: the OpenMP workers spin and get descheduled
    mid-GEMM, and each step ends up slower than with one thread per rank.
    """
    if torch.cuda.is_available():
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))


def resolve_config(args: argparse.Namespace) -> dict | None:
    """Return a patched config dict when ``--steps`` disagrees with the scheduler, else None.

    The LR schedule must end where training ends. Upstream refuses a config both in
    ``args.deepspeed_config`` and in ``config=``, so a patched dict replaces the file.
    """
    path = args.deepspeed_config
    cfg = {}
    if path:
        with open(path) as f:
            cfg = json.load(f)
    sched = cfg.get("scheduler", {}).get("params", {})
    total = sched.get("total_num_steps")
    if args.steps is None:
        args.steps = int(total) if total else 300
        return None
    if total is None or int(total) == args.steps:
        return None
    sched["total_num_steps"] = args.steps
    if "warmup_num_steps" in sched:  # the warmup has to fit inside a shortened run
        sched["warmup_num_steps"] = min(int(sched["warmup_num_steps"]), max(1, args.steps // 10))
    args.deepspeed_config = None
    return cfg


def memory_mb(device: torch.device) -> tuple[float, float]:
    """(current, peak) memory of this rank in MB: CUDA allocator on GPU, process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20
    rss = psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return rss, peak


def gather(obj):
    """Every rank's ``obj`` as a list indexed by rank (a collective: all ranks must call it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def log_progress(engine, bar, step: int, losses: list[float], window_tokens: int, window_s: float) -> None:
    now, peak = memory_mb(engine.device)
    # RSS now on CPU; on CUDA the allocator's high-water mark is the number that matters.
    stats = gather((sum(losses) / max(len(losses), 1), peak if engine.device.type == "cuda" else now))
    if bar is None:
        return
    loss = sum(s[0] for s in stats) / len(stats)
    mem = "/".join(f"{s[1]:.0f}" for s in stats)
    lr = engine.get_lr()[0]
    tok_s = window_tokens / max(window_s, 1e-9)
    bar.set_postfix_str(f"loss={loss:.3f} lr={lr:.2e} tok/s={tok_s:,.0f} mem_MB={mem}")
    bar.write(f"step {step:>5}  loss {loss:.4f}  lr {lr:.3e}  "
              f"{tok_s:9,.0f} tok/s  mem/rank MB [{mem}]")


def train(args: argparse.Namespace, engine, loader) -> tuple[list[float], float]:
    """Run ``args.steps`` optimizer steps; return this rank's per-step losses and the wall time."""
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_micro_batch_size_per_gpu() * gas * args.block_size * dist.get_world_size()
    bar = None
    if dist.get_rank() == 0:
        # stdout, not tqdm's default stderr: the launcher pipes each rank's stderr (so it is
        # never a TTY) but leaves stdout inherited. Captured to a file, redraw rarely.
        tty = sys.stdout.isatty()
        bar = tqdm(total=args.steps, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True,
                   mininterval=0.5 if tty else 15.0)
    step_losses, micro_losses, window = [], [], []
    start = engine.global_steps  # > 0 after a resume
    if bar is not None:
        bar.update(start)
    stop = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    batches = iter(deepspeed.utils.RepeatingLoader(loader))
    for _ in range(start * gas):  # skip the batches the checkpointed run already consumed
        next(batches)
    t0 = t_win = time.perf_counter()
    for x, y in batches:
        if start + len(step_losses) >= stop:
            break
        x, y = x.to(engine.device), y.to(engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()  # ask before step() advances the count
        engine.step()
        micro_losses.append(loss.item())
        if not boundary:
            continue
        step_losses.append(sum(micro_losses) / len(micro_losses))
        window.append(step_losses[-1])
        micro_losses = []
        if bar is not None:
            bar.update(1)
        done = start + len(step_losses)
        if done % args.log_interval == 0 or done == stop:
            now = time.perf_counter()
            log_progress(engine, bar, done, window, len(window) * tokens_per_step, now - t_win)
            window, t_win = [], now
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return step_losses, elapsed


def summarize(args, engine, step_losses: list[float], elapsed: float) -> None:
    all_losses = gather(step_losses)
    peaks = gather(memory_mb(engine.device)[1])
    if dist.get_rank() != 0:
        return
    # Mean over ranks, then over the first/last k steps: one noisy batch should not decide it.
    per_step = [sum(r[i] for r in all_losses) / len(all_losses) for i in range(len(step_losses))]
    k = max(1, min(10, len(per_step) // 4))
    first, last = sum(per_step[:k]) / k, sum(per_step[-k:]) / k
    tokens = (len(per_step) * engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
              * args.block_size * dist.get_world_size())
    kind = "CUDA max allocated" if engine.device.type == "cuda" else "peak RSS"
    print("\n=== summary ===")
    print(f"world size        : {dist.get_world_size()} ({engine.device.type}, "
          f"{torch.get_num_threads()} thread(s)/rank)")
    print(f"optimizer steps   : {len(per_step)} (micro batch {engine.train_micro_batch_size_per_gpu()}, "
          f"grad accumulation {engine.gradient_accumulation_steps()}, block {args.block_size})")
    print(f"loss first {k:>2} avg : {first:.4f}")
    print(f"loss last  {k:>2} avg : {last:.4f}")
    print(f"total time        : {elapsed:.1f} s")
    print(f"throughput        : {tokens / elapsed:,.0f} tokens/s")
    print(f"{kind:<18}: " + ", ".join(f"rank {r} {m:.0f} MB" for r, m in enumerate(peaks)))
    if args.sample_len > 0:
        model = engine.module
        model.eval()
        prompt = torch.tensor([list(b"It is a truth ")], dtype=torch.long, device=engine.device)
        out = model.generate(prompt, args.sample_len, temperature=0.8)
        print("sample            :\n" + decode(out[0].tolist()))


def main() -> None:
    args = parse_args()
    configure_threads()
    deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")
    config = resolve_config(args)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg)
    dataset = TextDataset(args.data, block_size=args.block_size)
    if dist.get_rank() == 0:
        print(f"model: {cfg.to_dict()}  params: {model.num_parameters():,}  "
              f"windows: {len(dataset):,} x {args.block_size} bytes")
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=config)
    if args.resume:
        path, _ = engine.load_checkpoint(args.save_dir)
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {engine.global_steps}" if path else
                  f"nothing to resume in {args.save_dir}: starting from scratch")
    step_losses, elapsed = train(args, engine, loader)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)  # every rank: each saves its optimizer partition
        if dist.get_rank() == 0:
            print(f"saved checkpoint {args.save_dir}/global_step{engine.global_steps}")
    summarize(args, engine, step_losses, elapsed)


if __name__ == "__main__":
    main()
