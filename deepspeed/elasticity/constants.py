"""Keys and defaults of the `elasticity` config section (upstream module deepspeed.elasticity.constants).

    "elasticity": {
        "enabled": true,
        "max_train_batch_size": 2000,      # the largest global batch the job accepts
        "micro_batch_sizes": [2, 4, 6],    # per-GPU micro-batch sizes the model runs well with
        "min_gpus": 1, "max_gpus": 10000,  # the GPU counts to stay compatible with
        "min_time": 20,                    # minutes before a scheduler may rescale (0: unknown)
        "prefer_larger_batch": true,
        "ignore_non_elastic_batch_info": false,
        "num_gpus_per_node": 1, "model_parallel_size": 1,  # version 0.2 only
        "version": 0.2
    }
"""

ELASTICITY = "elasticity"
LATEST_ELASTICITY_VERSION = 0.2

ENABLED = "enabled"
ENABLED_DEFAULT = False
MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = 2000
MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = [2, 4, 6]
MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = 1
MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = 10000
NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = 1
MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = 1
MIN_TIME = "min_time"
MIN_TIME_DEFAULT = 0
PREFER_LARGER_BATCH = "prefer_larger_batch"
PREFER_LARGER_BATCH_DEFAULT = True
# With elasticity on, train_batch_size / micro batch / gradient accumulation in the config are an
# error (they would be ignored) unless this is true.
IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = False
VERSION = "version"
VERSION_DEFAULT = LATEST_ELASTICITY_VERSION
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
# Set by a resource scheduler: the elasticity section it planned with (JSON); the runtime must agree.
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"
