"""Many nodes with ``watchdogd run --rdzv-backend etcd``: real processes, a real etcd.

Each "node" is a ``watchdogd run`` process on this machine; they meet on
the test's etcd under a run id of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from ..conftest import children, kill_nodes, wait_until
from ..etcd import EtcdServer, running_etcd

WORKER = """
import json, os, sys, time
out = sys.argv[1]
want = int(sys.argv[2])  # the world size to finish at
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK",
                                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
name = f"{os.getpid()}.json"
with open(os.path.join(out, name), "w") as f:
    json.dump(env, f)
if int(env["WORLD_SIZE"]) != want:
    time.sleep(600)  # wait for the job to re-form
"""


_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _kill_nodes() -> Iterator[None]:
    yield
    kill_nodes(_started)


def node(
    etcd: EtcdServer,
    run: str,
    tmp_path: Path,
    nnodes: str,
    want: int,
    *extra: str,
    net: Subnet | None = None,
    endpoint: str | None = None,
    code: str = WORKER,
) -> subprocess.Popen[str]:
    """A node: ``watchdogd run`` here, or inside ``net``'s namespace at its own address;
    ``endpoint``: etcd's, when reached another way. ``want`` 0: the workers never end.
    ``code``: the workers' script (``WORKER``: each reports its variables)."""
    worker = tmp_path / "worker.py"
    worker.write_text(code)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    address, prefix = "127.0.0.1", []
    endpoint = endpoint or etcd.endpoint
    if net is not None:
        endpoint = f"{net.host_addr}:{etcd.client_port}"
        address, prefix = net.ns_addr, ["ip", "netns", "exec", net.ns]
    proc = subprocess.Popen(
        [
            *prefix,
            "watchdogd",
            "run",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run,
            "--nnodes",
            nnodes,
            "--local-addr",
            address,
            "--rdzv-conf",
            "last_call_timeout=0.3,lease_ttl=2.0,join_timeout=20.0",
            *extra,
            str(worker),
            str(out),
            str(want),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _started.append(proc)
    return proc


def reports(tmp_path: Path) -> list[dict[str, str]]:
    return [
        json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json") if p.stat().st_size
    ]


def finish(*nodes: subprocess.Popen[str], timeout: float = 60) -> list[int]:
    codes = []
    for proc in nodes:
        with proc:
            try:
                codes.append(proc.wait(timeout))
            finally:
                proc.kill()
    return codes


def test_two_nodes_form_one_job_with_the_right_ranks(etcd: EtcdServer, tmp_path: Path) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    a = node(etcd, run, tmp_path, "2", 4, "--nproc-per-node", "2")
    b = node(etcd, run, tmp_path, "2", 4, "--nproc-per-node", "2")
    assert finish(a, b) == [0, 0]
    seen = reports(tmp_path)
    assert sorted(int(r["RANK"]) for r in seen) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in seen} == {"4"}
    assert sorted({r["GROUP_RANK"] for r in seen}) == ["0", "1"]
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in seen}) == 1


def test_a_third_node_scales_the_job_up_without_spending_a_restart(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    # max_restarts 0: the scale-up restart must not count.
    a = node(etcd, run, tmp_path, "2:3", 3)
    b = node(etcd, run, tmp_path, "2:3", 3)
    wait_until(lambda: len(reports(tmp_path)) == 2, timeout=30)
    assert {r["WORLD_SIZE"] for r in reports(tmp_path)} == {"2"}
    arrived = time.monotonic()
    c = node(etcd, run, tmp_path, "2:3", 3)
    assert finish(a, b, c) == [0, 0, 0]
    at_three = [r for r in reports(tmp_path) if r["WORLD_SIZE"] == "3"]
    print(f"\nscale-up: arrival to a finished 3-node round {time.monotonic() - arrived:.2f}s")
    assert sorted(int(r["RANK"]) for r in at_three) == [0, 1, 2]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in at_three} == {"0"}


def test_a_lost_node_makes_the_others_re_form_smaller(etcd: EtcdServer, tmp_path: Path) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    nodes = [node(etcd, run, tmp_path, "2:3", 2, "--max-restarts", "1") for _ in range(3)]
    wait_until(lambda: len(reports(tmp_path)) == 3, timeout=30)
    victim = nodes.pop()
    workers = children(victim.pid)
    assert workers
    # The node dies: its daemon and its workers, at once, without a word to etcd.
    with victim:
        victim.kill()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    died = time.monotonic()
    assert finish(*nodes) == [0, 0]
    took = time.monotonic() - died
    print(f"\nnode loss (lease TTL 2 s): death to survivors done at 2 nodes {took:.2f}s")
    at_two = [r for r in reports(tmp_path) if r["WORLD_SIZE"] == "2"]
    assert sorted(int(r["RANK"]) for r in at_two) == [0, 1]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in at_two} == {"1"}  # a counted restart


