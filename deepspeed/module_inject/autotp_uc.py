"""Upstream's `model.universal_checkpoint_info` for an AutoTP model: the parameter patterns a universal
checkpoint converter needs to join the tensor ranks' slices (which are row-parallel, which are the
same on every TP rank, which hold a vocabulary, which are fused blocks).

It describes the layout AutoTP made here (module_inject/layers.py): a row layer's weight is split on
dim 1, a column layer's weight and bias on dim 0, every other parameter (norms, embeddings, a row
layer's bias) is whole on every TP rank. Upstream's `ds_to_universal` reads it from the model's
checkpoint state; this package's converter does not use it yet (docs/compatibility.md).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..checkpoint.constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, ORIGINAL_VOCAB_SIZE,
                                    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS,
                                    TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO,
                                    UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                                    VOCABULARY_PARAMETER_PATTERNS)


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """The conversion patterns of `model`'s parameters, each under its first (canonical) name."""
    from .layers import tp_layers

    split = {id(p): (layer, dim) for layer in tp_layers(model) for p, dim in layer.sharded_params()}
    rows, replicated, vocabulary, fused = [], [], [], []
    vocab_size = None
    for name, param in model.named_parameters():   # tied parameters: the first name only
        pattern = rf"^{re.escape(name)}$"
        if id(param) not in split:
            replicated.append(pattern)
            continue
        layer, dim = split[id(param)]
        if dim == 1:
            rows.append(pattern)
        elif param.dim() == 2 and ("embed" in name or "lm_head" in name):
            vocabulary.append(pattern)
            vocab_size = vocab_size or param.shape[0] * layer.tp_world_size
        blocks = layer._blocks(dim)
        if blocks:
            shape: list[Any] = [-1] * param.dim()
            shape[dim] = tuple(blocks)
            fused.append({"patterns": [pattern], "shape": shape, "partition_dim": dim})
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(rows),
            TP_REPLICATED_PARAMETER_PATTERNS: sorted(replicated),
            VOCABULARY_PARAMETER_PATTERNS: sorted(vocabulary),
            PARAMETER_WITH_SUB_PARAMS: fused,
            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {}}
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


def attach(model: nn.Module) -> None:
    """Set `model.universal_checkpoint_info` (upstream's attribute) after AutoTP sharded it."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(model))
