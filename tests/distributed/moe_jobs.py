"""Expert-parallel training jobs for test_moe_engine.py (run on every rank by run_distributed).

`ToyMoE` is a minimal expert-parallel layer with upstream's engine-facing surface: experts named
`deepspeed_moe.experts.deepspeed_experts.<local id>`, parameters marked `allreduce=False` and
`group_name="ep_size_<ep>"`, `set_deepspeed_parallelism()` building the groups. Top-1 routing
without capacity (every token reaches its expert) and a hand-written all-to-all through
deepspeed.comm, so a single-process model holding every expert (`reference`) applies the same
routing and gives the exact gradient of the W ranks' mean loss.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

HIDDEN, EXPERTS, TOKENS = 8, 4, 6


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (its backward is the same exchange of the gradients)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        import deepspeed.comm as dist

        ctx.group = group
        x = x.contiguous()   # (empty_like of a strided input would keep its strides)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, _AllToAll.apply(ctx.group, grad)


def _expert(global_id: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(1000 + global_id)
    layer = nn.Linear(HIDDEN, HIDDEN)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.3)
        layer.bias.copy_(torch.randn(HIDDEN, generator=gen) * 0.1)
    return layer


class ToyMoE(nn.Module):
    def __init__(self, num_experts: int = EXPERTS, ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.ep_group = None
        moe = nn.Module()
        moe.gate = nn.Module()
        moe.gate.wg = nn.Linear(HIDDEN, num_experts, bias=False)
        with torch.no_grad():
            moe.gate.wg.weight.copy_(torch.randn(num_experts, HIDDEN, generator=torch.Generator().manual_seed(7)))
        moe.experts = nn.Module()
        first = ep_rank * self.num_local_experts
        moe.experts.deepspeed_experts = nn.ModuleList(_expert(first + i) for i in range(self.num_local_experts))
        for p in moe.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name
        self.deepspeed_moe = moe

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        from deepspeed.utils import groups

        groups._create_expert_and_data_parallel(self.ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.deepspeed_moe.gate.wg(x).float(), dim=-1)
        index = probs.argmax(dim=-1)
        weight = probs.gather(1, index[:, None]).to(x.dtype)
        mask = torch.nn.functional.one_hot(index, self.num_experts).T.unsqueeze(-1).to(x.dtype)   # [E, T, 1]
        dispatched = mask * x.unsqueeze(0)                                                       # [E, T, d]
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self.ep_group, dispatched)   # [ep x local E, T, d]: my experts' tokens
        local = dispatched.reshape(-1, self.num_local_experts, *x.shape)
        out = torch.stack([e(local[:, i]) for i, e in enumerate(self.deepspeed_moe.experts.deepspeed_experts)], 1)
        out = out.reshape(-1, *x.shape)
        if self.ep_size > 1:
            out = _AllToAll.apply(self.ep_group, out)
        return (mask * out).sum(0) * weight


class ToyModel(nn.Module):
    def __init__(self, ep_size: int = 1, ep_rank: int = 0, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)   # before the experts: their count must not shift its init
        self.moes = nn.ModuleList(ToyMoE(EXPERTS, ep_size, ep_rank) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for moe in self.moes:
            h = h + moe(h)
        return torch.nn.functional.mse_loss(self.out(h).float(), target)


def batches(world: int, steps: int, micro: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank and micro-step: (x, target) of TOKENS tokens."""
    gen = torch.Generator().manual_seed(42)
    return [[(torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, HIDDEN, generator=gen))
             for _ in range(world * micro)] for _ in range(steps)]


