"""Per-rank jobs for the pipeline tests (run by harness.run_distributed), and the layers and
data they share with the plain-PyTorch reference in the test process."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

VOCAB, HIDDEN, SEQ = 16, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        if isinstance(x, tuple):   # (hidden, integer mask): the mask travels along, without gradient
            h, mask = x
            return torch.tanh(self.fc(h)) * mask.unsqueeze(-1).to(h.dtype), mask
        return torch.tanh(self.fc(x))


class Embed(nn.Embedding):
    def __init__(self, with_mask: bool = False) -> None:
        super().__init__(VOCAB, HIDDEN)
        self.with_mask = with_mask

    def forward(self, ids):
        h = super().forward(ids)
        return (h, (ids % 3 != 0).long()) if self.with_mask else h


def head(embed, x):
    h = x[0] if isinstance(x, tuple) else x
    return h @ embed.weight.t()


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


NUM_BLOCKS = 6
BASE_SEED = 1234


def specs(with_mask: bool = False):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return ([TiedLayerSpec("embed", Embed, with_mask)] + [LayerSpec(Block) for _ in range(NUM_BLOCKS)] +
            [TiedLayerSpec("embed", Embed, with_mask, forward_fn=head)])


def reference_layers(with_mask: bool = False):
    """The same layers built in one process with the pipeline's per-layer seeds."""
    torch.manual_seed(BASE_SEED + 0)
    embed = Embed(with_mask)
    blocks = []
    for i in range(NUM_BLOCKS):
        torch.manual_seed(BASE_SEED + 1 + i)
        blocks.append(Block())
    return embed, blocks


def reference_forward(embed, blocks, ids):
    x = embed(ids)
    for b in blocks:
        x = b(x)
    return head(embed, x)


def batches(step: int, replica: int, micro: int, gas: int, dp: int):
    """Micro-batches of replica `replica` at `step`: deterministic, disjoint slices of a global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (micro * gas * dp, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (micro * gas * dp, SEQ), generator=g)
    out = []
    for k in range(gas):
        start = (replica * gas + k) * micro
        out.append((ids[start:start + micro], labels[start:start + micro]))
    return out, (ids, labels)


def config(micro: int, gas: int, dp: int, zero: int, dtype: str = "fp32", clip: float = 0.0) -> dict:
    cfg = {"train_batch_size": micro * gas * dp, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": zero}, "gradient_clipping": clip}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train(stages: int, micro: int, gas: int, zero: int, steps: int, ac_interval: int = 0, with_mask: bool = False,
          dtype: str = "fp32", clip: float = 0.0, partition_method: str = "parameters", csv_dir: str | None = None,
          loader: bool = False, print_every: int = 0):
    """Train the pipeline; returns (losses, this stage's parameters by name, meta, p2p counts).
    `loader`: every step's micro-batches given once through set_dataloader (upstream's API).
    `print_every`: steps_per_print, with the engine's progress lines returned in meta["progress"]."""
    import logging

    import deepspeed
    from deepspeed.utils.logging import logger
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import PipelineModule

    world = ds_comm.get_world_size()
    dp = world // stages
    model = PipelineModule(specs(with_mask), num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                           partition_method=partition_method, activation_checkpoint_interval=ac_interval,
                           checkpointable_layers=["Block"] if ac_interval else None)
    cfg = config(micro, gas, dp, zero, dtype, clip)
    if csv_dir:
        cfg["csv_monitor"] = {"enabled": True, "output_path": csv_dir, "job_name": "pipe"}
    progress: list[str] = []
    if print_every:
        cfg["steps_per_print"] = print_every
        handler = logging.Handler()
        handler.emit = lambda record: progress.append(record.getMessage()) if "step=" in record.getMessage() else None
        logger.addHandler(handler)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    replica = engine.grid.get_data_parallel_id()
    losses = []
    counts = []
    if loader:
        engine.set_dataloader([b for step in range(steps) for b in batches(step, replica, micro, gas, dp)[0]])
    for step in range(steps):
        data, _ = batches(step, replica, micro, gas, dp)
        before = _p2p_snapshot()
        losses.append(float(engine.train_batch() if loader else engine.train_batch(iter(data))))
        counts.append(_p2p_delta(before))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    meta = {"stage": engine.stage_id, "replica": replica, "parts": engine.module.parts,
            "norm": engine.get_global_grad_norm(), "loss_scale": engine.loss_scale_value(), "progress": progress}
    engine.destroy()
    if print_every:
        logger.removeHandler(handler)   # the harness's worker processes run later jobs too
    return losses, params, meta, counts


def _p2p_snapshot():
    from deepspeed import comm as ds_comm

    out: dict[str, tuple[int, int]] = {}
    for op, s in ds_comm.comms_counter.summary().items():
        if op in ("send", "isend", "recv"):   # stages send asynchronously (isend); counted as sends
            name = "recv" if op == "recv" else "send"
            count, nbytes = out.get(name, (0, 0))
            out[name] = (count + int(s["count"]), nbytes + int(s["bytes"]))
    return out


def _p2p_delta(before):
    after = _p2p_snapshot()
    return {op: (after[op][0] - before.get(op, (0, 0))[0], after[op][1] - before.get(op, (0, 0))[1]) for op in after}


