"""The seed's 3-D parallelism as a Megatron-DeepSpeed user writes it: a PipelineModule over
`PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`, Megatron-style column/row parallel linear
layers of the user's own on the `mpu`'s tensor group (weights tagged `tensor_model_parallel`,
LayerNorm, embedding, head and the row bias replicated), `deepspeed.initialize` (the module's grid is the mpu, as upstream), ZeRO-1 and
gradient clipping. The reference in the test process is the same model unsharded."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, FFN, SEQ = 16, 8, 16, 4
NUM_BLOCKS = 4
BASE_SEED = 77


def _full(layer: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The unsharded initial value of one weight: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(BASE_SEED * 1000 + layer * 10 + sum(map(ord, name)) % 7)
    return torch.randn(shape, generator=g) * 0.3


def _example_module():
    """examples/megatron_3d/train.py: its Megatron f / g functions are the ones the blocks use."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "megatron_3d", "train.py")
    spec = importlib.util.spec_from_file_location("megatron_3d_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_example = _example_module()
_CopyToTensor, _ReduceFromTensor = _example.CopyToTensorParallel, _example.ReduceFromTensorParallel


class TensorBlock(nn.Module):
    """x + Row(gelu(Column(LayerNorm(x)))): FFN columns split over the tensor ranks."""

    def __init__(self, layer: int, mpu) -> None:
        super().__init__()
        self.mpu = mpu
        tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        cols = slice(rank * FFN // tp, (rank + 1) * FFN // tp)
        self.norm = nn.LayerNorm(HIDDEN)
        self.col_weight = nn.Parameter(_full(layer, "col_w", (FFN, HIDDEN))[cols].clone())
        self.col_bias = nn.Parameter(_full(layer, "col_b", (FFN,))[cols].clone())
        self.row_weight = nn.Parameter(_full(layer, "row_w", (HIDDEN, FFN))[:, cols].clone())
        self.row_bias = nn.Parameter(_full(layer, "row_b", (HIDDEN,)).clone())   # replicated
        for p, dim in ((self.col_weight, 0), (self.col_bias, 0), (self.row_weight, 1)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1   # Megatron's tags

    def forward(self, x):
        group = self.mpu.get_tensor_model_parallel_group()
        h = _CopyToTensor.apply(self.norm(x), group)
        h = nn.functional.gelu(nn.functional.linear(h, self.col_weight, self.col_bias))
        out = _ReduceFromTensor.apply(nn.functional.linear(h, self.row_weight), group)
        return x + out + self.row_bias


class AutoBlock(nn.Module):
    """x + down(gelu(up(LayerNorm(x)))) with plain Linear layers: AutoTP's automatic plan makes
    `mlp.up_proj` column- and `mlp.down_proj` row-parallel ([Note: AutoTP in pipeline stages])."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.up_proj, self.mlp.down_proj = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        with torch.no_grad():
            self.mlp.up_proj.weight.copy_(_full(layer, "col_w", (FFN, HIDDEN)))
            self.mlp.up_proj.bias.copy_(_full(layer, "col_b", (FFN,)))
            self.mlp.down_proj.weight.copy_(_full(layer, "row_w", (HIDDEN, FFN)))
            self.mlp.down_proj.bias.copy_(_full(layer, "row_b", (HIDDEN,)))

    def forward(self, x):
        return x + self.mlp.down_proj(nn.functional.gelu(self.mlp.up_proj(self.norm(x))))


class Embed(nn.Embedding):
    def __init__(self) -> None:
        super().__init__(VOCAB, HIDDEN)
        with torch.no_grad():
            self.weight.copy_(_full(100, "embed", (VOCAB, HIDDEN)))


class Head(nn.Linear):
    def __init__(self) -> None:
        super().__init__(HIDDEN, VOCAB)
        with torch.no_grad():
            self.weight.copy_(_full(101, "head_w", (VOCAB, HIDDEN)))
            self.bias.copy_(_full(101, "head_b", (VOCAB,)))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


class _FullMPU:
    """A tensor size of 1: the reference builds the unsharded blocks with it."""

    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_rank(self):
        return 0

    def get_tensor_model_parallel_group(self):
        return None


def reference_model(autotp: bool = False) -> nn.Sequential:
    blocks = [AutoBlock(i) if autotp else TensorBlock(i, _FullMPU()) for i in range(NUM_BLOCKS)]
    return nn.Sequential(Embed(), *blocks, Head())


def reference(steps: int, micro: int, gas: int, dp: int, clip: float, autotp: bool = False):
    """Plain PyTorch on the unsharded model and the same global batch: (losses, norms, params)."""
    model = reference_model(autotp)   # tensor size 1: the group is None and f / g do nothing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        ids, labels = global_batch(step, micro * gas * dp)
        loss = loss_fn(model(ids), labels)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def global_batch(step: int, size: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)


def micro_batches(step: int, replica: int, micro: int, gas: int, dp: int):
    ids, labels = global_batch(step, micro * gas * dp)
    return [(ids[s:s + micro], labels[s:s + micro])
            for s in ((replica * gas + k) * micro for k in range(gas))]


def train(pp: int, mp: int, micro: int, gas: int, zero: int, steps: int, clip: float, ckpt_dir: str | None = None,
          save_at: int = 0, autotp: bool = False, universal: str | None = None, start: int = 0,
          load_universal: bool = True):
    """Train 3-D; returns (losses, norms, this rank's params by reference name, meta). With
    `ckpt_dir`, save after `save_at` steps, then build a new engine, load and go on. With `autotp`
    the blocks are plain (AutoBlock) and `tensor_parallel.autotp_size` shards them in each stage.
    `universal`: first load that tag of `ckpt_dir` with `checkpoint.load_universal`, then train steps
    `start`..`steps`-1 (the global batches of those steps)."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = ds_comm.get_world_size() // (pp * mp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)
    holder: dict = {}

    class Block(TensorBlock):   # built inside the PipelineModule, on its grid (the mpu)
        def __init__(self, layer):
            super().__init__(layer, holder["mpu"])

    class LazyMPU:   # Megatron's mpu answers from the topology; the group once the grid exists
        def get_tensor_model_parallel_world_size(self):
            return mp

        def get_tensor_model_parallel_rank(self):
            return topo.get_coord(ds_comm.get_rank()).model

        def get_tensor_model_parallel_group(self):
            return holder["module"].mpu().get_slice_parallel_group()

    holder["mpu"] = LazyMPU()
    cfg = {"train_batch_size": micro * gas * dp, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": zero}}
    if autotp:
        cfg["tensor_parallel"] = {"autotp_size": mp}
    if universal is not None and load_universal:
        cfg["checkpoint"] = {"load_universal": True}

    def build():
        block = AutoBlock if autotp else Block
        specs = [LayerSpec(Embed)] + [LayerSpec(block, i) for i in range(NUM_BLOCKS)] + [LayerSpec(Head)]
        model = holder["module"] = PipelineModule(specs, topology=topo, loss_fn=loss_fn, partition_method="uniform")
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,   # upstream: no mpu= with a PipelineModule
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        return engine

    engine = build()
    grid = engine.grid
    replica, tp_rank = grid.get_data_parallel_id(), grid.get_slice_parallel_rank()
    losses, norms = [], []
    if universal is not None:
        engine.load_checkpoint(ckpt_dir, tag=universal)
    for step in range(start, steps):
        if ckpt_dir and universal is None and step == save_at:
            engine.save_checkpoint(ckpt_dir, tag="mid")
            engine.destroy()
            engine = build()
            engine.load_checkpoint(ckpt_dir, tag="mid")
        losses.append(float(engine.train_batch(iter(micro_batches(step, replica, micro, gas, dp)))))
        norms.append(engine.get_global_grad_norm())
    # this rank's slices under the reference's names ("<layer index>.<param>")
    params = {}
    for name, p in engine.module.named_parameters():
        params[name] = p.detach().clone()
    meta = {"stage": engine.stage_id, "tp_rank": tp_rank, "tp": mp, "replica": replica}
    engine.destroy()
    return losses, norms, params, meta


def autotp_without_model_axis():
    """`autotp_size` 2 on a PipelineModule whose topology has no model axis: refused, naming both."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    model = PipelineModule([LayerSpec(Embed), LayerSpec(AutoBlock, 0), LayerSpec(Head)], num_stages=1,
                           loss_fn=loss_fn)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    except ValueError as error:
        return str(error)
    return None


class MegatronMPU:
    """A Megatron-style mpu for tensor x data without a pipeline (tensor peers consecutive, as
    Megatron lays them out): what Megatron-DeepSpeed passes as `deepspeed.initialize(mpu=...)`."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.rank = tp, rank
        self._tensor = self._data = None
        for start in range(0, world, tp):   # every rank creates every group, in one order
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._tensor, self._tensor_ranks = group, ranks
        for lane in range(tp):
            ranks = list(range(lane, world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._data, self._data_ranks = group, ranks

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_tensor_model_parallel_rank(self):
        return self._tensor_ranks.index(self.rank)

    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_tensor_model_parallel_group(self):
        return self._tensor

    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_world_size(self):
        return len(self._data_ranks)

    def get_data_parallel_rank(self):
        return self._data_ranks.index(self.rank)

    def get_data_parallel_group(self):
        return self._data


def train_mpu(tp: int, micro: int, zero: int, steps: int, clip: float, ckpt_dir: str | None = None,
              save_at: int | None = None, start: int = 0):
    """Megatron-style tensor layers x data on a client mpu, no pipeline (Megatron-DeepSpeed without
    pipeline parallelism): returns (losses, norms, this rank's params by reference name, meta).
    `ckpt_dir`: save tag "mid" there before step `save_at`; with `start`, load it first and train from there."""
    import deepspeed

    mpu = MegatronMPU(tp)
    dp = mpu.get_data_parallel_world_size()
    model = nn.Sequential(Embed(), *[TensorBlock(i, mpu) for i in range(NUM_BLOCKS)], Head())
    cfg = {"train_batch_size": micro * dp, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": zero}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu, model_parameters=model.parameters())
    losses, norms = [], []
    if ckpt_dir is not None and start:
        engine.load_checkpoint(ckpt_dir, tag="mid")
    for step in range(start, steps):
        if ckpt_dir is not None and step == save_at:
            engine.save_checkpoint(ckpt_dir, tag="mid")
        (ids, labels), = micro_batches(step, mpu.get_data_parallel_rank(), micro, 1, dp)
        loss = loss_fn(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
        norms.append(engine.get_global_grad_norm())
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    meta = {"tp_rank": mpu.get_tensor_model_parallel_rank(), "tp": tp}
    engine.destroy()
    return losses, norms, params, meta
