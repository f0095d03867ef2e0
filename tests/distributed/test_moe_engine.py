"""Expert parallelism in the engine: expert gradients over their expert-data-parallel groups, ZeRO 0-3
with experts, the global norm, the same update at every ep_size ([Note: expert gradients])."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from moe_jobs import (checkpoint_roundtrip, deepspeed_fixture_experts_by_static, load_deepspeed_fixture, merged,
                      reference, safe_get_experts, train, train_layer)

STEPS = 10


def _check(results: list[dict], ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    state = merged(results)
    assert set(state) == set(ref["state"])
    for name, value in ref["state"].items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_moe_matches_dense_reference(stage: int, world: int, ep: int) -> None:
    """10 SGD steps at ep>1 equal one process holding every expert on the whole global batch (so the
    update is the same at every ep_size: no #6545 skew)."""
    _check(run_distributed(world, train, ep, STEPS, {"stage": stage}), reference(world, STEPS))


def test_moe_ep_sizes_agree() -> None:
    """ep=1 (replicated experts), 2 and 4 on the same 4-rank global batch give the same parameters."""
    runs = {ep: merged(run_distributed(4, train, ep, STEPS, {"stage": 1})) for ep in (1, 2, 4)}
    for ep in (2, 4):
        for name, value in runs[1].items():
            torch.testing.assert_close(runs[ep][name], value, rtol=1e-5, atol=1e-6, msg=f"ep={ep} {name}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_moe_clipping_counts_each_expert_once(stage: int) -> None:
    """The global norm (and so the clipped update) equals the reference's over all parameters."""
    clip = 0.05
    results = run_distributed(4, train, 2, STEPS, {"stage": stage, "clip": clip})
    ref = reference(4, STEPS, clip=clip)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
    assert min(ref["norms"]) > clip   # clipping was active at every step
    _check(results, ref)


def test_moe_gradient_accumulation() -> None:
    _check(run_distributed(2, train, 2, 4, {"stage": 2, "micro_gas": 2}), reference(2, 4, micro_gas=2))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_moe_bf16(stage: int) -> None:
    """bf16 parameters (fp32 masters) track the fp32 reference within bf16's precision."""
    results = run_distributed(2, train, 2, 5, {"stage": stage, "bf16": True})
    _check(results, reference(2, 5), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("key,value", [("zero_quantized_gradients", True), ("zero_quantized_weights", True),
                                       ("zero_hpz_partition_size", 2)])
def test_moe_zero3_with_ep_refuses_zeropp(key: str, value: object) -> None:
    """ZeRO-3 partitions experts over their expert-data-parallel groups ([Note: ZeRO-3 expert units]);
    ZeRO++ (qgZ, qwZ, hpZ) is not combined with it yet."""
    with pytest.raises(Exception, match=rf"ep_size=2\) with ZeRO-3 and {key} \(ZeRO\+\+\)"):
        run_distributed(4, train, 2, 1, {"stage": 3, "zero_optimization": {"stage": 3, key: value}})


def test_moe_zero3_with_ep_refuses_muon() -> None:
    with pytest.raises(Exception, match=r"Muon optimizer with expert parallelism \(ep_size > 1\) at zero_optimization"):
        run_distributed(2, train, 2, 1, {"stage": 3, "opt": "Muon", "lr": 0.01})


def test_moe_zero3_with_ep_offload_and_accumulation() -> None:
    """ZeRO-3 at ep=2 on 4 ranks with parameters and optimizer offloaded to CPU and 2 micro-steps per step
    equals the one-process reference."""
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    _check(run_distributed(4, train, 2, 4, {"stage": 3, "micro_gas": 2, "zero_optimization": zero}),
           reference(4, 4, micro_gas=2))


def test_moe_zero3_with_ep_refuses_zero_init_experts() -> None:
    from moe_jobs import zero_init_error

    for message in run_distributed(2, zero_init_error, 2):
        assert "expert parameters created under deepspeed.zero.Init" in message, message


def test_moe_layer_zero3_with_ep_matches_zero2(tmp_path) -> None:
    """deepspeed.moe.layer.MoE at ep_size 2 and 4 on 4 ranks at ZeRO-3 (experts partitioned over their
    expert-data-parallel groups; upstream refuses this) trains as at ZeRO-2; its checkpoint reloads exactly."""
    for ep in (2, 4):
        runs = run_distributed(4, train_layer, ep, 4, {"stage": 3}, str(tmp_path / f"ep{ep}"))
        z3 = merged(runs)
        z2 = merged(run_distributed(4, train_layer, ep, 4, {"stage": 2}))
        assert set(z3) == set(z2)
        for name, value in z2.items():
            torch.testing.assert_close(z3[name], value, rtol=1e-5, atol=1e-6, msg=f"ep={ep} {name}")
        loaded = merged([{"state": r["loaded"]} for r in runs])
        assert set(loaded) == set(z3)
        for name, value in z3.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"ep={ep} loaded {name}")


def _merge(results: list[dict], key: str) -> dict:
    return merged([{"state": r[key]} for r in results])


@pytest.mark.parametrize("stage", [0, 2])
def test_moe_checkpoint_resume(stage: int, tmp_path) -> None:
    """Save at ep=2 (Adam state), load into a fresh engine, train on: equal to the uninterrupted run;
    the files are upstream's MoE layout."""
    import os

    cfg = {"stage": stage, "opt": "Adam", "lr": 0.01}
    results = run_distributed(4, checkpoint_roundtrip, 2, 2, cfg, str(tmp_path))
    names = sorted(os.listdir(tmp_path / "t"))
    assert "mp_rank_00_model_states.pt" in names
    assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)} <= set(names)
    if stage == 0:
        assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= set(names)
    else:
        assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)} <= set(names)
    expert = torch.load(tmp_path / "t" / "layer_1_expert_3_mp_rank_00_model_states.pt")
    assert sorted(expert) == ["moes.1.deepspeed_moe.experts.deepspeed_experts.3.bias",
                              "moes.1.deepspeed_moe.experts.deepspeed_experts.3.weight"]
    module = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not [k for k in module if "deepspeed_experts" in k]
    for key, ref in (("loaded", "saved"), ("resumed", "uninterrupted")):
        got, want = _merge(results, key), _merge(results, ref)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{key} {name}")
    assert all(r["client"]["note"] == 7 and r["global_steps"] == 3 for r in results)


