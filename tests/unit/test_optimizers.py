"""Optimizers in deepspeed.ops against straightforward per-element references of their math.

Each reference below is the textbook/upstream-kernel formula written with plain tensor
ops in float64, one tensor at a time, so a mistake in the multi-tensor code shows up as a
mismatch. Where torch has the same algorithm we also compare with torch.optim directly.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.runtime.optimizers import build_optimizer

SHAPES = [(3,), (4, 5), (2, 3, 4)]
STEPS = 4


# ----------------------------------------------------------------------------- references
def ref_adam(p, g, st, lr, b1, b2, eps, wd, adamw, bias_correction):
    st["t"] = st.get("t", 0) + 1
    m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
    if not adamw:
        g = g + wd * p
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    bc1 = 1 - b1 ** st["t"] if bias_correction else 1.0
    bc2 = 1 - b2 ** st["t"] if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adamw:
        update = update + wd * p
    return p - lr * update


def ref_lion(p, g, st, lr, b1, b2, wd):
    m = st.setdefault("m", torch.zeros_like(p))
    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * torch.sign(c)
    st["m"] = b2 * m + (1 - b2) * g
    return p


def ref_lamb(p, g, st, lr, b1, b2, eps, wd, bias_correction, eps_inside_sqrt, min_coeff, max_coeff, scale=1.0):
    st["t"] = st.get("t", 0) + 1
    m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
    g = g / scale
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
    update = m / denom + wd * p
    w_norm, u_norm = p.norm().item(), update.norm().item()
    coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm and u_norm else 1.0
    step = lr * math.sqrt(1 - b2 ** st["t"]) / (1 - b1 ** st["t"]) if bias_correction else lr
    st.setdefault("coeffs", []).append(coeff)
    return p - step * coeff * update


def ref_adagrad(p, g, st, lr, eps, wd):
    s = st.setdefault("s", torch.zeros_like(p))
    g = g + wd * p
    s.add_(g * g)
    return p - lr * g / (s.sqrt() + eps)


# ----------------------------------------------------------------------------- harness
def make_params(seed=0, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype)) for s in SHAPES]


def grads_for(step, params):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]


def run_against_reference(make_optimizer, reference, group_lrs=(1e-2, 3e-3), steps=STEPS, scale=1.0, **hp):
    """Step the optimizer with two param groups (different lr) and the reference side by side."""
    params = make_params(scale=scale)
    refs = [p.detach().double().clone() for p in params]
    groups = [{"params": params[:1], "lr": group_lrs[0]}, {"params": params[1:], "lr": group_lrs[1]}]
    optimizer = make_optimizer(groups)
    states = [{} for _ in params]
    for step in range(steps):
        grads = grads_for(step, params)
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        optimizer.step()
        for i, g in enumerate(grads):
            lr = group_lrs[0] if i == 0 else group_lrs[1]
            refs[i] = reference(refs[i], g, states[i], lr=lr, **hp)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    return optimizer, states


# ----------------------------------------------------------------------------- Adam
ADAM_CASES = [(w, bc, wd) for w in (True, False) for bc in (True, False) for wd in (0.0, 0.1)]


@pytest.mark.parametrize("adamw,bias_correction,wd", ADAM_CASES)
def test_fused_adam_matches_formula(adamw, bias_correction, wd):
    hp = dict(b1=0.9, b2=0.99, eps=1e-8, wd=wd, adamw=adamw, bias_correction=bias_correction)
    run_against_reference(
        lambda groups: FusedAdam(groups, betas=(0.9, 0.99), weight_decay=wd, adam_w_mode=adamw,
                                 bias_correction=bias_correction),
        ref_adam, **hp,
    )  # fmt: skip


@pytest.mark.parametrize("adamw,bias_correction,wd", ADAM_CASES)
def test_cpu_adam_matches_formula(adamw, bias_correction, wd):
    hp = dict(b1=0.8, b2=0.999, eps=1e-6, wd=wd, adamw=adamw, bias_correction=bias_correction)
    run_against_reference(
        lambda groups: DeepSpeedCPUAdam(groups, betas=(0.8, 0.999), eps=1e-6, weight_decay=wd, adamw_mode=adamw,
                                        bias_correction=bias_correction),
        ref_adam, **hp,
    )  # fmt: skip


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_equals_torch_optim(cls, adamw):
    params, twins = make_params(), make_params()
    mode = {"adam_w_mode": adamw} if cls is FusedAdam else {"adamw_mode": adamw}
    ours = cls(params, lr=1e-2, weight_decay=0.05, **mode)
    theirs = (torch.optim.AdamW if adamw else torch.optim.Adam)(twins, lr=1e-2, weight_decay=0.05, foreach=True)
    for step in range(STEPS):
        for p, q, g in zip(params, twins, grads_for(step, params)):
            p.grad, q.grad = g.float(), g.float()
        ours.step()
        theirs.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_cpu_adam_bf16_params_keep_fp32_moments():
    param = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    reference, state = param.detach().float().clone(), {}
    optimizer = DeepSpeedCPUAdam([param], lr=1e-2)
    for step in range(STEPS):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(step))
        param.grad = grad.bfloat16()
        optimizer.step()
        # Upstream semantics: fp32 math on the (rounded) bf16 param, result rounded back.
        reference = ref_adam(reference, grad.bfloat16().float(), state, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, True)
        reference = reference.bfloat16().float()
    assert optimizer.state[param]["exp_avg"].dtype == torch.float32
    assert param.dtype == torch.bfloat16
    torch.testing.assert_close(param.float(), reference, rtol=0, atol=1e-2)


def test_cpu_adam_low_precision_states_when_asked():
    param = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    param.grad = torch.randn(8, dtype=torch.bfloat16)
    optimizer = DeepSpeedCPUAdam([param], fp32_optimizer_states=False)
    optimizer.step()
    assert optimizer.state[param]["exp_avg_sq"].dtype == torch.bfloat16


def test_adam_refuses_amsgrad_and_deprecated_step_args():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(make_params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(make_params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="step\\(\\) with no arguments"):
        FusedAdam(make_params()).step(scale=2.0)


def test_fused_adam_zero_grad_follows_set_grad_none():
    for set_grad_none, expect_none in ((True, True), (False, False)):
        params = make_params()
        optimizer = FusedAdam(params, set_grad_none=set_grad_none)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.zero_grad()
        assert all((p.grad is None) == expect_none for p in params)


ALL_OPTIMIZERS = [FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion, DeepSpeedCPUAdagrad, FusedLamb]


@pytest.mark.parametrize("cls", ALL_OPTIMIZERS)
def test_state_dict_round_trip_resumes_identically(cls):
    a_params, b_params = make_params(), make_params()
    a, b = cls(a_params, lr=1e-2), cls(b_params, lr=1e-2)
    for step in range(2):
        for p, q, g in zip(a_params, b_params, grads_for(step, a_params)):
            p.grad, q.grad = g.float(), g.float()
        a.step()
        b.step()
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in b_params]
    resumed = cls(resumed_params, lr=1e-2)
    resumed.load_state_dict(b.state_dict())
    for step in range(2, 4):
        for p, q, g in zip(a_params, resumed_params, grads_for(step, a_params)):
            p.grad, q.grad = g.float(), g.float()
        a.step()
        resumed.step()
    for p, q in zip(a_params, resumed_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, DeepSpeedCPULion, DeepSpeedCPUAdagrad])
def test_load_state_dict_keeps_fp32_moments_of_bf16_params(cls):
    param = torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16))
    param.grad = torch.randn(16, dtype=torch.bfloat16)
    optimizer = cls([param])
    optimizer.step()
    saved = {k: v.clone() for k, v in optimizer.state[param].items()}
    resumed = cls([torch.nn.Parameter(param.detach().clone())])
    resumed.load_state_dict(optimizer.state_dict())
    (state,) = resumed.state.values()
    for key, value in saved.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_adam_resumes_from_upstream_int_step_counters():
    params, twins = make_params(), make_params()
    ours, theirs = FusedAdam(params, lr=1e-2), torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0)
    for step in range(3):
        for p, q, g in zip(params, twins, grads_for(step, params)):
            p.grad, q.grad = g.float(), g.float()
        ours.step()
        theirs.step()
    for state in ours.state.values():  # what an upstream FusedAdam checkpoint holds
        state["step"] = int(state["step"].item())
    for p, q, g in zip(params, twins, grads_for(3, params)):
        p.grad, q.grad = g.float(), g.float()
    ours.step()
    theirs.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- Lion
@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_formula(cls, wd):
    run_against_reference(
        lambda groups: cls(groups, betas=(0.9, 0.99), weight_decay=wd), ref_lion, b1=0.9, b2=0.99, wd=wd
    )


def test_lion_defaults_follow_upstream():
    optimizer = FusedLion(make_params())
    assert optimizer.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}


# ----------------------------------------------------------------------------- LAMB
LAMB_CASES = [(bc, inside, wd) for bc in (True, False) for inside in (True, False) for wd in (0.0, 0.01)]


@pytest.mark.parametrize("bias_correction,eps_inside_sqrt,wd", LAMB_CASES)
def test_lamb_matches_formula(bias_correction, eps_inside_sqrt, wd):
    hp = dict(b1=0.9, b2=0.999, eps=1e-6, wd=wd, bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
              min_coeff=0.01, max_coeff=10.0)  # fmt: skip
    optimizer, states = run_against_reference(
        lambda groups: FusedLamb(groups, eps=1e-6, weight_decay=wd, bias_correction=bias_correction,
                                 eps_inside_sqrt=eps_inside_sqrt),
        ref_lamb, **hp,
    )  # fmt: skip
    assert optimizer.get_lamb_coeffs() == pytest.approx([s["coeffs"][-1] for s in states], rel=1e-5)


@pytest.mark.parametrize("scale,expected", [(100.0, 10.0), (1e-5, 0.01)])
def test_lamb_trust_ratio_is_clamped(scale, expected):
    hp = dict(b1=0.9, b2=0.999, eps=1e-8, wd=0.0, bias_correction=True, eps_inside_sqrt=False,
              min_coeff=0.01, max_coeff=10.0)  # fmt: skip
    optimizer, _ = run_against_reference(lambda groups: FusedLamb(groups), ref_lamb, scale=scale, **hp)
    assert optimizer.get_lamb_coeffs() == pytest.approx([expected] * len(SHAPES))


def test_lamb_zero_param_uses_unit_coefficient_and_loss_scale():
    param = torch.nn.Parameter(torch.zeros(5))
    param.grad = torch.full((5,), 8.0)
    optimizer = FusedLamb([param], lr=0.1)
    optimizer.step(scale=4.0)
    expected = ref_lamb(torch.zeros(5, dtype=torch.float64), torch.full((5,), 8.0, dtype=torch.float64), {},
                        0.1, 0.9, 0.999, 1e-8, 0.0, True, False, 0.01, 10.0, scale=4.0)  # fmt: skip
    assert optimizer.get_lamb_coeffs() == [1.0]
    torch.testing.assert_close(param.double().detach(), expected)


def test_lamb_max_grad_norm_clips_through_combined_scale():
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    optimizer = FusedLamb([param], lr=0.1, max_grad_norm=1.0)
    optimizer.step(grad_norms=[6.0])  # clip = (6 + 1e-6) / 1 > 1, so grads are divided by ~6
    expected = ref_lamb(torch.ones(4, dtype=torch.float64), torch.full((4,), 3.0, dtype=torch.float64), {},
                        0.1, 0.9, 0.999, 1e-8, 0.0, True, False, 0.01, 10.0, scale=6.0 + 1e-6)  # fmt: skip
    torch.testing.assert_close(param.double().detach(), expected)


def test_lamb_legacy_grads_and_output_params_arguments():
    params, twins = make_params(), make_params()
    ours, reference = FusedLamb(params, lr=0.01), FusedLamb(twins, lr=0.01)
    grads = [g.half() for g in grads_for(0, params)]  # upstream's fp16 path: half grads, fp32 params
    outputs = [torch.empty_like(p, dtype=torch.half) for p in params]
    ours.step(grads=grads, output_params=outputs, scale=2.0)
    for q, g in zip(twins, grads):
        q.grad = g.float() / 2.0
    reference.step()
    for p, q, out in zip(params, twins, outputs):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(out, p.detach().half())


# ----------------------------------------------------------------------------- Adagrad
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adagrad_matches_formula_and_torch(wd):
    run_against_reference(lambda groups: DeepSpeedCPUAdagrad(groups, weight_decay=wd), ref_adagrad, eps=1e-10, wd=wd)
    params, twins = make_params(), make_params()
    ours, theirs = DeepSpeedCPUAdagrad(params, weight_decay=wd), torch.optim.Adagrad(twins, weight_decay=wd)
    for step in range(STEPS):
        for p, q, g in zip(params, twins, grads_for(step, params)):
            p.grad, q.grad = g.float(), g.float()
        ours.step()
        theirs.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_adagrad_sparse_grad_updates_only_touched_rows():
    weight = torch.nn.Parameter(torch.randn(6, 3))
    before = weight.detach().clone()
    rows = torch.tensor([[1, 4]])
    values = torch.randn(2, 3)
    weight.grad = torch.sparse_coo_tensor(rows, values, (6, 3), check_invariants=True)
    DeepSpeedCPUAdagrad([weight], lr=0.1, weight_decay=0.5).step()
    untouched = [0, 2, 3, 5]
    torch.testing.assert_close(weight.detach()[untouched], before[untouched], rtol=0, atol=0)
    expected = ref_adagrad(before[[1, 4]].double(), values.double(), {}, 0.1, 1e-10, 0.5)
    torch.testing.assert_close(weight.detach()[[1, 4]].double(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adam_on_cuda_equals_torch_fused(dtype):
    params = [torch.nn.Parameter(p.detach().cuda().to(dtype)) for p in make_params()]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = FusedAdam(params, weight_decay=0.1), torch.optim.AdamW(twins, weight_decay=0.1, fused=True)
    for step in range(STEPS):
        for p, q, g in zip(params, twins, grads_for(step, params)):
            p.grad, q.grad = g.cuda().to(dtype), g.cuda().to(dtype)
        ours.step()
        theirs.step()
    assert ours.state[params[0]]["step"].device.type == "cuda"
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ----------------------------------------------------------------------------- build_optimizer
@pytest.mark.parametrize(
    "type_name,params,offload,cls,w_mode",
    [
        ("Adam", {}, False, FusedAdam, True),  # upstream default: adam_w_mode=True
        ("adam", {"adam_w_mode": False}, False, FusedAdam, False),
        ("AdamW", {"adam_w_mode": False}, False, FusedAdam, True),  # AdamW forces decoupled decay
        ("Adam", {"adam_w_mode": False}, True, DeepSpeedCPUAdam, False),
        ("ADAMW", {}, True, DeepSpeedCPUAdam, True),
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, False, torch.optim.Adam, None),
        ("AdamW", {"torch_adam": True, "foreach": False}, True, torch.optim.AdamW, None),
        ("Lamb", {"max_coeff": 5.0}, False, FusedLamb, None),
        ("Lion", {}, False, FusedLion, None),
        ("lion", {}, True, DeepSpeedCPULion, None),
        ("Adagrad", {"lr_decay": 0.1}, False, torch.optim.Adagrad, None),
        ("Adagrad", {}, True, DeepSpeedCPUAdagrad, None),
        ("SGD", {"lr": 0.1, "momentum": 0.9}, False, torch.optim.SGD, None),
        ("rmsprop", {}, False, torch.optim.RMSprop, None),
    ],
)
def test_build_optimizer_maps_types_like_upstream(type_name, params, offload, cls, w_mode):
    given = dict(params)
    optimizer = build_optimizer(type_name, params, make_params(), on_cpu_offload=offload)
    assert type(optimizer) is cls
    assert params == given  # the config dict is not consumed
    if w_mode is not None:
        assert bool(optimizer.adam_w_mode) is w_mode


def test_build_optimizer_keeps_param_groups_and_hyperparameters():
    params = make_params()
    groups = [{"params": params[:1], "weight_decay": 0.0}, {"params": params[1:], "lr": 5e-4}]
    optimizer = build_optimizer("AdamW", {"lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.1}, groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 5e-4]
    assert optimizer.param_groups[0]["betas"] == [0.8, 0.9]


@pytest.mark.parametrize(
    "type_name,params,match",
    [
        ("OneBitAdam", {}, r"optimizer\.type: got 'OneBitAdam'.*Supported.*Adam, AdamW, Lamb"),
        ("ZeroOneAdam", {}, r"optimizer\.type: got 'ZeroOneAdam'"),
        ("OneBitLamb", {}, r"optimizer\.type: got 'OneBitLamb'"),
        ("Muon", {"nesterov": True}, r"optimizer\.params\.nesterov: not a parameter of optimizer type 'Muon'"),
        ("NoSuchOpt", {}, r"optimizer\.type: got 'NoSuchOpt'"),
        ("Adam", {"lrr": 0.1}, r"optimizer\.params\.lrr: .*accepted keys: lr, bias_correction"),
        ("Adam", {"torch_adam": True, "bias_correction": False}, r"optimizer\.params\.bias_correction"),
        ("Lion", {"eps": 1e-8}, r"optimizer\.params\.eps: .*accepted keys: lr, betas, weight_decay"),
        ("Adam", {"max_grad_norm": 1.0}, r"optimizer\.params\.max_grad_norm: .*gradient_clipping"),
        ("SGD", {"adam_w_mode": True}, r"optimizer\.params\.adam_w_mode: only valid for .*Adam"),
    ],
)
def test_build_optimizer_errors_name_the_config_path(type_name, params, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(type_name, params, make_params())


def test_build_optimizer_mup_types_need_mup():
    if importlib.util.find_spec("mup") is not None:
        pytest.skip("mup is installed, so MuAdam builds")
    with pytest.raises(ValueError, match=r"optimizer\.type: got 'MuAdam'.*mup"):
        build_optimizer("MuAdam", {}, make_params())
