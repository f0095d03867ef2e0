"""Jobs for the engine under AutoTP tensor parallelism: each TP rank holds slices of its replica's
Linear layers and sees its replica's micro-batch; the result must equal one process training the
unsharded model on the same global batch (SGD, so gradient scale errors show in the parameters)."""

from __future__ import annotations

import copy

import torch
from torch import nn

VOCAB, HIDDEN, SEQ = 32, 16, 6
MLP_KINDS = ("mlp", "glu")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(h)))


class _GluBlock(nn.Module):
    """gate and up fused in one Linear ([gate; up] on the output features), as Phi-3's gate_up_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


# layer_specs for "glu": the fused gate_up split block by block (shape [2, -1]), down row-parallel
GLU_SPECS = {"partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*gate_up\.weight$"], "partition_type": "column", "shape": [2, -1]},
    {"patterns": [r".*down\.weight$"], "partition_type": "row"}]}}


class TinyMLPLM(nn.Module):
    """Embedding -> LayerNorm -> MLP block (column up, row down by the automatic rule) -> lm_head (whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.block = _Block()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.checkpoint_block = False   # deepspeed.checkpointing around the TP pair (recomputed in backward)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.checkpoint_block:
            import deepspeed

            h = h + deepspeed.checkpointing.checkpoint(self.block, self.norm(h))
        else:
            h = h + self.block(self.norm(h))
        logits = self.lm_head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind in MLP_KINDS:
        model = TinyMLPLM()
        if kind == "glu":
            model.block = _GluBlock()
        return model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "qwen3":   # its tp_plan keeps q_norm/k_norm whole: replicated_with_grad_allreduce
        config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64)
        config._attn_implementation = "eager"
        return Qwen3ForCausalLM(config)
    kv = 1 if kind == "llama-kv1" else 2   # llama-kv1: a KV head count that tp=2 does not divide
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def make_data(steps: int, batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def _loss(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind in MLP_KINDS:
        return model(ids, ids.roll(-1, dims=1))
    return model(input_ids=ids, labels=ids).loss


def reference(kind: str, steps: int, dp: int, micro: int, lr: float, clip: float, momentum: float = 0.0) -> dict:
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses, norms = [], []
    for ids in make_data(steps, dp * micro):
        opt.zero_grad()
        for d in range(dp):
            loss = _loss(model, kind, ids[d * micro:(d + 1) * micro])
            (loss / dp).backward()
            losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms, "losses": losses}


def train_tp(kind: str, steps: int, tp: int, stage: int, micro: int = 2, lr: float = 0.5, clip: float = 0.0,
             via_init: bool = False, count_bytes: bool = False, save_dir: str | None = None,
             load_dir: str | None = None, extra: dict | None = None, start: int = 0, momentum: float = 0.0,
             save_16bit: str | None = None, checkpoint_block: bool = False, accumulate: int = 1,
             perturb: float = 0.0, adam: bool = False, load_kwargs: dict | None = None,
             report_state: bool = False, freeze: str | None = None) -> dict:
    """Every rank: its replica's micro-batches (`accumulate` of them, consecutive rows of the global batch).
    `via_init`: shard with deepspeed.tp_model_init first (transformers' way), else by the config alone.
    `perturb`: TP rank 1 adds this to every gradient of its replicated parameters (a nondeterministic kernel's
    last-bit difference, magnified). Each engine.step()'s all-reduces are recorded (`step_reduces`).
    `adam`: torch AdamW (weight decay 0.01) instead of SGD. `report_state`: this rank's optimizer state at the
    end, {(name, start of its piece): {field: value}}. `freeze`: this parameter does not train."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.module_inject.layers import GatherReplacedLayerParams, is_tensor_parallel
    from deepspeed.utils import groups

    model = build(kind)
    model.checkpoint_block = checkpoint_block
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    if freeze is not None:
        model.get_parameter(freeze).requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": clip,
              "gradient_accumulation_steps": accumulate,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
              "tensor_parallel": {"autotp_size": tp, **(GLU_SPECS if kind == "glu" else {})}}
    config.update(copy.deepcopy(extra or {}))
    if via_init:
        model = deepspeed.tp_model_init(model, tp_size=tp, dtype=torch.float32, config=config)
    if adam:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    else:   # made before the config path shards: same params
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if load_dir is not None:
        engine.load_checkpoint(load_dir, **(load_kwargs or {}))
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    rows = torch.utils.data.TensorDataset(torch.arange(64.0).view(32, 2))
    first_batch = next(iter(engine.deepspeed_io(rows)))[0].tolist()   # this replica's first micro-batch
    assert dp == dist.get_world_size() // tp and engine.train_batch_size() == micro * dp * accumulate
    counted: list[tuple[str, int]] = []
    if count_bytes:
        real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            counted.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
            return real(tensor, *args, **kwargs)

    if perturb and dist.get_rank() % tp == 1:
        for p in engine.module.parameters():
            if not is_tensor_parallel(p):
                p.register_hook(lambda grad: grad + perturb)
    losses, norms, step_reduces = [], [], []
    for ids in make_data(start + steps, dp * micro * accumulate)[start:]:
        for j in range(accumulate):
            first = (dp_rank * accumulate + j) * micro
            x = ids[first:first + micro]
            if count_bytes:
                dist.all_reduce = counting
            try:
                loss = engine(x, x.roll(-1, dims=1)) if kind in MLP_KINDS else engine(input_ids=x, labels=x).loss
                engine.backward(loss)
            finally:
                dist.all_reduce = real if count_bytes else dist.all_reduce
            dist.comms_counter.reset()
            dist.comms_counter.keep_records = True
            engine.step()
            dist.comms_counter.keep_records = False
            step_reduces.append([(r.nbytes, r.dtype) for r in dist.comms_counter.records if r.op == "all_reduce"])
            losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="tp")
    if save_16bit is not None:
        engine.save_16bit_model(save_16bit)
    state = _optimizer_state(engine) if report_state else None
    local = {n: p.numel() for n, p in engine.module.named_parameters()}
    sharded = {n for n, p in engine.module.named_parameters() if is_tensor_parallel(p)}
    params = list(engine.module.parameters())
    with GatherReplacedLayerParams(params, engine.module, enabled=True):
        full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = {n: p.numel() for n, p in engine.module.named_parameters()}
    return {"params": full, "losses": losses, "norms": norms, "local_numel": local,
            "full_numel": full_numel, "after_numel": after, "sharded": sorted(sharded), "bytes": counted,
            "tensor_rank": dist.get_rank() % tp, "first_batch": first_batch, "step_reduces": step_reduces,
            "tp_src": groups.get_tensor_model_parallel_src_rank(), "state": state}


def _optimizer_state(engine) -> dict:
    from deepspeed.runtime.checkpoint.hp_state import HpState

    hp = HpState(engine._checkpoint_view())
    return {(p.name, p.start): {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                for k, v in hp.base.state.get(p.key, {}).items()} for p in hp.pieces}


MUON_CONFIG = {"type": "Muon", "params": {"lr": 3e-3, "muon_lr": 0.02, "momentum": 0.9, "weight_decay": 0.1,
                                          "betas": [0.9, 0.95], "eps": 1e-8, "ns_method": "standard"}}


def muon_with_tp(how: str, tp: int, stage: int, steps: int = 3, save_dir: str | None = None,
                 load_dir: str | None = None, start: int = 0) -> dict:
    """Muon with AutoTP, three ways in: the config's Muon + autotp_size ("config"), tp_model_init then the
    config's Muon ("tp_model_init"), tp_model_init then a client MuonWithAuxAdam ("client"); tp=1 is the
    unsharded run. Returns the whole parameters after each step and the all-gathers' bytes of the last.
    `save_dir`: save after the steps; `load_dir`: load first, then train on batches start..start+steps."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    model = build("mlp")
    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2 * tp // world * 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": copy.deepcopy(MUON_CONFIG), "tensor_parallel": {"autotp_size": tp}}
    optimizer = None
    if how != "config":
        model = deepspeed.tp_model_init(model, tp_size=tp, dtype=torch.float32)
        del config["tensor_parallel"]
    if how == "client":
        del config["optimizer"]
        params = MUON_CONFIG["params"]
        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
        others = [p for p in model.parameters() if all(p is not q for q in matrices)]
        optimizer = MuonWithAuxAdam([dict(params=matrices, use_muon=True, lr=params["muon_lr"], momentum=0.9,
                                          weight_decay=0.1, ns_method="standard"),
                                     dict(params=others, use_muon=False, lr=params["lr"], betas=(0.9, 0.95), eps=1e-8,
                                          weight_decay=0.1)])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if load_dir is not None:
        engine.load_checkpoint(load_dir, tag="muon")
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    history = []
    for ids in make_data(start + steps, 4)[start:]:
        x = ids[dp_rank * micro:(dp_rank + 1) * micro]
        dist.comms_counter.reset()
        engine.backward(engine(x, x.roll(-1, dims=1)))
        engine.step()
        gathered = dist.comms_counter.summary().get("all_gather", {}).get("bytes", 0)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3), \
                GatherReplacedLayerParams(params, engine.module, enabled=True):
            history.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="muon")
    return {"history": history, "gathered": gathered, "sliced": sorted(
        n for n, p in engine.module.named_parameters() if getattr(p, "use_muon", False) and p.ndim == 2)}


