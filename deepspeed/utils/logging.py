"""The `deepspeed` logger and rank-aware logging helpers (upstream names: logger, log_dist)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Iterable

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _create_logger(name: str = "DeepSpeed", level: int = logging.INFO) -> logging.Logger:
    log = logging.getLogger(name)
    log.setLevel(level)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        log.addHandler(handler)
    return log


logger = _create_logger(level=getattr(logging, os.environ.get("DS_LOG_LEVEL", "INFO").upper(), logging.INFO))


def _current_rank() -> int:
    """The global rank without importing torch.distributed when it is not initialised."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (all ranks when `ranks` is None or contains -1)."""
    rank = _current_rank()
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def print_dist(message: str, ranks: Iterable[int] | None = None) -> None:
    rank = _current_rank()
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        print(f"[Rank {rank}] {message}", flush=True)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the `deepspeed` logger (or `custom_logger`) to a level named like "info" or "ERROR";
    the config's top-level `log_level` is applied this way by deepspeed.initialize."""
    level = getattr(logging, str(log_level_str).upper(), None)
    if not isinstance(level, int):
        raise ValueError(f"{log_level_str!r} is not one of the `logging` levels (debug, info, warning, error, "
                         "critical)")
    (custom_logger or logger).setLevel(level)


def should_log_le(max_log_level_str: str) -> bool:
    level = getattr(logging, max_log_level_str.upper(), None)
    if not isinstance(level, int):
        raise ValueError(f"{max_log_level_str} is not one of the `logging` levels")
    return logger.getEffectiveLevel() <= level


def warning_once(message: str, _seen: set = set()) -> None:  # noqa: B006 - deliberate memo
    if message not in _seen:
        _seen.add(message)
        logger.warning(message)
