"""DeepSpeed ops: optimizers (``adam``, ``lamb``, ``lion``, ``adagrad``) in pure PyTorch.

Subpackages are deliberately not imported here, so ``import deepspeed.ops`` stays cheap;
import e.g. ``deepspeed.ops.adam`` to get ``FusedAdam`` and ``DeepSpeedCPUAdam``.
"""
