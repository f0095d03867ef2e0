"""AutoEP universal checkpoints between this package and DeepSpeed 0.19.8, both directions (CPU, 2 ranks, gloo).

    python tools/universal_interop/autoep.py [--ds-venv /tmp/ds-venv] [--work /tmp/autoep_interop] [--stages 1,3]

For each ZeRO stage and each writer (ours, DeepSpeed's): autoep_worker.py trains the AutoEP fixture model
(autoep_size 2) 2 steps and saves; the writer's own ds_to_universal converts the tag; each reader loads it with
checkpoint.load_universal at autoep_size 2 and 1 and trains 2 more steps; the continued losses are compared
with our uninterrupted 4 steps at that size (docs/checkpointing.md "With DeepSpeed 0.19.8")."""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from run import rel, report, run, setup  # noqa: E402

WORKER = os.path.join(HERE, "autoep_worker.py")


def job(impl: str, venv: str, scratch: str, **spec) -> dict:
    rc, out = run(impl, venv, scratch, [WORKER, json.dumps(spec)], timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if rc == 0 and lines else {"error": " | ".join(out.splitlines()[-3:])}


def matrix(args, work: str, scratch: str, load: str) -> list:
    """Every stage x writer x reader x ep case; `load`: "universal" (the writer's own ds_to_universal, then
    load_universal) or "plain" (load_checkpoint of the saved tag, strict defaults: autoep_plain.py)."""
    summary: list = []
    for stage in map(int, args.stages.split(",")):
        want = {ep: job("ours", args.ds_venv, scratch, ckpt=work, ep=ep, stage=stage, steps=4, start=0) for ep in (2, 1)}
        for writer in ("ours", "upstream"):
            ckpt = os.path.join(work, f"z{stage}_{writer}")
            shutil.rmtree(ckpt, ignore_errors=True)
            saved = job(writer, args.ds_venv, scratch, ckpt=ckpt, ep=2, stage=stage, steps=2, start=0, save="t")
            rc, out = 0, ""
            if load == "universal":
                rc, out = run(writer, args.ds_venv, scratch, ["-m", "deepspeed.checkpoint.ds_to_universal",
                                                              "--input_folder", os.path.join(ckpt, "t"),
                                                              "--output_folder", os.path.join(ckpt, "t_universal")])
                with open(os.path.join(ckpt, "latest_universal"), "w") as f:
                    f.write("t_universal")
            for reader in ("ours", "upstream"):
                for ep in (2, 1):
                    case = {"stage": stage, "written_by": writer, "loaded_by": reader, "ep": ep}
                    got = saved if "error" in saved else {"error": out[-300:]} if rc else \
                        job(reader, args.ds_venv, scratch, ckpt=ckpt, ep=ep, stage=stage, steps=2, start=2, load=load)
                    if "error" in got:
                        case["error"] = got["error"]
                    else:
                        case.update(losses=got["losses"], max_rel=rel(got["losses"], want[ep]["losses"][2:]))
                    report(summary, case, f"ZeRO-{stage} written by {writer:8s} loaded by {reader:8s} at ep {ep}")
    return summary


def main() -> int:
    args, work, scratch = setup(__doc__.split("\n")[0], "--stages", "1,3", "autoep_interop_")
    print("SUMMARY " + json.dumps(matrix(args, work, scratch, "universal")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
