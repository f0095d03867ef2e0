# compat: upstream path `deepspeed.monitor.config`; the sections live in runtime/config/sections/monitor.py.
"""`DeepSpeedMonitorConfig` (the four monitor sections together) and `get_monitor_config`."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..runtime.config.sections.base import DSModel
from ..runtime.config.sections.monitor import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig

CSVConfig = CSVMonitorConfig  # upstream's name


class DeepSpeedMonitorConfig(DSModel):
    """`tensorboard`, `comet`, `wandb`, `csv_monitor`; `enabled` when any of them is."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """WandB monitor."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor."""

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled or self.comet.enabled


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a config dict (absent ones take their defaults)."""
    return DeepSpeedMonitorConfig(**{k: param_dict.get(k) or {} for k in ("tensorboard", "wandb", "csv_monitor",
                                                                          "comet")})


__all__ = ["DeepSpeedMonitorConfig", "get_monitor_config", "TensorBoardConfig", "WandbConfig", "CSVConfig",
           "CometConfig"]
