"""Affine maps of tensor-parallel shards (deepspeed/checkpoint/affine.py, [Note: affine maps]): the stored
form round-trips and is upstream's (a hand-written upstream dict loads), rebuild and extract are inverses,
and `plan` re-slices between two maps (TP 2->1, 1->2, 2->4, 4->2, fused and replicated) exactly; the
converter and the TP re-slice read a recorded map instead of the partition dims. No processes."""

from __future__ import annotations

import json

import pytest
import torch

from deepspeed.checkpoint.affine import (AffinePiece, ParamAffineMap, block_gather_map, contiguous_split_map, plan,
                                         replicated_map, segmented_map, sub_param_map)
from deepspeed.checkpoint.files import CheckpointError
from deepspeed.checkpoint.tp_maps import published, recorded_map, saved_map, split_map

BUILT = {
    "replicated": lambda: replicated_map((4, 6), 2),
    "replicated_scaled": lambda: replicated_map((4, 6), 3, scale=0.5),
    "scalar": lambda: replicated_map((), 2),
    "rows": lambda: contiguous_split_map((8, 6), [4, 4], 0),
    "cols_uneven": lambda: contiguous_split_map((6, 10), [3, 7], 1),
    "fused": lambda: sub_param_map((12, 4), [4, 8], [[2, 2], [4, 4]], 0),
    "fused_empty_rank": lambda: sub_param_map((12, 4), [4, 8], [[4, 0], [3, 5]], 0),
    "segmented": lambda: segmented_map((10, 3), [(4, False), (6, True)], 0, 2, [[2, 2]]),
    "gathered": lambda: block_gather_map((8, 2), {0: [0, 1, 3], 1: [2]}, 2, 0),
}


@pytest.mark.parametrize("kind", sorted(BUILT))
def test_round_trip_and_rebuild_extract_inverse(kind):
    amap = BUILT[kind]()
    amap.validate_coverage()
    stored = json.loads(json.dumps(amap.to_dict()))   # rank keys become strings, as in a JSON file
    assert ParamAffineMap.from_dict(stored) == amap == ParamAffineMap.from_dict(amap.to_dict())
    full = torch.randn(amap.logical_shape)
    shards = {r: amap.extract(full, r) for r in amap.shard_shapes}
    assert all(tuple(s.shape) == amap.shard_shapes[r] for r, s in shards.items())
    assert torch.allclose(amap.rebuild(shards), full, rtol=1e-7, atol=0)


def test_pieces_sit_where_the_builders_say():
    # [gate; up] of 4 rows each, 3 columns, TP=2: rank 1 holds gate rows 2-3, then up rows 6-7
    full = torch.arange(24.0).view(8, 3)
    amap = sub_param_map((8, 3), [4, 4], [[2, 2], [2, 2]], 0)
    assert torch.equal(amap.extract(full, 1), torch.cat([full[2:4], full[6:8]]))
    assert torch.equal(replicated_map((3,), 2, scale=0.5).extract(torch.ones(3), 1), torch.full((3,), 0.5))
    assert torch.equal(block_gather_map((8, 2), {0: [3, 0]}, 2, 0).extract(torch.arange(16.0).view(8, 2), 0),
                       torch.cat([torch.arange(12.0, 16).view(2, 2), torch.arange(4.0).view(2, 2)]))


def test_an_upstream_encoded_dict_loads():
    """Written by hand in DeepSpeed 0.19.8's encoding (as its `collect_autotp_universal_checkpoint_info` stores
    it, rank keys as a JSON file has them): a fused [gate; up] weight (8, 3) at TP=2 and a replicated norm."""
    def piece(source, dest, rank):
        return {"shape": [2, 3], "source": [source, [3, 1]], "dest": [dest, [3, 1]], "locations": [rank]}

    gate_up = {"logical_shape": [8, 3], "ranks": {
        "0": {"shard_shape": [4, 3], "pieces": [piece(0, 0, 0), piece(12, 6, 0)]},
        "1": {"shard_shape": [4, 3], "pieces": [piece(6, 0, 1), piece(18, 6, 1)]}}}
    norm = {"logical_shape": [3], "ranks": {r: {"shard_shape": [3], "pieces": [
        {"shape": [3], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1]}]} for r in ("0", "1")}}
    states = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {
        r"^mlp\.gate_up\.weight$": gate_up, r"^norm\.weight$": norm}}}}
    amap = recorded_map(states, "mlp.gate_up.weight", 2)
    assert amap == split_map((8, 3), 0, [4, 4], 2)   # what our layers publish for that layer
    assert recorded_map(states, "norm.weight", 2) == split_map((3,), None, None, 2)
    assert recorded_map(states, "other", 2) is None
    assert published({"^x$": amap})["params"]["^x$"] == amap.to_dict()


