# compat: upstream path `deepspeed.monitor` (monitor.MonitorMaster, tensorboard, csv_monitor, wandb, comet).
from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
