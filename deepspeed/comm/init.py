"""`init_distributed`: choose the backend, discover rank/world size, create the process group."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as _tdist

from ..utils.logging import logger
from . import exit as exit_step

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# (rank, world size, local rank, master address) variables of the launchers we recognise.
_MPI_ENVS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", None),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", None),
    ("PMIX_RANK", "PMIX_SIZE", "MPI_LOCALRANKID", None),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_LAUNCH_NODE_IPADDR"),
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from MPI or SLURM variables; True if found."""
    for rank_key, size_key, local_key, addr_key in _MPI_ENVS:
        if rank_key in os.environ and size_key in os.environ:
            os.environ["RANK"] = os.environ[rank_key]
            os.environ["WORLD_SIZE"] = os.environ[size_key]
            os.environ.setdefault("LOCAL_RANK", os.environ.get(local_key or "", "0") or "0")
            if addr_key and addr_key in os.environ:
                os.environ.setdefault("MASTER_ADDR", os.environ[addr_key])
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
            if verbose:
                logger.info(f"Discovered rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} from {rank_key}")
            return True
    return False


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
    if rank < 0 and "RANK" not in os.environ and auto_mpi_discovery:
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
