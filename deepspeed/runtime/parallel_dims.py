"""Parallel dims: how the world's ranks are laid out over named parallel axes (pure, no processes).

[Note: the rank order]
A layout is named axes with sizes, ranks laid out row-major over them: the last axis varies fastest.
The standard layout of the engine is

    pipe (slowest) x data x sequence x tensor (fastest)

so tensor-parallel peers are neighbours (the fastest links), sequence-parallel groups are runs of
consecutive ranks (upstream's `parallel_state_sp` order: world 4, sp 2 -> [0, 1], [2, 3]), data-parallel
replicas are strided ([0, 2], [1, 3]) and the sequence-data-parallel group that ZeRO shards over is
data x sequence ([0, 1, 2, 3]). Pipeline topologies (`PipeDataParallelTopology`: pipe x data,
`PipeModelDataParallelTopology`: pipe x data x model) are layouts of the same kind. A group "over axes A"
is every set of ranks that differ only in the axes A; `axis_groups` lists them. The process groups
themselves are made once by the owner in `runtime/mesh.py`.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Iterable


class ProcessTopology:
    """Maps n-dimensional coordinates (one per named axis) to linear ranks and back."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} must have the same length")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*[range(d) for d in dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = list(self.mapping)   # index = rank

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. `get_rank(pipe=1, data=0)`."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank: coordinate {coord_kwargs} is outside dims {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: list[str] = ["data", "pipe"], inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """`model_01`-style name of a rank over the axes not omitted (checkpoint file names use it)."""
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit)

    def get_dim(self, axis: str) -> int:
        """The size of `axis`, 0 when the topology has no such axis."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"get_coord: rank {rank} is not in this topology of {len(self._coords)} ranks")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Groups of ranks that differ only in `axis` (e.g. the data-parallel groups); [] for an
        unknown axis. Ordered by the coordinates of the other axes."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for rest in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, rest))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinate matches every given axis value, in rank order."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on `axis` is `idx`; [] for an unknown axis."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


def axis_groups(topology: ProcessTopology, axes: Iterable[str]) -> list[list[int]]:
    """Every group of ranks that differ only in `axes` (a group over no axes is each rank alone),
    ordered by the coordinates of the other axes; each group in rank order. Unknown axes count as
    size 1, so a layout without a `sequence` axis has singleton sequence groups."""
    varying = [a for a in topology.axes if a in set(axes)]
    fixed_axes = [a for a in topology.axes if a not in set(axes)]
    groups = []
    for fixed in itertools.product(*[range(topology.get_dim(a)) for a in fixed_axes]):
        pinned = dict(zip(fixed_axes, fixed))
        groups.append(sorted(topology.filter_match(**pinned)))
    return groups


# The named groups of the standard layout: the axes each one spans.
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "data": ("data",),
    "sequence": ("sequence",),
    "sequence_data": ("data", "sequence"),
    "tensor": ("tensor",),
    "pipe": ("pipe",),
    "model": ("pipe", "tensor"),   # what holds one whole model: stages x tensor slices
}
AXES = ("pipe", "data", "sequence", "tensor")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of every parallel dim over a world; `data` is what is left (world / the others)."""

    world_size: int
    pipe: int = 1
    sequence: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pipe", "sequence", "tensor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel dims: {name} must be an integer >= 1, got {value!r}")
        model = self.pipe * self.sequence * self.tensor
        if self.world_size % model:
            raise ValueError(f"parallel dims: the world size ({self.world_size}) must be a multiple of "
                             f"pipe x sequence x tensor = {self.pipe} x {self.sequence} x {self.tensor} = {model}; "
                             f"choose degrees whose product divides {self.world_size}")

    @property
    def data(self) -> int:
        return self.world_size // (self.pipe * self.sequence * self.tensor)

    @property
    def sequence_data(self) -> int:
        """The size of the group ZeRO shards over and gradients are averaged over."""
        return self.data * self.sequence

    def degrees(self) -> dict[str, int]:
        return {"pipe": self.pipe, "data": self.data, "sequence": self.sequence, "tensor": self.tensor}

    def topology(self) -> ProcessTopology:
        degrees = self.degrees()
        return ProcessTopology(axes=list(AXES), dims=[degrees[a] for a in AXES])

    def groups(self, name: str) -> list[list[int]]:
        """The rank lists of the named group (GROUP_AXES) over the whole world."""
        if name not in GROUP_AXES:
            raise KeyError(f"unknown parallel group {name!r}; known: {sorted(GROUP_AXES)}")
        return axis_groups(self.topology(), GROUP_AXES[name])

    def ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group `name`."""
        return next(g for g in self.groups(name) if rank in g)


