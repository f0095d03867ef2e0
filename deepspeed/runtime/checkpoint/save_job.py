"""Writing one checkpoint tag: this rank's files, then (rank 0) publishing it; inline or in the background.

[Note: background save]
With `checkpoint.async_save`, `save_checkpoint` returns as soon as the state is a snapshot in
memory (tensors that training would change are copied; the re-cut partitions are new tensors
anyway) and a thread of each rank writes its files, fsyncs them and the staging directory. The
thread does file I/O only, never a collective: ranks tell rank 0 that they are done (or failed,
with the message) through marker files in the staging directory, and rank 0's thread publishes
the tag (rename, then `latest`) only after every rank's `done` marker appeared
([Note: crash-safe save] in checkpoint/files.py). A rank killed mid-write leaves no marker, so
the tag is never published and `latest` keeps naming the previous one. The next
save_checkpoint, load_checkpoint and engine.wait_for_checkpoint() join the thread and agree on
its outcome across ranks on the main thread ([Note: agreed errors]), so a failed
background write raises on every rank; engine.destroy() and interpreter exit wait for it too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
import weakref
from typing import Any

from ...checkpoint import files
from ...utils.logging import logger

PEER_TIMEOUT_S = float(os.environ.get("DEEPSPEED_CHECKPOINT_PEER_TIMEOUT_S", "1800"))
_DONE, _FAILED = ".rank{}.done", ".rank{}.failed"


class PeerFailed(files.CheckpointError):
    """Rank 0 did not publish because another rank's background write failed (that rank reports why)."""


class SaveJob:
    """This rank's files of one tag (name -> object to torch.save) and, on rank 0, the publishing."""

    def __init__(self, save_dir: str, tag: str, rank: int, world: int, entries: list[tuple[str, Any]],
                 save_latest: bool) -> None:
        self.save_dir, self.tag, self.rank, self.world = save_dir, tag, rank, world
        self.entries, self.save_latest = entries, save_latest
        self.staging = files.staging_dir(save_dir, tag)

    def write(self) -> None:
        """This rank's files into the staging directory, each complete (fsynced) before its rename,
        then one fsync of the directory so the renames are durable too."""
        for name, obj in self.entries:
            files.save_file(obj, os.path.join(self.staging, name))
        self.entries = []  # release the snapshot as soon as it is on disk
        if files.FSYNC:
            files.fsync_dir(self.staging)

    def publish(self) -> None:
        """Rank 0, once every rank's files are complete: the tag becomes visible, then `latest`."""
        for r in range(self.world):
            _remove(os.path.join(self.staging, _DONE.format(r)))
        files.commit_staging(self.save_dir, self.tag)
        if self.save_latest:
            files.write_text(os.path.join(self.save_dir, files.LATEST), self.tag)
        copy_recovery_script(self.save_dir)

    def discard(self) -> None:
        files.discard_staging(self.save_dir, self.tag)

    # --- the background protocol (file I/O only) ------------------------------------------------
    def run_background(self) -> None:
        try:
            self.write()
        except BaseException as error:
            _mark(self.staging, _FAILED.format(self.rank), f"{type(error).__name__}: {error}")
            raise
        _mark(self.staging, _DONE.format(self.rank), "")
        if self.rank == 0:
            self._wait_for_peers()
            self.publish()

    def _wait_for_peers(self) -> None:
        deadline, pause = time.monotonic() + PEER_TIMEOUT_S, 0.005
        waiting = set(range(1, self.world))
        while waiting:
            for r in sorted(waiting):
                failed = os.path.join(self.staging, _FAILED.format(r))
                if os.path.exists(failed):
                    with open(failed) as handle:
                        raise PeerFailed(f"rank {r} failed to write its files: {handle.read()}")
                if os.path.exists(os.path.join(self.staging, _DONE.format(r))):
                    waiting.discard(r)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise files.CheckpointError(f"ranks {sorted(waiting)} did not finish writing {self.staging} "
                                            f"within {PEER_TIMEOUT_S:g} s (DEEPSPEED_CHECKPOINT_PEER_TIMEOUT_S); "
                                            "not published")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


class PendingSave:
    """A SaveJob running in a background thread of this rank."""

    def __init__(self, job: SaveJob) -> None:
        self.job = job
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"deepspeed-checkpoint-{job.tag}", daemon=False)
        _PENDING.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.job.run_background()
        except BaseException as error:  # noqa: BLE001 - surfaced by join() on the main thread
            self.error = error

    def join(self) -> BaseException | None:
        self.thread.join()
        _PENDING.discard(self)
        return self.error


_PENDING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """Non-daemon threads are joined by the interpreter before this runs; this reports failures."""
    for pending in list(_PENDING):
        error = pending.join()
        if error is not None:
            logger.error(f"background checkpoint save of {pending.job.tag} failed: {error}")


def copy_recovery_script(save_dir: str) -> None:
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "utils", "zero_to_fp32.py")
    if os.path.isfile(source):
        target = os.path.join(save_dir, "zero_to_fp32.py")
        shutil.copyfile(source, target + ".tmp")
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)


def _mark(staging: str, name: str, text: str) -> None:
    try:
        with open(os.path.join(staging, name), "w") as handle:
            handle.write(text)
    except OSError as error:
        logger.error(f"checkpoint: cannot write marker {name} in {staging}: {error}")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
