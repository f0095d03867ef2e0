# compat: upstream import path deepspeed.ops.transformer
"""The BERT transformer layer (upstream's "transformer kernel"), written in plain PyTorch."""

from .config import DeepSpeedTransformerConfig, TransformerConfig
from .transformer import DeepSpeedTransformerLayer

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
