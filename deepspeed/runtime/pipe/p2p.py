"""Activations and their gradients between neighbouring pipeline stages.

[Note: one message per boundary]
A stage's output may be a tensor or a tuple of tensors in mixed dtypes (hidden states plus an
integer attention mask). Each transfer is one `send`/`recv` of raw bytes: the tensors are
packed into a uint8 buffer (a single contiguous tensor is sent as its own bytes, no copy) and
unpacked on arrival as views of the received buffer. Which dtypes and shapes the bytes hold
(the "meta") is sent once, before the first transfer in each direction of use (training,
evaluation), and cached by both sides; after that, every micro-batch costs exactly one message
of exactly the activation's size per boundary and direction. A stage whose output shape
changes raises (the receiver could not know) unless the module was built with
`dynamic_shape=True`, in which case the meta precedes every transfer.
Gradients go back only for the tensors that required grad on the sending side (floating
point, part of the graph); integer masks and detached tensors travel forward only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ... import comm as ds_comm

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
_ALIGN = 16   # bytes: every packed tensor starts aligned, so views of any dtype are legal


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Meta:
    """What one stage boundary carries: the tensors and whether they came as a tuple."""

    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, value: Any) -> "Meta":
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if not torch.is_tensor(t):
                raise TypeError(f"pipeline stages exchange tensors or tuples of tensors; a stage returned "
                                f"{type(t).__name__} ({t!r:.80})")
            if t.dtype not in _DTYPES:
                raise TypeError(f"pipeline activations of dtype {t.dtype} are not supported ({_DTYPES})")
        return cls(tuple(TensorMeta(t.dtype, tuple(t.shape), bool(t.requires_grad and t.is_floating_point()))
                         for t in tensors), isinstance(value, (tuple, list)))

    def encode(self, device: torch.device) -> torch.Tensor:
        words = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            words += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
        return torch.tensor(words, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, words: list[int]) -> "Meta":
        is_tuple, count, pos, tensors = bool(words[0]), words[1], 2, []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[words[pos]], bool(words[pos + 1]), words[pos + 2]
            tensors.append(TensorMeta(dtype, tuple(words[pos + 3:pos + 3 + ndim]), grad))
            pos += 3 + ndim
        return cls(tuple(tensors), is_tuple)

    @cached_property
    def grad_part(self) -> "Meta":
        """What goes back: the tensors that required grad (computed once per meta)."""
        return Meta(tuple(t for t in self.tensors if t.requires_grad), True)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of one packed transfer (computed once per meta)."""
        return packed_nbytes(self.tensors)


def _offsets(metas: tuple[TensorMeta, ...]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for m in metas:
        offsets.append(pos)
        pos += -(-m.nbytes // _ALIGN) * _ALIGN
    return offsets, pos


def pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of `tensors` as one uint8 tensor ([Note: one message per boundary]), on their
    device (`device`, the link's, when there are none)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1).view(torch.uint8)
    metas = tuple(TensorMeta(t.dtype, tuple(t.shape), False) for t in tensors)
    offsets, total = _offsets(metas)
    device = tensors[0].device if tensors else device
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for t, m, start in zip(tensors, metas, offsets):
        buffer[start:start + m.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unpack(buffer: torch.Tensor, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
    if len(metas) == 1:
        m = metas[0]
        return [buffer.view(m.dtype).view(m.shape)]
    offsets, _ = _offsets(metas)
    return [buffer[start:start + m.nbytes].view(m.dtype).view(m.shape) for m, start in zip(metas, offsets)]


def packed_nbytes(metas: tuple[TensorMeta, ...]) -> int:
    return metas[0].nbytes if len(metas) == 1 else _offsets(metas)[1]


class StageLink:
    """This stage's channel to one neighbour: meta handshake once, then one message per transfer.

    Sends are asynchronous (isend): a stage goes on computing while its neighbour is still busy
    instead of waiting for it to post the matching receive; messages to one peer arrive in the
    order they were posted. Each pending send keeps its buffer alive until done; `flush()` waits
    for all of them (the engine calls it at the end of every schedule)."""

    def __init__(self, peer: int, device: torch.device, dynamic_shape: bool = False) -> None:
        self.peer = peer
        self.device = device
        self.dynamic_shape = dynamic_shape
        self.sent: dict[str, Meta] = {}      # mode ("train"/"eval") -> meta of what we send
        self.received: dict[str, Meta] = {}  # mode -> meta of what we receive
        self._pending: list[tuple[Any, torch.Tensor]] = []   # (work, buffer) of sends in flight

    def _post(self, buffer: torch.Tensor) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.pop(0)
        self._pending.append((ds_comm.isend(buffer, self.peer), buffer))

    def flush(self) -> None:
        """Wait until every send posted so far has completed."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    # --- activations (forward direction) ---------------------------------------------------
    def send_activation(self, value: Any, mode: str) -> None:
        meta = Meta.of(value)
        known = self.sent.get(mode)
        if known is None or self.dynamic_shape:
            self._send_meta(meta)
            self.sent[mode] = meta
        elif known.tensors != meta.tensors or known.is_tuple != meta.is_tuple:
            raise ValueError(f"pipeline activation sent to rank {self.peer} changed from {_describe(known)} to "
                             f"{_describe(meta)}: shapes are exchanged once; build the PipelineModule with "
                             "dynamic_shape=True for inputs whose shape varies")
        tensors = list(value) if isinstance(value, (tuple, list)) else [value]
        self._post(pack(tensors, self.device))

    def recv_activation(self, mode: str) -> Any:
        if mode not in self.received or self.dynamic_shape:
            self.received[mode] = self._recv_meta()
        meta = self.received[mode]
        buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        ds_comm.recv(buffer, self.peer)
        tensors = [t.requires_grad_(m.requires_grad and torch.is_grad_enabled())
                   for t, m in zip(unpack(buffer, meta.tensors), meta.tensors)]
        return tuple(tensors) if meta.is_tuple else tensors[0]

    # --- gradients (backward direction) ------------------------------------------------------
    def send_grads(self, inputs: Any, mode: str) -> None:
        """Send the gradients of the received `inputs` that required grad (zeros where unused)."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in _as_list(inputs) if t.requires_grad]
        if grads:
            self._post(pack(grads, self.device))

    def recv_grads(self, mode: str) -> list[torch.Tensor]:
        """Receive the gradients for what this stage sent (its outputs that required grad)."""
        part = self.sent[mode].grad_part
        if not part.tensors:
            return []
        buffer = torch.empty(part.nbytes, dtype=torch.uint8, device=self.device)
        ds_comm.recv(buffer, self.peer)
        return unpack(buffer, part.tensors)

    # --- meta ----------------------------------------------------------------------------------
    def _send_meta(self, meta: Meta) -> None:
        words = meta.encode(self.device)
        self._post(torch.tensor([words.numel()], dtype=torch.int64, device=self.device))
        self._post(words)

    def _recv_meta(self) -> Meta:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        ds_comm.recv(length, self.peer)
        words = torch.zeros(int(length.item()), dtype=torch.int64, device=self.device)
        ds_comm.recv(words, self.peer)
        return Meta.decode(words.tolist())


def _as_list(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _describe(meta: Meta) -> str:
    return ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in meta.tensors)
