"""What a change of layout costs at load: time, CPU seconds and peak memory of `load_checkpoint` in the
loading process, ours vs DeepSpeed 0.19.8.

    python3 benchmarks/bench_checkpoint_layout.py --layers 8 --width 1024 --repeats 3

One model (a stack of `--layers` Linear(width, width) + ReLU, fp32, torch AdamW, ZeRO-2), trained 2 steps
and saved by each implementation's own launcher on 2 ranks (DP 2) and on 1 rank (DP 1). Then, each in a
fresh 1-rank job (the loading process measures itself):

* ours, same layout: the DP 1 checkpoint loaded at DP 1;
* ours, layout change: the DP 2 checkpoint loaded at DP 1 by plain `load_checkpoint` (no conversion);
* ours / DeepSpeed, universal: `ds_to_universal` of the DP 2 checkpoint (its own converter, a separate
  process: wall, CPU s, peak RSS from wait4), then `load_universal` at DP 1;
* DeepSpeed, same layout: its DP 1 checkpoint at DP 1 (DeepSpeed 0.19.8 does not load a ZeRO-2 checkpoint
  at another DP size without the universal step).

Per load: wall and CPU seconds (process time, every thread) of the call, and the peak RSS during it above
the RSS before it (`/proc/self/clear_refs` resets the high-water mark; VmHWM read after). The median over
`--repeats` fresh jobs. Files come from the page cache (just written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_VENV = os.environ.get("DS_VENV", "/tmp/ds-venv")
OURS_VENV = os.environ.get("OURS_VENV", os.path.join(ROOT, ".venv") if os.path.isdir(os.path.join(ROOT, ".venv"))
                           else "/work/main/.venv")


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def worker(args) -> None:
    import torch
    import deepspeed

    torch.set_num_threads(1)
    ours = os.path.abspath(deepspeed.__file__).startswith(ROOT + os.sep)
    if ours != (args.impl == "ours"):
        raise SystemExit(f"{args.impl} worker imported {deepspeed.__file__}")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": args.phase == "universal"}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(2, args.width, generator=torch.Generator().manual_seed(engine.global_rank))
    if args.phase == "save":
        for _ in range(2):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        # DeepSpeed's converter requires this client state (AutoTP and Megatron attach it; a plain model does not)
        engine.save_checkpoint(args.dir, tag=args.tag, client_state={"universal_checkpoint_info": {}})
        return
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current RSS
    wall, cpu = time.perf_counter(), time.process_time()
    engine.load_checkpoint(args.dir, tag=args.tag)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _rss_kib("VmHWM")
    loss = float(engine(x).pow(2).mean().detach())
    with open(args.out, "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "peak_mib": (peak - before) / 1024, "loss": loss}, f)


def _env(impl: str, work: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=os.path.join(work, "ext"))
    if impl == "ours":
        env["PYTHONPATH"] = ROOT
    return env


def _venv(impl: str) -> str:
    return OURS_VENV if impl == "ours" else DS_VENV


def job(args, impl: str, ranks: int, phase: str, ckpt: str, tag: str, work: str) -> dict | None:
    out = os.path.join(work, f"{impl}_{phase}_{ranks}.json")
    cmd = [os.path.join(_venv(impl), "bin", "deepspeed"), "--num_gpus", str(ranks), os.path.abspath(__file__),
           "--worker", "--impl", impl, "--phase", phase, "--dir", ckpt, "--tag", tag, "--out", out,
           "--layers", str(args.layers), "--width", str(args.width)]
    with open(os.path.join(work, "log.txt"), "a") as log:
        rc = subprocess.call(cmd, env=_env(impl, work), cwd=work, stdout=log, stderr=subprocess.STDOUT)
    for name in os.listdir("/dev/shm"):
        if name.startswith("deepspeed_allreduce_buffer_"):
            os.remove(os.path.join("/dev/shm", name))
    if rc != 0:
        raise SystemExit(f"{impl} {phase} on {ranks} rank(s) failed (rc {rc}); see {work}/log.txt")
    if phase == "save":
        return None
    with open(out) as f:
        return json.load(f)


def convert(impl: str, src: str, dst: str, work: str) -> dict:
    cmd = [os.path.join(_venv(impl), "bin", "python"), "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", src, "--output_folder", dst]
    wall = time.perf_counter()
    with open(os.path.join(work, "log.txt"), "a") as log:
        proc = subprocess.Popen(cmd, env=_env(impl, work), cwd=work, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{impl} ds_to_universal failed; see {work}/log.txt")
    return {"wall": time.perf_counter() - wall, "cpu": usage.ru_utime + usage.ru_stime,
            "peak_mib": usage.ru_maxrss / 1024}


def driver(args) -> None:
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        work = tempfile.mkdtemp(prefix="bench_ckpt_layout_")
        if True:   # kept on failure (its log.txt); removed after a complete repeat
            for impl in args.impls.split(","):
                for ranks in (2, 1):
                    job(args, impl, ranks, "save", os.path.join(work, f"{impl}_dp{ranks}"), "t", work)
                if impl == "ours":
                    rows.setdefault("ours: same layout (DP 1 -> 1)", []).append(
                        job(args, impl, 1, "plain", os.path.join(work, "ours_dp1"), "t", work))
                    rows.setdefault("ours: DP 2 -> 1, plain load_checkpoint", []).append(
                        job(args, impl, 1, "plain", os.path.join(work, "ours_dp2"), "t", work))
                else:
                    rows.setdefault("DeepSpeed 0.19.8: same layout (DP 1 -> 1)", []).append(
                        job(args, impl, 1, "plain", os.path.join(work, "deepspeed_dp1"), "t", work))
                src = os.path.join(work, f"{impl}_dp2", "t")
                conv = convert(impl, src, os.path.join(work, f"{impl}_dp2", "t_universal"), work)
                load = job(args, impl, 1, "universal", os.path.join(work, f"{impl}_dp2"), "t_universal", work)
                label = "ours" if impl == "ours" else "DeepSpeed 0.19.8"
                rows.setdefault(f"{label}: DP 2 -> 1, ds_to_universal", []).append(conv)
                rows.setdefault(f"{label}: DP 2 -> 1, load_universal", []).append(load)
        shutil.rmtree(work, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {params:,} parameters "
          f"({params * 16 / 2**20:.0f} MiB of fp32 weights + masters' Adam state); median of {args.repeats}")
    print("| load | wall s | CPU s | peak RSS above start, MiB | loss after load |")
    print("|---|---|---|---|---|")
    for label, values in rows.items():
        med = {k: statistics.median(v[k] for v in values) for k in ("wall", "cpu", "peak_mib")}
        loss = f"{values[0]['loss']:.6f}" if "loss" in values[0] else "-"
        print(f"| {label} | {med['wall']:.3f} | {med['cpu']:.3f} | {med['peak_mib']:.0f} | {loss} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--impl", default="ours")
    parser.add_argument("--impls", default="ours,deepspeed")
    parser.add_argument("--phase", default="save")
    parser.add_argument("--dir", default="")
    parser.add_argument("--tag", default="t")
    parser.add_argument("--out", default="")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
