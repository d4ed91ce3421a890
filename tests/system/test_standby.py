"""Standby nodes on etcd: ``watchdogd run`` processes beyond ``--nnodes MAX``, a real etcd.

A standby waits beside the full round, without the join timeout, shows as
one, takes the rank of the next node lost (every other node keeps its own)
and leaves with 0 when the job ends without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ..conftest import children, wait_until
from ..etcd import EtcdServer
from ..report_then_wait import ANCESTORS, REPORT_THEN_WAIT
from .test_multinode import _kill_nodes, _socket_of, ctl, finish, node

__all__ = ["_kill_nodes"]  # the launchers a failed test left are killed after it

# Each rank reports its variables, when it reached user code and which processes it
# runs under (the test names each agent by its pid), then runs until ``done`` exists.
WORKER = (
    """
import json, os, sys, time
started = time.time()
out = sys.argv[1]
"""
    + ANCESTORS
    + """
report = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK",
                                     "TORCHELASTIC_RESTART_COUNT",
                                     "TORCHELASTIC_USE_AGENT_STORE")}
report.update(started=started, ancestors=ancestors())
"""
    + REPORT_THEN_WAIT
)

TTL = 2.0
JOIN_TIMEOUT = 3.0
CONF = f"last_call_timeout=0.3,lease_ttl={TTL},join_timeout={JOIN_TIMEOUT}"


def ranks_run(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]


def of(agent: subprocess.Popen[str], seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports of ``agent``'s workers."""
    return [report for report in seen if agent.pid in report["ancestors"]]


def standing_by(events: Path) -> bool:
    return events.exists() and '"rdzv_standby"' in events.read_text()


def start_standby(
    etcd: EtcdServer, run: str, tmp_path: Path, nnodes: str, *flags: str, name: str = "standby"
) -> tuple[subprocess.Popen[str], Path]:
    """A node beyond MAX: it stands by (its event says so) and outwaits its join timeout."""
    events = tmp_path / f"{name}.jsonl"
    standby = node(etcd, run, tmp_path, nnodes, 0, "--rdzv-conf", CONF, "--event-log",
                   str(events), *flags, code=WORKER)  # fmt: skip
    wait_until(lambda: standing_by(events), timeout=30)
    time.sleep(JOIN_TIMEOUT + 0.5)
    assert standby.poll() is None  # no "no place after …": a standby has no join timeout
    return standby, events


def kill_node(agent: subprocess.Popen[str]) -> float:
    """The node dies, its agent and its workers at once, without a word to etcd."""
    workers = children(agent.pid)
    with agent:
        agent.kill()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    return time.time()


@pytest.mark.parametrize(
    ("lost", "prewarm"),
    [(0, ()), (1, ("--prewarm", "json"))],
    ids=["rank0", "middle-prewarmed"],
)
def test_a_standby_takes_the_lost_nodes_rank_and_the_others_keep_theirs(
    etcd: EtcdServer, tmp_path: Path, lost: int, prewarm: tuple[str, ...]
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    members = [node(etcd, run, tmp_path, "4:4", 0, "--max-restarts", "1", "--rdzv-conf", CONF,
                    code=WORKER) for _ in range(4)]  # fmt: skip
    wait_until(lambda: len(ranks_run(tmp_path)) == 4, timeout=60)
    before = {agent.pid: of(agent, ranks_run(tmp_path))[0]["GROUP_RANK"] for agent in members}
    assert sorted(before.values()) == ["0", "1", "2", "3"]
    standby, events = start_standby(etcd, run, tmp_path, "4:4", *prewarm)
    sock = _socket_of(events)
    assert "STANDBY" in ctl(sock, "status") and "STANDBY" in ctl(sock, "groups")
    if prewarm:
        spares = json.loads(ctl(sock, "groups", "--json"))[0]["spares"]
        assert [spare["ready"] for spare in spares] == [True]  # warm before it is needed
    victim = next(agent for agent in members if before[agent.pid] == str(lost))
    members.remove(victim)
    lost_at = kill_node(victim)

    def second_round() -> list[dict[str, Any]]:
        return [r for r in ranks_run(tmp_path) if r["TORCHELASTIC_RESTART_COUNT"] == "1"]

    wait_until(lambda: len(second_round()) == 4, timeout=30)
    after = second_round()
    (taken,) = of(standby, after)
    assert (taken["GROUP_RANK"], taken["RANK"], taken["WORLD_SIZE"]) == (str(lost), str(lost), "4")
    # Rank 0's agent hosts the store, a standby at rank 0 too: it offered its store as it
    # stood by (it asked for its place before its helper had imported torch).
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in after} == {"True"}
    assert {agent.pid: of(agent, after)[0]["GROUP_RANK"] for agent in members} == {
        agent.pid: before[agent.pid] for agent in members
    }
    took = taken["started"] - lost_at
    print(f"\nstandby{' (prewarmed)' if prewarm else ''} at lost rank {lost} (lease TTL {TTL:g} s):"
          f" loss -> its rank at user code {took:.2f}s")  # fmt: skip
    assert took < TTL + 2
    assert "STANDBY" not in ctl(sock, "groups")
    # The lost node comes back (its agent started again): the next standby.
    back, _ = start_standby(etcd, run, tmp_path, "4:4", name="back")
    assert len(ranks_run(tmp_path)) == 8  # nobody restarted for it
    (tmp_path / "out" / "done").touch()
    assert finish(*members, standby, back) == [0, 0, 0, 0, 0]


def test_more_nodes_than_max_never_end_the_job_and_the_standby_leaves_with_0(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    members = [node(etcd, run, tmp_path, "2:2", 0, "--rdzv-conf", CONF, code=WORKER)
               for _ in range(2)]  # fmt: skip
    wait_until(lambda: len(ranks_run(tmp_path)) == 2, timeout=60)
    standby, events = start_standby(etcd, run, tmp_path, "2:2")
    (tmp_path / "out" / "done").touch()
    assert finish(*members, standby) == [0, 0, 0]
    seen = ranks_run(tmp_path)
    assert len(seen) == 2 and of(standby, seen) == []  # no restart for the standby
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in seen} == {"0"}
    assert '"rdzv_graceful_exit"' in events.read_text()
