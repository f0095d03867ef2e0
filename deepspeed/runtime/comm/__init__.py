"""Upstream's `deepspeed.runtime.comm` path (coalesced collectives)."""
