"""Pipeline parallelism (upstream deepspeed.runtime.pipe). Layer specs are here; the pipeline
module and engine are not built yet (constructing a PipelineModule says so)."""

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
