"""Layer specifications for pipeline models, and PipelineModule (not built yet in this package).

A spec records how to build a layer without building it, so a pipeline stage constructs only
its own layers (a model too large for one process never exists whole).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import NotSupportedYet


class LayerSpec:
    """`LayerSpec(torch.nn.Linear, 4, 8)` builds `torch.nn.Linear(4, 8)` when `build()` is called."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, torch.nn.Module):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters (`tied_weight_attr`) are shared by every spec with the same `key`."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class PipelineModule(torch.nn.Module):
    """Upstream's pipeline model container. Subclassing works (libraries and tests define
    subclasses at import time); constructing one raises until pipeline parallelism lands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedYet("deepspeed.pipe.PipelineModule: pipeline parallelism is not implemented yet in this "
                              "build of deepspeed (LayerSpec and TiedLayerSpec are). Train the model without "
                              "pipeline stages, or use DeepSpeed itself for pipeline parallelism.")
