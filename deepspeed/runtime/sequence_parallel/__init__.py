"""Sequence parallelism (Ulysses / ALST): upstream's `deepspeed.runtime.sequence_parallel` package."""
