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
import shutil
import sys

import torch

from ..utils.progress import progress
from .files import CheckpointError, model_file, save_file, write_text
from .reader import CheckpointReader

_PER_ELEMENT = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings",
                "fp32_flat_groups", "optimizer_state_dict")


def convert(input_folder: str, output_folder: str) -> int:
    """Write the universal checkpoint of tag directory `input_folder`; returns the parameter count."""
    input_folder = os.path.normpath(input_folder)
    reader = CheckpointReader(os.path.dirname(input_folder) or ".", os.path.basename(input_folder))
    if reader.universal:
        raise CheckpointError(f"{input_folder} is already a universal checkpoint")
    zero_dir = os.path.join(output_folder, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    fields = ["fp32"] + reader.fields()
    names = reader.param_names()
    for name in progress(names, desc="Converting to universal", unit="param"):
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        shape = reader.groups()[reader._where[name][0]][reader._where[name][1]][1]
        for field in fields:
            value = reader.read(name, field)
            if value is not None:
                save_file({"param": value.view(shape)}, os.path.join(folder, f"{field}.pt"))
        if reader.step is not None:
            save_file(torch.tensor(float(reader.step)), os.path.join(folder, "step.pt"))  # host: a file
    common = {}
    if reader.optimizer_state:
        common = {k: v for k, v in reader.optimizer_state[0].items() if k not in _PER_ELEMENT}
    common["param_groups"] = [dict(g, params=[i]) for i, g in enumerate(reader.param_groups)]
    save_file(common, os.path.join(zero_dir, "optimizer_state.pt"))
    source = os.path.join(reader.path, model_file())
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(output_folder, model_file()))
    else:  # ZeRO-3: rank 0's model states, with each frozen parameter whole instead of rank 0's piece
        states = dict(reader.model_states)
        frozen = states.get("frozen_param_shapes") or {}
        states["frozen_param_fragments"] = {n: reader.module_tensor(n) for n in frozen} if frozen else None
        save_file(states, os.path.join(output_folder, model_file()))
    parent = os.path.dirname(os.path.normpath(output_folder)) or "."
    write_text(os.path.join(parent, "latest_universal"), os.path.basename(os.path.normpath(output_folder)))
    return len(names)


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
