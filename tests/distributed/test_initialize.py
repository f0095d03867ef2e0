"""`deepspeed.initialize` with every argument form of the 0.3.0 manual (seed 004) and the current API."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import pytest
import torch

from harness import run_distributed
from models import make_model

BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def initialize_forms() -> dict:
    import deepspeed

    out = {}
    # 1. args.deepspeed_config (a JSON path) through add_config_arguments
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ds.json")
        with open(path, "w") as f:
            json.dump(BASE, f)
        parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
        parser.add_argument("--local_rank", type=int, default=-1)
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
        model = make_model()
        engine, opt, loader, sched = deepspeed.initialize(args=args, model=model,
                                                          model_parameters=model.parameters())
        out["args_path"] = (type(opt).__name__, loader, sched, args.local_rank)
        with pytest.raises(ValueError, match="both"):
            deepspeed.initialize(args=args, model=make_model(), config=BASE)

    # 2. config dict and legacy config_params
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=dict(BASE))
    out["config_dict"] = (engine.config == BASE, engine.train_batch_size())
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config_params=dict(BASE))
    out["config_params"] = type(opt).__name__

    # 3. client optimizer: instance, and callable taking the parameters; client scheduler: callable
    model = make_model()
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = {"train_micro_batch_size_per_gpu": 2}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=cfg)
    out["client_instance"] = opt is client
    model = make_model()
    engine, opt, _, sched = deepspeed.initialize(
        model=model, model_parameters=(p for p in model.parameters()),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.25),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), config=cfg)
    out["client_callable"] = (type(opt).__name__, opt.param_groups[0]["lr"], type(sched).__name__)

    # 4. param-group dicts with their own options, and a generator of parameters
    model = make_model()
    groups = [{"params": model.fc1.parameters(), "lr": 0.1}, {"params": model.head.parameters()}]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=dict(BASE))
    out["groups"] = [g["lr"] for g in opt.param_groups]

    # 5. no optimizer at all: inference only
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 1})
    with torch.no_grad():
        y = engine(torch.randn(3, 16))
    with pytest.raises(RuntimeError, match="optimizer"):
        engine.backward(y.sum())
    out["inference"] = (opt, tuple(y.shape))

    # 6. training_data → a distributed DataLoader with collate_fn
    data = torch.utils.data.TensorDataset(torch.arange(16).float().unsqueeze(1))
    engine, _, loader, _ = deepspeed.initialize(model=make_model(), config=dict(BASE), training_data=data,
                                                collate_fn=lambda batch: torch.cat([b[0] for b in batch]))
    out["loader"] = sorted(int(v) for batch in loader for v in batch)
    out["attrs"] = (engine.module.__class__.__name__, engine.fc1.in_features, isinstance(engine, torch.nn.Module))
    return out


def test_initialize_argument_forms() -> None:
    results = run_distributed(2, initialize_forms)
    r0, r1 = results
    assert r0["args_path"][0] in ("FusedAdam", "Adam", "AdamW") and r0["args_path"][1] is None
    assert r0["args_path"][3] == 0 and r1["args_path"][3] == 1  # args.local_rank set from LOCAL_RANK
    assert r0["config_dict"] == (True, 4)
    assert r0["client_instance"] is True
    assert r0["client_callable"] == ("SGD", 0.25, "StepLR")
    assert r0["groups"][0] == 0.1 and r0["groups"][1] == pytest.approx(1e-3)
    assert r0["inference"] == (None, (3, 4))
    # each rank gets a disjoint half of the dataset
    assert sorted(r0["loader"] + r1["loader"]) == list(range(16)) and not set(r0["loader"]) & set(r1["loader"])
    assert r0["attrs"] == ("TinyMLP", 16, True)


def bad_config_everywhere() -> str:
    import deepspeed

    try:
        deepspeed.initialize(model=make_model(), config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2})
    except ValueError as err:
        return str(err)
    return "no error"


def test_bad_config_fails_on_every_rank_without_hanging() -> None:
    results = run_distributed(2, bad_config_everywhere, timeout=60)
    assert all("train_batch_size" in r for r in results), results
