"""`deepspeed.comm`: the upstream function API over torch.distributed.

This is the only module of the runtime that calls torch.distributed collectives, so every
call is counted (see counting.py) and, with the `comms_logger` config section, logged.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as _tdist
from torch.distributed import ReduceOp

from ..utils.comms_logging import CommsLogger
from . import exit as _exit
from . import guard as _guard
from .counting import comms_counter
from .gloo_collectives import (all_gather_applies, broadcast_all_gather, exchange_reduce_scatter,
                               reduce_scatter_applies)

__all__ = ["ReduceOp", "default_pg_timeout", "TORCH_DISTRIBUTED_DEFAULT_PORT", "configure", "is_available", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_all_ranks_from_group", "get_world_group", "get_backend", "new_group", "initialize_mesh_device", "destroy_process_group", "all_reduce", "inference_all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "allgather_fn", "all_gather", "broadcast", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count", "get_logged_comm_ops", "comms_logger", "init_distributed", "mpi_discovery", "comms_counter"]

default_pg_timeout = datetime.timedelta(minutes=30)
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


comms_logger = CommsLogger()
"""The `comms_logger` section's logger (utils/comms_logging.py); off unless the config or
`configure(enabled=True)` turns it on."""


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Apply an enabled `comms_logger` config section, then any explicit overrides (upstream's rules)."""
    section = getattr(getattr(deepspeed_config, "model", None), "comms_logger", None)
    if section is not None:
        comms_logger.configure(section)
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("prof_ops", prof_ops),
                        ("verbose", verbose), ("debug", debug)):
        if value is not None:
            setattr(comms_logger, name, value)


def _group_size(group: Any) -> int:
    return _tdist.get_world_size(group) if _tdist.is_initialized() else 1


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    """The group's global ranks, for records that split traffic by group (None without a process group)."""
    if not _tdist.is_initialized():
        return None
    return tuple(_tdist.get_process_group_ranks(group if group is not None else _tdist.group.WORLD))


def _timed(op: str, tensor: torch.Tensor | None, group: Any, fn: Callable[[], Any], nbytes: int | None = None,
           label: Any = None) -> Any:
    """Run one collective, count it, and log it when the comms logger asks for it. Every collective
    is journaled and watched on the way ([Note: collective guard] in guard.py); `label` says what
    it is for a report (e.g. ZeRO-3's unit)."""
    logged = comms_logger.wants(op)
    entry = _guard.begin(op, tensor, group, label)
    start = time.perf_counter()
    try:
        result = fn()
    except BaseException as exc:  # a failure explains itself where it can ([Note: collective guard])
        error = _guard.failed(entry, group, exc)
        if error is exc:
            raise
        raise error from exc
    result = _guard.end(entry, result, group)
    if logged:   # completed before timing: [Note: what the comms logger measures]
        _complete(result, tensor)
    elapsed = time.perf_counter() - start
    numel = tensor.numel() if tensor is not None else 0
    size = nbytes if nbytes is not None else (numel * tensor.element_size() if tensor is not None else 0)
    comms_counter.record(op, numel, size, str(tensor.dtype) if tensor is not None else "-", _group_size(group),
                         elapsed, _group_ranks(group) if comms_counter.keep_records else None)
    if logged:
        comms_logger.append(op, op, elapsed * 1e3, size, _group_size(group))
    return _exit.track(result)  # an asynchronous Work is settled at exit if still pending (exit.py)


def _complete(result: Any, tensor: torch.Tensor | None) -> None:
    if result is not None and hasattr(result, "wait"):
        result.wait()
    if tensor is not None and tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


# --- process group state ------------------------------------------------------------------
def is_available() -> bool:
    return _tdist.is_available()


def is_initialized() -> bool:
    return _tdist.is_available() and _tdist.is_initialized()


