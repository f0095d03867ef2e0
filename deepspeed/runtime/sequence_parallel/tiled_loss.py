"""Tiled losses (ALST): the loss over sequence shards so the full-vocabulary logits never exist at once,
and upstream's ALST forward/loss/backward driver. Upstream's names and signatures; see
[Note: tiled backward] in tiled_compute.py for how the shards' gradients are produced."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import torch

from ... import comm as ds_comm
from ...sequence.layer import all_gather_varlen
from ._tiling import check_shards, gathered, grad_params, leaf, shard_backward, shard_bounds

IGNORE_INDEX = -100


def _check_fused_args(x: torch.Tensor, y: torch.Tensor, mask: Any, output_reduction: Any) -> None:
    where = "TiledFusedLogitsLoss"
    if output_reduction not in ("mean", "sum"):
        raise ValueError(f"{where}: output_reduction={output_reduction!r} is not allowed: use 'mean' or 'sum'")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"{where}: x and y must be at least 2D [batch_size, seq_len, ...], got x {tuple(x.shape)}, "
                         f"y {tuple(y.shape)}")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"{where}: x {tuple(x.shape)} and y {tuple(y.shape)} differ in their batch/seq dims")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{where}: mask {tuple(mask.shape)} must be [batch_size, seq_len] = {tuple(x.shape[:2])}")


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`:
    `fn(self, x_shard, y_shard[, mask_shard])` (typically lm_head + cross entropy, returning a scalar)
    over `shards` slices of the flattened batch x sequence tokens; the result is the "mean" or "sum"
    of the slices' values (upstream's: a plain mean of per-slice values; with uneven slices or masks use
    "sum" and normalise yourself). Only one slice's logits exist at a time, in forward and backward.
    `mask` (None or [bs, seqlen]) is sliced with x and y and passed only when given. Gradient: for x
    (the other inputs are constants); parameter gradients accumulate as in any backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: torch.Tensor, y: torch.Tensor, mask: Any, shards: int,
                compute_params: Any, output_reduction: str) -> torch.Tensor:
        check_shards(shards, "TiledFusedLogitsLoss")
        _check_fused_args(x, y, mask, output_reduction)
        ctx.fn, ctx.module, ctx.reduction, ctx.params = fn, self, output_reduction, grad_params(compute_params)
        flat = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
        if mask is not None:
            flat.append(mask.reshape(-1))
        ctx.bounds = shard_bounds(flat[0].shape[0], shards)
        ctx.save_for_backward(x, *flat[1:])
        with torch.no_grad(), gathered(ctx.params):
            outs = [fn(self, *(t.narrow(0, s, n) for t in flat)) for s, n in ctx.bounds]
        out = torch.stack([o.reshape(()) for o in outs])
        return out.mean() if output_reduction == "mean" else out.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, *rest = ctx.saved_tensors
        flat_x = x.detach().reshape(-1, *x.shape[2:])
        x_grad = torch.zeros_like(flat_x) if ctx.needs_input_grad[2] else None
        if ctx.reduction == "mean":
            grad_out = grad_out / len(ctx.bounds)

        def run_shard(i: int, start: int, size: int) -> None:
            piece = leaf(flat_x.narrow(0, start, size), x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece, *(t.narrow(0, start, size) for t in rest))
            torch.autograd.backward(out, grad_out.to(out.dtype).expand_as(out))
            if x_grad is not None and piece.grad is not None:
                x_grad.narrow(0, start, size).copy_(piece.grad)

        shard_backward(ctx.params, ctx.bounds, run_shard)
        return (None, None, None if x_grad is None else x_grad.view_as(x)) + (None, ) * 5


class TiledLoss(torch.autograd.Function):
    """`TiledLoss.apply(loss_fn, logits, vocab_size, shift_labels, shards)` (upstream's older form): the
    loss of existing `logits` computed over `shards` sequence slices, so its float32 upcast and softmax
    exist for one slice at a time. `loss_fn(logits=, labels=None, vocab_size=, shift_labels=)` is
    Hugging Face's `model.loss_function` (a mean over the tokens whose label is not -100); slices are
    weighted by their counted tokens, so the result is the mean over every counted token, and slices
    with none are skipped. The gradient is that weighted mean's (upstream's divides evenly by shards)."""

    @staticmethod
    def forward(ctx: Any, loss_fn: Callable, logits: torch.Tensor, vocab_size: int, shift_labels: torch.Tensor,
                shards: int) -> torch.Tensor:
        check_shards(shards, "TiledLoss")
        bounds = shard_bounds(shift_labels.shape[1], shards)
        counts = [int((shift_labels.narrow(1, s, n) != IGNORE_INDEX).sum()) for s, n in bounds]
        ctx.loss_fn, ctx.vocab_size, ctx.counts, ctx.bounds = loss_fn, vocab_size, counts, bounds
        ctx.save_for_backward(logits, shift_labels)
        total = sum(counts)
        if total == 0:   # nothing counted: 0 with zero gradients (cross entropy would give nan)
            return (logits.sum() * 0.0).float().detach()
        with torch.no_grad():
            parts = [loss_fn(logits=logits.narrow(1, s, n), labels=None, vocab_size=vocab_size,
                             shift_labels=shift_labels.narrow(1, s, n)) * c
                     for (s, n), c in zip(bounds, counts) if c]
        return torch.stack(parts).sum() / total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        logits, shift_labels = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        total = sum(ctx.counts)
        for (s, n), c in zip(ctx.bounds, ctx.counts):
            if not c:
                continue
            piece = leaf(logits.narrow(1, s, n), True)
            with torch.enable_grad():
                loss = ctx.loss_fn(logits=piece, labels=None, vocab_size=ctx.vocab_size,
                                   shift_labels=shift_labels.narrow(1, s, n))
            torch.autograd.backward(loss, grad_out * (c / total))
            grad.narrow(1, s, n).copy_(piece.grad)
        return None, grad, None, None, None


class _GatherScalars(torch.autograd.Function):
    """Differentiable all_gather of one scalar per rank of `group` (through deepspeed.comm): the gradient
    of each rank's scalar is the sum of every rank's gradient for it (torch.distributed.nn's rule)."""

    @staticmethod
    def forward(ctx: Any, group: Any, value: torch.Tensor) -> tuple:
        ctx.group, ctx.zero = group, (value.shape, value.dtype, value.device)   # for a missing gradient
        world = ds_comm.get_world_size(group)
        out = [torch.empty_like(value) for _ in range(world)]
        ds_comm.all_gather(out, value.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        shape, dtype, device = ctx.zero   # a missing gradient is zero, on the device of the others
        stacked = torch.stack([g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                               for g in grads]).contiguous()
        ds_comm.all_reduce(stacked, group=ctx.group)
        return None, stacked[ds_comm.get_rank(ctx.group)]


class UlyssesSPFwdLossBwdWithLogits:
    """Upstream's ALST driver for trainers that do not use UlyssesSPDataLoaderAdapter: each SP rank
    brings its own batch; `sp_fwd_loss_bwd(batch)` gathers the SP group's batches and, for each,
    runs forward on this rank's sequence slice, the loss (tiled over "auto" ~1 GiB fp32 logit shards
    or `num_loss_logit_shards`), the token-weighted loss over the SP group, and `model.backward`;
    it returns the mean loss (a float). `model`: the engine; `model_unwrapped`: the HF model (its
    `loss_function` and `config.vocab_size`). Batches need input_ids, position_ids and labels of equal
    shape; each sequence length must divide by the SP size."""

    def __init__(self, model: Any, model_unwrapped: Any, device: Any, num_loss_logit_shards: Any = "auto",
                 **kwargs: Any) -> None:
        from ...utils import groups
        self.model, self.model_unwrapped, self.device = model, model_unwrapped, device
        self.num_loss_logit_shards, self.kwargs = num_loss_logit_shards, kwargs
        self.sp_group = groups._get_sequence_parallel_group()
        self.sp_world_size = groups._get_sequence_parallel_world_size()
        self.sp_rank = groups._get_sequence_parallel_rank()

    def _gather_batches(self, batch: dict) -> list[dict]:
        """Every SP rank's batch (sequence lengths may differ by rank), in SP rank order."""
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise ValueError(f"UlyssesSPFwdLossBwdWithLogits: the batch has no {key!r} (keys: {list(batch)})")
        shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "position_ids", "labels")}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"UlyssesSPFwdLossBwdWithLogits: input_ids, position_ids and labels differ in shape: "
                             f"{shapes}")
        lengths = None   # every rank's sequence length: asked once, by the first gather
        batches: list[dict] = [defaultdict(dict) for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            parts = all_gather_varlen(value.to(self.device), 1, self.sp_group, lengths)
            lengths = [part.shape[1] for part in parts]
            for rank, part in enumerate(parts):
                batches[rank][key] = part
        return batches

    def sp_fwd_loss_bwd(self, batch: dict) -> float:
        batches = self._gather_batches(batch)
        self.model.set_gradient_accumulation_boundary(False)
        losses = []
        for step, sub in enumerate(batches):
            if step + 1 == len(batches):
                self.model.set_gradient_accumulation_boundary(True)
            seqlen = sub["input_ids"].shape[1]
            if seqlen % self.sp_world_size:
                raise ValueError(f"UlyssesSPFwdLossBwdWithLogits: sub-step {step}: sequence length {seqlen} does not "
                                 f"divide by the sequence parallel size {self.sp_world_size}")
            chunk = seqlen // self.sp_world_size
            labels = sub.pop("labels")
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
            sub["shift_labels"] = shift
            # the tokens each rank's loss averages over: its slice of the shifted labels (upstream estimates
            # them from the unshifted slice less one, which is off where a slice edge meets a -100)
            counts = [int((shift[:, r * chunk:(r + 1) * chunk] != IGNORE_INDEX).sum())
                      for r in range(self.sp_world_size)]
            local = {k: v[:, self.sp_rank * chunk:(self.sp_rank + 1) * chunk] for k, v in sub.items()}
            shift_labels = local.pop("shift_labels")
            self.forward(local)
            loss = self.compute_loss(labels=None, shift_labels=shift_labels)
            per_rank = _GatherScalars.apply(self.sp_group, loss)
            self.loss = sum(per_rank[r] * counts[r] for r in range(self.sp_world_size)) / max(sum(counts), 1)
            self.backward()
            losses.append(self.loss.detach().item())
        return sum(losses) / len(losses) if losses else float("nan")

    def forward(self, batch: dict) -> Any:
        outputs = self.model(**batch, use_cache=False)   # no labels: the loss is ours
        self.logits = outputs.logits
        return outputs

    def compute_loss(self, labels: Any, shift_labels: torch.Tensor) -> torch.Tensor:
        if bool((shift_labels == IGNORE_INDEX).all()):
            self.loss = (self.logits.sum() * 0.0).float()   # nothing counted: zero loss, zero gradients
            return self.loss
        shards = self.num_loss_logit_shards
        if shards == "auto":   # ~1 GiB of fp32 logits per shard
            shards = max(1, math.ceil(self.logits.numel() * 4 / 2**30))
        loss_fn, vocab_size = self.model_unwrapped.loss_function, self.model_unwrapped.config.vocab_size
        if shards > 1:
            self.loss = TiledLoss.apply(loss_fn, self.logits, vocab_size, shift_labels, shards)
        else:
            self.loss = loss_fn(logits=self.logits, labels=None, vocab_size=vocab_size, shift_labels=shift_labels)
        return self.loss

    def backward(self) -> None:
        if getattr(self.model, "sequence_parallel_loss", "unset") is None:   # an engine: this loss is a whole one
            self.model.sequence_parallel_loss = "whole"
        self.model.backward(self.loss)
