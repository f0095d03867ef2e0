"""Record upstream DeepSpeed's multi-node command lines and elastic batch results as JSON fixtures.

Run by hand with the *upstream* package importable (it is never imported by the tests):

    TORCH_EXTENSIONS_DIR=$(mktemp -d) /tmp/ds-venv/bin/python tools/launcher_fixtures.py \
        --elasticity-src /tmp/ds-old/deepspeed-0.19.7

Writes
  tests/fixtures/launcher_0_19_8/runner_cmds.json  `deepspeed` (0.19.8 runner.main) for a hostfile,
      flags, environment and .deepspeed_env files: the command it would Popen, selected variables of
      the environment it would pass, the ssh calls it would make, or the exception it raises.
  tests/fixtures/launcher_0_19_8/pdsh_get_cmd.json  PDSHRunner.get_cmd (command and kill command).
  tests/fixtures/launcher_0_19_8/elasticity.json   compute_elastic_config over a grid of inputs.
      DeepSpeed 0.19.8 removed deepspeed/elasticity, so these come from 0.19.7's sources
      (`pip download --no-deps --no-binary :all: deepspeed==0.19.7`, unpacked), loaded beside the
      installed 0.19.8 package.

Nothing runs for real: subprocess calls are intercepted. Machine-specific strings are replaced by
placeholders: {PYTHON} (sys.executable), {CWD} (working directory), {LAUNCHER_DIR} (upstream's
deepspeed/launcher directory; ours in the tests), {PID} (the launcher's pid).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "launcher_0_19_8")
PYTHON = "{PYTHON}"
FAKE_PID = 4242
HOSTNAME_I = b"10.1.2.3 172.17.0.1 \n"
NUMA_CORES = [[0, 1, 2, 3], [4, 5, 6, 7]]  # the topology the IMPI --bind_cores_to_rank cases assume
ENV_KEYS = ("PDSH_RCMD_TYPE", "PDSH_SSH_ARGS_APPEND", "PYTHONPATH")

H2 = "worker-0 slots=4\nworker-1 slots=4\n"
H3 = "# three hosts\nworker-0 slots=2\n\nworker-1 slots=2\nworker-2 slots=2\n"
HU = "w0 slots=4\nw1 slots=2\n"
H1 = "worker-0 slots=4\n"
EXPORT_ENV = {"NCCL_DEBUG": "INFO", "PYTHONHASHSEED": "0", "UCX_TLS": "rc", "MLFLOW_RUN": "7", "MV2_X": "1",
              "OTHER_VAR": "3", "PYTHONFOO": "a b", "NCCL_IB_HCA": "mlx5_0"}
DS_ENV = "FOO=bar\nNCCL_IB_DISABLE=1\nMULTI=x=y\nSPACED=hello world\n"
SCRIPT = ["train.py", "--lr", "0.1"]


def case(name, argv, hostfile=H2, env=None, ds_env=None, home_ds_env=None, accel="cpu"):
    return {"name": name, "argv": argv, "hostfile": hostfile, "env": env or {}, "ds_env": ds_env,
            "home_ds_env": home_ds_env, "accelerator": accel}


def runner_cases() -> list[dict]:
    hf = ["-H", "{CWD}/hostfile"]
    cases = [
        # pdsh
        case("pdsh_default", hf + SCRIPT),
        case("pdsh_master", hf + ["--master_addr", "10.0.0.1", "--master_port", "1234"] + SCRIPT),
        case("pdsh_three_hosts", hf + SCRIPT, hostfile=H3),
        case("pdsh_include", hf + ["-i", "worker-0:0,2@worker-1:1"] + SCRIPT),
        case("pdsh_include_host", hf + ["--include", "worker-1"] + ["--force_multi"] + SCRIPT),
        case("pdsh_exclude", hf + ["-e", "worker-1:0@worker-0:3"] + SCRIPT),
        case("pdsh_num_gpus", hf + ["--num_gpus", "2"] + SCRIPT),
        case("pdsh_num_nodes", hf + ["--num_nodes", "2", "--num_gpus", "1"] + SCRIPT, hostfile=H3),
        case("pdsh_force_multi", hf + ["--force_multi"] + SCRIPT, hostfile=H1),
        case("pdsh_flags", hf + ["--module", "--no_local_rank", "--save_pid", "--enable_each_rank_log", "/logs",
                                 "pkg.train", "--x"]),
        case("pdsh_no_python", hf + ["--no_python", "./run.sh", "a"]),
        case("pdsh_ssh_port", hf + ["--ssh_port", "2222"] + SCRIPT),
        case("pdsh_ssh_port_env", hf + ["--ssh_port", "2222"] + SCRIPT, env={"PDSH_SSH_ARGS_APPEND": "-q"}),
        case("pdsh_no_ssh_check", hf + ["--no_ssh_check", "--master_addr", "w0"] + SCRIPT),
        case("pdsh_venv", hf + ["--venv_script", "/opt/venv/bin/activate"] + SCRIPT),
        case("pdsh_launcher_args", hf + ["--launcher", "PDSH", "--launcher_args", "-R ssh -l user"] + SCRIPT),
        case("pdsh_user_args_quoting", hf + ["train.py", "--name", "hello world", 'say "hi" now', "x'y"]),
        case("pdsh_exports_cpu", hf + SCRIPT, env=EXPORT_ENV, ds_env=DS_ENV),
        case("pdsh_exports_cuda", hf + SCRIPT, env=EXPORT_ENV, ds_env=DS_ENV, accel="cuda"),
        case("pdsh_home_ds_env", hf + SCRIPT, home_ds_env="HOME_VAR=1\nFOO=home\n", ds_env="FOO=cwd\n"),
        case("pdsh_aisc_excludes", hf + SCRIPT, env={**EXPORT_ENV, "AISC_JOB_NAME": "j", "UCX_NET_DEVICES": "x"},
             accel="cuda"),
        case("pdsh_pythonpath", hf + SCRIPT, env={"PYTHONPATH": "/opt/lib:/more"}),
        case("pdsh_log_level", hf + ["--log_level", "debug", "-q"] + SCRIPT),
        # OpenMPI
        case("openmpi_default", hf + ["--launcher", "openmpi"] + SCRIPT),
        case("openmpi_btl_given", hf + ["--launcher", "openmpi", "--launcher_args",
                                        "--mca btl_tcp_if_include ib0 --bind-to none"] + SCRIPT),
        case("openmpi_btl_short", hf + ["--launcher", "openmpi", "--launcher_args", "-mca btl_tcp_if_include lo"]
             + SCRIPT),
        case("openmpi_module", hf + ["--launcher", "openmpi", "--module", "pkg.train", "a"]),
        case("openmpi_no_python", hf + ["--launcher", "openmpi", "--no_python", "./run.sh"]),
        case("openmpi_exports", hf + ["--launcher", "openmpi"] + SCRIPT, env=EXPORT_ENV, ds_env=DS_ENV, accel="cuda"),
        case("openmpi_three_hosts", hf + ["--launcher", "openmpi", "--master_addr", "10.9.9.9"] + SCRIPT, hostfile=H3),
        case("openmpi_uneven", hf + ["--launcher", "openmpi"] + SCRIPT, hostfile=HU),
        case("openmpi_include_error", hf + ["--launcher", "openmpi", "-i", "worker-0"] + SCRIPT),
        case("openmpi_num_gpus_error", hf + ["--launcher", "openmpi", "--num_gpus", "2"] + SCRIPT),
        # MPICH
        case("mpich_default", hf + ["--launcher", "mpich"] + SCRIPT),
        case("mpich_module_args", hf + ["--launcher", "mpich", "--launcher_args", "-bind-to core",
                                        "--module", "pkg.train", "--x"], env=EXPORT_ENV),
        case("mpich_no_python", hf + ["--launcher", "mpich", "--no_python", "./run.sh"]),
        case("mpich_uneven_error", hf + ["--launcher", "mpich"] + SCRIPT, hostfile=HU),
        case("mpich_exclude_error", hf + ["--launcher", "mpich", "-e", "worker-0:1"] + SCRIPT),
        # Intel MPI
        case("impi_default", hf + ["--launcher", "impi"] + SCRIPT),
        case("impi_three_hosts", hf + ["--launcher", "impi", "--module", "pkg.train"], hostfile=H3, env=EXPORT_ENV),
        case("impi_no_python", hf + ["--launcher", "impi", "--no_python", "./run.sh", "z"]),
        case("impi_bind_cores", hf + ["--launcher", "impi", "--bind_cores_to_rank", "--bind_core_list", "0-7"]
             + SCRIPT, hostfile="worker-0 slots=2\nworker-1 slots=2\n"),
        case("impi_bind_cores_split", hf + ["--launcher", "impi", "--bind_cores_to_rank", "--bind_core_list",
                                            "0,1,3-5,7"] + SCRIPT, hostfile="worker-0 slots=2\nworker-1 slots=2\n"),
        case("impi_uneven_error", hf + ["--launcher", "impi"] + SCRIPT, hostfile=HU),
        # MVAPICH
        case("mvapich_default", hf + ["--launcher", "mvapich"] + SCRIPT),
        case("mvapich_cuda", hf + ["--launcher", "mvapich", "--module", "pkg.train"], accel="cuda", env=EXPORT_ENV),
        case("mvapich_no_python", hf + ["--launcher", "mvapich", "--no_python", "./run.sh"], hostfile=H3),
        case("mvapich_uneven_error", hf + ["--launcher", "mvapich"] + SCRIPT, hostfile=HU),
        # SLURM
        case("slurm_default", hf + ["--launcher", "slurm"] + SCRIPT),
        case("slurm_num", hf + ["--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "2"] + SCRIPT, hostfile=H3),
        case("slurm_include_hosts", hf + ["--launcher", "slurm", "-i", "worker-0@worker-2"] + SCRIPT, hostfile=H3),
        case("slurm_include_first_slots", hf + ["--launcher", "slurm", "-i", "worker-0:0,1@worker-1:0,1"] + SCRIPT),
        case("slurm_include_slot_error", hf + ["--launcher", "slurm", "-i", "worker-0:1@worker-1"] + SCRIPT),
        case("slurm_uneven_error", hf + ["--launcher", "slurm"] + SCRIPT, hostfile=HU),
        case("slurm_launcher_args", hf + ["--launcher", "slurm", "--launcher_args", "--partition gpu -t 10"] + SCRIPT,
             env=EXPORT_ENV, ds_env=DS_ENV, accel="cuda"),
        case("slurm_module", hf + ["--launcher", "slurm", "--module", "pkg.train"]),
        case("slurm_no_python", hf + ["--launcher", "slurm", "--no_python", "./run.sh"]),
        # one node of a multi-node job, started without ssh (per-node launch.py command line)
        case("no_ssh_node1", hf + ["--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1"] + SCRIPT),
        case("no_ssh_node0_flags", hf + ["--no_ssh", "--node_rank", "0", "--master_addr", "10.0.0.1",
                                         "--master_port", "4000", "--no_local_rank", "--bind_cores_to_rank",
                                         "--bind_core_list", "0-3", "--enable_each_rank_log", "/logs"] + SCRIPT),
        case("no_ssh_include", hf + ["--no_ssh", "--node_rank", "1", "--master_addr", "h", "-i",
                                     "worker-0:1@worker-2:0"] + SCRIPT, hostfile=H3),
        case("no_ssh_bad_node_rank", hf + ["--no_ssh", "--node_rank", "2", "--master_addr", "h"] + SCRIPT),
        # resource errors
        case("error_include_and_num_gpus", hf + ["-i", "worker-0", "--num_gpus", "1"] + SCRIPT),
        case("error_include_and_exclude", hf + ["-i", "worker-0", "-e", "worker-1"] + SCRIPT),
        case("error_unknown_host", hf + ["-i", "worker-9"] + SCRIPT),
        case("error_unknown_slot", hf + ["-i", "worker-0:7"] + SCRIPT),
        case("error_bad_hostfile_line", hf + SCRIPT, hostfile="worker-0 slots=4\nworker-1 gpus=4\n"),
        case("error_duplicate_host", hf + SCRIPT, hostfile="worker-0 slots=4\nworker-0 slots=2\n"),
        case("error_empty_hostfile", hf + SCRIPT, hostfile="# nothing\n\n"),
    ]
    return cases


class _Recorder:
    """Stands in for subprocess: ssh probes succeed, Popen records and returns at once."""

    def __init__(self):
        self.ssh_calls, self.popen = [], []

    def check_call(self, cmd, **kwargs):
        self.ssh_calls.append(list(cmd))
        return 0

    def check_output(self, cmd, **kwargs):
        if cmd and cmd[0] == "mpiname":
            return b"MVAPICH2-GDR 2.3.7"
        self.ssh_calls.append(list(cmd))
        return HOSTNAME_I

    def Popen(self, cmd, env=None, **kwargs):  # noqa: N802 (subprocess's name)
        self.popen.append((list(cmd), dict(env or {})))
        return types.SimpleNamespace(wait=lambda: 0, returncode=0, send_signal=lambda s: None)


def _normalize(value, cwd: str, launcher_dir: str):
    if isinstance(value, str):
        return (value.replace(launcher_dir, "{LAUNCHER_DIR}").replace(cwd, "{CWD}")
                .replace(str(FAKE_PID), "{PID}"))
    if isinstance(value, list):
        return [_normalize(v, cwd, launcher_dir) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v, cwd, launcher_dir) for k, v in value.items()}
    return value


def run_runner_case(c: dict, runner_mod, mnr_mod, numa_mod) -> dict:
    from deepspeed.accelerator import get_accelerator

    launcher_dir = os.path.dirname(os.path.realpath(mnr_mod.__file__))
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as home:
        cwd = os.path.realpath(cwd)
        with open(os.path.join(cwd, "hostfile"), "w") as fd:
            fd.write(c["hostfile"])
        if c["ds_env"]:
            with open(os.path.join(cwd, ".deepspeed_env"), "w") as fd:
                fd.write(c["ds_env"])
        if c["home_ds_env"]:
            with open(os.path.join(home, ".deepspeed_env"), "w") as fd:
                fd.write(c["home_ds_env"])
        rec = _Recorder()
        accel = get_accelerator()
        saved_env = dict(os.environ)
        old_cwd = os.getcwd()
        patches = [
            (runner_mod.subprocess, "check_call", rec.check_call),
            (runner_mod.subprocess, "check_output", rec.check_output),
            (runner_mod.subprocess, "Popen", rec.Popen),
            (mnr_mod.subprocess, "check_output", rec.check_output),
            (mnr_mod.shutil, "which", lambda name: f"/usr/bin/{name}"),
            (runner_mod.os, "getpid", lambda: FAKE_PID),
            (runner_mod, "DEEPSPEED_ENVIRONMENT_PATHS", [home, "."]),
            (numa_mod, "get_numa_cores", lambda: NUMA_CORES),
            (numa_mod, "check_for_numactl_pkg", lambda: True),
            (sys, "executable", PYTHON),
            (type(accel), "export_envs", (lambda self: ["NCCL"]) if c["accelerator"] == "cuda"
             else (lambda self: [])),
            (type(accel), "device_name", (lambda self, i=None: "cuda") if c["accelerator"] == "cuda"
             else type(accel).device_name),
        ]
        originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        argv = [a.replace("{CWD}", cwd) for a in c["argv"]]
        result: dict = {}
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            os.environ.clear()
            os.environ.update({"PATH": "/usr/bin:/bin", "HOME": home, **c["env"]})
            os.chdir(cwd)
            with contextlib.redirect_stdout(io.StringIO()):
                runner_mod.main(argv)
            cmd, env = rec.popen[0]
            result["cmd"] = cmd
            result["popen_env"] = {k: env[k] for k in ENV_KEYS if k in env}
            if os.path.exists(mnr_mod.MVAPICH_TMP_HOSTFILE) and c["argv"].count("mvapich"):
                with open(mnr_mod.MVAPICH_TMP_HOSTFILE) as fd:
                    result["mvapich_hostfile"] = fd.read()
                os.remove(mnr_mod.MVAPICH_TMP_HOSTFILE)
        except BaseException as exc:  # noqa: BLE001 - recorded, including SystemExit/AssertionError
            result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        finally:
            os.chdir(old_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            for obj, name, value in originals:
                setattr(obj, name, value)
        result["ssh_calls"] = rec.ssh_calls
        return {**c, **_normalize(result, cwd, launcher_dir)}


def pdsh_get_cmd_cases(runner_mod, mnr_mod) -> list[dict]:
    """PDSHRunner.get_cmd directly: the command and the pkill command sent on SIGINT/SIGTERM."""
    out = []
    with tempfile.TemporaryDirectory() as cwd:
        cwd = os.path.realpath(cwd)
        old = os.getcwd()
        saved_exe = sys.executable
        os.chdir(cwd)
        sys.executable = PYTHON
        try:
            for name, argv, resources in [
                ("two_hosts", ["--master_addr", "10.0.0.1", "train.py", "--a"], {"h1": [0, 1], "h2": [0, 1]}),
                ("ssh_port_flags", ["--master_addr", "m", "--ssh_port", "22", "--no_local_rank", "train.py"],
                 {"h1": [0]}),
            ]:
                args = runner_mod.parse_args(argv)
                world_info = runner_mod.encode_world_info(resources)
                pdsh = mnr_mod.PDSHRunner(args, world_info)
                pdsh.add_export("PYTHONPATH", cwd)
                cmd, kill, env = pdsh.get_cmd({"X": "1"}, resources)
                out.append(_normalize({"name": name, "argv": argv, "resources": resources, "cmd": cmd,
                                       "kill_cmd": kill, "env": env}, cwd, "\0"))
        finally:
            os.chdir(old)
            sys.executable = saved_exe
    return out


# --------------------------------------------------------------------------- elasticity


def load_elasticity(src: str):
    """Import 0.19.7's deepspeed/elasticity modules beside the installed deepspeed (0.19.8)."""
    import deepspeed

    path = os.path.join(src, "deepspeed", "elasticity")
    pkg = types.ModuleType("deepspeed.elasticity")
    pkg.__path__ = [path]  # a bare package: skip __init__ (it imports the torch elastic agent)
    sys.modules["deepspeed.elasticity"] = pkg
    deepspeed.elasticity = pkg
    return importlib.import_module("deepspeed.elasticity.elasticity")


