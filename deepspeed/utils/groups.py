"""Upstream's `deepspeed.utils.groups` accessors, as a facade over the parallel-dims mesh (runtime/mesh.py).

Order of authority, as upstream: an `mpu` handed to `deepspeed.initialize` (kept in this module's `mpu`;
a Megatron-style object, or ALST's `parallel_state_sp`, itself a facade over the mesh), then the current
mesh (made from the config's `sequence_parallel_size` or by `parallel_state_sp.initialize_sequence_parallel`),
then the whole world as one data-parallel group. No accessor creates a group: they only read.
"""

from __future__ import annotations

from typing import Any

from .. import comm as dist
from ..runtime import mesh as _mesh

mpu: Any = None   # upstream's module global: set by the engine when a client passes `mpu=`


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Upstream's entry point: remember the client's mpu (expert parallelism is not built here)."""
    if ep_size != 1:
        from ..runtime.errors import NotSupportedYet

        raise NotSupportedYet(f"groups.initialize(ep_size={ep_size}): expert parallelism is not available yet")
    globals()["mpu"] = mpu


def _sp_only(obj: Any) -> bool:
    """ALST's mpu (upstream: a module with `initialize_sequence_parallel`) has no model parallelism."""
    return obj is not None and hasattr(obj, "initialize_sequence_parallel")


def _mesh_or_none() -> Any:
    return _mesh.current()


def _from(method: str) -> Any:
    """`mpu.<method>` when the client's mpu has it, else None."""
    return getattr(mpu, method, None) if mpu is not None else None


# --- sequence parallel ------------------------------------------------------------------------
def _get_sequence_parallel_group() -> Any:
    if _from("get_sequence_parallel_group") is not None:
        return mpu.get_sequence_parallel_group()
    mesh = _mesh_or_none()
    if mesh is None:
        raise KeyError("No sequence parallel group found: set sequence_parallel_size in the DeepSpeed config, or "
                       "call deepspeed.runtime.sequence_parallel.parallel_state_sp.initialize_sequence_parallel(n)")
    return mesh.group("sequence")


def _get_sequence_parallel_world_size() -> int:
    if _from("get_sequence_parallel_world_size") is not None:
        return int(mpu.get_sequence_parallel_world_size())
    mesh = _mesh_or_none()
    return mesh.size("sequence") if mesh is not None else 1


def _get_sequence_parallel_rank() -> int:
    if _from("get_sequence_parallel_rank") is not None:
        return int(mpu.get_sequence_parallel_rank())
    mesh = _mesh_or_none()
    return mesh.rank("sequence") if mesh is not None else 0


def _get_sequence_data_parallel_group() -> Any:
    """The group ZeRO shards over and gradients are averaged over: data x sequence."""
    if _from("get_sequence_data_parallel_group") is not None:
        return mpu.get_sequence_data_parallel_group()
    mesh = _mesh_or_none()
    return mesh.group("sequence_data") if mesh is not None else _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    if _from("get_sequence_data_parallel_world_size") is not None:
        return int(mpu.get_sequence_data_parallel_world_size())
    mesh = _mesh_or_none()
    return mesh.size("sequence_data") if mesh is not None else _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    if _from("get_sequence_data_parallel_rank") is not None:
        return int(mpu.get_sequence_data_parallel_rank())
    mesh = _mesh_or_none()
    return mesh.rank("sequence_data") if mesh is not None else _get_data_parallel_rank()


# --- data parallel ------------------------------------------------------------------------------
def _get_data_parallel_group() -> Any:
    if _from("get_data_parallel_group") is not None:
        return mpu.get_data_parallel_group()
    mesh = _mesh_or_none()
    return mesh.group("data") if mesh is not None else dist.get_world_group()


def _get_data_parallel_world_size() -> int:
    if _from("get_data_parallel_world_size") is not None:
        return int(mpu.get_data_parallel_world_size())
    mesh = _mesh_or_none()
    return mesh.size("data") if mesh is not None else dist.get_world_size()


def _get_data_parallel_rank() -> int:
    if _from("get_data_parallel_rank") is not None:
        return int(mpu.get_data_parallel_rank())
    mesh = _mesh_or_none()
    return mesh.rank("data") if mesh is not None else dist.get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    if _from("get_data_parallel_group_ranks") is not None:
        return list(mpu.get_data_parallel_group_ranks())
    mesh = _mesh_or_none()
    return mesh.ranks("data") if mesh is not None else list(range(dist.get_world_size()))


def _get_broadcast_src_rank() -> int:
    """The global rank every replica's parameters are broadcast from: rank 0 of the ZeRO group."""
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


# --- model (tensor x pipe) parallel -------------------------------------------------------------
def _get_model_parallel_world_size() -> int:
    if mpu is not None and not _sp_only(mpu):
        return int(mpu.get_model_parallel_world_size())
    mesh = _mesh_or_none()
    return mesh.size("model") if mesh is not None else 1


def _get_model_parallel_rank() -> int:
    if mpu is not None and not _sp_only(mpu):
        return int(mpu.get_model_parallel_rank())
    mesh = _mesh_or_none()
    return mesh.rank("model") if mesh is not None else 0


def _get_model_parallel_group() -> Any:
    if mpu is not None and not _sp_only(mpu):
        return mpu.get_model_parallel_group()
    mesh = _mesh_or_none()
    if mesh is None:
        raise KeyError("No model parallel group found: no mpu was given and no parallel dims were set")
    return mesh.group("model")


# upstream's public (unprefixed) tensor-parallel accessors, over the mesh's `tensor` dim
def get_tensor_model_parallel_group() -> Any:
    mesh = _mesh_or_none()
    if mesh is None:
        raise KeyError("No tensor parallel group found: tensor parallelism is not set up")
    return mesh.group("tensor")


def get_tensor_model_parallel_world_size() -> int:
    mesh = _mesh_or_none()
    return mesh.size("tensor") if mesh is not None else 1


def get_tensor_model_parallel_rank() -> int:
    mesh = _mesh_or_none()
    return mesh.rank("tensor") if mesh is not None else 0


get_model_parallel_group = _get_model_parallel_group
get_model_parallel_world_size = _get_model_parallel_world_size
get_model_parallel_rank = _get_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
