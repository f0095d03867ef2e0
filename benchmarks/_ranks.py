"""One place for the in-process launch the micro-benchmarks share: `ranks` spawned processes on a
free loopback port, each running `target(rank, ranks, port, *args, queue)`; returns what the
ranks put on the queue first (the benchmarks have rank 0 put the gathered results)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any, Callable


def run_ranks(target: Callable, ranks: int, *args: Any, timeout: float = 1800) -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ranks, port, *args, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = queue.get(timeout=timeout)
    for p in procs:
        p.join()
    return results


def rank_environment(rank: int, world: int, port: int) -> None:
    """Inside a spawned rank: the variables `deepspeed.init_distributed` reads (and DS_ACCELERATOR=cpu)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
