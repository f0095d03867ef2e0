"""Run under the launcher with two ranks (test_checkpoint_crash.py): train, save checkpoint A,
train one more step, then save checkpoint B while rank 1 SIGKILLs itself half-way through
writing its optimizer-state file. Usage: ckpt_crash_script.py SAVE_DIR RECORD_FILE sync|async|publish|exit|exitfail.
`sync`: checkpoint.async_save false (the kill hits save_checkpoint itself). `async`: the
background save (async_save true): B's files are written by a thread (the kill hits that thread's write, after
save_checkpoint returned and training went on). `publish`: rank 0's background thread is killed
after renaming B into place, before it writes `latest`. `exit`: nobody is killed; the script ends right
after save_checkpoint(B) returns, while B's (slowed) background write still runs."""

from __future__ import annotations

import datetime
import errno
import io
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.checkpoint import files  # noqa: E402

import ckpt_jobs as J  # noqa: E402


def die_while_writing_optimizer_file(real_save_file):
    def save_file(obj, path, dir_fd=None, shown=None, **kw):
        if path.endswith("optim_states.pt"):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getvalue()
            # where files.save_file writes before its rename (a name in the staging directory's descriptor)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
            os.write(fd, data[:len(data) // 2])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save_file(obj, path, dir_fd=dir_fd, shown=shown, **kw)

    return save_file


def die_while_publishing_latest(real_write_text):
    """Rank 0's background thread is killed after B's rename into place, before `latest` names it."""
    def write_text(path, text, dir_fd=None, mode=0o644, **kw):
        if path == files.LATEST and text == "B":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write_text(path, text, dir_fd=dir_fd, mode=mode, **kw)

    return write_text


def slow(real_save_file):
    """The background write is surely still running when the script goes on (and exits)."""
    def save_file(obj, path, dir_fd=None, shown=None, **kw):
        time.sleep(0.5)
        return real_save_file(obj, path, dir_fd=dir_fd, shown=shown, **kw)

    return save_file


def disk_full(real_save_file):
    """The optimizer-state file's write fails as on a full disk."""
    def save_file(obj, path, dir_fd=None, shown=None, **kw):
        if path.endswith("optim_states.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", shown or path)
        return real_save_file(obj, path, dir_fd=dir_fd, shown=shown, **kw)

    return save_file


def main() -> None:
    save_dir, record, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    background = mode != "sync"
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    engine = J.build(J.config(2, 2, checkpoint={"async_save": background}))
    data = J.batches(3)
    J.train(engine, data[:2])
    snap = J.snapshot(engine)
    if rank == 0:
        torch.save({"snap": snap, "global_steps": engine.global_steps}, record + ".tmp")
        os.replace(record + ".tmp", record)
    engine.save_checkpoint(save_dir, tag="A")
    J.train(engine, data[2:])
    if mode == "exit":  # B is written after the script returned: process exit waits for it
        snap = J.snapshot(engine)
        if rank == 0:
            torch.save({"snap": snap, "global_steps": engine.global_steps}, record + ".B")
        files.save_file = slow(files.save_file)
    elif mode == "exitfail":  # B's background write fails on rank 1 and nothing waits for it but exit
        if rank == 1:
            files.save_file = disk_full(files.save_file)
    elif mode == "publish":
        if rank == 0:
            files.write_text = die_while_publishing_latest(files.write_text)
    elif rank == 1:
        files.save_file = die_while_writing_optimizer_file(files.save_file)
    engine.save_checkpoint(save_dir, tag="B")
    sys.stdout.write(f"rank {rank}: save of B returned\n")
    sys.stdout.flush()
    if mode in ("async", "publish"):
        J.train(engine, data[2:])  # training goes on while the thread writes (and dies)
        engine.wait_for_checkpoint()
        sys.stdout.write(f"rank {rank}: background save of B finished\n")


if __name__ == "__main__":
    main()
