"""The streamed torch.save writer ([Note: streamed checkpoint file] in deepspeed/checkpoint/stream_save.py):
records byte-identical to torch.save's (pickle included), loadable with and without mmap, 64-byte aligned;
a producer that gives the wrong length and a full disk raise, leaving no file."""

from __future__ import annotations

import errno
import io
import os
import struct
import zipfile

import pytest
import torch

from deepspeed.checkpoint import files, stream_save
from deepspeed.checkpoint.stream_save import Streamed, StreamedTensor


def _records(source) -> dict:
    with zipfile.ZipFile(source) as archive:
        return {i.filename: archive.read(i) for i in archive.infolist() if "serialization_id" not in i.filename}


def _chunked(tensor: torch.Tensor, size: int):
    return lambda: (tensor[i:i + size] for i in range(0, tensor.numel(), size))


def _objects():
    big = torch.randn(2 * (stream_save.CHUNK_BYTES // 4) + 13)   # more than one chunk, odd length
    base = torch.arange(10.)
    shared = {"view": base[2:5], "whole": base}   # two tensors, one storage
    plain = {"groups": {0: {"step": torch.tensor(3.), "exp_avg": big, "empty": torch.zeros(0)}},
             "fp32": [torch.arange(7.), torch.ones(3, dtype=torch.bfloat16)], "shared": shared, "x": 1.5,
             "ints": torch.arange(4).to(torch.uint16)}
    streamed = {"groups": {0: {"step": torch.tensor(3.), "exp_avg": StreamedTensor(big.numel(), torch.float32,
                                                                                  _chunked(big, 1 << 20)),
                               "empty": StreamedTensor(0, torch.float32, lambda: iter(()))}},
                "fp32": [torch.arange(7.), torch.ones(3, dtype=torch.bfloat16)], "shared": shared, "x": 1.5,
                "ints": torch.arange(4).to(torch.uint16)}
    return plain, streamed, big


def test_records_equal_torch_save_and_load_with_mmap(tmp_path):
    plain, streamed, big = _objects()
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    path = str(tmp_path / "s.pt")
    stream_save.peak_chunk_bytes = 0
    files.save_file(Streamed(streamed), path)
    assert 0 < stream_save.peak_chunk_bytes <= 4 << 20   # handed over a chunk at a time
    assert _records(path) == _records(io.BytesIO(buffer.getvalue()))   # data.pkl and every storage, bytes
    raw = open(path, "rb").read()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():   # every record's data 64-byte aligned, as torch's writer does
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    for mmap in (False, True):
        loaded = torch.load(path, mmap=mmap, weights_only=True)
        assert torch.equal(loaded["groups"][0]["exp_avg"], big)
        assert loaded["shared"]["view"].untyped_storage().data_ptr() == \
            loaded["shared"]["whole"].untyped_storage().data_ptr()
        assert loaded["fp32"][1].dtype == torch.bfloat16 and loaded["ints"].dtype == torch.uint16


def test_wrong_length_raises_and_leaves_no_file(tmp_path):
    path = str(tmp_path / "s.pt")
    with pytest.raises(RuntimeError, match="3 elements produced, 4 expected"):
        files.save_file(Streamed({"t": StreamedTensor(4, torch.float32, lambda: iter([torch.ones(3)]))}), path)
    assert os.listdir(tmp_path) == []


def test_full_disk_raises_enospc_naming_the_file(tmp_path, monkeypatch):
    written = []
    calls = []

    def full(fd, data):
        if sum(written) > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(data))
        return os.write(fd, data)

    def produce():
        for _ in range(64):
            calls.append(1)
            yield torch.ones(1 << 18)

    monkeypatch.setattr(files, "_write", full)
    path = str(tmp_path / "s.pt")
    with pytest.raises(OSError, match="No space left on device") as raised:
        files.save_file(Streamed({"t": StreamedTensor(64 << 18, torch.float32, produce)}), path)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == path
    assert len(calls) < 8   # stopped at the first failed write, not after reading everything
    assert os.listdir(tmp_path) == []
