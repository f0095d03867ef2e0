# compat: upstream `deepspeed.moe.layer`.
"""`MoE`: importable and subclassable, so code that imports it (or offers it as an option) loads;
constructing one raises until expert parallelism is implemented."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.errors import NotSupportedYet


class MoE(torch.nn.Module):
    """Upstream's expert-parallel layer. Constructing one raises NotSupportedYet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedYet("deepspeed.moe.layer.MoE: Mixture of Experts (expert parallelism) is not implemented "
                              "in this build of deepspeed. Use a plain PyTorch MoE block (ZeRO-3 leaf modules "
                              "handle data-dependent routing: zero_optimization.leaf_module), or DeepSpeed itself.")


__all__ = ["MoE"]
