"""deepspeed.moe.layer.MoE over real gloo processes ([Note: the MoE exchange] in deepspeed/moe/sharded_moe.py).

Every rank runs the layer on its own tokens with experts sharded over its expert-parallel group;
the output, l_aux and the input, gate and expert gradients must equal a single-process dense
reference: each token's output is the gate-weighted sum of its routed experts applied to it directly
(no buffers, no exchange), the experts shared by the group's ranks, so an expert's gradient is the
sum over the group's tokens. Routing itself is checked against DeepSpeed 0.19.8 in
tests/unit/test_moe_gating.py. Also: skewed routing (experts, and so ranks, that receive nothing),
a rank that routes nothing at all, ranks with different token counts, and the all-to-all bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_distributed

H, F, E = 8, 12, 4   # hidden, expert width, experts


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H))


def _tokens(rank: int, scenario: str) -> int:
    return 10 + 4 * rank if scenario == "uneven" else 12


def _inputs(rank: int, scenario: str, gate_weight: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(_tokens(rank, scenario), H, generator=g)
    if scenario == "skewed":   # every token prefers expert 0: the experts of every other EP rank get nothing
        x = x * 0.1 + 4.0 * gate_weight[0] / gate_weight[0].norm()
    return x.reshape(2, -1, H)


def _used(rank: int, scenario: str, tokens: int) -> torch.Tensor | None:
    if scenario != "unused":
        return None
    return torch.zeros(tokens) if rank == 1 else torch.ones(tokens)   # rank 1 routes no token at all


def _build(cfg: dict) -> "nn.Module":
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    return MoE(H, _expert(), num_experts=E, ep_size=cfg["ep"], k=cfg["k"], min_capacity=2, capacity_factor=cfg["cf"],
               drop_tokens=cfg["drop"], use_rts=True)


def _expert_weights(global_id: int, expert: nn.Module) -> None:
    torch.manual_seed(500 + global_id)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn_like(p) * 0.4)


def _reference(layer: nn.Module, cfg: dict, group: list[int]) -> dict:
    """Dense single-process forward/backward of every rank of `group` with the same routing."""
    from deepspeed.moe.sharded_moe import TopKGate

    experts = [_expert() for _ in range(E)]
    for gid, expert in enumerate(experts):
        _expert_weights(gid, expert)
    out = {}
    for r in group:
        gate = TopKGate(H, E, k=cfg["k"], capacity_factor=cfg["cf"], min_capacity=2, drop_tokens=cfg["drop"])
        gate.load_state_dict(layer.deepspeed_moe.gate.state_dict())
        x = _inputs(r, cfg["scenario"], gate.wg.weight.detach()).requires_grad_()
        tokens = x.reshape(-1, H)
        torch.manual_seed(1000 + r)
        l_aux, routes, counts = gate.route(tokens, _used(r, cfg["scenario"], tokens.shape[0]))
        applied = torch.stack([e(tokens) for e in experts])                        # [E, S, H]
        picked = applied[routes.indices.clamp(min=0), torch.arange(tokens.shape[0])]  # [k, S, H]
        weights = routes.gates * (routes.indices >= 0)
        y = (picked * weights.unsqueeze(-1)).sum(0).reshape(x.shape)
        loss = (y * _loss_weights(r, y.shape)).sum() + l_aux
        loss.backward()
        out[r] = {"y": y.detach(), "l_aux": l_aux.detach(), "x_grad": x.grad, "gate_grad": gate.wg.weight.grad,
                  "counts": counts, "routes": routes}
    out["experts"] = [[p.grad.clone() for p in e.parameters()] for e in experts]
    return out


def _loss_weights(rank: int, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(70 + rank))


def _theory_capacity(cfg: dict, ref: dict, group: list[int]) -> int:
    """The buffer rows every rank of the group agrees on: the largest gate capacity in the group."""
    from deepspeed.moe.gating import capacity_for

    if cfg["drop"]:
        return max(capacity_for(_tokens(r, cfg["scenario"]), E, cfg["cf"] * cfg["k"], 2) for r in group)
    loads = max(int(ref[r]["counts"].max()) for r in group)
    if cfg["k"] == 1:
        return max(min(loads, _tokens(r, cfg["scenario"])) for r in group)
    return loads


def _run_configs(configs: list[dict]) -> list[dict]:
    from deepspeed.runtime import mesh

    try:
        return [_run_config(cfg) for cfg in configs]
    finally:
        mesh.reset()   # leave the pool's ranks without this test's mesh


def _run_config(cfg: dict) -> dict:
    from deepspeed import comm as dist
    from deepspeed.runtime import mesh
    from deepspeed.utils import groups

    mesh.reset()
    rank = dist.get_rank()
    layer = _build(cfg)
    layer.set_deepspeed_parallelism()
    group = groups._get_expert_parallel_group_ranks(layer.expert_group_name)
    ep_rank = group.index(rank)
    local = list(layer.deepspeed_moe.experts.deepspeed_experts)
    for i, expert in enumerate(local):
        _expert_weights(ep_rank * len(local) + i, expert)
    x = _inputs(rank, cfg["scenario"], layer.deepspeed_moe.gate.wg.weight.detach()).requires_grad_()
    dist.comms_counter.reset()
    torch.manual_seed(1000 + rank)
    y, l_aux, counts = layer(x, _used(rank, cfg["scenario"], x.shape[0] * x.shape[1]))
    ((y * _loss_weights(rank, y.shape)).sum() + l_aux).backward()
    stats = dist.comms_counter.summary()
    ref = _reference(layer, cfg, group)
    mine = ref[rank]

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max()) if a.numel() else 0.0

    expert_err = max(err(p.grad, q) for i, e in enumerate(local)
                     for p, q in zip(e.parameters(), ref["experts"][ep_rank * len(local) + i]))
    capacity = _theory_capacity(cfg, ref, group)
    a2a = stats.get("all_to_all_single", {"count": 0, "bytes": 0})
    local_loads = [int(ref[r]["counts"].view(len(group), -1)[ep_rank].sum()) for r in group]
    return {
        "cfg": cfg, "rank": rank, "y": err(y.detach(), mine["y"]), "l_aux": err(l_aux.detach(), mine["l_aux"]),
        "x_grad": err(x.grad, mine["x_grad"]), "gate_grad": err(layer.deepspeed_moe.gate.wg.weight.grad,
                                                                mine["gate_grad"]),
        "experts": expert_err, "counts": torch.equal(counts, mine["counts"]),
        "a2a_count": a2a["count"], "a2a_bytes": a2a["bytes"], "a2a_theory": 4 * E * capacity * H * 4,
        "local_loads": local_loads, "routed": int((mine["routes"].indices >= 0).sum()),
        "y_norm": float(y.detach().norm())}


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for res in per_rank:
            name = f"{res['cfg']} rank {res['rank']}"
            for key in ("y", "l_aux", "x_grad", "gate_grad", "experts"):
                assert res[key] < 1e-5, f"{name}: {key} differs by {res[key]}"
            assert res["counts"], name
            if res["cfg"]["ep"] > 1:   # 2 exchanges forward, 2 backward, sized by the agreed capacity
                assert res["a2a_count"] == 4 and res["a2a_bytes"] == res["a2a_theory"], (name, res)
            else:
                assert res["a2a_count"] == 0, name


def _configs(eps: tuple[int, ...], scenarios: tuple[str, ...] = ("random",)) -> list[dict]:
    return [{"ep": ep, "k": k, "drop": drop, "cf": 0.5 if drop else 1.0, "scenario": s}
            for ep in eps for k in (1, 2) for drop in (True, False) for s in scenarios]


def _transpose(per_rank: list[list[dict]]) -> list[list[dict]]:
    return [list(row) for row in zip(*per_rank)]


def test_moe_layer_equals_dense_reference_world2():
    results = _transpose(run_distributed(2, _run_configs, _configs((1, 2))))
    _check(results)
    # the capacity factor 0.5 really drops tokens, and no-drop keeps all of them
    assert any(r["routed"] < 12 * r["cfg"]["k"] for row in results for r in row if r["cfg"]["drop"])
    assert all(r["routed"] == 12 * r["cfg"]["k"] for row in results for r in row if not r["cfg"]["drop"])


def test_moe_layer_skewed_unused_and_uneven_ranks_world2():
    """Experts of EP rank 1 get no token from anyone; rank 1 routes nothing (used_token all zero);
    ranks hold 10 and 14 tokens: all complete (no hang) and equal the reference."""
    configs = [c for c in _configs((2,), ("skewed", "uneven")) if c["scenario"] == "uneven" or c["k"] == 1]
    configs += [{"ep": 2, "k": 1, "drop": drop, "cf": 1.0, "scenario": "unused"} for drop in (True, False)]
    results = _transpose(run_distributed(2, _run_configs, configs))
    _check(results)
    for row in results:
        cfg = row[0]["cfg"]
        if cfg["scenario"] == "skewed":
            assert all(r["local_loads"] == [0, 0] for r in row if r["rank"] == 1), row
        if cfg["scenario"] == "unused":
            assert row[1]["routed"] == 0 and row[1]["y_norm"] == 0.0 and row[0]["routed"] > 0


def test_moe_layer_equals_dense_reference_world4():
    configs = [c for c in _configs((2, 4)) if c["ep"] == 4 or c["k"] == 1]
    _check(_transpose(run_distributed(4, _run_configs, configs)))


@pytest.mark.slow
def test_moe_layer_all_variants_world4():
    _check(_transpose(run_distributed(4, _run_configs, _configs((1, 2, 4), ("random", "skewed", "uneven")))))


def _one_rank_bad_input(bad_rank: int) -> str:
    """Rank `bad_rank` holds fewer tokens than min_capacity; the group's first forward also makes
    the expert groups (no set_deepspeed_parallelism call: [Note: when the expert groups are made])."""
    from deepspeed import comm as dist
    from deepspeed.runtime import mesh

    mesh.reset()
    layer = _build({"ep": 2, "k": 1, "cf": 1.0, "drop": True})
    ok = layer(torch.randn(6, H))[0]   # lazily made groups, a normal step
    assert ok.shape == (6, H) and layer.deepspeed_moe.ep_group is not None
    tokens = 1 if dist.get_rank() == bad_rank else 6
    try:
        layer(torch.randn(tokens, H))
    except ValueError as e:
        dist.barrier()   # every rank got here: none is stuck in an exchange
        return str(e)
    return "no error"


def test_one_rank_bad_input_makes_every_rank_raise():
    messages = run_distributed(2, _one_rank_bad_input, 1, timeout=60)
    assert all("fewer tokens than min_capacity" in m for m in messages), messages
