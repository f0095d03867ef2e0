"""FLOPs profiler: per-module forward FLOPs, parameters and latency (upstream's API).

[Note: counting FLOPs without patching torch]
Upstream replaces `torch.nn.functional.*`, `torch.matmul`, `Tensor` methods and einops functions
with counting wrappers while it profiles, and synchronizes the device at every module boundary.
Here FLOPs come from `torch.utils.flop_counter.FlopCounterMode`, a dispatcher-level mode that
sees every aten operation (whatever Python function issued it) and applies torch's own formulas
(matmuls, convolutions, attention, forward and backward). It is entered and exited around the
profiled forward; nothing of torch is replaced. Per-module numbers come from forward pre/post
hooks registered on the profiled model's modules only: a module's FLOPs are the counter's growth
between its pre- and post-hook (so they include its submodules and functional calls), and its
latency is the host clock between them (device events on CUDA, resolved after the pass; no
synchronization). The hooks are removed when profiling stops, so the model and torch are as
before.

Counting costs: every aten operation passes through a Python handler (1.8x the forward time of
the demo model on one CPU thread, 1.06x for a 19M-parameter one). So latencies are taken in a pass
*without* the counter: `get_model_profile` runs one counted forward and one timed forward, and the engine
counts FLOPs at `profile_step` and times modules at the step after it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...utils.logging import logger
from . import report
from .report import (DETAILED_HEADER, EngineTimes, ModuleRow, bytes_to_string, duration_to_string,  # noqa: F401
                     flops_to_string, macs_to_string, number_to_string, params_to_string)

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
           "params_to_string", "duration_to_string", "bytes_to_string"]


def _extra_flop_formulas() -> dict[Any, Any]:
    """Formulas torch's registry lacks: SDPA's CPU flash kernel (same FLOPs as the CUDA ones)."""
    from torch.utils import flop_counter

    aten, extra = torch.ops.aten, {}
    count, backward = getattr(flop_counter, "sdpa_flop_count", None), getattr(flop_counter, "sdpa_backward_flop_count", None)
    forward_op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward_op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if count is not None and forward_op is not None and forward_op not in flop_counter.flop_registry:
        extra[forward_op] = lambda q, k, v, *args, out_shape=None, **kwargs: count(q, k, v)
    if backward is not None and backward_op is not None and backward_op not in flop_counter.flop_registry:
        extra[backward_op] = lambda g, q, k, v, *args, out_shape=None, **kwargs: backward(g, q, k, v)
    return extra


def _counter() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())


def _param_numel(p: torch.Tensor) -> int:
    """A parameter's full size, also when ZeRO-3 holds only a shard (`ds_numel`)."""
    return int(getattr(p, "ds_numel", p.numel()))


@dataclass
class _Stats:
    flops: int = 0
    calls: int = 0
    duration: float = 0.0   # seconds


class _Clock:
    """Host seconds on the CPU; device events on CUDA, resolved later (no synchronization)."""

    def __init__(self) -> None:
        from ...utils.timer import _device_timing

        self.device = _device_timing()

    def now(self) -> Any:
        if self.device is None:
            return time.perf_counter()
        event = self.device.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(begin: Any, end: Any) -> float:
        if isinstance(begin, float):
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0


