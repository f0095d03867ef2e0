# compat: upstream path deepspeed.runtime.zero.leaf_module_config (DeepSpeed 0.19.8 names).
"""`zero_optimization.leaf_module`: the config class and its defaults under upstream's names.

The defaults are lists, as upstream's, so `config.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES`
holds for a default config; each is a fresh copy of the section's own defaults
(deepspeed/runtime/config/sections/zero.py), so mutating one changes no config.
"""

from ..config.sections import zero as _zero
from ..config.sections.zero import DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_CLASSES = list(_zero.DEFAULT_LEAF_MODULE_CLASSES)
DEFAULT_LEAF_MODULE_NAMES = list(_zero.DEFAULT_LEAF_MODULE_NAMES)
DEFAULT_LEAF_MODULE_NAME_SUFFIXES = list(_zero.DEFAULT_LEAF_MODULE_NAME_SUFFIXES)

__all__ = ["DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
           "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
