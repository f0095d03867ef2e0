"""The pure plan of moving AutoTP slices across tensor-parallel sizes (runtime/checkpoint/tp_reslice.py):
cutting a weight at TP=t, then assembling TP=t' slices from those pieces, gives exactly the TP=t' cut,
fused blocks included; no processes."""

from __future__ import annotations

import pytest
import torch

from deepspeed.checkpoint.files import CheckpointError
from deepspeed.runtime.checkpoint.tp_reslice import Segment, assemble, slice_sources


def _cut(full: torch.Tensor, dim: int, blocks, tp: int, index: int) -> torch.Tensor:
    """The layer's rule (TensorParallel_Layer._slice): each block split on its own."""
    parts = full.split(list(blocks or [full.shape[dim]]), dim)
    return torch.cat([b.narrow(dim, index * (b.shape[dim] // tp), b.shape[dim] // tp) for b in parts], dim)


@pytest.mark.parametrize("saved_tp,new_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("dim,blocks", [(0, None), (1, None), (0, [12, 12]), (0, [8, 4, 12])])
def test_assembled_slice_equals_the_new_cut(saved_tp, new_tp, dim, blocks):
    if blocks and any(b % saved_tp or b % new_tp for b in blocks):
        pytest.skip("blocks not divisible")
    full = torch.randn(24, 24)
    saved = [_cut(full, dim, blocks, saved_tp, r) for r in range(saved_tp)]
    reads = []

    def read(rank):
        reads.append(rank)
        return saved[rank].reshape(-1)   # the reader answers flat

    for index in range(new_tp):
        reads.clear()
        plan = slice_sources(24, blocks, saved_tp, new_tp, index)
        got = assemble(read, saved[0].shape, _cut(full, dim, blocks, new_tp, index).shape, dim, plan)
        assert torch.equal(got, _cut(full, dim, blocks, new_tp, index))
        assert reads == sorted(set(reads))   # each saved slice read once
        assert sum(s.length for s in plan) == 24 // new_tp


def test_plan_of_a_fused_weight_2_to_1():
    # [gate; up] each 8 wide, saved at TP=2: rank 0 holds gate[0:4], up[0:4]; rank 1 gate[4:8], up[4:8]
    assert slice_sources(16, [8, 8], 2, 1, 0) == [Segment(0, 0, 0, 4), Segment(1, 0, 4, 4),
                                                 Segment(0, 4, 8, 4), Segment(1, 4, 12, 4)]


def test_a_missing_field_on_a_saved_rank_gives_none():
    plan = slice_sources(4, None, 2, 1, 0)
    assert assemble(lambda r: torch.zeros(2) if r == 0 else None, [2], [4], 0, plan) is None


def test_indivisible_sizes_refused():
    with pytest.raises(CheckpointError, match="not divisible"):
        slice_sources(6, None, 2, 4, 0)


class _FlatReader:
    """A saved TP rank's reader over its slice: answers element ranges and records which it was asked."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value, self.asked = value.reshape(-1), []

    def groups(self):
        return [[("w", self.shape)]]

    def read(self, name, field, start=0, numel=None):
        numel = self.value.numel() - start if numel is None else numel
        self.asked.append((start, numel))
        return self.value[start:start + numel].clone()


@pytest.mark.parametrize("saved_tp,new_tp", [(2, 1), (1, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("shape,dim,blocks", [((24, 6), 0, None), ((24, 6), 0, [12, 12]), ((6, 24), 1, None),
                                              ((3, 24, 2), 1, None)])
def test_range_reads_equal_the_new_cut_and_ask_only_for_their_rows(saved_tp, new_tp, shape, dim, blocks):
    """A data-parallel piece of the new slice reads only the saved rows holding it (issue 39)."""
    from deepspeed.runtime.checkpoint.tp_reslice import TPReslicedReader

    full = torch.randn(*shape)
    for index in range(new_tp):
        saved = [_FlatReader(_cut(full, dim, blocks, saved_tp, r)) for r in range(saved_tp)]
        for r in saved:
            r.shape = _cut(full, dim, blocks, saved_tp, 0).shape
        want = _cut(full, dim, blocks, new_tp, index).reshape(-1)
        n = want.numel()
        for start, numel in [(0, n), (0, n // 2), (n // 2, n - n // 2), (5, 7), (n - 1, 1)]:
            for r in saved:
                r.asked.clear()
            reader = TPReslicedReader(saved, {"w": dim}, {"w": blocks} if blocks else {}, new_tp, index)
            assert torch.equal(reader.read("w", "fp32", start, numel), want[start:start + numel])
            asked = sum(a[1] for r in saved for a in r.asked)
            if numel < n // 2 and dim == 0:
                assert asked < n, (start, numel, asked)   # not the whole saved slices
