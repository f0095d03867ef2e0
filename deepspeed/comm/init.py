"""`init_distributed`: choose the backend, discover rank/world size, create the process group."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
from typing import Any, Mapping

import torch
import torch.distributed as _tdist

from ..launcher.resources import first_slurm_host
from ..utils.logging import logger
from . import exit as exit_step

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# (rank, world size, local rank, local size) variables of the launchers we recognise, as upstream's
# runners start ranks: OpenMPI's mpirun, MVAPICH's, MPICH/Intel MPI's hydra (PMI_*), srun.
_MPI_ENVS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover_env(env: Mapping[str, str], distributed_port: int = 29500) -> dict[str, str] | None:
    """Pure: the torch.distributed variables implied by an MPI or SLURM launcher's, or None.

    MASTER_ADDR, unless set: SLURM's first node of the step (task 0 runs there), else
    SLURM_LAUNCH_NODE_IPADDR; 127.0.0.1 when all ranks share this host (or nothing says
    otherwise); "" when the ranks span hosts and nothing names rank 0's (see mpi_discovery).
    """
    for rank_key, size_key, local_key, local_size_key in _MPI_ENVS:
        if rank_key not in env or size_key not in env:
            continue
        out = {"RANK": env[rank_key], "WORLD_SIZE": env[size_key], "LOCAL_RANK": env.get(local_key, "0") or "0",
               "MASTER_PORT": env.get("MASTER_PORT", str(distributed_port))}
        addr = env.get("MASTER_ADDR", "")
        if not addr and rank_key == "SLURM_PROCID":
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            addr = first_slurm_host(nodelist) if nodelist else env.get("SLURM_LAUNCH_NODE_IPADDR", "")
        if not addr:
            local_size = env.get(local_size_key or "", "")
            spans_hosts = local_size.isdigit() and int(local_size) < int(env[size_key])
            addr = "" if spans_hosts else "127.0.0.1"
        out["MASTER_ADDR"] = addr
        out["_FOUND"] = rank_key
        return out
    return None


def _master_from_mpi4py() -> str | None:
    """Upstream's way: rank 0's first `hostname -I` address, broadcast over MPI (needs mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    addr = None
    if comm.Get_rank() == 0:
        try:
            addr = subprocess.check_output(["hostname", "-I"]).decode().split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            addr = socket.gethostbyname(socket.gethostname())
    return comm.bcast(addr, root=0)


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from MPI or SLURM variables; True if found."""
    found = discover_env(os.environ, distributed_port)
    if found is None:
        return False
    source = found.pop("_FOUND")
    if not found["MASTER_ADDR"]:
        found["MASTER_ADDR"] = _master_from_mpi4py() or ""
    if not found["MASTER_ADDR"]:
        raise RuntimeError(
            f"deepspeed.init_distributed: the {found['WORLD_SIZE']} ranks ({source}) span several hosts and "
            "MASTER_ADDR is not set, so rank 0's address is unknown. Export MASTER_ADDR=<rank 0's host> to every "
            "rank (mpirun -x MASTER_ADDR, or a line in .deepspeed_env), or install mpi4py (upstream's way)")
    os.environ.update(found)
    if verbose:
        logger.info(f"Discovered rank {found['RANK']}/{found['WORLD_SIZE']} (local rank {found['LOCAL_RANK']}) "
                    f"from {source}; master {found['MASTER_ADDR']}:{found['MASTER_PORT']}")
    return True


def _default_backend() -> str:
    from ..accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = _DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise torch.distributed once (idempotent).

    Rank and world size come from the arguments, else the launcher's env variables (RANK,
    WORLD_SIZE), else MPI/SLURM discovery, else a single process on a free local port.
    """
    if _tdist.is_available() and _tdist.is_initialized():
        exit_step.process_group_created(owned=False)  # the script's group: settle ours at exit only
        return
    if dist_init_required is False:   # as upstream: refusing to create the group leaves none to run on
        raise RuntimeError("deepspeed.init_distributed(dist_init_required=False): torch.distributed is not "
                           "initialized; call torch.distributed.init_process_group() first, or pass "
                           "dist_init_required=None (the default) to let DeepSpeed initialize it")
    backend = dist_backend or _default_backend()
    if rank < 0 and auto_mpi_discovery and not all(k in os.environ for k in _REQUIRED):
        mpi_discovery(distributed_port, verbose)
    if rank < 0 and world_size < 0 and "RANK" not in os.environ and init_method is None:
        # Not launched by any launcher: a world of one on a private port (no clash between jobs).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "init_method": init_method or "env://"}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    if verbose:
        logger.info(f"Initializing torch.distributed with backend {backend} "
                    f"(rank {rank if rank >= 0 else os.environ.get('RANK')}, "
                    f"world size {world_size if world_size >= 0 else os.environ.get('WORLD_SIZE')})")
    _tdist.init_process_group(**kwargs)
    exit_step.process_group_created(owned=True)  # destroyed at exit unless the script does it (exit.py)
