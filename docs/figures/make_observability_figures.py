"""Regenerate the figures of docs/observability.md from a real run of the demo.

    python docs/figures/make_observability_figures.py              # trains the demo (2 ranks), then plots
    python docs/figures/make_observability_figures.py --run runs/obs --plot-only

Needs `tensorboard` and `matplotlib` (neither is a dependency of the package). Trains the demo
(examples/gpt/train.py, ZeRO-2, 2 ranks, the `deepspeed` launcher) with its ds_config.json plus the
TensorBoard and CSV monitors, the wall-clock breakdown and the FLOPs profiler, then renders the
TensorBoard event file into docs/figures/tensorboard_demo.png (read back with TensorBoard's own
EventAccumulator) and copies the profiler's report to docs/figures/flops_profile_demo.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PANELS = [("Train/Samples/train_loss", "training loss (rank 0)"), ("Train/Samples/lr", "learning rate"),
          ("Train/Samples/grad_norm", "gradient norm (before clipping)"),
          ("Train/Samples/elapsed_time_ms_forward", "ms per step: forward / backward / step")]
TIMES = [("Train/Samples/elapsed_time_ms_forward", "forward"), ("Train/Samples/elapsed_time_ms_backward", "backward"),
         ("Train/Samples/elapsed_time_ms_step", "step")]


def train(run: str, steps: int) -> None:
    with open(os.path.join(ROOT, "examples", "gpt", "ds_config.json")) as f:
        cfg = json.load(f)
    cfg.update({"steps_per_print": 10, "wall_clock_breakdown": True,
                "tensorboard": {"enabled": True, "output_path": run, "job_name": "tensorboard"},
                "csv_monitor": {"enabled": True, "output_path": run, "job_name": "csv"},
                "flops_profiler": {"enabled": True, "profile_step": 5, "module_depth": 2, "top_modules": 2,
                                   "detailed": True, "output_file": os.path.join(run, "flops_profile.txt")}})
    cfg["scheduler"]["params"]["total_num_steps"] = steps
    config = os.path.join(run, "ds_config.json")
    with open(config, "w") as f:
        json.dump(cfg, f, indent=2)
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([launcher, "--num_gpus", "2", os.path.join(ROOT, "examples", "gpt", "train.py"), "--deepspeed",
                    "--deepspeed_config", config, "--steps", str(steps), "--sample-len", "0"], check=True, env=env)


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot(scalars: dict[str, list[tuple[int, float]]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), dpi=110)
    for ax, (tag, title) in zip(axes.flat, PANELS):
        lines = TIMES if tag == TIMES[0][0] else [(tag, None)]
        for name, label in lines:
            steps, values = zip(*scalars[name])
            ax.plot(steps, values, label=label, linewidth=1.2)
        ax.set_title(f"{title}\n{tag if label is None else 'Train/Samples/elapsed_time_ms_*'}", fontsize=9)
        ax.set_xlabel("samples (engine.global_samples)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if label is not None:
            ax.legend(fontsize=8)
    fig.suptitle("examples/gpt, ZeRO-2 on 2 ranks (CPU, gloo): the TensorBoard event file of rank 0", fontsize=10)
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=None, help="run folder (default: a fresh temporary one)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plot-only", action="store_true", help="plot an existing --run without training")
    a = p.parse_args()
    run = os.path.abspath(a.run or tempfile.mkdtemp(prefix="obs_demo_"))
    os.makedirs(run, exist_ok=True)
    if not a.plot_only:
        train(run, a.steps)
    plot(read_scalars(os.path.join(run, "tensorboard")), os.path.join(HERE, "tensorboard_demo.png"))
    shutil.copyfile(os.path.join(run, "flops_profile.txt"), os.path.join(HERE, "flops_profile_demo.txt"))
    print(f"wrote {os.path.join(HERE, 'tensorboard_demo.png')} and flops_profile_demo.txt from {run}")


if __name__ == "__main__":
    main()
