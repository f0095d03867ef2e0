"""Pure gradient-accumulation boundary logic."""

from __future__ import annotations


def is_boundary(micro_steps: int, gradient_accumulation_steps: int, override: bool | None = None) -> bool:
    """Whether micro-step `micro_steps` (0-based) ends an accumulation window.

    An explicit override (set_gradient_accumulation_boundary, used by Accelerate) wins.
    """
    if override is not None:
        return override
    return (micro_steps + 1) % gradient_accumulation_steps == 0
