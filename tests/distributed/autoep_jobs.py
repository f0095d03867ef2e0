"""AutoEP jobs (run on every rank by run_distributed): tiny Mixtral and Qwen3-MoE models built
locally, their experts swapped by AutoEP, against the same model unsharded.

`block_run` checks the swapped model directly (no engine): logits, the HF aux loss and, after
reducing gradients by hand (dense over the world, experts over their expert-data-parallel group,
then gathered over the EP group), the gradients of the sum of every rank's loss equal the unsharded
model's on all ranks' batches. `train_run` trains through deepspeed.initialize with the
`expert_parallel` section (or without it: the baseline) and returns the whole weights
(state_dict(): the HF layout) and, with `save`, checks save_16bit_model's file loads into a plain
HF model."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

VOCAB, SEQ, MICRO = 64, 6, 2


def build(kind: str, experts: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=32, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False)
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=8, num_local_experts=experts, **common)
        model = MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(intermediate_size=12, moe_intermediate_size=8, num_experts=experts,
                             decoder_sparse_step=1, norm_topk_prob=False, **common)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind in ("deepseek_v2", "deepseek_v3"):   # layer 0 dense (first_k_dense_replace), layer 1 MoE + shared
        import transformers

        cfg_class = transformers.DeepseekV3Config if kind == "deepseek_v3" else transformers.DeepseekV2Config
        extra = {"n_group": 2, "topk_group": 1} if kind == "deepseek_v3" else {}
        cfg = cfg_class(intermediate_size=12, moe_intermediate_size=8, n_routed_experts=experts, n_shared_experts=1,
                        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, **extra,
                        **{k: v for k, v in common.items() if k not in ("output_router_logits", "router_aux_loss_coef", "head_dim")})
        model = (transformers.DeepseekV3ForCausalLM if kind == "deepseek_v3" else transformers.DeepseekV2ForCausalLM)(cfg)
    else:
        raise ValueError(kind)
    import deepspeed

    experts = [p for name, p in model.named_parameters() if "experts" in name]
    zero_init = hasattr(experts[0], "ds_id")
    # HF leaves the fused experts at torch.empty until post_init's init: make them sane. Under zero.Init
    # (no HfDeepSpeedConfig here) post_init ran on placeholders: run it again on the whole tensors, rank
    # 0's values kept, as transformers does under ZeRO-3.
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0, enabled=zero_init), \
            torch.no_grad():
        if zero_init:   # (init_weights skips modules post_init marked as done: the routers are still empty)
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.02)
        for p in experts:
            p.normal_(0.0, 0.3)
    model.config._attn_implementation = "eager"
    return model.float()


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _ep_info(ep: int) -> tuple:
    from deepspeed.utils import groups

    name = f"ep_size_{ep}"
    return (groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name))


def block_run(kind: str, ep: int, seed: int = 0) -> dict:
    """Forward, aux loss and gradients of the swapped model vs the unsharded one (no engine)."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep import apply_autoep
    from deepspeed.module_inject.auto_ep_layer import autoep_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build(kind, seed=seed)
    model = copy.deepcopy(ref)
    apply_autoep(model, {"preset_model": kind}, ep)
    layers = autoep_layers(model)
    ids = batch(0, rank)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    want = ref(input_ids=ids, labels=ids)
    aux = getattr(out, "aux_loss", None)
    result = {"logits": (out.logits - want.logits).abs().max().item(),
              "aux": abs(aux.item() - want.aux_loss.item()) if aux is not None else None,
              "aux_value": aux.item() if aux is not None else None,
              "local_experts": [layer.num_local_experts for layer in layers],
              "shapes": {n: tuple(p.shape) for n, p in model.named_parameters() if "experts" in n}}
    for r in range(world):   # the reference: the gradient of the sum of every rank's loss
        ids_r = batch(0, r)
        ref(input_ids=ids_r, labels=ids_r).loss.backward()
    ep_group, edp_group = _ep_info(ep)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if getattr(p, "allreduce", True):
            dist.all_reduce(g, group=None)
        else:
            dist.all_reduce(g, group=edp_group)
            parts = [torch.empty_like(g) for _ in range(ep)]
            dist.all_gather(parts, g.contiguous(), group=ep_group)
            g = torch.cat(parts)
        grads[name] = g
    ref_grads = dict(ref.named_parameters())
    result["grad_err"] = max((grads[n] - ref_grads[n].grad).abs().max().item() for n in grads)
    result["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    result["full_equal"] = all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    return result


def train_steps(engine: Any, steps: int, data_rank: int, first: int = 0) -> dict:
    """`steps` engine steps (batches `first`, `first` + 1, ...) on this data rank's batches: {"losses",
    "norms"} per step."""
    losses, norms = [], []
    for step in range(first, first + steps):
        ids = batch(step, data_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


def train_run(kind: str, ep: int, steps: int, stage: int = 1, save: str = "", zero_init: bool = False) -> dict:
    """`steps` SGD steps through the engine (ep=0: no expert_parallel section); whole weights.
    `zero_init`: the model is built under deepspeed.zero.Init (partitioned placeholders)."""
    import deepspeed
    import deepspeed.comm as dist

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": kind}
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=zero_init):
        model = build(kind)
    if zero_init:
        assert any(hasattr(p, "ds_id") for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    result = train_steps(engine, steps, rank)
    if stage == 3:   # whole weights: gather every unit (experts over their EDP group), then state_dict()
        result["pieces"] = {n: (p.ds_numel, p.ds_tensor.numel()) for n, p in engine.module.named_parameters()}
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            result["state"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
        # save_16bit_model gathers the units, then each expert tensor over the EP group: the whole HF layout
        result["sd16"] = engine._zero3_consolidated_16bit_state_dict()
        dist.barrier()
        return result
    result["state"] = {k: v.clone() for k, v in engine.module.state_dict().items()}   # collective under AutoEP
    state = result["state"]
    if save:
        engine.save_16bit_model(save)
        if rank == 0:
            plain = build(kind, seed=123)
            saved = torch.load(os.path.join(save, "pytorch_model.bin"), weights_only=True)
            missing, unexpected = plain.load_state_dict(saved, strict=True)
            result["loaded_equal"] = all(torch.equal(plain.state_dict()[k], v) for k, v in state.items())
    dist.barrier()
    return result


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_run(kind: str, out: str, ep: int, steps: int = 4, save_steps: int = 0, resume: str = "") -> dict:
    """The HF Trainer, unchanged, with `expert_parallel` in its DeepSpeed config (ep=0: without);
    save_model writes the HF layout (Accelerate's get_state_dict -> module.state_dict() on every rank)."""
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state()
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**6}
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}   # preset from config.model_type
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=steps, learning_rate=1e-2,
                             max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             report_to=[], deepspeed=config, use_cpu=True, dataloader_drop_last=True, seed=0)
    trainer = Trainer(model=build(kind), args=args, train_dataset=_Data(32))
    trainer.train(resume_from_checkpoint=resume or None)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    from deepspeed.module_inject.auto_ep_layer import autoep_layers

    swapped = len(autoep_layers(trainer.model))
    trained = {k: v.float().clone() for k, v in trainer.model.state_dict().items()}   # collective under AutoEP
    trainer.save_model(out)
    if trainer.args.process_index != 0:
        return {"losses": losses, "saved": {}, "swapped": swapped}
    from safetensors.torch import load_file

    from transformers import AutoModelForCausalLM

    saved = load_file(os.path.join(out, "model.safetensors"))   # HF's on-disk layout (its save conversion)
    plain = AutoModelForCausalLM.from_pretrained(out)   # a plain HF model loads it
    loaded = {k: v.float() for k, v in plain.state_dict().items()}
    return {"losses": losses, "saved": {k: v.float() for k, v in saved.items()}, "swapped": swapped,
            "loaded": loaded, "trained": trained}


