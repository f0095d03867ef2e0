"""Pipeline parallelism (upstream deepspeed.runtime.pipe): layer specs and PipelineModule
(module.py), topologies and process grids (topology.py), schedules (schedule.py), stage-to-stage
transfers (p2p.py) and the PipelineEngine (engine.py). docs/pipeline.md is the user's guide."""

from .module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401  (upstream re-exports these)
from .topology import ProcessTopology  # noqa: F401

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
