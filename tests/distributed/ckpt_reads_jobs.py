"""Jobs of test_checkpoint_reads.py: a load that records which checkpoint files each rank opened."""

from __future__ import annotations

import os
from typing import Any

import ckpt_jobs as J


def opened_files_job(cfg: dict, load_dir: str) -> dict:
    """A fresh engine loads `load_dir` (latest); returns the files its rank opened (in order), the
    slices of trained parameters it holds ((group, name, start, numel): what it had to read) and
    (rank 0) the full fp32 masters and optimizer states after the load."""
    import torch.distributed as dist

    from deepspeed.checkpoint import files
    from deepspeed.runtime.checkpoint.hp_state import HpState

    engine = J.build(cfg, "tiny", seed=123)
    with files.watch_opens() as seen:
        engine.load_checkpoint(load_dir)
    pieces = [(p.group, p.name, p.start, p.numel) for p in HpState(engine._checkpoint_view()).pieces]
    snap = J.snapshot(engine)
    return {"opened": [os.path.basename(p) for p in seen], "pieces": pieces,
            "snap": snap if dist.get_rank() == 0 else None}


def saved_groups(tag_dir: str) -> list[dict[str, int]]:
    """{name: numel} of each optimizer param group, in file order, from `param_shapes`."""
    import torch

    shapes: Any = torch.load(os.path.join(tag_dir, J.MODEL_FILE), weights_only=True, map_location="cpu")["param_shapes"]
    shapes = [shapes] if isinstance(shapes, dict) else shapes
    return [{n: torch.Size(s).numel() for n, s in group.items()} for group in shapes]
