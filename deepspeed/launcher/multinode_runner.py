"""The command lines that start a multi-node job through a cluster tool (upstream module name).

Each runner turns the parsed `deepspeed` flags, the world info and the exported variables into
the command DeepSpeed 0.19.8 builds for the same inputs (tests/unit/test_multinode_runner.py
checks them against upstream's, recorded in tests/fixtures/launcher_0_19_8). Building a
command is pure (MVAPICH also writes its hostfile, as upstream); `multinode.py` runs it.

| runner  | starts                                  | rank / world size from               |
|---------|-----------------------------------------|--------------------------------------|
| pdsh    | launch.py once per host over ssh        | launch.py (node rank = pdsh's %n)    |
| openmpi | mpirun -n N -hostfile F python script   | OMPI_COMM_WORLD_* (init_distributed) |
| mpich   | mpirun ... launcher_helper.py script    | PMI_RANK / MPI_LOCALRANKID (helper)  |
| impi    | mpirun ... -env RANK i -env LOCAL_RANK  | the command line                     |
| mvapich | mpirun -np N -ppn P --hostfile F        | MV2_COMM_WORLD_* (init_distributed)  |
| slurm   | srun -n N python script                 | SLURM_PROCID/... (init_distributed)  |

Deliberate differences from upstream, each a command upstream builds that cannot work:
`--module` with MPICH puts `-m` before the helper's file path and `--no_python` executes
the helper (a .py file without a shebang) directly: here the helper always runs under python
and gets `--module`/`--no_python`. SLURM ignores `--module` and `--no_python`: here they apply.
pdsh passes an argument with shell characters but no space unquoted: here it is quoted.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

from .constants import MVAPICH_TMP_HOSTFILE, PDSH_MAX_FAN_OUT
from .resources import LaunchError, cuda_device_count

_SHELL_SAFE = re.compile(r"^[\w@%+=:,./-]*$")


def _count(args: Any, name: str) -> int | None:
    """--num_nodes/--num_gpus: upstream's -1 and our None both mean 'not given'."""
    value = getattr(args, name, None)
    return value if value is not None and value > 0 else None


def _master_port(args: Any) -> int:
    """--master_port; our parser leaves it None when not given (upstream's default is 29500)."""
    return args.master_port or 29500


def _each_rank_log(args: Any) -> str | None:
    value = getattr(args, "enable_each_rank_log", None)
    return None if value is None else str(value)


class MultiNodeRunner(ABC):
    """Base of the runners: the user's script and arguments, and the variables to export."""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        # Facts about the launching process that go into the command; tests pin them.
        self.python = sys.executable
        self.cwd = os.path.abspath(".")
        self.launcher_pid = os.getpid()

    @abstractmethod
    def backend_exists(self) -> Any:
        """Whether the tool this runner calls is installed."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> Any:
        """The command that starts the job (pdsh also returns its kill command and environment)."""

    def add_export(self, key: str, var: str) -> None:
        """Export `key=var` to every rank; values with shell characters are double-quoted (upstream)."""
        var = var.strip()
        if not _SHELL_SAFE.match(var):
            var = f'"{var}"'
        self.exports[key.strip()] = var

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Reject flags this backend cannot honour."""

    @classmethod
    def validate_active_resources(cls, active_resources: Mapping[str, Sequence[int]]) -> None:
        """Reject an --include/--exclude result this backend cannot express (checked before launch)."""

    def python_exec(self) -> list[str]:
        """`python -u [-m]`, or nothing with --no_python."""
        if self.args.no_python:
            return []
        return [self.python, "-u"] + (["-m"] if self.args.module else [])

    def _no_filters(self) -> None:
        """MPI backends take the whole hostfile: no --include/--exclude/--num_nodes/--num_gpus."""
        if self.args.include or self.args.exclude:
            raise LaunchError(f"--launcher {self.name}: does not support --include/--exclude (it launches on "
                              "every host of the hostfile); edit the hostfile or use --launcher pdsh")
        if _count(self.args, "num_nodes") or _count(self.args, "num_gpus"):
            raise LaunchError(f"--launcher {self.name}: does not support --num_nodes/--num_gpus; edit the "
                              "hostfile's slots or use --launcher pdsh")


