# compat: upstream path deepspeed.runtime.zero.utils (DeepSpeed 0.19.8 name).
"""`ZeRORuntimeException`: what ZeRO raises for a setup it refuses (upstream's class, same path)."""


class ZeRORuntimeException(Exception):
    """E.g. ZeRO-Offload with a client optimizer that is not one of DeepSpeed's CPU optimizers
    while `zero_force_ds_cpu_optimizer` is true (its default)."""


__all__ = ["ZeRORuntimeException"]
