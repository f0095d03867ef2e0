"""Monitors (deepspeed.monitor): the files they write are read back and compared with what went in,
including a training run whose events must equal the engine's own losses, learning rates and
gradient norms; the optional backends fail with the extra to install when their package is
missing and make the expected calls when it is there (fake wandb / comet_ml modules)."""

from __future__ import annotations

import csv
import os
import sys
import types

import pytest
import torch

from deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.monitor.utils import MonitorUnavailableError

EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8), ("Train/Samples/train_loss", 2.25, 16)]


def read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def read_tensorboard(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_csv_monitor_files_and_resume(tmp_path):
    config = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}})
    assert config.enabled and not config.tensorboard.enabled
    master = MonitorMaster(config)
    master.write_events(EVENTS)
    master.close()
    folder = tmp_path / "run"
    assert sorted(os.listdir(folder)) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert read_csv(folder / "Train_Samples_train_loss.csv") == [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]]
    again = MonitorMaster(config)          # a resumed run appends, without a second header
    again.write_events([("Train/Samples/lr", 5e-4, 24)])
    again.close()
    assert read_csv(folder / "Train_Samples_lr.csv") == [["step", "lr"], ["8", "0.001"], ["24", "0.0005"]]


def test_tensorboard_monitor_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    master = MonitorMaster(get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                                               "job_name": "tb"}}))
    master.write_events(EVENTS)
    master.close()
    assert read_tensorboard(str(tmp_path / "tb")) == {"Train/Samples/train_loss": [(8, 2.5), (16, 2.25)],
                                                     "Train/Samples/lr": [(8, pytest.approx(1e-3))]}


def test_nothing_enabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    master = MonitorMaster(DeepSpeedMonitorConfig())
    assert not master.enabled and master.backends() == []
    master.write_events(EVENTS)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("section,module,extra", [("tensorboard", "tensorboard", "tensorboard"),
                                                  ("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet")])
def test_missing_package_names_the_extra(section, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)   # makes `import module` fail
    with pytest.raises(MonitorUnavailableError) as info:
        MonitorMaster(get_monitor_config({section: {"enabled": True}}))
    message = str(info.value)
    assert f"{section}.enabled is true" in message and f"deepspeed[{extra}]" in message and "pip install" in message


def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.calls = []
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_wandb_calls(monkeypatch):
    wandb = fake_module("wandb")
    wandb.init = lambda **kw: wandb.calls.append(("init", kw))
    wandb.log = lambda data, step=None, commit=None: wandb.calls.append(("log", data, step))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    master = MonitorMaster(get_monitor_config({"wandb": {"enabled": True, "project": "p", "team": "t",
                                                         "group": "g"}}))
    master.write_events(EVENTS[:2])
    assert wandb.calls == [("init", {"project": "p", "group": "g", "entity": "t"}),
                           ("log", {"Train/Samples/train_loss": 2.5}, 8), ("log", {"Train/Samples/lr": 1e-3}, 8)]


def test_comet_calls_and_interval(monkeypatch):
    experiment = types.SimpleNamespace(logged=[], names=[])
    experiment.log_metric = lambda name, value, step=None: experiment.logged.append((name, value, step))
    experiment.set_name = experiment.names.append
    comet = fake_module("comet_ml", __version__="3.45.0")
    comet.start = lambda **kw: (comet.calls.append(kw), experiment)[1]
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    master = MonitorMaster(get_monitor_config({"comet": {"enabled": True, "project": "p", "samples_log_interval": 10,
                                                         "experiment_name": "exp"}}))
    assert comet.calls[0]["project"] == "p" and experiment.names == ["exp"]
    master.write_events([("loss", 1.0, 8), ("loss", 2.0, 12), ("loss", 3.0, 18), ("lr", 0.1, 18)])
    assert experiment.logged == [("loss", 1.0, 8), ("loss", 3.0, 18), ("lr", 0.1, 18)]   # 12 is < 10 after 8
    comet.__version__ = "3.40.0"
    with pytest.raises(MonitorUnavailableError, match="version 3.40.0"):
        MonitorMaster(get_monitor_config({"comet": {"enabled": True}}))


def test_engine_events_equal_the_engines_losses_lrs_and_norms(tmp_path):
    """Two monitors on a 6-step run with gradient accumulation: every step's train_loss, lr and
    grad_norm, keyed by samples, equal what the script saw; the breakdown goes every 3 steps."""
    import deepspeed

    import importlib.util

    tensorboard = importlib.util.find_spec("tensorboard") is not None   # CSV is checked either way
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 3,
           "wall_clock_breakdown": True, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
           "tensorboard": {"enabled": tensorboard, "output_path": str(tmp_path), "job_name": "tb"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    want: dict[str, list[tuple[int, float]]] = {"train_loss": [], "lr": [], "grad_norm": []}
    micro = []
    for _ in range(12):
        x, y = torch.randn(4, 8).to(engine.device), torch.randint(0, 3, (4,)).to(engine.device)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        micro.append(loss.detach())
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            step = engine.global_samples
            want["train_loss"].append((step, torch.stack(micro).mean().item()))
            want["lr"].append((step, engine.get_lr()[0]))
            want["grad_norm"].append((step, float(engine.get_global_grad_norm())))
            micro = []
    engine.destroy()
    assert [s for s, _ in want["lr"]] == [8, 16, 24, 32, 40, 48]
    for name, rows in want.items():
        got = read_csv(tmp_path / "csv" / f"Train_Samples_{name}.csv")
        assert got[0] == ["step", name] and [(int(s), float(v)) for s, v in got[1:]] == rows, name
    for part in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        got = read_csv(tmp_path / "csv" / f"Train_Samples_elapsed_time_ms_{part}.csv")
        assert [int(s) for s, _ in got[1:]] == [24, 48] and all(float(v) >= 0 for _, v in got[1:])
    assert not os.path.exists(tmp_path / "csv" / "Train_Samples_loss_scale.csv")   # fp32: no loss scale
    if tensorboard:
        scalars = read_tensorboard(str(tmp_path / "tb"))
        for name, rows in want.items():
            assert scalars[f"Train/Samples/{name}"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in rows], name


def test_user_events_and_fp16_loss_scale(tmp_path):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    cfg = {"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 4},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    scales = []
    for _ in range(3):
        out = engine(torch.randn(2, 8).half().to(engine.device))
        engine.backward(out.float().pow(2).mean())
        engine.step()
        scales.append((engine.global_samples, float(engine.loss_scale_value())))
    engine.monitor.write_events([("Custom/accuracy", 0.75, engine.global_samples)])
    engine.destroy()
    got = read_csv(tmp_path / "j" / "Train_Samples_loss_scale.csv")[1:]
    assert [(int(s), float(v)) for s, v in got] == scales and scales[0][1] == 16.0
    assert read_csv(tmp_path / "j" / "Custom_accuracy.csv") == [["step", "accuracy"], ["6", "0.75"]]
