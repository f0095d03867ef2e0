"""Time DeepSpeedCPUAdam against torch.optim.AdamW(foreach=True) on CPU parameters.

Run: ``.venv/bin/python benchmarks/bench_cpu_adam.py [--numel 20000000] [--steps 10]``.
Prints the median step time of each (plus torch's fused CPU AdamW for context) and the
ratio foreach / DeepSpeedCPUAdam (> 1 means DeepSpeedCPUAdam is faster).
The parameters are split into a few tensors of different sizes, like a small transformer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam


def make_params(numel: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``numel`` fp32 parameters in tensors of mixed sizes, each with a random gradient."""
    gen = torch.Generator().manual_seed(seed)
    shares = [0.4, 0.3, 0.2, 0.05, 0.04, 0.01]
    params = []
    for share in shares:
        p = torch.nn.Parameter(torch.randn(max(1, int(numel * share)), generator=gen))
        p.grad = torch.randn(p.shape, generator=gen)
        params.append(p)
    return params


def median_step_seconds(optimizer: torch.optim.Optimizer, steps: int, warmup: int = 2) -> float:
    """Median wall time of ``optimizer.step()`` over ``steps`` timed steps."""
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    candidates = {
        "DeepSpeedCPUAdam": lambda: DeepSpeedCPUAdam(make_params(args.numel), **hp),
        "torch.optim.AdamW(foreach=True)": lambda: torch.optim.AdamW(make_params(args.numel), foreach=True, **hp),
        "torch.optim.AdamW(fused=True)": lambda: torch.optim.AdamW(make_params(args.numel), fused=True, **hp),
    }
    times = {}
    for name, build in candidates.items():  # one optimizer alive at a time, so memory does not pile up
        times[name] = median_step_seconds(build(), args.steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel / 1e6:.1f}M fp32 params")
    for name, seconds in times.items():
        print(f"{name:34s} median step {seconds * 1e3:8.2f} ms")
    ratio = times["torch.optim.AdamW(foreach=True)"] / times["DeepSpeedCPUAdam"]
    print(f"speed-up of DeepSpeedCPUAdam over AdamW(foreach=True): {ratio:.2f}x")

if __name__ == "__main__":
    main()
