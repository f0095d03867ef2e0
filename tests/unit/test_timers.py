"""Timers (deepspeed.utils.timer): accounting with a controlled clock, upstream's log line, and the
rule that timers never synchronize an asynchronous device unless built to (a fake device counts
every synchronize and every event)."""

from __future__ import annotations

import contextlib
import io
import types

import pytest

from deepspeed.utils import timer as timer_mod
from deepspeed.utils.timer import SynchronizedWallClockTimer, ThroughputTimer, trim_mean


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timer_mod.time, "perf_counter", fake)
    monkeypatch.setattr(timer_mod, "_device_timing", lambda: None)   # host timing even with CUDA in use
    return fake


def test_wall_clock_timers_accumulate_and_log(clock):
    timers = SynchronizedWallClockTimer()
    for span in (0.010, 0.030):
        timers("fwd").start()
        clock.now += span
        timers("fwd").stop()
    with timers("step"):
        clock.now += 0.002
    assert timers("fwd").count() == 2 and timers("fwd").elapsed(reset=False) == pytest.approx(40.0)
    assert timers.elapsed_ms(["fwd", "step", "missing"], normalizer=2, reset=False) == {
        "fwd": pytest.approx(20.0), "step": pytest.approx(1.0)}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        timers.log(["fwd", "step"], normalizer=2)
    assert out.getvalue() == "[Rank 0] time (ms) | fwd: 20.00 | step: 1.00\n"
    assert timers("fwd").elapsed() == 0.0   # log reset them
    timers("fwd").start()
    clock.now += 0.005
    assert timers("fwd").elapsed() == pytest.approx(5.0) and timers("fwd").started   # a running timer goes on


def test_trim_mean():
    assert trim_mean([], 0.1) == 0.0
    assert trim_mean([1.0] * 9 + [100.0], 0.1) == 1.0
    with pytest.raises(ValueError):
        trim_mean([1.0], 1.5)


def test_throughput_counts_only_the_timed_micro_steps(clock):
    tput = ThroughputTimer(types.SimpleNamespace(enabled=True, synchronized=True), batch_size=8, start_step=1,
                           steps_per_output=None)
    for step in range(4):
        for _ in range(2):                 # two micro-steps of 0.1 s, then 1 s outside (data loading)
            tput.start()
            clock.now += 0.1
            tput.stop(global_step=False)
            clock.now += 1.0
        tput.start()
        tput.stop(global_step=True)
    assert tput.global_step_count == 4 and tput.micro_step_count == 12
    assert tput.avg_samples_per_sec() == pytest.approx(8 * 3 / (3 * 0.2))   # warm-up step not counted
    assert tput.avg_tflops_per_sec() is None
    tput.flops_per_sample, tput.world_size = 1e12, 2
    assert tput.avg_tflops_per_sec() == pytest.approx(40.0 / 2)
    assert "RunningAvgSamplesPerSec=40.0" in tput.report() and "TFLOPs/s per rank=20.000" in tput.report()


def test_throughput_reports_every_steps_per_output(clock):
    lines = []
    tput = ThroughputTimer(None, batch_size=4, start_step=0, steps_per_output=2, logging_fn=lines.append)
    for _ in range(5):
        tput.start()
        clock.now += 0.5
        tput.stop(global_step=True, report_speed=True)
    assert len(lines) == 2 and lines[1].startswith("epoch=0/micro_step=4/global_step=4, RunningAvgSamplesPerSec=8.0")


class FakeEvent:
    def __init__(self, device, enable_timing=False):
        self.device = device

    def record(self):
        self.device.calls.append("record")
        self.t = self.device.clock

    def synchronize(self):
        self.device.calls.append("event.synchronize")

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class FakeDevice:
    """An asynchronous device: events carry its own clock; synchronize() is what must not happen."""

    def __init__(self):
        self.calls, self.clock = [], 0.0

    def Event(self, enable_timing=False):  # noqa: N802 - torch's name
        return FakeEvent(self, enable_timing)

    def synchronize(self):
        self.calls.append("device.synchronize")


def test_timers_never_synchronize_an_async_device_unless_asked(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(timer_mod, "_device_timing", lambda: device)
    timers, tput = SynchronizedWallClockTimer(), ThroughputTimer(None, batch_size=2, start_step=0)
    for _ in range(3):
        tput.start()
        timers("fwd").start()
        device.clock += 0.25
        timers("fwd").stop()
        tput.stop(global_step=True, report_speed=False)
    assert "device.synchronize" not in device.calls and "event.synchronize" not in device.calls
    assert timers("fwd").elapsed() == pytest.approx(750.0) and tput.avg_samples_per_sec() == pytest.approx(8.0)
    assert "device.synchronize" not in device.calls       # reading waits on events only
    device.calls.clear()
    synced = SynchronizedWallClockTimer(synchronize=True)
    synced("x").start()
    synced("x").stop()
    assert device.calls.count("device.synchronize") == 2 and "record" not in device.calls
