"""torch.save / torch.load as a checkpoint engine."""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint_engine import CheckpointEngine


class TorchCheckpointEngine(CheckpointEngine):

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        # Checkpoints hold optimizer state and client objects, not only tensors (as upstream's).
        return torch.load(path, map_location=map_location, weights_only=False)
