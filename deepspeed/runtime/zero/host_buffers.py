"""Offloaded optimizer partitions in pinned host memory: [Note: pinned optimizer offload].

[Note: pinned optimizer offload]
With `offload_optimizer: {device: "cpu", pin_memory: true}` (the default, as upstream's) and
parameters on a CUDA device, each shard's fp32 master and its host copy of the reduced gradient
slice are allocated page-locked. At the step the device-to-host gradient copies are then issued
all at once with `non_blocking=True` (full-bandwidth DMA, no staging through a pageable bounce
buffer, no host wait per shard) and the host waits once, for the copying stream, before the CPU
optimizer (and the overflow check) reads them. Host-to-device copies of the updated masters stay
blocking: a later in-place write of a master (the next step, a checkpoint load) must not race an
unfinished copy. Without CUDA (a CPU-only machine, where torch cannot pin) or with
`pin_memory: false`, the buffers are ordinary host tensors and every copy blocks, exactly as
before. `pinning` decides; `host_copy` / `host_zeros` are the only allocations; `DeviceToHost`
issues the copies and the one wait.
"""

from __future__ import annotations

import torch

from ...accelerator import get_accelerator

HOST = torch.device("cpu")   # host: the offload target


def pinning(requested: bool, source: torch.device, target: torch.device) -> bool:
    """Whether host buffers filled from `source` should be pinned: asked for, the target is the
    host, and the data comes from a CUDA device of the CUDA accelerator (deepspeed.accelerator:
    DS_ACCELERATOR, else CUDA when available), the only case where torch can pin and it pays."""
    return bool(requested) and target.type == "cpu" and source.type == "cuda" and \
        get_accelerator().device_name() == "cuda"


def _allocate(shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=HOST, pin_memory=pin)


def host_copy(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host copy of `tensor` in `dtype` (a new master), pinned if `pin`."""
    out = _allocate(tensor.shape, dtype, pin)
    out.copy_(tensor.detach())
    return out


def host_zeros(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """Zeros shaped and typed as `like`, on the host, pinned if `pin`."""
    return _allocate(like.shape, like.dtype, pin).zero_()


class DeviceToHost:
    """Copies into host buffers, asynchronous where the buffer is pinned; `wait()` before the host
    reads any of them."""

    def __init__(self) -> None:
        self.streams: list[torch.cuda.Stream] = []
        self.asynchronous = 0   # copies issued with non_blocking=True (read by tests)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool) -> None:
        if pinned and src.device.type == "cuda":
            dst.copy_(src, non_blocking=True)
            self.asynchronous += 1
            stream = torch.cuda.current_stream(src.device)
            if stream not in self.streams:
                self.streams.append(stream)
        else:
            dst.copy_(src, non_blocking=pinned)   # CPU to CPU: synchronous whatever the flag
            self.asynchronous += int(pinned)

    def wait(self) -> None:
        for stream in self.streams:
            stream.synchronize()
        self.streams.clear()
