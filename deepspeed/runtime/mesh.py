"""The one owner of the process groups of every parallel dim ([Note: the rank order] in parallel_dims.py).

A `ParallelMesh` is made once for a layout (a `ProcessTopology`: the engine's standard pipe x data x
sequence x tensor, or a pipeline topology) and creates each of its named groups once, eagerly, in one
order on every rank, as torch.distributed requires of `new_group`. Everything that needs a group asks
the mesh by name: the engine (ZeRO shards over `sequence_data`), `deepspeed.utils.groups`, the `mpu`
that ALST hands to clients (`parallel_state_sp`) and the pipeline grid are facades over it.

Why not `torch.distributed.device_mesh.DeviceMesh` underneath: it builds a group for every mesh dim and
flattens joined dims with extra groups, but `sequence_data` (ZeRO's group) and `model` (pipe x tensor)
are joins it would build again for every client, its dim names are fixed at construction, and its
`get_group` raises for the world-sized dims we hand out as the world group. The rank arithmetic here is
the same row-major layout, so `as_device_mesh()` can build the equivalent DeviceMesh for clients that
want one (Accelerate's `torch_device_mesh`).

Groups of one rank are not created per name: every singleton is this rank's one "self" group, made
with local synchronisation (no other rank takes part), so layouts without a dim cost nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from .. import comm as ds_comm
from .parallel_dims import (GROUP_AXES, ParallelDims, ProcessTopology, axis_groups, expert_rank_groups,
                            expert_replica_rank_groups, folded_expert_rank_groups, hpz_rank_groups)

_SELF_GROUPS: dict[int, Any] = {}   # id(default process group) -> this rank's singleton group


def _world_key() -> int:
    import torch.distributed as tdist

    return id(tdist.distributed_c10d._get_default_group()) if ds_comm.is_initialized() else 0


def _self_group() -> Any:
    key = _world_key()
    if key not in _SELF_GROUPS:
        _SELF_GROUPS[key] = ds_comm.new_group(ranks=[ds_comm.get_rank()], use_local_synchronization=True)
    return _SELF_GROUPS[key]


def _make(lists: list[list[int]], rank: int, world_size: int) -> tuple[list[int], Any]:
    """This rank's (ranks, group) among `lists`, creating every group of the lists in one order on
    every rank (as torch.distributed requires of `new_group`); singletons and the world reuse theirs."""
    mine = next(g for g in lists if rank in g)
    if len(mine) == 1:
        return mine, (_self_group() if ds_comm.is_initialized() else None)
    if len(mine) == world_size:
        return mine, ds_comm.get_world_group()
    handle = None
    for ranks in lists:
        group = ds_comm.new_group(ranks=ranks)
        if rank in ranks:
            handle = group
    return mine, handle


class ParallelMesh:
    """The process groups of one layout. `group(name)` is this rank's group over the named axes."""

    def __init__(self, topology: ProcessTopology, names: dict[str, tuple[str, ...]] | None = None,
                 dims: ParallelDims | None = None) -> None:
        self.topology = topology
        self.dims = dims
        self.world_size = ds_comm.get_world_size()
        self.global_rank = ds_comm.get_rank()
        if topology.world_size() != self.world_size:
            layout = dict(zip(topology.axes, topology.dims))
            raise ValueError(f"parallel dims {layout} cover {topology.world_size()} ranks but the world size is "
                             f"{self.world_size}")
        self._world_key = _world_key()
        self.names = dict(names if names is not None else GROUP_AXES)
        self._groups: dict[tuple[str, ...], tuple[list[int], Any]] = {}
        self._experts: dict[str, tuple[tuple[list[int], Any], tuple[list[int], Any]]] = {}
        self._hpz: dict[int, tuple[list[int], Any]] = {}
        self._custom: dict[str, tuple[list[int], Any] | None] = {}
        self._expert_holders: dict[str, tuple[list[int], Any]] = {}
        self._expert_layouts: dict[str, str] = {}
        for axes in self.names.values():   # eagerly, in the same order on every rank
            self._build(axes)

    @classmethod
    def standard(cls, dims: ParallelDims) -> "ParallelMesh":
        return cls(dims.topology(), GROUP_AXES, dims)

    def _key(self, axes: Iterable[str]) -> tuple[str, ...]:
        wanted = set(axes)
        return tuple(a for a in self.topology.axes if a in wanted and self.topology.get_dim(a) > 1)

    def _build(self, axes: Iterable[str]) -> tuple[list[int], Any]:
        key = self._key(axes)
        if key not in self._groups:
            self._groups[key] = _make(axis_groups(self.topology, key), self.global_rank, self.world_size)
        return self._groups[key]

    def expert_groups(self, expert_size: int, data_before_expert: bool = False, folded: bool = False) -> str:
        """Build (once; collective, every rank with the same arguments) the expert-parallel and
        expert-data-parallel groups of `expert_size` ([Note: expert groups]); returns their name,
        upstream's `ep_size_<n>`. `folded`: AutoEP+AutoTP's layout, expert groups folded over the
        tensor dim too ([Note: EP x TP folding] in moe/tp_tokens.py)."""
        name = f"ep_size_{expert_size}"
        layout = "folded" if folded else "data_before_expert" if data_before_expert else "expert_before_data"
        if self._expert_layouts.get(name, layout) != layout:   # another engine's layout: build this one anew
            self._experts.pop(name)
        self._expert_layouts[name] = layout
        if name not in self._experts:
            experts, replicas = (folded_expert_rank_groups(self.topology, expert_size) if folded else
                                 expert_rank_groups(self.topology, expert_size, data_before_expert))
            # upstream's order: the expert-data-parallel groups first
            replica_entry = _make(replicas, self.global_rank, self.world_size)
            self._experts[name] = (_make(experts, self.global_rank, self.world_size), replica_entry)
            holders = expert_replica_rank_groups(experts)
            self._expert_holders[name] = replica_entry if sorted(map(sorted, holders)) == sorted(
                map(sorted, replicas)) else _make(holders, self.global_rank, self.world_size)
        return name

    def rank_groups(self, name: str, lists: list[list[int]]) -> tuple[list[int], Any] | None:
        """(ranks, group) of this rank among `lists`, groups over ranks that no axis describes (a
        pipeline's tied-weight stages), built once per `name` (collective: every rank, same lists,
        same order); None when this rank is in none of them."""
        if name not in self._custom:
            handle = None
            for ranks in lists:
                ranks = sorted(ranks)
                group = _self_group() if len(ranks) == 1 else ds_comm.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    handle = (ranks, group)
            self._custom[name] = handle
        return self._custom[name]

    def expert_holders(self, name: str) -> tuple[list[int], Any]:
        """(ranks, group) of the ranks holding the same experts as this one ([Note: EP x TP folding])."""
        self.expert_entry(name)
        return self._expert_holders[name]

    def hpz_group(self, partition_size: int) -> tuple[list[int], Any]:
        """(ranks, group) of this rank's hpZ node ([Note: hpZ node groups]); built once (collective:
        every rank with the same size)."""
        if partition_size not in self._hpz:
            self._hpz[partition_size] = _make(hpz_rank_groups(self.topology, partition_size), self.global_rank,
                                              self.world_size)
        return self._hpz[partition_size]

    def expert_entry(self, name: str, data: bool = False) -> tuple[list[int], Any]:
        """(ranks, group) of this rank's expert-parallel group `name` (its expert-data group with `data`)."""
        if name not in self._experts:
            raise KeyError(f"parallel mesh: no expert groups named {name!r}; built: {sorted(self._experts)}")
        return self._experts[name][1 if data else 0]

    def expert_names(self) -> list[str]:
        return list(self._experts)

    def _entry(self, name: str | Iterable[str]) -> tuple[list[int], Any]:
        if isinstance(name, str):
            if name not in self.names:
                raise KeyError(f"parallel mesh: no group named {name!r}; this mesh has {sorted(self.names)}")
            name = self.names[name]
        key = self._key(name)
        if key not in self._groups:
            raise KeyError(f"parallel mesh: no group over axes {key} was built; built: {sorted(self._groups)}")
        return self._groups[key]

    def group(self, name: str | Iterable[str]) -> Any:
        return self._entry(name)[1]

    def ranks(self, name: str | Iterable[str]) -> list[int]:
        return list(self._entry(name)[0])

    def size(self, name: str | Iterable[str]) -> int:
        return len(self._entry(name)[0])

    def rank(self, name: str | Iterable[str]) -> int:
        return self._entry(name)[0].index(self.global_rank)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on `axis` (0 for an axis the layout does not have)."""
        return getattr(self.topology.get_coord(self.global_rank), axis, 0) if axis in self.topology.axes else 0

    def alive(self) -> bool:
        """False once the default process group these groups belong to was destroyed or replaced."""
        return self._world_key == _world_key()

    def as_device_mesh(self, device_type: str = "cpu") -> Any:
        """The equivalent torch DeviceMesh over the standard dims (it creates its own groups)."""
        from torch.distributed.device_mesh import init_device_mesh

        degrees = [(a, d) for a, d in zip(self.topology.axes, self.topology.dims)]
        return init_device_mesh(device_type, tuple(d for _, d in degrees), mesh_dim_names=tuple(a for a, _ in degrees))

    def __repr__(self) -> str:
        layout = ", ".join(f"{a}={d}" for a, d in zip(self.topology.axes, self.topology.dims))
        return f"ParallelMesh({layout})"


# --- the current standard mesh ---------------------------------------------------------------
_CURRENT: ParallelMesh | None = None


def current() -> ParallelMesh | None:
    """The standard mesh made by `initialize` (None before, or after the process group went away)."""
    global _CURRENT
    if _CURRENT is not None and not _CURRENT.alive():
        _CURRENT = None
    return _CURRENT


def initialize(*, sequence: int = 1, tensor: int = 1, pipe: int = 1) -> ParallelMesh:
    """The standard mesh for these degrees over the current world: the current one when it has them,
    else a new one (collective: every rank calls it with the same degrees)."""
    global _CURRENT
    dims = ParallelDims(ds_comm.get_world_size(), pipe=pipe, sequence=sequence, tensor=tensor)
    mesh = current()
    if mesh is None or mesh.dims != dims:
        mesh = ParallelMesh.standard(dims)
        _CURRENT = mesh
    return mesh


def reset() -> None:
    """Forget the current mesh (its groups stay valid for whoever holds them)."""
    global _CURRENT
    _CURRENT = None
