"""`ds_report`: what this install is and what it can run, for bug reports.

Upstream's report centres on compiled C++/CUDA ops; this implementation is pure Python,
so instead it reports the facts that decide whether a job can run (torch build,
accelerator, distributed backends) and which DeepSpeed features exist yet. FEATURES is the
single place later work updates when a feature lands.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

# Feature -> status ("yes", "planned", or a short qualifier). Update when a feature lands.
FEATURES: dict[str, str] = {
    "engine (deepspeed.initialize)": "yes",
    "data parallel": "yes",
    "launcher (`deepspeed` CLI)": "yes",
    "config validation (pydantic)": "yes",
    "optimizers (FusedAdam, CPUAdam, Lamb, Lion, Adagrad)": "yes (torch foreach/fused)",
    "LR schedules": "yes",
    "deepspeed.comm with counting": "yes",
    "fp16 / bf16 / torch_autocast mixed precision": "yes",
    "PyTorch-compatible backward, multiple engines": "yes",
    "ZeRO stage 1 / 2": "yes (reduce-scatter + all-gather)",
    "ZeRO stage 3": "yes (gather units, zero.Init, GatheredParameters, prefetch, hang watchdog)",
    "ZeRO-Offload (optimizer, CPU)": "yes (stages 1-3)",
    "parameter offload (CPU)": "yes (stage 3)",
    "ZeRO-Infinity (NVMe)": "planned",
    "checkpoint save / load": "yes (stages 0-3, DeepSpeed layout, resume anywhere)",
    "zero_to_fp32 / ds_to_universal": "yes (streaming)",
    "activation checkpointing": "planned",
    "pipeline parallelism": "planned",
    "multi-node launch": "yes (pdsh, OpenMPI, MPICH, Intel MPI, MVAPICH, SLURM, --no_ssh)",
    "elastic batch sizes (elasticity)": "yes (restart on another node count)",
    "autotuning": "planned",
}

_DOTS = 34


def _torch_build(torch) -> str:
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"HIP {hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return "CPU only"


def _accelerator(torch) -> str:
    if not torch.cuda.is_available():
        return "cpu (no CUDA device visible)"
    count = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    return f"cuda: {count} device(s): {names}"


def _backends() -> str:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return "torch.distributed unavailable"
    if not dist.is_available():
        return "torch.distributed unavailable"
    checks = (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available), ("mpi", dist.is_mpi_available))
    return ", ".join(f"{name}: {'yes' if check() else 'no'}" for name, check in checks)


def _shm_size() -> str:
    """/dev/shm size; small values break DataLoader workers and NCCL in containers."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return "unknown"
    nbytes = stats.f_frsize * stats.f_blocks
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            break
        size /= 1024
    warn = " [WARNING] below 512 MB; in docker raise --shm-size" if nbytes < 512 * 1024**2 else ""
    return f"{size:.2f} {unit}{warn}"


def general_report() -> list[tuple[str, str]]:
    """(name, value) rows describing this install and machine."""
    import torch

    import deepspeed

    return [
        ("deepspeed version", f"{deepspeed.__version__} (pure-Python reimplementation)"),
        ("deepspeed install path", str(list(deepspeed.__path__))),
        ("torch version", torch.__version__),
        ("torch install path", str(list(torch.__path__))),
        ("torch build", _torch_build(torch)),
        ("accelerator", _accelerator(torch)),
        ("distributed backends", _backends()),
        ("python version", f"{platform.python_version()} ({sys.executable})"),
        ("shared memory (/dev/shm) size", _shm_size()),
    ]


def format_rows(rows: list[tuple[str, str]]) -> str:
    return "\n".join(f"{name} {'.' * max(2, _DOTS - len(name))} {value}" for name, value in rows)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (upstream's signature; there are no compiled ops to report)."""
    line = "-" * 72
    print(line)
    print("DeepSpeed general environment info:")
    print(line)
    print(format_rows(general_report()))
    if not hide_operator_status:
        print(line)
        print("DeepSpeed features (no C++/CUDA ops: everything is pure Python on torch):")
        print(line)
        print(format_rows(list(FEATURES.items())))
    print(line)


def cli_main() -> None:
    parser = argparse.ArgumentParser(prog="ds_report", description="Report the DeepSpeed environment.")
    parser.add_argument("--hide_operator_status", action="store_true", help="omit the feature table")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="accepted for compatibility")
    args = parser.parse_args()
    main(hide_operator_status=args.hide_operator_status, hide_errors_and_warnings=args.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
