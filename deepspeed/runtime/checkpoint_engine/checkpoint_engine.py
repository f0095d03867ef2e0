"""The checkpoint engine interface (upstream's names): a backend implements save/load; `create`
and `commit` bracket one tag's files (a backend that writes asynchronously flushes in `commit`)."""

from __future__ import annotations

import os
from typing import Any


class CheckpointEngine:

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None

    def create(self, tag: str) -> None:
        """A new checkpoint (tag) begins."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        raise NotImplementedError

    def load(self, path: str, map_location: Any = None) -> Any:
        raise NotImplementedError

    def commit(self, tag: str) -> bool:
        """Every file of `tag` is written and durable."""
        return True

    def is_decoupled(self) -> bool:
        """True where saving continues in the background after `save` returns."""
        return False

    def preserves_storage_sharing(self) -> bool:
        """True where tensors sharing a storage are saved as views of one storage (torch.save)."""
        return True

    def cleanup(self) -> None:
        pass
