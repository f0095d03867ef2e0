"""Ranks started with different configs: every rank raises the same ConfigMismatchError naming the
differing keys with each rank's value, before any collective depends on the config; the same config
written differently agrees. [Note: cross-rank config agreement] in deepspeed/runtime/config/agreement.py.

Each job catches its error and returns it, so the worker pool stays usable (and a rank that did not
raise would return "ok": the test sees it instead of hanging)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from harness import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _with(config: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(config))
    *parents, leaf = dotted.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return {"type": type(e).__name__, "message": str(e), "differences": getattr(e, "differences", None)}
    return {"type": "ok"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def initialize_job(configs: list, steps: int = 0, mpu: bool = False) -> dict:
    """deepspeed.initialize with this rank's config (configs[rank]); train `steps` steps when it agrees."""
    import deepspeed
    from deepspeed import comm as ds_comm

    rank = ds_comm.get_rank()

    def run():
        model = _model()
        kwargs = {}
        if mpu:
            from test_activation_checkpointing_ranks import GroupMpu

            kwargs["mpu"] = GroupMpu()   # data-parallel groups of one: only the world can tell the ranks apart
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=configs[rank], **kwargs)
        for _ in range(steps):
            engine.backward(engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 8)).pow(2).mean())
            engine.step()

    return _outcome(run)


@pytest.mark.parametrize("key, values, shown", [
    ("train_micro_batch_size_per_gpu", (4, 8), "train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8"),
    ("zero_optimization.stage", (2, 3), "zero_optimization.stage: rank 0 = 2, rank 1 = 3"),
    ("optimizer.params.lr", (1e-3, 2e-3), "optimizer.params.lr: rank 0 = 0.001, rank 1 = 0.002"),
], ids=["micro_batch", "zero_stage", "lr"])
def test_different_configs_raise_on_every_rank(key, values, shown):
    configs = [_with(BASE, key, v) for v in values]
    results = run_distributed(2, initialize_job, configs, 2)
    for rank, r in enumerate(results):
        assert r["type"] == "ConfigMismatchError", (rank, r)
        assert r["message"].startswith("deepspeed.initialize: the ranks were started with different DeepSpeed "
                                       "configs"), r["message"]
        assert shown in r["message"], r["message"]
        assert r["differences"][key] == {0: values[0], 1: values[1]}
    assert results[0]["message"] == results[1]["message"]


SAME_WRITTEN_DIFFERENTLY = [
    # rank 0: batch sizes derived, "auto" for defaults, DeepSpeed's optimizer name in another case, ints
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto",
     "optimizer": {"params": {"lr": 1e-3, "weight_decay": 0}, "type": "adamw"},
     "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "steps_per_print": 1000,
     "tensorboard": {"output_path": "/node0/tb"}},
    # rank 1: the same values written out, keys in another order, floats, the legacy alias of the bucket
    {"zero_optimization": {"reduce_bucket_size": 5e8, "stage": 2}, "steps_per_print": 1000,
     "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0, "lr": 0.001}},
     "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
     "tensorboard": {"output_path": "/node1/tb"}},
]


def test_the_same_config_written_differently_agrees():
    results = run_distributed(2, initialize_job, SAME_WRITTEN_DIFFERENTLY, 2)
    assert [r["type"] for r in results] == ["ok", "ok"], results


def test_agreement_costs_one_small_all_reduce():
    """The matching case: one extra all-reduce (5 int64) and no object exchange at initialize."""
    from deepspeed.runtime.config.agreement import PER_RANK_KEYS

    assert "tensorboard.output_path" in PER_RANK_KEYS
    results = run_distributed(2, count_job)
    for r in results:
        assert r["agreement"] == {"all_reduce": (1, 5)}, r


def count_job() -> dict:
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.agreement import agree_config
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig(dict(BASE), world_size=2)
    ds_comm.comms_counter.reset()
    agree_config(config, "test")
    agree_config(config, "test again")   # agreed once over the world: not again (the engine after initialize)
    seen = {op: (int(s["count"]), int(s["numel"])) for op, s in ds_comm.comms_counter.summary().items()}
    deepspeed.initialize(model=_model(), config=dict(BASE))   # still builds
    return {"agreement": seen}


def test_config_invalid_on_one_rank_fails_every_rank():
    bad = _with(BASE, "zero_optimization.stage", 7)
    results = run_distributed(2, initialize_job, [BASE, bad])
    for r in results:
        assert r["type"] == "DeepSpeedConfigError", r
        assert r["message"].startswith("deepspeed.initialize: the config failed to load or validate: rank 1: "), r
        assert "zero_optimization.stage" in r["message"], r
    assert "this is rank 0, which succeeded but stops too" in results[0]["message"]


def test_engine_with_mpu_agrees_over_the_world():
    configs = [_with(BASE, "train_micro_batch_size_per_gpu", v) for v in (4, 8)]
    results = run_distributed(2, initialize_job, configs, 1, True)
    for r in results:
        assert r["type"] == "ConfigMismatchError", r
        assert "train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8" in r["message"]


