"""Legacy configuration classes of the DeepSpeed 0.3 manual: Config, TrainingConfig, BatchConfig,
FP16Config. They are small attribute structs; the JSON config (deepspeed.runtime.config) is the
primary interface, and TrainingConfig.to_ds_config() bridges the two.

    >>> c = Config(verbose=True)
    >>> c.verbose, c['verbose']
    (True, True)
    >>> Config.from_dict({'verbose': True}).verbose
    True
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

from deepspeed.runtime.config.batch import resolve_batch
from deepspeed.runtime.config.ds_config import data_parallel_world_size
from deepspeed.runtime.config.errors import DeepSpeedConfigError, did_you_mean, suggest


class Config:
    """Base class for DeepSpeed configurations: a struct built from keyword arguments or a dict.

    Subclasses list their fields in `_fields` (name -> sub-config class or None); they reject
    unknown names and build sub-configs from nested dicts. The base class accepts any name.
    """

    _fields: ClassVar[Optional[dict[str, Optional[type["Config"]]]]] = None

    def __init__(self, **kwargs: Any):
        fields = type(self)._fields
        if fields is not None:
            unknown = [k for k in kwargs if k not in fields]
            if unknown:
                raise DeepSpeedConfigError([f"{type(self).__name__}: unknown field {k!r}"
                                            f"{did_you_mean(suggest(k, fields))}" for k in unknown])
            for name in fields:
                setattr(self, name, None)
        for name, value in kwargs.items():
            sub = fields.get(name) if fields else None
            setattr(self, name, sub.from_dict(value) if sub is not None and isinstance(value, dict) else value)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "Config":
        return cls(**config)

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self, name, value)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in vars(self)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({inner})"

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in vars(self).items()}

    def _sub_configs(self) -> list["Config"]:
        return [v for v in vars(self).values() if isinstance(v, Config)]

    def resolve(self) -> None:
        """Infer any missing arguments, if possible (sub-configs included)."""
        for sub in self._sub_configs():
            sub.resolve()

    def _check(self) -> None:
        """Raise DeepSpeedConfigError if this config's own values are invalid."""

    def is_valid(self) -> bool:
        """Resolve missing values, then report whether this config and all sub-configs are valid."""
        try:
            self.resolve()
            self._check()
        except (DeepSpeedConfigError, ValueError, TypeError):
            return False
        return all(sub.is_valid() for sub in self._sub_configs())


class BatchConfig(Config):
    """Batch size related parameters: train_batch_size = micro * gradient_accumulation_steps * world."""

    _fields = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None}
    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None

    def resolve(self, world_size: Optional[int] = None) -> None:
        """Complete the batch configuration from the values given (DeepSpeed's rules; see
        deepspeed/runtime/config/batch.py). The world size comes from torch.distributed when it is
        initialised, else the WORLD_SIZE environment variable, else 1."""
        sizes = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                              self.gradient_accumulation_steps, data_parallel_world_size(None, world_size))
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = sizes.gradient_accumulation_steps


class FP16Config(Config):
    """FP16 configuration: `enabled` turns fp16 training on; `clip` is the gradient clipping norm."""

    _fields = {"enabled": None, "clip": None}
    enabled: Optional[bool] = None
    clip: Optional[float] = None

    def _check(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise DeepSpeedConfigError(f"FP16Config.enabled: got {self.enabled!r}; expected true or false")
        clip = self.clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not math.isfinite(clip) or clip < 0):
            raise DeepSpeedConfigError(f"FP16Config.clip: got {clip!r}; expected a number >= 0")


class TrainingConfig(Config):
    """Top-level configuration for all aspects of training: `batch` (BatchConfig), `fp16` (FP16Config)."""

    _fields = {"batch": BatchConfig, "fp16": FP16Config}
    batch: Optional[BatchConfig] = None
    fp16: Optional[FP16Config] = None

    def to_ds_config(self) -> dict[str, Any]:
        """The equivalent DeepSpeed JSON config dict (after resolve(), batch sizes are complete)."""
        out: dict[str, Any] = {}
        if self.batch is not None:
            out.update({k: v for k, v in self.batch.to_dict().items() if v is not None})
        if self.fp16 is not None:
            if self.fp16.enabled is not None:
                out["fp16"] = {"enabled": self.fp16.enabled}
            if self.fp16.clip is not None:
                out["gradient_clipping"] = self.fp16.clip
        return out


__all__ = ["BatchConfig", "Config", "FP16Config", "TrainingConfig"]
