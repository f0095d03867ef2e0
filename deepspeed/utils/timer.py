"""Wall-clock timers (`wall_clock_breakdown`) and the throughput timer (`engine.tput_timer`).

[Note: timers never stall the device]
Upstream's timers call `synchronize()` on every start and stop (its throughput timer by default,
its wall-clock timers through CUDA events it then waits on): each one drains the device queue, so
the host can no longer run ahead of the GPU and a timed run is slower than an untimed one.
Here a timer on a device that runs asynchronously records a device *event* at start and at stop
(a few microseconds, no wait) and reads the elapsed time only when someone asks for it
(`elapsed()`, `log()`, the throughput report every `steps_per_print` steps); by then the events
are normally long complete. On the CPU the device is the host: `time.perf_counter()`. A timer
built with `synchronize=True` synchronizes anyway (only wanted to time host code that must not
include queued device work).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable

from .logging import print_dist

# upstream's timer names (deepspeed/utils/timer.py)
FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
# upstream's ZeRO optimizer timers (runtime/zero/stage_1_and_2.py)
OPTIMIZER_STEP_TIMER = "optimizer_step"
OPTIMIZER_ALLGATHER_TIMER = "optimizer_allgather"
TIME_EPSILON = 1e-6
_MAX_PENDING = 4096   # unresolved event pairs a timer keeps before it resolves the oldest


def _device_timing() -> Any:
    """The accelerator when its work runs asynchronously to the host (CUDA), else None."""
    from ..accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.use_host_timers():
        return None
    import torch

    return accelerator if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class _EventSpan:
    """A start/stop pair of device events; milliseconds resolved on demand."""

    __slots__ = ("start", "end")

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def milliseconds(self) -> float:
        self.end.synchronize()    # waits for this event only, not for the whole device
        return float(self.start.elapsed_time(self.end))


class Timer:
    """One named timer; `start()`/`stop()` pairs accumulate until `elapsed(reset=True)`."""

    def __init__(self, name: str, synchronize: bool = False) -> None:
        self.name_ = name
        self.synchronize = synchronize
        self.started_ = False
        self._host_start = 0.0
        self._event_start: Any = None
        self._spans: list[Any] = []          # float milliseconds (host) or _EventSpan (device)
        self.elapsed_records: list[float] | None = None

    @property
    def name(self) -> str:
        return self.name_

    @property
    def started(self) -> bool:
        return self.started_

    def start(self) -> None:
        """Start timing (a no-op when already running: nested engine calls reuse one timer)."""
        if self.started_:
            return
        device = _device_timing()
        if self.synchronize and device is not None:
            device.synchronize()
        if device is not None and not self.synchronize:
            self._event_start = device.Event(enable_timing=True)
            self._event_start.record()
        else:
            self._event_start = None
            self._host_start = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """Stop timing and keep the span (`record` is upstream's flag, accepted and ignored)."""
        if not self.started_:
            return
        if self._event_start is not None:
            end = _device_timing().Event(enable_timing=True)
            end.record()
            self._spans.append(_EventSpan(self._event_start, end))
            self._event_start = None
        else:
            if self.synchronize and _device_timing() is not None:
                _device_timing().synchronize()
            self._spans.append((time.perf_counter() - self._host_start) * 1000.0)
        self.started_ = False
        if len(self._spans) > _MAX_PENDING:   # bound the memory of a timer nobody reads
            self._spans = [sum(self._resolve(self._spans[:-1]))] + self._spans[-1:]
        if reset:
            self.reset()

    @staticmethod
    def _resolve(spans: list[Any]) -> list[float]:
        return [s.milliseconds() if isinstance(s, _EventSpan) else s for s in spans]

    def reset(self) -> None:
        self.started_ = False
        self._event_start = None
        self._spans = []
        self.elapsed_records = None

    def count(self) -> int:
        """Completed start/stop pairs since the last reset."""
        return len(self._spans)

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds of all completed spans (a running span is cut here and goes on)."""
        running = self.started_
        if running:
            self.stop()
        self.elapsed_records = self._resolve(self._spans)
        self._spans = list(self.elapsed_records)
        total = sum(self.elapsed_records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """Trimmed mean (10% each side) of the spans, in milliseconds."""
        self.elapsed(reset=False)
        return trim_mean(self.elapsed_records or [], 0.1)

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class SynchronizedWallClockTimer:
    """Named timers (upstream's class; the name is historical, see [Note: timers never stall
    the device]); `log(names)` prints their milliseconds on rank 0."""

    Timer = Timer

    def __init__(self, synchronize: bool = False) -> None:
        self.synchronize = synchronize
        self.timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = Timer(name, self.synchronize)
        return self.timers[name]

    def get_timers(self) -> dict[str, Timer]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        from ..accelerator import get_accelerator

        acc, gib = get_accelerator(), 1024**3
        reserved = getattr(acc, "memory_reserved", acc.memory_allocated)
        max_reserved = getattr(acc, "max_memory_reserved", acc.max_memory_allocated)
        return (f" | mem_allocated: {acc.memory_allocated() / gib:.4f} GB | max_mem_allocated: "
                f"{acc.max_memory_allocated() / gib:.4f} GB | cache_allocated: {reserved() / gib:.4f} GB | "
                f"max_cache_allocated: {max_reserved() / gib:.4f} GB")

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        """Print `time (ms) | name: value | ...` (upstream's line) for the timers that exist."""
        line = "time (ms)" + "".join(f" | {n}: {v:.2f}" for n, v in self.elapsed_ms(names, normalizer, reset).items())
        if memory_breakdown:
            line += self.memory_usage()
        print_dist(line, ranks=ranks or [0])

    def elapsed_ms(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Milliseconds of each named timer that exists, divided by `normalizer`."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return {n: self.timers[n].elapsed(reset=reset) / normalizer for n in names if n in self.timers}

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Trimmed mean milliseconds per span of each named timer (upstream multiplies by 1000)."""
        means = {n: self.timers[n].mean() / normalizer for n in names if n in self.timers}
        if reset:
            for n in means:
                self.timers[n].reset()
        return means


class NoopTimer:
    """A timer group that measures nothing (upstream's name)."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs: Any) -> None: ...

        def elapsed(self, **kwargs: Any) -> float:
            return 0.0

        def mean(self) -> float:
            return 0.0

        def __enter__(self) -> "NoopTimer.Timer":
            return self

        def __exit__(self, *exc: Any) -> None: ...

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None: ...

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict:
        return {}


def timed(owner: Any, name: str) -> Any:
    """`owner.timers(name)` as a context manager when `owner` carries timers (the engine hands
    its timers to the ZeRO optimizers under wall_clock_breakdown, as upstream), else a no-op."""
    timers = owner.__dict__.get("timers") if hasattr(owner, "__dict__") else None
    return timers(name) if timers is not None else nullcontext()


class ThroughputTimer:
    """Samples per second (and, once FLOPs per sample are known, TFLOP/s) of the training steps.

    Upstream's signature and accounting: each micro-step is timed from `start()` (the engine's
    forward) to `stop()` (the end of `engine.step()`), so time spent between steps (data loading,
    evaluation, checkpoints) is not counted; the first `start_step` optimizer steps are warm-up.
    With `config.synchronized` (the default) a device that runs asynchronously is timed with
    events resolved at each report ([Note: timers never stall the device]); the host clock otherwise.
    """

    def __init__(self, config: Any = None, batch_size: int | None = None, start_step: int = 2,
                 steps_per_output: int | None = None, monitor_memory: bool = False,
                 logging_fn: Callable[[str], Any] | None = None) -> None:
        from .logging import logger

        self.config = config
        self.enabled = getattr(config, "enabled", True)
        self.synchronized = getattr(config, "synchronized", True)
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.flops_per_sample: float | None = None   # set by the engine from the FLOPs profiler
        self.world_size = 1                           # ranks sharing batch_size (for TFLOP/s per rank)
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = 0.0     # seconds over the counted steps
        self.step_elapsed_time = 0.0      # seconds of the last counted optimizer step
        self.started = False
        self.initialized = False
        self._begin: Any = None                     # host seconds or a device event
        self._step: list[tuple[Any, Any]] = []      # this optimizer step's micro-step spans
        self._pending: list[tuple[bool, list[tuple[Any, Any]]]] = []   # (counted?, spans) not resolved yet

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _now(self) -> Any:
        device = _device_timing() if self.synchronized else None
        if device is None:
            return time.perf_counter()
        event = device.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Begin timing a micro-step (ignored while one is being timed)."""
        if not self.enabled or self.started:
            return
        self.initialized = self.started = True
        self._begin = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step; `global_step`: it ended an optimizer step."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self._step.append((self._begin, self._now()))
        if not global_step:
            return
        self.global_step_count += 1
        self._pending.append((self.global_step_count > self.start_step, self._step))
        self._step = []
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self.logging(self.report())

    def _resolve(self) -> None:
        for counted, spans in self._pending:
            seconds = sum(end - begin if isinstance(end, float) else _EventSpan(begin, end).milliseconds() / 1000.0
                          for begin, end in spans)
            self.total_elapsed_time += seconds if counted else 0.0
            self.step_elapsed_time = seconds
        self._pending = []

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the counted steps (0.0 before the first one)."""
        self._resolve()
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * steps / self.total_elapsed_time

    def avg_tflops_per_sec(self) -> float | None:
        """Achieved TFLOP/s per rank: FLOPs per sample × samples/s ÷ ranks (None while unknown)."""
        if not self.flops_per_sample:
            return None
        return self.flops_per_sample * self.avg_samples_per_sec() / max(self.world_size, 1) / 1e12

    def report(self) -> str:
        """Upstream's throughput line, plus TFLOP/s per rank when known."""
        from ..accelerator import get_accelerator

        avg = self.avg_samples_per_sec()
        current = self.batch_size / (self.step_elapsed_time + TIME_EPSILON)
        line = (f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}, "
                f"RunningAvgSamplesPerSec={avg}, CurrSamplesPerSec={current}, "
                f"MemAllocated={round(get_accelerator().memory_allocated() / 1024**3, 2)}GB, "
                f"MaxMemAllocated={round(get_accelerator().max_memory_allocated() / 1024**3, 2)}GB")
        tflops = self.avg_tflops_per_sec()
        return line + (f", TFLOPs/s per rank={tflops:.3f}" if tflops is not None else "")


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean of `data` without the `trim_percent` smallest and largest values (0 when empty)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    if not data:
        return 0.0
    ordered = sorted(data)
    k = int(round(len(ordered) * trim_percent))
    kept = ordered[k:len(ordered) - k] or ordered
    return sum(kept) / len(kept)


__all__ = ["SynchronizedWallClockTimer", "ThroughputTimer", "NoopTimer", "Timer", "trim_mean", "timed"]
