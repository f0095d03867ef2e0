"""The monitor interface: upstream's `Event` tuple and the `Monitor` base every backend derives
from (re-exported by monitor.py, upstream's module). Below the backends and MonitorMaster."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

Event = tuple[str, Any, int]


class Monitor(ABC):
    """A backend: `write_events(event_list)` with `(name, value, step)` tuples."""

    requires: Callable[[], None] | None = None
    """Raises when the backend's optional package is missing (checked only when enabled)."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config
        self.enabled = getattr(monitor_config, "enabled", True)
        if self.enabled and self.requires is not None:
            self.requires()

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None: ...

    def close(self) -> None:
        """Flush and release files (no-op by default)."""
