"""Upstream's asynchronous NVMe I/O op. This build has none (NVMe offload is not supported): its
builder reports itself incompatible, so code that gates on it (``__compatible_ops__["async_io"]``)
takes its no-NVMe path, and ``load()`` raises saying so."""

from ..op_builder import AsyncIOBuilder  # noqa: F401

__all__ = ["AsyncIOBuilder"]
