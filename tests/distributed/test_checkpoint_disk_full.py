"""A save into a file system that is really full (a small tmpfs in a private mount namespace, two
ranks under the launcher): every rank raises an error that names ENOSPC, the file and the bytes,
nothing of the failed tag stays on disk, the previous checkpoint loads, and saving works again
once there is space. (test_checkpoint_agreed.py injects ENOSPC at the write layer on one rank:
the same contract, on machines where no tmpfs can be mounted.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _namespace() -> list[str] | None:
    """A command prefix giving a private mount namespace where tmpfs can be mounted: `unshare -m`
    as root, `unshare -rm` (a user namespace) otherwise; None when neither works here."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-m"] if os.geteuid() == 0 else None, ["unshare", "-rm"]):
        if prefix is None:
            continue
        probe = subprocess.run(prefix + ["sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return prefix
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_save_into_a_full_file_system(tmp_path):
    prefix = _namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (needs root or unprivileged user namespaces)")
    save_dir, record = tmp_path / "small", tmp_path / "record"
    save_dir.mkdir()
    record.mkdir()
    script = os.path.join(HERE, "ckpt_disk_full_script.py")
    launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(_free_port()),
              "--num_gpus", "2", "--no_local_rank", script, str(save_dir), str(record)]
    shell = f'mount -t tmpfs -o size=1m tmpfs "{save_dir}" && exec "$@"'
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(prefix + ["sh", "-c", shell, "sh"] + launch, capture_output=True, text=True,
                            timeout=240, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(save_dir) == []  # the tmpfs was private to the job's namespace
    for rank in (0, 1):
        r = json.loads((record / f"rank{rank}.json").read_text())
        assert r["type"] == "CheckpointError", r
        message = r["message"]
        assert message.startswith(f"save_checkpoint: writing {save_dir}/ckpt/bad"), message
        assert "failed failed" not in message and "unexpected pos" not in message, message
        assert "OSError: [Errno 28] No space left on device (the file needs " in message, message
        assert "bytes free on that file system" in message and f"{save_dir}/ckpt/.bad.partial/" in message, message
        assert r["failures"], r
        assert r["listing"] == ["good", "latest", "zero_to_fp32.py"], r  # no staging directory, no .tmp
        assert r["leftovers"] == [] and r["latest"] == "good", r
        assert r["loaded"] == [f"{save_dir}/ckpt/good/mp_rank_00_model_states.pt", 1], r
        assert r["latest_after"] == "after", r
