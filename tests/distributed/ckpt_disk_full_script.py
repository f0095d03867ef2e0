"""Run under the launcher with two ranks, in a private mount namespace whose SAVE_DIR is a small
tmpfs (test_checkpoint_disk_full.py): save a good checkpoint, fill the file system, save again.
Usage: ckpt_disk_full_script.py SAVE_DIR RECORD_DIR. Each rank writes RECORD_DIR/rank{r}.json."""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

import ckpt_jobs as J  # noqa: E402


def fill(path: str) -> None:
    """Write zeros until the file system is full."""
    with open(path, "wb", buffering=0) as handle:
        chunk = bytes(4096)
        try:
            while True:
                handle.write(chunk)
        except OSError:
            pass


def main() -> None:
    save_dir, record = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    ckpt, filler = os.path.join(save_dir, "ckpt"), os.path.join(save_dir, "filler")
    engine = J.build(J.config(2, 2))
    data = J.batches(3)
    J.train(engine, data[:1])
    engine.save_checkpoint(ckpt, tag="good")
    engine.wait_for_checkpoint()
    J.train(engine, data[1:2])
    if rank == 0:
        fill(filler)
    dist.barrier()
    out = {"type": None}
    try:
        engine.save_checkpoint(ckpt, tag="bad")
        engine.wait_for_checkpoint()
    except Exception as error:  # noqa: BLE001 - recorded for the test
        out = {"type": type(error).__name__, "message": str(error), "failures": getattr(error, "failures", None)}
    dist.barrier()
    out["listing"] = sorted(os.listdir(ckpt))
    out["leftovers"] = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs
                              if f.endswith(".tmp") or ".partial" in d)
    out["latest"] = open(os.path.join(ckpt, "latest")).read()
    dist.barrier()
    fresh = J.build(J.config(2, 2), seed=123)
    path, _ = fresh.load_checkpoint(ckpt)
    out["loaded"] = [path, fresh.global_steps]
    if rank == 0:
        os.remove(filler)
    dist.barrier()
    engine.save_checkpoint(ckpt, tag="after")  # space again: saving works
    engine.wait_for_checkpoint()
    out["latest_after"] = open(os.path.join(ckpt, "latest")).read()
    with open(os.path.join(record, f"rank{rank}.json"), "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    main()