class _HostfileRunner(MultiNodeRunner):
    """A backend that is given the hostfile's {host: slots} (the MPI tools and srun)."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self) -> Any:
        return shutil.which("mpirun")

    def validate_args(self) -> None:
        self._no_filters()


def _same_slots(name: str, resource_pool: Mapping[str, int]) -> tuple[int, int]:
    """(total processes, processes per node); MPI's -ppn needs the same count on every host."""
    counts = list(resource_pool.values())
    if len(set(counts)) > 1:
        listing = ", ".join(f"{h}={n}" for h, n in resource_pool.items())
        raise LaunchError(f"--launcher {name}: needs the same slots on every host, the hostfile has {listing}")
    return sum(counts), counts[0]


class PDSHRunner(MultiNodeRunner):
    """pdsh runs `python -m deepspeed.launcher.launch --node_rank=%n` on every host over ssh."""

    def backend_exists(self) -> Any:
        return shutil.which("pdsh")

    @property
    def name(self) -> str:
        return "pdsh"

    def parse_user_args(self) -> list[str]:
        """pdsh joins the command into one string for the remote shell: quote what the shell would
        split or expand. Arguments with a space get upstream's double quotes; other unsafe ones
        (quotes, $, globs, an empty string) shlex quoting, where upstream passes them as they are."""
        out = []
        for arg in self.args.user_args:
            if " " in arg and not re.search(r"[$`\\!]", arg):
                arg = '"{}"'.format(arg.replace('"', '\\"'))
            elif not arg or not _SHELL_SAFE.match(arg):
                arg = shlex.quote(arg)
            out.append(arg)
        return out

    def launch_args(self) -> list[str]:
        """The per-host launch.py command (without the user's script)."""
        args = self.args
        exports = "".join(f"export {key}={value}; " for key, value in self.exports.items())
        cmd = [exports, f"cd {self.cwd};", self.python, "-u", "-m", "deepspeed.launcher.launch",
               f"--world_info={self.world_info_base64}", "--node_rank=%n", f"--master_addr={args.master_addr}",
               f"--master_port={_master_port(args)}"]
        if getattr(args, "venv_script", None) is not None:
            cmd = [f"source {args.venv_script};"] + cmd
        for flag in ("no_python", "module", "no_local_rank"):
            if getattr(args, flag, False):
                cmd.append(f"--{flag}")
        if args.save_pid:
            cmd += ["--save_pid", f"{self.launcher_pid}"]
        if _each_rank_log(args):
            cmd.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
        if getattr(args, "elastic_training", False):
            cmd += ["--enable_elastic_training", f"--max_elastic_nodes={args.max_elastic_nodes}",
                    f"--min_elastic_nodes={args.min_elastic_nodes}"]
        return cmd

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]):
        """(command, kill command, environment); the kill command is pdsh running `pkill -f` of the
        launch.py command line on every host, sent when the launcher is interrupted."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:
            previous = environment.get("PDSH_SSH_ARGS_APPEND", "")
            environment["PDSH_SSH_ARGS_APPEND"] = f"{previous} {' ' * 12}-p {self.args.ssh_port}"
        workers = ",".join(active_resources.keys())
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers] + shlex.split(self.args.launcher_args)
        launch = self.launch_args()
        pattern = " ".join(part + "\\" for part in [self.python, "-u", "-m", "deepspeed.launcher.launch"])[:-2]
        kill = pdsh + ["pkill -f ", pattern]
        return pdsh + launch + [self.user_script] + self.user_arguments, kill, environment


class OpenMPIRunner(_HostfileRunner):
    """mpirun starts every rank; init_distributed reads OMPI_COMM_WORLD_*."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self) -> Any:
        return shutil.which("ompi_info")

    @property
    def name(self) -> str:
        return "openmpi"

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> list[str]:
        launcher_args = shlex.split(self.args.launcher_args)
        # TCP over eth0 unless --launcher_args picks the interface (upstream's default).
        given = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(launcher_args,
                                                                                         launcher_args[1:]))
        btl = [] if given else ["--mca", "btl_tcp_if_include", "eth0"]
        mpirun = ["mpirun", "-n", f"{sum(self.resource_pool.values())}", "-hostfile", f"{self.args.hostfile}",
                  "--mca", "btl", "^openib"] + btl + launcher_args
        exports = [item for key, value in self.exports.items() for item in ("-x", f"{key}={value}")]
        return mpirun + exports + self.python_exec() + [self.user_script] + self.user_arguments


