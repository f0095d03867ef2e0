"""The feature rows of tools/gpu/features.py: one tiny causal LM, each row a few training steps of it
with one feature's code path on, at world size 1 (docs/gpu.md, "Feature rows").

Runs inside a worker process of features.py whose process group is already initialised (NCCL on the
device, gloo on the CPU). `run_row(name, device, steps)` returns {"losses": [...], "probe": [...]?,
"notes": str, "device": str, "backend": str}; the driver compares a device run with a CPU run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 32, 4
LR = 1e-2
OFFLOAD = {"device": "cpu", "pin_memory": True}

# name -> (ZeRO stage, dtype, model options, extra zero_optimization keys, optimizer type, what runs at world 1)
ROWS: dict[str, dict[str, Any]] = {
    "zero3": dict(stage=3, dtype="bf16", why="ZeRO-3 partitioned parameters: all-gather / reduce-scatter of world 1"),
    "zero3-offload-optimizer": dict(stage=3, dtype="bf16", zero={"offload_optimizer": OFFLOAD},
                                    why="ZeRO-3, fp32 masters and Adam state on the (pinned) CPU"),
    "zero3-offload-param": dict(stage=3, dtype="bf16", zero={"offload_param": OFFLOAD, "offload_optimizer": OFFLOAD},
                                why="ZeRO-3, offload_param cpu: parameter shards on the CPU, fetched per layer"),
    "zero3-offload-nvme": dict(stage=3, dtype="bf16", nvme=True,
                               why="ZeRO-Infinity: offload_param and offload_optimizer nvme on this machine's disk "
                                   "($DS_GPU_NVME_PATH or the temp dir), pinned swap buffers, parameters fetched "
                                   "from files to the device per layer"),
    "sp-ulysses": dict(stage=2, dtype="bf16", attn="ulysses",
                       why="DistributedAttention over the world group (sp degree 1): its all_to_all_single runs"),
    "sp-alst": dict(stage=3, dtype="bf16", attn="alst", mlp="tiled", loss="tiled",
                    why="ALST: UlyssesSPAttentionHF (sp degree 1, its all-to-alls run), TiledMLP and "
                        "TiledFusedLogitsLoss under ZeRO-3"),
    "tp-autotp": dict(stage=1, dtype="bf16", tp=True,
                      why="AutoTP plan applied at tp 1 (LinearLayer/LinearAllreduce) plus its copy/reduce/gather "
                          "autograd collectives on the world group; at degree 1 the engine's AutoTP is a no-op"),
    "moe": dict(stage=2, dtype="fp32", mlp="moe",
                why="MoE layer (4 experts, top-2, capacity, l_aux) at ep_size 1: gate, dispatch and experts run; "
                    "the expert all-to-all is skipped at ep 1 by design (as upstream's)"),
    "muon": dict(stage=3, dtype="bf16", optimizer="Muon",
                 why="Muon (Newton-Schulz on whole matrices) on ZeRO-3 shards; its all-to-all is empty at world 1"),
    "zeropp": dict(stage=3, dtype="bf16", zero={"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                                "zero_hpz_partition_size": 1}, probe="qgz",
                   why="ZeRO++ qwZ (int8 weight all-gather runs at world 1); qgZ's engine path needs world > 1 "
                       "(reduce-scatter of 1 is a copy), so its quantized_reduce_scatter is probed directly; "
                       "hpZ needs a node group smaller than ZeRO's group: none exists at world 1"),
}
TOLERANCE = {"bf16": (2e-2, 1e-3), "fp32": (1e-3, 1e-4)}   # (rtol, atol) on each step's loss and the probe


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _mlp_fn(self: Expert, x: torch.Tensor) -> torch.Tensor:
    return self.fc2(F.gelu(self.fc1(x)))


def _sdpa_bshd(q, k, v):   # [b, s, h, d] in and out
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def _hf_attention(module, q, k, v, mask, *args, **kwargs):   # transformers' attention-function shape
    return _sdpa_bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), None


class Block(nn.Module):
    def __init__(self, opts: dict) -> None:
        super().__init__()
        self.opts = opts
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        if opts.get("mlp") == "moe":
            from deepspeed.moe.layer import MoE

            self.mlp = MoE(DIM, Expert(), num_experts=4, ep_size=1, k=2, capacity_factor=2.0, min_capacity=4,
                           use_rts=False, top2_2nd_expert_sampling=False)
        else:
            self.mlp = Expert()
        if opts.get("attn") == "ulysses":
            from deepspeed.sequence.layer import DistributedAttention

            self.dist_attn = DistributedAttention(_sdpa_bshd, None, scatter_idx=2, gather_idx=1)
        elif opts.get("attn") == "alst":
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            self.dist_attn = UlyssesSPAttentionHF(_hf_attention, BATCH, HEADS, DIM // HEADS, HEADS, LAYERS, None,
                                                  seq_length_is_variable=True)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        qkv = self.qkv(h)
        if self.opts.get("tp"):
            from deepspeed.module_inject.layers import copy_to_tensor_parallel, gather_from_tensor_parallel

            qkv = gather_from_tensor_parallel(copy_to_tensor_parallel(qkv, None), None)
        q, k, v = (t.reshape(b, s, HEADS, DIM // HEADS) for t in qkv.split(DIM, dim=-1))
        attn = self.opts.get("attn")
        if attn == "ulysses":
            ctx = self.dist_attn(q, k, v).reshape(b, s, DIM)
        elif attn == "alst":
            pos = torch.arange(s, device=h.device).expand(b, s)
            ctx, _ = self.dist_attn(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                    position_ids=pos)
        else:
            ctx = _sdpa_bshd(q, k, v).reshape(b, s, DIM)
        out = self.proj(ctx)
        if self.opts.get("tp"):
            from deepspeed.module_inject.layers import reduce_from_tensor_parallel

            out = reduce_from_tensor_parallel(out, None)
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.ln1(x))
        h = self.ln2(x)
        aux = x.new_zeros((), dtype=torch.float32)
        if self.opts.get("mlp") == "moe":
            out, aux, _ = self.mlp(h)
        elif self.opts.get("mlp") == "tiled":
            from deepspeed.runtime.sequence_parallel.tiled_compute import TiledMLP

            out = TiledMLP.apply(_mlp_fn, self.mlp, h, 2, list(self.mlp.parameters()))
        else:
            out = self.mlp(h)
        return x + out, aux


class TinyLM(nn.Module):
    def __init__(self, opts: dict) -> None:
        super().__init__()
        self.opts = opts
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(opts) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        aux = 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        x = self.norm(x)
        if self.opts.get("loss") == "tiled":
            from deepspeed.runtime.sequence_parallel.tiled_loss import TiledFusedLogitsLoss

            def fn(head, xs, ys):
                return F.cross_entropy(head(xs).float(), ys)
            loss = TiledFusedLogitsLoss.apply(fn, self.lm_head, x, labels, None, 2, [self.lm_head.weight], "mean")
        else:
            loss = F.cross_entropy(self.lm_head(x).float().reshape(-1, VOCAB), labels.reshape(-1))
        return loss + 0.01 * aux


def _apply_autotp_plan(model: nn.Module) -> str:
    """AutoTP's plan and layers at tp 1 on the world group (shard_model itself returns at tp 1)."""
    from deepspeed.module_inject.auto_tp import _set_child, make_layer
    from deepspeed.module_inject.tp_plan import SKIP, build_plan, summary

    plan = build_plan(model, 1, None)
    for name, layer in plan.items():
        if layer.kind != SKIP:
            _set_child(model, name, make_layer(model.get_submodule(name), layer, None, name))
    kinds = {k: len(v) for k, v in summary(plan).items()}
    return "AutoTP plan " + ", ".join(f"{k} {n}" for k, n in kinds.items())


