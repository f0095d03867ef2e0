# compat: `from deepspeed.accelerator import get_accelerator`
from .real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
