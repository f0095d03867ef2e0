"""`deepspeed.checkpoint`: reading and converting DeepSpeed-layout checkpoints (files, reader, universal)."""

from .files import CheckpointError  # noqa: F401
