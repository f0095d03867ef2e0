"""Jobs for expert parallelism x tensor parallelism ([Note: EP x TP folding] in deepspeed/moe/tp_tokens.py):
AutoEP with AutoTP on the tiny HF Mixtral / Qwen3-MoE of autoep_jobs, against one process on the unsharded
model and the same global batch (the HF aux loss off: it is not a mean over data shards)."""

from __future__ import annotations

import torch

from autoep_jobs import MICRO, batch, build, train_steps


def _model(kind: str) -> torch.nn.Module:
    model = build(kind)
    model.config.output_router_logits = False
    return model


def _global(step: int, dp: int) -> torch.Tensor:
    return torch.cat([batch(step, d) for d in range(dp)])


def reference(kind: str, steps: int, dp: int, lr: float, clip: float) -> dict:
    """One process, the unsharded model, the global batch of `dp` data shards: SGD with torch's clipping."""
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        ids = _global(step, dp)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def train_autoep_autotp(kind: str, steps: int, tp: int, ep: int, stage: int, lr: float, clip: float) -> dict:
    """Every rank: AutoEP (`autoep_size=ep`) with AutoTP (`autotp_size=tp`) through deepspeed.initialize;
    this data rank's shard of each global batch. Per-step losses and norms, whole final weights, groups."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    from deepspeed.utils import groups

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage}, "gradient_clipping": clip,
              "optimizer": {"type": "SGD", "params": {"lr": lr}},
              "tensor_parallel": {"autotp_size": tp},
              "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": kind}}
    engine, *_ = deepspeed.initialize(model=_model(kind), config=config)
    dp_rank = engine.get_data_parallel_rank()
    losses, norms = train_steps(engine, steps, dp_rank).values()
    name = f"ep_size_{ep}"
    with GatherReplacedLayerParams(list(engine.module.parameters()), engine.module, enabled=True):
        state = {k: v.clone() for k, v in engine.module.state_dict().items()}   # experts: gathered over EP
    result = {"losses": losses, "norms": norms, "state": state, "dp_rank": dp_rank, "dp": engine.dp_world_size,
              "ep_ranks": groups._get_expert_parallel_group_ranks(name),
              "edp_ranks": groups._get_expert_data_parallel_group_ranks(name)}
    dist.barrier()
    return result


def refused(kind: str, tp: int, ep: int, stage: int, extra: dict) -> str:
    """The error deepspeed.initialize raises on this rank for AutoEP x AutoTP with `extra` config keys."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "tensor_parallel": {"autotp_size": tp},
              "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": kind}, **extra}
    try:
        deepspeed.initialize(model=_model(kind), config=config)
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


# -- deepspeed.moe.layer.MoE with a Megatron-style mpu (upstream's test_moe_tp.py) ----------------------------
H, EXPERTS, TOKENS = 8, 4, 6


class MPU:
    """Upstream test_moe_tp.py's mpu: tensor groups of `tp` consecutive ranks, data groups strided by tp."""

    def __init__(self, tp: int) -> None:
        import deepspeed.comm as dist

        self.rank, self.world, self.tp = dist.get_rank(), dist.get_world_size(), tp
        for i in range(0, self.world, tp):
            group = dist.new_group(list(range(i, i + tp)))
            if self.rank in range(i, i + tp):
                self.tp_group = group
        for i in range(tp):
            group = dist.new_group(list(range(i, self.world, tp)))
            if self.rank % tp == i:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.world // self.tp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_group(self):
        return self.tp_group


