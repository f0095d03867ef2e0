"""`deepspeed.runtime.activation_checkpointing` (`deepspeed.checkpointing` is its `checkpointing` module)."""
