"""Optimizer step with the state on NVMe vs in host memory (CPU offload), ZeRO-3, one rank, fp32.

    python benchmarks/bench_nvme_step.py --layers 8 --width 2048 --nvme_path /tmp/ds_nvme_step

A stack of Linear(width, width) layers (one ZeRO-3 gather unit each, so the swap has `layers`
sub-groups to pipeline). Reports the median step time (`engine.step()` only) of each run, the time the
NVMe step waited on I/O (`engine.optimizer.swapper.wait_s`), the bytes on disk, and checks the losses
are equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run(device: str, args: argparse.Namespace) -> dict:
    import torch

    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": device, "nvme_path": args.nvme_path}},
              "aio": {"block_size": 1 << 20, "intra_op_parallelism": args.threads},
              "checkpoint": {"async_save": args.async_save}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    times, waits, losses = [], [], []
    for _ in range(args.steps):
        x = torch.randn(4, args.width, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        swapper = engine.optimizer.swapper
        waits.append(swapper.wait_s if swapper is not None else 0.0)
    on_disk = engine.optimizer.swapper.nbytes_on_disk() if device == "nvme" else 0
    step = lambda: (engine.backward(engine(torch.randn(4, args.width, generator=g)).pow(2).mean()),  # noqa: E731
                    engine.step())
    ckpt = _checkpoint(engine, os.path.join(args.nvme_path, f"ckpt_{device}"), step) if args.checkpoint else {}
    engine.destroy()
    return {"step_s": statistics.median(times[1:]), "wait_s": statistics.median(waits[1:]), "losses": losses,
            "on_disk": on_disk, **ckpt}


def _checkpoint(engine, path: str, step) -> dict:
    """Save and load times, and (NVMe) the swap buffers' peak in memory during each: one sub-group's
    when they stream ([Note: optimizer state swapping]). With async_save also the training step right
    after the save (the write runs meanwhile) and the wait for the write after it."""
    import shutil

    from deepspeed.utils.rss_peak import peak_anon_rise

    swapper, out = engine.optimizer.swapper, {}
    for what, call in (("save", lambda: engine.save_checkpoint(path, tag="t")),
                       ("load", lambda: engine.load_checkpoint(path, tag="t"))):
        if swapper is not None:
            swapper.peak_resident_bytes = swapper.resident_bytes
        start = time.perf_counter()
        _, out[f"{what}_rise"] = peak_anon_rise(call)   # anonymous memory: what the call really held
        out[f"{what}_s"] = time.perf_counter() - start
        out[f"{what}_peak"] = swapper.peak_resident_bytes if swapper is not None else 0
        if what == "save" and engine._config.model.checkpoint.async_save:
            start = time.perf_counter()
            step()
            out["step_after_save_s"] = time.perf_counter() - start
            start = time.perf_counter()
            engine.wait_for_checkpoint()
            out["wait_s"] = time.perf_counter() - start
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--nvme_path", default="/tmp/ds_nvme_step")
    p.add_argument("--checkpoint", action="store_true", help="also time save/load_checkpoint (and the swap peak)")
    p.add_argument("--async_save", action="store_true", help="with --checkpoint: checkpoint.async_save")
    args = p.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29561"}.items():
        os.environ.setdefault(k, v)
    import deepspeed

    deepspeed.init_distributed("gloo", verbose=False)
    params = args.layers * (args.width * args.width + args.width)
    cpu, nvme = run("cpu", args), run("nvme", args)
    print(f"# ZeRO-3, 1 rank, {params / 1e6:.1f}M params, {args.layers} sub-groups, aio threads {args.threads}")
    print(f"cpu offload step  {cpu['step_s']:.3f} s")
    print(f"nvme offload step {nvme['step_s']:.3f} s ({nvme['step_s'] / cpu['step_s']:.2f}x), waiting on I/O "
          f"{nvme['wait_s']:.3f} s; {nvme['on_disk'] / 1e6:.0f} MB on disk (masters + 2 moments: "
          f"{params * 12 / 1e6:.0f} MB)")
    print(f"losses equal: {cpu['losses'] == nvme['losses']}")
    if args.checkpoint:
        shard = params * 12 / args.layers
        for what in ("save", "load"):
            print(f"{what}_checkpoint: cpu {cpu[what + '_s']:.3f} s, nvme {nvme[what + '_s']:.3f} s; swap buffers in "
                  f"memory at most {nvme[what + '_peak'] / 1e6:.1f} MB (one sub-group: {shard / 1e6:.1f} MB, "
                  f"all: {params * 12 / 1e6:.0f} MB); peak anonymous RSS rise: cpu {cpu[what + '_rise'] / 1e6:.0f} MB, "
                  f"nvme {nvme[what + '_rise'] / 1e6:.0f} MB")
        if args.async_save:
            print(f"async_save: the step right after save_checkpoint cpu {cpu['step_after_save_s']:.3f} s, nvme "
                  f"{nvme['step_after_save_s']:.3f} s; then waiting for the write cpu {cpu['wait_s']:.3f} s, "
                  f"nvme {nvme['wait_s']:.3f} s")


if __name__ == "__main__":
    main()
