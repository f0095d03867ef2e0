"""moe_ds_ep: the names of DeepSpeed's positional MoE optimizer state at another ep_size (pure, no process)."""

from __future__ import annotations

import pytest

from deepspeed.checkpoint.files import CheckpointError
from deepspeed.runtime.checkpoint.moe_ds_ep import saved_positions

def _name(layer: int, expert: int, param: str) -> str:
    return f"moe{layer}.deepspeed_moe.experts.deepspeed_experts.{expert}.{param}"


def _renamed(ep_rank: int, local: int, layers: int = 1) -> dict:
    """{local name: (layer, global id, global name)} of an engine holding `local` experts at `ep_rank`."""
    return {_name(layer, j, p): (layer, ep_rank * local + j, _name(layer, ep_rank * local + j, p))
            for layer in range(layers) for j in range(local) for p in ("w", "b")}


def test_positions_of_each_saved_rank_from_one_rank_holding_all_experts() -> None:
    renamed = _renamed(0, 4, layers=2)
    names = ["inp"] + list(renamed) + ["out"]   # registration order: layer 0's experts, then layer 1's
    got = saved_positions("ckpt", 1, names, renamed, [4, 4], saved_ep=2, ep_rank=1)
    assert got == ["inp"] + [_name(layer, g, p) for layer in range(2) for g in (2, 3) for p in ("w", "b")] + ["out"]


def test_positions_of_experts_this_rank_does_not_hold() -> None:
    """Running at ep=4 (one expert), the saved ep=1 rank's group still names all four."""
    renamed = _renamed(3, 1)
    got = saved_positions("ckpt", 0, list(renamed), renamed, [4], saved_ep=1, ep_rank=0)
    assert got == [_name(0, g, p) for g in range(4) for p in ("w", "b")]


def test_parameter_major_order_is_refused() -> None:
    renamed = _renamed(0, 2)
    names = sorted(renamed, key=lambda n: (n.endswith("w"), n))   # all biases, then all weights
    with pytest.raises(CheckpointError, match="group 3 lists MoE layer 0's expert parameters"):
        saved_positions("ckpt", 3, names, renamed, [2], saved_ep=2, ep_rank=0)


def test_layer_split_over_two_runs_is_refused() -> None:
    renamed = _renamed(0, 2)
    names = list(renamed)
    with pytest.raises(CheckpointError, match="more than one run"):
        saved_positions("ckpt", 0, names[:2] + ["dense"] + names[2:], renamed, [2], saved_ep=2, ep_rank=0)
