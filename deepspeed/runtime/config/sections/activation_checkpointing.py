"""`activation_checkpointing`: settings read by deepspeed.checkpointing.configure().

Defaults are DeepSpeed 0.19.8's (runtime/activation_checkpointing/config.py).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import DSModel, Int


class ActivationCheckpointingConfig(DSModel):
    """`activation_checkpointing`."""

    partition_activations: bool = False
    """Shard checkpointed activations across model-parallel ranks."""
    number_checkpoints: Optional[Int] = Field(None, ge=1)
    """Number of checkpoints (sizes the contiguous buffer); None: unknown."""
    contiguous_memory_optimization: bool = False
    """Copy partitioned activations into one contiguous buffer."""
    cpu_checkpointing: bool = False
    """Keep partitioned activations in CPU memory."""
    profile: bool = False
    """Time the checkpoint forward and backward passes."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary."""
