"""zero.Init: parameters partitioned while modules are constructed, before deepspeed.initialize.

[Note: zero.Init]
While an Init context is active, the `__init__` of every nn.Module subclass is wrapped (as
upstream does: existing classes are patched, classes defined inside the context are caught by
`__init_subclass__`). When the outermost `__init__` of a module returns, its direct parameters
not yet partitioned are broadcast from rank 0 of the group -- so every rank holds the same
values whatever its RNG did -- and each rank keeps one slice of each: ceil(numel/N) elements,
the last ranks' zero-padded (upstream's per-parameter `ds_tensor`). `p.data` becomes an empty
placeholder of the parameter's dtype. Once built, a rank holds ~1/N of the parameters; at any
moment at most one module's parameters (and one broadcast buffer) are full, so a model larger
than one process's memory can be built as long as its largest module fits. `nn.Module.apply` is
patched too: a parent initialising its children's (already partitioned) weights through
`self.apply(fn)` sees each module's parameters whole, and rank 0's result is re-partitioned.

`_SHARDS` (parameter -> InitShard) is the one owner of this state; the `ds_*` attributes are
published from it for downstream readers (Hugging Face reads `param.ds_numel` right after
building under Init). deepspeed.initialize adopts the slices: at stage 3 a gather unit over
the same ranks keeps each slice as it is, since it shards every parameter the same way
(`take_over`, no communication; a persistent unit is then gathered once), while a unit over
other ranks all-gathers the parameter into its buffer (`adopt_into`); at stages 0-2 the
parameters are made whole again (`materialize`). GatheredParameters (gathered.py) gathers and re-partitions
them in between (`acquire` / `release`).
"""

from __future__ import annotations

import os

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .... import comm as ds_comm
from . import param_attrs, tensor_ctors
from .param_attrs import ZeroParamStatus
from .param_attrs import unit_of
from .watchdog import gather_or_copy


@dataclass(eq=False)
class InitShard:
    """This rank's slice of one parameter partitioned under zero.Init."""

    shard: torch.Tensor            # 1-D, ceil(numel / world) elements (zero-padded at the end)
    shape: torch.Size
    group: Any
    rank: int
    world: int
    device: torch.device           # compute device: gathers and broadcasts run there
    ds_id: int
    gathered: int = 0              # GatheredParameters nesting depth holding the parameter full

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bounds(self) -> tuple[int, int]:
        """This rank's [lo, hi) inside the flattened parameter (hi - lo <= shard.numel())."""
        size = self.shard.numel()
        return min(self.numel, self.rank * size), min(self.numel, (self.rank + 1) * size)


_SHARDS: Any = WeakIdKeyDictionary()   # nn.Parameter -> InitShard (identity keys: tensors compare by value)


def init_shard(param: Any) -> InitShard | None:
    """The zero.Init slice of `param`, None when it is not partitioned by zero.Init."""
    return _SHARDS.get(param) if isinstance(param, nn.Parameter) else None


def full_numel(param: nn.Parameter) -> int:
    record = init_shard(param)
    return record.numel if record is not None else param.numel()


def full_shape(param: nn.Parameter) -> torch.Size:
    record = init_shard(param)
    return record.shape if record is not None else param.shape


def _publish(param: nn.Parameter, record: InitShard) -> None:
    param_attrs.publish(param, ds_id=record.ds_id, shape=record.shape, persist=False, tensor=record.shard,
                        world=record.world,
                        status=ZeroParamStatus.AVAILABLE if record.gathered else ZeroParamStatus.NOT_AVAILABLE)


def _unpublish(param: nn.Parameter) -> None:
    param_attrs.unpublish(param)


def _broadcast(tensor: torch.Tensor, src: int, group: Any, world: int) -> None:
    """Broadcast from group rank `src` (a no-op in a one-rank group)."""
    if world > 1:
        ds_comm.broadcast(tensor, src=ds_comm.get_global_rank(group, src), group=group)


def _placeholder(param: nn.Parameter) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


