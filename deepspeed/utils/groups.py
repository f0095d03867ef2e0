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
from .logging import log_dist

mpu: Any = None   # upstream's module global: set by the engine when a client passes `mpu=`


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Upstream's (deprecated) entry point: remember the client's mpu; with `ep_size > 1` also build
    the expert groups of that size."""
    globals()["mpu"] = mpu
    if ep_size > 1:
        if mpu is not None and not _sp_only(mpu):
            _create_expert_data_and_model_parallel(ep_size, mpu)
        else:
            _create_expert_and_data_parallel(ep_size)


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


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor rank 0 in this rank's TP group (tensor is the fastest mesh axis, so
    TP peers are neighbouring ranks): the source of a broadcast over the group."""
    from .. import comm as dist

    return dist.get_rank() - get_tensor_model_parallel_rank()


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> tuple[Any, Any]:
    """Upstream's builder of AutoTP's groups (its callers: AutoTP set-ups outside `initialize`): the
    standard mesh with this tensor degree, keeping the current mesh's sequence and pipe degrees
    (collective). Returns this rank's (data-parallel group, tensor-parallel group), as upstream. The
    mesh builds the groups itself, never through a DeviceMesh (runtime/mesh.py says why)."""
    world = dist.get_world_size()
    current = _mesh_or_none()
    sequence = current.size("sequence") if current is not None else 1
    pipe = current.size("pipe") if current is not None else 1
    tp = tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % (tp * sequence * pipe):
        raise ValueError(f"_init_tp_mesh_device: tensor_model_parallel_size={tp!r} must be an integer >= 1 that "
                         f"divides the world size {world} (with sequence {sequence} x pipe {pipe})")
    if data_parallel_size is not None and data_parallel_size * tp * sequence * pipe != world:
        raise ValueError(f"_init_tp_mesh_device: data_parallel_size={data_parallel_size} x "
                         f"tensor_model_parallel_size={tp} (x sequence {sequence} x pipe {pipe}) must equal the "
                         f"world size {world}")
    mesh = _mesh.initialize(sequence=sequence, tensor=tp, pipe=pipe)
    log_dist(f"tensor-parallel groups: {mesh!r}", ranks=[0])
    globals().update(_DATA_PARALLEL_GROUP=mesh.group("data"), _TENSOR_MODEL_PARALLEL_GROUP=mesh.group("tensor"),
                     _MODEL_PARALLEL_GROUP=mesh.group("model"))
    return _DATA_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP


# upstream's module globals for the groups `_init_tp_mesh_device` returned (clients and upstream's
# tests reset or read them); the accessors above read the mesh, which stays the one authority
_DATA_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_TENSOR_MODEL_PARALLEL_GROUP: Any = None


get_model_parallel_group = _get_model_parallel_group
get_model_parallel_world_size = _get_model_parallel_world_size
get_model_parallel_rank = _get_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# --- expert parallel ([Note: expert groups] in runtime/parallel_dims.py) -------------------------
def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list, list]:
    """The expert-parallel and expert-data-parallel rank lists of a world (pure; upstream's E + M + D)."""
    from ..runtime.parallel_dims import ParallelDims, expert_rank_groups

    dims = ParallelDims(world_size, pipe=pipeline_parallel_size_, tensor=tensor_parallel_size_)
    return expert_rank_groups(dims.topology(), expert_parallel_size_, use_data_before_expert_parallel_)


