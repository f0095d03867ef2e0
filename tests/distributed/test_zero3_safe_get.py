"""deepspeed.utils.safe_* accessors at ZeRO stage 3: the same values as at stages 0 and 2 for the
same training, full shapes from the units, sets visible in the model, local parts that
concatenate to the full tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from harness import run_distributed
from models_zero import TiedNet, global_batches, micro_slice
from test_engine_dp import _config
from test_tensor_fragment import assert_local_parts, local_parts, new_param, visible_weights

STEPS, SET_STEP = 3, 1


class UnitsNet(nn.Module):
    """Units of sizes that divide by neither 2 nor 4, and an empty unit used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(15, 7)       # 105 + 7: straddles ranks
        self.norm = nn.LayerNorm(7)       # 7 + 7
        self.fc2 = nn.Linear(7, 5)        # 35 + 5
        self.empty = nn.Linear(3, 0)      # 0 + 0
        self.head = nn.Linear(5, 4)       # 20 + 4

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(self.norm(torch.relu(self.fc1(x[:, :15])))))
        return F.cross_entropy(self.head(h), y) + self.empty(h[:, :3]).sum()


def build(model: str, frozen: tuple[str, ...] = ()) -> nn.Module:
    torch.manual_seed(0)
    net = {"units": UnitsNet, "tied": TiedNet}[model]()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    return net