class StridedMPU(MPU):
    """Tensor peers strided by the data size ({0,2} {1,3} on 4 ranks): not Megatron's layout."""

    def __init__(self, tp: int) -> None:
        import deepspeed.comm as dist

        self.rank, self.world, self.tp = dist.get_rank(), dist.get_world_size(), tp
        dp = self.world // tp
        for i in range(dp):
            group = dist.new_group(list(range(i, self.world, dp)))
            if self.rank % dp == i:
                self.tp_group = group
        for i in range(0, self.world, dp):
            group = dist.new_group(list(range(i, i + dp)))
            if self.rank in range(i, i + dp):
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.rank // (self.world // self.tp)

    def get_data_parallel_rank(self) -> int:
        return self.rank % (self.world // self.tp)


def moe_strided_mpu_refused() -> str:
    """deepspeed.initialize of MoE(ep 2) under a tensor-parallel mpu laid out strided: the error here."""
    import deepspeed
    from deepspeed.utils import groups

    groups.mpu = None
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        deepspeed.initialize(model=MoENet(2, 0), config=config, mpu=StridedMPU(2))
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        groups.mpu = None
    return ""


class MoENet(torch.nn.Module):
    """A replicated dense layer, then MoE (top-2, no token dropped at capacity_factor 4): output, l_aux."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.dense = torch.nn.Linear(H, H)
        expert = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, H))
        self.moe = MoE(H, expert, num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=4.0, min_capacity=1,
                       use_rts=False, top2_2nd_expert_sampling=False)
        local = EXPERTS // ep
        with torch.no_grad():   # expert e's weights depend on e: a token sent to the wrong expert shows
            for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(100 + ep_rank * local + i)
                for p in module.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(torch.tanh(self.dense(x)))
        return out.pow(2).mean() + 0.1 * l_aux


def _moe_data(step: int, shard: int) -> torch.Tensor:
    return torch.randn(2, TOKENS, H, generator=torch.Generator().manual_seed(10 * step + shard))


def moe_reference(steps: int, dp: int, lr: float, clip: float) -> dict:
    """One process, all experts (ep 1): each step's loss is the mean of the data shards' losses."""
    model = MoENet(1, 0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        loss = sum(model(_moe_data(step, d)) for d in range(dp)) / dp
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": _moe_state(model, 1)}


def _moe_state(model: torch.nn.Module, ep: int, ep_group=None) -> dict:
    """Dense and gate weights, and every expert's by its global id (gathered over the EP group)."""
    import deepspeed.comm as dist

    state = {k: v.detach().clone() for k, v in model.named_parameters() if "deepspeed_experts" not in k}
    for i, module in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
        for name, p in module.named_parameters():
            parts = [p.detach().clone()]
            if ep > 1:
                parts = [torch.empty_like(p) for _ in range(ep)]
                dist.all_gather(parts, p.detach().contiguous(), group=ep_group)
            for r, part in enumerate(parts):
                state[f"expert{r * (EXPERTS // ep) + i}.{name}"] = part
    return state


def train_moe_mpu(steps: int, tp: int, ep: int, stage: int, lr: float, clip: float) -> dict:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    groups.mpu = None
    mpu = MPU(tp)
    ep_rank = mpu.get_data_parallel_rank() % ep   # upstream's E + M + D: expert groups are runs inside a tensor lane
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "gradient_clipping": clip, "optimizer": {"type": "SGD", "params": {"lr": lr}}}
    engine, *_ = deepspeed.initialize(model=MoENet(ep, ep_rank), config=config, mpu=mpu)
    name = f"ep_size_{ep}"
    assert groups._get_expert_parallel_rank(name) == ep_rank
    losses, norms = [], []
    for step in range(steps):
        loss = engine(_moe_data(step, mpu.get_data_parallel_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    result = {"losses": losses, "norms": norms, "dp_rank": mpu.get_data_parallel_rank(),
              "state": _moe_state(engine.module, ep, groups._get_expert_parallel_group(name)),
              "ep_ranks": groups._get_expert_parallel_group_ranks(name),
              "expert_tp": groups._get_expert_model_parallel_world_size()}
    dist.barrier()
    groups.mpu = None
    return result



class _SharedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 6, bias=False)
        self.down_proj = torch.nn.Linear(6, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _tiny_autoep_layer(score_apply: str) -> tuple:
    """(model, its AutoEPMoELayer): a Mixtral-style block replaced at ep 1, the same weights on every rank."""
    from types import SimpleNamespace

    from torch import nn

    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    torch.manual_seed(1)
    model = nn.Module()
    model.config = SimpleNamespace(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    block = model.model.layers[0].mlp = nn.Module()
    block.gate = nn.Linear(8, 4, bias=False)
    block.experts = nn.Module()
    block.experts.gate_up_proj = nn.Parameter(torch.randn(4, 8, 12))
    block.experts.down_proj = nn.Parameter(torch.randn(4, 6, 8))
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "score_apply": score_apply}))
    (spec,) = auto_ep.ep_parser()
    return model, auto_ep.replace_moe_layer(spec, ep_size=1, ep_rank=0)


def folded_layer_grads(score_apply: str, shared: bool = False) -> dict:
    """Every rank (tp 2, ep 1): one AutoEPMoELayer (with `shared`, a shared-expert MLP in it), the same
    weights and tokens on both ranks, run whole and then with the two ranks sharing its assignments
    ([Note: folded assignment dispatch]) and, with `shared`, AutoTP's automatic plan sharding the
    shared experts; the output and the gradients of both runs."""
    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_tp import shard_model

    model, layer = _tiny_autoep_layer(score_apply)
    if shared:
        layer.shared_experts = _SharedMLP()
    x = torch.randn(2, 7, 8)

    def run() -> dict:
        layer.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        out = layer(inp)
        (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return {"out": out.detach(), "x": inp.grad.clone(), **grads}

    whole = run()
    group = ds_comm.new_group([0, 1])
    plan = shard_model(model, 2, None, group) if shared else {}
    layer.tensor_fold = (group, 2, ds_comm.get_rank(group))
    return {"whole": whole, "folded": run(), "plan": plan}


def folded_routing_differs() -> str:
    """Every rank (tp 2): the folded layer with `validate_folding_routing`, rank 1's tokens perturbed, so
    the peers route differently: the error each rank raises."""
    from deepspeed import comm as ds_comm

    _, layer = _tiny_autoep_layer("post")
    x = torch.randn(2, 7, 8)
    x[0, 0] += ds_comm.get_rank()
    layer.tensor_fold = (ds_comm.new_group([0, 1]), 2, ds_comm.get_rank())
    layer.validate_folding_routing = True
    try:
        layer(x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"