def empty_run(kind: str, tokens_by_rank: list[int]) -> dict:
    """One swapped experts module called directly, every token routed to experts 0 and 1 (EP rank 0's):
    EP rank 1 receives nothing, a rank with 0 tokens sends nothing; every rank still takes part in
    every collective. Outputs and the gradients of the sum of the ranks' outputs equal HF's module."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep import apply_autoep

    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model = build(kind)
    model = copy.deepcopy(ref_model)
    apply_autoep(model, {"preset_model": kind}, 2)
    layer, ref = model.model.layers[0].mlp.experts, ref_model.model.layers[0].mlp.experts

    def inputs(r: int) -> tuple:
        g = torch.Generator().manual_seed(r)
        n = tokens_by_rank[r]
        hidden = torch.randn(n, 16, generator=g)
        index = torch.stack([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)], dim=1)
        weights = torch.rand(n, 2, generator=g)
        return hidden, index, weights

    hidden, index, weights = inputs(rank)
    hidden.requires_grad_(True)
    out = layer(hidden, index, weights)
    out.sum().backward()
    want = ref(hidden.detach(), index, weights)
    for r in range(world):
        h, i, w = inputs(r)
        ref(h, i, w).sum().backward()
    ep_group, edp_group = _ep_info(2)
    errs = []
    for name in ("gate_up_proj", "down_proj"):
        g = getattr(layer, name).grad
        got_grad = g is not None
        g = g.clone() if g is not None else torch.zeros_like(getattr(layer, name))
        dist.all_reduce(g, group=edp_group)
        parts = [torch.empty_like(g) for _ in range(2)]
        dist.all_gather(parts, g, group=ep_group)
        errs.append((torch.cat(parts) - getattr(ref, name).grad).abs().max().item())
    return {"out": (out - want).abs().max().item() if len(out) else 0.0, "rows": len(out),
            "grad_err": max(errs), "has_grad": got_grad,
            "input_grad": hidden.grad is not None and tuple(hidden.grad.shape) == tuple(hidden.shape)}


def checkpoint_run(kind: str, save_dir: str, stage: int, save_ep: int, load_ep: int, steps: int = 3,
                   universal: bool = False, drop: str | None = None) -> dict:
    """Train `steps` (Adam), save_checkpoint at autoep_size `save_ep`, train `steps` more; a fresh engine at
    `load_ep` loads the checkpoint and trains the same `steps`: both runs' losses and whole weights.
    `universal`: rank 0 converts the tag with ds_to_universal (`drop`: then zeroes that optimizer field in
    every file) and the fresh engine loads the universal form (`checkpoint.load_universal`)."""
    import deepspeed
    import deepspeed.comm as dist

    def engine_at(ep: int, load_universal: bool = False) -> Any:
        model = build(kind)
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
                  "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                  "expert_parallel": {"enabled": True, "autoep_size": ep},
                  "checkpoint": {"load_universal": load_universal}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def train(engine: Any, first: int) -> list:
        return train_steps(engine, steps, dist.get_rank(), first)["losses"]

    engine = engine_at(save_ep)
    train(engine, 0)
    engine.save_checkpoint(save_dir, tag="t")
    at_save, state_at_save = whole_state(engine), hp_snapshot(engine)   # whole (HF layout); this rank's state
    consolidated, files = {}, sorted(os.listdir(os.path.join(save_dir, "t")))
    if dist.get_rank() == 0:   # zero_to_fp32 joins the experts' pieces into the whole HF tensors
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
        zero3 = os.path.join(save_dir, "t", "zero_pp_rank_0_mp_rank_00_model_states.pt")   # AutoEP ZeRO-3: per rank
        single = os.path.join(save_dir, "t", "mp_rank_00_model_states.pt")
        model_states = torch.load(zero3 if os.path.isfile(zero3) else single, weights_only=False)
        consolidated["ds_autoep_layers"] = model_states["ds_autoep_layers"]
        consolidated["param_shapes"] = model_states["param_shapes"]
        if universal:
            _universal_copy(os.path.join(save_dir, "t"), os.path.join(save_dir, "t_universal"), drop)
    dist.barrier()
    straight = train(engine, steps)
    whole = whole_state(engine)
    resumed = engine_at(load_ep, universal)
    resumed.load_checkpoint(save_dir, tag="t_universal" if universal else "t")
    state_loaded = hp_snapshot(resumed) if load_ep == save_ep else None
    again = train(resumed, steps)
    return {"straight": straight, "resumed": again, "whole": whole, "at_save": at_save, "consolidated": consolidated,
            "whole_resumed": whole_state(resumed), "files": files, "state_at_save": state_at_save,
            "state_loaded": state_loaded}


def hp_snapshot(engine: Any) -> dict:
    """This rank's fp32 masters and optimizer state, piece by piece, and the step (local): what a resume at
    the same layout must restore bit for bit."""
    from deepspeed.runtime.checkpoint.hp_state import HpState

    hp = HpState(engine._checkpoint_view())
    fields, step = hp.local_fields()
    return {"step": step, "fields": fields,
            "pieces": {(p.name, p.start): [hp.value(p, f).detach().float().cpu().clone() for f in ["fp32"] + fields]
                       for p in hp.pieces}}


def _universal_copy(tag: str, out: str, drop: str | None) -> None:
    from deepspeed.checkpoint.ds_to_universal import convert

    convert(tag, out)
    if drop is not None:
        for name in os.listdir(os.path.join(out, "zero")):
            path = os.path.join(out, "zero", name, f"{drop}.pt")
            if os.path.isfile(path):
                record = torch.load(path, weights_only=False)
                torch.save(dict(record, param=torch.zeros_like(record["param"])), path)


def whole_state(engine: Any) -> dict:
    """The whole module state dict (HF layout; collective): at ZeRO-3 inside a gather of every unit."""
    import contextlib

    import deepspeed

    gather = deepspeed.zero.GatheredParameters(list(engine.module.parameters())) if engine._stage3 is not None \
        else contextlib.nullcontext()
    with gather:
        return {k: v.clone() for k, v in engine.module.state_dict().items()}


def error_run(kind: str, section: dict, stage: int = 1) -> str:
    """deepspeed.initialize with a bad `expert_parallel` section: the error every rank raises."""
    import deepspeed

    model = build(kind)
    section = dict(section)
    zero = {"stage": stage, **section.pop("zero", {})}   # zero_optimization keys the case adds
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": zero,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "expert_parallel": {"enabled": True, **section}}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "initialized"


def bf16_run(kind: str) -> dict:
    """bf16 model, experts swapped at ep=2: rows and results cross gloo's all-to-all in bf16; outputs equal
    the unsharded bf16 model's up to bf16 rounding (expert matmuls see other row batches)."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep import apply_autoep

    ref = build(kind).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    apply_autoep(model, {}, 2)
    ids = batch(0, dist.get_rank())
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    want = ref(input_ids=ids, labels=ids)
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n]
    return {"logits": (out.logits.float() - want.logits.float()).abs().max().item(),
            "scale": want.logits.float().abs().max().item(), "loss": (out.loss.item(), want.loss.item()),
            "dtypes": sorted({str(g.dtype) for g in grads if g is not None}), "grads": sum(g is not None for g in grads)}


