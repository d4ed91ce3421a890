"""Many nodes with ``--rdzv-backend c10d``: torch's own rendezvous, real processes, real torch.

Each "node" is a ``watchdogd run`` (or a ``torchrun``) process on this
machine; they meet on a TCP store at a port of the test's own, under a run
id of their own. Workers prove the world is real with a gloo all_reduce.
torch's timeouts are cut to seconds (its defaults are minutes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.linux.net import free_port

from ..conftest import children, kill_nodes, wait_until

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)

WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
out, want = sys.argv[1], int(sys.argv[2])  # want: the world size to finish at
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
report = {k: os.environ[k] for k in keys} | {"sum": total.item()}
with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
    json.dump(report, f)
if dist.get_world_size() != want:
    time.sleep(600)  # wait for the job to re-form
dist.destroy_process_group()
"""

# Heartbeats every second, a node dead after 4 missed: torch's own rule.
CONF = (
    "join_timeout=40,last_call_timeout=1,read_timeout=20,"
    "keep_alive_interval=1,keep_alive_max_attempt=4"
)


_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _kill_nodes() -> Iterator[None]:
    yield
    kill_nodes(_started)


class Job:
    def __init__(self, tmp_path: Path, code: str = WORKER) -> None:
        self.endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
        self.run_id = f"job-{uuid.uuid4().hex[:8]}"
        self.worker = tmp_path / "worker.py"
        self.worker.write_text(code)
        self.out = tmp_path / "out"
        self.out.mkdir()

    def node(
        self, launcher: list[str], nnodes: str, want: int, *extra: str, conf: str = CONF
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [
                *launcher,
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}",
                f"--nnodes={nnodes}",
                "--local-addr=127.0.0.1",
                f"--rdzv-conf={conf}",
                *extra,
                str(self.worker),
                str(self.out),
                str(want),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _started.append(proc)
        return proc

    def reports(self) -> list[dict[str, str]]:
        return [json.loads(p.read_text()) for p in self.out.glob("*.json") if p.stat().st_size]


WATCHDOGD = ["watchdogd", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def finish(*nodes: subprocess.Popen[str], timeout: float = 120) -> list[int]:
    codes = []
    for proc in nodes:
        try:
            proc.wait(timeout)
        finally:
            proc.kill()
        codes.append(proc.returncode)
    return codes


def one_world(reports: list[dict[str, str]], size: int) -> None:
    assert sorted(int(r["RANK"]) for r in reports) == list(range(size))
    assert {r["WORLD_SIZE"] for r in reports} == {str(size)}
    assert {r["sum"] for r in reports} == {float(size)}  # the all_reduce saw every rank
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in reports}) == 1
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in reports} == {"True"}


def test_torchrun_and_watchdogd_nodes_share_one_world(tmp_path: Path) -> None:
    # Two of our nodes form one too: the lost-node test below starts with that.
    job = Job(tmp_path)
    theirs = job.node(TORCHRUN, "2", 4, "--nproc-per-node=2")
    ours = job.node(WATCHDOGD, "2", 4, "--nproc-per-node=2")
    codes = finish(theirs, ours)
    assert codes == [0, 0], [p.stderr.read() if p.stderr else "" for p in (theirs, ours)]
    seen = job.reports()
    one_world(seen, 4)
    assert sorted(r["GROUP_RANK"] for r in seen) == ["0", "0", "1", "1"]
    assert sorted(r["LOCAL_RANK"] for r in seen) == ["0", "0", "1", "1"]


def test_a_lost_node_leaves_the_survivor_to_re_form_alone(tmp_path: Path) -> None:
    job = Job(tmp_path)
    # The survivor hosts the rendezvous store: the victim's death must not take it.
    survivor = job.node(WATCHDOGD, "1:2", 1, "--max-restarts=1", conf=CONF + ",is_host=true")
    victim = job.node(WATCHDOGD, "1:2", 1, "--max-restarts=1", conf=CONF + ",is_host=false")
    wait_until(lambda: len(job.reports()) == 2, timeout=90)
    one_world(job.reports(), 2)
    workers = children(victim.pid)
    with victim:
        victim.kill()  # its helper goes with it (the parent-death signal)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    died = time.monotonic()
    assert finish(survivor) == [0], survivor.stderr.read() if survivor.stderr else ""
    print(f"\nnode loss (dead after 4 s of heartbeats): death to done at 1 node "
          f"{time.monotonic() - died:.1f}s")  # fmt: skip
    alone = [r for r in job.reports() if r["WORLD_SIZE"] == "1"]
    assert [(r["RANK"], r["TORCHELASTIC_RESTART_COUNT"]) for r in alone] == [("0", "1")]


def test_a_wrong_endpoint_fails_soon_naming_it(tmp_path: Path) -> None:
    job = Job(tmp_path)
    started = time.monotonic()
    # Nobody serves the endpoint, and this node must not host it. `timeout`
    # appears in real scripts: torch's c10d does not read it, nor do we.
    proc = job.node(WATCHDOGD, "2", 4, conf="timeout=900,read_timeout=2,is_host=false")
    assert finish(proc, timeout=60) == [1]
    took = time.monotonic() - started
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "--rdzv-conf timeout: not read by torch's c10d backend, ignored" in stderr
    assert f"c10d rendezvous {job.run_id} at {job.endpoint}" in stderr
    assert "connection to the C10d store has failed" in stderr
    assert took < 40  # read_timeout 2 s, not torch's 60 s, nor 900
    assert not job.reports()


