"""Engine events whose values may still be computing on the device.

A loss or gradient norm on a GPU becomes a number only when the device gets there; asking for it
(`.item()`) would stall the host. So a device value is copied to host memory without waiting,
with an event recorded behind the copy, and the event is written once the copy has landed
(normally by the next step). CPU values are numbers at once.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Event


class PendingEvents:
    """A queue of `(name, value, step)` whose values are resolved in order, without stalls."""

    def __init__(self) -> None:
        self._queue: list[tuple[str, Any, int, Any]] = []   # (name, host value, step, device event or None)

    def add(self, name: str, value: Any, step: int) -> None:
        if torch.is_tensor(value):
            value = value.detach()
            if value.device.type != "cpu":
                from ..accelerator import get_accelerator

                host = value.to("cpu", non_blocking=True)
                landed = get_accelerator().Event()
                landed.record()
                self._queue.append((name, host, step, landed))
                return
            value = value.item()
        self._queue.append((name, float(value), step, None))

    def ready(self, wait: bool = False) -> list[Event]:
        """The events whose values have landed, in order (all of them with `wait`)."""
        out = []
        for position, (name, value, step, landed) in enumerate(self._queue):
            if landed is not None:
                if not wait and not landed.query():
                    self._queue = self._queue[position:]
                    return out
                landed.synchronize()
            out.append((name, value.item() if torch.is_tensor(value) else value, step))
        self._queue = []
        return out

    def __len__(self) -> int:
        return len(self._queue)
