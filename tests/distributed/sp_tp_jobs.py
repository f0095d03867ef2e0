"""Jobs for Ulysses/ALST sequence parallelism with AutoTP tensor parallelism on one mesh ([Note: SP x TP]
in deepspeed/runtime/sequence_parallel/ulysses_sp.py): the tiny HF Llama of sp_models_jobs, its sdpa
attention routed through ALST and its Linear layers sharded by `tensor_parallel.autotp_size`, against
one process on the unsharded model and the same global batch (`sp_models_jobs.llama_reference`)."""

from __future__ import annotations

import math

import torch

from sp_engine_jobs import all_gather
from sp_models_jobs import _ce, _engine_config, _llama_forward, llama_data, new_llama


def train_llama_sp_tp(steps: int, sp: int, tp: int, stage: int, micro: int = 2, lr: float = 0.5,
                      clip: float = 1.0, tp_first: bool = False) -> dict:
    """Every rank: ALST registered before `deepspeed.initialize` (which adds the tensor dim to its mesh),
    the adapter's shards of its replica's batches over the sequence group, HF's loss join. `tp_first`:
    `deepspeed.tp_model_init` shards the model before ALST registers. Returns per-step losses and clipped
    norms, the whole final weights (GatherReplacedLayerParams) and the groups' ranks."""
    import deepspeed.comm as ds_comm
    from deepspeed.module_inject.layers import is_tensor_parallel
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups.mpu = None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        config = {**_engine_config(micro, sp, stage, lr, clip, "fp32"), "tensor_parallel": {"autotp_size": tp}}
        engine, loader, group = _sp_tp_engine(config, steps, tp_first=tp_first)
        losses, norms = _train(engine, loader, group, steps)
        sharded = sorted(n for n, p in engine.module.named_parameters() if is_tensor_parallel(p))
        return {"losses": losses, "norms": norms, "params": _whole(engine), "dp_rank": engine.get_data_parallel_rank(),
                "sharded": sharded,
                "sp_ranks": sorted(ds_comm.get_global_rank(group, r) for r in range(ds_comm.get_world_size(group))),
                "tp_ranks": sorted(ds_comm.get_global_rank(groups.get_tensor_model_parallel_group(), r)
                                   for r in range(groups.get_tensor_model_parallel_world_size())),
                "zero_ranks": engine.seq_dp_world_size}
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None


def sp_tp_resume(stage: int, save_dir: str, before: int = 2, after: int = 2, sp: int = 2, tp: int = 2) -> dict:
    """sp x tp at ZeRO `stage` with AdamW: train `before` steps, save_checkpoint, train `after` more (the
    uninterrupted run); a fresh engine (ALST registered again) loads the checkpoint and trains the same
    `after` steps. Returns both runs' losses and whole weights, the weights at the save and (rank 0)
    zero_to_fp32's state dict of the checkpoint."""
    import deepspeed.comm as ds_comm
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = {**_engine_config(2, sp, stage, 0.0, 1.0, "fp32"), "tensor_parallel": {"autotp_size": tp},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    out: dict = {}
    try:
        groups.mpu = None
        engine, loader, group = _sp_tp_engine(config, before + after)
        batches = iter(loader)
        _train(engine, batches, group, before)
        engine.save_checkpoint(save_dir, tag="t")
        engine.wait_for_checkpoint()
        out["at_save"] = _whole(engine)
        out["straight"] = _train(engine, batches, group, after)[0]
        out["whole"] = _whole(engine)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None
        resumed, loader, group = _sp_tp_engine(config, before + after, first=before)
        out["path"] = resumed.load_checkpoint(save_dir, tag="t")[0]
        out["loaded"] = _whole(resumed)
        out["resumed"] = _train(resumed, loader, group, after)[0]
        out["whole_resumed"] = _whole(resumed)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None
    if ds_comm.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out["consolidated"] = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
    ds_comm.barrier()
    return out


def sp_tp_load(stage: int, save_dir: str, tp: int, before: int = 2, after: int = 2, sp: int = 2) -> dict:
    """sp x `tp` at ZeRO `stage` (AdamW): a fresh engine loads tag "t" of `save_dir` (saved at any tensor
    size by sp_tp_resume) and trains the `after` steps that follow: the whole weights loaded, the losses."""
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = {**_engine_config(2, sp, stage, 0.0, 1.0, "fp32"), "tensor_parallel": {"autotp_size": tp},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        groups.mpu = None
        engine, loader, group = _sp_tp_engine(config, before + after, first=before)
        engine.load_checkpoint(save_dir, tag="t")
        return {"loaded": _whole(engine), "resumed": _train(engine, loader, group, after)[0]}
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None


def _sp_tp_engine(config: dict, steps: int, tp_first: bool = False, first: int = 0) -> tuple:
    """The engine on sp x tp (ALST registered, AutoTP from the config) and its loader of this rank's
    shards of its replica's batches from step `first` (a multiple of sp) to `steps`."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    sp, micro = config["sequence_parallel_size"], config["train_micro_batch_size_per_gpu"]
    model = new_llama()
    if tp_first:
        model = deepspeed.tp_model_init(model, tp_size=config["tensor_parallel"]["autotp_size"],
                                        dtype=torch.float32, config=config)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=micro, seq_length=16, seq_length_is_variable=False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    draws = math.ceil(steps / sp)
    data = llama_data(draws * sp, dp, micro, 0)
    mine = [data[j * sp + sp_rank][dp_rank] for j in range(first // sp, draws)]
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=None), sp_rank=sp_rank,
                                        sp_group=group, sp_world_size=sp, device=engine.device)
    return engine, loader, group


def _train(engine, loader, group, steps: int) -> tuple[list, list]:
    """`steps` steps on the loader's batches, HF's loss joined over the sequence group: losses, clipped norms."""
    losses, norms = [], []
    for _, batch in zip(range(steps), loader):
        ce, count = _ce(_llama_forward(engine, batch), batch["shift_labels"])
        local = ce / count.clamp(min=1)
        per_rank, counts = torch.stack(all_gather(local, group)), torch.stack(all_gather(count, group))
        loss = (per_rank * counts).sum() / counts.sum()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _whole(engine) -> dict:
    """The whole weights (ZeRO-3 units and AutoTP slices gathered), fp32, by name."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with GatherReplacedLayerParams(list(engine.module.parameters()), engine.module, enabled=True):
        return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}


def register_then_initialize(sp: int, tp: int, heads: int) -> None:
    """A model whose head count tp x sp does not divide: refused at initialize, on every rank."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups.mpu = None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        cfg = LlamaConfig(vocab_size=96, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64)
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=1, seq_length=16, seq_length_is_variable=False)
        deepspeed.initialize(model=model, mpu=mpu, config={**_engine_config(1, sp, 0, 0.1, 0.0, "fp32"),
                                                           "tensor_parallel": {"autotp_size": tp}})
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None


class _MegatronMpu:
    """A client's own Megatron-style mpu (its groups: the world's data group, no model parallelism)."""

    def get_data_parallel_group(self):
        return None

    def get_data_parallel_world_size(self) -> int:
        import deepspeed.comm as ds_comm

        return ds_comm.get_world_size()

    def get_model_parallel_world_size(self) -> int:
        return 1


def autotp_with_own_mpu() -> None:
    """autotp_size with a client mpu that is not ALST's: refused (the mesh makes the tensor groups)."""
    import deepspeed
    from deepspeed.utils import groups
    from tp_engine_jobs import build

    try:
        deepspeed.initialize(model=build("mlp"), mpu=_MegatronMpu(), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": 2}})
    finally:
        groups.mpu = None
