"""Running one benchmark case in a fresh interpreter: ours (this repository on PYTHONPATH) or DeepSpeed
0.19.8 from its venv (benchmarks/ds_venv.sh), and the counting helpers the side-by-side benchmarks share.

The child runs from a scratch directory outside the repository with PYTHONPATH removed for DeepSpeed (so
`import deepspeed` cannot find this repository's package) and a private TORCH_EXTENSIONS_DIR holding a
copy of the prebuilt shm-comm op (no JIT lock shared with another job); it prints one `RESULT <json>` line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(impl: str, script: str, argv: list[str], ds_venv: str, timeout: float,
              extra_env: dict[str, str] | None = None) -> dict:
    """Run `script argv` with ours ("ours") or DeepSpeed's python; its RESULT json, or {"error": ...}."""
    python = sys.executable if impl == "ours" else os.path.join(ds_venv, "bin", "python")
    work = tempfile.mkdtemp(prefix=f"bench_{impl}_")   # cwd outside the repo: no `deepspeed` from here
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TORCH_EXTENSIONS_DIR=os.path.join(work, "torch_extensions"), **(extra_env or {}))
    if impl == "ours":
        env["PYTHONPATH"] = ROOT
    else:
        prebuilt = os.path.join(ds_venv, "torch_extensions")
        if os.path.isdir(prebuilt):   # a private copy: no JIT lock shared with another job
            shutil.copytree(prebuilt, env["TORCH_EXTENSIONS_DIR"], ignore=shutil.ignore_patterns("lock"))
    proc = subprocess.Popen([python, os.path.abspath(script), *argv], env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: " + " | ".join(output.strip().splitlines()[-6:])}
    return json.loads(lines[-1][len("RESULT "):])


def ds_available(venv: str) -> str | None:
    """"0.19.8" when `venv` imports DeepSpeed 0.19.8, else None."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    probe = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                           text=True, cwd=tempfile.gettempdir(), env={k: v for k, v in os.environ.items()
                                                                       if k != "PYTHONPATH"})
    version = probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout.strip() else ""
    return version if version == "0.19.8" else None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` (and in the optimizers it wraps), each storage once."""
    import torch

    seen, total, opt = set(), 0, optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for per_param in state.values():
                for t in (per_param.values() if isinstance(per_param, dict) else ()):
                    if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                        seen.add(t.untyped_storage().data_ptr())
                        total += t.numel() * t.element_size()
        opt = getattr(opt, "optimizer", None)
    return total


def add_impl_args(parser) -> None:
    """--impls, --ds-venv and --job-timeout, as the side-by-side benchmarks take them."""
    parser.add_argument("--impls", default="ours,ds")
    parser.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    parser.add_argument("--job-timeout", type=float, default=600)


def chosen_impls(args) -> list[str]:
    """The implementations of --impls that can run here (DeepSpeed only where its venv imports it)."""
    impls = [i for i in args.impls.split(",") if i]
    if "ds" in impls and ds_available(args.ds_venv) is None:
        print(f"DeepSpeed 0.19.8 not importable from {args.ds_venv}/bin/python (benchmarks/ds_venv.sh builds it): "
              "ours only")
        impls.remove("ds")
    return impls


def run_case_and_report(target, ranks: int, *args, timeout: float) -> None:
    """In the child: run `target(rank, ranks, port, *args, out, queue)` on `ranks` processes (each writes
    `out/rank<r>.json`), then print the RESULT line with the DeepSpeed version and every rank's row."""
    from _ranks import run_ranks

    out = tempfile.mkdtemp(prefix="bench_case_")
    try:
        run_ranks(target, ranks, *args, out, timeout=timeout)
        rows = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    import deepspeed

    print("RESULT " + json.dumps({"version": deepspeed.__version__, "ranks": rows}), flush=True)
