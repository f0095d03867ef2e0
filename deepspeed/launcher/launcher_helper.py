"""Per-rank shim of the MPICH runner: map MPICH's rank variables to RANK/LOCAL_RANK, then exec the script.

`mpirun ... python -u <this file> --launcher mpich [--module|--no_python] script args` (see
multinode_runner.MPICHRunner). It runs as a plain file, so it imports only the standard library.
Unlike upstream's helper, which waits for the script and always exits 0, it replaces itself with
the script (os.execvpe): the script's exit code and signals reach mpirun unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys

RANK_NAMES = {"mpich": (["PMIX_RANK", "PMI_RANK"], ["PALS_LOCAL_RANKID", "MPI_LOCALRANKID"])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Map MPI rank variables to RANK/LOCAL_RANK and run the script.")
    parser.add_argument("--launcher", default="mpich", type=str.lower, help="which MPI's variables to read")
    parser.add_argument("--module", action="store_true", help="run the script as `python -m`")
    parser.add_argument("--no_python", action="store_true", help="execute the script directly")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="accepted for compatibility")
    parser.add_argument("--bind_core_list", default=None, help="accepted for compatibility")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _agreed(env: dict[str, str], names: list[str], what: str) -> str:
    values = {name: env[name] for name in names if name in env}
    if not values:
        raise SystemExit(f"launcher_helper: none of {', '.join(names)} is set; cannot tell this process's {what} "
                         "(was it started by MPICH's mpirun?)")
    if len(set(values.values())) > 1:
        raise SystemExit(f"launcher_helper: the {what} variables disagree: {values}")
    return next(iter(values.values()))


def map_env(env: dict[str, str], launcher: str) -> dict[str, str]:
    """RANK and LOCAL_RANK from the launcher's own variables (which must agree when several are set)."""
    if launcher not in RANK_NAMES:
        raise SystemExit(f"launcher_helper: --launcher {launcher!r} is not supported; expected one of "
                         f"{', '.join(RANK_NAMES)}")
    rank_names, local_names = RANK_NAMES[launcher]
    return {**env, "RANK": _agreed(env, rank_names, "rank"), "LOCAL_RANK": _agreed(env, local_names, "local rank")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = map_env(dict(os.environ), args.launcher)
    if args.no_python:
        cmd = [args.user_script]
    else:
        cmd = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.user_script]
    cmd += args.user_args
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
