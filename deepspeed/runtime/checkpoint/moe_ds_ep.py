"""DeepSpeed 0.19.8's own stage-0 MoE optimizer files read at another ep_size.

[Note: DeepSpeed MoE optimizer at another ep_size]
Upstream's `expp_rank_{e}_mp_rank_00_optim_states.pt` is a torch optimizer state_dict keyed by POSITION in
saved EP rank e's param groups: those of `split_params_into_different_moe_groups_for_optimizer` (the user's
groups without experts, then per user group and expert group name the experts), each listing parameters in
the order the user gave them; an expert group holds rank e's local experts, global ids e*L .. e*L+L-1 with
L = num_experts / saved ep_size. Those positions carry no names. The same model here, built the same way at
another ep_size, has the same groups, only with other experts in each expert group: every run of one MoE
layer's experts in a group (increasing ids, each with the same parameters) stands for "this layer's local
experts", and rewriting it with saved rank e's ids names each position of e's file. This rank then takes
the entries of the parameters it holds: its experts from the file of the saved rank that held them, the
replicated parameters from rank 0's (DeepSpeed keeps them equal on every EP rank). Anything that does not
fit this pattern is refused by name rather than guessed.
"""

from __future__ import annotations

import torch

from ...checkpoint.files import CheckpointError

MARK = ".deepspeed_experts."   # upstream's expert naming: ...deepspeed_moe.experts.deepspeed_experts.<id>.<param>


def _with_expert(name: str, old: int, new: int) -> str:
    return name.replace(f"{MARK}{old}.", f"{MARK}{new}.", 1)


def _layer_run(path: str, group: int, run: list[tuple[int, int, str]]) -> list[str]:
    """One MoE layer's run of expert parameters in a running group ((layer, global id, global name) each),
    as the names of its first expert's parameters; refused unless expert-major with increasing ids."""
    experts = list(dict.fromkeys(g for _, g, _ in run))
    first = [name for _, g, name in run if g == experts[0]]
    expected = [(run[0][0], g, _with_expert(n, experts[0], g)) for g in experts for n in first]
    if experts != list(range(experts[0], experts[0] + len(experts))) or run != expected:
        raise CheckpointError(
            f"{path}: optimizer group {group} lists MoE layer {run[0][0]}'s expert parameters as "
            f"{[n for *_, n in run]}; DeepSpeed's positions can be mapped to another ep_size only when each expert's "
            "parameters follow each other, experts in increasing order (as model.parameters() lists them)")
    return first


def saved_positions(path: str, group: int, names: list[str], renamed: dict[str, tuple[int, int, str]],
                    num_experts: list[int], saved_ep: int, ep_rank: int) -> list[str]:
    """The names (local for replicated parameters, global for experts) of the positions of saved EP rank
    `ep_rank`'s group `group`, from this engine's group `names` ([Note: DeepSpeed MoE optimizer at another
    ep_size])."""
    out: list[str] = []
    seen: set[int] = set()
    i = 0
    while i < len(names):
        if names[i] not in renamed:
            out.append(names[i])
            i += 1
            continue
        layer = renamed[names[i]][0]
        j = i
        while j < len(names) and names[j] in renamed and renamed[names[j]][0] == layer:
            j += 1
        if layer in seen:
            raise CheckpointError(f"{path}: optimizer group {group} lists MoE layer {layer}'s experts in more than "
                                  "one run; DeepSpeed's positions cannot be mapped to another ep_size")
        seen.add(layer)
        run = [renamed[n] for n in names[i:j]]
        first, local = _layer_run(path, group, run), num_experts[layer] // saved_ep
        out += [_with_expert(n, run[0][1], g) for g in range(ep_rank * local, (ep_rank + 1) * local) for n in first]
        i = j
    return out


