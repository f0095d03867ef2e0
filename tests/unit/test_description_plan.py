"""checkpoint/description.py: what a checkpoint's optimizer-state files hold, and the pure plan of a read.

Fragments and plans are checked against an element-by-element oracle written here from DeepSpeed's file
layouts (ZeRO-1/2 and stage-0 bf16: each group's parameters flattened in order, padded to a multiple of
alignment x N, cut in N equal shards; ZeRO-3: each parameter cut in N pieces of ceil(numel/N), the pieces
of a rank concatenated in parameter order over all groups).
"""

from __future__ import annotations

import time
import tracemalloc
from collections import OrderedDict

import pytest

from deepspeed.checkpoint.description import FLAT, PARAMWISE, Description, recorded_fragments
from deepspeed.checkpoint.files import CheckpointError

# two groups; sizes chosen so that padding is needed and parameters straddle shards (13, 7 odd)
SHAPES = [OrderedDict([("a.weight", (4, 13)), ("a.bias", (13,)), ("odd", (7,))]),
          OrderedDict([("b.weight", (3, 5)), ("b.bias", (3,))])]


def _oracle(shapes: list[dict], world: int, zero3: bool, alignment: int = 2) -> dict:
    """{(rank, flat, offset): (name, element index)} for every element the files hold."""
    where = {}
    if zero3:
        at = [0] * world
        for group in shapes:
            for name, shape in group.items():
                numel = _numel(shape)
                size = -(-numel // world)
                for r in range(world):
                    for k in range(size):
                        if r * size + k < numel:
                            where[(r, 0, at[r] + k)] = (name, r * size + k)
                    at[r] += size
        return where
    for g, group in enumerate(shapes):
        elements = [(n, k) for n, s in group.items() for k in range(_numel(s))]
        unit = alignment * world
        shard = -(-len(elements) // unit) * unit // world
        for at, element in enumerate(elements):
            where[(at // shard, g, at % shard)] = element
    return where


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _fragment_elements(desc: Description) -> dict:
    flat = desc.kind == FLAT
    return {(f.rank, f.group if flat else 0, f.flat_offset + k): (f.name, f.param_offset + k)
            for r in range(desc.world_size) for f in desc.fragments(r) for k in range(f.numel)}


CASES = [(w, z) for w in (1, 2, 3, 4, 7) for z in (False, True)]


@pytest.mark.parametrize("world, zero3", CASES)
def test_fragments_are_the_files_elements(world, zero3):
    desc = Description.derived(SHAPES, world, zero3)
    assert _fragment_elements(desc) == _oracle(SHAPES, world, zero3)


@pytest.mark.parametrize("world, zero3", CASES)
def test_plan_reads_every_element_once_where_the_files_hold_it(world, zero3):
    desc = Description.derived(SHAPES, world, zero3)
    where = {v: k for k, v in _oracle(SHAPES, world, zero3).items()}
    for group in SHAPES:
        for name, shape in group.items():
            numel = _numel(shape)
            for start, count in [(0, numel), (1, numel - 2), (numel // 2, 1), (numel, 0)]:
                covered = []
                for read in desc.plan(name, start, count):
                    for k in range(read.numel):
                        covered.append(read.out_offset + k)
                        assert where[(name, start + read.out_offset + k)] == (read.rank, read.flat,
                                                                              read.flat_offset + k)
                assert sorted(covered) == list(range(count)), (name, start, count)


@pytest.mark.parametrize("world, zero3", CASES)
def test_recorded_description_equals_derived(world, zero3):
    """What save records (ds_layout, each file's ds_fragments) reads back as the derived description."""
    desc = Description.derived(SHAPES, world, zero3)
    assert Description.from_layout(desc.layout(), SHAPES) == desc
    for rank in range(world):
        assert recorded_fragments(desc.record(rank), rank, "f") == desc.fragments(rank)
        desc.check_record(desc.record(rank), rank, "f")


def test_a_recorded_order_and_alignment_are_honoured():
    layout = {"version": 1, "kind": FLAT, "world_size": 2, "alignment": 4,
              "groups": [["odd", "a.bias", "a.weight"], ["b.bias", "b.weight"]]}
    desc = Description.from_layout(layout, SHAPES)
    shapes = [OrderedDict((n, SHAPES[g][n]) for n in names) for g, names in enumerate(layout["groups"])]
    assert _fragment_elements(desc) == _oracle(shapes, 2, False, alignment=4)
    assert desc != Description.derived(SHAPES, 2, False)


def test_size_does_not_grow_with_the_saved_rank_count():
    """O(params + groups) whatever N: building a Description makes no per-rank or per-element objects, and
    a plan holds one read per saved rank the slice spans."""
    shapes = [OrderedDict((f"p{i}", (64, 64)) for i in range(200))]
    sizes = []
    for world in (2, 1_000_000):
        tracemalloc.start()
        began = time.perf_counter()
        desc = Description.derived(shapes, world, zero3=world > 2)
        desc.partitions[0].placements(0, 0, 1)   # (its cached offsets built)
        took = time.perf_counter() - began
        sizes.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert took < 1.0
    assert sizes[1] < 2 * sizes[0], sizes
    flat = Description.derived(shapes, 10_000, zero3=False)   # shards of 82 elements: p100 spans 51 ranks
    assert len(flat.plan("p100")) == len({r.rank for r in flat.plan("p100")}) == 51
    zero3 = Description.derived(shapes, 1_000_000, zero3=True)
    assert len(zero3.fragments(5000)) == 0 and len(zero3.fragments(0)) == 200


def test_a_file_recording_other_fragments_is_named():
    desc = Description.derived(SHAPES, 2, False)
    record = desc.record(1)
    name, group, flat, param, numel = record["fragments"][0]
    record["fragments"][0] = (name, group, flat + 1, param, numel)
    with pytest.raises(CheckpointError) as error:
        desc.check_record(record, 1, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    text = str(error.value)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in text and repr(name) in text
    assert f"flat offset {flat + 1}" in text and f"flat offset {flat}," in text and "alignment 2" in text
    with pytest.raises(CheckpointError, match="kind 'paramwise'"):
        desc.check_record({**desc.record(0), "kind": PARAMWISE}, 0, "f")
    with pytest.raises(CheckpointError, match="version 9"):
        desc.check_record({**desc.record(0), "version": 9}, 0, "f")


@pytest.mark.parametrize("change, message", [
    ({"kind": "rows"}, "kind 'rows' is not one of"),
    ({"world_size": 0}, "world_size 0 must be a positive integer"),
    ({"alignment": "2"}, "alignment '2' must be a positive integer"),
    ({"version": 2}, "version 2 is not readable"),
    ({"groups": [["a.weight", "a.bias"], ["b.weight", "b.bias"]]}, "lack \\['odd'\\]"),
    ({"groups": [["a.weight", "a.bias", "odd", "b.bias"], ["b.weight", "b.bias"]]}, "listed twice"),
])
def test_bad_layout_is_named(change, message):
    layout = {**Description.derived(SHAPES, 2, False).layout(), **change}
    with pytest.raises(CheckpointError, match=message):
        Description.from_layout(layout, SHAPES)
