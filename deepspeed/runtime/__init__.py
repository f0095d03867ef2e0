"""`deepspeed.runtime`: engine, config, ZeRO, schedules. Submodules load on first attribute access."""

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