def elastic_cases() -> list[dict]:
    cases = []

    def add(name, elastic, world_size=0, return_microbatch=False, env_world_size=None, target="0.19.7", extra=None):
        cfg = {"elasticity": elastic, **(extra or {})}
        cases.append({"name": name, "ds_config": cfg, "target_deepspeed_version": target, "world_size": world_size,
                      "return_microbatch": return_microbatch, "env_world_size": env_world_size})

    base = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
            "max_gpus": 10000, "min_time": 20, "version": 0.1}
    add("v01_doc_example", base)
    for mb in ([1], [2], [3], [2, 4], [2, 4, 6], [3, 5, 7], [8, 12, 16, 17], [1, 2, 3, 4, 5], [5], [6, 10],
               [16, 32, 64]):
        for max_bs in (16, 100, 1000, 2000, 10000, 1000000):
            if max(mb) > max_bs:
                continue
            for prefer in (True, False):
                add(f"v01_mb{'-'.join(map(str, mb))}_max{max_bs}_{'larger' if prefer else 'smaller'}",
                    {**base, "micro_batch_sizes": mb, "max_train_batch_size": max_bs, "prefer_larger_batch": prefer})
    for lo, hi in ((1, 4), (2, 8), (8, 64), (32, 10000), (3, 3), (5, 1000)):
        add(f"v01_gpus_{lo}_{hi}", {**base, "min_gpus": lo, "max_gpus": hi})
    for ws in (1, 2, 3, 4, 8, 7, 16, 50, 64, 1000):
        add(f"v01_world{ws}", {**base, "max_train_batch_size": 1024, "micro_batch_sizes": [2, 4, 8]}, world_size=ws)
        add(f"v01_world{ws}_mb", {**base, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]},
            world_size=ws, return_microbatch=True)
    for env_ws in ("4", "6", "abc", None):
        add(f"v01_return_mb_env{env_ws}", {**base, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]},
            return_microbatch=True, env_world_size=env_ws)
    # version 0.2 (node-level)
    v2 = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
          "max_gpus": 1500, "min_time": 20, "version": 0.2}
    for ws in (64, 96, 128, 100, 32, 1500):
        add(f"v02_world{ws}", v2, world_size=ws)
        add(f"v02_world{ws}_mb", v2, world_size=ws, return_microbatch=True)
    for gpn, mp in ((8, 1), (8, 2), (8, 4), (4, 2), (16, 8), (8, 3)):
        for ws in (32, 64, 80):
            add(f"v02_gpn{gpn}_mp{mp}_world{ws}", {**v2, "num_gpus_per_node": gpn, "model_parallel_size": mp},
                world_size=ws, return_microbatch=True)
    add("v02_env_world", v2, return_microbatch=True, env_world_size="64")
    add("v02_env_missing", v2, return_microbatch=True)
    add("v02_small", {**v2, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 8,
                      "num_gpus_per_node": 2}, world_size=4, return_microbatch=True)
    add("v02_small_prefer_smaller", {**v2, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                                     "max_gpus": 8, "num_gpus_per_node": 2, "prefer_larger_batch": False},
        world_size=6, return_microbatch=True)
    # config checks and errors
    add("err_missing_section", None)
    add("err_disabled", {**base, "enabled": False})
    add("err_missing_max", {k: v for k, v in base.items() if k != "max_train_batch_size"})
    add("err_missing_micro", {k: v for k, v in base.items() if k != "micro_batch_sizes"})
    add("err_micro_not_list", {**base, "micro_batch_sizes": 4})
    add("err_micro_not_int", {**base, "micro_batch_sizes": [2, 4.5]})
    add("err_micro_not_positive", {**base, "micro_batch_sizes": [0, 2]})
    add("err_min_gpus", {**base, "min_gpus": 0})
    add("err_max_lt_min", {**base, "min_gpus": 8, "max_gpus": 4})
    add("err_model_parallel", {**base, "model_parallel_size": 0})
    add("err_model_parallel_v01", {**base, "model_parallel_size": 2})
    add("err_gpus_per_node", {**base, "num_gpus_per_node": 0})
    add("err_min_time", {**base, "min_time": -1})
    add("err_version_too_new", {**base, "version": 0.3})
    add("err_version_unknown", {**base, "version": 0.15})
    add("err_target_version", base, target="0.3.7")
    add("err_world_size_invalid", {**base, "max_train_batch_size": 16, "micro_batch_sizes": [4]}, world_size=3)
    add("err_micro_gt_max", {**base, "max_train_batch_size": 8, "micro_batch_sizes": [4, 16]})
    add("err_v02_gpn_mp", {**v2, "num_gpus_per_node": 8, "model_parallel_size": 3}, world_size=64)
    cases.append({"name": "err_not_dict", "ds_config": "not a dict", "target_deepspeed_version": "0.19.7",
                  "world_size": 0, "return_microbatch": False, "env_world_size": None})
    for c in cases:
        if c["ds_config"] != "not a dict" and c["ds_config"].get("elasticity") is None:
            c["ds_config"] = {"train_batch_size": 8}
    return cases


