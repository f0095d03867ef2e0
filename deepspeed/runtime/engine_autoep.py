"""The engine's AutoEP hook: with `expert_parallel.enabled`, swap the model's MoE experts for
expert-parallel ones before the engine's MoE set-up (engine_moe.py) finds them, so the expert
groups, the expert-gradient reduction and the broadcasts treat them as any expert layer."""

from __future__ import annotations

from typing import Any


def setup_autoep(engine: Any) -> None:
    """No-op unless the config's `expert_parallel` section is enabled. Every rank raises alike on a
    bad plan (it depends on the model and the config only), before any collective."""
    section = dict(engine.config.get("expert_parallel") or {})
    if not section.get("enabled", False):
        return
    from .errors import NotSupportedYet
    from ..module_inject.auto_ep import apply_autoep

    ep = int(section.get("autoep_size", 1))
    if engine._split is not None or engine.sequence_parallel_size > 1 or engine.mpu is not None:
        raise NotSupportedYet(f"expert_parallel.autoep_size={ep} with tensor or sequence parallelism or a client "
                              "mpu: AutoEP combines with data parallelism and ZeRO 0-3 in this build")
    engine.autoep_plan = apply_autoep(engine.module, section, ep, broadcast_group=engine.seq_data_parallel_group,
                                      use_data_before_expert_parallel=bool(
                                          engine.config.get("use_data_before_expert_parallelism", False)))