def test_a_newer_format_and_a_foreign_rank_count_are_refused():
    entry = {"universal_checkpoint_info": {"affine_map": {"version": 2, "params": {}}}}
    with pytest.raises(CheckpointError, match="format version 2"):
        recorded_map(entry, "w", 2)
    entry = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {
        "^w$": contiguous_split_map((4,), [2, 2], 0).to_dict()}}}}
    with pytest.raises(CheckpointError, match="holds 4"):
        recorded_map(entry, "w", 4)


def _execute(steps, shards, shape):
    """A plain executor of a plan: each box copied from its saved shard (narrow per dim)."""
    out = torch.full(shape, float("nan"))
    for s in steps:
        src, dst = shards[s.saved_rank], out
        for d, (a, b, n) in enumerate(zip(s.src, s.dst, s.shape)):
            src, dst = src.narrow(d, a, n), dst.narrow(d, b, n)
        dst.copy_(src * s.scale)
    return out


@pytest.mark.parametrize("saved_tp,new_tp", [(2, 1), (1, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("dim,blocks", [(None, None), (0, None), (1, None), (0, [8, 4, 12]), (1, [12, 12])])
def test_plan_reslices_to_the_new_cut(saved_tp, new_tp, dim, blocks):
    full = torch.randn(24, 12 if dim != 1 else 24)
    saved, running = split_map(full.shape, dim, blocks, saved_tp), split_map(full.shape, dim, blocks, new_tp)
    shards = {r: saved.extract(full, r) for r in range(saved_tp)}
    for rank in range(new_tp):
        steps = plan(saved, running, rank)
        assert torch.equal(_execute(steps, shards, running.shard_shapes[rank]), running.extract(full, rank))
        if dim is None:
            assert {s.saved_rank for s in steps} == {0}   # a replicated block from its lowest holder


def test_plan_of_a_fused_weight_2_to_1_reads_block_by_block():
    steps = plan(split_map((16, 2), 0, [8, 8], 2), split_map((16, 2), 0, [8, 8], 1), 0)
    assert [(s.saved_rank, s.src, s.dst, s.shape) for s in steps] == [
        (0, (0, 0), (0, 0), (4, 2)), (1, (0, 0), (4, 0), (4, 2)),   # gate rows 0-3, 4-7
        (0, (4, 0), (8, 0), (4, 2)), (1, (4, 0), (12, 0), (4, 2))]   # up rows 0-3, 4-7


def test_plan_refuses_what_it_cannot_move():
    with pytest.raises(ValueError, match="shape"):
        plan(split_map((4, 2), 0, None, 2), split_map((2, 4), 0, None, 2), 0)
    strided = ParamAffineMap((4,), {0: (2,), 1: (2,)}, {0: [AffinePiece((2,), 0, (2,), 0, (1,), [0])],
                                                        1: [AffinePiece((2,), 1, (2,), 0, (1,), [1])]})
    with pytest.raises(ValueError, match="not a block"):
        plan(strided, split_map((4,), 0, None, 1), 0)
    gap = contiguous_split_map((4,), [2, 2], 0)
    gap.pieces_by_rank[1] = []
    with pytest.raises(ValueError, match="hold 2 of the 4"):
        plan(gap, split_map((4,), 0, None, 1), 0)


def test_rebuild_checks_what_it_is_given():
    amap = contiguous_split_map((4,), [2, 2], 0)
    with pytest.raises(ValueError, match="ranks not given: \\[1\\]"):
        amap.rebuild({0: torch.zeros(2)})
    with pytest.raises(ValueError, match="3 elements"):
        amap.rebuild({0: torch.zeros(2), 1: torch.zeros(3)})
    with pytest.raises(ValueError, match="different values"):
        replicated_map((2,), 2).rebuild({0: torch.zeros(2), 1: torch.ones(2)})
    with pytest.raises(NotImplementedError, match="scaled piece"):
        replicated_map((2,), 2, scale=0.5).rebuild({0: torch.zeros(2)}, scale_power=-1)


def test_saved_map_is_recorded_else_derived():
    """`tp_maps.saved_map`: the recorded map wins; without one the partition dim / fused blocks describe it; a
    TP=1 (also universal) checkpoint is whole whatever maps its model states keep."""
    gathered = block_gather_map((8, 2), {0: [0, 2], 1: [1, 3]}, 2, 0)
    states = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {"^w$": gathered.to_dict()}}}}
    assert saved_map(states, "w", (4, 2), 2, 0, None) == gathered
    assert saved_map({}, "w", (4, 2), 2, 0, [4, 4]) == split_map((8, 2), 0, [4, 4], 2)
    assert saved_map(states, "w", (8, 2), 1, 0, None) == split_map((8, 2), None, None, 1)
    with pytest.raises(CheckpointError, match="gives tensor rank 0 a slice of"):
        saved_map(states, "w", (2, 2), 2, 0, None)


