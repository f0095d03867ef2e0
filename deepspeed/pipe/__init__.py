# compat: upstream `deepspeed.pipe`.
"""Pipeline parallelism's public names."""

from ..runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
