"""DeepSpeedConfigError and the one-line messages it carries.

Every message names the dotted key path, the value given and what is allowed, e.g.
    zero_optimization.stage: got 4; expected one of 0, 1, 2, 3
    zero_optimization.overlap_com: unknown key (did you mean 'overlap_comm'?)
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ValidationError

from .sections.base import field_keys, model_at


class DeepSpeedConfigError(ValueError, AssertionError):
    """An invalid DeepSpeed config. `errors` holds one line per problem found. Also an
    AssertionError: upstream asserts on most bad values, and callers catch that."""

    def __init__(self, errors: Iterable[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{len(self.errors)} problems in the DeepSpeed config:\n" + "\n".join(
                f"  - {line}" for line in self.errors)
        super().__init__(message)


class BatchConfigError(DeepSpeedConfigError):
    """Batch sizes that do not fit together, found when they are re-resolved at run time
    (upstream asserts there, and callers catch AssertionError)."""


class ConfigMismatchError(DeepSpeedConfigError):
    """The ranks resolved different configs ([Note: cross-rank config agreement] in agreement.py).
    `errors` holds one line per differing key; `differences` is {dotted key: {rank: value}}."""

    def __init__(self, what: str, lines: list[str], differences: dict[str, dict[int, Any]]):
        self.errors = list(lines)
        self.differences = differences
        ValueError.__init__(self, (
            f"{what}: the ranks were started with different DeepSpeed configs; every rank must run the same one. "
            "The resolved configs differ in:\n" + "\n".join(f"  {line}" for line in lines) + "\n"
            "(compared after validation, with \"auto\" values and batch sizes resolved; keys that may differ per "
            "rank are not compared: docs/config.md, \"Cross-rank agreement\")"))


# ------------------------------------------------------------------------------ suggestions
def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: one per insertion, deletion, substitution, swap."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _norm(key: str) -> str:
    return key.lower().replace("-", "_").replace(" ", "_")


def _max_distance(a: str, b: str) -> int:
    return 1 if min(len(a), len(b)) <= 5 else 2


def is_near_miss(key: str, candidate: str) -> bool:
    """A typo-sized difference: spelling/case variants, one edit (short keys) or two (long keys)."""
    a, b = _norm(key), _norm(candidate)
    return abs(len(a) - len(b)) <= 2 and edit_distance(a, b) <= _max_distance(a, b)


def suggest(key: str, candidates: Iterable[str], limit: int = 3) -> list[str]:
    """The closest candidates: all near misses at the smallest distance, else difflib's picks."""
    candidates = sorted(set(candidates))
    a = _norm(key)
    scored = []
    for candidate in candidates:
        b = _norm(candidate)
        if abs(len(a) - len(b)) <= 2:
            distance = edit_distance(a, b)
            if distance <= _max_distance(a, b):
                scored.append((distance, candidate))
    if scored:
        best = min(distance for distance, _ in scored)
        return [c for distance, c in scored if distance == best][:limit]
    return difflib.get_close_matches(key, candidates, n=limit, cutoff=0.75)


def did_you_mean(options: list[str]) -> str:
    if not options:
        return ""
    return " (did you mean " + " or ".join(repr(o) for o in options) + "?)"


def belongs_under(homes: list[str]) -> str:
    if not homes:
        return ""
    places = ", ".join("the top level" if h == "" else h for h in homes[:3])
    return f"; it belongs under {places}" if homes[0] else f"; it belongs at {places}"


def unknown_key_message(path: str, key: str, allowed: Iterable[str], homes: list[str]) -> str:
    """'<path>: unknown key' plus a did-you-mean and, if the key lives elsewhere, where."""
    allowed = sorted(allowed)
    hint = did_you_mean(suggest(key, allowed)) + belongs_under(homes)
    if not hint:
        hint = "; allowed keys: " + ", ".join(allowed)
    return f"{path}: unknown key{hint}"


# ------------------------------------------------------------------------------ pydantic errors
def show(value: Any) -> str:
    """A value as the user wrote it in JSON, shortened."""
    try:
        text = json.dumps(value, default=str, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dotted(loc: Iterable[Any]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _expected(kind: str, ctx: dict[str, Any]) -> Optional[str]:
    """What pydantic's error `kind` says was expected, in config terms."""
    simple = {
        "bool_type": "true or false", "bool_parsing": "true or false",
        "int_type": "an integer", "int_parsing": "an integer",
        "int_from_float": "an integer (no fractional part)",
        "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
        "string_type": "a string", "list_type": "a list", "dict_type": "an object",
        "model_type": "an object", "model_attributes_type": "an object",
    }
    if kind in simple:
        return simple[kind]
    if kind in ("literal_error", "enum"):
        return "one of " + str(ctx.get("expected", "")).replace(" or ", ", ")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"a value {bounds[kind]} {limit}"
    return None


def _line(err: dict[str, Any], root: type[BaseModel], homes: dict[str, list[str]]) -> list[str]:
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    path = dotted(loc)
    if kind == "extra_forbidden":
        parent = model_at(root, loc[:-1])
        allowed = field_keys(parent) if parent is not None else {}
        return [unknown_key_message(path, str(loc[-1]), allowed, homes.get(str(loc[-1]), []))]
    if kind == "ds_problems":
        return [f"{dotted((path, key)) if key else path}: {msg}" if path or key else msg
                for key, msg in ctx["problems"]]
    if kind == "missing":
        return [f"{path}: required key missing"]
    msg = str(err.get("msg", ""))
    for noise in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(noise)
    expected = _expected(kind, ctx)
    if expected is None and msg.startswith("expected"):
        expected = msg.removeprefix("expected ")
    if expected is not None:
        return [f"{path}: got {show(err.get('input'))}; expected {expected}"]
    return [f"{path}: {msg}" if path else msg]


def format_validation_error(exc: ValidationError, root: type[BaseModel], homes: dict[str, list[str]]) -> list[str]:
    """One line per problem in `exc`, raised while validating `root`; `homes` is key_homes(root)."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        for line in _line(err, root, homes):
            if line not in lines:
                lines.append(line)
    return lines
