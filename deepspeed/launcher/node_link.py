"""The link between the per-node launchers of one multi-node job.

[Note: node link]
torch.distributed's own rendezvous (rank 0's TCPStore on MASTER_ADDR:MASTER_PORT) only starts
once every rank runs, waits 30 minutes for a missing one and names nothing; and nothing tells
node 1 that a rank on node 0 died, so its ranks sit in a collective until the backend timeout.
So the launchers talk to each other first, over a small TCP link of their own:

* Node 0's launcher listens on MASTER_ADDR:(MASTER_PORT + 1) (DS_LAUNCHER_CONTROL_PORT
  overrides the port); every other node's launcher connects and says hello with its node rank.
  Ranks start only once every node has joined. After DS_LAUNCHER_RENDEZVOUS_TIMEOUT seconds
  (default 600) node 0 names the node ranks that never joined, and a node that cannot reach
  node 0 says so; both exit 1. With --min_elastic_nodes the job starts instead with the nodes
  that did join, if there are enough of them, renumbered in node-rank order.
* When a rank fails, or a launcher is signalled, that launcher stops its own ranks and
  reports to node 0, which waits SETTLE_S for other reports (a failure elsewhere is often a
  consequence: gloo ranks fail as soon as a peer dies), picks the earliest and tells every
  node to stop with that exit code. Every launcher exits with it, so `pdsh -S` and a
  scheduler see the failing rank's code whichever node they ask.
* A launcher that disappears without a word (SIGKILL, a crashed host: TCP keepalive finds
  it within ~30 s) counts as a failure with exit code 1.
Messages are JSON lines. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .plan import CONTROL_PORT_ENV, RDZV_TIMEOUT_ENV, LinkSpec
from .resources import LaunchError

SETTLE_S = 0.5  # how long node 0 collects failure reports before it picks the first one
LOST_CODE = 1  # exit code when a launcher vanished or the rendezvous failed


@dataclass(frozen=True)
class Stop:
    """The job's verdict: every launcher stops its ranks and exits with `code`."""

    code: int
    reason: str
    node_rank: int = -1  # where it happened (-1: unknown)
    detail: str = ""  # the failing rank's last stderr lines
    when: float = 0.0


def choose_start_set(joined: set[int], spec: LinkSpec, timed_out: bool) -> list[int] | None:
    """Pure: which node ranks start, or None to keep waiting; raises at the timeout if too few joined."""
    expected = len(spec.hosts)
    wanted = min(spec.max_nodes or expected, expected)
    if len(joined) >= wanted:
        return sorted(joined)[:wanted]
    if not timed_out:
        return None
    if spec.min_nodes is not None and len(joined) >= spec.min_nodes:
        return sorted(joined)
    missing = [r for r in range(expected) if r not in joined]
    need = f"; --min_elastic_nodes {spec.min_nodes} needs {spec.min_nodes}" if spec.min_nodes else ""
    raise LaunchError(
        f"rendezvous timeout after {spec.timeout_s:g} s: {', '.join(spec.label(r) for r in missing)} never joined "
        f"({len(joined)} of {expected} node(s) did{need}). Check that a launcher was started on each with the "
        f"same hostfile and --node_rank, and that it can reach {spec.addr}:{spec.port} ({CONTROL_PORT_ENV}); "
        f"{RDZV_TIMEOUT_ENV} sets the timeout")


def _send(sock: socket.socket, message: dict[str, Any]) -> bool:
    try:
        sock.sendall((json.dumps(message) + "\n").encode())
        return True
    except OSError:
        return False


def _keepalive(sock: socket.socket) -> None:
    """Notice a vanished host within ~30 s instead of the kernel's default two hours."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)


class _Reader:
    """JSON-line messages from one socket; `next` returns None on a timeout, raises EOFError at the end."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._buffer = sock, b""

    def next(self, timeout: float | None = None) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            self._sock.settimeout(timeout)
            try:
                chunk = self._sock.recv(65536)
            except socket.timeout:
                return None
            except OSError:
                chunk = b""
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {}

    def __iter__(self):
        while True:
            try:
                yield self.next()
            except EOFError:
                return


