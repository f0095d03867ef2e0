"""Process topologies: how global ranks map onto named parallelism axes, and the grid of groups.

`ProcessTopology(axes=["pipe", "data"], dims=[2, 3])` lays ranks out row-major over the axes
(the last axis varies fastest), so rank 4 is `ProcessCoord(pipe=1, data=1)`. Everything but
`PipelineParallelGrid` is a pure function of (axes, dims), tested without processes. The grid
creates the process groups and answers the `mpu` questions the engine and libraries ask.
"""

from __future__ import annotations

from typing import Any

from ... import comm as ds_comm
from ..parallel_dims import ProcessTopology, axis_groups  # noqa: F401  (ProcessTopology: re-exported)


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

        # every group comes from the one mesh owner of this layout (runtime/mesh.py)
        from ..mesh import ParallelMesh

        model_axes = tuple(a for a in self._topo.axes if a != "data")   # one whole model: all but data
        self.mesh = ParallelMesh(self._topo, {"model": model_axes, "data": ("data",), "pipe": ("pipe",),
                                              "slice": ("model",)})
        self.ds_model_group, self.ds_model_proc_group = self.mesh.ranks("model"), self.mesh.group("model")
        self.ds_model_rank = self.ds_model_group.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_group)
        self.dp_groups = axis_groups(self._topo, ("data",))
        self.dp_group, self.dp_proc_group = self.mesh.ranks("data"), self.mesh.group("data")
        self.pipe_groups = axis_groups(self._topo, ("pipe",))
        self.pp_group, self.pp_proc_group = self.mesh.ranks("pipe"), self.mesh.group("pipe")
        self.slice_group, self.slice_proc_group = self.mesh.ranks("slice"), self.mesh.group("slice")
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
