"""A Hugging Face `tp_plan` as AutoTP layer specs (upstream's `TPPlanConverter`).

A plan is applied whole or not at all: one style AutoTP does not provide rejects the plan, since
applying the rest could shard one half of a column/row pair (e.g. a row o_proj after a whole q_proj).
"""

from __future__ import annotations

import re
from typing import Optional

from .autotp_config import PartitionType, TPLayerSpec

# style -> (partition type, gather_output, grad_allreduce); `colwise_rep` is the older name of
# `colwise_gather_output`; `embedding_rowwise` and `replicated_with_grad_allreduce` keep the module whole.
STYLES = {
    "colwise": (PartitionType.COLUMN, False, False),
    "colwise_gather_output": (PartitionType.COLUMN, True, False),
    "colwise_rep": (PartitionType.COLUMN, True, False),
    "rowwise": (PartitionType.ROW, False, False),
    "embedding_rowwise": (PartitionType.SKIP, False, False),
    "replicated_with_grad_allreduce": (PartitionType.SKIP, False, True),
}
SUPPORTED_STYLES = frozenset(STYLES)


class TPPlanConverter:

    @staticmethod
    def convert(hf_tp_plan: dict[str, str]) -> Optional[list[TPLayerSpec]]:
        """One TPLayerSpec per plan entry (its key as a regex over "<module>.weight"); None for an empty
        plan (the caller falls back to the next source); ValueError naming the styles it cannot apply."""
        if not hf_tp_plan:
            return None
        unsupported = sorted({str(s) for s in hf_tp_plan.values() if str(s).lower() not in STYLES})
        if unsupported:
            keys = sorted(k for k, s in hf_tp_plan.items() if str(s) in unsupported)
            raise ValueError(f"Hugging Face tp_plan has unsupported partition style(s) {unsupported} (keys {keys}); "
                             f"AutoTP applies {sorted(STYLES)}. The plan is rejected whole, since applying only part "
                             "of it could split one half of a column/row pair; give "
                             "tensor_parallel.partition_config.layer_specs for this model instead")
        specs = []
        for key, style in hf_tp_plan.items():
            kind, gather, grad_allreduce = STYLES[str(style).lower()]
            regex = TPPlanConverter._wildcard_to_regex(key)
            regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
            specs.append(TPLayerSpec(patterns=[regex], partition_type=kind, gather_output=gather,
                                     grad_allreduce=grad_allreduce))
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        """A plan key ("layers.*.q_proj") as a regex matched anywhere in a dotted name."""
        return ".*" + ".*".join(re.escape(part).replace(r"\.", ".").replace(".", r"\.")
                                for part in pattern.split("*"))