class Subnet(NamedTuple):
    ns: str
    host_if: str
    host_addr: str
    ns_addr: str


@contextlib.contextmanager
def isolated_subnet() -> Iterator[Subnet]:
    """A network namespace of our own, joined to this one by a veth pair (a /30)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16)
    net = Subnet(f"wd-{tag}", f"wdh{tag}", f"10.231.{octet}.1", f"10.231.{octet}.2")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        ip("netns", "add", net.ns)
        ip("link", "add", net.host_if, "type", "veth", "peer", "name", f"wdn{tag}")
        ip("link", "set", f"wdn{tag}", "netns", net.ns)
        ip("addr", "add", f"{net.host_addr}/30", "dev", net.host_if)
        ip("link", "set", net.host_if, "up")
        ip("-n", net.ns, "addr", "add", f"{net.ns_addr}/30", "dev", f"wdn{tag}")
        ip("-n", net.ns, "link", "set", f"wdn{tag}", "up")
        ip("-n", net.ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        subprocess.run(["ip", "netns", "del", net.ns], capture_output=True)
        pytest.skip(f"cannot build a test network here: {e.stderr.strip()}")
    try:
        yield net
    finally:
        subprocess.run(["ip", "netns", "del", net.ns], capture_output=True)  # takes the veth pair


def test_a_node_cut_off_by_a_partition_is_lost_and_the_others_go_on(
    etcd_binary: str, tmp_path: Path
) -> None:
    with isolated_subnet() as net, running_etcd(etcd_binary, also_listen=net.host_addr) as etcd:
        run = f"job-{uuid.uuid4().hex[:8]}"
        here = [node(etcd, run, tmp_path, "2:3", 2, "--max-restarts", "1") for _ in range(2)]
        events = tmp_path / "away.jsonl"
        away = node(etcd, run, tmp_path, "2:3", 2, "--max-restarts", "1",
                    "--shutdown-timeout", "1", "--event-log", str(events), net=net)  # fmt: skip
        wait_until(lambda: len(reports(tmp_path)) == 3, timeout=30)
        assert {r["WORLD_SIZE"] for r in reports(tmp_path)} == {"3"}
        subprocess.run(["ip", "link", "set", net.host_if, "down"], check=True)  # the partition
        cut = time.monotonic()
        # It fences itself: no worker left by lease TTL + shutdown timeout + 1 s.
        wait_until(lambda: children(away.pid) == [], timeout=2 + 1 + 1)
        fenced = time.monotonic() - cut
        assert "rdzv_fenced" in events.read_text()
        assert finish(*here) == [0, 0]
        took = time.monotonic() - cut
        print(f"\npartition (lease TTL 2 s): cut to the cut-off node's workers gone {fenced:.2f}s, "
              f"to the other two done at 2 nodes {took:.2f}s")  # fmt: skip
        at_two = [r for r in reports(tmp_path) if r["WORLD_SIZE"] == "2"]
        assert sorted(int(r["RANK"]) for r in at_two) == [0, 1]
        assert away.poll() is None  # still serving timers, waiting for etcd; the fixture ends it


class FreezableProxy:
    """A TCP path to etcd that can be cut without a reset: bytes just stop moving."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.moving = threading.Event()
        self.moving.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.moving.wait()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _socket_of(events: Path) -> str:
    started = next(
        json.loads(line) for line in events.read_text().splitlines() if '"daemon_started"' in line
    )
    return str(started["metadata"]["socket"])


