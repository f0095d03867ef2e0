# compat: upstream package deepspeed.runtime.fp16; the scalers live in deepspeed.runtime.precision.

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