def _expert_mesh(tensor: int = 1, sequence: int = 1, pipe: int = 1) -> Any:
    """The mesh expert groups are built on: the current one when it has the tensor degree asked (as
    upstream, `mp_size=None` asks for 1) and the sequence/pipe degrees asked above 1, else the standard
    mesh for what is asked. An earlier engine's mesh stays current after that engine is gone, so a
    bare `_create_expert_and_data_parallel(ep)` before the next `initialize` must not inherit its
    tensor lanes: expert groups inside them would give that call other ep ranks than the next engine
    uses (each expert replica then trains on its own)."""
    mesh = _mesh_or_none()
    if mesh is None:
        return _mesh.initialize(sequence=sequence, tensor=tensor, pipe=pipe)
    have = {"tensor": mesh.size("tensor"), "sequence": mesh.size("sequence"), "pipe": mesh.size("pipe")}
    if have["tensor"] == tensor and all(v == 1 or v == have[k] for k, v in (("sequence", sequence), ("pipe", pipe))):
        return mesh
    return _mesh.initialize(sequence=sequence if sequence > 1 else have["sequence"], tensor=tensor,
                            pipe=pipe if pipe > 1 else have["pipe"])


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False,
                                     folding_spec: Any = None) -> None:
    """Build the expert-parallel and expert-data-parallel groups named `ep_size_<n>` (collective:
    every rank calls it with the same arguments; a second call is a no-op)."""
    if mp_mode not in ("tp", "sp"):
        raise ValueError(f"_create_expert_and_data_parallel: mp_mode must be 'tp' or 'sp', got {mp_mode!r}")
    if folding_spec is not None:   # AutoEP+AutoTP: expert groups folded over the tensor dim (auto_ep_folding)
        if int(folding_spec.ep_size) != int(expert_parallel_size_) or int(folding_spec.pp_size) != 1:
            raise ValueError(f"_create_expert_and_data_parallel: folding_spec {folding_spec} does not match "
                             f"expert_parallel_size_={expert_parallel_size_} (and pp_size 1)")
        _expert_mesh(tensor=int(folding_spec.tp_size)).expert_groups(int(expert_parallel_size_), folded=True)
        return
    mp = int(mp_size or 1)
    mesh = _expert_mesh(tensor=mp if mp_mode == "tp" else 1, sequence=mp if mp_mode == "sp" else 1,
                        pipe=int(pp_size or 1))
    mesh.expert_groups(int(expert_parallel_size_), use_data_before_expert_parallel_)


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, mpu: Any,
                                           use_data_before_expert_parallel_: bool = False) -> None:
    """Expert groups for a Megatron-style `mpu`: its tensor (and pipeline) degrees lay out the mesh."""
    global expert_tensor_parallel_world_size
    globals()["mpu"] = mpu
    tensor = int(mpu.get_tensor_model_parallel_world_size()) if hasattr(
        mpu, "get_tensor_model_parallel_world_size") else int(mpu.get_model_parallel_world_size())
    pipe = int(mpu.get_pipeline_model_parallel_world_size()) if hasattr(
        mpu, "get_pipeline_model_parallel_world_size") else 1
    mesh = _expert_mesh(tensor=tensor, pipe=pipe)
    mesh.expert_groups(int(expert_parallel_size_), use_data_before_expert_parallel_)
    expert_tensor_parallel_world_size = tensor


expert_tensor_parallel_world_size = 1   # upstream's: the experts' own tensor-parallel size (MoE with an mpu)


def _get_expert_model_parallel_world_size() -> int:
    """The tensor-parallel size of the experts themselves: the mpu's with
    `enable_expert_tensor_parallelism`, else 1 (upstream's accessor)."""
    return expert_tensor_parallel_world_size


def _expert(group_name: str, data: bool = False) -> tuple[list[int], Any]:
    mesh = _mesh_or_none()
    if mesh is None or group_name not in mesh.expert_names():
        raise KeyError(f"expert groups {group_name!r} were not created: an MoE layer with that ep_size builds them "
                       f"when the engine starts (or call groups._create_expert_and_data_parallel)")
    return mesh.expert_entry(group_name, data)


def _get_expert_holders_group(group_name: str) -> tuple[list[int], Any]:
    """(ranks, group) of the ranks holding this rank's experts of `group_name` ([Note: EP x TP folding])."""
    _expert(group_name)
    return _mesh.current().expert_holders(group_name)


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert(group_name)[1]


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name)[0])


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert(group_name, data=True)[1]


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name, data=True)[0])


def _expert_names() -> list[str]:
    mesh = _mesh_or_none()
    return mesh.expert_names() if mesh is not None else []


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_parallel_group(name) for name in _expert_names()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_data_parallel_group(name) for name in _expert_names()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_expert(group_name)[0])


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_expert(group_name, data=True)[0])


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert(group_name)[0].index(dist.get_rank())


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert(group_name, data=True)[0].index(dist.get_rank())


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first member of this rank's expert-parallel group."""
    return _expert(group_name)[0][0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank expert parameters are broadcast from: the first of the expert-data group."""
    return _expert(group_name, data=True)[0][0]


def _get_max_expert_size() -> int:
    """The largest expert-parallel size built (1 when none)."""
    return max((len(_expert(n)[0]) for n in _expert_names()), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())