class MPICHRunner(_HostfileRunner):
    """mpirun (hydra) starts launcher_helper.py per rank, which maps PMI_RANK to RANK."""

    @property
    def name(self) -> str:
        return "mpich"

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> list[str]:
        total, per_node = _same_slots(self.name, self.resource_pool)
        mpirun = ["mpirun", "-n", f"{total}", "-ppn", f"{per_node}"] + shlex.split(self.args.launcher_args)
        exports = [item for key, value in self.exports.items() for item in ("-genv", f"{key}={value}")]
        for key, value in (("MASTER_ADDR", self.args.master_addr), ("MASTER_PORT", _master_port(self.args)),
                           ("WORLD_SIZE", total), ("LOCAL_SIZE", per_node)):
            exports += ["-genv", key, str(value)]
        exports += ["-hosts", ",".join(self.resource_pool.keys())]
        helper = [os.path.join(os.path.dirname(os.path.realpath(__file__)), "launcher_helper.py"),
                  "--launcher", self.args.launcher]
        if self.args.no_python:
            helper.append("--no_python")
        elif self.args.module:
            helper.append("--module")
        python = [self.python, "-u"]  # the helper is a Python file; it adds -m / drops python itself
        return mpirun + exports + python + helper + [self.user_script] + self.user_arguments


