"""Elastic batch sizes: one global batch that stays valid across a range of GPU counts.

`compute_elastic_config` gives the same results as DeepSpeed 0.19.7 (0.19.8 removed the package);
the engine takes its batch sizes from it when the config's `elasticity` section is enabled, so a
job restarted on another number of nodes keeps its global batch (see docs/launcher.md).
"""

from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from .elasticity import compute_elastic_config, elastic_batch_params, elasticity_enabled, ensure_immutable_elastic_config
from .utils import is_torch_elastic_compatible

__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "elastic_batch_params",
           "is_torch_elastic_compatible", "ElasticityConfig", "ElasticityError", "ElasticityConfigError",
           "ElasticityIncompatibleWorldSize", "ELASTICITY", "ENABLED", "ENABLED_DEFAULT"]
