"""Jobs for EP x TP checkpoints ([Note: EP x TP checkpoint layout] in runtime/checkpoint/ep_tp_io.py): train,
save, train on; a fresh engine at the same layout loads and trains the same steps; zero_to_fp32 of the
checkpoint against one process on the unsharded model (test_ep_tp_checkpoint.py)."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from autoep_jobs import MICRO, train_steps
from eptp_jobs import MPU, EXPERTS, MoENet, _global, _model, _moe_data, _moe_state

LR, CLIP = 1e-2, 0.5


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)   # the engine's "Adam" (adam_w_mode, no decay)


def reference(kind: str, steps: int, dp: int) -> dict:
    """One process, the unsharded model, the global batch of `dp` data shards, Adam with torch's clipping:
    the whole weights after `steps` steps."""
    model = _model(kind)
    opt = _adam(model.parameters())
    for step in range(steps):
        ids = _global(step, dp)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def moe_reference(steps: int, dp: int) -> dict:
    """The same for MoENet (all experts in one process): weights by eptp_jobs._moe_state's names."""
    model = MoENet(1, 0)
    opt = _adam(model.parameters())
    for step in range(steps):
        (sum(model(_moe_data(step, d)) for d in range(dp)) / dp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return _moe_state(model, 1)


def _config(stage: int, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            "gradient_clipping": CLIP, "optimizer": {"type": "Adam", "params": {"lr": LR}}, **extra}


def _consolidated(save_dir: str) -> dict:
    """zero_to_fp32 on rank 0 (the standalone module save_checkpoint copies next to the checkpoint)."""
    import deepspeed.comm as dist

    out = {}
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out = dict(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t"))
    dist.barrier()
    return out


def _save_resume(save_dir: str, steps: int, make: Callable[[], Any], train: Callable[[Any, int], list],
                 whole: Callable[[Any], dict], after_save: Callable[[Any], dict] = lambda engine: {}) -> dict:
    """Train `steps`, save (then `after_save`), train `steps` more; a fresh engine loads and trains the same `steps`."""
    engine = make()
    train(engine, 0)
    engine.save_checkpoint(save_dir, tag="t")
    at_save = whole(engine)
    consolidated = _consolidated(save_dir)
    extra = after_save(engine)
    straight = train(engine, steps)
    final = whole(engine)
    resumed = make()
    resumed.load_checkpoint(save_dir, tag="t")
    return {"straight": straight, "resumed": train(resumed, steps), "whole": final, "whole_resumed": whole(resumed),
            "at_save": at_save, "consolidated": consolidated, "files": sorted(os.listdir(os.path.join(save_dir, "t"))),
            **extra}


def _whole_autoep(engine: Any) -> dict:
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with GatherReplacedLayerParams(list(engine.module.parameters()), engine.module, enabled=True):
        return {k: v.clone() for k, v in engine.module.state_dict().items()}   # experts: gathered over EP


def autoep_autotp_checkpoint(kind: str, save_dir: str, stage: int, steps: int, tp: int = 2, ep: int = 2) -> dict:
    """AutoEP x AutoTP: _save_resume's results, and save_16bit_model's file (rank 0) at the save."""
    import deepspeed

    def make() -> Any:
        config = _config(stage, tensor_parallel={"autotp_size": tp},
                         expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": kind})
        return deepspeed.initialize(model=_model(kind), config=config)[0]

    def train(engine: Any, first: int) -> list:
        return train_steps(engine, steps, engine.get_data_parallel_rank(), first)["losses"]

    def sixteen(engine: Any) -> dict:
        engine.save_16bit_model(os.path.join(save_dir, "16bit"))
        path = os.path.join(save_dir, "16bit", "pytorch_model.bin")
        return {"sixteen": torch.load(path) if engine.global_rank == 0 else {}}

    return _save_resume(save_dir, steps, make, train, _whole_autoep, sixteen)


def _moe_engine(stage: int, tp: int, ep: int, load_universal: bool = False) -> tuple[Any, int]:
    """deepspeed.moe.layer.MoE (MoENet) at ep_size `ep`, with a Megatron-style mpu of tensor groups of `tp`
    (none at tp 1): the engine and its data rank."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    groups.mpu = None
    mpu = MPU(tp) if tp > 1 else None
    dp_rank = mpu.get_data_parallel_rank() if mpu is not None else dist.get_rank()
    config = {**_config(stage), "train_micro_batch_size_per_gpu": 2, "checkpoint": {"load_universal": load_universal}}
    return deepspeed.initialize(model=MoENet(ep, dp_rank % ep), config=config, mpu=mpu)[0], dp_rank


def _moe_train(engine: Any, dp_rank: int, first: int, steps: int) -> list:
    losses = []
    for step in range(first, first + steps):
        loss = engine(_moe_data(step, dp_rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _moe_whole(engine: Any, ep: int) -> dict:
    from deepspeed.utils import groups

    return _moe_state(engine.module, ep, groups._get_expert_parallel_group(f"ep_size_{ep}"))


def moe_mpu_checkpoint(save_dir: str, stage: int, steps: int, tp: int = 2, ep: int = 2) -> dict:
    """deepspeed.moe.layer.MoE with a Megatron-style mpu of tensor pairs: _save_resume's results."""
    from deepspeed.utils import groups

    dp_rank = []

    def make() -> Any:
        engine, rank = _moe_engine(stage, tp, ep)
        dp_rank[:] = [rank]
        return engine

    out = _save_resume(save_dir, steps, make, lambda engine, first: _moe_train(engine, dp_rank[0], first, steps),
                       lambda engine: _moe_whole(engine, ep))
    groups.mpu = None
    return out


def moe_save_universal(save_dir: str, steps: int, drop: str | None = None) -> dict:
    """MoE with an mpu at tp 2 x ep 2 (ZeRO-1): train `steps`, save tag t, rank 0 writes t_universal
    (`drop`: as autoep_save_universal). The whole weights (_moe_state's names) at the save."""
    import deepspeed.comm as dist
    from autoep_jobs import _universal_copy
    from deepspeed.utils import groups

    engine, dp_rank = _moe_engine(1, 2, 2)
    _moe_train(engine, dp_rank, 0, steps)
    engine.save_checkpoint(save_dir, tag="t")
    if dist.get_rank() == 0:
        _universal_copy(os.path.join(save_dir, "t"), os.path.join(save_dir, "t_universal"), drop)
    dist.barrier()
    out = _moe_whole(engine, 2)
    groups.mpu = None
    return out


def moe_continue(save_dir: str, tag: str | None, stage: int, tp: int, ep: int, first: int, steps: int) -> dict:
    """autoep_continue for MoENet with an mpu of tensor groups of `tp` (none at tp 1)."""
    from deepspeed.utils import groups

    engine, dp_rank = _moe_engine(stage, tp, ep, load_universal=str(tag).endswith("_universal"))
    if tag is not None:
        engine.load_checkpoint(save_dir, tag=tag)
    loaded = _moe_whole(engine, ep)
    losses = _moe_train(engine, dp_rank, first, steps)
    out = {"loaded": loaded, "losses": losses, "whole": _moe_whole(engine, ep)}
    groups.mpu = None
    return out


def moe_consolidated_names(consolidated: dict) -> dict:
    """zero_to_fp32's MoENet state under _moe_state's names (expert<e>.<param> for each global expert)."""
    out = {}
    for name, value in consolidated.items():
        if ".deepspeed_experts." in name:
            expert, _, rest = name.split(".deepspeed_experts.")[1].partition(".")
            out[f"expert{expert}.{rest}"] = value
        else:
            out[name] = value
    assert len([k for k in out if k.startswith("expert")]) == EXPERTS * 4, sorted(out)
    return out


def load_whole(kind: str, save_dir: str, stage: int, tp: int = 2, ep: int = 2) -> dict:
    """A fresh AutoEP x AutoTP engine at ZeRO `stage` loads tag t: its whole weights."""
    import deepspeed

    config = _config(stage, tensor_parallel={"autotp_size": tp},
                     expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": kind})
    engine = deepspeed.initialize(model=_model(kind), config=config)[0]
    engine.load_checkpoint(save_dir, tag="t")
    return _whole_autoep(engine)


def _autoep_engine(kind: str, stage: int, tp: int, ep: int, load_universal: bool = False) -> Any:
    import deepspeed

    extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}
    if ep:   # (ep 0: no expert_parallel section; AutoTP refuses AutoEP at autoep_size 1 as upstream does)
        extra["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": kind}
    config = _config(stage, checkpoint={"load_universal": load_universal}, **extra)
    return deepspeed.initialize(model=_model(kind), config=config)[0]


def autoep_save_universal(kind: str, save_dir: str, steps: int, drop: str | None = None) -> dict:
    """AutoEP x AutoTP at tp 2 x ep 2 (ZeRO-1): train `steps`, save tag t; rank 0 writes its universal form
    t_universal (`drop`: that optimizer field then zeroed in every file). The whole weights at the save."""
    import deepspeed.comm as dist
    from autoep_jobs import _universal_copy

    engine = _autoep_engine(kind, 1, 2, 2)
    train_steps(engine, steps, engine.get_data_parallel_rank())
    engine.save_checkpoint(save_dir, tag="t")
    if dist.get_rank() == 0:
        _universal_copy(os.path.join(save_dir, "t"), os.path.join(save_dir, "t_universal"), drop)
    dist.barrier()
    return _whole_autoep(engine)


def autoep_continue(kind: str, save_dir: str, tag: str | None, stage: int, tp: int, ep: int, first: int,
                    steps: int) -> dict:
    """A fresh AutoEP engine at tp x ep loads `tag` (the universal form when it ends in _universal; None: no
    load): its whole weights as loaded, then after `steps` more steps (batches from `first`), and the losses."""
    engine = _autoep_engine(kind, stage, tp, ep, load_universal=str(tag).endswith("_universal"))
    if tag is not None:
        engine.load_checkpoint(save_dir, tag=tag)
    loaded = _whole_autoep(engine)
    losses = train_steps(engine, steps, engine.get_data_parallel_rank(), first)["losses"]
    return {"loaded": loaded, "losses": losses, "whole": _whole_autoep(engine)}
