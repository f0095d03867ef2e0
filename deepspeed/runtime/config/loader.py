"""Where a config comes from: a dict, a JSON file (or an HJSON file, as upstream reads files with
hjson, when the optional `hjson` package is installed), a JSON string or base64-encoded JSON."""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections import Counter
from typing import Any, Mapping

from .errors import DeepSpeedConfigError


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key given twice would silently keep only the last value."""
    counts = Counter(key for key, _ in pairs)
    duplicates = [key for key, n in counts.items() if n > 1]
    if duplicates:
        raise DeepSpeedConfigError(f"duplicate key(s) in DeepSpeed config: {', '.join(map(repr, duplicates))}")
    return dict(pairs)


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"{source} is not valid JSON: {exc}") from None
    except DeepSpeedConfigError as exc:
        raise DeepSpeedConfigError(f"{source}: {exc}") from None
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"{source} must hold a JSON object, got {type(value).__name__}")
    return value


def _parse_hjson(text: str, source: str, json_error: DeepSpeedConfigError) -> dict[str, Any]:
    """Upstream reads config files with hjson (a superset of JSON): accept one when hjson is there."""
    try:
        import hjson
    except ImportError:
        raise DeepSpeedConfigError(f"{json_error} (HJSON files need the optional package: pip install hjson)") from None
    try:
        value = hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except DeepSpeedConfigError as exc:
        raise DeepSpeedConfigError(f"{source}: {exc}") from None
    except Exception as exc:  # hjson.HjsonDecodeError: neither JSON nor HJSON
        raise DeepSpeedConfigError(f"{source} is neither valid JSON ({json_error}) nor valid HJSON: {exc}") from None
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"{source} must hold an object, got {type(value).__name__}")
    return dict(value)


def _decode_base64(text: str) -> str | None:
    compact = "".join(text.split())
    try:
        raw = base64.urlsafe_b64decode(compact + "=" * (-len(compact) % 4))
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def load_config_dict(config: Any) -> dict[str, Any]:
    """The config as a plain dict. A dict is returned as is (not copied, never mutated here);
    a str/PathLike is a path to a JSON file, a JSON object, or base64 of a JSON object."""
    if isinstance(config, dict):
        return config
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise DeepSpeedConfigError(
            f"config must be a dict, a path to a JSON file, a JSON string or base64-encoded JSON; "
            f"got {type(config).__name__}")
    text = os.fspath(config)
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as handle:
            content = handle.read()
        try:
            return _parse_json(content, f"config file {text}")
        except DeepSpeedConfigError as exc:
            if "not valid JSON" not in str(exc):
                raise
            return _parse_hjson(content, f"config file {text}", exc)
    if text.lstrip().startswith("{"):
        return _parse_json(text, "config JSON string")
    decoded = _decode_base64(text)
    if decoded is not None and decoded.lstrip().startswith("{"):
        return _parse_json(decoded, "base64 config")
    looks_like_path = text.endswith((".json", ".hjson")) or os.sep in text
    what = "file not found" if looks_like_path else "neither an existing file, a JSON object, nor base64 JSON"
    raise DeepSpeedConfigError(f"DeepSpeed config {text!r}: {what}")
