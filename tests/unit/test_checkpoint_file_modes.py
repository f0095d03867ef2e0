"""File systems that refuse permission changes (Azure Files and other SMB / FUSE mounts: chmod raises
EPERM or ENOTSUP) must not fail a save: the checkpoint is whole without the mode, as DeepSpeed's
`_change_recovery_script_permissions` logs and goes on. os.fchmod / os.chmod are made to refuse here
(no such mount on the test machine); every other file operation is real."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from deepspeed.checkpoint import files


@pytest.fixture
def logged():
    """The messages DeepSpeed's logger emits (it does not propagate to the root logger caplog reads)."""
    from deepspeed.utils.logging import logger

    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _refuse(err: int):
    def chmod(*_args, **_kwargs):
        raise OSError(err, os.strerror(err))
    return chmod


@pytest.mark.parametrize("err", [errno.EPERM, errno.ENOTSUP])
def test_write_text_goes_on_where_chmod_is_refused(tmp_path, monkeypatch, logged, err):
    monkeypatch.setattr(os, "fchmod", _refuse(err))
    target = str(tmp_path / "zero_to_fp32.py")
    files.write_text(target, "print('hi')\n", mode=0o755)
    assert open(target).read() == "print('hi')\n" and not os.path.exists(target + ".tmp")
    assert any("Could not change the permissions" in m and target in m for m in logged), logged


def test_other_chmod_errors_still_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fchmod", _refuse(errno.EIO))
    with pytest.raises(OSError, match="Input/output"):
        files.write_text(str(tmp_path / "latest"), "tag")
    assert not os.listdir(tmp_path)   # the temporary file is removed


def test_change_recovery_script_permissions(tmp_path, monkeypatch, logged):
    from deepspeed.runtime.engine import DeepSpeedEngine

    script = tmp_path / "zero_to_fp32.py"
    script.write_text("pass\n")
    os.chmod(script, 0o644)
    DeepSpeedEngine._change_recovery_script_permissions(str(script))
    assert os.stat(script).st_mode & 0o100
    DeepSpeedEngine._change_recovery_script_permissions(str(tmp_path / "missing.py"))   # logged, not raised
    monkeypatch.setattr(os, "chmod", _refuse(errno.EPERM))
    DeepSpeedEngine._change_recovery_script_permissions(str(script))
    assert sum("Could not change the permissions" in m for m in logged) == 2, logged


def test_elastic_checkpoint_at_stage_3_says_it_is_deprecated(logged):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert any("elastic checkpointing is deprecated" in m for m in logged), logged
