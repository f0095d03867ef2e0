"""Shared pieces of every config section: the `DSModel` base, number types, dtype names, problems.

[Note: config problems]
Pydantic reports per-field type errors itself. Rules that look at several fields at once, and
"not supported by this implementation" rejections, are written as `_problems()` on the model: a
list of (relative key, message). The base after-validator raises them all together as one
`ds_problems` error, so the formatter in errors.py can prefix each with the section's dotted path
and every problem in a config reaches the user in one exception.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any, Iterator, Optional

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

Problem = tuple[str, str]  # (key relative to the model, message)
AUTO = "auto"


class DSModel(BaseModel):
    """Base of every section: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        populate_by_name=True,
        arbitrary_types_allowed=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_auto(cls, data: Any, info: ValidationInfo) -> Any:
        """Upstream drops "auto" values so the default applies; direct constructions do the same
        (unless validated with context {"keep_auto": True}: upstream's `strict=True`)."""
        if isinstance(data, dict) and not (info.context or {}).get("keep_auto"):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO)}
        return data

    @model_validator(mode="after")
    def _raise_problems(self) -> "DSModel":
        problems = list(self._problems())
        if problems:
            summary = "; ".join(f"{k}: {m}" if k else m for k, m in problems)
            raise PydanticCustomError("ds_problems", "{summary}", {"summary": summary, "problems": problems})
        return self

    def _problems(self) -> Iterator[Problem]:
        """Cross-field and not-supported checks; see [Note: config problems]."""
        return iter(())

    # Upstream kept several sections as plain dicts (`config.pipeline["pipe_partitioned"]`).
    def __getitem__(self, key: str) -> Any:
        name = field_keys(type(self)).get(key)
        if name is None:
            raise KeyError(key)
        return getattr(self, name)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


def not_supported(what: str, fix: str = "remove it or set it to its default") -> str:
    return f"{what} is not supported by this implementation (pure-Python deepspeed); {fix}"


# ---------------------------------------------------------------------------------------------
# Numbers. JSON writers emit 5e8 for int fields (a float); pydantic accepts integral floats and
# rejects 2.5. We additionally reject booleans, which pydantic would silently turn into 0/1.
# ---------------------------------------------------------------------------------------------
def reject_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("ds_not_bool", "expected a number, not a boolean")
    return value


def _finite(value: Any) -> Any:
    value = reject_bool(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("ds_finite", "expected a finite number")
    return value


Int = Annotated[int, BeforeValidator(reject_bool)]
Float = Annotated[float, BeforeValidator(_finite)]


# ---------------------------------------------------------------------------------------------
# Dtype names: the spellings upstream's DtypeEnum accepts for the three training dtypes.
# ---------------------------------------------------------------------------------------------
_DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}
_CANONICAL = {s: name for name, spellings in _DTYPE_SPELLINGS.items() for s in spellings}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_CHOICES = ", ".join(f'"{s}"' for s in _CANONICAL)


def canonical_dtype(value: Any, allowed: tuple[str, ...] = ("fp32", "fp16", "bf16")) -> Optional[str]:
    """Map any accepted spelling (or a torch.dtype) to "fp32" / "fp16" / "bf16"; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = str(value)
    name = _CANONICAL.get(value.lower()) if isinstance(value, str) else None
    if name is None or name not in allowed:
        choices = ", ".join(f'"{s}"' for s, n in _CANONICAL.items() if n in allowed)
        raise PydanticCustomError("ds_expected", "expected one of {choices}", {"choices": choices})
    return name


DtypeName = Annotated[Optional[str], BeforeValidator(canonical_dtype)]


# ---------------------------------------------------------------------------------------------
# Walking the model tree: used for did-you-mean suggestions and "belongs under" hints.
# ---------------------------------------------------------------------------------------------
def model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The DSModel class inside an annotation such as Optional[ZeroConfig], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def field_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted JSON key of `model` (field names and aliases) -> field name."""
    keys: dict[str, str] = {}
    for name, info in model.model_fields.items():
        keys[name] = name
        if info.alias:
            keys[info.alias] = name
    return keys


def submodel(model: type[BaseModel], key: str) -> Optional[type[BaseModel]]:
    name = field_keys(model).get(key)
    return None if name is None else model_in(model.model_fields[name].annotation)


def model_at(root: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The model class that validates the object at `loc` (a pydantic error location)."""
    model: Optional[type[BaseModel]] = root
    for part in loc:
        if model is None or not isinstance(part, str):
            return None
        model = submodel(model, part)
    return model


def key_homes(root: type[BaseModel]) -> dict[str, list[str]]:
    """key -> dotted paths of every section that accepts it ("" is the top level)."""
    homes: dict[str, list[str]] = {}

    def visit(model: type[BaseModel], path: str) -> None:
        for key, name in field_keys(model).items():
            if path not in homes.setdefault(key, []):
                homes[key].append(path)
            child = model_in(model.model_fields[name].annotation)
            if child is not None and key == name:
                visit(child, f"{path}.{key}" if path else key)

    visit(root, "")
    return homes
