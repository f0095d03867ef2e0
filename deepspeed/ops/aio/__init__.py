"""Upstream's asynchronous NVMe I/O op (`async_io`): `AsyncIOBuilder().load()` returns this module,
whose `aio_handle` is the DeepNVMe handle in Python over the OS ([Note: the pure-Python I/O engine]
in handle.py). No build, no libaio."""

from ..op_builder import AsyncIOBuilder  # noqa: F401
from .handle import aio_handle  # noqa: F401

__all__ = ["AsyncIOBuilder", "aio_handle"]
