"""`checkpoint`: tag validation, universal loading and writer settings.

Defaults are DeepSpeed 0.19.8's (runtime/constants.py, runtime/model_checkpointing/constants.py).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from .base import DSModel, Int


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(DSModel):
    """`checkpoint.parallel_write`."""

    pipeline_stage: bool = False
    """Each pipeline stage writes its own part of the checkpoint."""


class CheckpointWriterConfig(DSModel):
    """`checkpoint.writer`: upstream's fast-writer knobs; the on-disk format does not change."""

    type: Literal["MOCK", "PYTHON", "FAST"] = "FAST"
    """Writer implementation (case-insensitive)."""
    io_buffer_size: Int = Field(64 * 1024**2, gt=0)
    """Bytes per I/O buffer."""
    io_buffer_double: bool = True
    """Double-buffer writes."""
    show_statistics: bool = False
    """Log write statistics."""
    data_parallel: Optional[Literal["REPLICA", "SOCKET", "MACHINE"]] = None
    """Which data-parallel ranks write (case-insensitive)."""
    decoupled: bool = False
    """Write from a separate process."""
    io_multiplier: Int = Field(1, ge=1)
    """I/O parallelism multiplier."""

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _upper_case(cls, value: Any) -> Any:
        return _upper(value)


class CheckpointConfig(DSModel):
    """`checkpoint`."""

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    """Check that all ranks save under the same tag: Ignore, Warn or Fail (case-insensitive)."""
    load_universal: bool = False
    """Load a universal (world-size independent) checkpoint."""
    use_node_local_storage: bool = False
    """Each node writes to its own local storage."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel checkpoint writing."""
    checkpoint_serialization: bool = True
    """Use torch.save's zipfile serialization."""
    writer: Optional[CheckpointWriterConfig] = None
    """Upstream fast-writer settings (None: the default torch.save writer)."""
    async_save: bool = False
    """This build's background save: save_checkpoint returns once the state is a snapshot in memory
    and each rank's thread writes, fsyncs and (rank 0) publishes the tag through directory
    descriptors opened before the return (renaming the save directory meanwhile is safe); the next
    save, load, deepspeed.initialize, engine.wait_for_checkpoint(), destroy() and process exit wait
    for it. false (the default, as upstream): the tag is written and published when save_checkpoint
    returns and only the fsyncs run in the background (docs/checkpointing.md)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper_case(cls, value: Any) -> Any:
        return _upper(value)

    @property
    def tag_validation_enabled(self) -> bool:
        return self.tag_validation != "IGNORE"

    @property
    def tag_validation_fail(self) -> bool:
        return self.tag_validation == "FAIL"
