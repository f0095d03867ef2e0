"""Memory reports (`memory_breakdown`, `see_memory_usage`): device and host memory, and the bytes
of model states this rank holds, by kind.

Model states are counted by storage: a tensor that views a flat buffer counts the buffer once,
under the first kind that reaches it, in the order parameters, gradients, masters, optimizer
states. So the numbers are what this rank really holds (ZeRO-1/2: the full 16-bit parameters and
gradient buckets, this rank's slice of masters and states; ZeRO-3: the shards plus whatever is
gathered at the moment of the report).
"""

from __future__ import annotations

import gc
from typing import Any, Iterable, Iterator

import torch

KINDS = ("parameters", "gradients", "masters", "optimizer states")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _base_optimizer(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _by_kind(engine: Any) -> dict[str, list[torch.Tensor]]:
    params = list(engine.module.parameters())
    model_ids = {id(p) for p in params}
    kinds: dict[str, list[torch.Tensor]] = {k: [] for k in KINDS}
    kinds["parameters"] += params + list(engine.module.buffers())
    kinds["gradients"] += [p.grad for p in params if p.grad is not None]
    for bucket in getattr(getattr(engine, "_reducer", None), "buckets", []):   # buffers and ZeRO-2 shards
        kinds["gradients"] += [v for v in vars(bucket).values() if torch.is_tensor(v)]
    for unit in getattr(getattr(engine, "_stage3", None), "units", []):   # ZeRO-3 shards and gathered units
        for name, value in vars(unit).items():
            if torch.is_tensor(value):
                kinds["gradients" if "grad" in name else "parameters"].append(value)
    base = _base_optimizer(engine)
    if isinstance(base, torch.optim.Optimizer):
        masters = [p for g in base.param_groups for p in g["params"] if id(p) not in model_ids]
        kinds["masters"] += masters
        kinds["gradients"] += [m.grad for m in masters if m.grad is not None]
        kinds["optimizer states"] += list(_tensors(list(base.state.values())))
    return kinds


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of storage this rank holds for each kind of model state (see the module docstring)."""
    seen: set[tuple[str, int]] = set()
    out = dict.fromkeys(KINDS, 0)
    for kind, tensors in _by_kind(engine).items():
        for tensor in tensors:
            if not torch.is_tensor(tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in seen or storage.data_ptr() == 0:
                continue
            seen.add(key)
            out[kind] += storage.nbytes()
    return out


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def memory_lines(message: str, engine: Any = None) -> list[str]:
    """Upstream's three lines (message, device MA/Max_MA/CA/Max_CA, host virtual memory), our RSS,
    and with an engine its model states by kind."""
    import psutil

    from ..accelerator import get_accelerator

    acc = get_accelerator()
    reserved = getattr(acc, "memory_reserved", acc.memory_allocated)
    max_reserved = getattr(acc, "max_memory_reserved", acc.max_memory_allocated)
    vm = psutil.virtual_memory()
    lines = [message,
             f"MA {_gib(acc.memory_allocated())} GB         Max_MA {_gib(acc.max_memory_allocated())} GB         "
             f"CA {_gib(reserved())} GB         Max_CA {_gib(max_reserved())} GB ",
             f"CPU Virtual Memory:  used = {_gib(vm.total - vm.available)} GB, percent = {vm.percent}%, "
             f"RSS = {_gib(psutil.Process().memory_info().rss)} GB"]
    if engine is not None:
        states = model_state_bytes(engine)
        lines.append("Model states on this rank: " + ", ".join(f"{k} {_mib(v)} MB" for k, v in states.items())
                     + f" (total {_mib(sum(states.values()))} MB)")
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def see_memory_usage(message: str, force: bool = False, engine: Any = None, ranks: Iterable[int] = (0,)) -> None:
    """Print memory on rank 0 when `force` (upstream's switch; the engine's `memory_breakdown`
    sets it). With `engine`, also the engine's model states by kind. Collects garbage first, as
    upstream, so host numbers are current; resets the device's peak counters after."""
    if not force:
        return
    from .. import comm as dist
    from ..accelerator import get_accelerator

    if dist.get_rank() not in ranks:
        return
    gc.collect()
    print("\n".join(memory_lines(message, engine)), flush=True)
    get_accelerator().reset_peak_memory_stats()
