"""AutoEP expert parameters in DeepSpeed's universal-checkpoint conversion (its module path).

DeepSpeed's converter first splits every ZeRO-1/2 optimizer file into per-DP-rank fragment files,
`<temp>/<param>/0/<state>.<dp:02d>`; an AutoEP expert parameter's fragments on the DP ranks of one
EP rank hold that rank's experts. `consolidate_autoep_zero12_expert_states` joins them into the
whole [num_experts, ...] tensor per state (fp32, exp_avg, exp_avg_sq), written as universal files
marked as expert tensors, and the step. (This package's own converter, ds_to_universal.py, reads
checkpoints through CheckpointReader and writes whole tensors directly.)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _zero12_fragment_path(temp_dir: str, param_name: str, state_name: str, dp_rank: int) -> str:
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:02d}")


def autoep_zero12_dp_ranks(ep_rank: int, dp_degree: int, ep_size: int, use_data_before_expert_parallel: bool) -> range:
    """The DP ranks holding EP rank `ep_rank`'s experts: strided by ep (EP groups of consecutive
    ranks, the default), or a consecutive block (use_data_before_expert_parallel)."""
    if dp_degree % ep_size:
        raise RuntimeError(f"ZeRO DP degree {dp_degree} is not divisible by autoep_size {ep_size}")
    if use_data_before_expert_parallel:
        block = dp_degree // ep_size
        return range(ep_rank * block, (ep_rank + 1) * block)
    return range(ep_rank, dp_degree, ep_size)


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def consolidate_autoep_zero12_expert_states(temp_dir: str, output_dir: str, expert_param_info: dict, slice_shapes: dict,
                                            dp_degree: int, tp_degree: int,
                                            use_data_before_expert_parallel: bool) -> None:
    """For each expert parameter (`expert_param_info[name]`: num_experts, num_local_experts, ep_size;
    `slice_shapes[name]`: one EP rank's shape), write `<output>/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`
    (the whole tensor, experts in order) and `step.pt`."""
    if tp_degree != 1:
        raise NotImplementedError("AutoEP ZeRO-1/2 universal conversion with tensor parallelism is not supported")
    for name, info in expert_param_info.items():
        if name not in slice_shapes:
            raise RuntimeError(f"AutoEP expert parameter {name} has no shape in the checkpoint")
        shape, ep, experts = tuple(slice_shapes[name]), info["ep_size"], info["num_experts"]
        if not shape or shape[0] != info["num_local_experts"]:
            raise RuntimeError(f"AutoEP {name}: slice shape {shape} does not hold num_local_experts="
                               f"{info['num_local_experts']}")
        out = os.path.join(output_dir, "zero", name)
        os.makedirs(out, exist_ok=True)
        for state in STATES:
            pieces = []
            for ep_rank in range(ep):
                paths = [_zero12_fragment_path(temp_dir, name, state, d)
                         for d in autoep_zero12_dp_ranks(ep_rank, dp_degree, ep, use_data_before_expert_parallel)]
                flat = [_load(p).flatten() for p in paths if os.path.isfile(p)]
                local = torch.cat(flat) if flat else torch.empty(0)  # host: offline checkpoint conversion
                if local.numel() != torch.Size(shape).numel() or (flat and local.dtype != torch.float32):
                    raise RuntimeError(f"AutoEP {name} {state}: EP rank {ep_rank}'s fragments hold {local.numel()} "
                                       f"{local.dtype} values, expected {torch.Size(shape).numel()} fp32")
                pieces.append(local.view(shape))
            torch.save({PARAM: torch.cat(pieces), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: experts},
                       os.path.join(out, f"{state}.pt"))
        steps = [_load(p) for p in (_zero12_fragment_path(temp_dir, name, "step", d) for d in range(dp_degree))
                 if os.path.isfile(p)]
        first = torch.as_tensor(steps[0]) if steps else None   # host: offline conversion
        if first is None or any(not torch.equal(torch.as_tensor(s), first) for s in steps):  # host: offline
            raise RuntimeError(f"AutoEP {name}: the optimizer step is missing or differs across DP ranks ({steps})")
        torch.save(steps[0], os.path.join(out, "step.pt"))
