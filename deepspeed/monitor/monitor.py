"""Monitors: where training events go. `MonitorMaster` fans events out to the enabled backends.

An event is upstream's tuple `(name, value, step)`; the engine's names are `Train/Samples/...`
and its step is the number of samples trained so far (`engine.global_samples`). Backends write
on global rank 0 only; on other ranks every call is a no-op.
"""

from __future__ import annotations

from typing import Any, Sequence

from .. import comm as dist
from .comet import CometMonitor
from .csv_monitor import csvMonitor
from .tensorboard import TensorBoardMonitor
from .wandb import WandbMonitor

from .base import Event, Monitor  # noqa: F401 (upstream's names live here too)


class MonitorMaster(Monitor):
    """Every enabled backend of a `DeepSpeedMonitorConfig` (or anything with its four sections)."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        sections = {name: getattr(monitor_config, name) for name in ("tensorboard", "wandb", "csv_monitor", "comet")}
        self.enabled = any(section.enabled for section in sections.values())
        # Every rank checks the packages (the same on every rank), so a missing one fails all alike.
        if sections["tensorboard"].enabled:
            self.tb_monitor = TensorBoardMonitor(sections["tensorboard"])
        if sections["wandb"].enabled:
            self.wandb_monitor = WandbMonitor(sections["wandb"])
        if sections["csv_monitor"].enabled:
            self.csv_monitor = csvMonitor(sections["csv_monitor"])
        if sections["comet"].enabled:
            self.comet_monitor = CometMonitor(sections["comet"])

    def backends(self) -> list[Monitor]:
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor) if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        if dist.get_rank() != 0:
            return
        for backend in self.backends():
            backend.write_events(event_list)

    def close(self) -> None:
        for backend in self.backends():
            backend.close()


def monitor_config_of(model: Any) -> Any:
    """The monitor sections of a RootConfig as upstream's DeepSpeedMonitorConfig."""
    from .config import DeepSpeedMonitorConfig

    return DeepSpeedMonitorConfig(tensorboard=model.tensorboard, wandb=model.wandb, csv_monitor=model.csv_monitor,
                                  comet=model.comet)