def expert_rank_groups(topology: ProcessTopology, expert_size: int,
                       data_before_expert: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """[Note: expert groups] The expert-parallel and expert-data-parallel rank lists of a layout.

    Experts are sharded over the ranks that replicate the dense model: each data-parallel pool (the
    ranks that differ only in `data` and `sequence`, i.e. ZeRO's group; for a pipeline topology, in
    `data`) is cut into expert-parallel groups of `expert_size` ranks. Upstream's default "E + D"
    order: expert groups are runs of consecutive pool members ([0, 1], [2, 3] of a pool of 4) and an
    expert-data-parallel group holds the members at the same position of every run ([0, 2], [1, 3]);
    the replicas of one expert shard average their gradients over it. `data_before_expert` ("D + E")
    swaps the two: expert-data groups are the runs, expert groups the strided sets. With tensor
    parallelism the pools are the tensor-strided data groups, as upstream's E + M + D example."""
    if isinstance(expert_size, bool) or not isinstance(expert_size, int) or expert_size < 1:
        raise ValueError(f"expert parallel size must be an integer >= 1, got {expert_size!r}")
    pool_axes = [a for a in ("data", "sequence") if a in topology.axes]
    experts: list[list[int]] = []
    replicas: list[list[int]] = []
    for pool in axis_groups(topology, pool_axes):
        if len(pool) % expert_size:
            raise ValueError(f"expert parallel size {expert_size} must divide the data-parallel size {len(pool)} "
                             f"(world {topology.world_size()} over {dict(zip(topology.axes, topology.dims))})")
        runs = [pool[i:i + expert_size] for i in range(0, len(pool), expert_size)]
        strided = [list(column) for column in zip(*runs)]
        if data_before_expert:
            width = len(pool) // expert_size
            replica_runs = [pool[i:i + width] for i in range(0, len(pool), width)]
            experts += [list(column) for column in zip(*replica_runs)]
            replicas += replica_runs
        else:
            experts += runs
            replicas += strided
    return experts, replicas


def folded_expert_rank_groups(topology: ProcessTopology, expert_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """AutoEP+AutoTP's expert layout (upstream's folding, module_inject/auto_ep_folding.py): expert
    groups are runs of `expert_size` consecutive ranks, which may span tensor groups (tensor is the
    fastest axis), and expert-data-parallel groups the ranks at the same position of every run. Needs
    a layout of data x tensor only (no sequence or pipe dim)."""
    from ..module_inject.auto_ep_folding import build_folding_spec, expected_folding_group_tables

    layout = dict(zip(topology.axes, topology.dims))
    if any(layout.get(axis, 1) > 1 for axis in ("sequence", "pipe")):
        raise ValueError(f"expert groups folded over the tensor dim need a data x tensor layout, got {layout}")
    spec = build_folding_spec(world_size=topology.world_size(), pp_size=1, tp_size=layout.get("tensor", 1),
                              ep_size=expert_size)
    tables = expected_folding_group_tables(spec)
    return [list(g) for g in tables.ep_groups], [list(g) for g in tables.edp_groups]


def expert_replica_rank_groups(experts: list[list[int]]) -> list[list[int]]:
    """The ranks holding the same experts: those at the same position of every expert group. It is
    the expert-data-parallel group, plus the tensor peers when the expert groups lie inside tensor
    lanes (upstream's E + M + D) and tokens are split over the tensor group ([Note: EP x TP folding])."""
    return [sorted(g[i] for g in experts) for i in range(len(experts[0]))]


def hpz_rank_groups(topology: ProcessTopology, partition_size: int) -> list[list[int]]:
    """[Note: hpZ node groups] The rank lists of ZeRO++ hpZ's secondary partition
    (`zero_hpz_partition_size`): each ZeRO pool (the ranks that differ only in `data` and
    `sequence`, ZeRO's group) is cut into runs of `partition_size` consecutive members, one "node"
    each ([0, 1], [2, 3] of a pool of 4 with size 2): consecutive ranks share a host under the
    launchers' rank order, so re-gathers inside a run stay on the host."""
    if isinstance(partition_size, bool) or not isinstance(partition_size, int) or partition_size < 1:
        raise ValueError(f"zero_hpz_partition_size must be an integer >= 1, got {partition_size!r}")
    runs: list[list[int]] = []
    for pool in axis_groups(topology, [a for a in ("data", "sequence") if a in topology.axes]):
        if len(pool) % partition_size:
            raise ValueError(f"zero_hpz_partition_size {partition_size} must divide ZeRO's group size {len(pool)} "
                             f"(world {topology.world_size()} over {dict(zip(topology.axes, topology.dims))})")
        runs += [pool[i:i + partition_size] for i in range(0, len(pool), partition_size)]
    return runs


def hpz_node_crossing(partition_size: int, ranks: list[int], rank: int, local_rank: int,
                      local_world_size: int | None) -> str | None:
    """Why this rank's hpZ group (`ranks`, global) is not inside its node, or None when it is (or
    when LOCAL_WORLD_SIZE is unknown). Its node: the launcher's block of consecutive ranks,
    `rank - local_rank` to that plus `local_world_size` ([Note: hpZ node groups])."""
    if local_world_size is None or local_world_size < 1:
        return None
    first = rank - local_rank
    node = range(first, first + local_world_size)
    if all(r in node for r in ranks):
        return None
    key = f"zero_optimization.zero_hpz_partition_size={partition_size}"
    if partition_size > local_world_size:
        why = f"is larger than the ranks of one node (LOCAL_WORLD_SIZE={local_world_size})"
    else:
        why = (f"makes hpZ groups (this rank's: {ranks}) that leave their node (ranks {first}-{node[-1]}, "
               f"LOCAL_WORLD_SIZE={local_world_size}): ZeRO's group strides over the other parallel dims")
    return (f"{key} {why}. hpZ's secondary partition then spans nodes: the re-gathers meant to stay inside "
            f"a node cross nodes, so hpZ saves no inter-node traffic while each rank still holds 1/"
            f"{partition_size} of every unit's parameters as its secondary copy. Training is correct; for "
            f"hpZ's saving set it to the ranks per node ({local_world_size}) or a divisor of it")
