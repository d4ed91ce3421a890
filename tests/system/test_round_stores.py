"""On etcd, rank 0's agent hosts the job's store, a new one on a new port for each round.

Two ``watchdogd run`` nodes on a real etcd, one rank each, real gloo. Without
the agent's store, rank 0's ``init_process_group`` hosts it and the other
rank, up first, backs off 0.25-0.75 s after its refused connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from ..conftest import wait_until
from ..etcd import EtcdServer
from .test_multinode import finish, node

WORKER = """
import datetime, json, os, sys, time
out = sys.argv[1]
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 0:
    time.sleep(6)  # the agents' helpers import torch meanwhile: this round went without
    sys.exit(1)
import torch, torch.distributed as dist
report = {k: os.environ[k] for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT")}
began = time.monotonic()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=datetime.timedelta(seconds=30))
report["connect_s"] = time.monotonic() - began
report["stale"] = store.check([f"attempt-{attempt - 1}"])  # what the last attempt wrote
store.set(f"attempt-{attempt}", "here")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
report["sum"] = total.item()
dist.barrier()
with open(os.path.join(out, f"{attempt}-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
sys.exit(1 if attempt == 1 else 0)  # both nodes restart once more
"""


def two_nodes(
    etcd: EtcdServer, tmp_path: Path, code: str, *, restarts: int
) -> list[subprocess.Popen[str]]:
    """Two nodes of one job (a rank each) running ``code``, which imports torch."""
    pytest.importorskip("torch")
    run = f"job-{uuid.uuid4().hex[:8]}"
    flags = ("--max-restarts", str(restarts))
    return [node(etcd, run, tmp_path, "2", 0, *flags, code=code) for _ in "ab"]


@pytest.mark.timeout(120)
def test_each_round_gets_an_empty_store_hosted_before_the_ranks_start(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    nodes = two_nodes(etcd, tmp_path, WORKER, restarts=2)
    assert finish(*nodes, timeout=100) == [0, 0]
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert sorted(seen) == ["1-0", "1-1", "2-0", "2-1"], seen
    for report in seen.values():
        assert report["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert report["sum"] == 2.0
        assert not report["stale"]  # the store is the round's own: nothing of the last one
        # It listened before any rank started: no refused connection, no client back-off.
        assert report["connect_s"] < 0.2, report
    ports = {attempt: {seen[f"{attempt}-{r}"]["MASTER_PORT"] for r in "01"} for attempt in "12"}
    assert len(ports["1"]) == len(ports["2"]) == 1 and ports["1"] != ports["2"]


LOSES_ITS_HELPER = """
import datetime, json, os, sys, time
out = sys.argv[1]
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 0:
    time.sleep(8)  # the test kills the agents' helpers meanwhile
    sys.exit(1)
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
with open(os.path.join(out, f"{attempt}-{rank}.json"), "w") as f:
    json.dump({"store": os.environ["TORCHELASTIC_USE_AGENT_STORE"], "sum": total.item()}, f)
dist.destroy_process_group()
"""


def _helpers(agent: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"torch_helper" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return found


def _serving(agent: subprocess.Popen[str]) -> bool:
    """Its helper listens on a TCP port: it has made its first store."""
    listening = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(f"socket:[{fields[9]}]")
    for pid in _helpers(agent.pid):
        with contextlib.suppress(OSError):
            fds = Path(f"/proc/{pid}/fd")
            if any(os.readlink(fd) in listening for fd in fds.iterdir()):
                return True
    return False


@pytest.mark.timeout(120)
def test_a_node_whose_helper_died_goes_on_with_rank_0_hosting(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    nodes = two_nodes(etcd, tmp_path, LOSES_ITS_HELPER, restarts=1)
    # Each helper has imported torch and made its first store; then it dies.
    wait_until(lambda: all(map(_serving, nodes)), timeout=30)
    for n in nodes:
        for pid in _helpers(n.pid):
            os.kill(pid, signal.SIGKILL)
    outputs = [n.communicate(timeout=100) for n in nodes]
    stderr = "".join(err for _, err in outputs)
    assert [n.returncode for n in nodes] == [0, 0], stderr[-3000:]
    seen = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("1-*.json")]
    assert seen == [{"store": "False", "sum": 2.0}] * 2
    assert stderr.count("the job's store goes to rank 0 from now on") == 2, stderr[-3000:]