def accessor_run(model: str, frozen: tuple[str, ...], config: dict) -> dict:
    """Trains through the engine, reading and writing everything through the safe_* API."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_full_optimizer_state)

    rank, world = dist.get_rank(), dist.get_world_size()
    net = build(model, frozen=frozen)
    shapes = {n: p.shape for n, p in net.named_parameters()}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=copy.deepcopy(config))
    dtype = next(engine.module.parameters()).dtype
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    named = list(engine.module.named_parameters())
    out: dict = {"grads": [], "masters": [], "exp_avg": [], "exp_avg_sq": [], "shapes": shapes}
    for step, (x, y) in enumerate(global_batches(STEPS, micro * gas * world)):
        for k in range(gas):
            engine.backward(engine(micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world)))
            if engine.is_gradient_accumulation_boundary():  # after backward, before the step
                out["grads"].append({n: _copy(safe_get_full_grad(p)) for n, p in named})
            engine.step()
        if step == SET_STEP:
            for salt, (n, p) in enumerate(named):
                if p.requires_grad:
                    safe_set_full_fp32_param(p, new_param(shapes[n], salt))
                    if shapes[n].numel():  # stage 0: no Adam state for an empty parameter never used
                        safe_set_full_optimizer_state(p, 0.5 * safe_get_full_optimizer_state(p, "exp_avg"), "exp_avg")
            out["visible"] = visible_weights(engine)
        out["masters"].append({n: safe_get_full_fp32_param(p) for n, p in named})
        for key in ("exp_avg", "exp_avg_sq"):
            out[key].append({n: safe_get_full_optimizer_state(p, key) if p.requires_grad and shapes[n].numel()
                             else None for n, p in named})
    out["weights"] = visible_weights(engine)
    out["frozen_local"] = [safe_get_local_fp32_param(p) for n, p in named if not p.requires_grad]
    return out


def _copy(value: torch.Tensor | None) -> torch.Tensor | None:
    """At stage 0 safe_get_full_grad returns param.grad itself, which the next step clears."""
    return value.detach().clone() if value is not None else None


def stages_run(model: str, frozen: tuple[str, ...], configs: dict) -> dict:
    return {stage: accessor_run(model, frozen, config) for stage, config in configs.items()}


# world, gas, precision, persistence threshold of stage 3, model, frozen parameters
CASES = [(1, 1, "fp32", 0, "units", ("fc1.bias",)), (2, 2, "fp32", 0, "units", ("fc1.bias", "norm.weight", "norm.bias")),
         (2, 1, "bf16", 10_000, "tied", ()), (4, 1, "fp32", 60, "units", ("fc2.weight",))]


@pytest.mark.parametrize("world,gas,precision,threshold,model,frozen", CASES,
                         ids=[f"w{c[0]}-gas{c[1]}-{c[2]}-persist{c[3]}-{c[4]}" for c in CASES])
def test_stage3_accessors_match_stages_0_and_2(world, gas, precision, threshold, model, frozen) -> None:
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    configs = {stage: _config(micro=1, gas=gas, zero_optimization=zero, **extra) for stage, zero in
               ((0, {"stage": 0}), (2, {"stage": 2, "reduce_bucket_size": 50}),
                (3, {"stage": 3, "stage3_param_persistence_threshold": threshold}))}
    results = run_distributed(world, stages_run, model, frozen, configs)
    # Gradients bit for bit where the sums match: each rank's gradient comes from the same
    # autograd kernels on tensors of the same shapes and strides, and the average of 2 ranks is
    # one (commutative) addition and exact scalings, whatever the buffer layout. 4 ranks make
    # gloo's all-reduce and reduce-scatter add in different orders, and stage 0 sums the
    # micro-steps before averaging over ranks. From the same gradients, torch's fused Adam treats
    # an element by its position in the tensor (vector body or scalar tail), and the masters sit at
    # other offsets in other layouts: ulps.
    exact = {2: world <= 2, 0: world <= 2 and gas == 1}
    ulps = {"rtol": 1e-5, "atol": 1e-10}
    tol = {"rtol": 1e-5, "atol": 1e-6} if precision == "fp32" else {"rtol": 2e-2, "atol": 1e-2}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def same(actual, expected, stage: int, kind: str, what: str) -> None:
        what = f"{what} vs stage {stage}"
        if expected is None:
            assert actual is None, what
            return
        assert actual is not None and actual.dtype == torch.float32 and actual.shape == expected.shape, what
        if exact[stage] and kind == "grads":
            assert torch.equal(actual, expected), what
        elif exact[stage]:
            torch.testing.assert_close(actual, expected, **ulps, msg=what)
        else:
            torch.testing.assert_close(actual, expected, **tol, msg=what)

    for rank, by_stage in enumerate(results):
        z3, z0, z2 = by_stage[3], by_stage[0], by_stage[2]
        trained = [n for n in z3["shapes"] if n not in frozen]
        assert len(z3["grads"]) == STEPS
        for step in range(STEPS):
            for name, shape in z3["shapes"].items():
                for kind in ("grads", "masters", "exp_avg", "exp_avg_sq"):
                    value = z3[kind][step][name]
                    if name in frozen:  # frozen parameters have no state here, as at stages 0-2
                        assert value is None and z2[kind][step][name] is None, (kind, name)
                        continue
                    if value is None and not shape.numel() and kind.startswith("exp_avg"):
                        continue  # not read for empty parameters (stage 0 has no state for them)
                    assert value.shape == shape, (kind, name)  # from the unit, not the released param
                    what = f"rank {rank} step {step} {kind} {name}"
                    same(value, z2[kind][step][name], 2, kind, what)
                    reference = z0[kind][step][name]
                    if reference is None and not shape.numel():  # stage 0: no .grad for an unused empty param
                        continue
                    if kind != "grads" or precision == "fp32":  # stage 0 bf16 keeps bf16 param.grad
                        same(value, reference.float() if kind == "grads" else reference, 0, kind, what)
        for salt, name in enumerate(z3["shapes"]):
            if name in trained:  # the set is visible at once and became the master
                assert torch.equal(z3["visible"][name], new_param(z3["shapes"][name], salt).to(dtype)), name
                assert torch.equal(z3["masters"][SET_STEP][name], new_param(z3["shapes"][name], salt)), name
                assert torch.equal(z3["weights"][name], z3["masters"][-1][name].to(dtype)), name
            else:
                assert torch.equal(z3["weights"][name], z0["weights"][name]), name  # frozen: unchanged
        assert any(z3["grads"][0][n].abs().sum() > 0 for n in trained)
        # the local API gives None for frozen parameters at stages 2 and 3, as the full one (and upstream)
        assert z3["frozen_local"] == [None] * len(frozen) and z2["frozen_local"] == [None] * len(frozen)


# --- local parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0, 10_000], ids=["sharded", "persistent"])
def test_stage3_local_parts_concatenate_to_full(threshold: int) -> None:
    # TinyMLP at 2 ranks: fc1's unit (544 elements) splits fc1.weight between the ranks
    assert_local_parts(*run_distributed(2, local_parts, 3, {"stage3_param_persistence_threshold": threshold}))
