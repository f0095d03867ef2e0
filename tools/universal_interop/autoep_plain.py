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
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from autoep import job  # noqa: E402
from run import rel, report, setup  # noqa: E402


def main() -> int:
    args, work, scratch = setup(__doc__.split("\n")[0], "--stages", "1,3", "autoep_plain_")
    summary = []
    for stage in map(int, args.stages.split(",")):
        want = {ep: job("ours", args.ds_venv, scratch, ckpt=work, ep=ep, stage=stage, steps=4, start=0) for ep in (2, 1)}
        for writer in ("ours", "upstream"):
            ckpt = os.path.join(work, f"z{stage}_{writer}")
            shutil.rmtree(ckpt, ignore_errors=True)
            saved = job(writer, args.ds_venv, scratch, ckpt=ckpt, ep=2, stage=stage, steps=2, start=0, save="t")
            for reader in ("ours", "upstream"):
                for ep in (2, 1):
                    case = {"stage": stage, "written_by": writer, "loaded_by": reader, "ep": ep}
                    got = saved if "error" in saved else \
                        job(reader, args.ds_venv, scratch, ckpt=ckpt, ep=ep, stage=stage, steps=2, start=2, load="plain")
                    if "error" in got:
                        case["error"] = got["error"]
                    else:
                        case.update(losses=got["losses"], max_rel=rel(got["losses"], want[ep]["losses"][2:]))
                    report(summary, case, f"ZeRO-{stage} written by {writer:8s} loaded by {reader:8s} at ep {ep}")
    print("SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
