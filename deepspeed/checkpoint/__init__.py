"""`deepspeed.checkpoint`: reading and converting DeepSpeed-layout checkpoints (files, reader, universal)."""

from .constants import UNIVERSAL_CHECKPOINT_INFO  # noqa: F401  (upstream re-exports its constants here)
from .files import CheckpointError  # noqa: F401

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
