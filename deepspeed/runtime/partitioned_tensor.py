"""PartitionedTensor: a tensor split evenly (by elements) across the ranks of a group.

Each rank keeps its contiguous slice of the flattened tensor (`local_data`, boundaries from
`partition_uniform`); `full()` all-gathers the slices back into the original shape. `to_meta()`
is a small int64 tensor describing shape and split, so a receiver that got only its slice (a
pipeline stage receiving partitioned activations) can rebuild the object with `from_meta()`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import comm as ds_comm
from .layer_partition import partition_uniform


class PartitionedTensor:
    def __init__(self, tensor: torch.Tensor, group: Any = None, partition_meta: Optional[torch.Tensor] = None) -> None:
        self.group = group
        self.num_parts = ds_comm.get_world_size(group)
        self.rank = ds_comm.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        flat = tensor.detach().contiguous().view(-1)
        self.local_data = flat[self.partition[self.rank]:self.partition[self.rank + 1]].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> "PartitionedTensor":
        """Rebuild from `to_meta()` and this rank's slice (no communication)."""
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.orig_size = values[1:1 + ndim]
        obj.num_parts, obj.rank = values[1 + ndim], values[2 + ndim]
        obj.partition = values[3 + ndim:]
        if len(obj.partition) != obj.num_parts + 1 or obj.num_parts != ds_comm.get_world_size(group):
            raise ValueError(f"PartitionedTensor meta is for {obj.num_parts} parts, the group has "
                             f"{ds_comm.get_world_size(group)}")
        obj.orig_device = torch.device(device) if device is not None else local_part.device
        obj.local_data = local_part
        return obj

    def to_meta(self) -> torch.Tensor:
        """[ndim, *shape, num_parts, rank, *partition boundaries] as int64 on the original device."""
        values = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(values, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, all-gathered from every rank's slice (collective over `group`)."""
        device = torch.device(device) if device is not None else self.local_data.device
        sizes = [self.partition[p + 1] - self.partition[p] for p in range(self.num_parts)]
        chunk = max(sizes) if sizes else 0
        padded = torch.zeros(chunk, dtype=self.local_data.dtype, device=device)
        padded[:self.local_data.numel()] = self.local_data.to(device)
        gathered = torch.empty(chunk * self.num_parts, dtype=padded.dtype, device=device)
        if self.num_parts > 1:
            ds_comm.all_gather_into_tensor(gathered, padded, group=self.group)
        else:
            gathered.copy_(padded)
        rows = gathered.view(self.num_parts, chunk) if chunk else gathered.view(self.num_parts, 0)
        flat = torch.cat([rows[p, :sizes[p]] for p in range(self.num_parts)])
        return flat.view(self.orig_size)
