"""hpZ (ZeRO++ `zero_hpz_partition_size`): a secondary copy of a unit's parameters partitioned
within a node, so that re-gathers stay inside it.

[Note: hpZ secondary partition]
ZeRO's group of N ranks is cut into "nodes" of n consecutive ranks (n divides N; the groups come
from the parallel mesh: parallel_dims.hpz_rank_groups, ParallelMesh.hpz_group). The primary
shard (1/N of each parameter, owned by the optimizer) is unchanged. The first gather of a unit
after its shards changed is the primary all-gather over all N ranks (it crosses the nodes); each
rank then cuts its secondary piece of every parameter -- elements [r*s', (r+1)*s') with
s' = ceil(numel/n), r its rank in the node -- from the gathered buffer: no communication. Every
later gather of the unit (backward's re-gathers, the next micro-steps' forwards) is an all-gather
of the secondary pieces over the node group only. The copy is dropped when the shards change
(the optimizer step: `ShardedUnit.refresh`, a GatheredParameters write, a `ds_tensor` write), so it
is refreshed once per optimizer step, by the next primary gather. Values are copied, never
computed, so hpZ gives bit-for-bit the parameters of plain stage 3 (with qwZ, the secondary holds
the dequantised values of the primary gather, and re-gathers send those unquantised inside the
node). Memory: 1/n of the unit in the parameters' dtype per rank, on the compute device.
Because n divides N, the primary buffer pads each parameter to a multiple of n (N*s >= n*s'), so
the secondary pieces are cut from and written to the primary buffer in place (UnitLayout with the
primary's offsets).
"""

from __future__ import annotations

from typing import Any

import torch

from .... import comm as ds_comm
from . import watchdog
from .unit_layout import UnitLayout
from .units import UnitSpec


class SecondaryShard:
    """One unit's hpZ copy: its piece within the node group, valid until the shards change."""

    def __init__(self, primary: UnitLayout, group: Any) -> None:
        self.group = group
        self.rank, self.world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
        if primary.world % self.world:
            raise ValueError(f"zero_hpz_partition_size {self.world} must divide ZeRO's group size {primary.world}")
        self.layout = UnitLayout(primary.numels, self.world, flat_offsets=primary.offsets)
        self.shard: torch.Tensor | None = None
        self.exact = False      # made from an unquantised gather (see [Note: qwZ quantized weight all-gather])

    @property
    def valid(self) -> bool:
        return self.shard is not None

    def invalidate(self) -> None:
        self.shard = None

    def take(self, flat: torch.Tensor, exact: bool) -> None:
        """Cut this rank's secondary piece from a freshly gathered primary buffer (no communication)."""
        self.shard, self.exact = self.layout.row(flat, self.rank), exact

    def gather_into(self, flat: torch.Tensor, spec: UnitSpec, phase: str,
                    start: bool = False) -> "watchdog.PendingGather | None":
        """All-gather the secondary pieces over the node group and write them into `flat`; `start`:
        return once issued, the write into `flat` done by the PendingGather's `finish()`."""
        received = torch.empty(self.layout.padded_numel, dtype=flat.dtype, device=flat.device)
        pending = watchdog.gather_or_copy(received, self.shard, self.group, spec, f"{phase} (hpZ)", start=start)
        if pending is not None:
            return pending.then(lambda: self.layout.unpack(received, flat))
        self.layout.unpack(received, flat)
        return None
