"""Helpers of deepspeed.elasticity (upstream module path)."""

import torch
from packaging import version


def is_torch_elastic_compatible() -> bool:
    """torch.distributed.elastic exists from torch 1.11 (upstream's check)."""
    return version.parse(torch.__version__.split("+")[0]) >= version.parse("1.11")
