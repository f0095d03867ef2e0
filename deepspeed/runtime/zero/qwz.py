"""qwZ (ZeRO++ `zero_quantized_weights`): ZeRO-3's parameter all-gather with int8 on the wire.

[Note: qwZ quantized weight all-gather]
The hook-driven gathers of stage 3 (forward, backward re-gathers, prefetches, persistent units'
refresh after a step) send each rank's shard as int8 with one fp32 scale per block of
`QGZ_BLOCK` elements, qgZ's block-wise quantiser (zero/qgz.py: scale = max|block| / 127,
round to nearest; the bytes ratio is qgz.wire_ratio), instead of the shard in the parameters' dtype:

1. every rank quantises its shard (S elements) into one payload row [S int8 | scales as bytes];
2. one `all_gather_into_tensor` of int8 rows -- (1 + 4 / QGZ_BLOCK) bytes per element instead
   of 4 (fp32) or 2 (bf16): 0.254x of fp32's all-gather bytes, 0.508x of bf16's;
3. every rank dequantises all N rows (its own included, so every rank computes with the same
   full parameter) into the rank-major gather buffer, in the parameters' dtype.

Each element of the gathered parameter is within max|block| / 254 of the exact value (plus
the rounding to the parameters' dtype). Only what forward and backward compute with is
quantised: the shards, the optimizer's fp32 masters and the gradients are untouched, so the
error does not accumulate across steps. Gathers that must be exact stay exact: GatheredParameters
(whose `modifier_rank` writes back into the shards; a unit gathered quantised by a hook is
gathered again exactly when a block asks for it), `gather_full` (checkpoints, safe_get_full_*)
and zero.Init's own gathers before initialize.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm.bounded import all_gather_into_tensor_within, start_all_gather_into_tensor_within
from ...comm.gloo_collectives import Composite
from .qgz import QGZ_BLOCK, dequantize_blockwise, quantize_blockwise


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, timeout_s: float,
                         label: Any = None, block: int = QGZ_BLOCK, start: bool = False) -> Any:
    """`out` (N x S, rank-major, any float dtype) = every rank's `shard` (S elements), sent as
    int8 + per-block scales; see [Note: qwZ quantized weight all-gather]. `start`: return once the
    all-gather is issued, with a Work whose `wait()` completes it and dequantises into `out` (a
    prefetch); else None, done."""
    width = shard.numel()
    world = out.numel() // max(width, 1)
    q, scales = quantize_blockwise(shard.detach().reshape(1, width), block)
    sent = torch.cat([q, scales.view(torch.int8)], dim=1).view(-1)
    received = torch.empty(world * sent.numel(), dtype=torch.int8, device=shard.device)

    def dequantize() -> None:
        rows = received.view(world, -1)
        values = dequantize_blockwise(rows[:, :width], rows[:, width:].contiguous().view(torch.float32), block)
        out.view(world, width).copy_(values)

    if start:
        return Composite([start_all_gather_into_tensor_within(received, sent, timeout_s, group, label=label)],
                         dequantize)
    all_gather_into_tensor_within(received, sent, timeout_s, group, label=label)
    dequantize()
    return None


class TorchQuantizerKernels:
    """The calls upstream's compiled QuantizerBuilder op answers, in plain PyTorch: symmetric int8
    over `groups` equal groups (qgZ's block-wise quantiser), fp16 out of `dequantize` as the op."""

    Symmetric, Asymmetric = 0, 1

    @staticmethod
    def _check(num_bits: int, quant_type: int) -> None:
        if num_bits != 8 or quant_type != TorchQuantizerKernels.Symmetric:
            raise NotImplementedError(f"quantizer: num_bits={num_bits}, quant_type={quant_type}; this build has "
                                      "symmetric 8-bit groups only (num_bits=8, quant_type=Symmetric)")

    def quantize(self, param: torch.Tensor, groups: int, num_bits: int, quant_type: int) -> tuple:
        self._check(num_bits, quant_type)
        q, scales = quantize_blockwise(param.reshape(1, -1).float(), param.numel() // groups)
        return q.view(-1), scales.view(-1)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, num_groups: int, num_bits: int,
                   quant_type: int) -> torch.Tensor:
        self._check(num_bits, quant_type)
        return dequantize_blockwise(q.reshape(1, -1), scale.reshape(1, -1), q.numel() // num_groups).view(-1).half()


class CUDAQuantizer:
    """Upstream's ZeRO++ weight quantiser (`partition_parameters.CUDAQuantizer`): int8 groups of at
    most `target_group_size` elements through `quantizer_cuda_module` (here TorchQuantizerKernels
    unless one is set). The op reads fp16, so `quantize` hands it fp16; `dequantize(dtype=)` gives a
    parameter back in its own dtype (a bf16 model's weights must not come back fp16)."""

    async_flag = True
    target_group_size = 8000
    group_size_cache: dict[int, int] = {}
    quantizer_cuda_module: Any = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = TorchQuantizerKernels()

    def _groups(self, numel: int) -> int:
        """Fewest equal groups of at most target_group_size elements (numel itself if none divides)."""
        if numel not in self.group_size_cache:
            groups = max(1, -(-numel // self.target_group_size))
            while numel % groups:
                groups += 1
            self.group_size_cache[numel] = groups
        return self.group_size_cache[numel]

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple:
        groups = self._groups(param.numel()) if groups is None else groups
        module = self.quantizer_cuda_module
        return module.quantize(param.to(dtype=torch.half), groups, 8, module.Symmetric)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None):
        module = self.quantizer_cuda_module
        out = module.dequantize(quantized_param, scale, scale.numel(), 8, module.Symmetric)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)
