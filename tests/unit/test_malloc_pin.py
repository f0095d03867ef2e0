"""The opt-in glibc mmap-threshold pin of ZeRO-1/2 ([Note: bucket-sized temporaries and the glibc heap])."""

import os
import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_pin_sets_half_the_bucket_capped_and_respects_user_tuning() -> None:
    code = ("from deepspeed.runtime.zero.optimizer import _keep_bucket_temporaries_off_heap as pin;"
            "print(pin(16 * 2**20), pin(256 * 2**20), pin(2**20))")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(8 * 2**20), str(32 * 2**20), "0"]  # half; capped at 32 MiB; too small
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["0", "0", "0"]  # the user's own tuning wins
