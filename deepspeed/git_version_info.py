# compat: upstream deepspeed.git_version_info (written by its setup.py at build time). Tools and
# upstream's test harness read the version, which ops are installed (none are compiled here) and
# which are compatible (those with a PyTorch equivalent: deepspeed.ops.op_builder).
"""Build facts: version, ops, the torch this runs on."""

import torch

from .ops.op_builder import ALL_OPS
from .version import __version__ as version
from .version import git_branch, git_hash

installed_ops = dict.fromkeys(ALL_OPS, False)
compatible_ops = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
              "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
              "hip_version": ".".join((getattr(torch.version, "hip", None) or "0.0").split(".")[:2]),
              "nccl_version": "0.0"}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "accelerator_name", "torch_info"]
