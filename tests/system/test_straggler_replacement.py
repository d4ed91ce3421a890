"""A persistent straggler replaced by a standby: ``watchdogd run`` processes, a real etcd.

Each rank times its own compute (``compute``) inside its step (``step``),
whose end waits for the slowest rank as a collective would; a rank told to
(``slow-<PID>``) computes twice as long, so every rank's step slows alike
and only that rank's compute is slower than its peers'. A node run with
``--replace-stragglers-after`` steps aside for such a rank of its own while
a standby waits: the standby takes its group rank, the other node keeps its
own, the node is quarantined saying why. A node run without it kills nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ..conftest import wait_until
from ..etcd import EtcdServer
from ..report_then_wait import REPORT_RANK
from .test_multinode import _kill_nodes, _socket_of, ctl, finish, node
from .test_quarantine import events_of
from .test_standby import CONF, of, ranks_run, standing_by

__all__ = ["_kill_nodes"]  # the launchers a failed test left are killed after it

WORKER = (
    """
import glob, json, os, sys, time
import watchdogd_client as wd
out = sys.argv[1]
"""
    + REPORT_RANK
    + """
slow = os.path.join(out, f"slow-{os.getpid()}")
while not os.path.exists(os.path.join(out, "done")):
    began = time.monotonic()
    anyone_slow = bool(glob.glob(os.path.join(out, "slow-*")))
    with wd.expires(after=30, scope="step"):
        with wd.expires(after=30, scope="compute"):
            time.sleep(0.16 if os.path.exists(slow) else 0.08)
        # The collective: every rank leaves it when the slowest arrives.
        time.sleep(max(0.0, began + (0.2 if anyone_slow else 0.12) - time.monotonic()))
"""
)

# Short windows: a rank is flagged within about two seconds of slowing down.
STRAGGLERS = ("--nproc-per-node", "2", "--straggler-window", "8",
              "--straggler-publish-interval", "0.3", "--rdzv-conf", CONF)  # fmt: skip
AFTER = 1.0


def agent(
    etcd: EtcdServer, run: str, tmp_path: Path, name: str, *flags: str
) -> tuple[subprocess.Popen[str], Path]:
    events = tmp_path / f"{name}.jsonl"
    proc = node(etcd, run, tmp_path, "2:2", 0, "--node-name", name, "--event-log", str(events),
                "--max-restarts", "3", *STRAGGLERS, *flags, code=WORKER)  # fmt: skip
    return proc, events


def slow_down(worker: dict[str, Any], tmp_path: Path) -> Path:
    """Make ``worker`` (a report) slow; the flag file, to remove to make it fast again."""
    pid = next(
        p.stem for p in (tmp_path / "out").glob("*.json") if worker == json.loads(p.read_text())
    )
    flag = tmp_path / "out" / f"slow-{pid}"
    flag.touch()
    return flag


def flagged(*logs: Path) -> set[int]:
    """The ranks flagged on ``compute`` now, by the nodes of these event logs."""
    now: set[int] = set()
    for events in logs:
        for line in events.read_text().splitlines() if events.exists() else []:
            event = json.loads(line)
            if (
                event["name"].startswith("straggler")
                and event["metadata"].get("scope") == "compute"
            ):
                rank = event["metadata"]["rank"]
                now = now | {rank} if event["name"] == "straggler" else now - {rank}
    return now


def test_a_persistent_straggler_is_replaced_by_the_standby_only_where_asked(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    # Node a does not ask for replacement; node b does (a node's own decision).
    a, a_events = agent(etcd, run, tmp_path, "node-a")
    replace = ("--replace-stragglers-after", str(AFTER), "--metrics-listen", "0")
    b, b_events = agent(etcd, run, tmp_path, "node-b", *replace)
    wait_until(lambda: len(ranks_run(tmp_path)) == 4, timeout=60)
    standby, s_events = agent(etcd, run, tmp_path, "node-s", *replace)
    wait_until(lambda: standing_by(s_events), timeout=30)
    first = ranks_run(tmp_path)
    (a_slow, _), b_ranks = sorted(of(a, first), key=lambda r: r["RANK"]), of(b, first)

    # A loaded machine may flag a rank while the workers start: past that first.
    wait_until(lambda: flagged(a_events, b_events) == set(), timeout=15)

    # Without the option: flagged, never killed.
    flag = slow_down(a_slow, tmp_path)
    wait_until(lambda: int(a_slow["RANK"]) in flagged(a_events), timeout=15)
    time.sleep(AFTER + 1.0)  # past AFTER and a check's interval
    assert len(ranks_run(tmp_path)) == 4 and events_of(a_events, "node_quarantined") == []
    flag.unlink()
    wait_until(lambda: flagged(a_events, b_events) == set(), timeout=15)

    # With it: node b steps aside for its slow rank; the standby takes b's group rank.
    b_slow = min(b_ranks, key=lambda r: r["RANK"])
    slow_down(b_slow, tmp_path)
    wait_until(lambda: len(ranks_run(tmp_path)) == 8, timeout=30)
    second = [r for r in ranks_run(tmp_path) if r not in first]
    assert {r["GROUP_RANK"] for r in of(standby, second)} == {b_slow["GROUP_RANK"]}
    assert {r["GROUP_RANK"] for r in of(a, second)} == {a_slow["GROUP_RANK"]}
    assert of(b, second) == []
    (aside,) = events_of(b_events, "node_quarantined")
    reason = aside["metadata"]["reason"]
    assert reason.startswith(f"straggler: rank {b_slow['RANK']} scope compute relative 0.")
    (replaced,) = events_of(b_events, "straggler_replaced")
    assert replaced["metadata"]["reason"] == reason
    sock = _socket_of(b_events)
    assert f"QUARANTINED, out of the job until cleared: {reason}" in ctl(sock, "status")
    address = events_of(b_events, "metrics_listening")[-1]["metadata"]["address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        assert "watchdogd_straggler_replacements_total 1.0" in answer.read().decode()
    assert events_of(a_events, "node_quarantined") == []
    (tmp_path / "out" / "done").touch()
    assert finish(a, standby, b) == [0, 0, 0]  # b, set aside, leaves as the job ends
