"""Shared pieces of the sequence-parallel client workers (hf_sp_worker.py): a dataset whose samples
carry `position_ids` (what UlyssesSPDataLoaderAdapter requires) and labels with -100 spread unevenly
over the two sequence halves, the check that the shards a rank trained on reassemble into real
samples, and the single-process full-sequence SGD run every variant is compared with.

The reference never uses the shards: it rebuilds each step's full batch from the dataset (found by
the gathered input_ids) and shifts the labels itself, so a shard or label shifted wrongly by the
adapter shows up as a mismatch instead of being copied into the reference.
"""

from __future__ import annotations

import math

import torch

import hf_common as C

SEQ = 16


class SPTokenData(torch.utils.data.Dataset):
    """Counting sequences (unique per sample: start 7*i, stride 1 + i % 3) with `position_ids`. The
    first m_i labels are ignored (an SFT prompt), m_i in 0..8: with two shards the first half of
    some samples keeps a single target while the second keeps eight, so the per-shard token counts
    differ and the token-weighted join is what makes the loss right."""

    def __init__(self, n: int) -> None:
        i = torch.arange(n).view(n, 1)
        self.ids = (7 * i + (1 + i % 3) * torch.arange(SEQ)) % C.VOCAB
        self.labels = self.ids.clone()
        prompt = (i * 5) % 9                                   # 0..8 ignored leading labels
        self.labels[torch.arange(SEQ).view(1, SEQ) < prompt] = -100
        self.labels[i.view(-1) % 4 == 1, SEQ - 3] = -100       # and a hole near the end of some
        self.index = {tuple(row.tolist()): k for k, row in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> dict:
        return {"input_ids": self.ids[k], "labels": self.labels[k], "position_ids": torch.arange(SEQ)}

    def full_batch(self, gathered_ids: torch.Tensor, gathered_pos: torch.Tensor, gathered_shift: torch.Tensor):
        """The dataset rows behind a gathered (all SP shards concatenated) batch, checked against
        what the shards held: ids, positions and shifted labels (the target of the last token of
        each shard is the first token of the next shard's, the last one -100). Returns
        (row indices, input_ids, shift_labels) from the dataset."""
        rows = []
        for ids in gathered_ids:
            key = tuple(ids.tolist())
            assert key in self.index, f"shards do not reassemble into a sample: {ids.tolist()}"
            rows.append(self.index[key])
        ids = self.ids[rows]
        shift = torch.nn.functional.pad(self.labels[rows], (0, 1), value=-100)[:, 1:]
        assert torch.equal(gathered_pos, torch.arange(SEQ).expand_as(ids)), gathered_pos
        assert torch.equal(gathered_shift, shift), (gathered_shift, shift)
        return rows, ids, shift


def gather_shards(tensor: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every SP rank's shard along the sequence (no gradient: inputs only)."""
    import deepspeed.comm as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def gathered_state(model) -> dict:
    """fp32 copies of every parameter, gathered under ZeRO-3 (a no-op for the others); every rank."""
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def engine_params(engine) -> dict:
    """The engine's fp32 master weights, whole, for every stage; AutoTP's slices joined over the
    tensor group (fp32 training: the module's weights are the masters)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams, is_tensor_parallel
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    if any(is_tensor_parallel(p) for p in params):
        with GatherReplacedLayerParams(params, engine.module, enabled=True):
            return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}
    return {n: safe_get_full_fp32_param(p).detach().clone().float() for n, p in engine.module.named_parameters()}


def fix_gloo_autograd_all_gather() -> None:
    """torch's differentiable all_gather (torch.distributed.nn.functional, what transformers'
    `deepspeed_sp_compute_loss` joins the shard losses with) falls back on gloo to scatters whose
    `src` is the group rank where torch wants the global one, so its backward fails in every
    sequence group that is not ranks 0..sp-1 (with tensor parallelism: every one). A CPU-only torch
    bug (NCCL takes a reduce-scatter): pass `group_src` instead, as HF_SURFACE's other CPU fixes."""
    import torch.distributed as dist
    from torch.distributed.nn import functional as F

    def forward(ctx, group, out_tensor_list, *tensors):
        ctx.group = group
        ctx.input_tensor_size_list = [t.size() for t in tensors]
        me = dist.get_rank(group=group)
        tensors = tuple(t.contiguous() for t in tensors)
        if dist.get_backend(group=group) != dist.Backend.GLOO:
            dist.all_to_all(out_tensor_list, list(tensors), group=group)
            return tuple(out_tensor_list)
        for i in range(dist.get_world_size(group=group)):
            dist.scatter(out_tensor_list[i], list(tensors) if i == me else None, group=group, group_src=i)
        return tuple(out_tensor_list)

    F._AlltoAll.forward = staticmethod(forward)


def plain_model(state: dict):
    """The tiny Llama with eager attention (sdpa is the Ulysses wrapper once registered in this
    process), loaded with `state`: one process, full sequences."""
    from transformers import LlamaForCausalLM

    cfg = C.tiny_config()
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def full_sequence_sgd(state: dict, batches: list, lr: float, clip: float) -> dict:
    """SGD on the full sequences: per step, the mean cross-entropy over the batch's valid shifted
    labels, gradient norm clipped to `clip`. Returns the losses, pre-clip norms and final weights."""
    model = plain_model(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for ids, shift in batches:
        opt.zero_grad()
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def dataset_loss(state: dict, data: SPTokenData) -> float:
    """Mean full-sequence loss over the whole dataset (one batch) with weights `state`."""
    shift = torch.nn.functional.pad(data.labels, (0, 1), value=-100)[:, 1:]
    return full_sequence_sgd(state, [(data.ids, shift)], lr=0.0, clip=float("inf"))["losses"][0]


def check_close(got: list, want: list, what: str, rtol: float = 1e-5) -> None:
    assert len(got) == len(want) and got, f"{what}: {len(got)} values vs {len(want)}"
    for k, (x, y) in enumerate(zip(got, want)):
        assert math.isclose(x, y, rel_tol=rtol, abs_tol=1e-6), f"{what}: step {k}: {x} != {y}\n{got}\n{want}"


def check_params(got: dict, want: dict, what: str, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")
