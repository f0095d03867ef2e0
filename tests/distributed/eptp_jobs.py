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
