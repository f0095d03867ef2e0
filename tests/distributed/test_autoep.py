"""AutoEP (`expert_parallel`): tiny Mixtral and Qwen3-MoE, experts sharded over EP ranks, against the
same model unsharded (autoep_jobs.py): forward, HF aux loss, gradients, training, saved weights."""

from __future__ import annotations

import pytest
import torch

from autoep_jobs import block_run, train_run
from harness import run_distributed


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_autoep_block_matches_hf(kind: str, world: int, ep: int) -> None:
    _check_block(run_distributed(world, block_run, kind, ep), ep, blocks=2, aux=True)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_autoep_deepseek_block_matches_hf(kind: str) -> None:
    """DeepSeek: a dense first layer (left alone), a MoE layer with shared experts (kept dense), group-limited
    routing (V3) — all the HF block's own."""
    _check_block(run_distributed(2, block_run, kind, 2), 2, blocks=1, aux=False)


def _check_block(results: list, ep: int, blocks: int, aux: bool) -> None:
    for r in results:
        assert r["local_experts"] == [4 // ep] * blocks
        assert all(shape[0] == 4 // ep for n, shape in r["shapes"].items() if "shared" not in n), r["shapes"]
        assert r["logits"] <= 1e-5
        if aux:
            assert r["aux"] <= 1e-6 and r["aux_value"] > 0
        assert r["grad_err"] <= 1e-5 * max(1.0, r["grad_scale"]), r["grad_err"]
        assert r["full_equal"]   # state_dict(): the original HF layout, whole experts


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-6)
    assert sorted(a["state"]) == sorted(b["state"])
    for name, value in b["state"].items():
        torch.testing.assert_close(a["state"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_autoep_training_matches_no_ep(kind: str, tmp_path) -> None:
    """10 SGD steps (ZeRO-1, clipping) at ep=2 on 2 ranks equal the same model without the section;
    save_16bit_model writes the HF layout, loadable into a plain HF model."""
    base = run_distributed(2, train_run, kind, 0, 10)
    ep = run_distributed(2, train_run, kind, 2, 10, 1, str(tmp_path))
    for a, b in zip(ep, base):
        _same(a, b)
    assert ep[0]["loaded_equal"]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_autoep_hf_trainer(kind: str, tmp_path) -> None:
    """The HF Trainer unchanged, `expert_parallel: {enabled, autoep_size: 2}` in its DeepSpeed config (ZeRO-2,
    AdamW, clipping), 2 ranks: the same losses and saved weights (HF layout) as without the section."""
    from autoep_jobs import trainer_run

    base = run_distributed(2, trainer_run, kind, str(tmp_path / "base"), 0)
    ep = run_distributed(2, trainer_run, kind, str(tmp_path / "ep"), 2)
    assert [r["swapped"] for r in ep] == [2, 2] and [r["swapped"] for r in base] == [0, 0]
    assert ep[0]["losses"] == pytest.approx(base[0]["losses"], rel=1e-5)
    assert sorted(ep[0]["saved"]) == sorted(base[0]["saved"])
    for name, value in base[0]["saved"].items():
        torch.testing.assert_close(ep[0]["saved"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for name, value in ep[0]["trained"].items():   # from_pretrained gives back the trained (HF-layout) weights
        assert tuple(value.shape) == tuple(base[0]["trained"][name].shape)
        torch.testing.assert_close(ep[0]["loaded"][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tokens", [[5, 3], [4, 0]])
def test_autoep_rank_with_no_local_tokens(tokens: list) -> None:
    """Every token routed to EP rank 0's experts (and, second case, rank 1 with no token at all): EP rank 1
    computes nothing yet joins every all-to-all; outputs and gradients equal HF's experts module."""
    from autoep_jobs import empty_run

    for r, n in zip(run_distributed(2, empty_run, "mixtral", tokens), tokens):
        assert r["rows"] == n and r["out"] <= 1e-6 and r["grad_err"] <= 1e-5
        assert r["has_grad"] and r["input_grad"]   # zero gradients, not missing ones


@pytest.mark.parametrize("kind", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_autoep_training_ep2_dp2_matches_no_ep(kind: str) -> None:
    """World 4, ep=2 x expert-data-parallel 2, ZeRO-2: 10 steps equal the same model without EP."""
    base = run_distributed(4, train_run, kind, 0, 10, 2)
    ep = run_distributed(4, train_run, kind, 2, 10, 2)
    for a, b in zip(ep, base):
        _same(a, b)


@pytest.mark.parametrize("kind,world", [("mixtral", 2), ("mixtral", 4), ("qwen3_moe", 2)])
def test_autoep_zero3_matches_no_ep_and_zero2(kind: str, world: int) -> None:
    """ZeRO-3 at ep=2 (world 2: EDP groups of one rank; world 4: ep=2 x EDP 2), SGD with clipping: 6 steps'
    losses and whole weights equal ZeRO-3 without EP and ZeRO-2 at ep=2. Expert pieces are 1/EDP of each
    local expert tensor, dense pieces 1/world; the consolidated 16-bit state dict (save_16bit_model) holds
    the whole HF tensors."""
    base = run_distributed(world, train_run, kind, 0, 6, 3)
    ep = run_distributed(world, train_run, kind, 2, 6, 3)
    zero2 = run_distributed(world, train_run, kind, 2, 6, 2)
    for a, b, c in zip(ep, base, zero2):
        _same(a, b)
        _same(a, c)
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5) and max(a["norms"]) > 1.0   # clipping acts
    edp = world // 2
    for r in ep:
        for name, (numel, piece) in r["pieces"].items():
            parts = edp if ".experts." in name else world
            assert piece == -(-numel // parts), (name, numel, piece)
    sd16 = ep[0]["sd16"]   # rank 0: the consolidated 16-bit state dict (save_16bit_model's), whole HF tensors
    assert sorted(sd16) == sorted(ep[0]["state"]) and all(r["sd16"] is None for r in ep[1:])
    for name, value in ep[0]["state"].items():
        torch.testing.assert_close(sd16[name], value, rtol=0, atol=0, msg=name)
    assert any(".experts." in n for n in ep[0]["pieces"])


def test_autoep_zero3_on_a_zero_init_model_matches_no_ep() -> None:
    """A model built under zero.Init (upstream's test_zero3_ep_source_zero_init_* path): its MoE blocks are
    made whole for the swap, the rest stays partitioned; 4 steps at ZeRO-3 ep=2 equal the same zero.Init-built
    model without EP (losses, clipped norms, whole weights); the experts end partitioned over their EDP
    group (one rank each here), the dense parameters over the world."""
    base = run_distributed(2, train_run, "mixtral", 0, 4, 3, "", True)
    ep = run_distributed(2, train_run, "mixtral", 2, 4, 3, "", True)
    for a, b in zip(ep, base):
        _same(a, b)
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5)
        for name, (numel, piece) in a["pieces"].items():
            assert piece == (numel if ".experts." in name else -(-numel // 2)), (name, numel, piece)


@pytest.mark.parametrize("world,stage,save_ep,load_ep", [(2, 1, 2, 2), (2, 0, 2, 2), (2, 2, 2, 1), (4, 3, 2, 2),
                                                         pytest.param(4, 3, 2, 1, marks=pytest.mark.slow),
                                                         pytest.param(4, 3, 2, 4, marks=pytest.mark.slow)])
def test_autoep_engine_checkpoint_resumes(tmp_path, world: int, stage: int, save_ep: int, load_ep: int) -> None:
    """save_checkpoint / load_checkpoint under AutoEP (ZeRO 0-2: experts one file each, optimizer pieces under
    the HF names; ZeRO-3, experts partitioned over their expert-data-parallel groups (ep=2 x EDP 2): upstream's
    partition-native layout): the resumed run trains like the uninterrupted one, also at another autoep_size;
    at the same layout the masters, Adam moments and step are restored bit for bit."""
    from autoep_jobs import checkpoint_run

    results = run_distributed(world, checkpoint_run, "mixtral", str(tmp_path), stage, save_ep, load_ep)
    consolidated = results[0]["consolidated"]
    layers = consolidated.pop("ds_autoep_layers")
    assert [{k: e[k] for k in ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts",
                               "ep_size")} for e in layers] == [   # DeepSpeed's description of the AutoEP layers
        {"moe_layer_id": i, "module_path": f"model.layers.{i}.mlp", "expert_key_prefix": f"model.layers.{i}.mlp.experts",
         "num_experts": 4,
         "num_local_experts": 4 // save_ep, "ep_size": save_ep} for i in range(2)]
    shapes = consolidated.pop("param_shapes")
    if stage == 3:   # upstream's partition-native layout: experts inside the ZeRO-3 files, in their own sub-group
        assert not [f for f in results[0]["files"] if f.startswith("layer_")], results[0]["files"]
        assert all(e["checkpoint_format"] == "zero3_partitioned" and e["checkpoint_format_version"] == 1
                   for e in layers)
        assert list(shapes[1]) == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj",
                                                                                                    "down_proj")]
    for r in results:   # the same layout: masters, Adam moments and step restored bit for bit
        if r["state_loaded"] is not None:
            assert r["state_loaded"]["step"] == r["state_at_save"]["step"]
            assert r["state_loaded"]["fields"] == r["state_at_save"]["fields"] == ["exp_avg", "exp_avg_sq"]
            assert r["state_loaded"]["pieces"].keys() == r["state_at_save"]["pieces"].keys()
            for key, values in r["state_at_save"]["pieces"].items():
                for want, got in zip(values, r["state_loaded"]["pieces"][key]):
                    assert torch.equal(got, want), key
    assert sorted(consolidated) == sorted(results[0]["at_save"])
    for name, value in results[0]["at_save"].items():   # zero_to_fp32: the whole HF tensors
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    for r in results:
        assert r["resumed"] == pytest.approx(r["straight"], rel=1e-5, abs=1e-6)
        for name, value in r["whole"].items():
            torch.testing.assert_close(r["whole_resumed"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def _router_aliases_checked(whole: dict) -> dict:
    """`whole` (a whole-block AutoEP model's state_dict()) without its router aliases, each checked present and
    equal to the router's entry, as upstream's state dict holds them ([Note: AutoEP router alias])."""
    aliases = [k for k in whole if ".mlp.gate.gate." in k]
    assert aliases, sorted(whole)
    for key in aliases:
        assert torch.equal(whole[key], whole[key.replace(".mlp.gate.", ".mlp.router.")]), key
    return {k: v for k, v in whole.items() if k not in aliases}


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_deepspeed_autoep_zero3_checkpoint_converts_and_loads_strictly(tmp_path, ep: int) -> None:
    """The same checkpoint through our ds_to_universal, loaded with load_universal and load_module_strict (the
    default) at ep 1 / 2: its module state's `mlp.gate.gate.weight` router aliases are accepted (equal to the
    router), and the whole weights are DeepSpeed's."""
    import os

    from autoep_jobs import deepspeed_autoep_zero3_universal_run

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_autoep_zero3")
    expected = torch.load(os.path.join(fixture, "expected.pt"), weights_only=False)["whole"]
    for whole in run_distributed(2, deepspeed_autoep_zero3_universal_run, fixture, str(tmp_path), ep):
        whole = _router_aliases_checked(whole)
        assert sorted(whole) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(whole[name], value), name


def test_deepspeed_autoep_zero3_checkpoint_loads() -> None:
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 checkpoint (its partition-native layout, 2 ranks, ep 2, Adam): loaded
    here with load_module_strict (the default: its module state's router aliases are accepted), each rank's optimizer state as this build would save it equals DeepSpeed's file bit for bit (fp32
    partitions, both moments, step, partition groups), the whole weights equal DeepSpeed's, training goes on."""
    import os

    from autoep_jobs import deepspeed_autoep_zero3_run

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_autoep_zero3")
    expected = torch.load(os.path.join(fixture, "expected.pt"), weights_only=False)["whole"]
    for r in run_distributed(2, deepspeed_autoep_zero3_run, fixture):
        assert r["steps"] == 3 and r["mine"]["partition_count"] == r["theirs"]["partition_count"] == 2
        assert r["mine"]["ds_zero_partition_groups"] == r["theirs"]["ds_zero_partition_groups"]
        for got, want in zip(r["mine"]["fp32_flat_groups"], r["theirs"]["fp32_flat_groups"], strict=True):
            assert torch.equal(got, want.float())
        mine, theirs = r["state"]
        assert sorted(mine) == sorted(theirs)
        for g, fields in theirs.items():
            assert sorted(mine[g]) == sorted(fields)
            for field, value in fields.items():
                assert torch.equal(mine[g][field].float(), value.float()), (g, field)
        whole = _router_aliases_checked(r["whole"])
        assert sorted(whole) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(whole[name], value), name


def test_autoep_zero3_frozen_experts_refused_at_save(tmp_path) -> None:
    """Frozen expert tensors have no place in upstream's AutoEP ZeRO-3 files (their pieces would live only in the
    optimizer files): save_checkpoint refuses on every rank, naming the parameter, and publishes nothing."""
    import os

    from autoep_jobs import frozen_expert_save_run

    for message in run_distributed(2, frozen_expert_save_run, str(tmp_path)):
        assert "model.layers.0.mlp.experts.gate_up_proj" in message and "frozen" in message, message
    assert not os.path.isdir(tmp_path / "t")


def test_autoep_checkpoint_with_another_expert_count_is_refused_naming_both(tmp_path) -> None:
    """A ZeRO-3 AutoEP checkpoint of 4 experts loaded into the model with 8: a ValueError on every rank
    naming both counts in upstream's words (before: a shape error naming only the router)."""
    from autoep_jobs import expert_count_mismatch_run

    for message in run_distributed(2, expert_count_mismatch_run, str(tmp_path), 3):
        assert message.startswith("ExpertCountError") and "saved with 4 experts" in message, message
        assert "target_local_experts=4, checkpoint_local_experts=2" in message, message


def test_autoep_hf_trainer_checkpoint_resume(tmp_path) -> None:
    """The Trainer saves a checkpoint at step 2 (engine.save_checkpoint under AutoEP) and a second Trainer
    resumes from it: steps 3-4 and the saved weights equal the uninterrupted run's."""
    from autoep_jobs import trainer_run

    straight = run_distributed(2, trainer_run, "mixtral", str(tmp_path / "a"), 2, 4, 2)
    resumed = run_distributed(2, trainer_run, "mixtral", str(tmp_path / "b"), 2, 4, 0,
                              str(tmp_path / "a" / "checkpoint-2"))
    # the resumed Trainer's log history holds steps 1-2 from the checkpoint, then its own steps 3-4
    assert len(resumed[0]["losses"]) == 4
    assert resumed[0]["losses"] == pytest.approx(straight[0]["losses"], rel=1e-5)
    for name, value in straight[0]["saved"].items():
        torch.testing.assert_close(resumed[0]["saved"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("section,stage,says", [
    ({"autoep_size": 4}, 1, "expert_parallel.autoep_size=4 must divide the world size 2"),
    ({"autoep_size": 2, "zero": {"zero_quantized_gradients": True}}, 3, "with ZeRO-3 and zero_quantized_gradients"),
    ({"autoep_size": 2, "preset_model": "qwen3_moe"}, 1, "preset_model='qwen3_moe' is for model_type"),
])
def test_autoep_bad_setup_raises_on_every_rank(section: dict, stage: int, says: str) -> None:
    from autoep_jobs import error_run

    for message in run_distributed(2, error_run, "mixtral", section, stage):
        assert says in message, message


def test_autoep_bf16() -> None:
    from autoep_jobs import bf16_run

    for r in run_distributed(2, bf16_run, "mixtral"):
        assert r["logits"] <= 2e-2 * max(1.0, r["scale"]), r
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-2)
        assert r["dtypes"] == ["torch.bfloat16"] and r["grads"] == 4


def test_autoep_replaces_blocks_that_compute_their_experts() -> None:
    """A block that indexes its fused experts itself (remote code, upstream's mock) is replaced whole
    (AutoEPMoELayer, the preset's routing): 5 SGD steps at ep=2 equal the model run as written."""
    from autoep_jobs import self_computing_run

    base = run_distributed(2, self_computing_run, 0, 5)
    ep = run_distributed(2, self_computing_run, 2, 5)
    assert [r["local_experts"] for r in ep] == [[2, 2], [2, 2]]
    assert ep[0]["losses"] == pytest.approx(base[0]["losses"], rel=1e-5, abs=1e-6)
    for name, value in ep[0]["state"].items():   # whole experts (AutoEP's w1/w2/w3) vs the block's fused tensors
        if ".experts.w" not in name:   # the router, also under upstream's alias `mlp.gate.gate.*`
            source = name.replace(".router.gate.", ".gate.").replace(".gate.gate.", ".gate.")
            torch.testing.assert_close(value, base[0]["state"][source], rtol=1e-5, atol=1e-5)
    for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
        gate_up, down = base[0]["state"][f"{layer}.experts.gate_up_proj"], base[0]["state"][f"{layer}.experts.down_proj"]
        torch.testing.assert_close(torch.cat([ep[0]["state"][f"{layer}.experts.w1"], ep[0]["state"][f"{layer}.experts.w3"]],
                                             dim=1), gate_up, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ep[0]["state"][f"{layer}.experts.w2"], down, rtol=1e-5, atol=1e-5)


def _universal_resume(tmp_path, save_ep: int, load_ep: int, drop: str | None = None,
                      stage: int = 1) -> tuple[list, list]:
    """AutoEP (Adam, ZeRO-`stage`) saved at autoep_size `save_ep`, converted by ds_to_universal (whole fused expert
    tensors with upstream's expert markers), loaded with load_universal at `load_ep` (experts re-homed):
    (each rank's continued losses and whole weights, those of the same run resumed by a plain load_checkpoint
    at `load_ep`). The reference is the plain load's continuation because the first steps ran at another
    ep_size (another reduction order: the uninterrupted run at `load_ep` differs from both by ~1e-6 of each
    weight's norm after Adam); the plain load equals the uninterrupted run (test_autoep_engine_checkpoint_resumes)."""
    from autoep_jobs import checkpoint_run

    want = run_distributed(2, checkpoint_run, "mixtral", str(tmp_path / "want"), stage, save_ep, load_ep)
    got = run_distributed(2, checkpoint_run, "mixtral", str(tmp_path / "got"), stage, save_ep, load_ep,
                          universal=True, drop=drop)
    return got, want


def _assert_same_training(got, want) -> None:
    for g, w in zip(got, want):
        assert g["resumed"] == pytest.approx(w["resumed"], rel=1e-6, abs=1e-7)
        for name, value in w["whole_resumed"].items():
            torch.testing.assert_close(g["whole_resumed"][name], value, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("save_ep,load_ep,stage", [(2, 1, 1), (2, 1, 3), pytest.param(1, 2, 1, marks=pytest.mark.slow)])
def test_autoep_universal_moves_experts(tmp_path, save_ep: int, load_ep: int, stage: int) -> None:
    """(At ZeRO-3 the tag is upstream's AutoEP ZeRO-3 layout: ds_to_universal joins the ranks' partitions.)"""
    import os

    got, want = _universal_resume(tmp_path, save_ep, load_ep, stage=stage)
    _assert_same_training(got, want)
    record = torch.load(os.path.join(tmp_path, "got", "t_universal", "zero", "model.layers.0.mlp.experts.gate_up_proj",
                                     "exp_avg.pt"), weights_only=False)
    assert record["is_expert_param"] is True and record["ep_num_experts"] == 4 and record["cat_dim"] == 0
    assert record["param"].shape[0] == 4
    # DeepSpeed 0.19.8's load_universal pairs these groups with its split ones by position and asserts ds_version
    common = torch.load(os.path.join(tmp_path, "got", "t_universal", "zero", "optimizer_state.pt"), weights_only=False)
    assert [(g.get("name"), g.get("moe", False)) for g in common["param_groups"]] == \
        [("dense-params", False), (f"ep_size_{save_ep}", True)] and common["ds_version"]


def test_autoep_universal_sees_a_dropped_moment(tmp_path) -> None:
    got, want = _universal_resume(tmp_path, 2, 1, drop="exp_avg_sq")
    with pytest.raises(AssertionError):
        _assert_same_training(got, want)
