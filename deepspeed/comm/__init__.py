# compat: `import deepspeed.comm as dist` — the upstream function API.
from .comm import *  # noqa: F401,F403
from .comm import ReduceOp, comms_counter, configure, init_distributed, mpi_discovery  # noqa: F401
from .counting import CommsCounter  # noqa: F401
from .placement import collective_device  # noqa: F401  (ours: [Note: collective device])
from .rendezvous import RanksDidNotArrive, arrive_and_wait  # noqa: F401

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from .._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
