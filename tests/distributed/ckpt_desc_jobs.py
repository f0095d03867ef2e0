"""Jobs of test_checkpoint_description.py: an engine with two optimizer param groups whose sizes need padding
(VarietyNet: 215 and 65 trained elements), saved after two steps and loaded into a fresh engine."""

from __future__ import annotations

import copy
from typing import Any

import ckpt_jobs as J

GROUPS = (("proj.weight", "odd"), ("emb.weight", "proj.bias"))   # not module order


def build(cfg: dict, seed: int) -> Any:
    import deepspeed

    model = J.make("variety", seed)
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in GROUPS[0]]}, {"params": [named[n] for n in GROUPS[1]], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=copy.deepcopy(cfg))
    return engine


def save_job(cfg: dict, save_dir: str) -> dict | None:
    engine = build(cfg, seed=0)
    J.train(engine, J.batches(2))
    snap = J.snapshot(engine)
    engine.save_checkpoint(save_dir)
    return snap if J._dist().get_rank() == 0 else None


def load_job(cfg: dict, load_dir: str) -> dict:
    """A fresh engine loads `load_dir`: {"snap"} (rank 0's, after the load) or {"error"} (every rank's)."""
    engine = build(cfg, seed=123)
    try:
        engine.load_checkpoint(load_dir)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(error).__name__}: {error}"}
    snap = J.snapshot(engine)
    return {"snap": snap if J._dist().get_rank() == 0 else None}
