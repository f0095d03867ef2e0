"""Engine-side checkpointing: what the engine's state looks like on disk (see engine_io.py)."""
