"""A tiny device facade (cuda or cpu) with the upstream `get_accelerator()` method names.

Third-party code (Hugging Face, Lightning) calls these names; our runtime uses only a few of
them. Selection: `DS_ACCELERATOR=cpu|cuda` if set, else cuda when available, else cpu.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class _Accelerator:
    """Methods shared by both devices; subclasses fix the device name and backend."""

    _name = "cpu"
    _communication_backend = "gloo"

    # identity ---------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def communication_backend_name(self) -> str:
        return self._communication_backend

    def random(self) -> Any:
        """torch's RNG module (`fork_rng`, `manual_seed`, ...), as upstream's accelerators return."""
        return torch.random

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # dtypes -----------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    # tensor constructors used by old code (and upstream's tests: `ByteTensor(list(bytes))`) ---------
    def _typed(self, dtype: torch.dtype) -> Any:
        return lambda *a, **k: torch.tensor(*a, dtype=dtype, device=self.device_name(), **k)

    FloatTensor = property(lambda self: self._typed(torch.float32))  # noqa: N815 - upstream names
    BFloat16Tensor = property(lambda self: self._typed(torch.bfloat16))  # noqa: N815
    HalfTensor = property(lambda self: self._typed(torch.float16))  # noqa: N815
    DoubleTensor = property(lambda self: self._typed(torch.float64))  # noqa: N815
    ByteTensor = property(lambda self: self._typed(torch.uint8))  # noqa: N815
    IntTensor = property(lambda self: self._typed(torch.int32))  # noqa: N815
    LongTensor = property(lambda self: self._typed(torch.int64))  # noqa: N815

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Upstream's API for its native pinned allocator; memory pinned by torch is unpinned when
        the tensor is freed, so there is nothing to do."""
        return None

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    def __repr__(self) -> str:
        return f"<accelerator {self._name} backend={self._communication_backend}>"


class CPU_Accelerator(_Accelerator):  # noqa: N801 - upstream name
    _name = "cpu"
    _communication_backend = "gloo"

    def device_count(self) -> int:
        """As upstream's CPU accelerator: the launcher's LOCAL_SIZE (processes on this node), else
        the number of NUMA nodes that have cores, else 1."""
        local = os.environ.get("LOCAL_SIZE", "")
        if local.isdigit() and int(local) > 0:
            return int(local)
        return _numa_nodes_with_cores()

    def device_name(self, device_index: int | None = None) -> str:
        """Always "cpu", as upstream's CPU accelerator: torch reports every CPU tensor's device as
        plain `cpu`, so `tensor.device == torch.device(device_name(i))` holds."""
        return "cpu"

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def empty_cache(self) -> None:
        pass

    def _rss(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        pass  # the kernel's max RSS cannot be reset; documented limitation

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().available

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {"allocated_bytes.all.current": self._rss()}


class CUDA_Accelerator(_Accelerator):  # noqa: N801 - upstream name
    _name = "cuda"
    _communication_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def __getattr__(self, name: str) -> Any:
        """Everything else (device_count, synchronize, memory stats, rng) is torch.cuda's own."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(torch.cuda, name)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free


_ACCELERATOR: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    """The process-wide accelerator, chosen once."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        choice = os.environ.get("DS_ACCELERATOR", "").lower()
        if choice not in ("", "cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={choice!r} is not supported; expected 'cpu' or 'cuda'")
        if choice == "cuda" or (choice == "" and torch.cuda.is_available()):
            _ACCELERATOR = CUDA_Accelerator()
        else:
            _ACCELERATOR = CPU_Accelerator()
    return _ACCELERATOR


SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]  # the accelerators this build runs on


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def set_accelerator(accel: _Accelerator) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accel


def _numa_nodes_with_cores() -> int:
    """NUMA nodes with at least one CPU (a flat-mode HBM node has none), from sysfs; 1 if unknown."""
    import glob

    count = 0
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        try:
            with open(path) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(count, 1)
