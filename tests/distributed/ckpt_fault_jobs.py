"""Per-rank jobs for test_checkpoint_agreed.py: non-strict loads, faults that only one rank sees,
background saves. Faults are injected inside the failing rank's job only (and undone in a
`finally`, the pools are reused), never by mocking torch.distributed."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import ckpt_jobs as J
from models import TinyMLP


class TinyExtra(TinyMLP):
    """TinyMLP plus one trainable parameter registered last (it lands in the last rank's shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        return F.cross_entropy(self.head(h) + self.extra, y)


J.MODELS["tiny_extra"] = TinyExtra


def _rank() -> int:
    return J._dist().get_rank()


def reference_losses(model_name: str, start: dict, todo: list, lr: float = 1e-2) -> list[float]:
    """Plain torch from the state `start` with a fresh AdamW on the global batches (the engine's
    gradient is the mean over ranks of per-rank means of equal micro-batches: the global mean)."""
    model = J.MODELS[model_name]()
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for x, y in todo:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def non_strict_load_job(cfg: dict, load_dir: str, model: str, steps: int = 2) -> dict:
    """A fresh engine of `model` loads with load_module_strict=False (no optimizer, no scheduler
    state), then trains `steps` batches; rank 0 also runs the plain-torch reference."""
    engine = J.build(cfg, model, seed=123)
    fresh = J.module_state(engine)
    start = time.monotonic()
    path, _ = engine.load_checkpoint(load_dir, load_module_strict=False, load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    loaded, snap = J.module_state(engine), J.snapshot(engine)
    todo = J.batches(3 + steps)[3:]
    losses = J.train(engine, todo)
    after = J.module_state(engine)
    out = {"path": path, "elapsed": time.monotonic() - start}
    if _rank() == 0:
        out.update(fresh=fresh, loaded=loaded, snap=snap, losses=losses, after=after,
                   reference=reference_losses(model, loaded, todo))
    return out


# --- faults that one rank sees ------------------------------------------------------------------
@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any, active: bool):
    old = getattr(obj, name)
    if active:
        setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        return {"type": None, "message": "no error", "elapsed": time.monotonic() - start}
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return {"type": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - start,
                "failures": getattr(error, "failures", None)}


def faulty_load_job(cfg: dict, load_dir: str, fault: str, victim: int) -> dict:
    """load_checkpoint while rank `victim` alone sees `fault`; then a clean load must work."""
    from deepspeed.checkpoint import files
    from deepspeed.checkpoint import reader as reader_module

    engine = J.build(cfg, "tiny", seed=123)
    mine = _rank() == victim

    def lacks_key(self, name, field, start=0, numel=None):
        if name == "head.bias":
            raise KeyError(f"{name!r} not in this rank's shard")
        return real_read(self, name, field, start, numel)

    real_read = reader_module.CheckpointReader.read
    with patched(reader_module.CheckpointReader, "read", lacks_key, mine and fault == "shard_lacks_key"), \
            patched(files, "read_latest", lambda *a: None, mine and fault == "no_latest"):
        out = _attempt(lambda: engine.load_checkpoint(load_dir))
    out["then"] = engine.load_checkpoint(load_dir, tag=None if fault != "rng" else "good")[0] is not None
    return out


def faulty_save_job(cfg: dict, save_dir: str, fault: str, victim: int) -> dict:
    """Save a good tag, then a second save while rank `victim` alone fails (`fault`); every rank
    must raise, nothing of the failed tag may be published. Then a matched save must work."""
    from deepspeed.checkpoint import files

    engine = J.build(cfg, "tiny", seed=0)
    J.train(engine, J.batches(1))
    engine.save_checkpoint(save_dir, tag="good")
    engine.wait_for_checkpoint()
    J.train(engine, J.batches(2)[1:])
    mine = _rank() == victim

    def disk_full(fd, data):  # the device is full for this rank's writes (the file system says so)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    tag = "bad"
    if fault == "tag" and mine:
        tag = "bad/tag"
    real_optim_file = files.optim_file
    with patched(files, "_write", disk_full, mine and fault == "write"), \
            patched(files, "optim_file", lambda dp, **kw: real_optim_file(0, **kw), fault == "clash"):  # one name
        def save():
            engine.save_checkpoint(save_dir, tag=tag)
            engine.wait_for_checkpoint()  # a background save reports here
        out = _attempt(save)
    J._dist().barrier()
    out["listing"] = sorted(os.listdir(save_dir))
    out["latest"] = open(os.path.join(save_dir, "latest")).read()
    engine.save_checkpoint(save_dir, tag="after")  # the pool and the engine are still usable
    engine.wait_for_checkpoint()
    out["latest_after"] = open(os.path.join(save_dir, "latest")).read()
    return out


# --- background saves ---------------------------------------------------------------------------
def async_save_job(cfg: dict, save_dir: str) -> dict:
    """save_checkpoint with checkpoint.async_save returns before the files exist; training goes
    on (changing every tensor the snapshot came from); the checkpoint holds the save-time state."""
    engine = J.build(cfg, "tiny", seed=0)
    data = J.batches(5)
    J.train(engine, data[:3])
    before, st = J.snapshot(engine), J.state(engine)
    start = time.monotonic()
    engine.save_checkpoint(save_dir)
    blocked = time.monotonic() - start
    J.train(engine, data[3:4])  # mutates params, masters, Adam state, buffers while the thread writes
    engine.save_checkpoint(save_dir, tag="second")  # waits for the first, then starts another
    engine.destroy()  # waits for the second
    out = {"blocked": blocked}
    if _rank() == 0:
        out.update(snap=before, state=st, listing=sorted(os.listdir(save_dir)),
                   latest=open(os.path.join(save_dir, "latest")).read())
    return out


def renamed_while_writing_job(cfg: dict, root: str) -> dict:
    """Hugging Face Trainer's pattern: save_checkpoint into `tmp-checkpoint-N`, rename it to
    `checkpoint-N` as soon as the call returns (the background write still running: each file's
    write is slowed by 0.2 s), then rotate (delete `checkpoint-1`) while the next save is in flight."""
    from deepspeed.checkpoint import files

    engine = J.build(cfg, "tiny", seed=0)
    data = J.batches(3)
    rank = _rank()
    real = files.save_file

    def slow(obj, path, dir_fd=None, shown=None, **kw):
        time.sleep(0.2)
        return real(obj, path, dir_fd=dir_fd, shown=shown, **kw)

    running, snap = [], None
    with patched(files, "save_file", slow, True):
        for n in (1, 2):
            J.train(engine, data[n - 1:n])
            engine.save_checkpoint(os.path.join(root, f"tmp-checkpoint-{n}"))
            snap = J.snapshot(engine)
            running.append(engine._checkpoint_slot.current.thread.is_alive())
            J._dist().barrier()
            if rank == 0:
                os.rename(os.path.join(root, f"tmp-checkpoint-{n}"), os.path.join(root, f"checkpoint-{n}"))
                if n == 2:
                    shutil.rmtree(os.path.join(root, "checkpoint-1"))
            J._dist().barrier()
        J.train(engine, data[2:3])  # training goes on while the thread writes
        engine.wait_for_checkpoint()
    out = {"running": running}
    if rank == 0:
        out.update(snap=snap, root=sorted(os.listdir(root)), listing=sorted(os.listdir(os.path.join(root, "checkpoint-2"))),
                   latest=open(os.path.join(root, "checkpoint-2", "latest")).read())
    return out


def published_on_return_job(cfg: dict, root: str) -> dict:
    """The default save ([Note: durable later]): when save_checkpoint returns, the tag and `latest`
    are on disk (upstream's contract: HF Trainer rotates old checkpoints right after); the fsyncs
    run in a thread that a rename of the save directory does not disturb."""
    import os

    engine = J.build(cfg, "tiny", seed=0)
    J.train(engine, J.batches(1))
    src, dst = os.path.join(root, "tmp-checkpoint-1"), os.path.join(root, "checkpoint-1")
    engine.save_checkpoint(src)
    listing = sorted(os.listdir(src))
    pending = engine._checkpoint_slot.current
    kind = None if pending is None else pending.target.__name__
    J._dist().barrier()
    if _rank() == 0:
        os.rename(src, dst)
    J._dist().barrier()
    engine.wait_for_checkpoint()
    return {"listing": listing, "kind": kind, "after": sorted(os.listdir(dst))}
