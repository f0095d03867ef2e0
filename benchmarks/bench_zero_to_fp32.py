"""Peak memory and time of ZeRO checkpoint consolidation: our zero_to_fp32 vs DeepSpeed 0.19.8's.

    python benchmarks/bench_zero_to_fp32.py                    # --size-gb 2, 2 ranks, both implementations
    python benchmarks/bench_zero_to_fp32.py --size-gb 0.2 --impls ours
    python benchmarks/bench_zero_to_fp32.py --keep --workdir /tmp/z2f_bench

1. Writes a synthetic bf16 ZeRO stage-2 checkpoint in DeepSpeed 0.19.8's layout into a temporary
   folder: ``--world`` ranks (default 2), a GPT-like parameter list (a 50304 x d embedding, blocks
   of attention/MLP matrices, layer norms, an odd-sized bias so the group needs end padding, and
   a tied ``lm_head.weight`` in ``shared_params``), sized so that the optimizer files (fp32 master
   partitions plus Adam's exp_avg and exp_avg_sq) total ``--size-gb`` GB; the model states file
   holds the bf16 module weights as DeepSpeed's does.
2. Runs each implementation's command line once, each in a fresh process, output
   ``pytorch_model.bin`` (default ``--max_shard_size 5GB``: one file):

   * ``ours``      ``<repo>/.venv/bin/python deepspeed/utils/zero_to_fp32.py CKPT OUT``
   * ``deepspeed`` ``$DS_VENV/bin/python -m deepspeed.utils.zero_to_fp32 CKPT OUT`` (PYTHONPATH
                   removed, run from the work folder so ``-m`` cannot pick up this repository's
                   package; needs ``huggingface_hub`` in that venv for its sharding).

   and an "import only" baseline for each (the interpreter plus what the script imports), so the
   fixed cost can be told apart from the consolidation itself.
3. Memory: ``ru_maxrss`` of the command (``os.wait4`` in a tiny launcher process, the true peak
   resident set; see ``_LAUNCHER``), and, sampled every ``--interval`` seconds from a thread,
   psutil's RSS and ``/proc/<pid>/status``'s RssAnon (private anonymous memory: tensors, the
   heap) and RssFile (pages of memory-mapped files that were touched: clean page cache the
   kernel can drop at any time; the file-backed part of RSS).
4. Loads both outputs (memory-mapped) and checks they hold the same keys with equal tensors.

Prints a markdown table; ``--json`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS_SCRIPT = os.path.join(ROOT, "deepspeed", "utils", "zero_to_fp32.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0,
                   help="total size of the *_optim_states.pt files (fp32 master + 2 Adam moments), GB")
    p.add_argument("--world", type=int, default=2, help="data-parallel ranks (one optimizer file each)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--impls", default="ours,deepspeed")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--interval", type=float, default=0.02, help="memory sampling period, seconds")
    p.add_argument("--workdir", default=None, help="where to put the checkpoint (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--no-baseline", action="store_true", help="skip the import-only runs")
    p.add_argument("--ours-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- checkpoint


def param_list(n_target: int, d: int):
    """GPT-like (name, shape) list with about n_target elements."""
    vocab = 50304
    params = [("wte.weight", (vocab, d)), ("wpe.weight", (1024, d))]
    total = vocab * d + 1024 * d
    layer = 0
    while True:
        block = [(f"h.{layer}.ln_1.weight", (d, )), (f"h.{layer}.ln_1.bias", (d, )),
                 (f"h.{layer}.attn.c_attn.weight", (3 * d, d)), (f"h.{layer}.attn.c_attn.bias", (3 * d, )),
                 (f"h.{layer}.attn.c_proj.weight", (d, d)), (f"h.{layer}.attn.c_proj.bias", (d, )),
                 (f"h.{layer}.ln_2.weight", (d, )), (f"h.{layer}.ln_2.bias", (d, )),
                 (f"h.{layer}.mlp.c_fc.weight", (4 * d, d)), (f"h.{layer}.mlp.c_fc.bias", (4 * d, )),
                 (f"h.{layer}.mlp.c_proj.weight", (d, 4 * d)), (f"h.{layer}.mlp.c_proj.bias", (d, ))]
        size = sum(math.prod(s) for _, s in block)
        if total + size > n_target and layer > 0:
            break
        params += block
        total += size
        layer += 1
    params += [("ln_f.weight", (d, )), ("ln_f.bias", (d, )), ("odd.bias", (7, ))]  # odd: end padding needed
    return params


def write_checkpoint(ckpt_dir: str, size_gb: float, world: int, d: int):
    """A bf16 ZeRO-2 checkpoint in DeepSpeed 0.19.8's layout (see tests/unit/test_zero_to_fp32.py)."""
    n_target = int(size_gb * 1e9 / 12)  # fp32 master + exp_avg + exp_avg_sq
    params = param_list(n_target, d)
    used = sum(math.prod(s) for _, s in params)
    align = 2 * world
    total = math.ceil(used / align) * align
    part = total // world
    tag = "global_step100"
    tdir = os.path.join(ckpt_dir, tag)
    os.makedirs(tdir, exist_ok=True)
    for r in range(world):
        keep = max(0, min(part, used - r * part))
        g = torch.Generator().manual_seed(1000 + r)
        master = torch.randn(keep, generator=g)
        osd = dict(
            loss_scaler={"cur_scale": 1.0, "dynamic": False}, dynamic_loss_scale=False, overflow=False, clip_grad=1.0,
            base_optimizer_state=[{"exp_avg": torch.zeros(keep), "exp_avg_sq": torch.zeros(keep), "step": 100}],
            single_partition_of_fp32_groups=[master], zero_stage=2, group_paddings=[part - keep],
            param_alignment_paddings=[[0] * len(params)], partition_count=[world], ds_version="0.19.8")
        torch.save(dict(optimizer_state_dict=osd, ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
                        ds_version="0.19.8"),
                   os.path.join(tdir, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        del master, osd
    module = OrderedDict((name, torch.zeros(shape, dtype=torch.bfloat16)) for name, shape in params)
    module["lm_head.weight"] = module["wte.weight"]
    model_state = dict(module=module, buffer_names=[], optimizer=None,
                       param_shapes=[OrderedDict((name, torch.Size(shape)) for name, shape in params)],
                       frozen_param_shapes=OrderedDict(), shared_params={"lm_head.weight": "wte.weight"},
                       frozen_param_fragments=OrderedDict(), lr_scheduler=None, global_steps=100, dp_world_size=world,
                       mp_world_size=1, ds_version="0.19.8")
    torch.save(model_state, os.path.join(tdir, "mp_rank_00_model_states.pt"))
    del module, model_state
    with open(os.path.join(ckpt_dir, "latest"), "w") as f:
        f.write(tag)
    largest = max(math.prod(s) for _, s in params)
    return dict(params=len(params), elements=used, largest_param_bytes=largest * 4,
                optim_bytes=sum(os.path.getsize(os.path.join(tdir, n)) for n in os.listdir(tdir)
                                if n.endswith("_optim_states.pt")),
                model_states_bytes=os.path.getsize(os.path.join(tdir, "mp_rank_00_model_states.pt")))


# ----------------------------------------------------------------------------- measuring


def _status_kb(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


# ru_maxrss of a process forked from this (large) one and exec'ed includes this process' own RSS
# at fork time (Linux records the old address space's high-water mark at exec). So the command is
# started by a tiny stdlib-only python that forks it and reports the child's os.wait4 rusage.
_LAUNCHER = r"""
import json, os, subprocess, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
p = subprocess.Popen(cmd)
_, status, ru = os.wait4(p.pid, 0)
wall = time.perf_counter() - t0
with open(out, "w") as f:
    json.dump({"ru_maxrss_kb": ru.ru_maxrss, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
               "rc": os.waitstatus_to_exitcode(status)}, f)
"""


def measure(cmd, cwd, env, interval, log_path):
    import psutil

    peaks = {"rss": 0, "VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    report = log_path + ".json"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen([sys.executable, "-I", "-c", _LAUNCHER, report] + cmd, cwd=cwd, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample():
            target = None
            while not done.is_set():
                try:
                    if target is None:
                        kids = psutil.Process(launcher.pid).children()
                        target = kids[0] if kids else None
                    if target is not None:
                        peaks["rss"] = max(peaks["rss"], target.memory_info().rss // 1024)
                        st = _status_kb(target.pid)
                        for k in ("VmHWM", "RssAnon", "RssFile"):
                            peaks[k] = max(peaks[k], st.get(k, 0))
                except psutil.Error:
                    pass
                done.wait(interval)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        launcher.wait()
        done.set()
        th.join()
    with open(report) as f:
        rep = json.load(f)
    return dict(rc=rep["rc"], wall_s=rep["wall_s"], cpu_s=rep["cpu_s"], ru_maxrss_mb=rep["ru_maxrss_kb"] / 1024,
                rss_mb=peaks["rss"] / 1024, hwm_mb=peaks["VmHWM"] / 1024, anon_mb=peaks["RssAnon"] / 1024,
                file_mb=peaks["RssFile"] / 1024)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) if os.path.isdir(path) else 0


def load_output(out_dir):
    index = os.path.join(out_dir, "pytorch_model.bin.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["pytorch_model.bin"]
    sd = {}
    for f in files:
        sd.update(torch.load(os.path.join(out_dir, f), map_location="cpu", mmap=True, weights_only=True))
    return sd


def compare(a_dir, b_dir):
    a, b = load_output(a_dir), load_output(b_dir)
    if sorted(a) != sorted(b):
        return f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            return f"tensor {k} differs"
    return "equal"


def main(argv=None):
    args = parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    work = args.workdir or tempfile.mkdtemp(prefix="bench_z2f_", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "runs": []}
    try:
        t0 = time.perf_counter()
        info = write_checkpoint(ckpt, args.size_gb, args.world, args.d_model)
        info["write_s"] = time.perf_counter() - t0
        results["checkpoint"] = info
        print(f"checkpoint: {info['params']} params, {info['elements'] / 1e6:.1f}M elements "
              f"({info['elements'] * 4 / 1e6:.0f} MB fp32), largest param {info['largest_param_bytes'] / 1e6:.0f} MB, "
              f"optimizer files {info['optim_bytes'] / 1e9:.2f} GB, model states {info['model_states_bytes'] / 1e6:.0f} MB, "
              f"world {args.world}, written in {info['write_s']:.0f}s", flush=True)
        base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        ds_python = os.path.join(args.ds_venv, "bin", "python")
        commands = {
            "ours": ([args.ours_python, OURS_SCRIPT, ckpt, "OUT", "--max_shard_size", args.max_shard_size],
                     [args.ours_python, "-c", "import torch, tqdm, numpy"]),
            "deepspeed": ([ds_python, "-m", "deepspeed.utils.zero_to_fp32", ckpt, "OUT", "--max_shard_size",
                           args.max_shard_size], [ds_python, "-c", "import deepspeed.utils.zero_to_fp32"]),
        }
        outs = {}
        for impl in impls:
            cmd, baseline = commands[impl]
            if not args.no_baseline:
                r = measure(baseline, work, base_env, args.interval, os.path.join(work, f"{impl}_import.log"))
                r.update(impl=f"{impl} (import only)", out_bytes=0)
                results["runs"].append(r)
                print(json.dumps(r), flush=True)
            out = os.path.join(work, f"out_{impl}")
            shutil.rmtree(out, ignore_errors=True)
            cmd = [out if c == "OUT" else c for c in cmd]
            r = measure(cmd, work, base_env, args.interval, os.path.join(work, f"{impl}.log"))
            r.update(impl=impl, out_bytes=dir_bytes(out), cmd=" ".join(cmd))
            if r["rc"] != 0:
                print(open(os.path.join(work, f"{impl}.log")).read()[-3000:], file=sys.stderr)
            results["runs"].append(r)
            outs[impl] = out
            print(json.dumps(r), flush=True)
        if len(outs) == 2:
            results["outputs"] = compare(*outs.values())
        print()
        print("| implementation | wall s | CPU s (user+sys) | peak RSS MB (ru_maxrss) | peak RSS MB (psutil, sampled) | "
              "peak RssAnon MB (sampled) | peak RssFile MB (sampled) | output bytes |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results["runs"]:
            print(f"| {r['impl']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['ru_maxrss_mb']:.0f} | {r['rss_mb']:.0f} | "
                  f"{r['anon_mb']:.0f} | {r['file_mb']:.0f} | {r['out_bytes']:,} |")
        if "outputs" in results:
            print(f"\noutputs of {' and '.join(outs)}: {results['outputs']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        failed = [r["impl"] for r in results["runs"] if r["rc"] != 0]
        return 1 if failed or results.get("outputs", "equal") != "equal" else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