class NodeLink:
    """One launcher's end of the link; node 0 also runs the coordinator. See [Note: node link]."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._lock = threading.Condition()
        self._stop: Stop | None = None
        self._done: set[int] = set()  # node ranks whose ranks all succeeded
        self._started: list[int] | None = None
        self._closed = False
        self._sock: socket.socket | None = None
        self._members: dict[int, socket.socket] = {}  # node 0 only
        self._reports: list[Stop] = []  # node 0 only: failures waiting for the settle window
        self._abort: str | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.spec.node_rank == 0

    # ------------------------------------------------------------------ rendezvous
    def rendezvous(self, cancelled: Callable[[], bool] = lambda: False) -> list[int] | None:
        """Block until the job starts; return the node ranks taking part (original numbering),
        or None when `cancelled()` turned true first (the launcher was signalled)."""
        return self._coordinate(cancelled) if self.is_coordinator else self._join(cancelled)

    def _coordinate(self, cancelled: Callable[[], bool]) -> list[int] | None:
        spec = self.spec
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_addr = spec.addr if spec.addr in ("127.0.0.1", "localhost") else ""
        try:
            server.bind((bind_addr, spec.port))
        except OSError as exc:
            server.close()
            raise LaunchError(f"node 0 cannot listen on port {spec.port} for the other launchers ({exc.strerror}); "
                              f"set {CONTROL_PORT_ENV} to a free port on every node") from None
        server.listen(64)
        self._sock = server
        threading.Thread(target=self._accept_loop, args=(server,), daemon=True).start()
        deadline = time.monotonic() + spec.timeout_s
        with self._lock:
            while True:
                joined = set(self._members) | {0}
                try:
                    chosen = choose_start_set(joined, spec, time.monotonic() >= deadline)
                except LaunchError as exc:
                    self._broadcast({"type": "abort", "reason": str(exc)})
                    raise
                if chosen is not None:
                    break
                if cancelled():
                    self._broadcast({"type": "abort", "reason": "node rank 0's launcher was stopped"})
                    return None
                self._lock.wait(timeout=min(0.2, max(deadline - time.monotonic(), 0.01)))
            self._started = chosen
            for rank, sock in list(self._members.items()):
                if rank in chosen:
                    _send(sock, {"type": "start", "nodes": chosen})
                else:
                    _send(sock, {"type": "abort", "reason": "the job started without this node (elastic start)"})
                    self._members.pop(rank)
        return chosen

    def _accept_loop(self, server: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            _keepalive(conn)
            threading.Thread(target=self._serve_member, args=(conn,), daemon=True).start()

    def _serve_member(self, conn: socket.socket) -> None:
        node_rank = None
        for message in _Reader(conn):
            kind = message.get("type")
            if kind == "hello":
                node_rank = self._admit(conn, message)
                if node_rank is None:
                    conn.close()
                    return
            elif kind == "exit" and node_rank is not None:
                self._on_exit(node_rank, message)
        if node_rank is not None:
            self._on_lost(node_rank)

    def _admit(self, conn: socket.socket, hello: dict[str, Any]) -> int | None:
        spec, rank = self.spec, hello.get("node_rank")
        with self._lock:
            reason = None
            if hello.get("token") != spec.token:
                reason = ("this launcher was started for a different job (other hostfile, flags or script) than "
                          f"node 0 at {spec.addr}:{spec.port}")
            elif not isinstance(rank, int) or not 0 < rank < len(spec.hosts):
                reason = f"--node_rank {rank!r} is not in [1, {len(spec.hosts)}) for {len(spec.hosts)} node(s)"
            elif rank in self._members:
                reason = f"node rank {rank} already joined; every launcher needs its own --node_rank"
            elif self._started is not None:
                reason = "the job already started without this node"
            if reason:
                _send(conn, {"type": "abort", "reason": reason})
                return None
            self._members[rank] = conn
            self._lock.notify_all()
        return rank

    def _join(self, cancelled: Callable[[], bool]) -> list[int] | None:
        spec = self.spec
        deadline = time.monotonic() + spec.timeout_s
        error = "no answer"
        while True:
            try:
                sock = socket.create_connection((spec.addr, spec.port), timeout=2.0)
                break
            except OSError as exc:
                error = exc.strerror or str(exc)
            if cancelled():
                return None
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"rendezvous timeout after {spec.timeout_s:g} s: {spec.label(spec.node_rank)} could not reach "
                    f"node rank 0's launcher at {spec.addr}:{spec.port} ({error}). Start the launcher of node rank 0 "
                    f"({spec.hosts[0]}), check --master_addr and the firewall ({CONTROL_PORT_ENV} sets the port)")
            time.sleep(0.2)
        _keepalive(sock)
        self._sock = sock
        _send(sock, {"type": "hello", "node_rank": spec.node_rank, "token": spec.token,
                     "host": socket.gethostname()})
        reader = _Reader(sock)
        try:
            while True:
                message = reader.next(timeout=0.2)
                if message is None:
                    if cancelled():
                        return None
                    continue
                if message.get("type") == "start":
                    self._started = list(message["nodes"])
                    threading.Thread(target=self._member_loop, args=(reader,), daemon=True).start()
                    return self._started
                if message.get("type") == "abort":
                    raise LaunchError(f"node rank 0 ({spec.hosts[0]}) turned this launcher away: "
                                      f"{message['reason']}")
        except EOFError:
            raise LaunchError(f"lost the connection to node rank 0's launcher at {spec.addr}:{spec.port} "
                              "before the job started (see its output)") from None

    def _member_loop(self, reader: _Reader) -> None:
        for message in reader:
            if message.get("type") == "stop":
                self._set_stop(Stop(message["code"], message["reason"], message.get("node_rank", -1),
                                    message.get("detail", "")))
        if not self._closed:
            self._set_stop(Stop(LOST_CODE, f"lost the connection to node rank 0's launcher ({self.spec.hosts[0]})",
                                0))

    # ------------------------------------------------------------------ during the run
    def poll(self) -> Stop | None:
        """The job's stop verdict, once there is one (non-blocking)."""
        with self._lock:
            return self._stop

    def all_done(self) -> bool:
        """Node 0: every started node reported success."""
        with self._lock:
            return self._started is not None and set(self._started) <= self._done

    def report(self, stop: Stop) -> Stop | None:
        """This node's ranks ended (code 0: all succeeded). Returns the job's verdict for a failure."""
        self.notify(stop)
        return None if stop.code == 0 else self.verdict(stop)

    def notify(self, stop: Stop) -> None:
        """Tell node 0 (without waiting) how this node's ranks ended."""
        message = {"type": "exit", "code": stop.code, "reason": stop.reason, "detail": stop.detail,
                   "when": stop.when or time.time()}
        if self.is_coordinator:
            self._on_exit(0, message)
        elif self._sock is not None:
            _send(self._sock, message)

    def verdict(self, stop: Stop) -> Stop:
        """Wait (briefly) for node 0's choice among the failures reported; ours if none comes."""
        deadline = time.monotonic() + SETTLE_S + 2.0
        with self._lock:
            while self._stop is None and time.monotonic() < deadline:
                self._lock.wait(timeout=0.05)
            return self._stop or stop

    def _on_exit(self, node_rank: int, message: dict[str, Any]) -> None:
        with self._lock:
            if message.get("code", 1) == 0:
                self._done.add(node_rank)
                self._lock.notify_all()
                return
            self._reports.append(Stop(int(message["code"]), str(message.get("reason", "")), node_rank,
                                      str(message.get("detail", "")), float(message.get("when", time.time()))))
            first = len(self._reports) == 1
        if first:
            threading.Thread(target=self._settle, daemon=True).start()

    def _on_lost(self, node_rank: int) -> None:
        with self._lock:
            if self._started is None or node_rank not in self._started:
                self._members.pop(node_rank, None)  # left before the start: no longer counts as joined
                return
            if node_rank in self._done or self._closed or self._stop is not None:
                return
        self._on_exit(node_rank, {"code": LOST_CODE, "reason": f"lost the connection to the launcher of "
                                  f"{self.spec.label(node_rank)} (killed, or its host is down)"})

    def _settle(self) -> None:
        time.sleep(SETTLE_S)
        with self._lock:
            verdict = min(self._reports, key=lambda s: s.when)
            self._broadcast({"type": "stop", "code": verdict.code, "reason": verdict.reason,
                             "node_rank": verdict.node_rank, "detail": verdict.detail})
        self._set_stop(verdict)

    def _broadcast(self, message: dict[str, Any]) -> None:
        for sock in list(self._members.values()):
            _send(sock, message)

    def _set_stop(self, stop: Stop) -> None:
        with self._lock:
            if self._stop is None:
                self._stop = stop
            self._lock.notify_all()

    def close(self) -> None:
        self._closed = True
        for sock in [self._sock, *self._members.values()]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