def run_elastic_case(c: dict, elasticity) -> dict:
    saved = os.environ.pop("WORLD_SIZE", None)
    if c["env_world_size"] is not None:
        os.environ["WORLD_SIZE"] = c["env_world_size"]
    try:
        result = elasticity.compute_elastic_config(c["ds_config"], c["target_deepspeed_version"],
                                                   world_size=c["world_size"],
                                                   return_microbatch=c["return_microbatch"])
        out = {"result": [int(result[0]), [int(g) for g in result[1]] if result[1] is not None else None]
               + [int(m) if m is not None else None for m in result[2:]]}
    except Exception as exc:  # noqa: BLE001 - recorded
        out = {"error": {"type": type(exc).__name__, "message": str(exc)}}
    finally:
        os.environ.pop("WORLD_SIZE", None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    return {**c, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elasticity-src", required=True, help="unpacked DeepSpeed 0.19.7 sdist")
    args = parser.parse_args()
    import deepspeed

    assert deepspeed.__version__.startswith("0.19.8"), deepspeed.__version__
    runner_mod = importlib.import_module("deepspeed.launcher.runner")
    mnr_mod = importlib.import_module("deepspeed.launcher.multinode_runner")
    numa_mod = importlib.import_module("deepspeed.utils.numa")
    os.makedirs(OUT_DIR, exist_ok=True)
    runner = [run_runner_case(c, runner_mod, mnr_mod, numa_mod) for c in runner_cases()]
    pdsh = pdsh_get_cmd_cases(runner_mod, mnr_mod)
    elasticity = load_elasticity(args.elasticity_src)
    elastic = [run_elastic_case(c, elasticity) for c in elastic_cases()]
    meta = {"deepspeed": deepspeed.__version__, "elasticity_from": os.path.basename(os.path.abspath(
        args.elasticity_src)), "numa_cores": NUMA_CORES, "hostname_I": HOSTNAME_I.decode(), "pid": FAKE_PID}
    for name, data in (("runner_cmds", runner), ("pdsh_get_cmd", pdsh), ("elasticity", elastic)):
        with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as fd:
            json.dump({"meta": meta, "cases": data}, fd, indent=1)
            fd.write("\n")
        print(f"{name}: {len(data)} cases, {sum('error' in c for c in data)} errors")
    shutil.rmtree("/tmp/deepspeed_mvapich_hostfile", ignore_errors=True)


if __name__ == "__main__":
    main()
