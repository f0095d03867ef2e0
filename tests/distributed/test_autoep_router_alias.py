"""Whole-block AutoEP checkpoints carry DeepSpeed 0.19.8's router alias ([Note: AutoEP router alias]): our saves
write `<block>.gate.gate.weight` beside `<block>.router.gate.weight` as one storage, and strict loads accept it,
an older file without it, and refuse one whose alias differs, naming it."""

from __future__ import annotations

import pytest

from autoep_alias_jobs import alias_save_load_run
from harness import run_distributed

ALIASES = ["model.layers.0.mlp.gate.gate.weight", "model.layers.1.mlp.gate.gate.weight"]


@pytest.mark.parametrize("stage", [1, 3])
def test_autoep_save_writes_router_alias_and_strict_loads_accept_it(tmp_path, stage: int) -> None:
    r0, r1 = run_distributed(2, alias_save_load_run, str(tmp_path), stage)
    keys = r0["keys"]
    for alias in ALIASES:   # upstream's order: the router's entries, then the alias's, then the experts'
        router = alias.replace(".gate.gate.", ".router.gate.")
        assert keys.index(alias) == keys.index(router) + 1, keys
        # ZeRO-1: the router's tensor itself (torch.save writes its storage once); ZeRO-3: empty placeholders
        assert r0["shared"][alias] if stage == 1 else r0["numel"][alias] == r0["numel"][router] == 0
    # zero_to_fp32 lists each parameter once, as DeepSpeed's consolidations do: no alias
    assert "model.layers.0.mlp.router.gate.weight" in r0["fp32_keys"]
    assert not [k for k in r0["fp32_keys"] if ".gate.gate." in k], r0["fp32_keys"]
    for r in (r0, r1):
        assert r["t_equal"] and r["old_equal"]
        if stage == 1:   # module.state_dict() / load_state_dict(strict) as upstream's, older dicts accepted
            assert r["state_dict_has_alias"] and r["load_state_dict_with_alias"] and r["load_state_dict_without_alias"]
        assert "model.layers.1.mlp.gate.gate.weight" in r["bad"] and "model.layers.1.mlp.router.gate.weight" \
            in r["bad"] and "differs" in r["bad"], r["bad"]
