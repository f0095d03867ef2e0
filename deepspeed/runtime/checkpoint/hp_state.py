"""The engine's high-precision training state, as checkpoints see it: one piece per parameter slice.

Three optimizer arrangements hold that state differently (see optimizer_wrapper.py): the bare
torch optimizer (stage 0 fp32: the parameters are the masters), MixedPrecisionOptimizer (stage
0 fp16/bf16: a full fp32 master per parameter) and ZeroOptimizer (stages 1-2: this rank's
fragments of per-bucket fp32 shards). `HpState` flattens all three into `pieces`: for each
slice of a trainable parameter this rank holds, its name, offset, fp32 master view and the
tensor its base-optimizer state is keyed by. Saving and loading work on pieces only, which is
what lets any stage and world size load what any other wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ... import comm as ds_comm
from .view import CheckpointView


@dataclass
class Piece:
    name: str
    group: int             # index of the optimizer param group
    start: int             # offset inside the flattened parameter
    numel: int
    master: torch.Tensor   # 1-D view of the fp32 (master) values (NVMe offload: read through `HpState.value`)
    key: torch.Tensor      # what the base optimizer's state is keyed by
    shard: int | None = None   # ZeRO: index of its bucket / unit in `HpState.sources`
    shard_start: int = 0       # ZeRO: offset inside that shard's master


class HpState:
    """This rank's pieces plus the layout every rank agrees on (groups of (name, shape))."""

    def __init__(self, view: CheckpointView) -> None:
        wrapper = view.optimizer
        self.wrapper = wrapper
        self.names = {id(p): n for n, p in view.module.named_parameters()}
        # the wrapper's arrangement, as it declares it (the `fragment_layout` deepspeed.utils.tensor_fragment
        # reads too): no import of the optimizer classes, which import this module
        layout = getattr(type(wrapper), "fragment_layout", None)
        self.stage3 = layout == "units"
        self.zero = layout in ("buckets", "units")
        self.mixed = layout == "masters"
        self.base: torch.optim.Optimizer = wrapper.optimizer if (self.zero or self.mixed) else wrapper
        # the sharded layout: per bucket (stages 1-2) or gather unit (stage 3), a BucketPartition
        # over `params`, this rank's fp32 `master` slice of it and the trained `fragments`
        self.sources = (wrapper.units if self.stage3 else wrapper.buckets) if self.zero else []
        self.swapper = getattr(wrapper, "swapper", None) if self.zero else None   # offload_optimizer nvme
        self.streamed = False   # the last `recut` gave StreamedTensors
        self.exchange = None    # ... produced by this ExchangedRecut while it writes the file
        self.view = None        # ... read through this SaveView (a background save: optimizer_swapper.py)
        # ZeRO-3 parameters are released between uses: their shapes come from their units
        shapes = {id(p): s for u in wrapper.coordinator.units for p, s in zip(u.params, u.shapes)} \
            if self.stage3 else {}
        all_groups = wrapper.model_param_groups if (self.zero or self.mixed) else \
            [list(g["params"]) for g in self.base.param_groups]
        # every parameter the optimizer was given, frozen ones included (torch state_dict indices)
        self.optimizer_names = [[self.names[id(p)] for p in g] for g in all_groups]
        model_groups = [[p for p in g if p.requires_grad] for g in all_groups]
        self.groups = [[(self.names[id(p)], shapes.get(id(p), p.shape)) for p in g] for g in model_groups]
        self.pieces: list[Piece] = []
        group_of = {id(p): i for i, g in enumerate(model_groups) for p in g}
        if self.zero:
            for s, sb in enumerate(self.sources):
                for f in sb.fragments:
                    p = sb.params[f.index]
                    key = wrapper._fragments_of[id(p)][0]
                    self.pieces.append(Piece(self.names[id(p)], group_of[id(p)], f.param_start, f.numel,
                                             sb.master[f.shard_start:f.shard_start + f.numel], key, s,
                                             f.shard_start))
        else:
            masters = {id(p): m for p, m in getattr(wrapper, "_pairs", [])}
            for i, (g, base_group) in enumerate(zip(model_groups, self.base.param_groups)):
                keys = {id(k): k for k in base_group["params"]}
                for p in g:
                    master = masters.get(id(p), p)
                    assert id(master) in keys, "optimizer param groups changed after initialize"
                    self.pieces.append(Piece(self.names[id(p)], i, 0, p.numel(), master.data.view(-1), master))

    # --- values -----------------------------------------------------------------------------
    def value(self, piece: Piece, field: str) -> torch.Tensor | None:
        """The piece's master (`field="fp32"`) or base-optimizer state (None: absent). With NVMe
        offload inside the swapper's `streaming` (a save), the piece's shard is read in first and the
        previous one dropped ([Note: optimizer state swapping]): callers walk the pieces in order."""
        if field != "fp32":
            return self.state_value(piece, field)
        if self.swapper is None or piece.shard is None:
            return piece.master
        self.swapper.hold(piece.shard)
        return self.sources[piece.shard].master[piece.shard_start:piece.shard_start + piece.numel]

    def state_value(self, piece: Piece, field: str) -> torch.Tensor | None:
        if self.swapper is not None and piece.shard is not None:
            self.swapper.hold(piece.shard)
        value = self.base.state.get(piece.key, {}).get(field)
        if torch.is_tensor(value) and value.numel() == piece.numel and value.dim() > 0:
            return value.reshape(-1)
        return None

    def local_fields(self) -> tuple[list[str], Any]:
        """(sorted per-element state fields, the step count) present on this rank."""
        fields, step = set(), None
        for piece in self.pieces:
            for key, value in self.base.state.get(piece.key, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.numel:
                    fields.add(key)
                elif key == "step":
                    step = float(value) if torch.is_tensor(value) else value
        return sorted(fields), step

    def agreed_fields(self, group: Any) -> tuple[list[str], Any]:
        """The fields and step of every rank (a rank may hold no piece at all)."""
        mine = self.local_fields()
        if not self.zero or ds_comm.get_world_size(group) == 1:
            return mine
        everyone: list[Any] = [None] * ds_comm.get_world_size(group)
        ds_comm.all_gather_object(everyone, mine, group=group)
        return combine_fields(everyone)

    def local_values(self, field: str) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, offset in the flattened parameter, fp32 values) of each piece this rank holds,
        for the master (`field="fp32"`) or a base-optimizer state."""
        for piece in self.pieces:
            value = self.value(piece, field)
            if value is not None:
                yield piece.name, piece.start, value.float()

    def recut_fields(self, fields: list[str], layouts: list[Any], rank: int,
                     strip_padding: set[str] = frozenset(), later: list | None = None) -> dict[str, list[torch.Tensor]]:
        """For each field ("fp32" or an optimizer state), this rank's slice of every param group's
        flat (`layouts`: one BucketPartition or ParamwisePartition per group over `self.groups`),
        gathered from the ranks holding the pieces.

        Replicated state is cut locally. Under ZeRO the plan of who sends what to whom follows
        from the bucket (or unit) and group partitions, which every rank knows, so one all-to-all
        for all fields together moves exactly the elements each rank lacks (1/N of each field per
        rank) and nothing else; elements that stay on their rank are copied directly, and when no
        element changes rank (ZeRO-3 units, whose per-parameter pieces are the files' pieces) no
        collective runs at all. Fields in `strip_padding` drop a BucketPartition's end padding.

        The all-to-all runs while the elements that stay here are copied. With `later` (a list),
        the work that reads only tensors made here (copying the received elements into place,
        zeroing the padding) is appended to it as a callable instead of done: a background save
        runs it on its thread ([Note: background save]); the slices are complete after it ran.
        """
        zero = not self.zero or self.wrapper.dp_world == 1
        new = torch.zeros if zero else torch.empty  # under ZeRO only the padding is zeroed (below)
        flats = {field: [new(layout.shard_numel - (layout.padding(rank) if field in strip_padding else 0),
                             dtype=torch.float32) for layout in layouts] for field in fields}
        if zero:   # piece by piece (NVMe offload: each shard read once), every field of each
            cuts = self._cutter(layouts)
            for piece in self.pieces:
                for field in fields:
                    value = self.value(piece, field)
                    if value is None:
                        continue
                    for dst, g, at, n, src in cuts(piece.name, piece.start, value.numel()):
                        if dst == rank:
                            flats[field][g][at:at + n].copy_(value[src:src + n].float())
            return flats
        sends, receives, local, crossing = self._plan(layouts, rank)
        device = self.wrapper._comm_device   # also on a rank without buckets ([Note: collective device])
        in_splits = [len(fields) * sum(t[2] for t in ss) for ss in sends]
        send = torch.empty(sum(in_splits), dtype=torch.float32, device=device)
        # the send buffer: per destination, field by field, in plan order; filled piece by piece
        # (NVMe offload: in shard order, each shard read once)
        fills, offset = [], 0   # (piece, offset in the piece, length, where field 0 goes, field stride)
        for ss in sends:
            length = sum(t[2] for t in ss)
            at = offset
            for piece, src, n, *_ in ss:
                fills.append((piece, src, n, at, length))
                at += n
            offset += len(fields) * length
        order = {id(p): k for k, p in enumerate(self.pieces)}
        for piece, src, n, at, length in sorted(fills, key=lambda t: order[id(t[0])]):
            for k, field in enumerate(fields):
                value = self.value(piece, field)
                out = send[at + k * length:at + k * length + n]
                if value is None:
                    out.zero_()
                else:
                    out.copy_(value[src:src + n])
        work, recv = None, None
        if crossing:  # started before the local copies, which then overlap the transfer
            out_splits = [len(fields) * sum(n for _, _, n in rs) for rs in receives]
            recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
            work = ds_comm.all_to_all_single(recv, send, out_splits, in_splits, group=self.wrapper.group,
                                             async_op=True)
        for piece, src, n, g, at in sorted(local, key=lambda t: order[id(t[0])]):   # what stays here skips the wire
            for field in fields:
                value = self.value(piece, field)
                if value is None:
                    flats[field][g][at:at + n].zero_()
                else:
                    flats[field][g][at:at + n].copy_(value[src:src + n])
        if work is not None:
            work.wait()
        del send
        written = [(g, at, n) for _, _, n, g, at in local] + [r for rs in receives for r in rs]

        def finish() -> None:
            offset, received = 0, recv.cpu() if recv is not None else None
            for rs in receives if received is not None else ():
                for field in fields:
                    for g, at, n in rs:
                        flats[field][g][at:at + n].copy_(received[offset:offset + n])
                        offset += n
            _zero_gaps(flats, written)

        if later is None:
            finish()
        else:
            later.append(finish)
        return flats

    def _cutter(self, layouts: list[Any]) -> Callable:
        where = {n: (g, i) for g, group in enumerate(self.groups) for i, (n, _) in enumerate(group)}

        def cuts(name: str, start: int, numel: int):
            """(destination rank, group, offset in its slice, length, offset in the piece)."""
            g, i = where[name]
            return ((dst, g, at, n, src) for dst, at, n, src in layouts[g].placements(i, start, numel))
        cuts.where = where
        return cuts

    def _plan(self, layouts: list[Any], rank: int) -> tuple[list, list, list, bool]:
        """Who sends what to whom under ZeRO (every rank walks the same plan in the same order):
        per destination (piece, offset, length, group, offset in its slice) to send, per source
        (group, offset in slice, length) to receive, what stays here (piece, offset, length, group, offset in slice), and whether any
        element changes rank at all (the same answer on every rank)."""
        cuts = self._cutter(layouts)
        world = self.wrapper.dp_world
        sends: list[list[tuple]] = [[] for _ in range(world)]   # (piece, offset, length, group, offset in slice)
        mine = {(p.name, p.start): p for p in self.pieces}
        receives: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        local: list[tuple[Piece, int, int, int, int]] = []  # (piece, offset, length, group, offset in slice)
        crossing = False
        for sb in self.sources:  # every rank walks the same plan in the same order
            for src_rank in range(world):
                for f in sb.partition.fragments(src_rank):
                    name = self.names[id(sb.params[f.index])]
                    if name not in cuts.where:   # frozen: no master, no optimizer state
                        continue
                    for dst, g, at, n, src in cuts(name, f.param_start, f.numel):
                        crossing = crossing or dst != src_rank
                        if src_rank == rank and dst == rank:  # already here: copied directly
                            local.append((mine[(name, f.param_start)], src, n, g, at))
                        elif src_rank == rank:
                            sends[dst].append((mine[(name, f.param_start)], src, n, g, at))
                        elif dst == rank:
                            receives[src_rank].append((g, at, n))
        return sends, receives, local, crossing

    def recut(self, fields: list[str], layouts: list[Any], rank: int, strip_padding: set[str] = frozenset(),
              later: list | None = None, stream: bool = False) -> dict[str, list[Any]]:
        """`streamed_fields` when `stream` and it can (then `self.streamed` is set), else `recut_fields`."""
        parts = self.streamed_fields(fields, layouts, rank, strip_padding) if stream else None
        self.streamed = parts is not None
        return parts if parts is not None else self.recut_fields(fields, layouts, rank, strip_padding, later)

    def streamed_fields(self, fields: list[str], layouts: list[Any], rank: int,
                        strip_padding: set[str] = frozenset()) -> dict[str, list[Any]] | None:
        """`recut_fields`' result as StreamedTensors whose bytes are read from the NVMe swap files
        when the file is written, one chunk at a time ([Note: streamed checkpoint file]); None
        (re-cut in memory) without NVMe offload. When elements change rank (ZeRO-1/2 at more than
        one rank) they are produced by `self.exchange`, whose all-to-all runs window by window while
        it writes the file ([Note: streamed re-cut]): collective then."""
        from ...checkpoint.stream_save import StreamedTensor

        if self.swapper is None:
            return None
        if self.zero and self.wrapper.dp_world > 1:
            sends, receives, local, crossing = self._plan(layouts, rank)
            if crossing:   # [Note: streamed re-cut]: exchanged while the file is written (collective)
                from .stream_recut import ExchangedRecut

                self.exchange = ExchangedRecut(self, fields, layouts, rank, strip_padding, sends, receives, local)
                return self.exchange.parts
        else:
            cuts = self._cutter(layouts)
            local = [(p, src, n, g, at) for p in self.pieces
                     for dst, g, at, n, src in cuts(p.name, p.start, p.numel) if dst == rank]
        segments: list[list[tuple[int, int, Piece, int]]] = [[] for _ in layouts]   # (at, length, piece, src)
        for piece, src, n, g, at in local:
            segments[g].append((at, n, piece, src))
        for g in segments:
            g.sort(key=lambda t: t[0])

        def produce(field: str, g: int, numel: int):
            def chunks():
                pos = 0
                for at, n, piece, src in segments[g]:
                    yield from _zeros(at - pos)
                    yield from self._stored_chunks(piece, field, src, n)
                    pos = at + n
                yield from _zeros(numel - pos)
            return chunks

        out = {}
        for field in fields:
            out[field] = []
            for g, layout in enumerate(layouts):
                numel = layout.shard_numel - (layout.padding(rank) if field in strip_padding else 0)
                out[field].append(StreamedTensor(numel, torch.float32, produce(field, g, numel)))
        return out

    def streamed_piece(self, piece: Piece, field: str) -> Any:
        """The piece's master (`field="fp32"`) or optimizer state as a StreamedTensor read from the NVMe
        swap files when the file is written; None when the piece has no such state (MoE pieces)."""
        from ...checkpoint.stream_save import StreamedTensor

        if self._stored(piece, field) is None:
            return None
        return StreamedTensor(piece.numel, torch.float32, lambda: self._stored_chunks(piece, field, 0, piece.numel))

    def _stored_chunks(self, piece: Piece, field: str, src: int, n: int) -> Iterator[torch.Tensor]:
        """Elements [src, src + n) of the piece's `field` as fp32 chunks from the swap files (zeros: none)."""
        source = self._stored(piece, field)
        if source is None:
            yield from _zeros(n)
            return
        i, fragment, key, offset = source
        yield from self.swapper.read_slice(i, fragment, key, offset + src, n, view=self.view)

    def _stored(self, piece: Piece, field: str) -> tuple[int, Any, Any, int] | None:
        """(shard, fragment or None for the master, state key, element offset) of the piece's
        `field` in the swapper's files; None when the piece has no such state."""
        if field == "fp32":
            return piece.shard, None, None, piece.shard_start
        value = self.base.state.get(piece.key, {}).get(field)
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.numel:
            return piece.shard, piece.key, field, 0
        return None

    # --- writing back -------------------------------------------------------------------------
    def refresh_model(self) -> None:
        """Copy the masters into the model's parameters after they were loaded."""
        if self.stage3:
            self.wrapper.refresh_from_masters()
        elif self.zero:
            self.wrapper._all_gather_params()
        elif self.mixed:
            pairs = self.wrapper._pairs
            if pairs:
                torch._foreach_copy_([p.data for p, _ in pairs], [m.data for _, m in pairs])


def _zeros(numel: int, chunk: int = 1 << 22):
    """`numel` fp32 zeros in chunks (a streamed tensor's gaps: the layout's padding)."""
    for at in range(0, max(numel, 0), chunk):
        yield torch.zeros(min(chunk, numel - at), dtype=torch.float32)  # host: checkpoint file bytes


def _zero_gaps(flats: dict[str, list[torch.Tensor]], written: list[tuple[int, int, int]]) -> None:
    """Zero what no (group, offset, length) range in `written` covers: the layout's padding (the
    flats were allocated uninitialised, which spares a pass over the whole slice)."""
    by_group: dict[int, list[tuple[int, int]]] = {}
    for g, at, n in written:
        by_group.setdefault(g, []).append((at, at + n))
    for fields in flats.values():
        for g, flat in enumerate(fields):
            end = 0
            for lo, hi in sorted(by_group.get(g, [])) + [(flat.numel(), flat.numel())]:
                if lo > end:
                    flat[end:lo].zero_()
                end = max(end, hi)


def upstream_scaler(scaler: Any) -> Any:
    """The loss scaler as DeepSpeed's class at DeepSpeed's import path (its loader unpickles it)."""
    from ..fp16.loss_scaler import DynamicLossScaler, LossScaler

    cls = DynamicLossScaler if scaler.dynamic else LossScaler
    copy = cls.__new__(cls)
    copy.__dict__.update({k: v for k, v in vars(scaler).items() if not callable(v)})
    return copy


def combine_fields(everyone: list[tuple[list[str], Any]]) -> tuple[list[str], Any]:
    """The fields and step of a group from each rank's `local_fields()`."""
    fields = sorted({f for fs, _ in everyone for f in fs})
    steps = {s for _, s in everyone if s is not None}
    return fields, (steps.pop() if steps else None)

