"""Muon's step on ZeRO shards: every matrix orthogonalised whole, on one owner rank.

[Note: Muon under ZeRO]
ZeRO 1-3 hand the base optimizer 1-D fragments of fp32 master shards; a matrix may be cut
across ranks anywhere (stages 1-2: buckets; stage 3: every parameter split N ways). Momentum
and the Nesterov direction are elementwise, so each rank computes them on its own fragments,
and the momentum buffer is sharded exactly like the masters (4 bytes per Muon element in all,
1/N of it per rank). Newton-Schulz is not elementwise: each Muon matrix gets an owner rank
(greedy: largest matrix first, to the least-loaded rank), one all-to-all moves every fragment's
direction to its matrix's owner, the owner runs NS on the whole matrix, and a second all-to-all
brings each fragment its slice of the result. The fragments travel in the NS compute dtype
(bf16 for "standard", fp16/fp32 for "gram", see original_muon.py): NS casts its input to it
first and produces its output in it, so the wire loses nothing and the update is bit for bit
the one an unsharded run computes from the same gradient. Bytes per step: for every Muon
matrix, the elements outside its owner's own fragments cross the wire twice, at most
2 * (N-1)/N * Ψ_muon elements of the compute dtype summed over ranks (1/N of that per rank
when owners balance); nothing crosses at N = 1 or when a matrix lies in its owner's shard.

[Note: Muon and gradient clipping]
`gradient_clipping` (default 1.0) clips the raw gradients by their global norm before the
momentum, at every stage: the step is `clip_grad_norm_` then torch.optim.Muon + AdamW, and the
engine reports that raw norm. DeepSpeed 0.19.8 does so at stage 0 only. At stages 1-3 it runs
Muon while it partitions the gradients, before its norm, so its norm and clip cover the
orthogonalised updates with the AdamW gradients; an update's norm is about
sqrt(min(rows, cols) * max(1, rows/cols)), a property of the shapes, so every Muon step there is
divided by ~sqrt(sum over matrices) (10.9 for a 4-matrix toy, 61.7 for bench_muon.py's model,
hundreds for an LLM) and the step is pinned by the threshold rather than by `muon_lr`. It is
upstream issue deepspeedai/DeepSpeed#8439 (open), and upstream's stage 0 disagrees with it, so
we keep the clip on gradients; with `"gradient_clipping": 0` both packages run the same formula
(docs/zero.md "Muon and gradient clipping"; tests/distributed/test_muon_clipping.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .... import comm as ds_comm
from .muon_optimizer import MuonWithAuxAdam
from .original_muon import ns_compute_dtype
from .tensor_parallel import orthogonalize_param


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon parameter of a shard: where it lives and which rank orthogonalises it."""

    shard: int                     # index of its bucket / unit in the wrapper's shard list
    index: int                     # its index in that shard's `params`
    shape: torch.Size
    owner: int
    pieces: tuple[tuple[Any, ...], ...]   # per rank: that rank's fragments of it (partition Fragments)
    num_heads: int | None = None           # per-head Muon: the model parameter's `muon_num_heads`


def assign_owners(numels: list[int], world: int) -> list[int]:
    """Owner rank per matrix: largest first, each to the least-loaded rank (lowest on ties)."""
    load, owners = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def plan_matrices(shards: list[Any], shapes: list[list[torch.Size]], muon_ids: set[int], world: int) -> list[MuonMatrix]:
    """The Muon matrices of `shards` in shard order, with owners and every rank's fragments (pure:
    the same answer on every rank)."""
    found = []
    for s, shard in enumerate(shards):
        per_rank = [shard.partition.fragments(r) for r in range(world)]
        for i, p in enumerate(shard.params):
            if id(p) in muon_ids:
                pieces = tuple(tuple(f for f in frags if f.index == i) for frags in per_rank)
                found.append((s, i, shapes[s][i], pieces, getattr(p, "muon_num_heads", None)))
    owners = assign_owners([found[k][2].numel() for k in range(len(found))], world)
    return [MuonMatrix(s, i, shape, owner, pieces, heads) for (s, i, shape, pieces, heads), owner in zip(found, owners)]


