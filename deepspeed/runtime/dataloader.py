"""DeepSpeedDataLoader (a distributed-sampler DataLoader) and RepeatingLoader."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler


class RepeatingLoader:
    """Wrap an iterable so that it restarts when exhausted (an endless stream of batches)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.data_iter)
        except StopIteration:
            sampler = getattr(self.loader, "data_sampler", None) or getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch") and hasattr(sampler, "epoch"):
                sampler.set_epoch(sampler.epoch + 1)  # a new shuffle each pass, as a user would expect
            self.data_iter = iter(self.loader)
            batch = next(self.data_iter)
        return batch


class DeepSpeedDataLoader:
    """A DataLoader whose sampler gives each data-parallel rank its own slice of every epoch.

    `batch_size` is the micro batch per rank. With one rank and no sampler given, samples are
    drawn with a RandomSampler, as upstream does.
    """

    def __init__(self, dataset: Dataset, batch_size: int, pin_memory: bool = False, local_rank: int = 0,
                 tput_timer: Any = None, collate_fn: Callable | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Any = None, data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: dict | None = None) -> None:
        self.tput_timer = tput_timer
        self.batch_size = batch_size
        self.dataset = dataset
        if data_sampler is None:
            world = data_parallel_world_size or 1
            if world > 1:
                data_sampler = DistributedSampler(dataset, num_replicas=world, rank=data_parallel_rank or 0,
                                                  drop_last=dataloader_drop_last)
            else:
                data_sampler = RandomSampler(dataset)
        self.data_sampler = data_sampler
        self.num_local_io_workers = num_local_io_workers or 0
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn
        self.drop_last = dataloader_drop_last
        self.dataloader = DataLoader(dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
                                     num_workers=self.num_local_io_workers, pin_memory=pin_memory,
                                     drop_last=dataloader_drop_last)
        self.len = len(self.dataloader)
        self.data: Iterator | None = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> "DeepSpeedDataLoader":
        self.data = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self.data is None:
            self.data = iter(self.dataloader)
        if self.tput_timer is not None:
            self.tput_timer.start()
        return next(self.data)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return getattr(self.data_sampler, "epoch", 0)


def move_to_device(item: Any, device: torch.device) -> Any:
    """Recursively move tensors of a batch (tuples, lists, dicts) to `device`."""
    if torch.is_tensor(item):
        return item.to(device, non_blocking=True)
    if isinstance(item, (list, tuple)):
        moved = [move_to_device(x, device) for x in item]
        return type(item)(*moved) if hasattr(item, "_fields") else type(item)(moved)
    if isinstance(item, dict):
        return type(item)({k: move_to_device(v, device) for k, v in item.items()})
    return item