class FlopsProfiler:
    """Measures the forward FLOPs, parameters and latency of each module of `model`.

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        prof.stop_profile()
        flops, params = prof.get_total_flops(), prof.get_total_params()
        prof.print_model_profile(profile_step=step)
        prof.end_profile()

    See [Note: counting FLOPs without patching torch]. In one `start_profile()`/`stop_profile()`
    window the latencies include the counting overhead; `start_profile(flops=False, reset=False)`
    on a later forward times the modules without it, keeping the counted FLOPs.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.func_patched = False          # upstream's attribute; nothing is ever patched here
        self.flops = self.macs = self.params = 0
        self.op_flops: dict[str, int] = {}
        self.backward_flops: int | None = None
        self._stats: dict[int, _Stats] = {}
        self._handles: list[Any] = []
        self._open: dict[int, list[tuple[int, Any]]] = defaultdict(list)
        self._spans: list[tuple[int, Any, Any]] = []
        self._counter: Any = None
        self._counted = 0                  # FLOPs of finished counting windows
        self._timing = False
        self._clock: _Clock | None = None

    # --- profiling windows --------------------------------------------------------------------
    def start_profile(self, ignore_list: list[type] | None = None, *, flops: bool = True, latency: bool = True,
                      reset: bool = True) -> None:
        """Start a profiling window: hooks on the model's modules (not on those whose type is in
        `ignore_list`) and, with `flops`, the FLOP counter. `reset=False` keeps earlier results."""
        if self._handles or self._counter is not None:
            self.stop_profile()
        if reset:
            self.reset_profile()
        self._timing, self._clock = latency, _Clock() if latency else None
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._stats.setdefault(id(module), _Stats())
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook))
        if flops:
            self._counter = _counter()
            self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and timing and remove every hook; the results stay until end_profile()."""
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            self._counted += counter.get_total_flops()
            for op, value in counter.get_flop_counts().get("Global", {}).items():
                self.op_flops[str(op)] = self.op_flops.get(str(op), 0) + value
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for key, begin, end in self._spans:
            self._stats[key].duration += _Clock.seconds(begin, end)
        self._spans, self._open = [], defaultdict(list)
        self._refresh_totals()

    def reset_profile(self) -> None:
        """Forget all results (upstream: resets the per-module attributes)."""
        self._drop_module_stats()
        self._counted = 0
        self.op_flops = {}
        self.backward_flops = None
        self.flops = self.macs = self.params = 0

    def _drop_module_stats(self) -> None:
        self._stats = {}
        self._open, self._spans = defaultdict(list), []

    def end_profile(self) -> None:
        """Stop profiling and drop the per-module results; the totals (`flops`, `macs`, `params`,
        `backward_flops`) stay readable, as upstream's attributes do."""
        if not self.started:
            return
        self.stop_profile()
        self._drop_module_stats()
        self.started = False

    # --- hooks -------------------------------------------------------------------------------
    def _flops_now(self) -> int:
        return self._counter.get_total_flops() if self._counter is not None else 0

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._open[id(module)].append((self._flops_now(), self._clock.now() if self._timing else None))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        frames = self._open.get(id(module))
        if not frames:
            return  # entered before the window opened
        flops_before, begin = frames.pop()
        stats = self._stats[id(module)]
        stats.calls += 1
        if self._counter is not None:
            stats.flops += self._flops_now() - flops_before
        if begin is not None:
            self._spans.append((id(module), begin, self._clock.now()))

    # --- backward (the engine measures it instead of assuming 2x the forward) --------------------
    def start_backward_count(self) -> None:
        self._backward_counter = _counter()
        self._backward_counter.__enter__()

    def stop_backward_count(self) -> None:
        counter = getattr(self, "_backward_counter", None)
        if counter is not None:
            counter.__exit__(None, None, None)
            self._backward_counter = None
            self.backward_flops = (self.backward_flops or 0) + counter.get_total_flops()

    # --- results -----------------------------------------------------------------------------
    def module_rows(self) -> ModuleRow:
        """The profile as a tree of rows (containers that never ran sum their children)."""

        def build(name: str, module: nn.Module, depth: int) -> ModuleRow:
            children = [build(f"{name}.{n}" if name else n, m, depth + 1) for n, m in module.named_children()]
            stats = self._stats.get(id(module), _Stats())
            ran = stats.calls > 0
            params = sum(_param_numel(p) for p in module.parameters())
            extra = module.extra_repr() if type(module).extra_repr is not nn.Module.extra_repr else ""
            return ModuleRow(name or type(module).__name__, type(module).__name__, depth,
                             stats.flops if ran else sum(c.flops for c in children), params,
                             stats.duration if stats.duration else sum(c.duration for c in children), extra, children)

        return build("", self.model, 0)

    def _refresh_totals(self) -> None:
        root = self._stats.get(id(self.model))
        self.flops = root.flops if root is not None and root.calls else self._counted
        self.macs = self.flops // 2
        self.params = sum(_param_numel(p) for p in self.model.parameters())

    def get_total_flops(self, as_string: bool = False) -> Any:
        """Forward FLOPs of the profiled model (matmuls, convolutions, attention)."""
        return number_to_string(self.flops) if as_string else self.flops

    def get_total_macs(self, as_string: bool = False) -> Any:
        """Multiply-accumulates: half the FLOPs (every counted operation is a sum of products)."""
        return macs_to_string(self.macs) if as_string else self.macs

    def get_total_duration(self, as_string: bool = False) -> Any:
        """Forward latency of the model in seconds (from the timed pass)."""
        duration = self.module_rows().duration
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> Any:
        """Parameters of the model (full sizes, also under ZeRO-3)."""
        return params_to_string(self.params) if as_string else self.params

    def is_expert_tensor_parallelism_enabled(self) -> bool:
        return False

    # --- printing ------------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None,
                            engine_times: EngineTimes | None = None) -> None:
        """Print the profile as upstream does: summary, top modules per depth, the module tree."""
        if not self.started:
            return
        root = self.module_rows()
        if engine_times is None and self.ds_engine is not None:
            engine_times = engine_times_of(self.ds_engine)
        if engine_times is not None and engine_times.measured_bwd_flops is None:
            engine_times.measured_bwd_flops = self.backward_flops
        lines = report.summary_lines(root, profile_step, engine_times, 2 + self.recompute_fwd_factor, self.op_flops)
        lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
        lines += report.aggregated_lines(root, module_depth, top_modules)
        if detailed:
            lines += DETAILED_HEADER + report.tree_lines(root)
        lines.append("------------------------------------------------------------------------------")
        report.write_lines(lines, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        report.write_lines(report.aggregated_lines(self.module_rows(), module_depth, top_modules))


def engine_times_of(engine: Any) -> EngineTimes:
    """The engine's sizes (and no latencies) for the summary of a standalone print."""
    dp = engine.dp_world_size   # None under Ulysses: the sequence-data-parallel group replicates
    return EngineTimes(world_size=engine.world_size,
                       dp_world_size=dp if dp is not None else getattr(engine, "seq_dp_world_size", 1),
                       mp_world_size=getattr(engine, "mp_world_size", 1),
                       micro_batch=engine.train_micro_batch_size_per_gpu())


def _call(model: nn.Module, args: Any, kwargs: dict, mode: str) -> Any:
    fn = model.generate if mode == "generate" else model
    return fn(*args, **kwargs)


def get_model_profile(model: nn.Module, input_shape: tuple | None = None, args: Any = None, kwargs: Any = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True, output_file: str | None = None,
                      ignore_modules: list[type] | None = None, mode: str = "forward") -> tuple[Any, Any, Any]:
    """Forward FLOPs, MACs and parameters of `model` on the given input (upstream's function).

    `input_shape`: the model takes one tensor of that shape (the parameters' dtype and device);
    otherwise `args`/`kwargs` are passed. Runs `warm_up` forwards, one counted forward and one
    timed forward; the model's training flag is restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [torch.ones(input_shape, dtype=first.dtype if first is not None else None,
                           device=first.device if first is not None else None)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs")
    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model)
    try:
        logger.info("Flops profiler warming-up...")
        for _ in range(warm_up):
            _call(model, args, kwargs, mode)
        prof.start_profile(ignore_list=ignore_modules, latency=False)
        _call(model, args, kwargs, mode)
        prof.start_profile(ignore_list=ignore_modules, flops=False, reset=False)
        _call(model, args, kwargs, mode)
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
