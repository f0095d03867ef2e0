"""Muon under ZeRO (upstream's package path): the math (original_muon.py), the optimizer class
(muon_optimizer.py) and the whole-matrix exchange the ZeRO optimizers run (sharded.py)."""
