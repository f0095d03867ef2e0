# compat: upstream import path deepspeed.ops.transformer.transformer
"""``DeepSpeedTransformerLayer``: a BERT encoder layer in plain PyTorch.

Upstream runs this layer as one CUDA kernel; here it is the same math composed from torch's own
fused operators (``scaled_dot_product_attention``, ``addmm``, ``native_layer_norm``, ``gelu``),
so it runs on any device and dtype, and autograd, ZeRO-3 hooks and activation checkpointing see
ordinary tensors. The memory flags of the config swap in the autograd functions of
:mod:`.functions`, which keep fewer activations and recompute them in backward.

Parameter names and shapes are upstream's (``attn_qkvw`` is q, k, v stacked: ``[3H, H]``), so
state dicts move between the two layers unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DeepSpeedTransformerConfig, TransformerConfig
from .functions import DropoutAdd, DropoutAttention, GeluLinear, InvertibleLayerNorm, draw_seed

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]

# name -> shape, in upstream's registration order; "H" hidden, "I" intermediate.
_PARAM_SHAPES = (
    ("attn_qkvw", ("3H", "H")), ("attn_qkvb", ("3H",)), ("attn_ow", ("H", "H")), ("attn_ob", ("H",)),
    ("attn_nw", ("H",)), ("attn_nb", ("H",)), ("inter_w", ("I", "H")), ("inter_b", ("I",)),
    ("output_w", ("H", "I")), ("output_b", ("H",)), ("norm_w", ("H",)), ("norm_b", ("H",)),
)
# initial_weights / initial_biases index -> parameter (0-2 are q, k, v, stacked into attn_qkv*).
_INITIAL_ORDER = ((3, "attn_o"), (4, "attn_n"), (5, "inter_"), (6, "output_"), (7, "norm_"))


class DeepSpeedTransformerLayer(nn.Module):
    """One BERT encoder layer (self-attention + feed-forward), Pre-LN or Post-LN.

    Static variable ``layer_id``: counts the layers created in this process (0, 1, ...); each
    layer stores its own index in ``config.layer_id``.

    Arguments:
        config: a :class:`DeepSpeedTransformerConfig`.
        initial_weights, initial_biases: optional, for tests: the 8 weights / biases of a HF
            ``BertLayer`` in the order q, k, v, attention output, attention LayerNorm,
            intermediate, output, output LayerNorm. They are copied, not shared.

    ``forward(hidden_states, attention_mask=None, ...)`` takes ``[B, S, H]`` and HF BERT's
    extended mask: additive, broadcastable to ``[B, heads, S, S]`` (usually ``[B, 1, 1, S]``),
    or boolean with True = attend. It returns ``[B, S, H]``, or ``(output,)`` with
    ``config.return_tuple`` / ``config.huggingface``.
    """

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights=None, initial_biases=None):
        super().__init__()
        _check_config(config)
        self.config = config
        self.config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0:
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() != "cpu":
                get_accelerator().set_device(config.local_rank)
        sizes = {"H": config.hidden_size, "3H": 3 * config.hidden_size, "I": config.intermediate_size}
        for name, shape in _PARAM_SHAPES:
            setattr(self, name, nn.Parameter(torch.empty(tuple(sizes[s] for s in shape))))  # host: torch.nn's default
        self.init_transformer_weights(config.adjust_init_range)
        with torch.no_grad():
            if initial_weights is not None:
                self._load_initial(initial_weights, "w")
            if initial_biases is not None:
                self._load_initial(initial_biases, "b")
        self.train(config.training)

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """BERT's initialization; ``adjust_init_range`` shrinks the two residual-branch output
        projections by ``1/sqrt(2 * num_hidden_layers)`` (GPT-2 style)."""
        std = self.config.initializer_range if self.config.initializer_range > 0 else 0.02
        output_std = std
        if adjust_init_range and self.config.num_hidden_layers > 0:
            output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers)
        with torch.no_grad():
            for name, _ in _PARAM_SHAPES:
                param = getattr(self, name)
                if name in ("attn_nw", "norm_w"):
                    param.fill_(1.0)
                elif name.endswith("b"):
                    param.zero_()
                else:
                    param.normal_(0.0, output_std if name in ("attn_ow", "output_w") else std)

    def _load_initial(self, tensors, kind: str) -> None:
        if len(tensors) != 8:
            raise ValueError(f"initial_{'weights' if kind == 'w' else 'biases'} needs the 8 tensors of a "
                             f"BertLayer (q, k, v, attn out, attn norm, inter, output, norm); got {len(tensors)}")
        getattr(self, f"attn_qkv{kind}").copy_(torch.cat([t.detach() for t in tensors[:3]]))
        for index, prefix in _INITIAL_ORDER:
            target = getattr(self, prefix + kind)
            if tuple(tensors[index].shape) != tuple(target.shape):
                raise ValueError(f"initial tensor {index} for {prefix + kind} has shape "
                                 f"{tuple(tensors[index].shape)}, expected {tuple(target.shape)}")
            target.copy_(tensors[index].detach())

    def extra_repr(self) -> str:
        c = self.config
        return (f"layer_id={c.layer_id}, hidden_size={c.hidden_size}, heads={c.heads}, "
                f"intermediate_size={c.intermediate_size}, pre_layer_norm={c.pre_layer_norm}")

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask=None, layer_head_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_value=None, output_attentions=False, grads=None, **unused):
        # Upstream ignores these arguments; silently wrong results are worse than an error.
        for name, value in (("head_mask", head_mask), ("layer_head_mask", layer_head_mask),
                            ("encoder_hidden_states", encoder_hidden_states), ("past_key_value", past_key_value)):
            if value is not None:
                raise NotImplementedError(f"DeepSpeedTransformerLayer does not support {name}")
        cfg = self.config
        cfg.is_grad_enabled = torch.is_grad_enabled()
        cfg.training = self.training
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            with torch.autocast(device_type, enabled=False):
                out = self._layer(hidden_states.to(dtype), attention_mask, dtype)
        else:
            if hidden_states.dtype != self.attn_qkvw.dtype:
                raise TypeError(f"DeepSpeedTransformerLayer: input is {hidden_states.dtype} but parameters are "
                                f"{self.attn_qkvw.dtype}; cast the layer (.half()/.bfloat16()) or use autocast")
            out = self._layer(hidden_states, attention_mask, None)
        return (out,) if cfg.return_tuple else out

    def _layer(self, x: torch.Tensor, attention_mask, dtype) -> torch.Tensor:
        cfg = self.config
        w = {name: (p if dtype is None else p.to(dtype)) for name, p in self.named_parameters(recurse=False)}
        attn_p = max(cfg.attn_dropout_ratio, 0.0) if self.training else 0.0
        hidden_p = max(cfg.hidden_dropout_ratio, 0.0) if self.training else 0.0
        seed = draw_seed(cfg.seed * 1_000_003 + cfg.layer_id if cfg.seed >= 0 else 0) if attn_p or hidden_p else 0
        mask = _prepare_mask(attention_mask, x.dtype)

        h = self._norm(x, w["attn_nw"], w["attn_nb"]) if cfg.pre_layer_norm else x
        ctx = self._attention(h, mask, w, attn_p, seed)
        a = _dropout_add(F.linear(ctx, w["attn_ow"], w["attn_ob"]), x, hidden_p, seed + 1)
        if cfg.pre_layer_norm:
            f_in = self._norm(a, w["norm_w"], w["norm_b"])
        else:
            a = f_in = self._norm(a, w["attn_nw"], w["attn_nb"])
        inter = F.linear(f_in, w["inter_w"], w["inter_b"])
        if cfg.gelu_checkpoint and torch.is_grad_enabled():
            ffn = GeluLinear.apply(inter, w["output_w"], w["output_b"])
        else:
            ffn = F.linear(F.gelu(inter), w["output_w"], w["output_b"])
        out = _dropout_add(ffn, a, hidden_p, seed + 2)
        return out if cfg.pre_layer_norm else self._norm(out, w["norm_w"], w["norm_b"])

    def _norm(self, x, weight, bias):
        if self.config.normalize_invertible and torch.is_grad_enabled():
            return InvertibleLayerNorm.apply(x, weight, bias, self.config.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.config.layer_norm_eps)

    def _attention(self, h, mask, w, p, seed):
        cfg = self.config
        batch, seq, hidden = h.shape
        heads = cfg.heads
        qkv = F.linear(h, w["attn_qkvw"], w["attn_qkvb"]).view(batch, seq, 3, heads, hidden // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)            # each [B, heads, S, d]
        if p == 0.0 or cfg.stochastic_mode:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            ctx = DropoutAttention.apply(q, k, v, _additive(mask, h.dtype), p, seed, cfg.attn_dropout_checkpoint)
        return ctx.transpose(1, 2).reshape(batch, seq, hidden)


def _dropout_add(x, residual, p, seed):
    return DropoutAdd.apply(x, residual, p, seed) if p > 0.0 else x + residual


def _prepare_mask(mask, dtype):
    """HF's extended mask as SDPA takes it: bool (True = attend) as is, additive cast to ``dtype``."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask.to(dtype)


def _additive(mask, dtype):
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _check_config(config) -> None:
    for name in ("hidden_size", "heads"):
        if getattr(config, name) <= 0:
            raise ValueError(f"DeepSpeedTransformerConfig.{name} must be set (> 0), got {getattr(config, name)}")
    if config.hidden_size % config.heads:
        raise ValueError(f"DeepSpeedTransformerConfig: hidden_size {config.hidden_size} is not a multiple of "
                         f"heads {config.heads}")
    for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
        if getattr(config, name) >= 1.0:
            raise ValueError(f"DeepSpeedTransformerConfig.{name} must be < 1, got {getattr(config, name)}")
