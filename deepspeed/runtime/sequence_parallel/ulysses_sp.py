"""ALST (Arctic Long Sequence Training) for Hugging Face models: upstream's `ulysses_sp` module.

`UlyssesSPAttentionHF.register_with_transformers(...)` replaces the attention function transformers
dispatches to (`ALL_ATTENTION_FUNCTIONS[core_attn_implementation]`) with one that exchanges q/k/v from
sequence shards to head shards (`deepspeed.sequence.layer._SeqAllToAll`, through `deepspeed.comm`), runs
the core implementation on the full sequence for `H/sp` heads, and exchanges the output back. Replacing
the core key rather than registering a new one keeps every transformers branch that tests
`config._attn_implementation == "sdpa"` (or "flash_attention_2") on its usual path.
`UlyssesSPDataLoaderAdapter` feeds it: every batch of the wrapped loader is shared by the sequence group
and each rank gets its slice of the sequence, with `labels` already shifted (`shift_labels`).
The tiled-compute names (`TiledMLP`, `TiledFusedLogitsLoss`, `sequence_tiled_compute`,
`UlyssesSPFwdLossBwdWithLogits`, ...) live in `tiled_compute.py` and are re-exported here.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Optional

import torch
from torch import Tensor

from ... import comm as ds_comm
from .. import mesh as _mesh
from ...sequence.layer import _DimZeroAllToAll, _SeqAllToAll  # noqa: F401  (upstream imports it from here)
from ...sequence.layer import all_gather_varlen

_TILED_NAMES = ("TiledMLP", "TiledFusedLogitsLoss", "sequence_tiled_compute", "SequenceTiledCompute",
                "UlyssesSPFwdLossBwdWithLogits", "AutogradComputeMLP", "TiledLoss")

# attention implementations that need a full 4-D mask (O(n^2)); ALST drops masks, as upstream
_UNSUPPORTED = ("eager", "paged|eager")
_FLASH = ("flash_attention_2", "flash_attention_3")
# flex_attention takes causality from its BlockMask, built for the local length: without the mask it would
# attend to future tokens, so it is refused rather than silently wrong (upstream rebuilds a causal mask)
_REFUSED = {"flex_attention": "its causal BlockMask is built for the local shard; use 'sdpa'"}


def __getattr__(name: str) -> Any:
    if name in _TILED_NAMES:
        from . import tiled_compute
        return getattr(tiled_compute, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-parallel wrapper around one transformers attention function.

    Called as transformers calls an attention function: `(module, query, key, value, attention_mask,
    **kwargs)` with q/k/v `[bs, heads, sl_local, head_size]`; returns `([bs, sl_local, heads * head_size],
    attn_weights)`. Key/value heads fewer than the group (MQA, GQA with kv < sp) are replicated so that
    each rank gets one, the copies' gradients summing back into the original head.
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False, tensor_parallel_size: int = 1) -> None:
        super().__init__()
        self.attn = attn
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation = None  # set by register_with_transformers
        self.mesh = None   # the mesh it follows, when made by register_with_transformers ([Note: SP x TP])
        self.bind(process_group, tensor_parallel_size)

    def bind(self, process_group: Any, tensor_parallel_size: int = 1) -> None:
        """Run over `process_group` (the SP group) on the heads of one of `tensor_parallel_size` AutoTP
        slices ([Note: SP x TP]): each rank's attention gets heads / tp query heads, split over sp."""
        tp = tensor_parallel_size
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.sp_rank = ds_comm.get_rank(process_group)
        self.tensor_parallel_size = tp
        sp, heads, kv_heads = self.world_size, self.attn_head_count, self.global_kv_head_count
        if tp > 1 and (heads % (tp * sp) or kv_heads % tp):
            raise ValueError(f"Ulysses sequence parallelism with AutoTP: the attention head count {heads} (key/value "
                             f"heads {kv_heads}) must be divisible by tensor_parallel.autotp_size x "
                             f"sequence_parallel_size = {tp} x {sp} = {tp * sp} (key/value heads by {tp}): each "
                             f"rank's attention holds heads / {tp} heads and Ulysses splits them over {sp} ranks; "
                             "choose sizes whose product divides the head count")
        if heads % sp != 0:
            raise ValueError(f"Attention head count {heads} is not divisible by SP size {sp}")
        local_kv = kv_heads // tp
        if not (local_kv % sp == 0 or sp % local_kv == 0):
            raise ValueError(f"KV attention head count {local_kv} is not divisible by SP size {sp} or vice versa"
                             + (f" ({kv_heads} key/value heads over autotp_size {tp})" if tp > 1 else ""))
        self.local_q_head_count = heads // tp // sp
        self.kv_replication_factor = max(sp // local_kv, 1)
        self.local_kv_head_count = max(local_kv // sp, 1)

    def follow(self, mesh: Any) -> None:
        """Bind to `mesh`'s sequence group and tensor degree (the engine refines ALST's SP-only mesh with
        AutoTP's tensor dim at initialize: [Note: SP x TP])."""
        self.mesh = mesh
        self.bind(mesh.group("sequence"), mesh.size("tensor"))

    def _check_shapes(self, query: Tensor, key: Tensor) -> None:
        bs, hc, sl_l, hs = query.shape
        if self.seq_length_is_variable:
            self.local_seq_length = sl_l
            self.global_seq_length = sl_l * self.world_size
        tp = self.tensor_parallel_size   # AutoTP: this rank's slice of the heads
        want_q = (self.batch_size, self.attn_head_count // tp, self.local_seq_length, self.attn_head_size)
        want_kv = (self.batch_size, self.global_kv_head_count // tp, self.local_seq_length, self.attn_head_size)
        if tuple(query.shape) != want_q or tuple(key.shape) != want_kv:
            raise ValueError(f"[rank {ds_comm.get_rank()}] Ulysses SP attention: query {tuple(query.shape)} / key "
                             f"{tuple(key.shape)} do not match the registered shapes {want_q} / {want_kv} "
                             "([batch, heads, local seqlen, head size]; micro_batch_size and seq_length given to "
                             "register_with_transformers)")

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any):
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        module._ds_ulysses_sp = True   # the engine takes this model's loss as a "whole" one (engine_parallel.py)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses SP requires position_ids in every forward() call (the global positions of "
                             "this rank's tokens; UlyssesSPDataLoaderAdapter provides them)")
        # the core attention sees the whole sequence: hand it the whole sequence's positions
        pos = kwargs["position_ids"].contiguous()
        parts = [torch.empty_like(pos) for _ in range(self.world_size)]
        ds_comm.all_gather(parts, pos, group=self.process_group)
        kwargs["position_ids"] = torch.cat(parts, dim=-1)

        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        # [bs, hc, sl_l, hs] -> [bs, hc_l, sl, hs]: scatter heads (dim 1), gather sequence (dim 2)
        seq_sizes = [self.local_seq_length] * self.world_size
        q, k, v = (_SeqAllToAll.apply(self.process_group, t, 1, 2, 0, None, None, None, True, seq_sizes)
                   for t in (query, key, value))

        groups_before = getattr(module, "num_key_value_groups", None)
        if groups_before is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            context, attn_weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        finally:
            if groups_before is not None:
                module.num_key_value_groups = groups_before
        # core attention returns [bs, sl, hc_l, hs]: scatter the sequence (dim 1), gather heads (dim 2)
        heads = [context.shape[2]] * self.world_size
        out = _SeqAllToAll.apply(self.process_group, context.contiguous(), 1, 2, 0, None, None, None, True, heads)
        return out.reshape(out.shape[0], out.shape[1], -1), attn_weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None):
        """Make the sequence-parallel groups and route `core_attn_implementation` through Ulysses.

        `model_name_or_path`: a model (or anything with `.config`, e.g. a PEFT wrapper), a config, or a hub
        name / local path. Returns the `mpu` (`parallel_state_sp`) for `deepspeed.initialize(mpu=...)`, or
        None when `sequence_parallel_size == 1`.
        """
        if sequence_parallel_size == 1:
            return None
        if max_length is not None and seq_length is None:
            seq_length = max_length  # upstream's deprecated name
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: either seq_length_is_variable must be True or seq_length "
                             "must be the fixed sequence length of every batch")
        if core_attn_implementation in _UNSUPPORTED:
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence "
                             "parallelism because it requires a 4D attention_mask (O(n^2) memory). Use 'sdpa', "
                             "'flash_attention_2' (where installed) or 'flex_attention'.")
        if core_attn_implementation in _REFUSED:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' is not supported with Ulysses "
                             f"sequence parallelism here: {_REFUSED[core_attn_implementation]}")
        hf_config = _hf_config(model_name_or_path)
        model_impl = getattr(hf_config, "_attn_implementation", None)
        if model_impl is not None and model_impl != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                             f"attn_implementation='{model_impl}'. Set both to the same value so the sequence-"
                             "parallel wrapper intercepts the active attention path.")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if isinstance(core_attn_implementation, str) and re.search(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$",
                                                                   core_attn_implementation):
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
            lazy_import_flash_attention(core_attn_implementation)  # hub kernels register lazily
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        if core_attn_implementation in _FLASH and not _flash_available(core_attn_implementation):
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' needs the flash-attn package, "
                             "which is not installed; use 'sdpa'")

        from . import parallel_state_sp as mpu

        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        core = getattr(core, "_ulysses_core", core)  # registering again wraps the original, not our wrapper
        if seq_length_is_variable:
            local_len = global_len = None
        else:
            if seq_length % sequence_parallel_size != 0:
                raise ValueError(f"seq_length={seq_length} is not divisible by sequence_parallel_size="
                                 f"{sequence_parallel_size}")
            local_len, global_len = seq_length // sequence_parallel_size, seq_length
        arch = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        head_size = getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads
        kv_heads = getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads
        mesh = _mesh.current()
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=arch.num_attention_heads,
                    attn_head_size=head_size, kv_head_count=kv_heads, num_hidden_layers=arch.num_hidden_layers,
                    process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=local_len, global_seq_length=global_len, disable_in_eval=disable_in_eval,
                    tensor_parallel_size=mesh.size("tensor"))
        uattn.mesh = mesh
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            # The mask transformers built is for the local shard's length and would be O(n^2) at full
            # length: drop it and rely on causality (+ position_ids for packed sequences), as upstream.
            return uattn(module, query, key, value, None, *args, **kwargs)

        uattn_wrapper._ulysses_core = core
        uattn_wrapper._ulysses_attention = uattn
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return mpu


