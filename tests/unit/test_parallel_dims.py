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


def test_sequence_x_tensor_layout_is_the_documented_picture():
    # docs/sequence_parallel.md "With AutoTP": world 8 = data 2 x sequence 2 x tensor 2, tensor fastest
    dims = ParallelDims(8, sequence=2, tensor=2)
    assert dims.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("sequence") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("sequence_data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank in range(8):   # the TP peers of one SP rank hold the same sequence shard of the same replica
        coord = dims.topology().get_coord(rank)
        peers = [dims.topology().get_coord(r) for r in dims.ranks("tensor", rank)]
        assert all((p.data, p.sequence) == (coord.data, coord.sequence) for p in peers)


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


def test_expert_groups_follow_upstreams_orders():
    from deepspeed.runtime.parallel_dims import expert_rank_groups
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    # upstream's docstring examples: E + D on 16 ranks (ep 2), E + M + D with tensor 2 (ep 4)
    ep, edp = expert_rank_groups(ParallelDims(16).topology(), 2)
    assert ep[:3] == [[0, 1], [2, 3], [4, 5]] and edp == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    ep, edp = _get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    # D + E swaps them; a pipeline keeps each stage's experts inside the stage
    ep, edp = expert_rank_groups(ParallelDims(8).topology(), 2, data_before_expert=True)
    assert ep == [[0, 4], [1, 5], [2, 6], [3, 7]] and edp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ep, edp = expert_rank_groups(ParallelDims(8, pipe=2).topology(), 2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # sequence ranks are data ranks for experts (they replicate the dense model)
    assert expert_rank_groups(ParallelDims(4, sequence=2).topology(), 4)[0] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="expert parallel size 3 must divide the data-parallel size 4"):
        expert_rank_groups(ParallelDims(4).topology(), 3)


def test_hpz_groups_that_leave_their_node_are_named_with_their_cost():
    from deepspeed.runtime.parallel_dims import hpz_node_crossing

    # 2 nodes of 4: a partition of 4 is a node, of 8 spans both
    assert hpz_node_crossing(4, [4, 5, 6, 7], rank=5, local_rank=1, local_world_size=4) is None
    too_big = hpz_node_crossing(8, list(range(8)), rank=5, local_rank=1, local_world_size=4)
    assert too_big.startswith("zero_optimization.zero_hpz_partition_size=8 is larger than the ranks of one "
                              "node (LOCAL_WORLD_SIZE=4)")
    assert "saves no inter-node traffic" in too_big and "1/8" in too_big and "(4)" in too_big
    # small enough, but ZeRO's group strides over tensor parallelism: [0, 2] leaves the node [0, 1]
    topo = ProcessTopology(axes=["data", "tensor"], dims=[4, 2])
    from deepspeed.runtime.parallel_dims import hpz_rank_groups

    strided = hpz_rank_groups(topo, 2)[0]
    assert strided == [0, 2]
    message = hpz_node_crossing(2, strided, rank=0, local_rank=0, local_world_size=2)
    assert "leave their node (ranks 0-1, LOCAL_WORLD_SIZE=2)" in message and "[0, 2]" in message
    assert hpz_node_crossing(8, list(range(8)), rank=5, local_rank=1, local_world_size=None) is None
