"""Upstream's ZeRO++ weight quantiser at its path (`partition_parameters.CUDAQuantizer`, qwz.py):
int8 groups in plain PyTorch, the error bound of qgZ's quantiser, and the caller's dtype back."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_within_half_a_step_per_group_and_in_the_parameters_dtype(dtype):
    param = (torch.randn(3 * 8000 + 24, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    quantizer = CUDAQuantizer()
    q, scale = quantizer.quantize(param)
    groups = scale.numel()
    assert q.dtype == torch.int8 and groups == 4 and param.numel() % groups == 0   # equal groups <= 8000
    back = quantizer.dequantize(q, scale, dtype=param.dtype)
    assert back.dtype == dtype and back.shape == param.shape
    step = param.float().view(groups, -1).abs().amax(dim=1, keepdim=True) / 127   # per group
    rounding = param.float().abs() * (torch.finfo(dtype).eps + torch.finfo(torch.half).eps)   # fp16 in, dtype out
    err = (back.float() - param.float()).abs()
    assert bool((err.view(groups, -1) <= step / 2 * 1.001 + rounding.view(groups, -1)).all())
    assert quantizer.dequantize(q, scale).dtype == torch.half   # without dtype: the op's fp16


def test_other_bit_widths_are_refused_by_name():
    module = CUDAQuantizer().quantizer_cuda_module
    with pytest.raises(NotImplementedError, match="num_bits=4"):
        module.quantize(torch.ones(8, dtype=torch.half), 1, 4, module.Symmetric)
