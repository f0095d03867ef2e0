# compat: upstream path deepspeed.runtime.config_utils (DeepSpeed 0.19.8 names).
"""`DeepSpeedConfigModel`: the base upstream's config classes (and libraries' own) derive from.

It is our sections' base (`DSModel`: unknown keys are errors, assignments re-validated, "auto"
values dropped so the default applies) plus upstream's deprecated-field protocol: a field
declared with `json_schema_extra={"deprecated": True, "new_param": "x", "new_param_fn": f}`
warns when given and moves `f(value)` onto `x` ("a.b" paths reach into sub-models); giving
both is an AssertionError, as upstream.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from pydantic import ConfigDict

from ..utils.logging import logger
from .config.sections.base import DSModel


class DeepSpeedConfigModel(DSModel):
    """`strict=True` keeps "auto" values (then validated like any other)."""

    model_config = ConfigDict(use_enum_values=True)

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if strict:   # validate as BaseModel.__init__ does, telling DSModel to keep "auto" values
            type(self).__pydantic_validator__.validate_python(data, self_instance=self, context={"keep_auto": True})
        else:
            super().__init__(**data)
        self._move_deprecated_fields()

    def _move_deprecated_fields(self) -> None:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            if not extra.get("deprecated") or name not in self.model_fields_set:
                continue
            new_param = extra.get("new_param", "")
            logger.warning(f"Config parameter {name} is deprecated" + (f", use {new_param} instead" if new_param
                                                                           else "") + f". {extra.get('deprecated_msg', '')}")
            if not new_param or not extra.get("set_new_param", True):
                continue
            *path, leaf = new_param.split(".")
            target = self
            for part in path:
                target = getattr(target, part)
            assert leaf not in target.model_fields_set, (
                f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_param}' together")
            convert = extra.get("new_param_fn", lambda x: x)
            setattr(target, leaf, convert(getattr(self, name)))


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """`json.load(..., object_pairs_hook=...)`: a key given twice is a ValueError."""
    duplicates = [key for key, n in Counter(k for k, _ in ordered_pairs).items() if n > 1]
    if duplicates:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicates}")
    return dict(ordered_pairs)


def load_json_without_duplicates(text: str) -> dict:
    return json.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
