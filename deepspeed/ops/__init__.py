"""DeepSpeed ops: optimizers (``adam``, ``lamb``, ``lion``, ``adagrad``) in pure PyTorch.

Subpackages are deliberately not imported here, so ``import deepspeed.ops`` stays cheap;
import e.g. ``deepspeed.ops.adam`` to get ``FusedAdam`` and ``DeepSpeedCPUAdam``.
"""

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

_submodule = submodule_getattr(__name__)


def __getattr__(name: str):
    if name == "__compatible_ops__":  # upstream: which ops can run here (ours: those with a PyTorch equivalent)
        from ..git_version_info import compatible_ops

        return compatible_ops
    return _submodule(name)
