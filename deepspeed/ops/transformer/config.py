# compat: upstream deepspeed.ops.transformer.transformer.{TransformerConfig, DeepSpeedTransformerConfig}
"""Configuration of :class:`~deepspeed.ops.transformer.DeepSpeedTransformerLayer`.

A plain mutable object, not a pydantic model: upstream's users (and its own layer) write
attributes onto it after construction (``layer_id``, ``training``, ``is_grad_enabled``) and
``from_dict`` sets arbitrary keys, so the same freedom is kept here.
"""

from __future__ import annotations

import json
from typing import Any


class TransformerConfig:
    """The sizes every transformer layer needs; the base of :class:`DeepSpeedTransformerConfig`."""

    def __init__(self, batch_size, hidden_size, intermediate_size, heads, attn_dropout_ratio,
                 hidden_dropout_ratio, num_hidden_layers, initializer_range):
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """Configuration of one BERT-style encoder layer (upstream's argument list and order).

    Arguments:
        batch_size: largest micro batch (informational: nothing here is preallocated).
        hidden_size, intermediate_size (default ``4 * hidden_size``), heads: the layer's shape.
        attn_dropout_ratio: dropout on the attention probabilities; hidden_dropout_ratio: on the
            attention output and the layer output. Negative means 0.
        num_hidden_layers, initializer_range: used by the default initialization.
        layer_norm_eps: LayerNorm epsilon (BERT: 1e-12).
        local_rank: if >= 0, the accelerator device the layer's parameters are created on.
        seed: if >= 0, mixed into every dropout draw (torch's generators still drive the
            sequence, so ``torch.manual_seed`` and activation checkpointing keep working).
        fp16, bf16: the precision the layer is meant to run in; the computation follows the
            dtype of the parameters (call ``.half()``/``.bfloat16()`` or let an engine cast).
        pre_layer_norm: Pre-LN (True) or Post-LN (False, original BERT) architecture.
        normalize_invertible: keep LayerNorm outputs instead of inputs for backward.
        gelu_checkpoint: recompute GELU in backward instead of keeping its output.
        adjust_init_range: scale the std of the two residual-branch output projections by
            ``1 / sqrt(2 * num_hidden_layers)``.
        attn_dropout_checkpoint: regenerate the attention-dropout mask in backward instead of
            keeping it.
        stochastic_mode: let ``scaled_dot_product_attention`` apply attention dropout itself
            (fused on CUDA); faster, but masks differ from the default path.
        return_tuple / huggingface (aliases): forward returns ``(output,)`` like a HF layer.
        training: initial value of the module's training flag.
        max_seq_length: the longest sequence (informational).
    """

    def __init__(self,
                 batch_size=-1,
                 hidden_size=-1,
                 intermediate_size=-1,
                 heads=-1,
                 attn_dropout_ratio=-1,
                 hidden_dropout_ratio=-1,
                 num_hidden_layers=-1,
                 initializer_range=-1,
                 layer_norm_eps=1e-12,
                 local_rank=-1,
                 seed=-1,
                 fp16=False,
                 pre_layer_norm=True,
                 normalize_invertible=False,
                 gelu_checkpoint=False,
                 adjust_init_range=True,
                 attn_dropout_checkpoint=False,
                 stochastic_mode=False,
                 return_tuple=False,
                 training=True,
                 huggingface=False,
                 max_seq_length=-1,
                 bf16=False):
        super().__init__(batch_size, hidden_size,
                         intermediate_size if intermediate_size > 0 else 4 * hidden_size, heads,
                         attn_dropout_ratio, hidden_dropout_ratio, num_hidden_layers, initializer_range)
        self.fp16 = fp16
        self.bf16 = bf16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple or huggingface
        self.max_seq_length = max_seq_length

    # The seed document (0.3-era) calls the tuple output `huggingface`; 0.19.8 calls it `return_tuple`.
    @property
    def huggingface(self) -> bool:
        return self.return_tuple

    @huggingface.setter
    def huggingface(self, value: bool) -> None:
        self.return_tuple = value

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedTransformerConfig:
        config = cls()
        for key, value in json_object.items():
            setattr(config, key, value)
        if "hidden_size" in json_object and "intermediate_size" not in json_object:
            config.intermediate_size = 4 * config.hidden_size
        return config

    @classmethod
    def from_json_file(cls, json_file: str) -> DeepSpeedTransformerConfig:
        # Upstream reads UTF-16; accept that (BOM) and plain UTF-8.
        with open(json_file, "rb") as reader:
            raw = reader.read()
        text = raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode("utf-8")
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["huggingface"] = self.return_tuple
        return out

    def __repr__(self) -> str:
        return f"DeepSpeedTransformerConfig({self.to_dict()})"
