"""Breaking a gloo group's pending operations: the primitive under comm.bounded.break_group and
the exit step (comm/exit.py). The lowest comm module: it imports nothing from the package."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as _tdist

UNMATCHED_TAG = 0x5EED0FF   # no rank ever sends with this tag


def process_group(group: Any) -> Any:
    return group if group is not None else _tdist.distributed_c10d._get_default_group()


def breakable(group: Any) -> bool:
    """Whether break_now applies: a gloo group of more than one rank."""
    pg = process_group(group)
    return pg.size() > 1 and _tdist.get_backend(group) == "gloo"


def break_now(group: Any) -> None:
    """A receive that no rank matches times out after a millisecond, and gloo closes this rank's
    connections when an operation times out, so every peer's pending or next operation of the group
    fails at once ("Connection closed by peer") instead of waiting for its timeout."""
    pg = process_group(group)
    peer = (pg.rank() + 1) % pg.size()
    try:
        probe = torch.empty(1)   # host: break_now applies to gloo groups only
        pg.recv([probe], peer, UNMATCHED_TAG).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass   # the expected timeout