def evaluate(stages: int, micro: int, gas: int):
    """eval_batch after one training step; returns (eval loss, logits on the last stage, params)."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import PipelineModule

    dp = ds_comm.get_world_size() // stages
    model = PipelineModule(specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(micro, gas, dp, 0),
                                           model_parameters=list(model.parameters()))
    replica = engine.grid.get_data_parallel_id()
    data, _ = batches(0, replica, micro, gas, dp)
    engine.train_batch(iter(data))
    eval_data, _ = batches(7, replica, micro, gas, dp)
    loss, logits = engine.eval_batch(iter(eval_data), return_logits=True)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return float(loss), logits, params, replica


def failing_stage(stages: int, fail_stage: int):
    """A layer of `fail_stage` raises in the second micro-batch's forward; returns how each rank
    ended (the exception text) and how long it took after the failure."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import LayerSpec, PipelineModule

    class Boom(Block):
        calls = 0

        def forward(self, x):
            Boom.calls += 1
            if Boom.calls == 2:
                raise ValueError("boom in a layer")
            return super().forward(x)

    layers = [LayerSpec(Embed)] + [LayerSpec(Boom if i == fail_stage else Block) for i in range(stages)] + \
        [LayerSpec(nn.Linear, HIDDEN, VOCAB)]
    dp = ds_comm.get_world_size() // stages
    model = PipelineModule(layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(2, 4, dp, 0),
                                           model_parameters=list(model.parameters()))
    data, _ = batches(0, engine.grid.get_data_parallel_id(), 2, 4, dp)
    start = time.monotonic()
    try:
        engine.train_batch(iter(data))
    except Exception as error:  # noqa: BLE001 - reported to the test
        raise RuntimeError(f"OUTCOME stage={engine.stage_id} after={time.monotonic() - start:.2f}s "
                           f"{type(error).__name__}: {error}") from None
    return "no error"


def save_and_resume(save_stages: int, save_gas: int, load_stages: int, load_gas: int, zero: int, path: str,
                    phase: str, dtype: str = "fp32", tag: str = "ckpt"):
    """phase "save": train 3 steps, save, train 2 more (the uninterrupted losses); phase "load":
    a fresh engine (maybe another stage count) loads `tag` and trains the same 2 steps (a tag
    ending in "_universal" is loaded with `checkpoint.load_universal`)."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import PipelineModule

    stages, gas = (save_stages, save_gas) if phase == "save" else (load_stages, load_gas)
    micro = 2
    dp = ds_comm.get_world_size() // stages
    model = PipelineModule(specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                           base_seed=BASE_SEED + (0 if phase == "save" else 99))
    cfg = config(micro, gas, dp, zero, dtype)
    if tag.endswith("_universal"):
        cfg["checkpoint"] = {"load_universal": True}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 4}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    replica = engine.grid.get_data_parallel_id()
    losses = []
    if phase == "save":
        for step in range(3):
            engine.train_batch(iter(batches(step, replica, micro, gas, dp)[0]))
        engine.save_checkpoint(path, tag="ckpt")
    else:
        load_path, _ = engine.load_checkpoint(path, tag=tag)
        assert load_path is not None
        assert engine.global_steps == 3, engine.global_steps
    for step in range(3, 5):
        losses.append(float(engine.train_batch(iter(batches(step, replica, micro, gas, dp)[0]))))
    files = sorted(os.listdir(os.path.join(path, "ckpt")))
    engine.destroy()
    return losses, files


def resume_upstream(stages: int, fixture: str, copy_to: str, resave: str | None = None):
    """Load DeepSpeed 0.19.8's own pipeline checkpoint (2 stages x 2, ZeRO-1) into `stages` stages
    and train the 2 steps upstream trained after saving; optionally save ours for the reverse check."""
    import json
    import shutil

    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import PipelineModule

    with open(os.path.join(fixture, "expected.json")) as f:
        expected = json.load(f)
    if ds_comm.get_rank() == 0 and not os.path.exists(copy_to):
        shutil.copytree(fixture, copy_to)   # a load must not need write access, but keep the fixture pristine
    ds_comm.barrier()
    micro = expected["micro"]
    global_batch = micro * expected["gas"] * (expected["world"] // expected["stages"])
    dp = ds_comm.get_world_size() // stages
    gas = global_batch // (micro * dp)
    model = PipelineModule(specs(), num_stages=stages, loss_fn=loss_fn, partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(micro, gas, dp, expected["zero"]),
                                           model_parameters=model.parameters())
    engine.load_checkpoint(copy_to, tag="ckpt")
    replica = engine.grid.get_data_parallel_id()
    losses = [float(engine.train_batch(iter(batches(step, replica, micro, gas, dp)[0]))) for step in range(3, 5)]
    if resave:   # the reverse direction (by hand): upstream loads this and trains steps 5-6
        engine.save_checkpoint(resave, tag="ckpt")
        losses += [float(engine.train_batch(iter(batches(step, replica, micro, gas, dp)[0]))) for step in range(5, 7)]
    engine.destroy()
    return losses, expected["losses"]