def config(row: dict) -> dict:
    optimizer = ({"type": "Muon", "params": {"lr": LR, "muon_lr": 0.02, "adam_lr": LR}}
                 if row.get("optimizer") == "Muon" else
                 {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}})
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": optimizer, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": row["stage"], "stage3_param_persistence_threshold": 0,
                                 **row.get("zero", {})}}
    if row["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if row.get("nvme"):
        import os
        import tempfile

        path = tempfile.mkdtemp(prefix="ds_gpu_nvme_", dir=os.environ.get("DS_GPU_NVME_PATH") or None)
        nvme = {"device": "nvme", "nvme_path": path, "pin_memory": True}
        cfg["zero_optimization"].update(offload_optimizer=dict(nvme),
                                        offload_param={**nvme, "max_in_cpu": 20000})   # below the model: swaps
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 2}
    return cfg


def _nvme_notes(engine: Any) -> str:
    """What the NVMe row moved and whether its swap buffers were pinned (device runs: they must be)."""
    params, opt = engine._stage3.swapper, engine.optimizer.swapper
    pinned = [b.is_pinned() for b in opt._spare]
    if engine.device.type == "cuda" and not all(pinned):
        raise RuntimeError(f"offload_optimizer nvme on CUDA: {pinned.count(False)} of {len(pinned)} swap buffers "
                           "are not pinned (pin_memory: true)")
    return (f"param swapper reads {params.reads} writes {params.writes} read-ahead hits {params.read_ahead_hits}; "
            f"optimizer swap buffers pinned {sum(pinned)}/{len(pinned)}; swap files "
            f"{opt.nbytes_on_disk() + params.dir.nbytes()} B")


