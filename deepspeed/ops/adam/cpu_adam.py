"""DeepSpeedCPUAdam: the ZeRO-Offload Adam(W), on torch's fused CPU kernel.

Upstream ships an AVX C++ kernel because ``torch.optim.Adam`` used to be slow on the
CPU. torch >= 2.4 has a fused CPU Adam that is ~10x faster than its foreach path, so
this class reuses :class:`~deepspeed.ops.adam.fused_adam.AdamBase` and only keeps the
upstream vocabulary: ``adamw_mode`` and ``fp32_optimizer_states`` (fp32 moments even
for bf16/fp16 params; see [Note: optimizer state dtype] in ``deepspeed.ops._multi_tensor``).
"""

from __future__ import annotations

import torch

from deepspeed.ops.adam.fused_adam import AdamBase


class DeepSpeedCPUAdam(AdamBase):
    """Adam/AdamW for parameters held in CPU memory (upstream signature).

    Args:
        model_params: iterable of tensors or of param-group dicts.
        lr, bias_correction, betas, eps, weight_decay: as in Adam; per group overridable.
        amsgrad: refused (``RuntimeError``), as upstream.
        adamw_mode: True for decoupled weight decay (AdamW), False for the L2 penalty.
        fp32_optimizer_states: keep moments in fp32 whatever the param dtype.
    """

    optimizer_id = 0  # upstream numbers instances for its C++ registry; kept for compatibility

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, amsgrad=amsgrad
        )
        state_dtype = torch.float32 if fp32_optimizer_states else None
        super().__init__(model_params, defaults, adam_w_mode=bool(adamw_mode), state_dtype=state_dtype)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, refusing AMSGrad as upstream does."""
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
