"""ZeRO-Infinity on one rank: the NVMe-offload step against the CPU-offload step, and a model whose
states exceed this machine's memory.

    # (a) a size that fits both ways: step time, I/O waits, peak RSS; losses must be equal
    python benchmarks/bench_nvme_offload.py compare --layers 8 --dim 2048 --steps 6 --nvme_path /tmp/nvme_bench
    # (b) one run at scale (model states = 16 B/param: params + fp32 masters + Adam's two moments)
    nice -n 19 python benchmarks/bench_nvme_offload.py run --mode nvme --layers 35 --dim 8192 --steps 3 \
        --nvme_path /work/nvme_bench --max_in_cpu 150000000

Each run is its own process (peak RSS is the process's `ru_maxrss`). The model is a stack of
`dim x dim` Linear layers (one ZeRO-3 unit each) built under `zero.Init(remote_device=...)`, trained
with DeepSpeed's AdamW at ZeRO-3 in fp32 on a fixed batch. `cpu`: offload_param and
offload_optimizer to "cpu"; `nvme`: both to "nvme" under --nvme_path (the run's swap directories are
removed at the end). Reported per run: seconds per step (median after the first), the seconds the
optimizer step waited on its swap files (`optimizer.swapper.wait_s`, last step), the seconds the
parameter swapper waited on reads (per step), bytes on disk, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _config(mode: str, path: str, max_in_cpu: int, micro: int) -> dict:
    zero = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 1, "reduce_bucket_size": 1 << 30}
    if mode == "cpu":
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    else:
        zero.update(offload_param={"device": "nvme", "nvme_path": path, "max_in_cpu": max_in_cpu},
                    offload_optimizer={"device": "nvme", "nvme_path": path})
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": zero, "aio": {"block_size": 1 << 20, "intra_op_parallelism": 4},
            "steps_per_print": 1 << 30}


def run(args: argparse.Namespace) -> dict:
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(args.port)}.items():
        os.environ.setdefault(key, value)
    import torch

    import deepspeed

    torch.manual_seed(0)
    config = _config(args.mode, args.nvme_path, args.max_in_cpu, args.micro)
    start = time.perf_counter()
    with deepspeed.zero.Init(remote_device=args.mode, config_dict_or_path=config):
        model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=config)
    setup_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.micro, args.dim, generator=g)
    target = torch.randn(args.micro, args.dim, generator=g)
    losses, times, opt_wait, param_wait = [], [], [], []
    swapper = getattr(engine._stage3, "swapper", None)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        before = swapper.wait_s if swapper is not None else 0.0
        loss = torch.nn.functional.mse_loss(engine(x), target)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        opt = getattr(engine.optimizer, "swapper", None)
        opt_wait.append(opt.wait_s if opt is not None else 0.0)
        param_wait.append(swapper.wait_s - before if swapper is not None else 0.0)
        print(f"step {len(losses)}: loss {losses[-1]!r} {times[-1]:.2f} s", file=sys.stderr, flush=True)
    on_disk = 0
    if args.mode == "nvme":
        on_disk = swapper.nbytes_on_disk() + engine.optimizer.swapper.nbytes_on_disk()
    engine.destroy()
    steady = times[1:] or times
    return {"mode": args.mode, "params": params, "model_state_GB": params * 16 / 1e9, "setup_s": setup_s,
            "step_s": statistics.median(steady), "step_times": times, "losses": losses,
            "optimizer_io_wait_s": opt_wait[-1], "param_read_wait_s": param_wait[-1], "on_disk_GB": on_disk / 1e9,
            "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "max_in_cpu": args.max_in_cpu if args.mode == "nvme" else None}


def compare(args: argparse.Namespace) -> dict:
    """Both modes in their own processes, the same model and batch."""
    out = {}
    for mode in ("cpu", "nvme"):
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode", mode] + [
            f"--{k}={getattr(args, k)}" for k in ("layers", "dim", "steps", "micro", "nvme_path", "max_in_cpu")]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ}).stdout
        out[mode] = json.loads(text.strip().splitlines()[-1])
    out["nvme_over_cpu"] = out["nvme"]["step_s"] / out["cpu"]["step_s"]
    out["losses_equal"] = out["nvme"]["losses"] == out["cpu"]["losses"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["run", "compare"])
    p.add_argument("--mode", choices=["cpu", "nvme"], default="nvme")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--nvme_path", default="/tmp/nvme_bench")
    p.add_argument("--max_in_cpu", type=int, default=0, help="default: a quarter of the parameters")
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    if not args.max_in_cpu:
        args.max_in_cpu = args.layers * (args.dim * args.dim + args.dim) // 4
    os.makedirs(args.nvme_path, exist_ok=True)
    print(json.dumps(run(args) if args.what == "run" else compare(args)))


if __name__ == "__main__":
    main()
