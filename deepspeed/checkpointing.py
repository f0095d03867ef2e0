# compat: `deepspeed.checkpointing` is deepspeed.runtime.activation_checkpointing.checkpointing, as
# upstream. The attribute resolves through deepspeed/__init__.py's lazy table; this file makes
# `import deepspeed.checkpointing` give that same module object.
"""Alias of deepspeed.runtime.activation_checkpointing.checkpointing."""

import sys

from .runtime.activation_checkpointing import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
