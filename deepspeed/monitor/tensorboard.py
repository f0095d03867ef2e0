"""TensorBoard monitor: scalars through torch.utils.tensorboard (needs the `tensorboard` package)."""

from __future__ import annotations

from typing import Any, Sequence

from .. import comm as dist
from ._paths import log_dir
from .base import Event, Monitor
from .utils import check_tb_availability


class TensorBoardMonitor(Monitor):
    """Writes `add_scalar(name, value, step)` into `output_path/job_name` on rank 0."""

    requires = staticmethod(check_tb_availability)

    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(tensorboard_config)
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.summary_writer = None
        if self.enabled and dist.get_rank() == 0:
            self.get_summary_writer()

    def get_summary_writer(self) -> Any:
        if self.summary_writer is None and self.enabled and dist.get_rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.summary_writer = SummaryWriter(log_dir=log_dir(self.monitor_config))
        return self.summary_writer

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        if self.summary_writer is None:
            return
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
