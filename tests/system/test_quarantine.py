"""Bad nodes set aside on etcd: ``watchdogd run`` processes, a real etcd.

A node whose worker is killed by a signal ``--quarantine-after`` times sets
itself aside: it leaves the job, a standby takes its rank, its ``/healthz``
answers 503 and ``watchdogctl status`` says why; its agent started again
stays out, until ``watchdogctl quarantine --clear``. A Python exception on
every node is the program's failure: nobody is set aside.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ..conftest import wait_until
from ..etcd import EtcdServer
from ..report_then_wait import REPORT_RANK
from .test_multinode import _kill_nodes, _socket_of, ctl, finish, node
from .test_standby import CONF, of, ranks_run, standing_by

__all__ = ["_kill_nodes"]  # the launchers a failed test left are killed after it

# Each rank reports as test_standby's do, then runs until ``done`` exists; a rank told
# to (``kill-<RANK>``, taken once) kills itself with SIGKILL: a node's failure.
WORKER = (
    """
import json, os, signal, sys, time
out = sys.argv[1]
"""
    + REPORT_RANK
    + """
kill = os.path.join(out, "kill-" + os.environ["RANK"])
while not os.path.exists(os.path.join(out, "done")):
    try:
        os.unlink(kill)
    except FileNotFoundError:
        time.sleep(0.05)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
