"""Run under the launcher with two ranks (test_checkpoint_crash.py): train, save checkpoint A,
train one more step, then save checkpoint B while rank 1 SIGKILLs itself half-way through
writing its optimizer-state file. Usage: ckpt_crash_script.py SAVE_DIR RECORD_FILE [async].
With `async` the saves use checkpoint.async_save: B's files are written by a background thread
(the kill hits that thread's write, after save_checkpoint returned and training went on)."""

from __future__ import annotations

import datetime
import io
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.checkpoint import files  # noqa: E402

import ckpt_jobs as J  # noqa: E402


def die_while_writing_optimizer_file(real_save_file):
    def save_file(obj, path):
        if path.endswith("optim_states.pt"):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getvalue()
            with open(path + ".tmp", "wb") as handle:  # where files.save_file writes before its rename
                handle.write(data[:len(data) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save_file(obj, path)

    return save_file


def main() -> None:
    save_dir, record = sys.argv[1], sys.argv[2]
    background = len(sys.argv) > 3 and sys.argv[3] == "async"
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
    if rank == 1:
        files.save_file = die_while_writing_optimizer_file(files.save_file)
    engine.save_checkpoint(save_dir, tag="B")
    sys.stdout.write(f"rank {rank}: save of B returned\n")
    sys.stdout.flush()
    if background:
        J.train(engine, data[2:])  # training goes on while the thread writes (and dies)
        engine.wait_for_checkpoint()
        sys.stdout.write(f"rank {rank}: background save of B finished\n")


if __name__ == "__main__":
    main()
