"""Progress bars of long offline work: zero_to_fp32 and ds_to_universal draw a tqdm bar on a terminal
(a real pseudo-terminal here) and print none into pipes; a checkpoint load draws one on rank 0 when
a terminal watches and the load is large (DS_PROGRESS_MIN_BYTES), and stays quiet otherwise."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "ds_0_19_8" / "stage2_fp32"


def run(cmd: list[str], cwd: Path, terminal: bool) -> tuple[int, str]:
    """Run `cmd` with stdout and stderr on a pseudo-terminal (`terminal`) or on pipes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not terminal:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
        return proc.returncode, proc.stdout + proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a 100-column terminal
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=180), b"".join(chunks).decode(errors="replace")


@pytest.fixture()
def checkpoint(tmp_path):
    if not FIXTURE.is_dir():
        pytest.skip("fixture checkpoint missing")
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("terminal", [True, False])
def test_zero_to_fp32_bar_only_on_a_terminal(checkpoint, terminal):
    script = ROOT / "deepspeed" / "utils" / "zero_to_fp32.py"
    rc, out = run([sys.executable, str(script), str(checkpoint), str(checkpoint / "out")], checkpoint, terminal)
    assert rc == 0, out
    assert ("Saving checkpoint shards" in out and "B/s" in out) is terminal


@pytest.mark.parametrize("terminal", [True, False])
def test_ds_to_universal_bar_only_on_a_terminal(checkpoint, terminal):
    rc, out = run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   str(checkpoint / "global_step3"), "--output_folder", str(checkpoint / "universal")],
                  checkpoint, terminal)
    assert rc == 0, out
    assert ("Converting to universal" in out) is terminal and "ds_to_universal: wrote" in out


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("watched,threshold,drawn", [(True, "0", True), (True, None, False), (False, "0", False)])
def test_checkpoint_load_bar(tmp_path, monkeypatch, watched, threshold, drawn):
    import deepspeed

    if threshold is None:
        monkeypatch.delenv("DS_PROGRESS_MIN_BYTES", raising=False)   # the default: 256 MiB, far above this model
    else:
        monkeypatch.setenv("DS_PROGRESS_MIN_BYTES", threshold)
    model = torch.nn.Linear(64, 64)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.save_checkpoint(str(tmp_path), tag="t")
    stdout, stderr = (Terminal() if watched else io.StringIO()), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        path, _ = engine.load_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    assert path is not None and stderr.getvalue() == ""
    assert ("Loading checkpoint" in stdout.getvalue()) is drawn