def global_state(model: nn.Module, ep_size: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """The parameters with experts under their global ids (the reference's names)."""
    return {global_state_name(n, ep_size, ep_rank): p.detach().float().clone() for n, p in model.named_parameters()}


def config(stage: int = 0, opt: str = "SGD", lr: float = 0.1, clip: float = 0.0, bf16: bool = False,
           micro_gas: int = 1, **extra: Any) -> dict:
    import deepspeed.comm as dist

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_gas,
           "train_batch_size": micro_gas * dist.get_world_size(),
           "optimizer": {"type": opt, "params": {"lr": lr}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}, "gradient_clipping": clip,
           "steps_per_print": None}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def make_engine(ep_size: int, cfg_kwargs: dict) -> tuple[Any, int]:
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    groups._create_expert_and_data_parallel(ep_size)
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    model = ToyModel(ep_size, ep_rank)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(**cfg_kwargs))
    return engine, ep_rank


def run_steps(engine: Any, steps: list, losses: list | None = None, norms: list | None = None) -> None:
    import deepspeed.comm as dist

    rank, gas = dist.get_rank(), engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        for micro in range(gas):
            x, t = step[rank * gas + micro]
            loss = engine(x.to(engine.device, dtype), t.to(engine.device))
            engine.backward(loss)
            engine.step()
        if losses is not None:
            losses.append(float(loss.detach()))
        if norms is not None:
            norms.append(engine.get_global_grad_norm())


def train(ep_size: int, steps: int, cfg_kwargs: dict) -> dict:
    """Train ToyModel at `ep_size` for `steps` and return global-named parameters, losses, norms."""
    import deepspeed.comm as dist

    engine, ep_rank = make_engine(ep_size, cfg_kwargs)
    gas = engine.gradient_accumulation_steps()
    losses, norms = [], []
    run_steps(engine, batches(dist.get_world_size(), steps, gas), losses, norms)
    with _whole(engine):
        state = global_state(engine.module, ep_size, ep_rank)
    return {"state": state, "losses": losses, "norms": norms, "rank": dist.get_rank()}


def _whole(engine: Any) -> Any:
    """At ZeRO-3, every parameter whole inside (experts gathered over their expert-data-parallel group)."""
    import contextlib

    import deepspeed

    if engine._stage3 is None:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))


def checkpoint_roundtrip(ep_save: int, ep_load: int, cfg_kwargs: dict, save_dir: str, before: int = 3,
                         after: int = 3, universal: bool = False) -> dict:
    """Train `before` steps at ep_save, save; train `after` more (the uninterrupted run); then a new
    engine at ep_load loads the checkpoint and trains the same `after` steps. `universal`: rank 0 converts
    the tag with ds_to_universal and the new engine loads that (`checkpoint.load_universal`)."""
    import deepspeed.comm as dist

    steps = batches(dist.get_world_size(), before + after, cfg_kwargs.get("micro_gas", 1))
    engine, ep_rank = make_engine(ep_save, cfg_kwargs)
    run_steps(engine, steps[:before])
    engine.save_checkpoint(save_dir, tag="t", client_state={"note": 7})
    engine.wait_for_checkpoint()
    with _whole(engine):
        saved = global_state(engine.module, ep_save, ep_rank)
    if universal and dist.get_rank() == 0:
        from deepspeed.checkpoint.ds_to_universal import convert

        convert(os.path.join(save_dir, "t"), os.path.join(save_dir, "t_universal"))
    dist.barrier()
    run_steps(engine, steps[before:])
    with _whole(engine):
        uninterrupted = global_state(engine.module, ep_save, ep_rank)
    load_kwargs = dict(cfg_kwargs, checkpoint={"load_universal": True}) if universal else cfg_kwargs
    resumed, ep_rank2 = make_engine(ep_load, load_kwargs)
    path, client = resumed.load_checkpoint(save_dir, tag="t_universal" if universal else "t")
    with _whole(resumed):
        loaded = global_state(resumed.module, ep_load, ep_rank2)
    steps_after_load = resumed.global_steps
    run_steps(resumed, steps[before:])
    with _whole(resumed):
        final = global_state(resumed.module, ep_load, ep_rank2)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": final, "client": client,
            "global_steps": steps_after_load, "path": path}