@pytest.mark.parametrize("opt", [{"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                                 {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}],
                         ids=["sgd_momentum", "adamw"])
def test_moe_zero3_checkpoint_resume(opt: dict, tmp_path) -> None:
    """ZeRO-3 at ep=2 on 4 ranks (experts partitioned over their expert-data-parallel groups): the
    checkpoint is upstream's MoE layout, reloads exactly, training on equals the uninterrupted run
    (momentum / both moments restored: dropping one breaks it), and zero_to_fp32 gives the whole
    model under global expert names, equal to the live parameters at the save."""
    import os

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    results = run_distributed(4, checkpoint_roundtrip, 2, 2, {"stage": 3, "optimizer": opt}, str(tmp_path), 2, 3)
    names = set(os.listdir(tmp_path / "t"))
    assert {"mp_rank_00_model_states.pt"} | {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                                             for layer in (0, 1) for e in range(4)} <= names
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)} <= names
    saved = _merge(results, "saved")
    for key, ref, tol in (("loaded", "saved", 0), ("resumed", "uninterrupted", 1e-6)):
        got, want = _merge(results, key), _merge(results, ref)
        assert set(got) == set(want) == set(saved)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=f"{key} {name}")
    assert all(r["global_steps"] == 2 and r["path"].endswith("mp_rank_00_model_states.pt") for r in results)
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    assert set(state) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage,ep_load", [(1, 1), (1, 4), (3, 4), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_moe_checkpoint_resume_at_another_ep_size(stage: int, ep_load: int, tmp_path) -> None:
    """Saved at ep=2 (ZeRO-1 or ZeRO-3, Adam), resumed at ep=1 or 4: the same parameters, and training on
    equals the uninterrupted ep=2 run (the update does not depend on ep_size)."""
    results = run_distributed(4, checkpoint_roundtrip, 2, ep_load, {"stage": stage, "opt": "Adam", "lr": 0.01},
                              str(tmp_path))
    for key, ref, tol in (("loaded", "saved", 0), ("resumed", "uninterrupted", 1e-5)):
        got, want = _merge(results, key), _merge(results, ref)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=f"{key} {name}")


