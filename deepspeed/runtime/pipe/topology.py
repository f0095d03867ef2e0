"""Process topologies: how global ranks map onto named parallelism axes, and the grid of groups.

`ProcessTopology(axes=["pipe", "data"], dims=[2, 3])` lays ranks out row-major over the axes
(the last axis varies fastest), so rank 4 is `ProcessCoord(pipe=1, data=1)`. Everything but
`PipelineParallelGrid` is a pure function of (axes, dims), tested without processes. The grid
creates the process groups and answers the `mpu` questions the engine and libraries ask.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

from ... import comm as ds_comm


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


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline × data parallelism: neighbouring ranks are data-parallel replicas of one stage."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline × data × tensor (model) parallelism, model-parallel ranks neighbours."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """The prime factors of n in ascending order, with multiplicity (upstream's helper name)."""
    if n < 1:
        raise ValueError(f"_prime_factors needs a positive integer, got {n}")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """Upstream's choice when no topology is given: the prime factors of the world size are dealt
    alternately to the pipe and data axes (pipe first), e.g. 12 = 2·2·3 -> pipe 6, data 2."""
    pipe, data = 1, 1
    for index, prime in enumerate(_prime_factors(world_size)):
        if index % 2 == 0:
            pipe *= prime
        else:
            data *= prime
    return PipeDataParallelTopology(num_pp=pipe, num_dp=data)


class PipelineParallelGrid:
    """The process groups of a topology and the `mpu` interface over them.

    Groups: data-parallel (same stage, all replicas), pipe (one replica's stages), model (all
    ranks with this rank's data coordinate: what holds one whole model; the engine sums gradient
    norms and agrees on overflow over it) and slice (tensor-parallel peers, or this rank alone).
    Every rank creates every group in the same order, as torch.distributed requires.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"PipelineParallelGrid: the topology has {self._topo.world_size()} ranks "
                             f"({dict(zip(self._topo.axes, self._topo.dims))}) but the world size is {self.world_size}")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        def groups_of(lists: list[list[int]]) -> tuple[list[int], Any]:
            mine, handle = [self.global_rank], None
            for ranks in lists:
                group = ds_comm.new_group(ranks=sorted(ranks))
                if self.global_rank in ranks:
                    mine, handle = list(ranks), group
            return mine, handle

        model_lists = [sorted(self._topo.get_axis_list("data", d)) for d in range(self.data_parallel_size)] \
            if "data" in self._topo.axes else [list(range(self.world_size))]
        self.ds_model_group, self.ds_model_proc_group = groups_of(model_lists)
        self.ds_model_rank = self.ds_model_group.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_group)
        self.dp_groups = self._topo.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]
        self.dp_group, self.dp_proc_group = groups_of(self.dp_groups)
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]
        self.pp_group, self.pp_proc_group = groups_of(self.pipe_groups)
        slice_lists = self._topo.get_axis_comm_lists("model") or [[r] for r in range(self.world_size)]
        self.slice_group, self.slice_proc_group = groups_of(slice_lists)
        self.p2p_groups = [[rank, ring[(ring.index(rank) + 1) % len(ring)]]
                           for rank in range(self.world_size) for ring in self.pipe_groups if rank in ring]

    def _is_grid_valid(self) -> bool:
        """Whether the topology covers exactly the world (checked at construction; upstream's name)."""
        return self._topo.world_size() == ds_comm.get_world_size()

    # --- coordinates -----------------------------------------------------------------------
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's replica (other axes may be overridden)."""
        coord = self._topo.get_coord(self.global_rank)._replace(**{"pipe": stage_id, **kwargs})
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    # --- the mpu interface -------------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group
