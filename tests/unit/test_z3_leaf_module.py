"""ZeRO-3 leaf-module flags (seed 000, "Configuring ZeRO Leaf Modules"): pure module attributes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils import (apply_zero_leaf_module_config, get_z3_leaf_modules, set_z3_leaf_modules,
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class MixtralSparseMoeBlock(nn.Module):  # same bare name as the Hugging Face class of the default list
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = Experts()


class SubExperts(Experts):
    pass


def model() -> nn.Module:
    return nn.ModuleDict({"layers": nn.ModuleList([MixtralSparseMoeBlock(), nn.Linear(4, 4)]),
                          "extra": SubExperts()})


def test_by_class_subclass_and_names() -> None:
    m = model()
    found = set_z3_leaf_modules(m, [Experts])
    assert found == [m["layers"][0].experts, m["extra"]]  # subclass matches too
    assert all(z3_leaf_parameter(p) for p in m["extra"].parameters())
    assert not z3_leaf_parameter(m["layers"][0].gate.weight)
    assert unset_z3_leaf_modules(m, [f"{__name__}.Experts"]) == [m["layers"][0].experts]
    assert get_z3_leaf_modules(m) == [m["extra"]]
    assert set_z3_leaf_modules(m, ["SubExperts"]) == [m["extra"]]
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(m, ["NoSuchBlock"])
    assert set_z3_leaf_modules(m, ["NoSuchBlock"], raise_if_not_found=False) == []


def test_by_name_and_suffix() -> None:
    m = model()
    found, missing = set_z3_leaf_modules_by_name(m, ["layers.0.experts", "nope"], raise_if_not_found=False)
    assert found == [m["layers"][0].experts] and missing == ["nope"]
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(m, ["nope"])
    found, missing = set_z3_leaf_modules_by_suffix(m, ["experts", "gate"])
    assert found == [m["layers"][0].experts, m["layers"][0].gate] and missing == []
    assert z3_leaf_module(m["layers"][0].gate)
    assert not z3_leaf_module(m["layers"][1])


def test_config_section_and_default_classes() -> None:
    m = model()
    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": 3, "leaf_module": {"names": ["extra"]}}}, world_size=1)
    leaf = cfg.model.zero_optimization.leaf_module
    found = apply_zero_leaf_module_config(m, leaf)
    # the default class list names MixtralSparseMoeBlock by its dotted Hugging Face path: bare-name match
    assert m["layers"][0] in found and m["extra"] in found and len(found) == 2
    assert z3_leaf_module(m["layers"][0]) and not z3_leaf_module(m["layers"][0].experts)
