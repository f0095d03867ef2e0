"""Collectives with a deadline of their own, shorter than the process group's timeout.

`torch.distributed`'s collectives take no timeout: an operation that a peer never joins waits
for the process group's timeout (30 minutes by default). The backend options do carry one
(`AllgatherOptions.timeout`, `ReduceScatterOptions.timeout`), and gloo honours it per
operation: after `timeout_s` the operation itself fails with a RuntimeError ("Timed out
waiting ... for recv operation"), its worker thread is freed and the connection closed, so
the peers' pending and later operations fail at once too ("Connection closed by peer").
Waiting on an asynchronous Work with a timeout is no substitute: torch's gloo reduce-scatter
Work ignores it, and an abandoned operation keeps the process from exiting until the group's
own timeout. On gloo ours are an all-to-all and broadcasts ([Note: gloo's reduce-scatter and
all-gather]), each carrying the deadline in its options; a broadcast that times out closes
the connection, so the all-gather's remaining broadcasts fail at once rather than each waiting
out its own deadline. NCCL's watchdog uses the group's timeout, not this one (see docs/zero.md).

`break_group` turns the same gloo behaviour into a way to fail a whole group at once.

Counted and logged like every collective of deepspeed.comm, under the same op names.
"""

from __future__ import annotations

import datetime
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as _tdist
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions, BroadcastOptions, ReduceScatterOptions

from .breaker import break_now, breakable
from .comm import ReduceOp, _timed
from .gloo_collectives import (all_gather_applies, broadcast_all_gather, exchange_reduce_scatter,
                               reduce_scatter_applies)

@lru_cache(maxsize=32)
def _options(kind: type, timeout_s: float, op: Any = None, async_op: bool = False) -> Any:
    opts = kind()
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    opts.asyncOp = async_op
    if op is not None:
        opts.reduceOp = op
    return opts

@lru_cache(maxsize=256)
def _broadcast_options(timeout_s: float, root: int) -> Any:
    opts = BroadcastOptions()
    opts.timeout, opts.rootRank, opts.rootTensor = datetime.timedelta(seconds=timeout_s), root, 0
    return opts

class _Completed:
    """The Work of an operation that already finished: some backends (NCCL on torch 2.11) return
    None rather than a Work when the options ask for a synchronous operation."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _work(work: Any) -> Any:
    return _Completed() if work is None else work


def _group(group: Any) -> Any:
    return group if group is not None else _tdist.distributed_c10d._get_default_group()

def all_gather_into_tensor_within(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float,
                                  group: Any = None, label: Any = None) -> None:
    """`all_gather_into_tensor` that fails after `timeout_s` seconds (where the backend honours it);
    `label` describes it in a divergence report (comm/guard.py)."""
    _timed("all_gather_into_tensor", output, group,
           lambda: _start_all_gather(output, tensor, float(timeout_s), group).wait(), label=label)

def start_all_gather_into_tensor_within(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float,
                                        group: Any = None, label: Any = None) -> Any:
    """Issue the bounded all-gather without waiting; returns its Work. The deadline travels in the
    operation's options (gloo fails the operation itself after `timeout_s`), so `Work.wait()`
    without a timeout still returns or raises in bounded time. Counted when issued."""
    return _timed("all_gather_into_tensor", output, group,
                  lambda: _start_all_gather(output, tensor, float(timeout_s), group), label=label)

def _start_all_gather(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float, group: Any) -> Any:
    pg = _group(group)
    if all_gather_applies(output, tensor, group):  # [Note: gloo's reduce-scatter and all-gather]
        def start(chunk: torch.Tensor, root: int) -> Any:
            return _work(pg.broadcast([chunk], _broadcast_options(timeout_s, root)))

        return broadcast_all_gather(output, tensor, group, start)
    # `_allgather_base` is the name every supported torch has (`all_gather_single` is newer than 2.11).
    return _work(pg._allgather_base(output, tensor, _options(AllgatherOptions, timeout_s, async_op=True)))

def reduce_scatter_tensor_within(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float,
                                 group: Any = None, op: Any = ReduceOp.SUM, label: Any = None) -> None:
    """`reduce_scatter_tensor` that fails after `timeout_s` seconds (where the backend honours it)."""
    pg = _group(group)
    if reduce_scatter_applies(output, tensor, op, group):  # [Note: gloo's reduce-scatter and all-gather]
        exchange = _options(AllToAllOptions, float(timeout_s))
        def swap(received: torch.Tensor, sent: torch.Tensor) -> Any:
            return _work(pg.alltoall_base(received, sent, [], [], exchange))

        _timed("reduce_scatter_tensor", tensor, group,
               lambda: exchange_reduce_scatter(output, tensor, group, swap).wait(), label=label)
        return
    opts = _options(ReduceScatterOptions, float(timeout_s), op)
    _timed("reduce_scatter_tensor", tensor, group, lambda: _work(pg._reduce_scatter_base(output, tensor, opts)).wait(),
           label=label)

def all_to_all_single_within(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float, group: Any = None,
                             label: Any = None) -> None:
    """`all_to_all_single` (equal splits) that fails after `timeout_s` seconds (where the backend
    honours it); counted as `all_to_all_single`."""
    pg, opts = _group(group), _options(AllToAllOptions, float(timeout_s))
    _timed("all_to_all_single", tensor, group, lambda: _work(pg.alltoall_base(output, tensor, [], [], opts)).wait(),
           label=label)

def break_group(group: Any = None) -> None:
    """Make the pending and later operations of `group` fail on every rank (gloo; elsewhere a no-op).

    A receive that no rank matches times out after a millisecond, and gloo closes this rank's
    connections when an operation times out, so every peer's pending or next operation of the
    group fails at once ("Connection closed by peer") instead of waiting for its timeout. For a
    group whose ranks are known to be out of step (the group is unusable anyway). Counted as a
    `recv` (comm/breaker.py has the primitive)."""
    if breakable(group):
        _timed("recv", None, group, lambda: break_now(group))
