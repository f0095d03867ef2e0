"""`ds_to_universal`: convert a checkpoint tag into DeepSpeed's universal (world-size free) layout.

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step10 \\
        --output_folder ckpt/global_step10_universal
    # writes ckpt/latest_universal too (as DeepSpeed's); load with checkpoint.load_universal

Output: `<out>/zero/<param name>/{fp32,exp_avg,exp_avg_sq,...}.pt` (each `{"param": full fp32
tensor}`), `<out>/zero/<param name>/step.pt`, `<out>/zero/optimizer_state.pt` (the state that
is not per element: loss scaler, param_groups, ...) and a copy of the model-states file.
Any input the reader understands works (ZeRO 0-3, any world size, ours or DeepSpeed's); one
parameter is held in memory at a time. Our engine loads either layout directly, so this is
only needed for tools that expect universal checkpoints.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

import torch

from ..utils.progress import progress
from .files import CheckpointError, model_file, save_file, write_text
from .reader import CheckpointReader

_PER_ELEMENT = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings",
                "fp32_flat_groups", "optimizer_state_dict")


def _open(input_folder: str) -> tuple[list[CheckpointReader], int]:
    """The readers of every model-parallel file set of the tag (one per pipeline stage), and how many
    there are. Each stage's files hold only its own layers' parameters, so all are read: reading
    stage 0 alone wrote a universal checkpoint missing every later stage's parameters."""
    load_dir, tag = os.path.dirname(input_folder) or ".", os.path.basename(input_folder)
    first = CheckpointReader(load_dir, tag)
    if first.universal:
        raise CheckpointError(f"{input_folder} is already a universal checkpoint")
    sets = sorted(int(m.group(1)) for m in (re.match(r"mp_rank_(\d+)_model_states\.pt$", f)
                                            for f in os.listdir(first.path)) if m)
    if len(sets) <= 1:
        return [first], 1
    layers = [f for f in os.listdir(first.path) if re.match(r"layer_\d+-model_states\.pt$", f)]
    sliced = [f for f in os.listdir(first.path) if re.match(r"layer_\d+-model_\d+-model_states\.pt$", f)]
    if not layers or sliced:
        raise CheckpointError(
            f"{input_folder} holds {len(sets)} tensor-parallel file sets (mp_rank_00..{sets[-1]:02d}); ds_to_universal "
            "does not merge tensor-parallel slices yet. Resume it at the same tensor-parallel size (any data-parallel "
            "size or stage count loads it directly), or consolidate the weights with zero_to_fp32")
    readers = [first] + [CheckpointReader(load_dir, tag, mp_rank=m) for m in sets[1:]]
    if not all(r.optimizer_state for r in readers):
        raise CheckpointError(f"{input_folder}: a pipeline checkpoint without ZeRO / mixed-precision optimizer "
                              "partitions has nothing to convert; its per-layer files load at any stage count as they are")
    return readers, len(sets)


def _shapes(reader: CheckpointReader) -> dict[str, torch.Size]:
    return {name: shape for group in reader.groups() for name, shape in group}


def convert(input_folder: str, output_folder: str) -> int:
    """Write the universal checkpoint of tag directory `input_folder`; returns the parameter count."""
    input_folder = os.path.normpath(input_folder)
    readers, sets = _open(input_folder)
    reader = readers[0]
    zero_dir = os.path.join(output_folder, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    owners: dict[str, tuple[int, torch.Size]] = {}   # a tied weight is in several stages' files: once
    for stage, r in enumerate(readers):
        for name, shape in _shapes(r).items():
            owners.setdefault(name, (stage, shape))
    for name, (stage, shape) in progress(list(owners.items()), desc="Converting to universal", unit="param"):
        source = readers[stage]
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        for field in ["fp32"] + source.fields():
            value = source.read(name, field)
            if value is not None:
                save_file({"param": value.view(shape)}, os.path.join(folder, f"{field}.pt"))
        if source.step is not None:
            save_file(torch.tensor(float(source.step)), os.path.join(folder, "step.pt"))  # host: a file
    common = {}
    if reader.optimizer_state:
        common = {k: v for k, v in reader.optimizer_state[0].items() if k not in _PER_ELEMENT}
    common["param_groups"] = [dict(g, params=[i]) for i, g in enumerate(reader.param_groups)]
    save_file(common, os.path.join(zero_dir, "optimizer_state.pt"))
    source = os.path.join(reader.path, model_file())
    if os.path.isfile(source):
        for m in range(sets):   # every stage's counters and scheduler, as upstream copies mp_rank_*
            shutil.copyfile(os.path.join(reader.path, model_file(m)), os.path.join(output_folder, model_file(m)))
    else:  # ZeRO-3: rank 0's model states, with each frozen parameter whole instead of rank 0's piece
        states = dict(reader.model_states)
        frozen = states.get("frozen_param_shapes") or {}
        states["frozen_param_fragments"] = {n: reader.module_tensor(n) for n in frozen} if frozen else None
        save_file(states, os.path.join(output_folder, model_file()))
    parent = os.path.dirname(os.path.normpath(output_folder)) or "."
    write_text(os.path.join(parent, "latest_universal"), os.path.basename(os.path.normpath(output_folder)))
    return len(owners)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="checkpoint tag directory, e.g. ckpt/global_step10")
    parser.add_argument("--output_folder", required=True, help="universal checkpoint directory to create")
    # accepted for command-line compatibility with DeepSpeed's script; conversion is sequential here
    parser.add_argument("--num_extract_workers", type=int, default=4)
    parser.add_argument("--num_merge_workers", type=int, default=2)
    parser.add_argument("--keep_temp_folder", action="store_true")
    parser.add_argument("--strict", dest="strict", action="store_true", default=True)
    parser.add_argument("--no_strict", dest="strict", action="store_false")
    parser.add_argument("--inject_missing_state", action="store_true")
    args = parser.parse_args(argv)
    try:
        count = convert(args.input_folder, args.output_folder)
    except CheckpointError as error:
        print(f"ds_to_universal: {error}", file=sys.stderr)
        return 2
    print(f"ds_to_universal: wrote {count} parameters to {os.path.join(args.output_folder, 'zero')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