def test_a_node_whose_etcd_path_stalls_fences_itself_then_rejoins(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    proxy = FreezableProxy(("127.0.0.1", etcd.client_port))
    run = f"job-{uuid.uuid4().hex[:8]}"
    here = node(etcd, run, tmp_path, "1:2", 0, "--max-restarts", "5")
    events = tmp_path / "away.jsonl"
    away = node(etcd, run, tmp_path, "1:2", 0, "--max-restarts", "5", "--shutdown-timeout",
                "1", "--event-log", str(events), endpoint=f"127.0.0.1:{proxy.port}")  # fmt: skip

    def sizes() -> list[str]:
        return sorted(r["WORLD_SIZE"] for r in reports(tmp_path))

    wait_until(lambda: sizes() == ["2", "2"], timeout=30)
    workers = children(away.pid)
    # A blip shorter than the fence margin stops nothing.
    proxy.moving.clear()
    time.sleep(0.3)
    proxy.moving.set()
    time.sleep(3)
    assert children(away.pid) == workers and sizes() == ["2", "2"]
    assert "rdzv_fenced" not in events.read_text()
    # Cut for good: it fences itself; the other node re-forms alone.
    proxy.moving.clear()
    cut = time.monotonic()
    wait_until(lambda: children(away.pid) == [], timeout=2 + 1 + 1)
    print(f"\nstalled etcd path (lease TTL 2 s): workers gone {time.monotonic() - cut:.2f}s after")
    wait_until(lambda: "1" in sizes(), timeout=20)
    status = subprocess.run(["watchdogctl", "--socket", _socket_of(events), "status"],
                            capture_output=True, text=True, timeout=10)  # fmt: skip
    assert "FENCED since" in status.stdout, status.stdout + status.stderr
    groups = subprocess.run(["watchdogctl", "--socket", _socket_of(events), "groups"],
                            capture_output=True, text=True, timeout=10)  # fmt: skip
    assert "FENCED" in groups.stdout
    # The path comes back: it rejoins as a new member, and the job grows back to 2.
    proxy.moving.set()
    wait_until(lambda: sizes().count("2") >= 4, timeout=30)
    text = events.read_text()
    assert "rdzv_unfenced" in text and "rdzv_fenced" in text
    assert here.poll() is None and away.poll() is None


# Each rank releases "compute" until told to stop; node 1 is a slow host (both its ranks
# take twice as long), which node 1 alone cannot see: its ranks are alike.
SLOW_NODE = """
import os, sys, time
import watchdogd_client as wd
out = sys.argv[1]
node = os.environ["GROUP_RANK"]
path = os.path.join(out, f"node{node}.sock")
with open(path + f".{os.getpid()}", "w") as f:
    f.write(os.environ["WATCHDOGD_SOCKET"])
os.rename(path + f".{os.getpid()}", path)
hold = 0.1 if node == "1" else 0.05
while not os.path.exists(os.path.join(out, "stop")):
    with wd.expires(after=30, scope="compute"):
        time.sleep(hold)
"""


def ctl(sock: str, *args: str) -> str:
    done = subprocess.run(["watchdogctl", "--socket", sock, *args],
                          capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    return done.stdout


def poll(predicate: Callable[[], bool], timeout: float) -> None:
    """``predicate`` true within ``timeout``, asked every 0.2 s (it runs a command)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_a_slow_node_is_flagged_by_itself_and_shown_on_the_other(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    flags = ["--nproc-per-node", "2", "--straggler-window", "5",
             "--straggler-publish-interval", "0.2"]  # fmt: skip
    logs = [tmp_path / f"events{i}.jsonl" for i in range(2)]
    nodes = [node(etcd, run, tmp_path, "2", 0, *flags, "--event-log", str(log), code=SLOW_NODE)
             for log in logs]  # fmt: skip
    out = tmp_path / "out"
    wait_until(lambda: all((out / f"node{i}.sock").exists() for i in range(2)), timeout=30)
    sock0, sock1 = ((out / f"node{i}.sock").read_text() for i in range(2))

    def job() -> dict[int, dict[str, Any]]:
        listing = json.loads(ctl(sock0, "stragglers", "--job", "--json"))["stragglers"]
        return {s["rank"]: s for s in listing}

    poll(lambda: [r for r, s in job().items() if s["flagged"]] == [2, 3], timeout=30)
    ranks = job()
    assert sorted(ranks) == [0, 1, 2, 3]
    assert [ranks[r]["node_rank"] for r in range(4)] == [0, 0, 1, 1]
    assert all(ranks[r]["relative"] < 0.85 and not ranks[r]["stale"] for r in (2, 3))
    assert [ranks[r]["uid"] >= 0 for r in range(4)] == [True, True, False, False]
    table = ctl(sock0, "stragglers", "--job")
    rows = [line.split() for line in table.splitlines() if "STRAGGLER" in line.split()]
    assert [(row[2], row[3]) for row in rows] == [("2", "1"), ("3", "1")]  # RANK, NODE
    # Node 0's own listing has its ranks only; node 1 scored its ranks on the job's yardstick.
    assert sorted(
        s["rank"] for s in json.loads(ctl(sock0, "stragglers", "--json"))["stragglers"]
    ) == [0, 1]
    (out / "stop").touch()
    assert finish(*nodes) == [0, 0]
    # The straggler event is raised by the node that runs the rank, and only there.
    by_socket = {_socket_of(log): log for log in logs}

    def flagged_in(log: Path) -> list[int]:
        events = [json.loads(line) for line in log.read_text().splitlines()]
        return sorted(e["metadata"]["rank"] for e in events if e["name"] == "straggler")

    assert flagged_in(by_socket[sock0]) == []
    assert flagged_in(by_socket[sock1]) == [2, 3]