class _Reader:
    """A saved tensor rank: its slice, flat, and the model states every rank's file holds."""

    def __init__(self, value, states):
        self.value, self.shape, self.model_states = value.reshape(-1), value.shape, states

    def groups(self):
        return [[("w", self.shape)]]

    def read(self, name, field, start=0, numel=None):
        numel = self.value.numel() - start if numel is None else numel
        return self.value[start:start + numel].clone()


def _interleaved(full):
    """A layout the partition dim cannot say: heads 0, 2 on rank 0 and 1, 3 on rank 1, with its model states."""
    amap = block_gather_map(full.shape, {0: [0, 2], 1: [1, 3]}, 2, 0)
    states = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {"^w$": amap.to_dict()}}}}
    return [_Reader(amap.extract(full, r), states) for r in range(2)]


def test_tp_reslice_plans_from_the_recorded_map():
    from deepspeed.runtime.checkpoint.tp_reslice import TPReslicedReader

    full = torch.randn(8, 3)
    readers = _interleaved(full)
    assert torch.equal(TPReslicedReader(readers, {"w": 0}, {}, 1, 0).read("w", "fp32").view(8, 3), full)
    for index in range(4):
        got = TPReslicedReader(readers, {"w": 0}, {}, 4, index).read("w", "fp32")
        assert torch.equal(got, full[2 * index:2 * index + 2].reshape(-1))


def test_ds_to_universal_joins_by_the_recorded_map():
    from deepspeed.checkpoint.ds_to_universal import _joined, _Unit

    full = torch.randn(8, 3)
    readers = _interleaved(full)
    assert torch.equal(_joined(_Unit(readers, {"w": 0}, {}), "w", lambda r: r.value.view(r.shape)), full)
    asked = []
    norm = replicated_map((3,), 2)
    states = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {"^w$": norm.to_dict()}}}}
    unit = _Unit([_Reader(torch.ones(3), states), _Reader(torch.ones(3), states)], {}, {})
    assert torch.equal(_joined(unit, "w", lambda r: asked.append(r) or r.value), torch.ones(3))
    assert asked == [unit.readers[0]]   # a replicated parameter: tensor rank 0's value only


def test_tp_reslice_refuses_an_uneven_recorded_layout():
    """The executor moves even slices: a recorded uneven split (upstream can write one) is refused by name."""
    from deepspeed.runtime.checkpoint.tp_reslice import TPReslicedReader

    amap = contiguous_split_map((5, 2), [3, 2], 0)
    states = {"universal_checkpoint_info": {"affine_map": {"version": 1, "params": {"^w$": amap.to_dict()}}}}
    full = torch.randn(5, 2)
    readers = [_Reader(amap.extract(full, r), states) for r in range(2)]
    with pytest.raises(CheckpointError, match="'w'.*not an even split"):
        TPReslicedReader(readers, {"w": 0}, {}, 1, 0).read("w", "fp32")