def tp_model_init_rules() -> dict:
    """Upstream's tp_model_init/initialize merge rules and `groups._init_tp_mesh_device`, on 4 ranks."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    def raised(fn) -> str:
        try:
            fn()
        except Exception as exc:   # noqa: BLE001 - the test checks the message
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def ranks(group) -> list[int]:
        return sorted(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))

    base = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "zero_optimization": {"stage": 0}}
    out = {}
    data, tensor = groups._init_tp_mesh_device(tensor_model_parallel_size=2)
    out["mesh"] = (ranks(data), ranks(tensor), ranks(groups.get_tensor_model_parallel_group()))
    # a model the automatic rule leaves whole (one Linear alone in its parent): the recorded tp_size still applies
    model = deepspeed.tp_model_init(nn.Sequential(nn.Linear(4, 4)), tp_size=2, dtype=torch.float32)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(base))[0]
    out["recorded"] = (engine.autotp_size(), groups.get_data_parallel_world_size())
    # upstream's per-parameter gather and re-cut (`param.gather_params([param])`, `param._tp_partition`)
    whole = build("mlp")
    want = whole.block.up.weight.detach().clone()
    sharded = deepspeed.tp_model_init(whole, tp_size=2, dtype=torch.float32)
    weight = sharded.block.up.weight
    storage, shard = weight.data.data_ptr(), weight.detach().clone()
    weight.gather_params([weight])
    gathered = torch.equal(weight.data, want)
    weight.data.mul_(2)   # an update made while whole is kept in the slice
    weight._tp_partition([weight])
    out["gather"] = (gathered, weight.data.data_ptr() == storage, torch.equal(weight.data, 2 * shard))
    own = dist.new_group(ranks=[dist.get_rank()])   # (every rank creates every group, in one order)
    mine = [dist.new_group(ranks=[r]) for r in range(4)][dist.get_rank()]
    del own

    class Mpu:   # a client mpu (never reached: the conflict is refused first)
        pass

    model = deepspeed.tp_model_init(nn.Linear(4, 4), tp_size=1, dtype=torch.float32, tp_group=mine)
    out["tp_group_and_mpu"] = raised(lambda: deepspeed.initialize(model=model, config=dict(base), mpu=Mpu(),
                                                                  model_parameters=model.parameters()))
    model = deepspeed.tp_model_init(nn.Linear(4, 4), tp_size=1, dtype=torch.float16)
    out["dtype"] = raised(lambda: deepspeed.initialize(model=model, config={**base, "bf16": {"enabled": True}},
                                                       model_parameters=model.parameters()))
    return out


def tp_input_check() -> list[str]:
    """The first forward under AutoTP compares the TP ranks' inputs: different ones raise on every rank;
    equal ones pass (and the check is gone after that)."""
    import deepspeed
    import deepspeed.comm as dist

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": 2}}
    out = []
    for offset in (dist.get_rank(), 0):
        engine = deepspeed.initialize(model=build("mlp"), config=config, optimizer=None,
                                      model_parameters=None)[0]
        ids = (make_data(1, 2)[0] + offset) % VOCAB
        try:
            engine(ids, ids)
            engine((ids + dist.get_rank()) % VOCAB, ids)   # checked once: a later difference is not looked at
            out.append("ok")
        except AssertionError as exc:
            out.append(str(exc))
    return out


def replicated_sync_direct(mismatch: bool) -> list:
    """ReplicatedGradSync over the world as a TP group of 2: a replicated gradient (1 on rank 0, 3 on rank 1)
    becomes 2 on both, a sharded one is left alone, one marked as a per-peer partial (auto_ep_folding)
    becomes their sum 4; with `mismatch` rank 1's replicated parameter has another shape, and the
    first-step check raises on both ranks. Returns the grads or the error."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep_folding import mark_autoep_folding_partial_router_parameter
    from deepspeed.runtime.tensor_parallel.replicated_grads import ReplicatedGradSync

    rank = dist.get_rank()
    whole = nn.Parameter(torch.zeros(2, 2) if mismatch and rank == 1 else torch.zeros(4))
    sharded = nn.Parameter(torch.zeros(3))
    sharded.tensor_model_parallel = True   # what AutoTP marks its slices with (layers.is_tensor_parallel)
    partial = nn.Parameter(torch.zeros(2))
    mark_autoep_folding_partial_router_parameter(partial)
    grads = [torch.full((4,), 1.0 + 2 * rank), torch.full((3,), float(rank)), torch.full((2,), 1.0 + 2 * rank)]
    sync = ReplicatedGradSync(None, dist.get_world_size(), {id(whole): "whole.weight"})
    try:
        sync.average([(grads[0], whole, 0), (grads[1], sharded, 0), (grads[2], partial, 0)], torch.device("cpu"))
    except RuntimeError as exc:
        return [str(exc)]
    return [g.tolist() for g in grads]