"""
)

# Every node's first attempt raises, all at once (``go``); the second reports and ends.
RAISES_FIRST = """
import os, sys, time
out = sys.argv[1]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    open(os.path.join(out, f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.002)
    raise RuntimeError("a bug in the training script")
open(os.path.join(out, f"{os.getpid()}.json"), "w").write("{}")
"""

QUARANTINE = ("--quarantine-after", "1", "--max-restarts", "5", "--rdzv-conf", CONF)


def agent(
    etcd: EtcdServer, run: str, tmp_path: Path, name: str, *flags: str
) -> tuple[subprocess.Popen[str], Path]:
    """A node named ``name`` in a 2-node job, its events in ``<name>.jsonl`` (appended)."""
    events = tmp_path / f"{name}.jsonl"
    proc = node(etcd, run, tmp_path, "2:2", 0, "--node-name", name, "--event-log", str(events),
                *flags, code=WORKER)  # fmt: skip
    return proc, events


def events_of(events: Path, name: str) -> list[dict[str, Any]]:
    if not events.exists():
        return []
    return [
        e for line in events.read_text().splitlines() if (e := json.loads(line))["name"] == name
    ]


def health(events: Path) -> tuple[int, dict[str, Any]]:
    (listening,) = events_of(events, "metrics_listening")[-1:]
    url = f"http://{listening['metadata']['address']}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_failing_node_is_set_aside_a_standby_takes_its_place_until_it_is_cleared(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    metrics = ("--metrics-listen", "0")
    a, a_events = agent(etcd, run, tmp_path, "node-a", *QUARANTINE, *metrics)
    b, _ = agent(etcd, run, tmp_path, "node-b", *QUARANTINE)
    wait_until(lambda: len(ranks_run(tmp_path)) == 2, timeout=60)
    standby, s_events = agent(etcd, run, tmp_path, "node-s", *QUARANTINE)
    wait_until(lambda: standing_by(s_events), timeout=30)
    (a_rank,) = (r["GROUP_RANK"] for r in of(a, ranks_run(tmp_path)))
    assert health(a_events)[0] == 200
    (tmp_path / "out" / f"kill-{a_rank}").touch()  # one failure is the node's: F=1

    def second_round() -> list[dict[str, Any]]:
        return [r for r in ranks_run(tmp_path) if r["TORCHELASTIC_RESTART_COUNT"] == "1"]

    wait_until(lambda: len(second_round()) == 2, timeout=30)
    (taken,) = of(standby, second_round())
    assert taken["GROUP_RANK"] == a_rank and of(a, second_round()) == []
    (aside,) = events_of(a_events, "node_quarantined")
    assert aside["metadata"]["node"] == "node-a"
    assert "killed by SIGKILL" in aside["metadata"]["reason"]
    sock = _socket_of(a_events)
    assert "QUARANTINED" in ctl(sock, "status") and "killed by SIGKILL" in ctl(sock, "status")
    code, said = health(a_events)
    assert (code, said["status"]) == (503, "quarantined") and "SIGKILL" in said["quarantined"]
    metric = 'watchdogd_quarantined{group="default"} 1.0'
    address = events_of(a_events, "metrics_listening")[-1]["metadata"]["address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        assert metric in answer.read().decode()
    # Stopped (it waits for no worker), then started again: it finds the job's key and
    # stays out; nobody restarts for it.
    a.send_signal(signal.SIGTERM)
    assert a.wait(10) == 1  # as torchrun, for a signal
    a_events.unlink()
    again, a_events = agent(etcd, run, tmp_path, "node-a", *QUARANTINE)
    wait_until(lambda: events_of(a_events, "node_quarantined") != [], timeout=30)
    sock = _socket_of(a_events)
    assert "QUARANTINED" in ctl(sock, "status") and "SIGKILL" in ctl(sock, "status")
    assert len(ranks_run(tmp_path)) == 4
    # Cleared, it comes back as a newcomer: the round is full, so it stands by.
    assert "clearing the quarantine of node-a" in ctl(sock, "quarantine", "--clear", "node-a")
    wait_until(lambda: standing_by(a_events), timeout=30)
    assert "QUARANTINED" not in ctl(sock, "status")
    assert len(ranks_run(tmp_path)) == 4
    (tmp_path / "out" / "done").touch()
    assert finish(b, standby, again) == [0, 0, 0]


def test_a_python_exception_on_every_node_sets_nobody_aside(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    nodes = [
        node(etcd, run, tmp_path, "2:2", 1, "--node-name", name, "--event-log",
             str(tmp_path / f"{name}.jsonl"), *QUARANTINE, code=RAISES_FIRST)
        for name in ("node-a", "node-b")
    ]  # fmt: skip
    out = tmp_path / "out"
    wait_until(lambda: len(list(out.glob("ready-*"))) == 2, timeout=60)
    (out / "go").touch()
    assert finish(*nodes, timeout=30) == [0, 0]
    assert len(list((tmp_path / "out").glob("*.json"))) == 2  # the second attempt ran
    logs = [tmp_path / f"{name}.jsonl" for name in ("node-a", "node-b")]
    # The first to fail claimed its round (a node told of it first stops without failing).
    assert any(events_of(log, "worker_failed") for log in logs)
    assert all(events_of(log, "node_quarantined") == [] for log in logs)


def test_a_node_set_aside_leaves_with_0_when_the_job_ends_without_it(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    nodes = [node(etcd, run, tmp_path, "1:2", 0, "--node-name", name, "--event-log",
                  str(tmp_path / f"{name}.jsonl"), *QUARANTINE, code=WORKER)
             for name in ("node-a", "node-b")]  # fmt: skip
    wait_until(lambda: len(ranks_run(tmp_path)) == 2, timeout=60)
    a, b = nodes
    (a_rank,) = (r["GROUP_RANK"] for r in of(a, ranks_run(tmp_path)))
    (tmp_path / "out" / f"kill-{a_rank}").touch()
    wait_until(lambda: len(ranks_run(tmp_path)) == 3, timeout=30)  # b, alone (MIN 1)
    again = [
        r["RANK"] for r in of(b, ranks_run(tmp_path)) if r["TORCHELASTIC_RESTART_COUNT"] == "1"
    ]
    assert again == ["0"]
    assert events_of(tmp_path / "node-a.jsonl", "node_quarantined") != []
    (tmp_path / "out" / "done").touch()
    assert finish(b, a, timeout=20) == [0, 0]  # a no longer waits for an operator
    ended = events_of(tmp_path / "node-a.jsonl", "group_state")[-1]["metadata"]
    assert ended["state"] == "SUCCEEDED" and "set aside" in ended["reason"]
