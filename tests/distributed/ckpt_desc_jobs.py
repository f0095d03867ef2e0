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


def base_state_job(cfg: dict, groups: bool, save_to: str | None = None, load_from: str | None = None) -> dict:
    """[Note: the base optimizer's state_dict at ZeRO-1/2]: after two steps, the base optimizer's
    state_dict() all-gathered per group flat (equal sizes on every rank, or the gather fails), the
    flats of a one-bucket group against the full states in bucket order, and a round trip with
    exp_avg doubled through its load_state_dict. `load_from`: a state_dict saved at another world size."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.shard_state_dict import FLAT_MARK

    engine = build(cfg, seed=0) if groups else J.build(cfg, "variety", seed=0)
    J.train(engine, J.batches(2))
    base = engine.optimizer.optimizer
    sd = base.state_dict()
    out: dict[str, Any] = {"mark": sd.get(FLAT_MARK), "keys": sorted(sd["state"]),
                           "params": [g["params"] for g in sd["param_groups"]]}
    world = dist.get_world_size()
    gathered = {}
    for g, entry in sd["state"].items():
        for field in J.STATE_FIELDS:
            parts = [torch.empty_like(entry[field]) for _ in range(world)]
            dist.all_gather(parts, entry[field])
            gathered[(g, field)] = torch.cat(parts)
    before = J.snapshot(engine)
    if not groups:   # one group: is each of its buckets, gathered, the bucket's flat of full states?
        buckets = [b.params for b in engine.optimizer.reducer.buckets]
        out["one_bucket"] = len(buckets) == 1
        full = {field: torch.cat([before[n][field].reshape(-1) for p in buckets[0]
                                  for n, q in engine.module.named_parameters() if q is p]) for field in J.STATE_FIELDS}
        out["gathered_is_full"] = all(torch.equal(gathered[(0, f)][:full[f].numel()], full[f]) for f in full)
    if save_to is not None and dist.get_rank() == 0:
        torch.save(sd, save_to)
    if load_from is not None:
        try:
            base.load_state_dict(torch.load(load_from, weights_only=False))
        except ValueError as error:
            out["error"] = str(error)
        return out
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] * 2
    base.load_state_dict(sd)
    after = J.snapshot(engine)
    out["doubled"] = all(torch.equal(after[n]["exp_avg"], before[n]["exp_avg"] * 2) and
                         torch.equal(after[n]["exp_avg_sq"], before[n]["exp_avg_sq"]) and
                         torch.equal(after[n]["fp32"], before[n]["fp32"]) for n in before)
    out["raw_form_back"] = len(base.state) == sum(len(g["params"]) for g in base.param_groups)
    out["losses"] = J.train(engine, J.batches(3)[2:])
    return out
