"""Router-alias jobs (run on every rank by run_distributed; [Note: AutoEP router alias]): the AutoEP fixture
model (tests/fixtures/ds_0_19_8_autoep_zero3/autoep_model.py, Mixtral-style blocks replaced whole) saved and
loaded here, its module state holding upstream's `mlp.gate.gate.*` alias entries."""

from __future__ import annotations

import os
import shutil
import sys

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")


def _model_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if f.endswith("_model_states.pt") and not f.startswith("layer_"))


def _rewrite(src: str, dst: str, edit) -> None:
    """A copy of tag `src` at `dst` whose model-states files' module state is `edit(module)`."""
    shutil.copytree(src, dst)
    for f in _model_files(dst):
        state = torch.load(f, weights_only=False)
        state["module"] = edit(dict(state["module"]))
        torch.save(state, f)


def alias_save_load_run(save_dir: str, stage: int) -> dict:
    """Train 1 step at `stage` (ep 2), save; rank 0 reports the model file's module keys and which alias entries
    share their router entry's storage once loaded back; then strict loads of: the tag (weights equal), a copy
    without the alias entries (an older file of ours), a copy with one alias entry changed (the error)."""
    import deepspeed
    import deepspeed.comm as dist

    sys.path.insert(0, os.path.join(FIXTURES, "ds_0_19_8_autoep_zero3"))
    import autoep_model

    config = autoep_model.config()
    config["zero_optimization"] = {"stage": stage}
    engine, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
    rank = dist.get_rank()
    engine.backward(engine(autoep_model.batch(0, rank)))
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    tag = os.path.join(save_dir, "t")
    out: dict = {}
    if rank == 0:
        module = torch.load(_model_files(tag)[0], weights_only=False)["module"]
        out["keys"] = list(module)
        out["shared"] = {k: module[k].untyped_storage().data_ptr() ==
                         module[k.replace(".gate.gate.", ".router.gate.")].untyped_storage().data_ptr()
                         for k in module if ".mlp.gate.gate." in k}
        out["numel"] = {k: v.numel() for k, v in module.items() if ".gate." in k}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out["fp32_keys"] = list(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t"))
        _rewrite(tag, os.path.join(save_dir, "old"),
                 lambda m: {k: v for k, v in m.items() if ".mlp.gate.gate." not in k})
        key = "model.layers.1.mlp.gate.gate.weight"
        _rewrite(tag, os.path.join(save_dir, "bad"), lambda m: {**m, key: torch.ones(3)})
    dist.barrier()
    params = {n: p for n, p in engine.module.named_parameters()}
    for name in ("t", "old"):
        other, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
        other.load_checkpoint(save_dir, tag=name)   # strict
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()) + list(other.module.parameters())) \
                if stage == 3 else _null():
            out[f"{name}_equal"] = all(torch.equal(p, params[n]) for n, p in other.module.named_parameters())
    if stage == 1:   # torch's strict load_state_dict of upstream's form (aliases) and of the form without them
        whole = engine.module.state_dict()   # (collective: whole experts)
        out["state_dict_has_alias"] = "model.layers.0.mlp.gate.gate.weight" in whole
        for name, state in (("with", whole), ("without", {k: v for k, v in whole.items() if ".gate.gate." not in k})):
            other, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
            other.module.load_state_dict(state)
            out[f"load_state_dict_{name}_alias"] = all(torch.equal(p, params[n])
                                                       for n, p in other.module.named_parameters())
    other, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
    try:
        other.load_checkpoint(save_dir, tag="bad")
        out["bad"] = "loaded"
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        out["bad"] = f"{type(exc).__name__}: {exc}"
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()
