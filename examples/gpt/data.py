"""Byte-level text data for the GPT example: no tokenizer, vocabulary = the 256 byte values."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "austen.txt")


def load_corpus(path: str | None = None) -> torch.Tensor:
    """Read a text file as raw bytes and return them as a 1-D uint8 tensor.

    Bytes rather than decoded characters so any UTF-8 text works with a fixed
    vocabulary of 256, and uint8 so a 1 MB corpus costs 1 MB of memory per rank.
    """
    with open(path or DEFAULT_CORPUS, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"corpus {path or DEFAULT_CORPUS!r} is empty")
    # bytearray: torch.frombuffer wants a writable buffer; clone detaches from it.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def decode(tokens) -> str:
    """Turn byte tokens back into text (invalid UTF-8 from sampling is replaced, not raised)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class TextDataset(Dataset):
    """Map-style dataset of (x, y) next-byte-prediction windows at fixed offsets.

    Item ``i`` starts at byte ``i * stride``: ``x = data[o : o + block_size]`` and
    ``y = data[o + 1 : o + block_size + 1]`` (y is x shifted by one). Offsets depend only
    on ``i``, so every rank and every run sees identical samples for the same index,
    which is what a DistributedSampler and a reproducible benchmark need. ``stride``
    defaults to ``block_size`` (non-overlapping windows).
    """

    def __init__(self, path: str | None = None, block_size: int = 128, stride: int | None = None,
                 data: torch.Tensor | None = None):
        self.block_size = int(block_size)
        self.stride = int(stride or block_size)
        if self.block_size < 1 or self.stride < 1:
            raise ValueError("block_size and stride must be positive")
        self.data = data if data is not None else load_corpus(path)
        # Each window needs block_size + 1 bytes (the extra one is the last target).
        span = self.data.numel() - (self.block_size + 1)
        if span < 0:
            raise ValueError(f"corpus of {self.data.numel()} bytes is shorter than block_size + 1")
        self._len = span // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} windows")
        o = i * self.stride
        chunk = self.data[o:o + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]
