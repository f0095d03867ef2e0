"""`ds_to_universal` of checkpoints in the MoE layout (AutoEP, `deepspeed.moe` with any ep_size).

Such a tag ([Note: MoE checkpoint layout] in runtime/checkpoint/moe_io.py) keeps the module without
experts in `mp_rank_00_model_states.pt`, one `layer_{L}_expert_{E}_...` file per global expert, and the
optimizer as named pieces (`ds_moe_pieces`: global name, offset into the whole tensor, fp32 master and
every optimizer field) in each rank's `expp_rank_*` (no ZeRO) or `zero_pp_rank_*` (ZeRO) file. The
pieces name what they are, so the whole tensors are joined from all files whatever ep_size, data size
and ZeRO stage wrote them, and written in upstream's universal layout: `zero/<name>/<field>.pt` with
`{"param": whole tensor}`. An AutoEP expert tensor (the fused HF `[num_experts, ...]` tensor under the
layer's `expert_key_prefix` of `ds_autoep_layers`) also carries upstream's markers: `cat_dim` 0,
`is_expert_param` and `ep_num_experts`, from which any ep_size cuts its rows. `deepspeed.moe` experts
are one parameter per global expert (`...deepspeed_experts.{E}...`), each written whole under that name.
The model-states and per-expert files are copied (both are independent of ep_size). With tensor
parallelism (EP x TP: one `mp_rank_XX` file set per tensor rank) the sets are joined too. The tag is
indexed first and joined one parameter at a time (moe_join.py, [Note: joining a MoE-layout tag per parameter]).
For AutoEP the files are DeepSpeed 0.19.8's form (`common_state`), which its load_universal reads.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Any, Callable, Iterable, Iterator

import torch

from .constants import AUTOEP_LAYERS_KEY, AUTOEP_ZERO3_SOURCE_GROUP, CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM
from ..version import __version__
from ..utils.progress import progress
from .files import CheckpointError, load_file, model_file, save_file
from .moe_join import MoEIndex
from .reader import CheckpointReader


def is_moe_layout(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "layer_*_expert_*_model_states.pt")))


def _expert_markers(states: dict) -> dict[str, dict]:
    """{expert_key_prefix: universal markers} of each AutoEP layer the model states describe."""
    out = {}
    for entry in states.get(AUTOEP_LAYERS_KEY) or []:
        out[entry["expert_key_prefix"]] = {CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                                           EP_NUM_EXPERTS: int(entry["num_experts"])}
    return out


def _markers(name: str, prefixes: dict[str, dict]) -> dict:
    owner = name.rpartition(".")[0]
    return prefixes.get(owner, {})


class JoinedReader(CheckpointReader):
    """A MoE-layout tag read as its universal form would be: how load_checkpoint reads an EP x TP checkpoint at
    another tensor or expert-parallel size, each rank then cutting its slices as from a universal checkpoint
    (runtime/checkpoint/tp_reslice.universal_cut_reader). The tag is indexed up front (moe_join.MoEIndex:
    every refusal raised before anything is read) and a field of a parameter is joined when the loader first
    asks for it, replacing the one held before: the loader reads parameter by parameter, field by field
    (`_plan_optimizer_state`, then the masters in `apply_plan`), so each is joined once and one parameter's
    field is held at a time ([Note: joining a MoE-layout tag per parameter])."""

    def __init__(self, path: str, tag: str) -> None:   # (not CheckpointReader's: no rank files)
        index = self._index = MoEIndex(path)
        self.path, self.tag, self.mp_rank, self.universal = path, tag, 0, True
        self.rank_files, self.zero_states, self.optimizer_state = [], [], []
        self.mappings = index.mappings
        self._partitions, self._parts, self._read_ranks, self._stage_value, self._full = [], {}, set(), 0, {}
        # the trained parameters' module entries are never read (their fp32 masters are): not joined
        states = index.whole_model_states(skip=frozenset(index.names))
        self.model_states = universal_states(states, index.names, index.shapes)
        self._set_groups([{n: torch.Size(index.shapes[n]) for n in index.names}])
        self._all_fields = sorted({f for n in index.names for f in index.fields(n) if f != "fp32"})
        self.common_state = common_state(index.param_groups, index.loss_scaler, states)
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.common_state["param_groups"]]
        self._step = float(next(iter(index.steps))) if index.steps else None
        self._held: tuple[str, str, torch.Tensor] | None = None   # (name, field, whole flat): the one joined

    def fields(self) -> list[str]:
        return self._all_fields

    def has_field(self, name: str, field: str) -> bool:
        return name in self._where and field in self._index.fields(name)

    def _whole(self, name: str, field: str) -> torch.Tensor:
        if self._held is None or self._held[:2] != (name, field):
            self._held = None   # dropped before the next is joined
            value = self._index.join(name, field)
            if value is None:
                raise CheckpointError(f"{self.path}: no {field!r} for parameter {name!r} in the checkpoint")
            self._held = (name, field, value)
        return self._held[2]

    def read_into(self, out: torch.Tensor, name: str, field: str, start: int = 0) -> None:
        g, i, numel = self._locate(name, start, out.numel())
        out.copy_(self._whole(name, field)[start:start + numel])

    def check(self, name: str, field: str, start: int = 0, numel: int | None = None) -> None:
        self._locate(name, start, numel)
        if not self.has_field(name, field):   # (the index checked that the pieces cover it)
            raise CheckpointError(f"{self.path}: no {field!r} for parameter {name!r} in the checkpoint")

    def module_tensor(self, name: str) -> torch.Tensor | None:
        if name in self._where:   # a trained parameter: its fp32 master, as a universal checkpoint holds it
            return self._whole(name, "fp32").view(self._index.shapes[name])
        return super().module_tensor(name)


def convert_moe(input_folder: str, output_folder: str) -> int:
    """Write the universal checkpoint of the MoE-layout tag `input_folder`, one parameter at a time
    ([Note: joining a MoE-layout tag per parameter]); returns the parameter count."""
    index = MoEIndex(input_folder)
    write_universal(output_folder, index.models[0], index.names, index.shapes, index.values, index.steps,
                    index.param_groups, index.loss_scaler, cat_dims=index.cat_dims,
                    model_states=index.whole_model_states)
    for name, source in index.expert_files().items():
        shutil.copyfile(source, os.path.join(output_folder, name))
    return len(index.names)


def write_universal(output_folder: str, states: dict, names: list[str], shapes: dict,
                    values: Callable[[str], Iterator[tuple[str, torch.Tensor]]], steps: set, param_groups: list[dict],
                    loss_scaler: Any, raw_dense: bool = False, cat_dims: dict[str, int] | None = None,
                    common: dict | None = None, model_states: Callable[[], dict] | None = None) -> None:
    """Upstream's universal layout: `zero/<name>/<field>.pt` for each parameter of `names` and each (field, flat
    whole tensor) `values(name)` yields, written as they come, so a caller that makes them on demand holds one
    at a time (AutoEP expert tensors with their markers, tensor-sliced ones with the `cat_dim` of `cat_dims`
    they were joined on, as upstream's converter writes it; with `raw_dense` the other parameters as bare
    tensors, as upstream writes a ZeRO-3 tag's), `step.pt`, `zero/optimizer_state.pt` (with `common`'s
    entries), and the model states (`model_states()`, made last; else `states`) with every trained parameter,
    experts whole, in `param_shapes`."""
    prefixes = _expert_markers(states)
    zero_dir = os.path.join(output_folder, "zero")
    for name in progress(sorted(names), desc="Converting to universal", unit="param"):
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        extra = _markers(name, prefixes) or ({} if raw_dense else {CAT_DIM: (cat_dims or {}).get(name, 0)})
        for field, flat in values(name):
            value = flat.view(shapes[name])
            save_file(value if raw_dense and not extra else {PARAM: value, **extra},
                      os.path.join(folder, f"{field}.pt"))
            del flat, value
        if steps:
            save_file(torch.tensor(float(next(iter(steps)))), os.path.join(folder, "step.pt"))  # host: a file
    save_file({**(common or {}), **common_state(param_groups, loss_scaler, states)},
              os.path.join(zero_dir, "optimizer_state.pt"))
    whole = model_states() if model_states is not None else states
    save_file(universal_states(whole, names, shapes), os.path.join(output_folder, model_file()))


def common_state(param_groups: list[dict], loss_scaler: Any, states: dict) -> dict:
    """`zero/optimizer_state.pt`: the param groups (one index each), the loss scaler and `ds_version` (upstream's
    load_universal asserts it). Upstream's AutoEP engine splits each optimizer group into its dense parameters
    and, appended after all of them, one group per expert group (`split_params_into_different_moe_groups_for_
    optimizer`: `name` "ep_size_<ep>", `moe` True), and its load_universal pairs the saved groups with its own by
    position (zip: a missing group is silently not loaded), so an AutoEP checkpoint's groups are written in that
    form; our loader folds them back (moe_io.source_param_groups)."""
    groups = [dict(g) for g in param_groups]
    sizes = sorted({int(entry["ep_size"]) for entry in states.get(AUTOEP_LAYERS_KEY) or []})
    if sizes and not any(g.get("moe") for g in groups):
        dense = [dict(g, name=g.get("name", "dense-params")) for g in groups]
        groups = dense + [dict(g, name=f"ep_size_{ep}", moe=True) for g in dense for ep in sizes]
    common = {"param_groups": [dict(g, params=[i]) for i, g in enumerate(groups)],
              "ds_version": states.get("ds_version") or __version__}
    if loss_scaler is not None:   # upstream unpickles its scaler class there (the pieces keep a state dict)
        common["loss_scaler"], common["dynamic_loss_scale"] = _scaler_object(loss_scaler)
    return common


def _scaler_object(saved: Any) -> tuple[Any, bool]:
    """(the loss scaler as the object DeepSpeed's ZeRO files pickle, whether it is dynamic) from the state
    dict an MoE checkpoint's pieces keep (or that object itself)."""
    from ..runtime.checkpoint.hp_state import upstream_scaler
    from ..runtime.precision.loss_scaler import scaler_from_state_dict

    if not isinstance(saved, dict):
        return saved, bool(getattr(saved, "dynamic", False))
    scaler = scaler_from_state_dict(saved)
    return upstream_scaler(scaler), scaler.dynamic


def universal_states(states: dict, trained: Iterable[str], shapes: dict) -> dict:
    """The model states with `param_shapes` naming every trained parameter (the universal reader's list)
    at its whole shape: the experts too."""
    listed = [{n: torch.Size(shapes[n]) if n in shapes else s for n, s in g.items()}
              for g in (states.get("param_shapes") or [{}])] or [{}]
    known = {n for g in listed for n in g}
    listed[-1].update({n: torch.Size(shapes[n]) for n in sorted(trained) if n not in known})
    return dict(states, param_shapes=listed)


def is_autoep_zero3_layout(path: str) -> bool:
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 layout ([Note: AutoEP ZeRO-3 layout]): rank 0's model states say so."""
    from ..utils.zero_to_fp32 import is_autoep_zero3_partitioned

    first = os.path.join(path, model_file(0, zero3_dp_rank=0))
    return os.path.isfile(first) and is_autoep_zero3_partitioned(load_file(first))


def convert_autoep_zero3(input_folder: str, output_folder: str) -> int:
    """The universal checkpoint of an AutoEP ZeRO-3 tag: every rank's per-parameter pieces joined into whole
    tensors (`join_autoep_zero3`, which zero_to_fp32 uses), experts [num_experts, ...] with their markers."""
    from ..utils.zero_to_fp32 import join_autoep_zero3

    ranks = {int(m.group(1)): os.path.join(input_folder, f) for f in os.listdir(input_folder)
             for m in [re.search(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$", f)] if m}
    if sorted(ranks) != list(range(len(ranks))) or not ranks:
        raise CheckpointError(f"{input_folder}: AutoEP ZeRO-3 optimizer files of ranks {sorted(ranks)}; expected "
                              "ranks 0..N-1 (they hold every trained weight)")
    models = [load_file(os.path.join(input_folder, model_file(0, zero3_dp_rank=r))) for r in range(len(ranks))]
    optim = [load_file(ranks[r])["optimizer_state_dict"] for r in range(len(ranks))]
    values, shapes = join_autoep_zero3(models, optim, input_folder)
    whole = {f: {n: v.contiguous().reshape(-1) for n, v in by_name.items()} for f, by_name in values.items()}
    base = optim[0]["optimizer_state_dict"]
    steps = {float(entry["step"]) for entry in base["state"].values() if "step" in entry}
    states = dict(models[0], param_shapes=[{n: torch.Size(shapes[n]) for n in g} for g in models[0]["param_shapes"]])
    # upstream's ZeRO-3 load_universal reads the step and hyperparameters from rank 0's optimizer state, kept
    # here as its converter keeps it (without the flat partitions)
    inner = {"state": {i: {"step": e["step"]} for i, e in base["state"].items() if "step" in e},
             "param_groups": base["param_groups"]}
    kept = {k: v for k, v in optim[0].items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
    write_universal(output_folder, states, sorted(whole["fp32"]), shapes,
                    lambda name: ((f, by_name[name]) for f, by_name in whole.items() if name in by_name), steps,
                    source_groups(base["param_groups"]), optim[0].get("loss_scaler"), raw_dense=True,
                    common={**kept, "optimizer_state_dict": inner})
    for r in range(len(ranks)):   # as upstream's converter: its ZeRO-3 load_universal reads these
        shutil.copyfile(os.path.join(input_folder, model_file(0, zero3_dp_rank=r)),
                        os.path.join(output_folder, model_file(0, zero3_dp_rank=r)))
    return len(shapes)


def source_groups(saved: list[dict]) -> list[dict]:
    """The hyperparameters of each optimizer group of the engine that saved an AutoEP ZeRO-3 tag: the first
    sub-group each became (ours record which; in upstream's files each sub-group stands for itself)."""
    firsts: dict[int, dict] = {}
    for i, group in enumerate(saved):
        firsts.setdefault(int(group.get(AUTOEP_ZERO3_SOURCE_GROUP, i)), group)
    ours = any(AUTOEP_ZERO3_SOURCE_GROUP in group for group in saved)   # upstream's: its split groups, kept
    drop = {"params", AUTOEP_ZERO3_SOURCE_GROUP} | ({"name", "moe"} if ours else set())
    return [{k: v for k, v in firsts[g].items() if k not in drop} for g in sorted(firsts)]
