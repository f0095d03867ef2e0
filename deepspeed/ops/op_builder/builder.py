# compat: upstream deepspeed.ops.op_builder.builder.
from . import OpBuilder  # noqa: F401


def probe_is_compatible(builder: OpBuilder) -> bool:
    return builder.is_compatible()
