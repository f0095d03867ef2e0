"""Availability checks of the optional monitor packages (upstream names), with the fix in the error.

Each check runs on every rank when the engine is built (the monitors write on rank 0 only), so a
missing package fails every rank alike instead of rank 0 alone.
"""

from __future__ import annotations

import importlib

from packaging import version as pkg_version

# monitor -> (import name, pip requirement, this package's extra, config key)
_OPTIONAL = {
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard", "tensorboard.enabled"),
    "wandb": ("wandb", "wandb", "wandb", "wandb.enabled"),
    "comet": ("comet_ml", "comet_ml>=3.41.0", "comet", "comet.enabled"),
}


class MonitorUnavailableError(ImportError):
    """A monitor is enabled in the config but its package is not installed."""


def _missing(monitor: str, detail: str = "") -> MonitorUnavailableError:
    module, requirement, extra, key = _OPTIONAL[monitor]
    return MonitorUnavailableError(
        f"{key} is true but the `{module}` package is {detail or 'not installed'}: install it with "
        f"`pip install \"{requirement}\"` (or this package's extra: `pip install \"deepspeed[{extra}]\"`), "
        f"or set {key} to false", name=module)


def _require(monitor: str) -> None:
    try:
        importlib.import_module(_OPTIONAL[monitor][0])
    except ImportError:
        raise _missing(monitor) from None


def check_tb_availability() -> None:
    _require("tensorboard")


def check_wandb_availability() -> None:
    _require("wandb")


def check_comet_availability() -> None:
    _require("comet")
    import comet_ml

    found = getattr(comet_ml, "__version__", "0")
    if pkg_version.parse(found) < pkg_version.Version("3.41.0"):
        raise _missing("comet", f"version {found} (3.41.0 or later is needed)")
