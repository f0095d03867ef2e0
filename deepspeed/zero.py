# compat: `deepspeed.zero` is the package deepspeed.runtime.zero, as upstream. `deepspeed.zero`
# as an attribute resolves through deepspeed/__init__.py's lazy table; this file makes
# `import deepspeed.zero` and `from deepspeed.zero import Init` give that same module object.
"""Alias of deepspeed.runtime.zero."""

import sys

from .runtime import zero as _zero

sys.modules[__name__] = _zero
