"""CSV monitor: one `<name with / as _>.csv` per event name, rows `step,value` (upstream's files)."""

from __future__ import annotations

import csv
import os
from typing import IO, Any, Sequence

from .. import comm as dist
from ._paths import log_dir
from .base import Event, Monitor


class csvMonitor(Monitor):  # noqa: N801 - upstream's name
    """Appends events to CSV files under `output_path/job_name` on rank 0. Files stay open and
    are flushed after every `write_events` call (upstream reopens the file for every event)."""

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.filenames: list[str] = []
        self._files: dict[str, tuple[IO[str], Any]] = {}
        self.log_dir = log_dir(csv_config) if self.enabled and dist.get_rank() == 0 else None

    def _writer(self, name: str) -> Any:
        filename = name.replace("/", "_").replace(" ", "_")
        if filename not in self._files:
            path = os.path.join(self.log_dir, filename + ".csv")
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            handle = open(path, "a", newline="")
            writer = csv.writer(handle)
            if fresh:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[filename] = (handle, writer)
            self.filenames.append(filename)
        return self._files[filename][1]

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.log_dir is None:
            return
        for name, value, step in event_list:
            self._writer(name).writerow([step, value])
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files = {}
