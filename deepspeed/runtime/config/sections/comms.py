"""`comms_logger`: per-collective logging in deepspeed.comm (upstream comm/config.py)."""

from __future__ import annotations

from pydantic import Field

from .base import DSModel


class CommsLoggerConfig(DSModel):
    """`comms_logger`."""

    enabled: bool = False
    """Record every collective (op, size, latency)."""
    verbose: bool = False
    """Print each collective as it happens."""
    prof_all: bool = True
    """Profile all collectives (otherwise only those in prof_ops)."""
    debug: bool = False
    """Append the calling function's name to each record."""
    prof_ops: list[str] = Field(default_factory=list)
    """Collective names to profile when prof_all is false."""