@pytest.mark.parametrize("stage", [2, 3])
def test_moe_zero_to_fp32(stage: int, tmp_path) -> None:
    """zero_to_fp32 on an MoE checkpoint (bf16): every expert under its global name, fp32, equal to the
    trained parameters."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    results = run_distributed(4, checkpoint_roundtrip, 2, 2, {"stage": stage, "bf16": True}, str(tmp_path), 2, 0)
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    saved = _merge(results, "saved")
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name].bfloat16().float(), value, rtol=0, atol=0, msg=name)


def test_moe_loads_deepspeed_0_19_8_checkpoint() -> None:
    """DeepSpeed 0.19.8's own stage-0 MoE checkpoint (its MoE layer, ep=2, Adam; fixture data) loads into
    the same model here: every parameter and Adam's exp_avg equal what DeepSpeed recorded."""
    import os

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_moe")
    for r in run_distributed(2, load_deepspeed_fixture, fixture):
        assert r["steps"] == 2
        got = {**r["state"], **r["exp_avg"]}
        assert set(got) == set(r["expected"])
        for name, value in r["expected"].items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("ep_size,world,stage", [(1, 2, 0), pytest.param(1, 2, 3, marks=pytest.mark.slow),
                                                 pytest.param(4, 4, 0, marks=pytest.mark.slow)])
def test_moe_loads_deepspeed_0_19_8_checkpoint_at_another_ep_size(ep_size: int, world: int, stage: int) -> None:
    """DeepSpeed 0.19.8's stage-0 MoE checkpoint saved at ep=2 loads at ep=1 (each rank all 4 experts) and
    ep=4 with a plain load_checkpoint: parameters, Adam's exp_avg (DeepSpeed's record) and exp_avg_sq (its
    files, by upstream's positions) are pure copies, the step count kept, and two more steps equal those
    after a load at ep=2; optimizer groups that do not match upstream's split are refused naming the group
    counts. Also into a ZeRO-3 engine (slow)."""
    import os

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_moe")
    same = merged([{"state": r["after"]} for r in run_distributed(world, load_deepspeed_fixture, fixture, 2)])
    refuse = stage == 0 and world == 2
    for r in run_distributed(world, load_deepspeed_fixture, fixture, ep_size, refuse_ungrouped=refuse, stage=stage):
        for name, value in r["after"].items():   # continues as the load at the saved ep_size does
            torch.testing.assert_close(value, same[name], rtol=1e-6, atol=1e-7, msg=name)
        assert r["steps"] == 2 and r["step"] == [2.0]
        assert len(r["state"]) == 6 + 2 * 2 * 4 // ep_size   # dense + (layers x experts held x weight, bias)
        got = {**r["state"], **r["exp_avg"], **r["exp_avg_sq"]}
        expected = {**r["expected"], **r["exp_avg_sq_expected"]}
        assert set(got) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
        assert r["group_names"] == ["p", f"ep_size_{ep_size}"]   # this engine's group names stay
        if refuse:
            assert "CheckpointError" in r["refused"] and "2 optimizer param groups" in r["refused"], r["refused"]


def test_load_moe_state_dict_static_reads_deepspeed_expert_files() -> None:
    """Upstream's static `DeepSpeedEngine.load_moe_state_dict` (Megatron-DeepSpeed calls it) fills a state
    dict with this rank's experts of DeepSpeed 0.19.8's ep=2 checkpoint, under local names, equal to
    DeepSpeed's values; `_get_expert_ckpt_name` names upstream's file."""
    import os

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_moe")
    for r in run_distributed(2, deepspeed_fixture_experts_by_static, fixture):
        assert r["local_names_ok"] and r["expected"] and set(r["loaded"]) == set(r["expected"])
        for name, value in r["expected"].items():
            torch.testing.assert_close(r["loaded"][name], value, rtol=0, atol=0, msg=name)
        assert r["path"].endswith(os.path.join("t", "layer_0_expert_3_mp_rank_00_model_states.pt"))