def reference(world: int, steps: int, lr: float = 0.1, clip: float = 0.0, micro_gas: int = 1) -> dict:
    """One process, every expert, the whole global batch: the exact gradient of the ranks' mean loss."""
    model = ToyModel(1, 0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for step in batches(world, steps, micro_gas):
        opt.zero_grad()
        for x, t in step:
            (model(x, t) / len(step)).backward()
        params = list(model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        opt.step()
    return {"state": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def merged(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every global parameter from the ranks' results (replicas must agree: checked by the caller)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r["state"].items():
            if name in out:
                torch.testing.assert_close(value, out[name], rtol=0, atol=0, msg=f"replicas differ: {name}")
            out[name] = value
    return out


def env_rank() -> int:
    return int(os.environ.get("RANK", 0))


def load_deepspeed_fixture(fixture: str, ep_size: int = 2, refuse_ungrouped: bool = False, stage: int = 0) -> dict:
    """An ep=`ep_size` engine loads DeepSpeed 0.19.8's MoE checkpoint (tests/fixtures/ds_0_19_8_moe: stage 0,
    ds_0_19_8_moe_zero2: ZeRO-2; saved at ep=2 on 2 ranks). `expected`: what DeepSpeed recorded on the ranks
    that held this rank's parameters; `exp_avg_sq_expected`: of the stage-0 fixture, read from its files by the
    positions spelled out here (the ZeRO-2 fixture records it in `expected`).
    `after`: the parameters after two more steps. `refuse_ungrouped`: also load into an engine with one
    optimizer group and return its error. `stage`: the loading engine's ZeRO stage."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    groups._create_expert_and_data_parallel(ep_size)
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}") if ep_size > 1 else 0
    model = ToyModel(ep_size, ep_rank)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                                 config=config(stage=stage, opt="Adam", lr=1e-2))
    engine.load_checkpoint(os.path.join(fixture, "ckpt"), tag="t")
    named = {global_state_name(n, ep_size, ep_rank): p for n, p in engine.module.named_parameters()}
    state = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
    saved = {}   # DeepSpeed recorded on 2 ranks (ep=2): the replicated parameters alike on both
    for rank in range(2):
        saved.update(torch.load(os.path.join(fixture, f"expected_rank{rank}.pt")))
    sq = {}
    dense = ["inp.weight", "inp.bias", "out.weight", "out.bias", "moes.0.deepspeed_moe.gate.wg.weight",
             "moes.1.deepspeed_moe.gate.wg.weight"]
    for saved_rank in range(2):   # upstream's positions: non-expert group, then the expert group (2 local experts)
        path = os.path.join(fixture, "ckpt", "t", f"expp_rank_{saved_rank}_mp_rank_00_optim_states.pt")
        if not os.path.isfile(path):   # a ZeRO-1/2 fixture: its expected_rank*.pt records exp_avg_sq
            continue
        optim = torch.load(path, weights_only=False)["optimizer"]["state"]
        experts = [f"moes.{layer}.deepspeed_moe.experts.deepspeed_experts.{2 * saved_rank + j}.{p}"
                   for layer in range(2) for j in range(2) for p in ("weight", "bias")]
        sq.update({"exp_avg_sq:" + n: optim[i]["exp_avg_sq"] for i, n in enumerate(dense + experts)})
    out = {"state": state, "steps": engine.global_steps,
           "exp_avg": {"exp_avg:" + n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named.items()},
           "exp_avg_sq": {"exp_avg_sq:" + n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in named.items()},
           "step": sorted({float(s["step"]) for s in getattr(optimizer, "optimizer", optimizer).state.values()}),
           "expected": {k: v for k, v in saved.items() if k.split(":")[-1] in state},
           "exp_avg_sq_expected": {k: v for k, v in sq.items() if k.split(":")[-1] in state},
           "group_names": [g["name"] for g in optimizer.param_groups]}
    run_steps(engine, batches(dist.get_world_size(), 2))   # the loaded state continues: two more Adam steps
    with _whole(engine):
        out["after"] = global_state(engine.module, ep_size, ep_rank)
    if refuse_ungrouped:
        other = ToyModel(ep_size, ep_rank)
        plain, *_ = deepspeed.initialize(model=other, model_parameters=other.parameters(),
                                         config=config(opt="Adam", lr=1e-2))
        try:
            plain.load_checkpoint(os.path.join(fixture, "ckpt"), tag="t")
        except Exception as error:   # the test checks type and message
            out["refused"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    return out


def global_state_name(name: str, ep_size: int, ep_rank: int) -> str:
    prefix = "deepspeed_moe.experts.deepspeed_experts."
    if prefix not in name:
        return name
    head, tail = name.split(prefix)
    local, rest = tail.split(".", 1)
    return f"{head}{prefix}{ep_rank * (EXPERTS // ep_size) + int(local)}.{rest}"


class LayerModel(nn.Module):
    """ToyModel's shape with deepspeed.moe.layer.MoE (top-2, capacity, no random token selection: the
    routing is a function of each rank's tokens only, whatever ep_size)."""

    def __init__(self, ep_size: int | tuple = 1) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        sizes = ep_size if isinstance(ep_size, tuple) else (ep_size, ep_size)
        self.inp, self.out = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.moes = nn.ModuleList(MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=ep, k=2,
                                      min_capacity=2, use_rts=False) for ep in sizes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h, aux = torch.tanh(self.inp(x)), 0.0
        for moe in self.moes:
            out, l_aux, _ = moe(h)
            h, aux = h + out, aux + l_aux
        return torch.nn.functional.mse_loss(self.out(h).float(), target) + 0.01 * aux


def layer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """LayerModel's parameters under global expert names (each MoE layer with its own ep_size)."""
    from deepspeed.utils import groups

    out = {}
    for name, p in model.named_parameters():
        ep = model.moes[int(name.split(".")[1])].ep_size if name.startswith("moes.") else 1
        rank = groups._get_expert_parallel_rank(f"ep_size_{ep}") if ep > 1 else 0
        out[global_state_name(name, ep, rank)] = p.detach().float().clone()
    return out


def train_layer(ep_size: int | tuple, steps: int, cfg_kwargs: dict, save_dir: str | None = None) -> dict:
    """LayerModel at ep_size for `steps`; with `save_dir`, save there and reload into a fresh engine."""
    import deepspeed
    import deepspeed.comm as dist

    model = LayerModel(ep_size)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(**cfg_kwargs))
    run_steps(engine, batches(dist.get_world_size(), steps))
    with _whole(engine):
        out = {"state": layer_state(engine.module)}
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
        engine.wait_for_checkpoint()
        fresh = LayerModel(ep_size)
        other, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(),
                                         config=config(**cfg_kwargs))
        other.load_checkpoint(save_dir, tag="t")
        with _whole(other):
            out["loaded"] = layer_state(other.module)
    return out


def save_for_deepspeed(save_dir: str) -> None:
    """The reverse of load_deepspeed_fixture: 2 steps of the fixture's setup here (ep=2, stage 0, Adam,
    upstream's optimizer groups), saved to `save_dir` with what DeepSpeed 0.19.8 must read back
    (expected_rank<r>.pt); make_moe_fixture.py --check-ours loads it with DeepSpeed."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(2)
    ep_rank = groups._get_expert_parallel_rank("ep_size_2")
    model = ToyModel(2, ep_rank)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                                 config=config(opt="Adam", lr=1e-2))
    run_steps(engine, batches(2, 2))
    engine.save_checkpoint(save_dir, tag="t")
    engine.wait_for_checkpoint()
    record = global_state(engine.module, 2, ep_rank)
    record.update({"exp_avg:" + global_state_name(n, 2, ep_rank): optimizer.state[p]["exp_avg"].clone()
                   for n, p in engine.module.named_parameters()})
    torch.save(record, os.path.join(save_dir, f"expected_rank{dist.get_rank()}.pt"))


def safe_get_experts(stage: int) -> dict:
    """safe_get_full_fp32_param / _grad / _optimizer_state of an expert parameter under ZeRO (its
    shard lives in the expert-data-parallel group) equal the parameter and reference values."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    import deepspeed.comm as dist

    engine, ep_rank = make_engine(2, {"stage": stage, "opt": "Adam", "lr": 0.01})
    steps = batches(dist.get_world_size(), 2)
    run_steps(engine, steps[:1])
    x, t = steps[1][dist.get_rank()]
    engine.backward(engine(x, t))
    with _whole(engine):
        whole = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    out = {}
    for name, p in engine.module.named_parameters():
        out[global_state_name(name, 2, ep_rank)] = (whole[name], safe_get_full_fp32_param(p),
                                                   safe_get_full_grad(p), safe_get_full_optimizer_state(p, "exp_avg"))
    engine.step()
    return out


def zero_init_error(ep_size: int) -> str:
    """Two Linears built under deepspeed.zero.Init, the second's parameters marked as experts of
    `ep_size`, then ZeRO-3: the error every rank raises."""
    import deepspeed

    with deepspeed.zero.Init():
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    for p in model[1].parameters():
        p.allreduce, p.group_name = False, f"ep_size_{ep_size}"
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage=3))
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "initialized"


