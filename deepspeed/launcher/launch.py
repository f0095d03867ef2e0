"""Per-node spawner: start the ranks of a `LaunchPlan`, watch them, and stop them all together.

Run directly as `python -m deepspeed.launcher.launch --world_info=B64 --node_rank=N ... script
args` (upstream's per-node entry point), or through `deepspeed` (runner.py), which calls
`run_plan` in-process so that there is no extra Python hop between the shell and the ranks.

[Note: launcher guarantees]
1. Each rank is the leader of its own process group (start_new_session=True), so signalling
   the group reaches its grandchildren (dataloader workers, compile workers) too.
2. The first rank to fail (non-zero exit, or death by signal) stops the job: the other ranks get
   up to DS_LAUNCHER_DRAIN_SECONDS (default 1 s) to end by themselves -- ranks that diagnosed the
   same failure (a collective divergence, deepspeed/comm/guard.py) print their reports and exit
   -- then every group gets SIGTERM, then SIGKILL after the grace period. The launcher exits with that rank's code
   (128+N for signal N) and prints which rank failed plus the tail of its stderr.
3. SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to every group, with the same
   SIGKILL escalation (a second signal escalates at once); the exit code is 128+signal.
4. Each rank's stderr is pumped through a thread that forwards the bytes unchanged and keeps
   the last TAIL_LINES lines for the failure report; stdout is inherited unless a rank log
   or an output prefix needs it piped too.
5. In a multi-node job the launchers meet before any rank starts and stop together, with
   one exit code, when a rank anywhere fails or a launcher is signalled (node_link.py,
   [Note: node link]).
Why not torch.distributed.run's elastic agent: see docs/launcher.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Callable, Iterator, Mapping

from .node_link import NodeLink, Stop
from .plan import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    LaunchError,
    LaunchPlan,
    LinkSpec,
    NodeJob,
    RankLaunch,
    ScriptSpec,
    decode_world_info,
    env_int,
    job_token,
    node_job,
    parse_core_list,
)

TAIL_LINES = 20
DEFAULT_GRACE_S = 5.0
GRACE_ENV = "DS_LAUNCHER_GRACE_SECONDS"  # seconds between SIGTERM and SIGKILL
DEFAULT_DRAIN_S = 1.0
DRAIN_ENV = "DS_LAUNCHER_DRAIN_SECONDS"  # seconds the other ranks may end by themselves after a failure
POLL_S = 0.05
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PREFIX = "[deepspeed launcher]"


def exit_code(returncode: int) -> int:
    """Popen's returncode -> the shell's exit status (-N for signal N becomes 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
    hint = " (possibly the out-of-memory killer)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint} (exit code {exit_code(returncode)})"


class _Sink:
    """A byte-level writer for one of the launcher's own streams; writes never raise."""

    def __init__(self, stream: IO, lock: threading.Lock) -> None:
        self._stream, self.lock = stream, lock

    def write(self, data: bytes) -> None:
        try:
            buffer = getattr(self._stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:  # e.g. a text-only replacement stream under a test harness
                self._stream.write(data.decode(errors="replace"))
            self._stream.flush()
        except (OSError, ValueError):  # closed or broken launcher stream: keep draining the rank
            pass


class _Pump(threading.Thread):
    """Copy one rank pipe to a sink (and log file) as bytes arrive; remember the last lines.

    Chunks are forwarded as soon as os.read returns them, so progress bars that redraw with
    '\\r' and never end a line still show live (a readline loop would hold them back).
    """

    def __init__(self, pipe: IO[bytes], sink: _Sink, log: IO[bytes] | None, prefix: bytes | None) -> None:
        super().__init__(daemon=True)
        self._pipe, self._sink, self._log, self._prefix = pipe, sink, log, prefix
        self.tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        self._partial = b""

    def run(self) -> None:
        fd = self._pipe.fileno()
        while chunk := os.read(fd, 65536):
            self._emit(chunk)
        if self._partial:
            self._emit(b"\n", final=True)
        self._pipe.close()

    def _emit(self, chunk: bytes, final: bool = False) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-65536:]  # incomplete last line (bounded)
        self.tail.extend(lines)
        if self._prefix is not None:  # prefixing needs whole lines
            chunk = b"".join(self._prefix + line + b"\n" for line in lines)
        elif final:
            chunk = b""
        with self._sink.lock:
            self._sink.write(chunk)
            if self._log is not None:
                with contextlib.suppress(OSError, ValueError):  # a full disk must not stall the rank
                    self._log.write(chunk)
                    self._log.flush()

    def tail_text(self) -> str:
        """The tail as a terminal would show it: text after the last '\\r' of each line."""
        lines = list(self.tail) + ([self._partial] if self._partial else [])
        return "\n".join(line.rsplit(b"\r", 1)[-1].decode(errors="replace") for line in lines[-TAIL_LINES:])


class _Rank:
    """One started rank: its spec, its Popen handle and the pumps draining its pipes."""

    def __init__(self, spec: RankLaunch, proc: subprocess.Popen, pumps: list[_Pump], log: IO[bytes] | None) -> None:
        self.spec, self.proc, self.pumps, self.log = spec, proc, pumps, log
        self.stderr_pump = pumps[-1]

    def label(self, plan: LaunchPlan) -> str:
        spec = self.spec
        if plan.num_nodes == 1:
            return f"rank {spec.global_rank} (local_rank {spec.local_rank}, pid {self.proc.pid})"
        return (f"rank {spec.global_rank} on {plan.host} (node rank {plan.node_rank}, local_rank {spec.local_rank}, "
                f"pid {self.proc.pid})")


class _Job:
    """Executes a LaunchPlan with the guarantees of [Note: launcher guarantees]."""

    def __init__(self, plan: LaunchPlan, grace_s: float, prefix_output: bool, link: NodeLink | None = None,
                 replan: Callable[[list[int]], LaunchPlan] | None = None) -> None:
        self.plan, self.grace_s, self.prefix_output = plan, grace_s, prefix_output
        self.link, self.replan = link, replan
        lock = threading.Lock()  # one lock: lines from different ranks never split each other
        self.err, self.out = _Sink(sys.stderr, lock), _Sink(sys.stdout, lock)
        self.ranks: list[_Rank] = []
        self.signum: int | None = None
        self.escalate = False
        self._link_failed_code = 1
        self.drain_s = _seconds(DRAIN_ENV, DEFAULT_DRAIN_S)

    def run(self) -> int:
        previous = self._install_handlers()
        try:
            if self.link is not None and not self._rendezvous():
                return self._link_failed_code
            try:
                self._start_all()
            except OSError as exc:
                reason = f"could not start {exc.filename or 'rank'} on {self.plan.host}: {exc.strerror or exc}"
                self.say(reason)
                self._stop_all(signal.SIGTERM)
                return self._verdict(Stop(127 if isinstance(exc, FileNotFoundError) else 126, reason,
                                          self.plan.node_rank))
            return self._monitor()
        finally:
            self._stop_all(signal.SIGTERM)  # no-op when every group is already gone
            for rank in self.ranks:
                for pump in rank.pumps:
                    pump.join(timeout=1.0)
                if rank.log is not None:
                    rank.log.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.link is not None:
                self.link.close()

    def _rendezvous(self) -> bool:
        """Meet the other nodes' launchers; False (with _link_failed_code set) when the job cannot start."""
        assert self.link is not None
        try:
            nodes = self.link.rendezvous(cancelled=lambda: self.signum is not None)
        except LaunchError as exc:
            self.say(f"error: {exc}")
            self._link_failed_code = 1
            return False
        if nodes is None:
            self.say(f"received {signal.Signals(self.signum or signal.SIGTERM).name} before the job started")
            self._link_failed_code = 128 + (self.signum or signal.SIGTERM)
            return False
        if nodes != list(range(len(self.link.spec.hosts))):
            assert self.replan is not None
            self.plan = self.replan(nodes)
            self.say(f"elastic start with {len(nodes)} of {len(self.link.spec.hosts)} node(s): node ranks {nodes}; "
                     f"this node is node rank {self.plan.node_rank}, world size {self.plan.world_size}")
        return True

    def spec_node_rank(self) -> int:
        return self.link.spec.node_rank if self.link is not None else self.plan.node_rank

    def say(self, message: str) -> None:
        with self.err.lock:
            self.err.write(f"{PREFIX} {message}\n".encode())

    def _install_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}  # signal.signal only works in the main thread; callers there own signals
        return {s: signal.signal(s, self._on_signal) for s in FORWARDED_SIGNALS}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        else:
            self.escalate = True  # second Ctrl-C: do not wait out the grace period

    def _start_all(self) -> None:
        for spec in self.plan.ranks:
            if self.signum is not None:
                return
            self.ranks.append(self._start(spec))

    def _start(self, spec: RankLaunch) -> _Rank:
        log = None
        if spec.log_path:
            os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
            log = open(spec.log_path, "wb")
        pipe_stdout = log is not None or self.prefix_output
        proc = subprocess.Popen(
            list(spec.argv),
            env={**os.environ, **spec.env},
            stdout=subprocess.PIPE if pipe_stdout else None,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if spec.cpu_cores:
            # Set right after exec, before the interpreter starts threads; children inherit it.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, spec.cpu_cores)
        prefix = f"[rank{spec.global_rank}]: ".encode() if self.prefix_output else None
        pumps = [_Pump(proc.stdout, self.out, log, prefix)] if pipe_stdout else []
        pumps.append(_Pump(proc.stderr, self.err, log, prefix))
        for pump in pumps:
            pump.start()
        return _Rank(spec, proc, pumps, log)

    def _monitor(self) -> int:
        while True:
            if self.signum is not None:
                name = signal.Signals(self.signum).name
                self.say(f"received {name}; forwarding it to {len(self.ranks)} rank(s)")
                where = f" of {self.link.spec.label(self.spec_node_rank())}" if self.link else ""
                stop = Stop(128 + self.signum, f"the launcher{where} received {name}", self.plan.node_rank)
                if self.link is not None:
                    self.link.notify(stop)
                self._stop_all(self.signum)
                return self._verdict(stop, notified=True)
            stop = self.link.poll() if self.link is not None else None
            if stop is not None:
                return self._stopped_by_link(stop)
            returncodes = [rank.proc.poll() for rank in self.ranks]
            failed = [rank for rank, rc in zip(self.ranks, returncodes) if rc not in (None, 0)]
            if failed:
                return self._stop_on_failure(failed[0])
            if all(rc == 0 for rc in returncodes):
                return self._succeeded()
            time.sleep(POLL_S)

    def _verdict(self, stop: Stop, notified: bool = False) -> int:
        """Report this node's end to the other launchers; the job's exit code comes back."""
        if self.link is None:
            return stop.code
        if not notified:
            self.link.notify(stop)
        verdict = self.link.verdict(stop)
        if verdict.node_rank != stop.node_rank or verdict.reason != stop.reason:
            self.say(f"job stopped: {verdict.reason}")
        return verdict.code

    def _succeeded(self) -> int:
        if self.link is None:
            return 0
        self.link.report(Stop(0, "done", self.plan.node_rank))
        while self.link.is_coordinator and not self.link.all_done():  # node 0 answers until every node is done
            stop = self.link.poll()
            if stop is not None:
                self.say(f"job stopped: {stop.reason}")
                return stop.code
            if self.signum is not None:
                return self._verdict(Stop(128 + self.signum, "node rank 0's launcher was signalled", 0))
            time.sleep(POLL_S)
        return 0

    def _stopped_by_link(self, stop: Stop) -> int:
        live = sum(1 for r in self.ranks if r.proc.poll() is None)
        self.say(f"stopping {live} local rank(s): {stop.reason}")
        if stop.detail.strip() and self.plan.node_rank == 0 and stop.node_rank != 0:
            self.say(f"last {TAIL_LINES} stderr lines of that rank:\n{stop.detail}")
        self._stop_all(signal.SIGTERM)
        return stop.code

    def _stop_on_failure(self, rank: _Rank) -> int:
        when = time.time()
        others = sum(1 for r in self.ranks if r is not rank and r.proc.poll() is None)
        label = rank.label(self.plan)
        reason = f"{label.split(' (')[0]} {describe_exit(rank.proc.returncode)}"
        self.say(f"{label} {describe_exit(rank.proc.returncode)}; stopping the other {others} local rank(s)")
        for pump in rank.pumps:  # the rank is gone: its pipes end now
            pump.join(timeout=1.0)
        tail = rank.stderr_pump.tail_text()
        stop = Stop(exit_code(rank.proc.returncode), reason, self.plan.node_rank, tail, when)
        if self.link is not None:
            self.link.notify(stop)  # the other nodes start stopping while this one does
        self._drain()
        self._stop_all(signal.SIGTERM)
        if tail.strip():
            self.say(f"last {TAIL_LINES} lines of rank {rank.spec.global_rank} stderr:\n{tail}")
        self.say(f"job failed: {reason}")
        return self._verdict(stop, notified=True)

    def _drain(self) -> None:
        """Give the other ranks `drain_s` to end by themselves: a rank that found the same failure
        finishes writing its own report (its stderr is pumped meanwhile) instead of being stopped."""
        deadline = time.monotonic() + self.drain_s
        while self.signum is None and time.monotonic() < deadline and any(r.proc.poll() is None for r in self.ranks):
            time.sleep(POLL_S)

    def _stop_all(self, signum: int) -> None:
        """Signal every live process group, then SIGKILL whatever outlives the grace period."""
        if not self._live_groups():
            return
        for pgid in self._live_groups():
            _killpg(pgid, signum)
        if not self._wait_groups(self.grace_s):
            for pgid in self._live_groups():
                _killpg(pgid, signal.SIGKILL)
            self._wait_groups(2.0)

    def _live_groups(self) -> list[int]:
        for rank in self.ranks:
            rank.proc.poll()  # reap our direct child so its zombie does not keep the group alive
        return [rank.proc.pid for rank in self.ranks if _group_alive(rank.proc.pid)]

    def _wait_groups(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._live_groups():
            if self.escalate or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in group `pgid`.

    Orphaned grandchildren are reaped by PID 1, which in some containers takes a second or
    more; their zombies keep killpg(pgid, 0) succeeding, so /proc is consulted to ignore them.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:  # no procfs: trust killpg
        return True
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as fd:
                fields = fd.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else default
    except ValueError:
        raise LaunchError(f"{name}={raw!r}: expected a number of seconds") from None


def grace_seconds() -> float:
    """The SIGTERM->SIGKILL grace period; DS_LAUNCHER_GRACE_SECONDS overrides the default."""
    return _seconds(GRACE_ENV, DEFAULT_GRACE_S)


def run_plan(plan: LaunchPlan, *, grace_s: float | None = None, prefix_output: bool = False,
             link: LinkSpec | None = None, replan: Callable[[list[int]], LaunchPlan] | None = None) -> int:
    """Start every rank of `plan`, supervise them, and return the launcher's exit code.

    With `link` (multi-node jobs) the launchers of all nodes rendezvous first and stop together;
    `replan(node_ranks)` rebuilds this node's plan when an elastic start leaves nodes out.
    """
    grace = grace_seconds() if grace_s is None else grace_s
    return _Job(plan, grace, prefix_output, NodeLink(link) if link else None, replan).run()


@contextlib.contextmanager
def pid_file(save_pid: int | None) -> Iterator[None]:
    """--save_pid: write our pid to /tmp/<save_pid>.deepspeed for the job's lifetime (upstream)."""
    if not save_pid:
        yield
        return
    path = f"/tmp/{save_pid}.deepspeed"
    with open(path, "w") as fd:
        fd.write(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


# --------------------------------------------------------------------------- CLI (upstream flags)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Upstream's per-node flags. --node_rank/--master_addr/--master_port fall back to NODE_RANK
    (or SLURM_NODEID), MASTER_ADDR and MASTER_PORT when a scheduler sets them, then to 0,
    127.0.0.1 and 29500."""
    parser = argparse.ArgumentParser(description="Start this node's ranks of a DeepSpeed job.")
    add = parser.add_argument
    add("--node_rank", type=int, default=None, help="index of this node in --world_info (env NODE_RANK; 0)")
    add("--master_addr", default=None, type=str, help="rank 0's host (env MASTER_ADDR; 127.0.0.1)")
    add("--master_port", default=None, type=int, help="rank 0's port (env MASTER_PORT; 29500)")
    add("--world_info", default="None", type=str, help="base64 JSON {host: [device ids]}")
    add("--module", action="store_true", help="run the script as `python -m`")
    add("--no_python", action="store_true", help="execute the script directly")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank")
    add("--save_pid", type=int, default=0, help="write our pid to /tmp/<SAVE_PID>.deepspeed")
    add("--enable_each_rank_log", default="None", type=str, help="also write DIR/rank<R>.log")
    add("--bind_cores_to_rank", action="store_true", help="give each rank its own cores")
    add("--bind_core_list", type=str, default=None, help="cores to split, e.g. 0,2-5")
    add("--enable_elastic_training", action="store_true", help="elastic start (see --min_elastic_nodes)")
    add("--min_elastic_nodes", type=int, default=-1, help="start with this many nodes if the others never join")
    add("--max_elastic_nodes", type=int, default=-1, help="start as soon as this many nodes joined")
    add("--prefix_output", action="store_true", help="prefix rank output lines with [rankN]:")
    add("--log_level", type=str, default="info", help="accepted for compatibility")
    add("-q", "--quiet", action="store_true", help="accepted for compatibility")
    add("training_script", type=str)
    add("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def job_from_launch_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> NodeJob:
    """This node's job from launch.py's flags (pure apart from reading our affinity)."""
    if args.world_info == "None":
        raise LaunchError("--world_info is required: base64 JSON {host: [device ids]}, as written by `deepspeed`")
    world = decode_world_info(args.world_info)
    spec = ScriptSpec(
        args.training_script, tuple(args.training_script_args), args.module, args.no_python, args.no_local_rank
    )
    cores = None
    if args.bind_cores_to_rank:
        cores = parse_core_list(args.bind_core_list) if args.bind_core_list else sorted(os.sched_getaffinity(0))
    log_dir = None if args.enable_each_rank_log in ("None", "") else args.enable_each_rank_log
    node_rank = args.node_rank
    if node_rank is None:
        node_rank = env_int(env, ["NODE_RANK", "SLURM_NODEID"], "this node's rank") or 0
    master_addr = args.master_addr or env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    master_port = args.master_port or env_int(env, ["MASTER_PORT"], "rank 0's port") or DEFAULT_MASTER_PORT
    elastic = (args.min_elastic_nodes, args.max_elastic_nodes)
    return node_job(spec, world, node_rank, (master_addr, master_port), env=env,
                    token=job_token(args.world_info, args.training_script), elastic=elastic,
                    cores=tuple(cores) if cores is not None else None, log_dir=log_dir)


def plan_from_launch_args(args: argparse.Namespace) -> LaunchPlan:
    """compat: this node's plan (without the link to the other nodes)."""
    return job_from_launch_args(args).plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = job_from_launch_args(args)
    except LaunchError as exc:
        print(f"{PREFIX} error: {exc}", file=sys.stderr)
        return 2
    with pid_file(args.save_pid):
        return run_plan(job.plan, prefix_output=args.prefix_output, link=job.link, replan=job.plan_for)


if __name__ == "__main__":
    sys.exit(main())
