"""Upstream's universal-checkpoint hooks on its optimizer wrappers (`_enable_universal_checkpoint`,
`_get_universal_checkpoint_info`), for tools written against DeepSpeed 0.19.8's DeepSpeedZeroOptimizer and
BF16_Optimizer: the AutoTP description (`universal_checkpoint_info`) the first parameter carrying one gives,
cached so it outlives the parameters' attributes, and upstream's `load_hp_checkpoint_state` bound on every
low-precision parameter. Our loader does not restore through them (runtime/checkpoint/loader.py).
"""

from __future__ import annotations

from typing import Any


class UniversalCheckpointHooks:
    """Mixin; `_lp_groups_attr` names the wrapper's low-precision parameter groups (upstream's attribute)."""

    _lp_groups_attr = "bit16_groups"

    def _enable_universal_checkpoint(self) -> None:
        from ..checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        from ..checkpoint.universal_checkpoint import enable_universal_checkpoint

        self._universal_checkpoint_info = None
        for group in getattr(self, self._lp_groups_attr, None) or []:
            if self._universal_checkpoint_info is None:
                self._universal_checkpoint_info = next(
                    (info for info in (getattr(p, UNIVERSAL_CHECKPOINT_INFO, None) for p in group)
                     if info is not None), None)
            enable_universal_checkpoint(param_list=group)

    def _get_universal_checkpoint_info(self) -> Any:
        return self.__dict__.get("_universal_checkpoint_info")
