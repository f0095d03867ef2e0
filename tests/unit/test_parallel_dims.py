"""The parallel-dims rank plan (runtime/parallel_dims.py), without processes."""

import pytest

from deepspeed.runtime.parallel_dims import ParallelDims, ProcessTopology, axis_groups
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


def test_sequence_groups_follow_upstreams_order():
    # upstream's parallel_state_sp: sequence groups are consecutive runs, ZeRO's group spans data x sequence
    dims = ParallelDims(8, sequence=2)
    assert dims.data == 4 and dims.sequence_data == 8
    assert dims.groups("sequence") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.groups("sequence_data") == [list(range(8))]
    assert dims.groups("tensor") == [[r] for r in range(8)]
    assert dims.ranks("sequence", 5) == [4, 5] and dims.ranks("data", 5) == [1, 3, 5, 7]


def test_every_dim_composes_row_major():
    dims = ParallelDims(16, pipe=2, sequence=2, tensor=2)
    topo = dims.topology()
    assert topo.axes == ["pipe", "data", "sequence", "tensor"] and topo.dims == [2, 2, 2, 2]
    assert dims.groups("tensor")[:2] == [[0, 1], [2, 3]]
    assert dims.groups("sequence")[:2] == [[0, 2], [1, 3]]
    assert dims.groups("data")[:2] == [[0, 4], [1, 5]]
    assert dims.groups("sequence_data")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.groups("model")[0] == [0, 1, 8, 9]
    for name in ("data", "sequence", "sequence_data", "tensor", "pipe", "model"):
        flat = sorted(r for g in dims.groups(name) for r in g)
        assert flat == list(range(16)), name    # every group family partitions the world


def test_pipeline_topology_is_a_layout_of_the_same_kind():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert axis_groups(topo, ["data"]) == topo.get_axis_comm_lists("data")
    assert axis_groups(topo, ["pipe"]) == topo.get_axis_comm_lists("pipe")
    assert axis_groups(topo, []) == [[r] for r in range(8)]
    assert axis_groups(ProcessTopology(["x"], [3]), ["x"]) == [[0, 1, 2]]


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(world_size=6, sequence=4), "must be a multiple of pipe x sequence x tensor = 1 x 4 x 1 = 4"),
    (dict(world_size=4, sequence=0), "sequence must be an integer >= 1, got 0"),
    (dict(world_size=4, tensor=True), "tensor must be an integer >= 1, got True"),
])
def test_bad_degrees_name_the_dim(kwargs, fragment):
    with pytest.raises(ValueError, match="parallel dims") as info:
        ParallelDims(**kwargs)
    assert fragment in str(info.value)


def test_unknown_group_name():
    with pytest.raises(KeyError, match="unknown parallel group 'expert'"):
        ParallelDims(4).groups("expert")
