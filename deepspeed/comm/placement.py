"""Where a tensor must live for a collective: [Note: collective device].

[Note: collective device]
gloo reduces host tensors; NCCL only device tensors of this rank's own GPU ("No backend type
associated with device type cpu" otherwise). A tensor that the runtime creates only to carry a
few numbers through a collective (an agreed flag, a capacity, a norm of a rank that holds no
gradients) therefore takes its device from the group's backend, never from torch's default (the
CPU). `collective_device(group)` is that device. Tensors combined with device data (stacked,
added) take that data's device instead. tests/unit/test_tensor_placement.py holds the package to
it: a tensor factory without `device=` and a literal CPU device need a `host:` comment saying why.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _tdist

_HOST = torch.device("cpu")   # host: gloo's (and an uninitialised process's) device


def collective_device(group: Any = None) -> torch.device:
    """This rank's GPU for an NCCL group, else the CPU. The first collective of a process whose
    group the user created without torch.cuda.set_device (the engine sets the device only later)
    takes LOCAL_RANK's GPU, as the engine will, not cuda:0 on every rank."""
    if not (_tdist.is_available() and _tdist.is_initialized()) or _tdist.get_backend(group) != "nccl":
        return _HOST
    local = os.environ.get("LOCAL_RANK")
    if local is not None and torch.cuda.current_device() != int(local):
        torch.cuda.set_device(int(local))
    return torch.device("cuda", torch.cuda.current_device())
