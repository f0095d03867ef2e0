"""Pinned host buffers for the offloaded optimizer (deepspeed/runtime/zero/host_buffers.py): when
they are asked for, and that the copies into them keep the values."""

import torch

from deepspeed.runtime.zero import host_buffers
from deepspeed.runtime.zero.host_buffers import DeviceToHost, host_copy, host_zeros, pinning

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class _Cuda:
    def device_name(self) -> str:
        return "cuda"


def test_pinning_only_for_a_cuda_accelerator_offloading_from_its_device(monkeypatch) -> None:
    if not torch.cuda.is_available():   # the CPU accelerator: torch cannot pin, nothing is asked
        assert not pinning(True, CPU, CPU) and not pinning(True, CUDA, CPU)
    monkeypatch.setattr(host_buffers, "get_accelerator", lambda: _Cuda())
    assert pinning(True, CUDA, CPU)
    assert not pinning(False, CUDA, CPU)        # offload_optimizer.pin_memory: false
    assert not pinning(True, CPU, CPU)          # nothing to copy from a device
    assert not pinning(True, CUDA, CUDA)        # not offloaded


def test_host_buffers_carry_the_pin_flag_to_the_allocation(monkeypatch) -> None:
    asked = []

    def allocate(shape, dtype, pin):
        asked.append(pin)
        return torch.empty(shape, dtype=dtype)   # a CPU-only torch cannot pin

    monkeypatch.setattr(host_buffers, "_allocate", allocate)
    source = torch.randn(5).to(torch.bfloat16)
    master = host_copy(source, torch.float32, True)
    assert master.dtype == torch.float32 and torch.equal(master, source.float())
    grad = host_zeros(master, True)
    assert asked == [True, True] and grad.dtype == torch.float32 and not grad.any()
    copies = DeviceToHost()
    copies.copy(grad, torch.ones(5), pinned=True)
    copies.wait()
    assert copies.asynchronous == 1 and torch.equal(grad, torch.ones(5))
