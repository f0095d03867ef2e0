"""torch.save's file format, written with some tensors' bytes streamed: [Note: streamed checkpoint file].

[Note: streamed checkpoint file]
With NVMe-offloaded optimizer state the rank's optimizer-states file holds the whole state re-cut
into DeepSpeed's flat per-group partitions; building those tensors would put all of it in memory.
Instead the file's object holds `StreamedTensor`s: a 1-D tensor's dtype and length plus a
producer that yields its bytes in order (read from the swap files a chunk at a time). `write`
pickles the object exactly as torch.save does (same `data.pkl` bytes: a StreamedTensor pickles as
the plain tensor it stands for, its storage a persistent id like any other) and writes torch's
zip records (`data.pkl`, `.format_version`, `.storage_alignment`, `byteorder`, `data/<key>` in
key order, `version`, `.data/serialization_id`), each stored uncompressed with its data 64-byte
aligned as torch's writer does, so `torch.load` (with `mmap=True` too) reads the same keys,
dtypes, shapes and bytes as from torch.save. `peak_chunk_bytes` counts the largest chunk a
producer handed over (tests bound it).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import uuid
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

CHUNK_BYTES = 16 << 20   # what a producer reads and hands over at a time
_ALIGN = 64               # torch's storage alignment in the zip file
_ARCHIVE = "archive/"
peak_chunk_bytes = 0      # largest chunk handed over since the last reset (tests)


class StreamedTensor:
    """A 1-D CPU tensor of `numel` `dtype` elements known only by `produce()`: an iterator of
    tensors of that dtype whose elements, concatenated, are the tensor's (exactly `numel`)."""

    def __init__(self, numel: int, dtype: torch.dtype, produce: Callable[[], Iterator[torch.Tensor]]) -> None:
        if dtype in torch.storage._new_dtypes():
            raise TypeError(f"StreamedTensor: dtype {dtype} is saved through UntypedStorage; use a classic dtype")
        self.numel, self.dtype, self.produce = int(numel), dtype, produce
        self.shape = torch.Size([self.numel])

    def __reduce_ex__(self, proto: int) -> tuple:
        # what torch.Tensor.__reduce_ex__ gives a contiguous 1-D tensor owning its storage (a new
        # stride tuple each time, as Tensor.stride() returns: a shared one would pickle as a memo reference)
        return (torch._utils._rebuild_tensor_v2, (_Storage(self), 0, (self.numel,), tuple([1]), False, OrderedDict()))

    def materialize(self) -> torch.Tensor:
        """The whole tensor in memory (tests; never on the save path)."""
        parts = list(self.produce())
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)  # host: a checkpoint tensor


class _Storage:
    __slots__ = ("tensor",)

    def __init__(self, tensor: StreamedTensor) -> None:
        self.tensor = tensor


class Streamed:
    """A file's object holding StreamedTensors: `files.save_file` writes it with `write`."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def _storage_record(obj: Any, keys: dict, records: dict) -> tuple | None:
    """torch.serialization's persistent id of a storage (its format: ('storage', storage type,
    key, location, numel)); keys are assigned in first-seen order."""
    if isinstance(obj, _Storage):
        key = keys.setdefault(id(obj.tensor), str(len(keys)))
        records[key] = obj.tensor
        kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.tensor.dtype])
        return ("storage", kind, key, "cpu", obj.tensor.numel)
    if isinstance(obj, torch.storage.TypedStorage):
        storage, numel = obj._untyped_storage, obj._size()
        kind = getattr(torch, obj._pickle_storage_type())
    elif torch.is_storage(obj):
        storage, numel = obj, obj.nbytes()
        kind = torch.serialization.normalize_storage_type(type(obj))
    else:
        return None
    key = keys.setdefault(storage._cdata, str(len(keys)))
    records[key] = storage
    return ("storage", kind, key, torch.serialization.location_tag(storage), numel)


def _pickled(obj: Any) -> tuple[bytes, dict]:
    keys: dict = {}
    records: dict = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            return _storage_record(value, keys, records)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue(), records


def streamed_in_order(obj: Any) -> list[StreamedTensor]:
    """The StreamedTensors of `obj` in the order `write` writes their records."""
    return [r for r in _pickled(obj)[1].values() if isinstance(r, StreamedTensor)]


def _chunks(record: Any) -> Iterator[memoryview]:
    global peak_chunk_bytes
    if isinstance(record, StreamedTensor):
        produced = 0
        for chunk in record.produce():
            chunk = chunk.detach().to("cpu", record.dtype).contiguous()
            produced += chunk.numel()
            nbytes = chunk.numel() * chunk.element_size()
            peak_chunk_bytes = max(peak_chunk_bytes, nbytes)
            if nbytes:
                yield memoryview(chunk.view(torch.uint8).numpy())
        if produced != record.numel:
            raise RuntimeError(f"streamed checkpoint tensor: {produced} elements produced, {record.numel} expected")
        return
    storage = record if record.device.type == "cpu" else record.cpu()
    if storage.nbytes():
        whole = torch.empty(0, dtype=torch.uint8, device="cpu")  # host: a byte view of the storage
        whole.set_(storage, 0, (storage.nbytes(),), (1,))
        yield memoryview(whole.numpy())


def _nbytes(record: Any) -> int:
    if isinstance(record, StreamedTensor):
        return record.numel * torch.empty(0, dtype=record.dtype).element_size()  # host: element size
    return record.nbytes()


def _put(archive: zipfile.ZipFile, sink: Any, name: str, nbytes: int, chunks: Iterator[Any]) -> None:
    """One stored record whose data starts at a multiple of 64 bytes (torch pads with an 'FB' extra field)."""
    info = zipfile.ZipInfo(_ARCHIVE + name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    zip64 = nbytes >= zipfile.ZIP64_LIMIT
    header = 30 + len(info.filename.encode()) + 4 + (20 if zip64 else 0)
    pad = -(sink.tell() + header) % _ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    with archive.open(info, "w", force_zip64=zip64) as out:
        for chunk in chunks:
            out.write(chunk)
            if getattr(sink, "error", None) is not None:   # files._Sink: a full disk stops the stream
                raise sink.error


def write(obj: Any, sink: Any) -> None:
    """`obj` in torch.save's format into the seekable binary file object `sink`."""
    data, records = _pickled(obj)
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        small = [("data.pkl", data), (".format_version", b"1"),
                 (".storage_alignment", str(_ALIGN).encode()), ("byteorder", sys.byteorder.encode())]
        for name, value in small:
            _put(archive, sink, name, len(value), iter([value]))
        for key, record in records.items():
            _put(archive, sink, f"data/{key}", _nbytes(record), _chunks(record))
        ident = str(uuid.uuid4().int).zfill(40)[:40].encode()
        for name, value in (("version", b"3\n"), (".data/serialization_id", ident)):
            _put(archive, sink, name, len(value), iter([value]))