def follow_mesh(mesh: Any) -> None:
    """[Note: SP x TP] ALST makes its sequence groups at `register_with_transformers`, before
    `deepspeed.initialize` knows the tensor-parallel degree; the engine then refines the mesh with
    AutoTP's tensor dim (same sequence degree, other ranks: tensor is the fastest axis) and calls this,
    so every registered attention runs over the new sequence group on its TP slice of the heads (and a
    head count that tp x sp does not divide is refused on every rank before any weight is cut)."""
    import sys

    registry = sys.modules.get("transformers.modeling_utils")
    functions = getattr(registry, "ALL_ATTENTION_FUNCTIONS", None)
    for key in list(functions.valid_keys()) if functions is not None else []:
        attention = getattr(functions[key], "_ulysses_attention", None)
        if attention is not None and attention.mesh is not None:
            attention.follow(mesh)


def _hf_config(model_name_or_path: Any) -> Any:
    if hasattr(model_name_or_path, "config"):  # a model, or a PEFT wrapper with a config attribute
        return model_name_or_path.config
    if hasattr(model_name_or_path, "num_attention_heads") or hasattr(model_name_or_path, "get_text_config"):
        return model_name_or_path  # already a config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_name_or_path)


def _flash_available(impl: str) -> bool:
    import transformers.utils as tu
    check = {"flash_attention_2": "is_flash_attn_2_available", "flash_attention_3": "is_flash_attn_3_available"}
    fn = getattr(tu, check[impl], None)
    return bool(fn and fn())


