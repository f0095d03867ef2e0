# compat: upstream deepspeed.nvme (the ds_io / ds_nvme_tune commands).
"""DeepNVMe measurement tools over the Python I/O handle: `ds_io` (one measurement) and
`ds_nvme_tune` (a sweep that suggests the `aio` config section); see io_bench.py."""

from .io_bench import ds_io_main, measure, suggest, tune_main  # noqa: F401

__all__ = ["ds_io_main", "measure", "suggest", "tune_main"]
