"""Upstream's NVMe tensor swapping. Not supported in this build (``offload_*.device: nvme`` is a
config error); only the constant that callers size their tensors by is kept, with upstream's value."""

MIN_SWAPPABLE_BYTES = 1024 * 1024  # upstream swaps no tensor smaller than 1 MiB

__all__ = ["MIN_SWAPPABLE_BYTES"]