def python_without(tmp_path: Path, module: str = "torch") -> Path:
    """An interpreter, as PYTHON_EXEC, that cannot import ``module`` (for what runs with ``-m``)."""
    python = tmp_path / "python-without"
    python.write_text(
        f"""#!/bin/sh
exec {sys.executable} -c '
import runpy, sys
sys.modules["{module}"] = None  # as if it were not installed
module = sys.argv.pop(2)
del sys.argv[1]
runpy.run_module(module, run_name="__main__", alter_sys=True)
' "$@"
"""
    )
    python.chmod(0o755)
    return python


def test_without_torch_the_error_names_the_ways_out(tmp_path: Path) -> None:
    python = python_without(tmp_path)
    out = subprocess.run(
        [
            *WATCHDOGD,
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port('127.0.0.1')}",
            "--no-python",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON_EXEC": str(python)},  # the workers' interpreter
    )
    assert out.returncode == 1
    assert f"{python} cannot import torch" in out.stderr
    assert "install torch there" in out.stderr and "--rdzv-backend etcd" in out.stderr


def test_a_bad_rdzv_conf_value_is_a_usage_error_naming_the_key() -> None:
    out = subprocess.run(
        [*WATCHDOGD, "--rdzv-backend=c10d", "--rdzv-conf=join_timeout=soon", "--no-python", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--rdzv-conf" in out.stderr and "join_timeout" in out.stderr


# One rank per node releases "compute" until told to stop; node 1's takes twice as long,
# which node 1 cannot see alone (its only rank is its own fastest).
SLOW_NODE = """
import os, sys, time
import watchdogd_client as wd
out = sys.argv[1]
node = os.environ["GROUP_RANK"]
path = os.path.join(out, f"node{node}.sock")
with open(path + ".tmp", "w") as f:
    f.write(os.environ["WATCHDOGD_SOCKET"])
os.rename(path + ".tmp", path)
hold = 0.1 if node == "1" else 0.05
while not os.path.exists(os.path.join(out, "stop")):
    with wd.expires(after=30, scope="compute"):
        time.sleep(hold)
"""


def test_straggler_summaries_go_through_the_store_both_ways(tmp_path: Path) -> None:
    job = Job(tmp_path, SLOW_NODE)
    flags = ["--straggler-window=5", "--straggler-publish-interval=0.2"]
    nodes = [job.node(WATCHDOGD, "2", 0, *flags) for _ in range(2)]
    wait_until(lambda: all((job.out / f"node{i}.sock").exists() for i in range(2)), timeout=90)
    sock0 = (job.out / "node0.sock").read_text()

    def ranks() -> dict[int, dict[str, object]]:
        done = subprocess.run(
            ["watchdogctl", "--socket", sock0, "stragglers", "--job", "--json"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
        return {s["rank"]: s for s in json.loads(done.stdout)["stragglers"]}

    deadline = time.monotonic() + 30
    # Flagged: node 0's summary reached node 1 (its yardstick), and node 1's came back.
    while not ranks().get(1, {}).get("flagged"):
        assert time.monotonic() < deadline, ranks()
        time.sleep(0.2)
    seen = ranks()
    assert [(seen[r]["node_rank"], seen[r]["stale"]) for r in (0, 1)] == [(0, False), (1, False)]
    assert seen[1]["uid"] == -1 and seen[1]["hostname"]
    (job.out / "stop").touch()
    assert finish(*nodes) == [0, 0], [p.stderr.read() if p.stderr else "" for p in nodes]


# Each rank joins the world, reports, and runs until ``done`` exists.
UNTIL_DONE = """
import json, os, sys, time
import torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")
report = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
    json.dump(report, f)
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("launcher", [WATCHDOGD, TORCHRUN], ids=["watchdogd", "torchrun"])
def test_a_node_beyond_max_waits_and_leaves_with_0_as_torchruns_does(
    tmp_path: Path, launcher: list[str]
) -> None:
    job = Job(tmp_path, code=UNTIL_DONE)
    members = [job.node(WATCHDOGD, "2:2", 0, conf=CONF + f",is_host={host}")
               for host in ("true", "false")]  # fmt: skip
    wait_until(lambda: len(job.reports()) == 2, timeout=90)
    surplus = job.node(launcher, "2:2", 0, conf=CONF + ",is_host=false")
    time.sleep(5)  # > 4 missed heartbeats: torch's redundancy list restarts nobody
    assert surplus.poll() is None
    assert len(job.reports()) == 2
    (job.out / "done").touch()
    codes = finish(*members, surplus)
    said = surplus.stderr.read() if surplus.stderr else ""
    assert codes[:2] == [0, 0]
    assert sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in job.reports()) == ["0", "0"]
    if launcher is WATCHDOGD:
        assert codes[2] == 0, said  # the job ended without it: a success
        assert "rdzv_graceful_exit" in said
    else:
        # torch 2.13's agent leaves with RendezvousGracefulExitError too (its run()
        # returns no result), but its launch_agent then reads that missing result:
        # exit 1 on an AttributeError, where a torch without the bug exits 0.
        assert codes[2] == 0 or "'NoneType' object has no attribute 'is_failed'" in said, said
