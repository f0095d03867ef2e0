"""Checkpoint engines: where upstream lets a storage backend (plain torch.save, Nebula, a fast
writer) take the writing of checkpoint files. `TorchCheckpointEngine` is the plain one; a
PipelineModule's `save_state_dict`/`load_state_dir` accept any object with its `save`/`load`.
The engine's own `save_checkpoint` writes through runtime/checkpoint (atomic publish of a tag)."""

from .checkpoint_engine import CheckpointEngine
from .torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointEngine", "TorchCheckpointEngine"]
