# compat: `from deepspeed.accelerator import get_accelerator`
from .real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
