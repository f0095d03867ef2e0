"""Weights & Biases monitor (needs the `wandb` package)."""

from __future__ import annotations

from typing import Any, Sequence

from .. import comm as dist
from .base import Event, Monitor
from .utils import check_wandb_availability


class WandbMonitor(Monitor):
    """`wandb.init(project, group, entity=team)` on rank 0; each event is `wandb.log({name: value}, step=step)`."""

    requires = staticmethod(check_wandb_availability)

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        self.group, self.team, self.project = wandb_config.group, wandb_config.team, wandb_config.project
        if self.enabled and dist.get_rank() == 0:
            import wandb

            wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict, step: int | None = None, commit: bool | None = None) -> Any:
        if self.enabled and dist.get_rank() == 0:
            import wandb

            return wandb.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            self.log({name: value}, step=step)
