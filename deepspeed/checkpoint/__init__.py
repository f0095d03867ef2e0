"""`deepspeed.checkpoint`: reading and converting DeepSpeed-layout checkpoints (files, reader, universal)."""

from .constants import UNIVERSAL_CHECKPOINT_INFO  # noqa: F401  (upstream re-exports its constants here)
from .files import CheckpointError  # noqa: F401
from .deepspeed_checkpoint import DeepSpeedCheckpoint  # noqa: F401  (upstream's inspection API)
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc  # noqa: F401
from .zero_checkpoint import ZeROCheckpoint  # noqa: F401

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
