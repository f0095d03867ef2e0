"""Isolation between in-process tests: a test that creates the default process group (zero.Init and
deepspeed.initialize do, as upstream, when none exists) or sets the rendezvous variables must not
leave them to the tests after it, which read the world size from the environment."""

import os

import pytest

_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    import torch.distributed as tdist

    had_group = tdist.is_available() and tdist.is_initialized()
    saved = {key: os.environ.get(key) for key in _RENDEZVOUS}
    yield
    if not had_group and tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
