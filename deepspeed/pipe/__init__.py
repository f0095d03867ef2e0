# compat: upstream `deepspeed.pipe`.
"""Pipeline parallelism's public names (docs/pipeline.md)."""

from ..runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from ..runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineParallelGrid,
                                     ProcessTopology)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid"]
