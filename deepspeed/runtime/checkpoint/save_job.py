"""Writing one checkpoint tag: this rank's files, then (rank 0) publishing it; inline or in the background.

[Note: background save]
By default (`checkpoint.async_save`), `save_checkpoint` returns as soon as the state is a snapshot
in memory (tensors that training would change are copied; the re-cut partitions are new tensors
anyway) and descriptors of the save and staging directories are open; a thread of each rank
writes its files, fsyncs them and the staging directory. Everything the thread touches is named
relative to those descriptors, so a rename of the save directory (or of one above it) right after
the call, as HF Trainer's `tmp-checkpoint-N` -> `checkpoint-N`, does not disturb it: the tag is
published inside the renamed directory. The thread does file I/O only, never a collective: ranks
tell rank 0 that they are done (or failed, with the message) through marker files in the staging
directory, and rank 0's thread publishes the tag (rename, then `latest`) only after every rank's
`done` marker appeared ([Note: crash-safe save] in checkpoint/files.py). A rank killed mid-write
leaves no marker, so the tag is never published and `latest` keeps naming the previous one. The
next save_checkpoint, load_checkpoint and engine.wait_for_checkpoint() join the thread and agree
on its outcome across ranks on the main thread ([Note: agreed errors]), so a failed
background write raises on every rank; deepspeed.initialize and any engine's load_checkpoint join
every such thread of the process first (wait_all_local), engine.destroy() waits for its own, and
process exit joins it (a non-daemon thread): the last checkpoint is published before the process
ends. `async_save: false` runs the same job inline (published when save_checkpoint returns).
"""

from __future__ import annotations

import atexit
import os
import sys
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
    """This rank's files of one tag (name -> object to torch.save) and, on rank 0, the publishing.

    Holds descriptors of the save directory and of the staging directory, opened on the calling
    thread before save_checkpoint returns: every later step (files, markers, renames, `latest`)
    names entries relative to them, so renaming the save directory or one above it (HF Trainer's
    `tmp-checkpoint-N` -> `checkpoint-N`) while the job runs changes nothing."""

    def __init__(self, save_dir: str, tag: str, rank: int, world: int, entries: list[tuple[str, Any]],
                 save_latest: bool, prepare: list | None = None, release: list | None = None) -> None:
        self.save_dir, self.tag, self.rank, self.world = save_dir, tag, rank, world
        self.entries, self.save_latest = entries, save_latest
        self.names: list[str] = []  # the files written so far
        self.prepare = list(prepare or [])  # local work completing the entries' tensors (on the writer's thread)
        self.release = list(release or [])  # what the entries read, freed once written (or abandoned)
        self.staging = files.staging_dir(save_dir, tag)
        self.save_fd = files.open_dir(save_dir)
        try:
            self.stage_fd = files.open_dir(os.path.basename(self.staging), self.save_fd)
        except BaseException:
            os.close(self.save_fd)
            raise
        self._closer = weakref.finalize(self, _close, self.save_fd, self.stage_fd)

    def write(self, durable: bool = True) -> None:
        """This rank's files into the staging directory, each complete (fsynced, unless not
        `durable`: see make_durable) before its rename, then one fsync of the directory so the
        renames are durable too."""
        for finish in self.prepare:
            finish()
        self.prepare = []
        try:
            for name, obj in self.entries:
                files.save_file(obj, name, dir_fd=self.stage_fd, shown=os.path.join(self.staging, name),
                                fsync=durable)
                self.names.append(name)
        finally:
            self._released()
        self.entries = []  # release the snapshot as soon as it is on disk
        if files.FSYNC and durable:
            files.fsync_fd(self.stage_fd)

    def make_durable(self) -> None:
        """[Note: durable later]
        The default save (async_save false) writes every file and publishes the tag before
        save_checkpoint returns, as upstream: the tag is complete and `latest` names it, so a
        script (or HF Trainer rotating old checkpoints) may use, copy or delete what is on disk
        right away, and a killed process cannot leave a partial tag (files are renamed into place
        only once complete, the tag only once every rank's files are). What a killed *process*
        cannot lose, a lost *machine* can: written pages not yet on the disk. Flushing them
        (fsync) is most of a save's time, so this thread does it after the return, through the
        save directory's descriptor (a renamed parent does not matter; a tag deleted meanwhile
        has nothing left to flush). The next save, load, wait_for_checkpoint(), destroy() and
        process exit wait for it; an fsync failure (a full disk on a file system that reports it
        only there) surfaces there, on every rank."""
        if self.rank == 0:   # what publish wrote beside the tags
            self._flush([files.LATEST, "zero_to_fp32.py"], self.save_fd, self.save_dir)
        try:
            tag_fd = files.open_dir(self.tag, self.save_fd)
        except FileNotFoundError:
            return
        try:
            self._flush(self.names, tag_fd, os.path.join(self.save_dir, self.tag))
            files.fsync_fd(tag_fd)
        finally:
            os.close(tag_fd)
        if self.rank == 0:
            files.fsync_fd(self.save_fd)

    @staticmethod
    def _flush(names: list[str], dir_fd: int, shown: str) -> None:
        """fsync each of `names` in `dir_fd` that is still there; a full disk is named as on writing."""
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as error:
                if error.errno in files._FULL:
                    raise files.disk_full(error, os.path.join(shown, name), None, dir_fd) from error
                raise
            finally:
                os.close(fd)

    def publish(self, durable: bool = True) -> None:
        """Rank 0, once every rank's files are complete: the tag becomes visible, then `latest`
        (flushed now, or by make_durable when not `durable`)."""
        for r in range(self.world):
            _remove(_DONE.format(r), self.stage_fd)
        files.commit_staging(self.save_dir, self.tag, dir_fd=self.save_fd, fsync=durable)
        if self.save_latest:
            files.write_text(files.LATEST, self.tag, dir_fd=self.save_fd, fsync=durable)
        copy_recovery_script(self.save_fd, fsync=durable)

    def discard(self) -> None:
        files.discard_staging(self.save_dir, self.tag, dir_fd=self.save_fd)

    def _released(self) -> None:
        while self.release:
            self.release.pop()()

    def close(self) -> None:
        self._released()
        self._closer()

    # --- the background protocol (file I/O only) ------------------------------------------------
    def run_background(self) -> None:
        try:
            self.write()
        except BaseException as error:
            _mark(self.stage_fd, _FAILED.format(self.rank), f"{type(error).__name__}: {error}")
            raise
        _mark(self.stage_fd, _DONE.format(self.rank), "")
        if self.rank == 0:
            self._wait_for_peers()
            self.publish()

    def _wait_for_peers(self) -> None:
        deadline, pause = time.monotonic() + PEER_TIMEOUT_S, 0.005
        waiting = set(range(1, self.world))
        while waiting:
            for r in sorted(waiting):
                try:
                    fd = os.open(_FAILED.format(r), os.O_RDONLY, dir_fd=self.stage_fd)
                except FileNotFoundError:
                    pass
                else:
                    with os.fdopen(fd) as handle:
                        raise PeerFailed(f"rank {r} failed to write its files: {handle.read()}")
                if files.exists_at(_DONE.format(r), self.stage_fd):
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
    """A SaveJob's background part running in a thread of this rank: all of it (async_save), or
    only make_durable (the default)."""

    def __init__(self, job: SaveJob, durable_only: bool = False) -> None:
        self.job = job
        self.target = job.make_durable if durable_only else job.run_background
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"deepspeed-checkpoint-{job.tag}", daemon=False)
        _PENDING.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.target()
        except BaseException as error:  # noqa: BLE001 - surfaced by join() on the main thread
            self.error = error
        else:
            self.job.close()  # on failure the owner discards the staging directory first

    def join(self) -> BaseException | None:
        self.thread.join()
        _PENDING.discard(self)
        return self.error


