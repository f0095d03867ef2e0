"""Reduce-scatter and all-gather on gloo, built from its all-to-all and broadcast.

[Note: gloo's reduce-scatter and all-gather]
torch's gloo backend implements `reduce_scatter_tensor` (and the list form) as a clone of the
whole input, an all-reduce of that clone and a copy of this rank's chunk: it moves all-reduce
bytes, 2(N-1)/N of the input per rank, twice what a reduce-scatter needs, and takes longer than
the all-reduce alone. Its `all_gather_into_tensor` gathers into a fresh input-sized buffer on a
worker thread and copies that into the output. Counted on the loopback interface with torch
2.13 (16 MB fp32, every rank on one host; benchmarks/bench_comm.py), the ranks together sent
2.00x the input's bytes at 2 ranks and 6.0x at 4 for `reduce_scatter_tensor`.

* Reduce-scatter = exchange + sum: `all_to_all_single` sends chunk j of the input to rank j and
  receives every rank's contribution to this rank's chunk, (N-1)/N of the input per rank (a
  reduce-scatter's optimum: 1.00x and 3.0x above, in half the time or less); the sum over the
  N received chunks then runs here, in rank order (deterministic, whichever rank computes it).
  The receive buffer is input-sized, as gloo's clone was.
* All-gather = one broadcast per rank, each rooted at the rank that owns the chunk, straight
  into the output's chunks: the same bytes as gloo's all-gather, no buffer at all, as fast or
  faster (one collective per rank instead of one).

Used for CPU tensors of a gloo group with more than one rank (SUM only for the reduce-scatter),
whatever their layout (non-contiguous ones go through contiguous copies: the choice of path must
not depend on anything that can differ between ranks); NCCL and the rest keep their native
collectives. deepspeed.comm counts each as the one reduce-scatter or all-gather it implements.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as _tdist
from torch.distributed import ReduceOp


def _gloo_cpu(whole: torch.Tensor, part: torch.Tensor, group: Any) -> int:
    """World size when `whole` (N chunks) and `part` (one chunk) take the gloo paths, else 0.

    Decided only from what every rank of a matching call shares (backend, world size, device
    type, sizes, dtype), never from a tensor's layout: ranks that took different paths would
    pair an all-to-all with an all-reduce and hang. Layout is handled locally (contiguous copies).
    A rank outside `group` falls through to torch, which returns without doing anything."""
    if whole.device.type != "cpu" or whole.dtype != part.dtype:
        return 0
    if group is not None and _tdist.distributed_c10d._rank_not_in_group(group):
        return 0
    if _tdist.get_backend(group) != "gloo":
        return 0
    world = _tdist.get_world_size(group)
    return world if world > 1 and whole.numel() == part.numel() * world else 0


def reduce_scatter_applies(output: torch.Tensor, tensor: torch.Tensor, op: Any, group: Any) -> bool:
    return op == ReduceOp.SUM and _gloo_cpu(tensor, output, group) > 0


def all_gather_applies(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> bool:
    return _gloo_cpu(output, tensor, group) > 0


class Composite:
    """One Work for several: waits for each, then runs `finish` (once)."""

    def __init__(self, works: list[Any], finish: Callable[[], None] | None = None) -> None:
        self._works, self._finish, self._done = works, finish, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            self._complete()
        return True

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
        self._works, self._finish = [], None

    def parts_completed(self) -> bool:
        """Whether every part is done, without finishing (safe from another thread)."""
        return self._done or all(work.is_completed() for work in list(self._works))

    def is_completed(self) -> bool:
        """True once the output is written (polling completes it when every part is done)."""
        if not self._done and all(work.is_completed() for work in self._works):
            for work in self._works:
                work.wait()   # done already: surfaces a failure instead of writing garbage
            self._complete()
        return self._done


def exchange_reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: Any,
                            start: Callable[[torch.Tensor, torch.Tensor], Any]) -> Composite:
    """Issue the exchange (`start(received, sent)` launches `all_to_all_single(received, sent)`
    asynchronously and returns its Work); the sum runs at `wait()`. `output` may be a view of
    `tensor` (the in-place reduce-scatter): the exchange has read `tensor` by then."""
    sent = tensor if tensor.is_contiguous() else tensor.contiguous()
    received = torch.empty(sent.numel(), dtype=sent.dtype, device=sent.device)
    world = _tdist.get_world_size(group)

    def finish() -> None:
        chunks = received.view(world, -1)
        if output.is_contiguous():
            torch.sum(chunks, dim=0, out=output.view(-1))
        else:
            output.copy_(chunks.sum(dim=0).view(output.shape))

    return Composite([start(received, sent)], finish)


def broadcast_all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any,
                         start: Callable[[torch.Tensor, int], Any]) -> Composite:
    """Copy this rank's chunk into `output` (unless `tensor` is that chunk already) and issue one
    broadcast per rank (`start(chunk, group_rank)` launches it asynchronously, in place). A
    non-contiguous `output` is gathered into a contiguous copy, written back at `wait()`."""
    world, rank = _tdist.get_world_size(group), _tdist.get_rank(group)
    flat = output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype,
                                                                       device=output.device)
    chunks = flat.chunk(world)
    if tensor.data_ptr() != chunks[rank].data_ptr() or not tensor.is_contiguous():
        chunks[rank].copy_(tensor.reshape(-1))
    finish = None if flat.data_ptr() == output.data_ptr() else (lambda: output.copy_(flat.view(output.shape)))
    return Composite([start(chunk, root) for root, chunk in enumerate(chunks)], finish)
