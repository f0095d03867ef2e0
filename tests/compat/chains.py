"""Attribute chains evaluated in a fresh interpreter after only `import deepspeed`, as a client's
first use sees them (nothing imported before by other tests)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import deepspeed
lazy = [m for m in ("deepspeed.runtime.engine", "deepspeed.runtime.lr_schedules", "pydantic") if m in sys.modules]
bad = {}
for chain in json.loads(sys.argv[1]):
    try:
        eval(chain)
    except Exception as e:
        bad[chain] = repr(e)
print(json.dumps({"bad": bad, "eager": lazy, "zero_alias": deepspeed.zero is deepspeed.runtime.zero}))
"""


def resolve_after_bare_import(chains: list[str]) -> dict:
    """{"bad": {chain: error}, "eager": heavy modules `import deepspeed` alone loaded,
    "zero_alias": deepspeed.zero is deepspeed.runtime.zero}."""
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(chains)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])
