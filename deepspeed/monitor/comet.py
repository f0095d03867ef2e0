"""Comet ML monitor (needs `comet_ml` >= 3.41)."""

from __future__ import annotations

from typing import Any, Sequence

from .. import comm as dist
from .base import Event, Monitor
from .utils import check_comet_availability


class EventsLogScheduler:
    """Logs an event name again only after `samples_log_interval` more samples (upstream's rule)."""

    def __init__(self, samples_log_interval: int) -> None:
        self._samples_log_interval = samples_log_interval
        self._last_logged_events_samples: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        last = self._last_logged_events_samples.get(name)
        if last is None or current_sample - last >= self._samples_log_interval:
            self._last_logged_events_samples[name] = current_sample
            return True
        return False


class CometMonitor(Monitor):
    """`comet_ml.start(...)` on rank 0; events go to the experiment's `log_metric`."""

    requires = staticmethod(check_comet_availability)

    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config)
        self._samples_log_interval = comet_config.samples_log_interval
        self._experiment: Any = None
        self._events_log_scheduler = EventsLogScheduler(comet_config.samples_log_interval)
        if self.enabled and dist.get_rank() == 0:
            import comet_ml

            self._experiment = comet_ml.start(api_key=comet_config.api_key, project=comet_config.project,
                                              workspace=comet_config.workspace,
                                              experiment_key=comet_config.experiment_key, mode=comet_config.mode,
                                              online=comet_config.online)
            if comet_config.experiment_name is not None:
                self._experiment.set_name(comet_config.experiment_name)

    @property
    def experiment(self) -> Any:
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self._experiment is None:
            return
        for name, value, step in event_list:
            if self._events_log_scheduler.needs_logging(name, step):
                self._experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        if self._experiment is not None and hasattr(self._experiment, "end"):
            self._experiment.end()
            self._experiment = None
