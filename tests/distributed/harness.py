"""Persistent multi-process workers for distributed tests (gloo on CPU, real processes).

`run_distributed(world_size, fn, *args)` runs the module-level function `fn` on every rank of
a pool of `world_size` processes and returns the per-rank results. Pools start once per world
size and are reused across tests, so the suite pays process start-up and torch import once.
An exception on any rank is re-raised here with every failing rank's traceback; a pool whose
ranks failed or timed out is torn down (its ranks may be stuck in a collective) and rebuilt
on next use, so one failure cannot hang or poison later tests.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
from typing import Any, Callable

_CALL_TIMEOUT_S = float(os.environ.get("DS_TEST_TIMEOUT", 240))
_GLOO_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(module_name: str, module_file: str, qualname: str) -> Callable:
    if module_name not in sys.modules:
        directory = os.path.dirname(module_file)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        importlib.import_module(module_name)
    obj: Any = sys.modules[module_name]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu")
    import datetime

    import torch

    torch.set_num_threads(1)  # world sizes up to 4 on a 2-core machine: avoid oversubscription
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                               timeout=datetime.timedelta(seconds=_GLOO_TIMEOUT_S))
    conn.send(("ready", None))
    import logging

    from deepspeed.utils.logging import logger

    # A job may change logging for the whole process (the HF Trainer sets levels per process rank);
    # the next job in this worker starts from the levels the worker started with.
    logging_state = (logger.level, logger.disabled, logging.root.manager.disable)
    while True:
        logger.setLevel(logging_state[0])
        logger.disabled = logging_state[1]
        logging.disable(logging_state[2])
        message = conn.recv()
        if message is None:
            break
        module_name, module_file, qualname, args, kwargs = message
        try:
            fn = _resolve(module_name, module_file, qualname)
            result = fn(*args, **kwargs)
            _saves_written()
            conn.send(("ok", result))
            del result   # not alive during the next job (tests count the tensors a process holds)
        except BaseException:  # report everything, including assertion errors
            _saves_written()
            conn.send(("error", traceback.format_exc()))
    import torch.distributed as tdist

    tdist.destroy_process_group()


def _saves_written() -> None:
    """A job's background checkpoint writes are finished when it returns (as at process exit), so
    the test can look at the files."""
    from deepspeed.runtime.checkpoint.save_job import wait_all_local

    wait_all_local()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(120):
                self.close(force=True)
                raise RuntimeError(f"worker rank {rank} of world size {world_size} did not start")
            conn.recv()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        module = sys.modules[fn.__module__]
        message = (fn.__module__, module.__file__, fn.__qualname__, args, kwargs)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError) as exc:   # died in an earlier call
                errors[rank] = f"rank {rank}'s process is gone ({exc!r})"
        for rank, conn in enumerate(self.conns):
            if rank in errors:
                continue
            # After a first failure the other ranks get a short grace period (they may be stuck).
            wait = timeout if not errors else 15
            try:
                if not conn.poll(wait):
                    errors[rank] = f"rank {rank} did not answer within {wait:.0f} s (stuck in a collective?)"
                    continue
                status, value = conn.recv()
            except (EOFError, ConnectionError, OSError) as exc:   # the process died (e.g. a gloo abort)
                self.procs[rank].join(timeout=5)
                code = self.procs[rank].exitcode
                errors[rank] = f"rank {rank}'s process died (exit code {code}; {exc!r})"
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise DistributedTestError(fn.__qualname__, self.world_size, errors)
        return results

    def close(self, force: bool = False) -> None:
        for conn in self.conns:
            try:
                if not force:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class DistributedTestError(AssertionError):
    def __init__(self, name: str, world_size: int, errors: dict[int, str]) -> None:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        super().__init__(f"{name} failed on {len(errors)}/{world_size} ranks:\n{text}")


_POOLS: dict[int, WorkerPool] = {}


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = _CALL_TIMEOUT_S,
                    **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on ranks 0..world_size-1 and return their results by rank."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        _POOLS.pop(world_size).close(force=True)
        raise


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