# --- partitioning ---------------------------------------------------------------------------
def partition(params: Iterable[nn.Parameter], settings: "Init") -> None:
    """Broadcast `params` from group rank 0 and keep this rank's slice of each (one broadcast
    per dtype). Parameters already partitioned, or owned by a ZeRO-3 engine, are left alone."""

    todo = [p for p in dict.fromkeys(params) if p is not None and p not in _SHARDS and unit_of(p) is None
            and not p.is_meta]   # meta: not built yet (skip_init); partitioned once materialised
    if not todo:
        return
    group, device = settings.group, settings.device
    rank, world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in todo:
        if settings.dtype is not None and p.is_floating_point():
            p.data = p.data.to(settings.dtype)
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, members in by_dtype.items():
        flat = torch.cat([p.detach().reshape(-1).to(device) for p in members])
        _broadcast(flat, 0, group, world)
        offset = 0
        for p in members:
            size = -(-p.numel() // world)
            shard = torch.zeros(size, dtype=dtype, device=settings.shard_device)
            record = InitShard(shard, p.shape, group, rank, world, device, param_attrs.next_ds_id())
            lo, hi = record.bounds()
            shard[:hi - lo].copy_(flat[offset + lo:offset + hi])
            if settings.pin_memory:
                record.shard = shard.pin_memory()
            offset += p.numel()
            _SHARDS[p] = record
            p.data = torch.empty(0, dtype=dtype, device=device)
            _publish(p, record)


def _gather_full(record: InitShard) -> torch.Tensor:
    """The whole parameter (record's dtype, compute device): one all-gather of the slices."""
    full = torch.empty(record.shard.numel() * record.world, dtype=record.shard.dtype, device=record.device)
    gather_or_copy(full, record.shard.to(record.device), record.group)
    return full[:record.numel].view(record.shape)


def acquire(param: nn.Parameter) -> None:
    """Make `param` whole (one all-gather unless a GatheredParameters block already did)."""
    record = _SHARDS[param]
    record.gathered += 1
    if record.gathered == 1:
        param.data = _gather_full(record).to(device=param.device, dtype=param.dtype)
    _publish(param, record)


def release(param: nn.Parameter, modifier_rank: int | None) -> None:
    """End of a GatheredParameters block: with `modifier_rank`, its values are broadcast and
    re-partitioned into every rank's slice; the outermost block frees the full tensor."""
    record = _SHARDS[param]
    if modifier_rank is not None:
        data = param.data
        if data.shape != record.shape:
            raise RuntimeError(f"GatheredParameters: a parameter of shape {tuple(record.shape)} was given a "
                               f"tensor of shape {tuple(data.shape)}; build a new parameter (under zero.Init) "
                               f"to change its size")
        buf = data.detach().to(record.device, record.shard.dtype).contiguous().view(-1)
        _broadcast(buf, modifier_rank, record.group, record.world)
        if buf.data_ptr() != data.data_ptr():
            data.copy_(buf.view(record.shape))      # an outer block still holds it full
        lo, hi = record.bounds()
        record.shard[:hi - lo].copy_(buf[lo:hi])
    record.gathered -= 1
    if record.gathered == 0:
        param.data = _placeholder(param)
    _publish(param, record)


def take_over(param: nn.Parameter) -> InitShard:
    """deepspeed.initialize takes `param` over: its zero.Init record leaves the registry."""
    record = _SHARDS.pop(param)
    if record.gathered:
        _SHARDS[param] = record
        raise RuntimeError("deepspeed.initialize was called inside a GatheredParameters block of one of the "
                           "model's parameters; call it after the block")
    return record


def _members(group: Any, world: int) -> list[int]:
    return [ds_comm.get_global_rank(group, r) for r in range(world)]


def partitioned_like(param: nn.Parameter, group: Any) -> bool:
    """`param`'s zero.Init slice is the piece a ZeRO-3 unit over `group` keeps of it (the same
    ranks in the same order): the unit can take it as it is, without communicating."""
    record = _SHARDS.get(param)
    if record is None:
        return False
    world = ds_comm.get_world_size(group) if ds_comm.is_initialized() else 1
    return record.world == world and _members(record.group, world) == _members(group, world)


def adopt_into(param: nn.Parameter, out: torch.Tensor) -> None:
    """deepspeed.initialize takes `param` over: its full value is all-gathered into `out` (cast
    to out's dtype) and the zero.Init slice is dropped. Collective: every rank, same order."""
    record = take_over(param)
    out.copy_(_gather_full(record).view(out.shape))


def materialize(module: nn.Module) -> None:
    """Make every zero.Init parameter of `module` whole again and plain (ZeRO stages 0-2)."""
    for p in module.parameters():
        if p in _SHARDS:
            full = torch.empty(_SHARDS[p].shape, dtype=p.dtype, device=p.device)
            adopt_into(p, full)
            p.data = full
            _unpublish(p)


# --- the context manager ---------------------------------------------------------------------
_ACTIVE: list["Init"] = []           # entered, enabled contexts; the outermost one partitions
_CONSTRUCTING: set[int] = set()      # id() of modules whose outermost __init__ is running
_PATCHED: dict[type, Callable] = {}  # class -> its original __init__
_NO_HOOK = object()
_SAVED_INIT_SUBCLASS: Any = _NO_HOOK  # nn.Module's own __init_subclass__, if torch defines one
_SAVED_APPLY: Any = None               # nn.Module.apply while patched


def _wrap_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        outer = id(module) not in _CONSTRUCTING
        _CONSTRUCTING.add(id(module))
        try:
            init(module, *args, **kwargs)
        finally:
            if outer:
                _CONSTRUCTING.discard(id(module))
        if outer and _ACTIVE:   # children's too: one built on meta and materialised later (skip_init)
            partition(module.parameters(), _ACTIVE[0])
    return wrapper


def _apply_gathered(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """nn.Module.apply inside Init: a parent's __init__ often initialises its children's weights
    (`self.apply(self._init_weights)`) after they were partitioned. Each module's own partitioned
    parameters are whole while `fn` sees it and re-partitioned from rank 0's values afterwards
    (GatheredParameters(modifier_rank=0) semantics, as upstream), one module at a time."""
    for child in module.children():
        child.apply(fn)
    own = [p for p in module.parameters(recurse=False) if p in _SHARDS]
    for p in own:
        acquire(p)
    try:
        fn(module)
    except BaseException:
        for p in own:
            release(p, None)   # no collective: this rank is failing
        raise
    for p in own:
        release(p, 0)
    return module


def _patch_class(cls: type) -> None:
    if "__init__" in cls.__dict__ and cls not in _PATCHED:
        _PATCHED[cls] = cls.__dict__["__init__"]
        cls.__init__ = _wrap_init(cls.__dict__["__init__"])


def _init_subclass(cls: type, **kwargs: Any) -> None:
    if _SAVED_INIT_SUBCLASS is _NO_HOOK:
        super(nn.Module, cls).__init_subclass__(**kwargs)
    else:
        _SAVED_INIT_SUBCLASS.__get__(None, cls)(**kwargs)
    _patch_class(cls)


def _patch() -> None:
    global _SAVED_INIT_SUBCLASS, _SAVED_APPLY
    todo = [nn.Module]
    while todo:
        cls = todo.pop()
        _patch_class(cls)
        todo.extend(cls.__subclasses__())
    _SAVED_INIT_SUBCLASS = nn.Module.__dict__.get("__init_subclass__", _NO_HOOK)
    nn.Module.__init_subclass__ = classmethod(_init_subclass)
    _SAVED_APPLY, nn.Module.apply = nn.Module.apply, _apply_gathered


def _unpatch() -> None:
    nn.Module.apply = _SAVED_APPLY
    for cls, init in _PATCHED.items():
        cls.__init__ = init
    _PATCHED.clear()
    if _SAVED_INIT_SUBCLASS is _NO_HOOK:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _SAVED_INIT_SUBCLASS


def _not_supported(what: str) -> Exception:
    from ...errors import NotSupportedYet

    return NotSupportedYet(f"deepspeed.zero.Init: {what} is not implemented in this build of deepspeed")


def _config_settings(config: Any) -> tuple[torch.dtype | None, str | None, bool | None]:
    """(dtype, offload device, pin_memory) a DeepSpeed config asks for; None where it is silent."""
    from ...config.loader import load_config_dict

    raw = load_config_dict(config)
    enabled = [name for name in ("bf16", "fp16") if (raw.get(name) or {}).get("enabled") is True]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[enabled[0]] if enabled else None
    offload = (raw.get("zero_optimization") or {}).get("offload_param") or {}
    device = offload.get("device")
    return dtype, device.lower() if isinstance(device, str) else None, offload.get("pin_memory")


def _check_nvme_config(config: Any) -> None:
    """[Note: zero.Init with remote_device nvme]
    Slices made under zero.Init(remote_device="nvme") (Lightning passes it with offload_parameters and
    nvme_path) stay in host memory, 1/N of the model per rank, until deepspeed.initialize puts each
    unit's shard in its swap file ([Note: parameter swapping]); upstream swaps them during Init. The
    config must say where: zero_optimization.offload_param.nvme_path (as upstream's swapper reads it);
    where the shards live after initialize is offload_param.device's choice (Lightning writes
    device "cpu" unless offload_params_device="nvme")."""
    offload = {}
    if config is not None:
        from ...config.loader import load_config_dict

        offload = (load_config_dict(config).get("zero_optimization") or {}).get("offload_param") or {}
    if not offload.get("nvme_path"):
        raise ValueError("deepspeed.zero.Init(remote_device=\"nvme\") needs config_dict_or_path with "
                         "zero_optimization.offload_param.nvme_path (and device \"nvme\"); got "
                         f"offload_param={offload or None}")


def _settings(config: Any, remote_device: Any, dtype: torch.dtype | None,
              group: Any) -> tuple[torch.dtype | None, str | None, bool | None]:
    """(config dtype, offload device, config pin_memory) from the config and the arguments. With a
    config, agreed across `group` first: every rank must partition alike, and a rank whose config
    does not load makes every rank raise ([Note: cross-rank config agreement])."""
    def resolve() -> tuple[torch.dtype | None, str | None, bool | None]:
        config_dtype, config_device, config_pin = _config_settings(config) if config is not None \
            else (None, None, None)
        device = getattr(remote_device, "value", remote_device)
        return config_dtype, str(device).lower() if device is not None else config_device, config_pin

    if config is None:
        return resolve()
    from ...agreement import agree_config

    # pin_memory is not compared: page-locked or not, the shard holds the same values on that rank only
    return agree_config(resolve, "deepspeed.zero.Init", group=group, view=lambda s: {
        "dtype": str(dtype if dtype is not None else s[0]), "remote_device": s[1] or "none"})


def contradicting_single_rank_group(dp_world_size: int, explicit_process_group: Any, env: Any) -> str | None:
    """The error for a one-rank group under a multi-process launcher (None when all is well).

    A process group of size 1 created before the launcher's world was joined (a library calling
    init_process_group itself, from_pretrained before init_distributed) would make every rank keep
    the whole model: no error, just each rank out of memory. A group passed explicitly is the
    user's choice and is trusted; a WORLD_SIZE that is not a number is not a launcher's."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    try:
        launched = int(env.get("WORLD_SIZE") or 1)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init: the launcher started WORLD_SIZE={launched} processes but the default process group has "
            "1 rank, so nothing would be partitioned and every rank would hold the whole model. Create the group "
            "for the whole world first (deepspeed.init_distributed(), or let deepspeed.initialize do it) before "
            "zero.Init, or pass data_parallel_group= explicitly if one rank per group is intended.")


class Init:
    """Partition parameters as modules are constructed (a context manager), or those of an
    already-built `module`. DeepSpeed 0.19.8's signature; see [Note: zero.Init].

    Honoured: `module`, `data_parallel_group` / `mpu` / `sequence_data_parallel_group` (the
    group the parameters are split over), `remote_device` "cpu" or None (where the slices
    live; "nvme": see [Note: zero.Init with remote_device nvme]), `pin_memory` (only with CUDA), `dtype` (floating parameters cast before being
    split; else fp16/bf16 from `config_dict_or_path`, else left as built), `enabled`. Ignored:
    `mem_efficient_linear`, `zero_param_parallel_group` (hpZ's groups come from the config's
    `zero_hpz_partition_size` at initialize), `zero_quantized_weights` (qwZ quantises the engine's
    gathers, set by the config; zero.Init's own gathers stay exact). Rejected: `param_swapper`
    (upstream's swapper object) and `zero_quantized_nontrainable_weights`.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        if zero_quantized_nontrainable_weights:
            raise _not_supported("quantized frozen weights (zero_quantized_nontrainable_weights=True)")
        if param_swapper is not None:
            raise _not_supported("param_swapper (NVMe parameter offload)")
        config = config_dict_or_path if config_dict_or_path is not None else config
        if not ds_comm.is_initialized():
            ds_comm.init_distributed()   # as upstream (and deepspeed.initialize): even a single process
        if sequence_data_parallel_group is not None:
            self.group = sequence_data_parallel_group
        elif data_parallel_group is not None:
            self.group = data_parallel_group
        else:
            # ZeRO shards over data x sequence: an mpu with sequence groups (ALST's) names that group
            self.group = None if mpu is None else mpu.get_sequence_data_parallel_group() \
                if hasattr(mpu, "get_sequence_data_parallel_group") else mpu.get_data_parallel_group()
        explicit = next((g for g in (sequence_data_parallel_group, data_parallel_group, mpu) if g is not None), None)
        message = contradicting_single_rank_group(ds_comm.get_world_size(self.group), explicit, os.environ)
        if message is not None:
            raise RuntimeError(message)
        config_dtype, device, config_pin = _settings(config, remote_device, dtype, self.group)
        if device not in (None, "none", "cpu", "nvme"):
            raise _not_supported(f"remote_device={device!r} (only None, \"cpu\" or \"nvme\")")
        if device == "nvme":   # [Note: zero.Init with remote_device nvme]
            _check_nvme_config(config)
            device = "cpu"
        from ....accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())
        self.shard_device = torch.device("cpu") if device == "cpu" else self.device  # host: remote_device
        pin = pin_memory or (config_pin is True and remote_device is None)
        self.pin_memory = bool(pin) and self.shard_device.type == "cpu" and torch.cuda.is_available()
        self.dtype = dtype if dtype is not None else config_dtype
        if module is not None:
            for m in module.modules():   # one module's parameters full at a time
                partition(m.parameters(recurse=False), self)

    def __enter__(self) -> "Init":
        if self.enabled:
            _ACTIVE.append(self)
            if len(_ACTIVE) == 1:
                _patch()
                # dtype None: tensors are born in their own dtype; parameters are cast when they
                # are partitioned (fp32 init then rounded, as without Init). See tensor_ctors.py.
                tensor_ctors.install(None, self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                tensor_ctors.uninstall()
                _unpatch()