def get_rank(group: Any = None) -> int:
    return _tdist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size(group: Any = None) -> int:
    return _tdist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return _tdist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group` in group-rank order (upstream's name)."""
    return list(_group_ranks(group) or (0,))


def get_world_group() -> Any:
    return _tdist.group.WORLD


def get_backend(group: Any = None) -> str:
    return _tdist.get_backend(group)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    group = _tdist.new_group(ranks, **kwargs)
    _exit.subgroup_created(group)  # ours: destroyed at exit if still alive (exit.py)
    return group


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """Upstream's: a torch DeviceMesh of this shape over the accelerator's device type (collective; it
    makes its own groups). The engine's groups come from runtime/mesh.py, not from this."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..accelerator import get_accelerator

    if not is_initialized():
        raise RuntimeError("initialize_mesh_device: call deepspeed.init_distributed() first")
    return init_device_mesh(get_accelerator().device_name(), tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        _guard.forget(group)
        _tdist.destroy_process_group(group)


# --- collectives -------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return _timed("all_reduce", tensor, group, lambda: _tdist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return _timed("reduce", tensor, group, lambda: _tdist.reduce(tensor, dst, op=op, group=group, async_op=async_op))


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Any:
    """On gloo, an all-to-all exchange plus a local sum: half the bytes of gloo's own
    ([Note: gloo's reduce-scatter and all-gather] in gloo_collectives.py)."""
    if reduce_scatter_applies(output, tensor, op, group):
        return _timed("reduce_scatter_tensor", tensor, group, lambda: _finish(async_op, exchange_reduce_scatter(
            output, tensor, group, lambda received, sent: _tdist.all_to_all_single(
                received, sent, group=group, async_op=True))))
    return _timed("reduce_scatter_tensor", tensor, group,
                  lambda: _tdist.reduce_scatter_tensor(output, tensor, op=op, group=group, async_op=async_op))


def _finish(async_op: bool, work: Any) -> Any:
    """A composite Work as torch returns one: itself when asynchronous, else None once done."""
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
    nbytes = sum(t.numel() * t.element_size() for t in input_list)
    return _timed("reduce_scatter", output, group,
                  lambda: _tdist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op), nbytes)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    """On gloo, one in-place broadcast per rank: no gathered copy ([Note: gloo's reduce-scatter
    and all-gather] in gloo_collectives.py)."""
    if all_gather_applies(output_tensor, tensor, group):
        return _timed("all_gather_into_tensor", output_tensor, group, lambda: _finish(async_op, broadcast_all_gather(
            output_tensor, tensor, group, lambda chunk, root: _tdist.broadcast(
                chunk, root if group is None else _tdist.get_global_rank(group, root), group=group, async_op=True))))
    return _timed("all_gather_into_tensor", output_tensor, group,
                  lambda: _tdist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op))


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    nbytes = sum(t.numel() * t.element_size() for t in tensor_list)
    return _timed("all_gather", tensor, group,
                  lambda: _tdist.all_gather(tensor_list, tensor, group=group, async_op=async_op), nbytes)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return _timed("broadcast", tensor, group, lambda: _tdist.broadcast(tensor, src, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    return _timed("all_to_all_single", tensor, group, lambda: _tdist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    return _timed("gather", tensor, group,
                  lambda: _tdist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op))


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    return _timed("scatter", tensor, group,
                  lambda: _tdist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return _timed("send", tensor, group, lambda: _tdist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return _timed("recv", tensor, group, lambda: _tdist.recv(tensor, src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return _timed("isend", tensor, group, lambda: _tdist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return _timed("irecv", tensor, group, lambda: _tdist.irecv(tensor, src, group=group, tag=tag))


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    return _timed("barrier", None, group, lambda: _tdist.barrier(group=group, async_op=async_op))


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> Any:
    return _timed("monitored_barrier", None, group,
                  lambda: _tdist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks))


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> Any:
    return _timed("all_gather_object", None, group, lambda: _tdist.all_gather_object(object_list, obj, group=group))


def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None, device: Any = None) -> Any:
    return _timed("broadcast_object_list", None, group,
                  lambda: _tdist.broadcast_object_list(object_list, src=src, group=group, device=device))


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Print the comms logger's table on rank 0 (collective: every rank must call it; with
    `show_straggler`, also the fastest rank's latency and each rank's wait). With `return_dict`,
    every rank returns its statistics (upstream's structure)."""
    comms_logger.paused = True   # the summary's own collectives are not logged
    try:
        if is_initialized():
            _tdist.barrier()
        result = comms_logger.log_all(print_log=get_rank() == 0, show_straggler=show_straggler,
                                      return_dict=return_dict)
        if is_initialized():
            _tdist.barrier()
    finally:
        comms_logger.paused = False
    return result


def reset_log() -> None:
    """Forget what the comms logger recorded (e.g. per epoch)."""
    comms_logger.reset_data()


def has_comm_data() -> bool:
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return comms_logger.get_operation_names()


# --- initialisation ----------------------------------------------------------------------
from .init import init_distributed, mpi_discovery  # noqa: E402  (uses the names above)