class UlyssesSPDataLoaderAdapter:
    """Wrap a DataLoader so the ranks of a sequence group train on one batch at a time, each its slice.

    Every `sp_world_size` steps it takes one batch from each rank's loader, shares them over the group
    (`deepspeed.comm` all_gather; batches may differ in length between ranks), and yields them one after
    the other: step i is rank i's batch, cut along the sequence (dim 1) into `sp_world_size` equal slices,
    this rank getting slice `sp_rank`. `labels` become `shift_labels` (labels shifted left by one, -100 at
    the end) before the cut, so the token at a slice's edge keeps its target from the next slice. Batches
    must carry `input_ids` and `position_ids`; non-tensor entries are copied; the length is
    `len(dl) * sp_world_size`. Slices are handed out on CPU, as upstream (at long sequences the
    prefill holds `sp_world_size` batches); the training loop moves them to its device.
    """

    def __init__(self, dl, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()
        from .. import mesh as _mesh

        made = _mesh.current()   # ALST's mesh when sp_group is its sequence group: followed if refined
        self._mesh = made if made is not None and "sequence" in made.names and made.group("sequence") is sp_group \
            else None

    def _follow_refined_mesh(self) -> None:
        """[Note: SP x TP] An adapter made before `deepspeed.initialize` (Accelerate's `_prepare_deepspeed`
        wraps the loader first) holds the SP-only mesh's sequence group; with AutoTP the engine refines the
        mesh (tensor fastest) and the sequence groups move: take the refined mesh's group and rank."""
        from .. import mesh as _mesh

        now = _mesh.current()
        if self._mesh is None or now is None or now is self._mesh or "sequence" not in now.names \
                or now.size("sequence") != self.sp_world_size:
            return
        self.sp_group, self.sp_rank, self._mesh = now.group("sequence"), now.rank("sequence"), now

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def __getattr__(self, name: str) -> Any:
        # sampler, dataset, batch_size, set_epoch...: the wrapped loader's (Trainer and Accelerate read them)
        if name == "dl":
            raise AttributeError(name)
        return getattr(self.dl, name)

    def refill(self) -> None:
        self._follow_refined_mesh()
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses SP requires `position_ids` in every dataloader batch so that each token keeps "
                             "its global position after sequence sharding (torch.arange(seq_len) per sample, or "
                             "reset at document boundaries for packed sequences)")
        seqlen = batch["input_ids"].shape[1]
        for k, v in batch.items():
            if torch.is_tensor(v) and (v.dim() < 2 or v.shape[1] != seqlen):
                raise ValueError(f"{k}'s shape {tuple(v.shape)} must match input_ids's shape "
                                 f"{tuple(batch['input_ids'].shape)} in its first two dims")
        lens = None   # every rank's sequence length: asked once, by the first tensor's gather

        per_rank: list[dict] = [{} for _ in range(self.sp_world_size)]
        for k, v in batch.items():
            if torch.is_tensor(v):
                with torch.no_grad():   # ranks' batches may differ in length
                    parts = all_gather_varlen(v.to(self.device), 1, self.sp_group, lens)
                lens = [part.shape[1] for part in parts]
            else:
                parts = [None] * self.sp_world_size
                ds_comm.all_gather_object(parts, v, group=self.sp_group)
            for rank, part in enumerate(parts):
                per_rank[rank][k] = part

        for sample in per_rank:
            self.micro_batches.append(_shard(sample, self.sp_rank, self.sp_world_size))


def _shard(batch: dict, sp_rank: int, sp_world_size: int) -> dict:
    """This rank's slice of one batch, with `labels` turned into `shift_labels` first."""
    seq_length = batch["input_ids"].shape[1]
    if seq_length % sp_world_size != 0:
        raise ValueError(f"batch's seqlen={seq_length} isn't divisible by sp-size={sp_world_size}")
    chunk = seq_length // sp_world_size
    if "labels" in batch:
        # the model cannot shift labels itself: the next token may live on the next rank
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    out = {}
    for k, v in batch.items():
        out[k] = v[:, chunk * sp_rank:chunk * (sp_rank + 1)].cpu().contiguous() if torch.is_tensor(v) else v
    return out
