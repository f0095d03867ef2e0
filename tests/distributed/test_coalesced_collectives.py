"""deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced (upstream's path): several
tensors in one reduce-scatter; each rank's chunk of each tensor's group mean, against a float64
reference computed from every rank's contribution, for sizes that divide the world, that do not,
and that are smaller than it (trailing ranks get empty chunks)."""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed

SIZES = ([6], [6, 3], [1], [7, 0, 13, 4])


def _contribution(rank: int, size: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(10 * rank + size), dtype=torch.float64)


def _coalesced_matches() -> list[str]:
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    failures = []
    for sizes in SIZES:
        for dtype in (torch.float32, torch.float16):
            tensors = [_contribution(rank, n).to(dtype) for n in sizes]
            outputs = reduce_scatter_coalesced(tensors, ds_comm.get_world_group())
            for n, out in zip(sizes, outputs):
                mean = sum(_contribution(r, n).to(dtype).double() / world for r in range(world))
                chunk = math.ceil(n / world)
                want = mean[rank * chunk:(rank + 1) * chunk]
                tol = 1e-6 if dtype == torch.float32 else 2e-3
                if out.shape != want.shape or not torch.allclose(out.double(), want, rtol=tol, atol=tol):
                    failures.append(f"{sizes} {dtype} tensor {n}: {tuple(out.shape)} vs {tuple(want.shape)}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_coalesced_gives_each_rank_its_chunk_of_the_mean(world: int) -> None:
    assert run_distributed(world, _coalesced_matches) == [[]] * world


def _quant_reduce_errors() -> list[float]:
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce

    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    shapes = ((30, 17), (5,), (3, 2))   # a 1-D tensor takes the unquantised path, as upstream
    tensors = [_contribution(rank, math.prod(s)).float().view(s) for s in shapes]
    errors = []
    for shape, out in zip(shapes, all_to_all_quant_reduce(tensors, {})):
        n = math.prod(shape)
        mean = sum(_contribution(r, n) for r in range(world)) / world
        chunk = math.ceil(n / world)
        want = mean[rank * chunk:(rank + 1) * chunk]
        bound = sum(_contribution(r, n).abs().max() for r in range(world)) / 254 / world
        assert out.shape == want.shape and out.dtype == torch.float32, (shape, out.shape, want.shape)
        errors.append(float((out.double() - want).abs().max() / bound) if want.numel() else 0.0)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_reduce_gives_each_rank_its_chunk_of_the_mean_within_the_int8_bound(world: int) -> None:
    """Upstream's qgZ entry point: the mean's chunk, within the block-wise int8 bound (1-D exact)."""
    for errors in run_distributed(world, _quant_reduce_errors):
        assert errors[0] <= 1.0 and errors[2] <= 1.0 and errors[1] < 1e-3, errors   # 1-D: fp32 rounding only


def test_multiple_all_gather_handles_forward_the_dependency_flag() -> None:
    from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles

    seen = []

    class Handle:
        def wait(self, *, handle_dependency: bool = True) -> None:
            seen.append(handle_dependency)

    MultipleAllGatherHandles([Handle(), Handle()]).wait(handle_dependency=False)
    MultipleAllGatherHandles([Handle()]).wait()
    assert seen == [False, False, True]


def _placeholder_shape_matches() -> bool:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import partitioned_param_data_shape

    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 2, "zero_optimization": {"stage": 3}}):
        layer = torch.nn.Linear(8, 8)
    return layer.weight.shape == torch.Size(partitioned_param_data_shape) and layer.weight.ds_numel == 64


def test_partitioned_param_data_shape_is_the_placeholder_shape() -> None:
    assert run_distributed(2, _placeholder_shape_matches) == [True, True]
