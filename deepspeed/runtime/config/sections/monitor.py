"""Monitor sections: `tensorboard`, `csv_monitor`, `wandb`, `comet` (upstream monitor/config.py)."""

from __future__ import annotations

from typing import Optional

from .base import DSModel, Int


class TensorBoardConfig(DSModel):
    """`tensorboard`: write training events for TensorBoard (needs the `tensorboard` package)."""

    enabled: bool = False
    """Log to TensorBoard."""
    output_path: str = ""
    """Directory for the event files ("": under the launch directory)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this job."""


class CSVMonitorConfig(DSModel):
    """`csv_monitor`: write training events to local CSV files."""

    enabled: bool = False
    """Log to CSV files."""
    output_path: str = ""
    """Directory for the CSV files ("": under the launch directory)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this job."""


class WandbConfig(DSModel):
    """`wandb`: log training events to Weights & Biases (needs the `wandb` package)."""

    enabled: bool = False
    """Log to WandB."""
    group: Optional[str] = None
    """WandB group name."""
    team: Optional[str] = None
    """WandB team (entity)."""
    project: str = "deepspeed"
    """WandB project."""


class CometConfig(DSModel):
    """`comet`: log training events to Comet ML (needs the `comet_ml` package, >= 3.41)."""

    enabled: bool = False
    """Log to Comet."""
    samples_log_interval: Int = 100
    """Log an event name again only after this many more samples."""
    project: Optional[str] = None
    """Comet project."""
    workspace: Optional[str] = None
    """Comet workspace."""
    api_key: Optional[str] = None
    """Comet API key."""
    experiment_name: Optional[str] = None
    """Experiment name."""
    experiment_key: Optional[str] = None
    """Experiment key."""
    online: Optional[bool] = None
    """Log online (True) or offline."""
    mode: Optional[str] = None
    """"get", "create" or "get_or_create"."""

