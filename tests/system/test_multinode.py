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
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

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
) -> subprocess.Popen[str]:
    """A node: ``watchdogd run`` here, or inside ``net``'s namespace at its own address."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    endpoint, address, prefix = etcd.endpoint, "127.0.0.1", []
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
        away = node(etcd, run, tmp_path, "2:3", 2, "--max-restarts", "1", net=net)
        wait_until(lambda: len(reports(tmp_path)) == 3, timeout=30)
        assert {r["WORLD_SIZE"] for r in reports(tmp_path)} == {"3"}
        subprocess.run(["ip", "link", "set", net.host_if, "down"], check=True)  # the partition
        cut = time.monotonic()
        assert finish(*here) == [0, 0]
        took = time.monotonic() - cut
        print(f"\npartition (lease TTL 2 s): cut to the other two done at 2 nodes {took:.2f}s")
        at_two = [r for r in reports(tmp_path) if r["WORLD_SIZE"] == "2"]
        assert sorted(int(r["RANK"]) for r in at_two) == [0, 1]
        assert away.poll() is None  # cut off, it cannot know yet; the fixture ends it
