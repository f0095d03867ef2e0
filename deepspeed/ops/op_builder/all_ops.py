# compat: upstream deepspeed.ops.op_builder.all_ops.
from . import ALL_OPS  # noqa: F401
