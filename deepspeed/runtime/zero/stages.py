"""StageSpec: the only place a ZeRO stage number is interpreted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    shard_optimizer_state: bool   # fp32 master weights and optimizer state: 1/N per rank
    shard_gradients: bool         # gradients reduce-scattered after every backward, not only at the boundary
    shard_parameters: bool        # parameters gathered just in time (stage 3)


STAGES = {
    0: StageSpec(False, False, False),
    1: StageSpec(True, False, False),
    2: StageSpec(True, True, False),
    3: StageSpec(True, True, True),
}
