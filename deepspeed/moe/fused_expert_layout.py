"""Which of the two fused gate/up expert layouts a pair of 3-D expert tensors uses (shapes only).

Transformers 5.x stores `gate_up_proj` as [E, 2F, H] with `down_proj` [E, H, F] ("gate_up_first");
some checkpoints store the transposes, [E, H, 2F] with [E, F, H] ("hidden_first"). AutoEP's
repacking (ep_repack.py) needs to know which, to cut gate and up apart and transpose when needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class FusedGateUpLayout:
    layout: str   # "gate_up_first" or "hidden_first"
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(gate_up_shape: Sequence[int], down_shape: Sequence[int]) -> Optional[FusedGateUpLayout]:
    """The layout of fused gate_up [E, 2F, H] / down [E, H, F] (or their transposes); None when the
    shapes fit neither (not 3-D, an odd fused dimension, disagreeing expert counts)."""
    gate_up, down = tuple(gate_up_shape), tuple(down_shape)
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        return None
    _, a, b = gate_up
    if a % 2 == 0 and down[1:] == (b, a // 2):
        return FusedGateUpLayout("gate_up_first", hidden_size=b, ffn_hidden_size=a // 2, needs_transpose=False)
    if b % 2 == 0 and down[1:] == (b // 2, a):
        return FusedGateUpLayout("hidden_first", hidden_size=a, ffn_hidden_size=b // 2, needs_transpose=True)
    return None