def pipeline_job(stages: tuple, direct: bool) -> dict:
    """A 2-stage pipeline whose ranks ask for different ZeRO stages; `direct` builds the
    PipelineEngine itself (its own check of stage 3 comes after the agreement)."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.engine import PipelineEngine

    import pipe_jobs

    config = _with(BASE, "zero_optimization.stage", stages[ds_comm.get_rank()])

    def run():
        model = PipelineModule(pipe_jobs.specs(), num_stages=2, loss_fn=pipe_jobs.loss_fn)
        if direct:
            PipelineEngine(model=model, config=config, mpu=model.mpu(),
                           config_class=DeepSpeedConfig(config, mpu=model.mpu()),
                           model_parameters=list(model.parameters()))
        else:
            deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))

    return _outcome(run)


@pytest.mark.parametrize("direct", [False, True], ids=["initialize", "PipelineEngine"])
def test_pipeline_engine_agrees_before_its_own_checks(direct):
    results = run_distributed(2, pipeline_job, (1, 3), direct)
    what = "PipelineEngine" if direct else "deepspeed.initialize"
    for r in results:
        assert r["type"] == "ConfigMismatchError", r
        assert r["message"].startswith(what) and "zero_optimization.stage: rank 0 = 1, rank 1 = 3" in r["message"]


def zero_init_job(configs: list) -> dict:
    import deepspeed
    from deepspeed import comm as ds_comm

    def run():
        with deepspeed.zero.Init(config_dict_or_path=configs[ds_comm.get_rank()]):
            torch.nn.Linear(8, 8)

    return _outcome(run)


def test_zero_init_agrees_its_settings():
    fp32 = _with(BASE, "zero_optimization.stage", 3)
    bf16 = _with(fp32, "bf16.enabled", True)
    results = run_distributed(2, zero_init_job, [bf16, fp32])
    for r in results:
        assert r["type"] == "ConfigMismatchError", r
        assert r["message"].startswith("deepspeed.zero.Init") and \
            "dtype: rank 0 = \"torch.bfloat16\", rank 1 = \"None\"" in r["message"], r["message"]
    pinned = _with(bf16, "zero_optimization.offload_param", {"device": "cpu", "pin_memory": False})
    unpinned = _with(bf16, "zero_optimization.offload_param", {"device": "cpu", "pin_memory": True})
    assert [r["type"] for r in run_distributed(2, zero_init_job, [pinned, unpinned])] == ["ok", "ok"]


def checkpointing_job(partition: tuple) -> dict:
    import deepspeed
    from deepspeed import comm as ds_comm
    from test_activation_checkpointing_ranks import GroupMpu

    from deepspeed.runtime.activation_checkpointing import state

    config = {"activation_checkpointing": {"partition_activations": partition[ds_comm.get_rank()]}}
    owner = state.PROCESS
    saved = (owner.settings, owner.mpu, owner.configured, owner.buffer)
    try:
        return _outcome(lambda: deepspeed.checkpointing.configure(GroupMpu(), deepspeed_config=config))
    finally:   # the workers persist across tests: leave the process-wide settings as they were
        owner.settings, owner.mpu, owner.configured, owner.buffer = saved


def test_checkpointing_configure_agrees_over_the_model_parallel_group():
    results = run_distributed(2, checkpointing_job, (True, False))
    for r in results:
        assert r["type"] == "ConfigMismatchError", r
        assert r["message"].startswith("deepspeed.checkpointing.configure") and \
            "partition_activations: rank 0 = true, rank 1 = false" in r["message"], r["message"]
    assert [r["type"] for r in run_distributed(2, checkpointing_job, (True, True))] == ["ok", "ok"]


# --- through the launcher: a config file per rank ---------------------------------------------------
JOB = os.path.join(os.path.dirname(__file__), "launcher_jobs", "config_per_rank.py")


def test_launcher_reports_the_mismatch_and_every_rank_exits_non_zero(tmp_path):
    for rank, micro in enumerate((4, 8)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_with(BASE, "train_micro_batch_size_per_gpu", micro)))
    logs = tmp_path / "logs"
    from test_launcher import LAUNCHER, _env, _free_port

    start = time.monotonic()
    result = subprocess.run(LAUNCHER + ["--master_port", str(_free_port()), "--num_gpus", "2",
                                        "--enable_each_rank_log", str(logs), JOB, "--config", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=_env())
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout + result.stderr
    assert "train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8" in result.stderr, result.stderr
    assert "trained" not in result.stdout
    for rank in (0, 1):   # each rank raised the error itself (not only stopped by the launcher)
        log = (logs / f"rank{rank}.log").read_text()
        assert "ConfigMismatchError" in log and "rank 0 = 4, rank 1 = 8" in log, log
    assert elapsed < 60, elapsed   # seconds: no rank waits for the gloo timeout