class _SelfComputingExperts(torch.nn.Module):
    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, ffn) * 0.3)


class SelfComputingBlock(torch.nn.Module):
    """A Mixtral-style block (softmax, top-2, renormalised) that indexes its fused experts itself, as
    remote-code models do: the experts swap cannot serve it, AutoEP replaces the whole block."""

    def __init__(self, experts: int = 4, hidden: int = 16, ffn: int = 8) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = _SelfComputingExperts(experts, hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.gate(flat), dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.gate.out_features):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = (flat[token] @ self.experts.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ self.experts.down_proj[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.reshape(x.shape)


class SelfComputingMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        torch.manual_seed(0)
        self.config = SimpleNamespace(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.model.layers:
            layer.mlp = SelfComputingBlock()
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.model.layers:
            x = x + layer.mlp(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def self_computing_run(ep: int, steps: int) -> dict:
    """SGD through the engine on SelfComputingMoE (ep=0: no expert_parallel section)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    model = SelfComputingMoE()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(steps):
        loss = engine(batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    return {"losses": losses, "state": {k: v.clone() for k, v in engine.module.state_dict().items()},
            "local_experts": [m.experts.w1.shape[0] for m in layers]}


def deepspeed_autoep_zero3_run(fixture: str) -> dict:
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 checkpoint (tests/fixtures/ds_0_19_8_autoep_zero3) loaded into the same
    model here (ZeRO-3, ep 2): this rank's optimizer state as save_checkpoint would write it now, DeepSpeed's
    file for this rank, the whole weights, the step count and one more step's loss."""
    import sys

    import deepspeed
    import deepspeed.comm as dist

    sys.path.insert(0, fixture)
    import autoep_model

    engine, *_ = deepspeed.initialize(model=autoep_model.Model(), config=autoep_model.config())
    # strict (the default): its module state's router alias mlp.gate.gate.weight, equal to
    # mlp.router.gate.weight, is accepted ([Note: AutoEP router alias])
    engine.load_checkpoint(os.path.join(fixture, "ckpt"), tag="t")
    rank = dist.get_rank()
    mine = engine._optimizer_partition_state()
    theirs = torch.load(os.path.join(fixture, "ckpt", "t", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                        weights_only=False)["optimizer_state_dict"]
    whole = whole_state(engine)
    loss = engine(autoep_model.batch(2, rank))
    engine.backward(loss)
    engine.step()
    keys = ("fp32_flat_groups", "ds_zero_partition_groups", "partition_count")
    return {"mine": {k: mine[k] for k in keys}, "theirs": {k: theirs[k] for k in keys},
            "state": (mine["optimizer_state_dict"]["state"], theirs["optimizer_state_dict"]["state"]),
            "whole": whole, "steps": engine.global_steps, "loss": loss.item()}


def deepspeed_autoep_zero3_universal_run(fixture: str, out: str, ep: int) -> dict:
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 checkpoint converted by our ds_to_universal (rank 0), loaded strictly with
    load_universal at autoep_size `ep` (its module state's router alias entries dropped): the whole weights."""
    import sys

    import deepspeed
    import deepspeed.comm as dist

    sys.path.insert(0, fixture)
    import autoep_model

    if dist.get_rank() == 0:
        from deepspeed.checkpoint.ds_to_universal import convert

        convert(os.path.join(fixture, "ckpt", "t"), os.path.join(out, "t_universal"))
    dist.barrier()
    config = dict(autoep_model.config(ep), checkpoint={"load_universal": True})
    engine, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
    engine.load_checkpoint(out, tag="t_universal")
    return whole_state(engine)


def frozen_expert_save_run(save_dir: str) -> str:
    """AutoEP at ZeRO-3 with one expert tensor frozen: what save_checkpoint raises on this rank."""
    import deepspeed
    import deepspeed.comm as dist

    model = build("mixtral")
    model.model.layers[0].mlp.experts.gate_up_proj.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "expert_parallel": {"enabled": True, "autoep_size": 2}}
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    ids = batch(0, dist.get_rank())
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except Exception as exc:   # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def expert_count_mismatch_run(save_dir: str, stage: int) -> str:
    """Save AutoEP Mixtral with 4 experts (ep 2), load into the same model with 8: what load raises here."""
    import deepspeed
    import deepspeed.comm as dist

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "expert_parallel": {"enabled": True, "autoep_size": 2}}
    engine = deepspeed.initialize(model=build("mixtral"), config=config)[0]
    ids = batch(0, dist.get_rank())
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    other = deepspeed.initialize(model=build("mixtral", experts=8), config=config)[0]
    try:
        other.load_checkpoint(save_dir, tag="t")
    except ValueError as exc:   # the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:   # noqa: BLE001
        return f"not a ValueError: {type(exc).__name__}: {exc}"
    return "loaded"
