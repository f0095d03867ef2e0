# compat: `from deepspeed.accelerator import get_accelerator`
from .real_accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
