"""Copies out of memory-mapped checkpoint files give the file's pages back ([Note: released reads])."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepspeed.checkpoint import files, mapped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status, madvise")

MIB = 1 << 20


def _rss_file() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "state.pt")
    torch.save({"flat": torch.arange(12 * MIB // 4, dtype=torch.float32)}, path)   # 12 MiB of values
    return path


def test_released_copy_is_exact_and_leaves_few_file_pages(saved):
    obj = files.load_file(saved)
    mapping = mapped.mapping_of(saved, obj)
    assert mapping is not None and mapping.holds(obj["flat"])
    source = obj["flat"][5:]   # not page aligned
    before = _rss_file()
    out = torch.empty_like(source)
    mapped.copy_released(out, source, [mapping])
    assert _rss_file() - before < 10 * MIB   # one 8 MiB chunk at most stays mapped, not 12 MiB
    assert torch.equal(out, torch.arange(5, 12 * MIB // 4, dtype=torch.float32))
    assert torch.equal(source, out)   # released pages read back from the file


def test_plain_copy_keeps_the_file_pages(saved):
    """What the release saves: without it the whole source stays resident (the test above can fail)."""
    obj = files.load_file(saved)
    before = _rss_file()
    torch.empty_like(obj["flat"]).copy_(obj["flat"])
    assert _rss_file() - before > 10 * MIB


def test_memory_not_in_a_recorded_mapping_is_copied_plainly(saved):
    obj = files.load_file(saved)
    mapping = mapped.mapping_of(saved, obj)
    fresh = torch.arange(4 * MIB, dtype=torch.float32)   # anonymous memory: releasing it would zero it
    assert not mapping.holds(fresh)
    out = torch.empty_like(fresh)
    mapped.copy_released(out, fresh, [mapping])
    assert torch.equal(out, fresh) and torch.equal(fresh, torch.arange(4 * MIB, dtype=torch.float32))


def test_small_files_are_not_looked_up(tmp_path):
    path = str(tmp_path / "small.pt")
    torch.save({"x": torch.ones(16)}, path)
    assert os.path.getsize(path) < mapped.MIN_FILE_BYTES and mapped.mapping_of(path, files.load_file(path)) is None
