"""Short 2-rank ZeRO jobs that end without tearing the process group down, repeated.

    python exit_runs.py --stage 2 --runs 20 [--mode plain|destroy|raise]   (driver)
    python exit_runs.py --stage 2 --single                                 (one rank of a
                                                                            launched job)

The driver imports torch and deepspeed once and forks the two ranks of every run, so a run
costs no interpreter start-up; each forked rank trains a few steps, does the user's final
`all_reduce` of an exit code and leaves through `sys.exit`, i.e. through interpreter
finalization exactly as a script does ([Note: exiting without destroy_process_group] in
deepspeed/comm/exit.py). The driver runs on one core, which makes the race at exit (a gloo
worker releasing tensors while the interpreter finalizes) likelier, and prints one line
`RESULT {...}` with every rank's exit code and exit time.

Modes: `plain` (no teardown), `destroy` (the script calls destroy_process_group itself),
`raise` (rank 1 leaves a collective pending that rank 0 never joins, then raises; rank 0 stays
alive for a while: rank 1 must exit at once, not wait for the collective or the peer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import deepspeed
import deepspeed.comm as ds_comm

_STEPS = 3
_RAISE_PEER_ALIVE_S = 10.0
# Imported once by the driver, before any process group exists, so a forked rank starts warm.
_PRELOAD = ("torch._dynamo", "deepspeed.runtime.engine", "deepspeed.runtime.config", "deepspeed.runtime.builder",
            "deepspeed.runtime.zero.optimizer", "deepspeed.runtime.optimizers", "deepspeed.ops.adam",
            "deepspeed.runtime.lr_schedules")


_PINNING_MODULE = """
import torch.distributed as dist

def broadcast(tensor, src, group=dist.group.WORLD):
    return dist.broadcast(tensor, src, group=group)
"""


def _import_pinning_module() -> None:
    """A module imported after init_process_group whose functions have the default group as a
    default argument, as torch.distributed.nn.functional's have when it is imported then (in a
    script, by the optimizer's lazy import of torch._dynamo; the driver imported that before)."""
    import types

    module = types.ModuleType("exit_runs_pinning")
    exec(_PINNING_MODULE, module.__dict__)
    sys.modules[module.__name__] = module


def _train(stage: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(_STEPS):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()


def _rank_main(stage: int, mode: str) -> None:
    """One rank of a job; always leaves through SystemExit or an exception (never returns)."""
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=60))
    _import_pinning_module()  # pins the group ([Note: exiting without destroy_process_group])
    _train(stage)
    if mode == "raise":
        if dist.get_rank() == 1:
            pending = ds_comm.all_reduce(torch.ones(4), async_op=True)  # noqa: F841  (rank 0 never joins)
            raise RuntimeError("rank 1 fails with a collective pending")
        time.sleep(_RAISE_PEER_ALIVE_S)
        os._exit(0)  # rank 0 is only the live peer here
    code = torch.zeros(1)
    # A busy machine, deterministically: a thread waiting for the GIL gets it only after 0.5 s
    # of uninterrupted bytecode (default 5 ms), so a gloo worker that still has to release the
    # final all_reduce's tensors is likely to be waiting when the interpreter starts finalizing.
    sys.setswitchinterval(0.5)
    dist.all_reduce(code)  # the user's final all_reduce of an exit code
    if mode == "destroy":
        dist.destroy_process_group()
    sys.exit(int(code.item()))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _drive(stage: int, runs: int, mode: str, cpu: int) -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[cpu % len(cpus)]})
    results = []
    for _ in range(runs):
        port, pids = _free_port(), {}
        start = time.monotonic()
        for rank in range(2):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the rank: SystemExit or an exception unwinds to the interpreter's exit
                os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
                _rank_main(stage, mode)
            pids[pid] = rank
        codes, seconds = [None, None], [None, None]
        while pids:
            pid, status = os.wait()
            rank = pids.pop(pid)
            codes[rank] = os.waitstatus_to_exitcode(status)
            seconds[rank] = round(time.monotonic() - start, 2)
        results.append({"codes": codes, "seconds": seconds})
    print("RESULT " + json.dumps({"stage": stage, "mode": mode, "runs": results}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--mode", choices=("plain", "destroy", "raise"), default="plain")
    parser.add_argument("--cpu", type=int, default=0, help="index of the allowed CPU to run on")
    parser.add_argument("--single", action="store_true", help="be one rank of a launched job")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.single:
        _rank_main(args.stage, args.mode)
    _drive(args.stage, args.runs, args.mode, args.cpu)


if __name__ == "__main__":
    main()
