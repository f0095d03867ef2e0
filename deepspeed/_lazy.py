"""PEP 562 helper: an attribute of a package that names one of its submodules imports it.

Upstream DeepSpeed imports most of its tree eagerly, so attribute chains such as
`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` work after a bare `import deepspeed`
(accelerate relies on that). Here every package installs `__getattr__ = submodule_getattr(__name__)`
(or falls back to it), which gives the same chains while `import deepspeed` stays cheap.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def import_submodule(package: str, name: str) -> Any:
    """`package.name` imported and returned; AttributeError when there is no such submodule
    (an ImportError raised *inside* an existing submodule propagates unchanged)."""
    if name.startswith("__"):   # dunders (__path__, __wrapped__, ...) are never submodules
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    full = f"{package}.{name}"
    try:
        module = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != full:
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    # A submodule may replace itself in sys.modules (deepspeed.zero); the import binds the
    # package attribute to the original, so return (and bind) what sys.modules holds.
    module = sys.modules.get(full, module)
    setattr(sys.modules[package], name, module)
    return module


def submodule_getattr(package: str) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` that imports submodules on first access."""

    def __getattr__(name: str) -> Any:
        return import_submodule(package, name)

    return __getattr__
