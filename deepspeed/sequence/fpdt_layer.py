"""Upstream's FPDT (Fully Pipelined Distributed Transformer, "Ulysses-Offload") names, importable so that
code and tests importing them load; using them raises NotSupportedYet. FPDT chunks attention through
flash-attn kernels with CUDA-stream offloading of the chunks to host memory; this package has no such
kernels. Use `deepspeed.sequence.layer.DistributedAttention` (Ulysses), which runs on every device."""

from __future__ import annotations

from typing import Any

from ..runtime.errors import NotSupportedYet

_WHY = ("FPDT (Ulysses-Offload, flash-attn kernels with chunk offloading) is not implemented; use "
        "deepspeed.sequence.layer.DistributedAttention")


class FPDT_InputConstruct:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedYet(f"deepspeed.sequence.fpdt_layer.FPDT_InputConstruct: {_WHY}")


class _FPDTGPUOffloadingAttentionImpl_:
    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedYet(f"deepspeed.sequence.fpdt_layer._FPDTGPUOffloadingAttentionImpl_: {_WHY}")


class FPDT_Attention:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedYet(f"deepspeed.sequence.fpdt_layer.FPDT_Attention: {_WHY}")