def deepspeed_fixture_experts_by_static(fixture: str) -> dict:
    """Upstream's static `DeepSpeedEngine.load_moe_state_dict` (Megatron-DeepSpeed's call) on DeepSpeed
    0.19.8's ep=2 checkpoint: this rank's experts under their local names, with global-name keys here."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(2)
    ep_rank = groups._get_expert_parallel_rank("ep_size_2")
    model = ToyModel(2, ep_rank)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    loaded: dict = {}
    DeepSpeedEngine.load_moe_state_dict(os.path.join(fixture, "ckpt"), "t", loaded, False, model=engine.module)
    expected = torch.load(os.path.join(fixture, f"expected_rank{dist.get_rank()}.pt"))
    local_names = {n for n, _ in engine.module.named_parameters()}
    return {"loaded": {global_state_name(n, 2, ep_rank): v for n, v in loaded.items()},
            "local_names_ok": set(loaded) <= local_names,
            "expected": {n: v for n, v in expected.items() if "deepspeed_experts" in n and not n.startswith("exp_avg")},
            "path": DeepSpeedEngine._get_expert_ckpt_name(fixture, 0, 3, "t")}


def missing_piece_error(save_dir: str) -> tuple[str, str]:
    """LayerModel at ep 2, ZeRO-2: saved, then rank 0's optimizer file loses its first piece of a dense
    parameter (one every rank reads whole); a fresh engine's load must raise on every rank. Returns
    (that parameter, the error)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint.files import optim_file

    cfg = config(stage=2, opt="Adam", lr=1e-2)
    model = LayerModel(2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run_steps(engine, batches(dist.get_world_size(), 1))
    engine.save_checkpoint(save_dir, tag="t")
    engine.wait_for_checkpoint()
    path = f"{save_dir}/t/{optim_file(0, bf16=False)}"
    pieces = torch.load(path, weights_only=False)["optimizer_state_dict"]["ds_moe_pieces"]
    dense = next(p for p in pieces if "deepspeed_experts" not in p[0])
    dist.barrier()
    if dist.get_rank() == 0:
        state = torch.load(path, weights_only=False)
        state["optimizer_state_dict"]["ds_moe_pieces"] = [p for p in pieces if p is not dense]
        torch.save(state, path)
    dist.barrier()
    fresh = LayerModel(2)
    other, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg)
    try:
        other.load_checkpoint(save_dir, tag="t")
    except Exception as error:  # noqa: BLE001 - the message is the result
        return dense[0], str(error)
    return dense[0], ""
