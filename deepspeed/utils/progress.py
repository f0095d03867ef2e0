"""Progress bars for long offline work (ds_to_universal, checkpoint loads of large models): a tqdm
bar when a terminal is watching, nothing otherwise.

The bar goes to stderr when stderr is a terminal, else to stdout when that is (the `deepspeed`
launcher pipes each rank's stderr but leaves stdout inherited), else nowhere: logs captured to
files or pipes get no carriage-return noise. Only global rank 0 draws. (utils/zero_to_fp32.py
carries its own copy of this rule: it must run without deepspeed installed.)
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any, Iterable

MIN_BYTES_ENV = "DS_PROGRESS_MIN_BYTES"
DEFAULT_MIN_BYTES = 256 * 2**20   # checkpoint loads below this are quick: no bar


class NoBar:
    """Stands in for a bar: iterates, ignores updates."""

    def __init__(self, iterable: Iterable | None = None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Any:
        return iter(self._iterable if self._iterable is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def terminal_stream() -> IO[str] | None:
    """stderr or stdout when it is a terminal (in that order), else None."""
    for stream in (sys.stderr, sys.stdout):
        try:
            if stream is not None and stream.isatty():
                return stream
        except (AttributeError, ValueError):   # replaced or closed streams
            continue
    return None


def min_bytes() -> int:
    """Size below which checkpoint loads draw no bar (`DS_PROGRESS_MIN_BYTES` overrides)."""
    return int(os.environ.get(MIN_BYTES_ENV, DEFAULT_MIN_BYTES))


def progress(iterable: Iterable | None = None, total: float | None = None, desc: str | None = None,
             unit: str = "it", unit_scale: bool = False, stream: IO[str] | None = None) -> Any:
    """A tqdm bar on `stream` (default: terminal_stream()) on global rank 0, else a NoBar."""
    from .. import comm as dist

    stream = stream if stream is not None else terminal_stream()
    if stream is None or dist.get_rank() != 0:
        return NoBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:   # pragma: no cover - tqdm is a dependency
        return NoBar(iterable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=stream, leave=False,
                dynamic_ncols=True)
