"""plan_units(kind_of=...): a module owning parameters of several kinds (dense and expert parameters,
partitioned over different groups at ZeRO-3) gets one unit per kind; the module gathers all of them."""

from __future__ import annotations

import torch
from torch import nn

from deepspeed.runtime.zero.stage3.units import plan_units


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.expert = nn.Parameter(torch.zeros(5))
        self.b = nn.Parameter(torch.zeros(2))
        self.inner = nn.Linear(2, 2)


def test_units_split_by_kind_in_order() -> None:
    model = _Mixed()
    model.expert.allreduce = False
    plan = plan_units(model, kind_of=lambda p: getattr(p, "allreduce", True))
    assert [u.param_names for u in plan.units] == [("a", "b"), ("expert",), ("inner.weight", "inner.bias")]
    assert [u.owner for u in plan.units] == ["", "", "inner"]
    assert plan.module_units[""] == (0, 1) and plan.param_unit["expert"] == 1


def test_one_kind_is_the_default_plan() -> None:
    model = _Mixed()
    assert [u.param_names for u in plan_units(model).units] == [("a", "expert", "b"), ("inner.weight", "inner.bias")]
