"""DeepSpeed ops: optimizers (``adam``, ``lamb``, ``lion``, ``adagrad``) in pure PyTorch.

Subpackages are deliberately not imported here, so ``import deepspeed.ops`` stays cheap;
import e.g. ``deepspeed.ops.adam`` to get ``FusedAdam`` and ``DeepSpeedCPUAdam``.
"""

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