class IMPIRunner(_HostfileRunner):
    """Intel MPI's mpirun with one `-n 1 -env RANK i -env LOCAL_RANK j` section per rank."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.numa_cores: list[list[int]] | None = None  # None: read /sys when binding cores

    @property
    def name(self) -> str:
        return "impi"

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> list[str]:
        total, per_node = _same_slots("impi", self.resource_pool)
        args = self.args
        mpirun = ["mpirun", "-ppn", f"{per_node}"] + shlex.split(args.launcher_args)
        exports = [item for key, value in self.exports.items() for item in ("-genv", key, value)]
        bind = getattr(args, "bind_cores_to_rank", False)
        numactl = []
        if bind:
            from ..utils.numa import get_numactl_cmd  # deepspeed.utils imports torch: only when binding

            try:
                numactl = [get_numactl_cmd(args.bind_core_list, per_node, r, self.numa_cores)
                           for r in range(per_node)]
            except ValueError as exc:
                raise LaunchError(str(exc)) from None
            exports += ["-genv", "OMP_NUM_THREADS", str(numactl[0][0])]
        for key, value in (("MASTER_ADDR", args.master_addr), ("MASTER_PORT", _master_port(args)),
                           ("WORLD_SIZE", total), ("LOCAL_SIZE", per_node)):
            exports += ["-genv", key, str(value)]
        exports += ["-genv", "I_MPI_PIN", "0"]  # DeepSpeed binds cores itself (numactl)
        exports += ["-hosts", ",".join(self.resource_pool.keys())]
        per_rank: list[str] = []
        for rank in range(total):
            local = rank % per_node
            prefix = numactl[local][1] if bind else []
            section = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local)]
            per_rank += ([":"] if rank else []) + section + prefix + self.python_exec() + [self.user_script]
            per_rank += self.user_arguments
        return mpirun + exports + per_rank


class SlurmRunner(_HostfileRunner):
    """srun starts every rank; init_distributed reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID."""

    def backend_exists(self) -> Any:
        return shutil.which("sinfo")

    @property
    def name(self) -> str:
        return "slurm"

    def validate_args(self) -> None:
        """srun takes --include/--exclude/--num_* (validate_active_resources checks the result)."""

    @classmethod
    def validate_active_resources(cls, active_resources: Mapping[str, Sequence[int]]) -> None:
        """srun places tasks by count: it cannot pick device ids or give hosts different counts."""
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise LaunchError(f"--launcher slurm: cannot select device ids {list(slots)} on {host}; srun "
                                  "places tasks by count. Filter whole hosts, or keep the first N slots on each")
        counts = {host: len(slots) for host, slots in active_resources.items()}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"{h}={n}" for h, n in counts.items())
            raise LaunchError(f"--launcher slurm: needs the same slot count on every host, got {listing}")

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> list[str]:
        self.validate_active_resources(active_resources)
        args = self.args
        srun = ["srun", "-n", f"{sum(len(s) for s in active_resources.values())}"] + shlex.split(args.launcher_args)
        if getattr(args, "slurm_comment", ""):
            srun += ["--comment", args.slurm_comment]
        if args.include or args.exclude:  # name the hosts that survived the filter, and all of them
            srun += ["--nodelist", ",".join(active_resources.keys()), "--nodes", f"{len(active_resources)}"]
        if _count(args, "num_nodes"):
            srun += ["--nodes", f"{args.num_nodes}"]
        if _count(args, "num_gpus"):
            srun += ["--gpus-per-node", f"{args.num_gpus}"]  # --num_gpus is per node
        exports = "--export=ALL" + "".join(f",{key}={value}" for key, value in self.exports.items())
        return srun + [exports] + self.python_exec() + [self.user_script] + self.user_arguments


class MVAPICHRunner(_HostfileRunner):
    """MVAPICH2-GDR's mpirun with its tuning variables; init_distributed reads MV2_COMM_WORLD_*."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int],
                 cuda: bool | None = None) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        if cuda is None:

            cuda = cuda_device_count() > 0
        self.add_export("MV2_SMP_USE_CMA", "0")  # the CMA kernel module is missing on Ubuntu
        self.add_export("MV2_DEBUG_SHOW_BACKTRACE", "1")
        if cuda:
            self.add_export("MV2_USE_CUDA", "1")
        self.add_export("MV2_SUPPORT_DL", "1")
        self.add_export("MV2_ENABLE_AFFINITY", "0")  # needed for MPI_THREAD_MULTIPLE
        self.add_export("MV2_INTER_ALLGATHER_TUNING", "5")
        self.add_export("MV2_CUDA_USE_NAIVE", "0")

    def backend_exists(self) -> bool:
        if not shutil.which("mpiname"):
            warnings.warn("mpiname does not exist, mvapich is not installed properly")
            return False
        name = subprocess.check_output(["mpiname"]).decode().strip()
        if "MVAPICH2-GDR" not in name:
            warnings.warn(f"Expected MVAPICH2-GDR as return for mpiname but received {name}")
            return False
        return True

    @property
    def name(self) -> str:
        return "mvapich"

    def hostfile_text(self) -> str:
        return "".join(f"{host}\n" for host in self.resource_pool)

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Sequence[int]]) -> list[str]:
        total, per_node = _same_slots(self.name, self.resource_pool)
        with open(MVAPICH_TMP_HOSTFILE, "w") as fd:
            fd.write(self.hostfile_text())
        mpirun = ["mpirun", "-np", f"{total}", "-ppn", f"{per_node}", "--hostfile", MVAPICH_TMP_HOSTFILE]
        mpirun += shlex.split(self.args.launcher_args)
        exports = [item for key, value in self.exports.items() for item in ("-env", f"{key}={value}")]
        return mpirun + exports + self.python_exec() + [self.user_script] + self.user_arguments
