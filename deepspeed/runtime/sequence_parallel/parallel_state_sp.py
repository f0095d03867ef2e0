"""ALST's `mpu` (upstream's module of this name): sequence-parallel groups, as a facade over the mesh.

`UlyssesSPAttentionHF.register_with_transformers` calls `initialize_sequence_parallel(n)` and hands this
module to `deepspeed.initialize(mpu=...)`. The groups are the standard mesh's ([Note: the rank order] in
runtime/parallel_dims.py): sequence groups are runs of n consecutive ranks, data-parallel replicas strided,
and the sequence-data-parallel group (ZeRO's) spans both. As upstream, "model parallel" here names the
sequence-parallel group (Megatron-style callers ask for it); the engine treats this mpu as having no
model parallelism (`deepspeed.utils.groups._get_model_parallel_world_size() == 1`).
"""

from __future__ import annotations

from typing import Any

from ... import comm as dist
from .. import mesh as _mesh


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make (or reuse) the mesh with this sequence-parallel degree over the whole world."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() first")
    world_size = dist.get_world_size()
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {sequence_parallel_size!r}")
    if world_size < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world_size}) is less than sequence_parallel_size {sequence_parallel_size}")
    if world_size % sequence_parallel_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size}")
    _mesh.initialize(sequence=sequence_parallel_size)


def _current() -> Any:
    mesh = _mesh.current()
    if mesh is None:
        raise RuntimeError("sequence parallel groups are not initialized: call initialize_sequence_parallel(n)")
    return mesh


def get_sequence_parallel_group() -> Any:
    return _current().group("sequence")


def get_sequence_parallel_world_size() -> int:
    return _current().size("sequence")


def get_sequence_parallel_rank() -> int:
    return _current().rank("sequence")


def get_sequence_data_parallel_group() -> Any:
    return _current().group("sequence_data")


def get_sequence_data_parallel_world_size() -> int:
    return _current().size("sequence_data")


def get_sequence_data_parallel_rank() -> int:
    return _current().rank("sequence_data")


def get_data_parallel_group() -> Any:
    return _current().group("data")


def get_data_parallel_world_size() -> int:
    return _current().size("data")


def get_data_parallel_rank() -> int:
    return _current().rank("data")


def get_data_parallel_group_ranks() -> list[int]:
    return _current().ranks("data")


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