_PENDING: weakref.WeakSet = weakref.WeakSet()


def wait_all_local() -> None:
    """Join every background save of this process (no collective; each failure stays with its
    PendingSave for its engine's next wait to report): before anything reads checkpoints here
    (deepspeed.initialize, load_checkpoint of any engine)."""
    for pending in list(_PENDING):
        if pending.thread is not threading.current_thread():
            pending.thread.join()


@atexit.register
def _wait_at_exit() -> None:
    """Non-daemon threads are joined by the interpreter before this runs; this reports failures."""
    failed = False
    for pending in list(_PENDING):
        error = pending.join()
        if error is not None:
            failed = True
            logger.error(f"background save_checkpoint of {pending.job.tag} into {pending.job.save_dir} failed "
                         f"({'not published' if pending.target != pending.job.make_durable else 'not on disk'}): "
                         f"{error}")
            pending.job.discard()
            pending.job.close()
    if failed:  # the run did not succeed: its last checkpoint is lost; the exit status must say so
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - closed streams
                pass
        os._exit(1)


def copy_recovery_script(save_fd: int, fsync: bool = True) -> None:
    """zero_to_fp32.py beside the tags (in the directory of `save_fd`), replaced atomically."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "utils", "zero_to_fp32.py")
    if os.path.isfile(source):
        with open(source) as handle:
            files.write_text("zero_to_fp32.py", handle.read(), dir_fd=save_fd, mode=0o755, fsync=fsync)


def _mark(stage_fd: int, name: str, text: str) -> None:
    """A marker file: created first (an inode, no data block: it appears even on a full disk),
    then filled."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=stage_fd)
    except OSError as error:
        logger.error(f"checkpoint: cannot write marker {name}: {error}")
        return
    try:
        os.write(fd, text.encode())
    except OSError as error:
        logger.error(f"checkpoint: cannot fill marker {name}: {error}")
    finally:
        os.close(fd)


def _remove(name: str, dir_fd: int) -> None:
    try:
        os.remove(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
