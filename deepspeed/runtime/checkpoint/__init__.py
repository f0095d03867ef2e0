"""Engine-side checkpointing: what the engine's state looks like on disk (see engine_io.py)."""

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
