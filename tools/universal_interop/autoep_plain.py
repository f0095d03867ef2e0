"""AutoEP checkpoints between this package and DeepSpeed 0.19.8 by a plain load_checkpoint with strict defaults.

    python tools/universal_interop/autoep_plain.py [--ds-venv /tmp/ds-venv] [--work /tmp/autoep_plain] [--stages 1,3]

For each ZeRO stage and each writer (ours, DeepSpeed's): autoep_worker.py trains the AutoEP fixture model
(whole-block replaced: its module state holds the router alias `mlp.gate.gate.weight`, [Note: AutoEP router
alias]) 2 steps at autoep_size 2 and saves (no conversion); each reader loads that tag with
`engine.load_checkpoint(dir)` (load_module_strict=True, optimizer and scheduler states) at autoep_size 2 and
1 and trains 2 more steps; the continued losses are compared with our uninterrupted 4 steps at that size
(docs/moe.md "Checkpoints with experts")."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from autoep import matrix  # noqa: E402
from run import setup  # noqa: E402


def main() -> int:
    args, work, scratch = setup(__doc__.split("\n")[0], "--stages", "1,3", "autoep_plain_")
    print("SUMMARY " + json.dumps(matrix(args, work, scratch, "plain")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