def _qgz_probe(device: torch.device) -> list[float]:
    """qgZ's quantized reduce-scatter on the world group (one rank: quantise, int8 all-to-all, dequantise)."""
    from deepspeed.runtime.zero.qgz import quantized_reduce_scatter

    flat = torch.randn(2048, generator=torch.Generator().manual_seed(5)).to(device)
    out = torch.empty_like(flat)
    quantized_reduce_scatter(out, flat, None, 60.0)
    return [float(out.sum()), float((out - flat).abs().max()), float(out[:4].sum())]


def tokens(steps: int) -> torch.Tensor:
    """[steps, BATCH, SEQ + 1]: one batch of arithmetic sequences (random start, stride 1-3, mod VOCAB)
    every step, so the loss falls far beyond the tolerance in a few steps and a device run whose update
    is lost or wrong shows."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
    return ((start + stride * torch.arange(SEQ + 1)) % VOCAB).expand(steps, BATCH, SEQ + 1)


def run_row(name: str, device: torch.device, steps: int) -> dict:
    import deepspeed
    import torch.distributed as dist

    row = ROWS[name]
    torch.manual_seed(0)
    model = TinyLM(row)
    notes = [row["why"]]
    if row.get("tp"):
        notes.append(_apply_autotp_plan(model))
    data = tokens(steps)
    cfg = config(row)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    try:
        for batch in data:
            batch = batch.to(engine.device)
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
        notes.append(f"optimizer {type(opt).__name__}")
        if row.get("nvme"):
            notes.append(_nvme_notes(engine))
        result = {"losses": losses, "device": str(engine.device), "backend": dist.get_backend(),
                  "world_size": dist.get_world_size(), "notes": "; ".join(notes)}
        if row.get("probe") == "qgz":
            result["probe"] = _qgz_probe(engine.device)
    finally:
        engine.destroy()
        if row.get("nvme"):   # the run's swap directories are gone after destroy(); the temp dir goes too
            import shutil

            shutil.rmtree(cfg["zero_optimization"]["offload_optimizer"]["nvme_path"], ignore_errors=True)
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss {losses}")
    return result


def compare(name: str, got: dict, ref: dict) -> tuple[bool, float, str]:
    """Device run `got` against CPU run `ref`: (ok, worst |delta| / allowed, text)."""
    rtol, atol = TOLERANCE[ROWS[name]["dtype"]]
    a = got["losses"] + got.get("probe", [])
    b = ref["losses"] + ref.get("probe", [])
    if len(a) != len(b):
        return False, math.inf, f"{len(got['losses'])} vs {len(ref['losses'])} losses"
    worst = max((abs(x - y) / (atol + rtol * abs(y)) for x, y in zip(a, b)), default=0.0)
    delta = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return worst <= 1.0, worst, f"max |delta| {delta:.2e} ({worst:.2f} of the tolerance)"
