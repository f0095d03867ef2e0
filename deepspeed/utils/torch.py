# compat: upstream deepspeed.utils.torch (version gates used by libraries and upstream's tests).
"""Helpers about the installed torch."""

from __future__ import annotations

import torch
from packaging import version as _version


def required_torch_version(min_version: object = None, max_version: object = None) -> bool:
    """Whether the installed torch lies within [min_version, max_version] (either may be None)."""
    if min_version is None and max_version is None:
        raise AssertionError("required_torch_version: give min_version or max_version (got neither)")
    installed = _version.parse(torch.__version__.split("+")[0])
    if min_version is not None and installed < _version.parse(str(min_version)):
        return False
    return max_version is None or installed <= _version.parse(str(max_version))


def is_functorch_transforming() -> bool:
    """True while running under a torch.func transform (grad, vmap, ...)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
