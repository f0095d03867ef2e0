"""AutoEP presets: per-model-family descriptions of where a Hugging Face model keeps its MoE blocks
(base.py: the data types; registry.py: the built-in presets and their lookup)."""
