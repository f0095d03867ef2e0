"""Which whole-block AutoEP layers carry DeepSpeed 0.19.8's router alias, and the one rule loads apply to it
([Note: AutoEP router alias] in deepspeed/module_inject/auto_ep_alias.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepspeed.checkpoint.files import CheckpointError
from deepspeed.module_inject.auto_ep_alias import drop_alias_entries, router_alias_name, router_capture


class _Recorded(nn.Linear):
    _can_record_outputs = {"router_logits": {"index": 0, "layer_name": "router_probe"}}


def _alias(block: nn.Module, router: nn.Module, adapter: str) -> str | None:
    target, layer_name = router_capture(block, router, adapter)
    spec = SimpleNamespace(router_name="gate", router_logits_capture_target=target,
                           router_logits_capture_layer_name=layer_name)
    return router_alias_name(spec, nn.Module())


@pytest.mark.parametrize("adapter, router, block_records, alias", [
    ("mixtral", nn.Linear(2, 2), False, "gate"),           # upstream retargets the recorder to the router
    ("qwen3_moe", nn.Linear(2, 2), False, "gate"),
    ("qwen3_5_moe", nn.Linear(2, 2), True, "gate"),
    ("deepseek_v3", nn.Linear(2, 2), False, None),         # nothing recorded: no alias
    ("default", _Recorded(2, 2), False, "router_probe"),   # the router class records: its layer_name
    ("default", _Recorded(2, 2), True, None),              # the block records instead
])
def test_alias_only_where_upstream_registers_it(adapter, router, block_records, alias) -> None:
    block = nn.Module()
    if block_records:
        block._can_record_outputs = {"router_logits": 1}
    assert _alias(block, router, adapter) == alias


def test_drop_alias_entries() -> None:
    w = torch.randn(4, 3)
    state = {"b.router.gate.weight": w, "b.gate.gate.weight": w.clone(), "b.experts.w1": torch.ones(1)}
    drop_alias_entries(state, "b.", "gate")
    assert list(state) == ["b.router.gate.weight", "b.experts.w1"]
    alone = {"b.gate.gate.weight": w}   # only the alias: it is the router's
    drop_alias_entries(alone, "b.", "gate")
    assert list(alone) == ["b.router.gate.weight"]
    bad = {"b.router.gate.weight": w, "b.gate.gate.weight": w + 1}
    with pytest.raises(CheckpointError, match=r"ckpt/t: 'b\.gate\.gate\.weight' differs from 'b\.router\.gate\.weight'"):
        drop_alias_entries(bad, "b.", "gate", "ckpt/t")