class ShardedMuon:
    """Runs MuonWithAuxAdam's step over a ZeRO optimizer's shards ([Note: Muon under ZeRO])."""

    def __init__(self, optimizer: MuonWithAuxAdam, shards: list[Any], shapes: list[list[torch.Size]],
                 model_param_groups: list[list[torch.Tensor]], group: Any, comm_device: torch.device,
                 names: dict[int, str]) -> None:
        self.optimizer, self.shards, self.group = optimizer, shards, group
        self.rank, self.world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
        self.comm_device = comm_device
        self.exchanges: list[tuple[dict, list[MuonMatrix]]] = []   # (param group, its matrices)
        for params, base_group in zip(model_param_groups, optimizer.param_groups):
            if base_group.get("use_muon"):
                matrices = plan_matrices(shards, shapes, {id(p) for p in params}, self.world)
                for m in matrices:
                    if len(m.shape) < 2:
                        name = names.get(id(shards[m.shard].params[m.index]), "?")
                        raise ValueError(f"Muon: parameter {name} of shape {tuple(m.shape)} is tagged use_muon=True "
                                         "but Muon needs a matrix (ndim >= 2); set param.use_muon = False")
                self.exchanges.append((base_group, matrices))

    @staticmethod
    def maybe(optimizer: Any, *args: Any) -> "ShardedMuon | None":
        return ShardedMuon(optimizer, *args) if isinstance(optimizer, MuonWithAuxAdam) else None

    def step(self) -> None:
        """Muon directions for every fragment, then the base step applies them (Adam groups too)."""
        masters = {(s, f.index, f.param_start): m for s, shard in enumerate(self.shards)
                   for m, f in shard.fragment_masters}
        for group, matrices in self.exchanges:
            self._directions(group, matrices, masters)
        with self.optimizer.directions_given():
            self.optimizer.step()

    def _directions(self, group: dict, matrices: list[MuonMatrix], masters: dict) -> None:
        rank, world = self.rank, self.world
        device = next(iter(masters.values())).device if masters else self.comm_device
        dtype = ns_compute_dtype(group["ns_method"], device)
        mine = {}   # (matrix position, param_start) -> direction of my fragment, wire dtype
        for k, m in enumerate(matrices):
            for f in m.pieces[rank]:
                master = masters[(m.shard, m.index, f.param_start)]
                grad = master.grad if master.grad is not None else torch.zeros_like(master)
                mine[(k, f.param_start)] = self.optimizer.momentum_step(master, grad, group).to(dtype)
        owned = [k for k, m in enumerate(matrices) if m.owner == rank]
        whole = {k: torch.empty(matrices[k].shape.numel(), dtype=dtype, device=device) for k in owned}
        for k in owned:
            for f in matrices[k].pieces[rank]:
                whole[k][f.param_start:f.param_start + f.numel].copy_(mine[(k, f.param_start)])
        # to the owners: per destination rank, my fragments of the matrices it owns, in plan order
        sends = [[(k, f) for k, m in enumerate(matrices) if m.owner == dst and dst != rank for f in m.pieces[rank]]
                 for dst in range(world)]
        receives = [[(k, f) for k in owned for f in matrices[k].pieces[src]] if src != rank else []
                    for src in range(world)]
        # the same answer on every rank (the plan is), so every rank joins the same collectives
        crossing = any(f.numel for m in matrices for r, frags in enumerate(m.pieces) if r != m.owner for f in frags)
        if not crossing:
            sends = receives = [[] for _ in range(world)]
        received = self._exchange([[mine[(k, f.param_start)] for k, f in ss] for ss in sends], receives, dtype,
                                  crossing)
        for rs, chunk in zip(receives, received):
            for (k, f), piece in zip(rs, chunk):
                whole[k][f.param_start:f.param_start + f.numel].copy_(piece)
        result = {k: orthogonalize_param(self.shards[matrices[k].shard].params[matrices[k].index], whole[k],
                                         matrices[k].shape, group["ns_method"])
                  for k in owned}   # a tensor-parallel slice is joined over its tensor group first
        # back: per rank, the slices of my matrices' results that its fragments cover
        back = self._exchange([[result[k][f.param_start:f.param_start + f.numel] for k, f in rs] for rs in receives],
                              sends, dtype, crossing)
        for ss, chunk in zip(sends, back):
            for (k, f), piece in zip(ss, chunk):
                mine[(k, f.param_start)] = piece
        for k in owned:
            for f in matrices[k].pieces[rank]:
                mine[(k, f.param_start)] = result[k][f.param_start:f.param_start + f.numel]
        for k, m in enumerate(matrices):
            for f in m.pieces[rank]:
                master = masters[(m.shard, m.index, f.param_start)]
                master.grad = mine[(k, f.param_start)].to(device=master.device, dtype=master.dtype)

    def _exchange(self, outgoing: list[list[torch.Tensor]], incoming: list[list[tuple[int, Any]]],
                  dtype: torch.dtype, crossing: bool) -> list[list[torch.Tensor]]:
        """One all-to-all: `outgoing[r]` (tensors) to rank r; returns, per source rank, the pieces
        described by `incoming[r]` ((matrix, fragment) pairs, sized by fragment.numel)."""
        in_splits = [sum(t.numel() for t in ts) for ts in outgoing]
        out_splits = [sum(f.numel for _, f in rs) for rs in incoming]
        if not crossing:
            return [[] for _ in incoming]
        flat = [t.reshape(-1) for ts in outgoing for t in ts]
        send = (torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.comm_device)).to(self.comm_device)
        recv = torch.empty(sum(out_splits), dtype=dtype, device=self.comm_device)
        ds_comm.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        pieces, offset = [], 0
        for rs in incoming:
            chunk = []
            for _, f in rs:
                chunk.append(recv[offset:offset + f.numel])
                offset += f.numel
            pieces.append(chunk)
        return pieces
