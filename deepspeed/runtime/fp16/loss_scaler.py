# compat: upstream path deepspeed.runtime.fp16.loss_scaler (DeepSpeed 0.19.8 names and signatures)
# onto deepspeed.runtime.precision.loss_scaler. Upstream ZeRO checkpoints pickle these classes by
# this path; the attribute names match, so unpickled objects work as scalers here.
import torch

from deepspeed.runtime.precision.loss_scaler import BaseScaler, DynamicScaler, StaticScaler

# Keys of `fp16` section's dynamic_loss_scale_args() and of CreateLossScaler's dynamic_loss_args.
INITIAL_LOSS_SCALE = 'init_scale'
SCALE_WINDOW = 'scale_window'
DELAYED_SHIFT = 'delayed_shift'
CONSECUTIVE_HYSTERESIS = 'consecutive_hysteresis'
MIN_LOSS_SCALE = 'min_scale'


class LossScalerBase(BaseScaler):
    """Upstream base: adds the legacy `backward` and `scale_gradient` helpers."""

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase, StaticScaler):
    """Static scale; upstream signature `LossScaler(scale=1)`."""

    def __init__(self, scale=1):
        super().__init__(scale)

    def has_overflow(self, params):
        return False


class DynamicLossScaler(LossScalerBase, DynamicScaler):
    """Upstream positional signature; the scale factor is fixed at 2.0 as upstream."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True, dtype=torch.half):
        super().__init__(init_scale=init_scale, scale_factor=2.0, scale_window=scale_window, min_scale=min_scale,
                         delayed_shift=delayed_shift, consecutive_hysteresis=consecutive_hysteresis,
                         raise_error_at_min_scale=raise_error_at_min_scale)
        self.dtype = dtype

    def has_overflow_serial(self, params):
        return any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):
    """Dynamic only for fp16 with dynamic scaling; other dtypes get a static scale of 1.0."""
    if dtype == torch.half and dynamic_scaling:
        assert dynamic_loss_args is not None, "Dynamic loss scaling parameters must be defined."
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
