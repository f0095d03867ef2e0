"""EngineObserver: what the engine shows about its own run. It owns the wall-clock timers
(`engine.timers`), the throughput timer (`engine.tput_timer`), the monitors (`engine.monitor`),
the FLOPs profiler (`engine.flops_profiler`) and the memory reports; the engine calls one hook
at each phase boundary (forward, backward, the reduction inside it, step).

[Note: what is reported when]
- Monitor events, on rank 0, at every optimizer step, keyed by samples trained
  (`engine.global_samples`): `Train/Samples/train_loss` (mean of the step's micro-batch losses
  passed to engine.backward, this rank's), `Train/Samples/lr` (first parameter group),
  `Train/Samples/loss_scale` (fp16), `Train/Samples/grad_norm` (when the step computed one).
  Values still on the device are written once they reach the host, normally a step later
  (monitor/pending.py): recording never stalls the device.
- `wall_clock_breakdown` (also on with the FLOPs profiler, as upstream): every `steps_per_print`
  optimizer steps (every step when it is unset), one line with the mean milliseconds per
  optimizer step of fwd, bwd (= bwd_inner: autograd, + bwd_allreduce: the wait for gradient
  reductions not hidden behind backward), step, and for ZeRO the optimizer step and the
  parameter all-gather inside it; the same means go to the monitors as
  `Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}`.
- `memory_breakdown`: during those reported steps, memory before and after forward, backward
  and step, with the model states by kind (memory_report.py).
- `flops_profiler`: on rank 0 the first forward (and its backward) of optimizer step
  `profile_step` is counted, the first forward of the next step is timed per module, and the
  report is printed when that step ends; after it `engine.tput_timer` also reports TFLOP/s.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch

from ..monitor.monitor import MonitorMaster, monitor_config_of
from ..monitor.pending import PendingEvents
from ..utils.logging import log_dist, print_dist
from ..utils.timer import (BACKWARD_GLOBAL_TIMER, BACKWARD_INNER_GLOBAL_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER,
                           FORWARD_GLOBAL_TIMER, OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_STEP_TIMER, STEP_GLOBAL_TIMER,
                           SynchronizedWallClockTimer, ThroughputTimer)
from .memory_report import see_memory_usage

BREAKDOWN = [FORWARD_GLOBAL_TIMER, BACKWARD_GLOBAL_TIMER, BACKWARD_INNER_GLOBAL_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER,
             STEP_GLOBAL_TIMER, OPTIMIZER_STEP_TIMER, OPTIMIZER_ALLGATHER_TIMER]
ELAPSED_EVENTS = {FORWARD_GLOBAL_TIMER: "forward", BACKWARD_GLOBAL_TIMER: "backward",
                  BACKWARD_INNER_GLOBAL_TIMER: "backward_inner", BACKWARD_REDUCE_GLOBAL_TIMER: "backward_allreduce",
                  STEP_GLOBAL_TIMER: "step"}


class EngineObserver:
    """See [Note: what is reported when]. Built at the end of the engine's constructor."""

    def __init__(self, engine: Any) -> None:
        model = engine._config.model
        self._engine = engine
        self.rank = engine.global_rank
        self.every = model.steps_per_print or 1
        self.breakdown = model.wall_clock_breakdown or model.flops_profiler.enabled
        self.memory = model.memory_breakdown
        self.timers = SynchronizedWallClockTimer()
        self.tput_timer = ThroughputTimer(model.timers.throughput, batch_size=engine.train_batch_size(),
                                          steps_per_output=model.steps_per_print)
        self.tput_timer.world_size = engine.dp_world_size
        self.monitor = MonitorMaster(monitor_config_of(model))
        self.profile = model.flops_profiler
        self.flops_profiler = None
        if self.profile.enabled:
            from ..profiling.flops_profiler.profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(engine.module, engine, self.profile.recompute_fwd_factor)
        self._phase: str | None = None       # FLOPs profile: count -> counted -> time -> timed -> done
        self._count_backward = False
        self._profile_base: dict[str, float] = {}
        self._events = PendingEvents()
        self._window = 0                     # optimizer steps since the last breakdown report
        if self.breakdown and _is_zero(engine.optimizer):
            engine.optimizer.__dict__.setdefault("timers", self.timers)   # read by utils.timer.timed
        if self.monitor.enabled:
            atexit.register(_close_at_exit, weakref.ref(self))

    # --- forward ---------------------------------------------------------------------------
    def before_forward(self) -> None:
        engine = self._engine
        training = engine.training and torch.is_grad_enabled()
        self._memory("Engine before forward", engine.global_steps)
        if training:
            self.tput_timer.start()
        if self.breakdown:
            self.timers(FORWARD_GLOBAL_TIMER).start()
        if training and self.flops_profiler is not None and self.rank == 0:
            self._begin_profiled_forward(engine.global_steps)

    def after_forward(self) -> None:
        if self._phase in ("count", "time"):
            self.flops_profiler.stop_profile()
            self._count_backward = self._phase == "count"
            self._phase = "counted" if self._phase == "count" else "timed"
        if self.breakdown:
            self.timers(FORWARD_GLOBAL_TIMER).stop()
        self._memory("Engine after forward", self._engine.global_steps)

    # --- backward --------------------------------------------------------------------------
    def before_backward(self) -> None:
        self._memory("Engine before backward", self._engine.global_steps)
        if self.breakdown:
            self.timers(BACKWARD_GLOBAL_TIMER).start()
            self.timers(BACKWARD_INNER_GLOBAL_TIMER).start()
        if self._count_backward:
            self.flops_profiler.start_backward_count()

    def before_reduce(self) -> None:
        """Autograd is done; what follows is waiting for the gradient reductions."""
        if self._count_backward:
            self.flops_profiler.stop_backward_count()
            self._count_backward = False
        if self.breakdown:
            self.timers(BACKWARD_INNER_GLOBAL_TIMER).stop()
            self.timers(BACKWARD_REDUCE_GLOBAL_TIMER).start()

    def after_backward(self) -> None:
        if self.breakdown:
            self.timers(BACKWARD_REDUCE_GLOBAL_TIMER).stop()
            self.timers(BACKWARD_GLOBAL_TIMER).stop()
        self._memory("Engine after backward", self._engine.global_steps)

    # --- step ------------------------------------------------------------------------------
    def before_step(self) -> None:
        self._memory("Engine before step", self._engine.global_steps)
        if self.breakdown:
            self.timers(STEP_GLOBAL_TIMER).start()

    def on_model_step(self, losses: list[torch.Tensor]) -> None:
        """Record this optimizer step's events (counters already advanced)."""
        if not self.monitor.enabled or self.rank != 0:
            return
        engine, samples = self._engine, self._engine.global_samples
        if losses:
            self._events.add("Train/Samples/train_loss", torch.stack([x.float() for x in losses]).mean(), samples)
        lr = engine.get_lr()
        if lr:
            self._events.add("Train/Samples/lr", lr[0], samples)
        if engine.precision.needs_scaler:
            self._events.add("Train/Samples/loss_scale", engine.loss_scale_value(), samples)
        norm = engine.get_global_grad_norm()
        if norm is not None:
            self._events.add("Train/Samples/grad_norm", norm, samples)

    def after_step(self, boundary: bool) -> None:
        engine = self._engine
        self.tput_timer.stop(global_step=boundary, report_speed=self.rank == 0)
        if self.breakdown:
            self.timers(STEP_GLOBAL_TIMER).stop()
        if boundary:
            self._window += 1
            if self._phase == "timed":
                self._finish_profile()
            if self.breakdown and engine.global_steps % self.every == 0:
                self._report_breakdown()
            self.flush_events()
        self._memory("Engine after step", engine.global_steps - int(boundary))

    # --- reports ---------------------------------------------------------------------------
    def _report_breakdown(self) -> None:
        steps, self._window = max(self._window, 1), 0
        means = self.timers.elapsed_ms(BREAKDOWN, normalizer=steps)
        if self.rank == 0:
            print_dist("time (ms) | " + " | ".join(f"{n}: {v:.2f}" for n, v in means.items()), ranks=[0])
            if self.monitor.enabled:
                for name, suffix in ELAPSED_EVENTS.items():
                    if name in means:
                        self._events.add(f"Train/Samples/elapsed_time_ms_{suffix}", means[name],
                                         self._engine.global_samples)

    def record_train_loss(self, loss: torch.Tensor) -> None:
        """`Train/Samples/train_loss` of the last optimizer step, on rank 0, when the loss is known
        only after the step (the PipelineEngine's batch mean, broadcast from the last stage)."""
        if self.monitor.enabled and self.rank == 0:
            self._events.add("Train/Samples/train_loss", loss, self._engine.global_samples)
            self.flush_events()

    def flush_events(self, wait: bool = False) -> None:
        """Write the recorded events whose values are on the host (all of them with `wait`)."""
        events = self._events.ready(wait)
        if events:
            self.monitor.write_events(events)

    def _memory(self, message: str, step_index: int) -> None:
        if self.memory and (step_index + 1) % self.every == 0:
            see_memory_usage(message, force=True, engine=self._engine)

    # --- FLOPs profile ---------------------------------------------------------------------
    def _begin_profiled_forward(self, step: int) -> None:
        target = self.profile.profile_step
        if step == target and self._phase is None:
            self.flops_profiler.start_profile(latency=False)
            self._phase = "count"
        elif step == target + 1 and self._phase == "counted":
            self._profile_base = self.timers.elapsed_ms(BREAKDOWN, reset=False)
            self.flops_profiler.start_profile(flops=False, reset=False)
            self._phase = "time"

    def _finish_profile(self) -> None:
        from ..profiling.flops_profiler.profiler import engine_times_of

        engine, prof = self._engine, self.flops_profiler
        now = self.timers.elapsed_ms(BREAKDOWN, reset=False)
        gas = engine.gradient_accumulation_steps()

        def per_micro_batch(name: str) -> float:
            return (now.get(name, 0.0) - self._profile_base.get(name, 0.0)) / 1000.0 / gas

        times = engine_times_of(engine)
        times.fwd, times.bwd, times.step = (per_micro_batch(n) for n in (FORWARD_GLOBAL_TIMER, BACKWARD_GLOBAL_TIMER,
                                                                         STEP_GLOBAL_TIMER))
        prof.print_model_profile(profile_step=self.profile.profile_step, module_depth=self.profile.module_depth,
                                 top_modules=self.profile.top_modules, detailed=self.profile.detailed,
                                 output_file=self.profile.output_file, engine_times=times)
        backward = prof.backward_flops if prof.backward_flops is not None else (2 + prof.recompute_fwd_factor) * prof.flops
        self.tput_timer.flops_per_sample = (prof.flops + backward) / engine.train_micro_batch_size_per_gpu()
        log_dist(f"FLOPs per sample (forward + backward, measured at step {self.profile.profile_step}): "
                 f"{self.tput_timer.flops_per_sample:.4g}", ranks=[0])
        prof.end_profile()
        self._phase = "done"

    def close(self) -> None:
        """Write what is pending and close the monitors' files (engine.destroy() and at exit)."""
        self.flush_events(wait=True)
        self.monitor.close()


def _is_zero(optimizer: Any) -> bool:
    from .base_optimizer import ZeROOptimizer

    return isinstance(optimizer, ZeROOptimizer)


def _close_at_exit(ref: Any) -> None:
    observer = ref()
    if observer is not None:
        observer.close()
