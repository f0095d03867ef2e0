"""TP-replicated parameters get one gradient: averaged over the tensor-parallel group at the step.

[Note: TP-replicated gradients]
Under AutoTP the parameters that stay whole (embeddings, norms, row-layer biases, an LM head kept
whole) live on every TP rank of a replica. Their gradients are equal on the TP peers only if the peers
compute bit-identical backward passes, which nondeterministic kernels (CUDA atomics in embedding
backward, split-K matmuls) do not promise; a last-bit difference a step compounds into weights that
drift apart. So at each optimizer step, after the data-parallel reduction and before the overflow
check, clipping and the base optimizer, every rank averages the gradient of its replicated parameters
(at ZeRO 1-3: of the fragments it owns) over the TP group with one flat all-reduce per dtype. Every TP
peer then applies the identical update to identical weights and identical optimizer state: drift is
impossible, not merely detected. A parameter marked as a per-peer partial
(auto_ep_folding.mark_autoep_folding_partial_router_parameter) is summed instead of averaged.

Why fragments line up: TP peers hold the same parameters in the same order with the same local sizes
(sharded parameters are split evenly, uneven splits are refused), so ZeRO's buckets and units, and the
fragment of each parameter a data rank owns, are the same on every TP peer. The first step checks this
(one all_gather of a digest of the fragments' parameter shapes, offsets and sizes) and raises on every
rank if a peer differs, naming its first replicated parameter.

Cost: the replicated parameters' gradient bytes once per optimizer step (not per micro-step), divided
by the data-parallel size at ZeRO 1-3 (each rank averages only the fragments it owns); one all-reduce
call per gradient dtype. Megatron-LM does the same for the parameters whose gradients legitimately
differ over TP (norms under sequence parallelism, `finalize_model_grads`), coalesced into one flat
all-reduce; upstream DeepSpeed's AutoTP does it only for modules flagged `replicated_with_grad_allreduce`
and otherwise relies on identical computation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import comm as ds_comm


def tp_reduction(param: torch.Tensor, world: int) -> str:
    """"average" for a parameter held whole on every TP rank (not sliced by AutoTP), "sum" for one
    marked as a per-peer partial, "skip" for TP slices and experts (AutoEP's experts differ over the
    tensor peers when the expert groups fold over them, [Note: EP x TP folding]): the rule of
    auto_ep_folding.autoep_folding_gradient_reduction_strategy, which holds without AutoEP too."""
    from ...module_inject.auto_ep_folding import autoep_folding_gradient_reduction_strategy

    return autoep_folding_gradient_reduction_strategy(_TensorFold(world), param)


@dataclass(frozen=True)
class _TensorFold:
    tp_size: int
    mp_mode: str = "tp"


@dataclass
class ReplicatedGradSync:
    """Averages TP-replicated gradients over `group` (the TP group of this replica, `world` ranks)."""

    group: Any
    world: int
    names: dict[int, str] = field(default_factory=dict)   # id(param) -> name, for the error message
    checked: bool = False
    how: dict[int, str] = field(default_factory=dict)   # id(param) -> tp_reduction(param)

    def average(self, pieces: list[tuple[torch.Tensor, torch.Tensor, int]], comm_device: torch.device) -> None:
        """`pieces`: (gradient tensor to reduce in place, the model parameter it belongs to, its offset in
        the flattened parameter) for every gradient this rank steps; the replicated ones are averaged,
        the marked partials summed (`tp_reduction`)."""
        for _, param, _ in pieces:
            if id(param) not in self.how:
                self.how[id(param)] = tp_reduction(param, self.world)
        how = self.how
        mine = [(grad, param, start) for grad, param, start in pieces if grad is not None and how[id(param)] != "skip"]
        if not self.checked:
            self._check_layout(mine, comm_device)
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, bool]]] = {}
        for grad, param, _ in mine:
            by_dtype.setdefault(grad.dtype, []).append((grad, how[id(param)] == "average"))
        for dtype in sorted(by_dtype, key=str):   # the same order on every TP peer
            grads = [g for g, _ in by_dtype[dtype]]
            flat = torch.cat([g.reshape(-1) for g in grads]).to(comm_device)
            ds_comm.all_reduce(flat, group=self.group)
            parts = flat.split([g.numel() for g in grads])
            for part, (_, average) in zip(parts, by_dtype[dtype]):
                if average:
                    part.div_(self.world)
            torch._foreach_copy_(grads, [part.view_as(g).to(g.device) for part, g in zip(parts, grads)])

    def _check_layout(self, mine: list[tuple[torch.Tensor, torch.Tensor, int]], comm_device: torch.device) -> None:
        """Once: every TP peer must average the same fragments (see the Note); raises on every rank if not."""
        layout = [(tuple(param.shape), start, grad.numel(), str(grad.dtype)) for grad, param, start in mine]
        digest = torch.tensor([zlib.crc32(repr(layout).encode()), len(layout)], dtype=torch.int64,
                              device=comm_device)
        gathered = [torch.empty_like(digest) for _ in range(self.world)]
        ds_comm.all_gather(gathered, digest, group=self.group)
        self.checked = True
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            first = self.names.get(id(mine[0][1]), "?") if mine else "(none on this rank)"
            raise RuntimeError("tensor parallelism: the TP ranks' replicated-parameter gradients are laid out "
                               f"differently (digests {[g.tolist() for g in gathered]}; first replicated parameter "
                               f"here: {first}), so they cannot be averaged over the TP group; the TP peers must "
                               "hold the same parameters in the same order with equal local sizes")