def test_moe_layer_same_update_at_every_ep_size(tmp_path) -> None:
    """deepspeed.moe.layer.MoE (top-2, capacity) on 4 ranks, ZeRO-2: ep=1, 2 and 4 train to the same
    parameters (no ep_size skew); a checkpoint of the ep=4 run reloads exactly."""
    runs = {ep: run_distributed(4, train_layer, ep, STEPS, {"stage": 2}, str(tmp_path) if ep == 4 else None)
            for ep in (1, 2, 4)}
    states = {ep: merged(r) for ep, r in runs.items()}
    assert any(not torch.equal(states[1]["moes.0.deepspeed_moe.experts.deepspeed_experts.0.weight"],
                               states[1][f"moes.0.deepspeed_moe.experts.deepspeed_experts.{e}.weight"])
               for e in range(1, 4))   # the experts were routed different tokens
    for ep in (2, 4):
        for name, value in states[1].items():
            torch.testing.assert_close(states[ep][name], value, rtol=1e-5, atol=1e-6, msg=f"ep={ep} {name}")
    loaded = merged([{"state": r["loaded"]} for r in runs[4]])
    for name, value in states[4].items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_moe_layer_zero3_at_ep_1() -> None:
    """ep_size=1 at ZeRO-3: experts are ordinary parameters there; the same training as ZeRO-1."""
    z3 = merged(run_distributed(2, train_layer, 1, 4, {"stage": 3}))
    z1 = merged(run_distributed(2, train_layer, 1, 4, {"stage": 1}))
    for name, value in z1.items():
        torch.testing.assert_close(z3[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_moe_safe_get_full_of_experts() -> None:
    """The safe_get_full_* helpers gather an expert's shards over its expert-data-parallel group: every
    replica of an expert sees the same full fp32 value (its parameter) and gradient at ZeRO 1, 2 and 3."""
    for stage in (1, 2, 3):
        results = run_distributed(4, safe_get_experts, stage)
        for r in results:
            for name, (param, fp32, grad, exp_avg) in r.items():
                torch.testing.assert_close(fp32, param, rtol=0, atol=0, msg=name)
                assert grad is not None and exp_avg is not None and grad.shape == param.shape
        for name in results[0]:
            holders = [r for r in results if name in r]
            for r in holders[1:]:
                torch.testing.assert_close(r[name][2], holders[0][name][2], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_moe_layers_of_different_ep_sizes(stage: int) -> None:
    """One model with an ep=2 and an ep=4 MoE layer (two sets of expert groups and buckets) on 4 ranks,
    clipping on: the same parameters as with both layers at ep=1."""
    cfg = {"stage": stage, "clip": 0.05}
    mixed = merged(run_distributed(4, train_layer, (2, 4), 4, cfg))
    plain = merged(run_distributed(4, train_layer, 1, 4, cfg))
    for name, value in plain.items():
        torch.testing.assert_close(mixed[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("ep_load", [4, pytest.param(1, marks=pytest.mark.slow)])
def test_moe_universal_checkpoint_at_another_ep_size(ep_load: int, tmp_path) -> None:
    """deepspeed.moe at ep=2 (ZeRO-1, Adam) -> ds_to_universal (each global expert whole under its global
    name) -> load_universal at ep=1 or 4 (experts re-homed): the loaded parameters are the saved ones, and
    the continued training equals the same run resumed by a plain load_checkpoint at that ep_size (1e-6),
    which equals the uninterrupted run (test_moe_checkpoint_resume_at_another_ep_size)."""
    cfg = {"stage": 1, "opt": "Adam", "lr": 0.01}
    got = run_distributed(4, checkpoint_roundtrip, 2, ep_load, cfg, str(tmp_path / "u"), universal=True)
    want = run_distributed(4, checkpoint_roundtrip, 2, ep_load, cfg, str(tmp_path / "p"))
    assert (tmp_path / "u" / "t_universal" / "zero" / "moes.0.deepspeed_moe.experts.deepspeed_experts.3.weight" /
            "exp_avg_sq.pt").is_file()
    for key, ref, results, tol in (("loaded", "saved", got, 0), ("resumed", "resumed", want, 1e-6)):
        have, expected = _merge(got, key), _merge(results, ref)
        assert set(have) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(have[name], value, rtol=tol, atol=tol * 0.1, msg=f"{key} {name}")


def test_moe_checkpoint_missing_piece_is_named_on_every_rank(tmp_path):
    """The MoE reader reads pieces lazily, but still checks at open that they cover what this rank reads:
    a piece removed from one rank's optimizer file fails every rank's load, naming the parameter."""
    from moe_jobs import missing_piece_error

    for name, message in run_distributed(2, missing_piece_error, str(tmp_path / "ckpt")):
        assert f"{name!r} is incomplete in the checkpoint's optimizer files" in message, message
