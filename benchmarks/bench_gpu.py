"""One GPU, bf16, the same GPT and the same tokens: plain PyTorch vs our engine vs DeepSpeed 0.19.8.

    python benchmarks/bench_gpu.py                       # on a CUDA machine (tools/gpu/check.sh runs it)
    python benchmarks/bench_gpu.py --dry-run             # tiny model, CPU allowed, seconds: the plumbing
    python benchmarks/bench_gpu.py --sizes small --variants torch,zero2,ds-zero2 --json /tmp/b.json

Variants: `torch` (autocast bf16 + fused AdamW, fp32 weights), `zero0`..`zero3` (ours, bf16),
`offload` (ours, ZeRO-2 with offload_optimizer cpu), `ds-zero0`..`ds-zero3` and `ds-offload`
(DeepSpeed 0.19.8 at the same settings). Sizes: `small` (GPT-2 small: 12 layers, width 768,
vocab 50304, 124M parameters) and `medium` (GPT-2 medium: 24 layers, width 1024, 350M).

Each implementation family runs in its own subprocess, so our `deepspeed` and DeepSpeed's never
meet in one process; DeepSpeed's runs with PYTHONPATH=$DS_GPU_CHECK_DS_PATH (--ds-path; the
folders tools/gpu/install_wheels.py filled) from a working directory outside the repository.
DeepSpeed's FusedAdam is a CUDA op JIT-built with nvcc; tools/gpu/ds_build.py builds it (and the
C++ CPU Adam `ds-offload` needs) ahead of the benchmark and reports in `--ds-build`
($DS_GPU_CHECK_DS_BUILD). `--ds-fused-adam auto` (default): DeepSpeed's ZeRO 0-3 rows use
FusedAdam where that report says it was built (or, with no report, where nvcc exists: then
the first DeepSpeed row's warmup JIT-builds it), else `torch_adam: true` (torch's AdamW), and
each row's label says which and why; `ds-offload` is reported skipped when the report says its
CPU Adam was not built. A variant that crashes or runs out of time is reported as such and the
next one starts in a fresh process; `--budget` bounds the total.

Reported per variant, each measured `--repeats` times (default 2, back to back in one process
after one warmup, each repeat's own median): tokens/s (min-max over the repeats), median step
time of each repeat, median optimizer step time (the part of the step after backward: for
`offload`/`ds-offload` the CPU Adam), MFU of the best repeat against the device's dense bf16
peak (H100/H200 SXM: 989 TFLOPS; 6N + 12·L·d·T FLOPs per token), peak device memory
(torch.cuda.max_memory_allocated, reset before each variant).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = {"small": dict(n_layer=12, n_head=12, n_embd=768), "medium": dict(n_layer=24, n_head=16, n_embd=1024),
         "tiny": dict(n_layer=2, n_head=2, n_embd=64)}
OURS = ("zero0", "zero1", "zero2", "zero3", "offload")
DS = tuple(f"ds-{v}" for v in OURS)
DEFAULT_VARIANTS = {"small": ("torch",) + OURS + DS, "medium": ("torch", "zero2", "zero3", "ds-zero2", "ds-zero3")}
# Dense bf16 tensor-core peak (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def ds_config(variant: str, micro_batch: int, fused_adam: bool) -> dict:
    stage = 2 if variant.endswith("offload") else int(variant[-1])
    params = {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    if variant.startswith("ds-") and not variant.endswith("offload") and not fused_adam:
        params["torch_adam"] = True
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": {"stage": stage}}
    if variant.endswith("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


# ----------------------------------------------------------------------------------------- worker
def _load_model_module():
    """examples/gpt/model.py by path: the repository root never goes on sys.path (it holds our
    `deepspeed`, which must not shadow DeepSpeed's in the ds- worker)."""
    spec = importlib.util.spec_from_file_location("bench_gpt_model", ROOT / "examples" / "gpt" / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _measure(run_step, device, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_s, opt_s = [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        t1 = run_step(sync)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t2 - t0)
            opt_s.append(t2 - t1)
    return step_s, opt_s


def run_variant(args, variant: str, mod, device) -> dict:
    import torch

    cfg = mod.GPTConfig(vocab_size=args.vocab, block_size=args.seq, dropout=0.0, **SIZES[args.size])
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (args.warmup + args.steps * args.repeats, args.batch, args.seq + 1),
                           generator=gen)
    torch.manual_seed(0)
    model = mod.GPT(cfg)
    n_params = model.num_parameters(exclude_embeddings=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    it = iter(tokens)
    notes = []
    if variant == "torch":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

        def run_step(sync):
            batch = next(it).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            sync()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return t1
        engine = None
    else:
        import deepspeed

        ours = Path(deepspeed.__file__).resolve().is_relative_to(ROOT)
        if ours == variant.startswith("ds-"):   # the two packages must not be mixed up
            raise RuntimeError(f"variant {variant} imported deepspeed {deepspeed.__version__} "
                               f"from {deepspeed.__file__}")
        config = ds_config(variant, args.batch, args.ds_fused_adam == "yes")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        notes.append(f"optimizer {type(getattr(engine.optimizer, 'optimizer', engine.optimizer)).__name__}")

        def run_step(sync):
            batch = next(it).to(engine.device, non_blocking=True)
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            sync()
            t1 = time.perf_counter()
            engine.step()
            return t1
    reps = [_measure(run_step, device, args.warmup if i == 0 else 0, args.steps) for i in range(args.repeats)]
    step_reps = [statistics.median(step_s) for step_s, _ in reps]
    step = min(step_reps)
    tok_s = args.batch * args.seq / step
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * args.seq
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = peak_flops(name)
    row = {"size": args.size, "variant": variant, "ok": True, "params_m": round(n_params / 1e6, 1),
           "tokens_per_s": round(tok_s), "step_ms": round(step * 1e3, 2),
           "tokens_per_s_reps": [round(args.batch * args.seq / s) for s in step_reps],
           "step_ms_reps": [round(s * 1e3, 2) for s in step_reps],
           "opt_ms_reps": [round(statistics.median(opt_s) * 1e3, 2) for _, opt_s in reps],
           "opt_ms": round(min(statistics.median(opt_s) for _, opt_s in reps) * 1e3, 2),
           "mfu": round(tok_s * flops_per_token / peak, 4) if peak else None, "device": name,
           "peak_mem_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if device.type == "cuda"
           else None, "notes": "; ".join(notes), "impl_file": sys.modules.get("deepspeed").__file__
           if "deepspeed" in sys.modules else None}
    if engine is not None:
        engine.destroy()
    return row


def worker(args) -> int:
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    mod = _load_model_module()
    with open(args.out, "a") as out:
        for variant in args.variants.split(","):
            out.write(json.dumps({"started": variant}) + "\n")
            out.flush()
            try:
                row = run_variant(args, variant, mod, device)
            except Exception as e:   # report it and go on with the next variant
                import traceback

                traceback.print_exc()
                row = {"size": args.size, "variant": variant, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
            out.write(json.dumps(row) + "\n")
            out.flush()
            import gc

            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


# ----------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args, size: str, variants: list[str], out: str, timeout: float, logf) -> None:
    """Run `variants` in one worker process; on a crash or timeout, restart after the culprit."""
    ds = variants[0].startswith("ds-")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = args.ds_path if ds else f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "bench_gpu_torch_extensions"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--size", size, "--variants",
           ",".join(variants), "--out", out, "--batch", str(args.batch), "--seq", str(args.seq), "--vocab",
           str(args.vocab), "--warmup", str(args.warmup), "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--ds-fused-adam", args.ds_fused_adam]
    with tempfile.TemporaryDirectory() as cwd:   # outside the repo: '' on sys.path must not find our deepspeed
        try:
            subprocess.run(cmd, env=env, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


def _rows(out: str) -> tuple[list[dict], str | None]:
    rows, started = [], None
    if os.path.exists(out):
        for line in open(out):
            rec = json.loads(line)
            if "started" in rec:
                started = rec["started"]
            else:
                rows.append(rec)
                started = None
    return rows, started


def run_family(args, size: str, variants: list[str], deadline: float, logf) -> list[dict]:
    rows: list[dict] = []
    todo = list(variants)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        while todo:
            left = deadline - time.monotonic()
            if left < 5:
                rows += [{"size": size, "variant": v, "ok": False, "error": "skipped: --budget spent"} for v in todo]
                break
            _spawn(args, size, todo, out, left, logf)
            before = len(rows)
            rows, hung = _rows(out)
            done = {r["variant"] for r in rows}
            if hung is None and len(rows) == before:   # died before its first variant: do not loop
                rows += [{"size": size, "variant": v, "ok": False, "error": "worker failed to start (see log)"}
                         for v in todo]
                break
            if hung is not None:   # the process died or ran out of time inside `hung`
                rows.append({"size": size, "variant": hung, "ok": False,
                             "error": "timeout" if deadline - time.monotonic() < 5 else "process died (see log)"})
                with open(out, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                done.add(hung)
            todo = [v for v in todo if v not in done]
    return rows


def markdown(rows: list[dict], device: str, notes: list[str]) -> str:
    lines = [f"bench_gpu on {device}", "",
             "| size | variant | tokens/s (min-max) | step ms (each repeat) | optimizer ms (each repeat) | MFU (best) "
             "| peak GiB | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("ok"):
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            mem = r["peak_mem_gib"] if r.get("peak_mem_gib") is not None else "n/a"
            toks = r.get("tokens_per_s_reps") or [r["tokens_per_s"]]
            each = lambda k, one: " / ".join(str(v) for v in (r.get(k) or [r[one]]))  # noqa: E731
            lines.append(f"| {r['size']} ({r['params_m']}M) | {r['variant']} | {min(toks)}-{max(toks)} | "
                         f"{each('step_ms_reps', 'step_ms')} | {each('opt_ms_reps', 'opt_ms')} | {mfu} | {mem} | "
                         f"{r.get('notes', '')} |")
        else:
            lines.append(f"| {r['size']} | {r['variant']} | - | - | - | - | - | FAILED: {r.get('error', '')} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def wanted_of(args, size: str, ds_ok: bool, cuda: bool) -> list[str]:
    wanted = args.variants.split(",") if args.variants else list(
        DEFAULT_VARIANTS.get(size, ("torch", "zero0", "zero3", "offload")))
    if not ds_ok or not cuda:   # DeepSpeed on the CPU JIT-builds its shm comm op at init: minutes
        wanted = [v for v in wanted if not v.startswith("ds-")]
    return wanted


def ds_adam_plan(args) -> tuple[str, str, str | None]:
    """DeepSpeed's optimizer for its ZeRO 0-3 rows: ("yes"/"no" FusedAdam, the rows' label, and the
    reason to skip `ds-offload` or None), from --ds-fused-adam and tools/gpu/ds_build.py's report."""
    report = None
    if args.ds_build and os.path.isfile(args.ds_build):
        with open(args.ds_build) as f:
            report = json.load(f)
    skip_offload = None
    if report is not None:
        cpu = report.get("cpu_adam", {})
        if cpu.get("status") != "built":
            skip_offload = (f"skipped: DeepSpeed's CPU Adam was not built by ds-build ({cpu.get('status')}"
                            f"{': ' + cpu['error'][-200:] if cpu.get('error') else ''})")
    if args.ds_fused_adam == "no":
        return "no", "torch_adam (--ds-fused-adam no)", skip_offload
    if args.ds_fused_adam == "yes":
        return "yes", "FusedAdam (--ds-fused-adam yes)", skip_offload
    if report is not None:
        fused = report.get("fused_adam", {})
        status = fused.get("status")
        if status == "built":
            return "yes", f"FusedAdam (built ahead by ds-build in {fused.get('seconds')} s)", skip_offload
        if status == "no nvcc":
            return "no", "torch_adam: no nvcc in the image, so no FusedAdam (unfused)", skip_offload
        if status == "unfinished":
            return "no", "torch_adam: FusedAdam build did not finish within ds-build's limit (unfused)", skip_offload
        return "no", f"torch_adam: FusedAdam build {status} (unfused)", skip_offload
    if shutil.which("nvcc"):
        return "yes", "FusedAdam (JIT-built with nvcc in the first DeepSpeed row's warmup)", skip_offload
    return "no", "torch_adam: no nvcc on this machine, so no FusedAdam (unfused)", skip_offload


def driver(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_gpu: no CUDA device (use --dry-run for the CPU plumbing check)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    sizes = ["tiny"] if args.dry_run else args.sizes.split(",")
    notes = []
    ds_ok = bool(args.ds_path) and all(os.path.isdir(p) for p in args.ds_path.split(os.pathsep) if p)
    if not ds_ok:
        notes.append("DeepSpeed 0.19.8 rows skipped: no --ds-path / DS_GPU_CHECK_DS_PATH with its wheel installed")
    elif not cuda:
        notes.append("DeepSpeed 0.19.8 rows skipped on the CPU (its init JIT-builds a shared-memory comm op: minutes)")
    fused, ds_label, skip_offload = ds_adam_plan(args)
    args.ds_fused_adam = fused   # what the workers get: yes or no
    if ds_ok and cuda:
        notes.append(f"DeepSpeed ZeRO 0-3 rows: {ds_label}")
    deadline = time.monotonic() + args.budget
    rows = []
    log_path = args.log or os.devnull
    plan = []   # (size, variants of one family); DeepSpeed's offload (a C++ JIT build) comes last of all
    with open(log_path, "a") as logf:
        for size in sizes:
            wanted = wanted_of(args, size, ds_ok, cuda)
            plan += [(size, [v for v in wanted if not v.startswith("ds-")]),
                     (size, [v for v in wanted if v.startswith("ds-") and v != "ds-offload"])]
        plan += [(size, ["ds-offload"]) for size in sizes if "ds-offload" in wanted_of(args, size, ds_ok, cuda)]
        for size, family in plan:
            if family == ["ds-offload"] and skip_offload:
                rows.append({"size": size, "variant": "ds-offload", "ok": False, "error": skip_offload})
            elif family:
                rows += run_family(args, size, family, deadline, logf)
    for r in rows:   # every DeepSpeed ZeRO 0-3 row says which optimizer it ran and why
        if r.get("ok") and r["variant"].startswith("ds-zero"):
            r["notes"] = f"{ds_label}; {r.get('notes', '')}"
    text = markdown(rows, device, notes)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dry_run": args.dry_run, "rows": rows, "notes": notes, "markdown": text},
                      f, indent=1)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model, 2 steps, CPU allowed, no DeepSpeed on CPU")
    ap.add_argument("--sizes", default="small,medium", help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--variants", default="", help="comma-separated (default: every variant for small, a subset "
                                                   "for medium)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats of each variant (>= 2 for the check)")
    ap.add_argument("--budget", type=float, default=600, help="seconds for everything; the rest is reported skipped")
    ap.add_argument("--ds-path", default=os.environ.get("DS_GPU_CHECK_DS_PATH", ""),
                    help="PYTHONPATH for DeepSpeed 0.19.8 (default $DS_GPU_CHECK_DS_PATH)")
    ap.add_argument("--ds-fused-adam", choices=("auto", "yes", "no"), default="auto",
                    help="DeepSpeed's FusedAdam for its ZeRO 0-3 rows: auto = where ds-build built it, else where "
                         "nvcc exists")
    ap.add_argument("--ds-build", default=os.environ.get("DS_GPU_CHECK_DS_BUILD", ""),
                    help="tools/gpu/ds_build.py's report (default $DS_GPU_CHECK_DS_BUILD)")
    ap.add_argument("--json", default="")
    ap.add_argument("--log", default="", help="the workers' output (default: discarded)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for s in args.sizes.split(","):
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r}; allowed: {', '.join(SIZES)}")
    unknown = [v for v in args.variants.split(",") if v and v not in ("torch",) + OURS + DS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; allowed: torch, {', '.join(OURS + DS)}")
    if args.dry_run and not args.worker:
        args.batch, args.seq, args.vocab, args.warmup, args.steps = 2, 32, 256, 0, 1   # --repeats kept
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
