"""`deepspeed.checkpoint`: reading and converting DeepSpeed-layout checkpoints (files, reader, universal)."""

from .files import CheckpointError  # noqa: F401

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
