"""Wall-clock timers (`wall_clock_breakdown`) and the samples/s throughput timer."""

from __future__ import annotations

import time

from .logging import log_dist


class _Timer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        self._start = 0.0
        self.elapsed_records: list[float] = []

    def start(self) -> None:
        if not self.started:
            _synchronize()
            self._start = time.perf_counter()
            self.started = True

    def stop(self, record: bool = True) -> None:
        if self.started:
            _synchronize()
            self.elapsed_records.append(time.perf_counter() - self._start)
            self.started = False

    def elapsed(self, reset: bool = True) -> float:
        total = sum(self.elapsed_records)
        if reset:
            self.elapsed_records = []
        return total

    def mean(self) -> float:
        return sum(self.elapsed_records) / max(len(self.elapsed_records), 1)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class SynchronizedWallClockTimer:
    """Named timers; `log(names)` prints their elapsed milliseconds on rank 0."""

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        parts = [f"{n}: {self.timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}" for n in names if n in self.timers]
        if parts:
            log_dist("time (ms) | " + " | ".join(parts), ranks=ranks or [0])

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        means = {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}
        if reset:
            for n in names:
                if n in self.timers:
                    self.timers[n].elapsed(reset=True)
        return means


class ThroughputTimer:
    """Samples per second between optimizer steps, skipping the first `start_step` steps."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._start = None

    def start(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not global_step or self._start is None:
            return
        now = time.perf_counter()
        self.global_step_count += 1
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += now - self._start
        self.step_elapsed_time = now - self._start
        self._start = now

    def avg_samples_per_sec(self) -> float:
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * steps / self.total_elapsed_time