def _check_structure(path: str, saved: dict[int, dict], optimizer_names: list[list[str]], renamed: dict,
                     num_experts: list[int], layer_eps: list[int]) -> None:
    """Refusals that need no position: mixed ep sizes, indivisible expert counts, other group lists."""
    saved_ep = len(saved)
    if sorted(saved) != list(range(saved_ep)):
        raise CheckpointError(f"{path}: DeepSpeed's expp_rank_* files are for EP ranks {sorted(saved)}, "
                              f"expected 0..{saved_ep - 1}")
    if len(set(layer_eps)) > 1:
        raise CheckpointError(f"{path}: this model's MoE layers have different ep_sizes {layer_eps}; DeepSpeed's "
                              f"MoE checkpoint (saved at ep_size {saved_ep}) loads at another ep_size only when all "
                              "layers share one")
    bad = [n for n in num_experts if n % saved_ep]
    if bad:
        raise CheckpointError(f"{path}: MoE layers with {bad} experts cannot have been saved at ep_size {saved_ep}")
    groups = saved[0]["param_groups"]
    if len(groups) != len(optimizer_names):
        raise CheckpointError(f"{path}: DeepSpeed saved {len(groups)} optimizer param groups, this engine has "
                              f"{len(optimizer_names)}; build the optimizer groups as the saving job did "
                              "(split_params_into_different_moe_groups_for_optimizer)")
    for k, (group, names) in enumerate(zip(groups, optimizer_names)):
        experts = any(n in renamed for n in names)
        if bool(group.get("moe", False)) != experts:
            raise CheckpointError(f"{path}: DeepSpeed's optimizer group {k} ({group.get('name')!r}) is "
                                  f"{'an expert' if group.get('moe') else 'a non-expert'} group, this engine's is "
                                  f"{'an expert' if experts else 'a non-expert'} group")


def entries(path: str, saved: dict[int, dict], optimizer_names: list[list[str]], module: dict,
            renamed: dict[str, tuple[int, int, str]], num_experts: list[int],
            layer_eps: list[int]) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(name, torch optimizer state entry) for each of this engine's optimizer parameters, read from
    DeepSpeed's files `saved` ({saved EP rank: optimizer state_dict}) written at another ep_size, and the
    saved param groups' settings (expert groups without their `name`: this engine's group names stay)."""
    _check_structure(path, saved, optimizer_names, renamed, num_experts, layer_eps)
    local_of = {name: local for local, (_, _, name) in renamed.items()}
    found: dict[str, dict] = {}
    for ep_rank, sd in sorted(saved.items()):
        for k, (group, names) in enumerate(zip(sd["param_groups"], optimizer_names)):
            positions = saved_positions(path, k, names, renamed, num_experts, len(saved), ep_rank)
            if len(positions) != len(group["params"]):
                raise CheckpointError(
                    f"{path}: DeepSpeed's optimizer group {k} ({group.get('name')!r}) of EP rank {ep_rank} holds "
                    f"{len(group['params'])} parameters, this model's structure gives {len(positions)} for it; "
                    "build the optimizer groups as the saving job did")
            for index, name in zip(group["params"], positions):
                local = local_of.get(name, name if name not in renamed else None)
                if local is None or local in found:
                    continue
                entry = sd["state"].get(index, {})
                _check_shape(path, ep_rank, k, index, local, entry, module)
                found[local] = entry
    pairs = [(name, found.get(name, {})) for names in optimizer_names for name in names]
    groups = [{k: v for k, v in g.items() if k != "params" and not (k == "name" and g.get("moe"))}
              for g in saved[0]["param_groups"]]
    return pairs, groups


def _check_shape(path: str, ep_rank: int, group: int, index: int, name: str, entry: dict, module: dict) -> None:
    for field, value in entry.items():
        if torch.is_tensor(value) and value.dim() > 0 and name in module and \
                value.numel() != module[name].numel():
            raise CheckpointError(f"{path}: position {index} (group {group}) of EP rank {ep_rank}'s optimizer state "
                                  f"maps to {name!r} of shape {tuple(module[name].shape)}, but its {field} has shape "
                                  f"{tuple(value.shape)}")

