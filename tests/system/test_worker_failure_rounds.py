"""A worker failure on an etcd job of two nodes: one restart, one new round, then done.

Real ``watchdogd run`` processes on a real etcd. Rank 1's worker fails once;
both nodes must re-form once and finish, never loop through rounds.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from ..conftest import wait_until
from ..etcd import EtcdServer
from .test_multinode import _kill_nodes, finish, node

__all__ = ["_kill_nodes"]  # the launchers a failed test left are killed after it

# Group rank 1 fails in the first attempt, and rank 0 runs until the restart
# that follows stops it; in the second attempt both run for a second (a stray
# restart shows meanwhile) and end.
WORKER = """
import os, sys, time
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if restart == "0" and os.environ["GROUP_RANK"] == "1":
    sys.exit(1)
time.sleep(60 if restart == "0" else 1)
"""

CONF = "last_call_timeout=0.3,lease_ttl=2,join_timeout=10"


def rounds(events: Path) -> list[dict[str, object]]:
    written = events.read_text() if events.exists() else ""
    lines = written.split("\n")[:-1]  # the last one may be half written
    return [e for e in map(json.loads, lines) if e.get("name") == "rdzv_round_complete"]


def test_a_worker_failure_restarts_both_nodes_once(etcd: EtcdServer, tmp_path: Path) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / f"node{i}.jsonl" for i in range(2)]
    started = time.monotonic()
    nodes = [
        node(etcd, run, tmp_path, "2", 0, "--max-restarts", "3", "--rdzv-conf", CONF,
             "--event-log", str(log), code=WORKER)
        for log in logs
    ]  # fmt: skip

    def over() -> bool:  # both done, or a third round: it loops
        return all(n.poll() is not None for n in nodes) or any(len(rounds(log)) > 2 for log in logs)

    wait_until(over, timeout=15)
    print(f"\nworker failure on 2 etcd nodes: start to over {time.monotonic() - started:.2f}s")
    assert [len(rounds(log)) for log in logs] == [2, 2]  # the first round, and one more
    assert finish(*nodes) == [0, 0]
