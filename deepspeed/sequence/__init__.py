"""Sequence parallelism for hand-built models: `deepspeed.sequence.layer.DistributedAttention` (Ulysses)."""
