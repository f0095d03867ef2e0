"""`pipeline`: pipeline-engine settings (upstream runtime/config.py get_pipeline_config)."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from .base import DSModel, Int


class PipelineConfig(DSModel):
    """`pipeline`."""

    stages: Union[int, str] = "auto"
    """Number of pipeline stages ("auto": taken from the PipelineModule)."""
    partition: str = "best"
    """Partitioning method hint."""
    seed_layers: bool = False
    """Use a different seed for each layer."""
    activation_checkpoint_interval: Int = Field(0, ge=0)
    """Checkpoint every N layers (0: off)."""
    pipe_partitioned: bool = True
    """Partition activations sent between stages over the model-parallel group."""
    grad_partitioned: bool = True
    """Partition gradients sent between stages over the model-parallel group."""
    use_reentrant: Optional[bool] = None
    """Reentrant activation checkpointing inside the pipeline (None: True, as upstream)."""

    @field_validator("stages", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Union[int, str]:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            raise PydanticCustomError("ds_expected", 'expected "auto" or an integer >= 1')
        return int(value)
