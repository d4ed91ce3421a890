"""A job's timeline: ``watchdogctl events --trace`` on a run with a hang and a restart."""

from __future__ import annotations

import json
import socket
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..conftest import REPO, wait_until
from .test_cli import ctl, serve

STANDIN = REPO / "tests" / "flight_recorder_standin.py"


def tracks(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each track's slices and instants, by the track's name."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] != "M":
            found[names[e["pid"], e["tid"]]].append(e)
    return found


def inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_a_hang_and_a_restart_on_the_timeline(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    spec = short_dir / "job.toml"
    spec.write_text(
        f"""
name = "job"
entrypoint = [{sys.executable!r}, {str(STANDIN)!r}, "3", "1"]
nproc = 2
max_restarts = 1
flight_recorder = true
log_dir = {str(short_dir / "logs")!r}
env = {{ TORCH_NCCL_COORD_CHECK_MILSEC = "50", PYTHONPATH = {str(REPO / "client")!r} }}
"""
    )
    out = short_dir / "t.json"
    with serve(short_dir):
        assert ctl(sock, "submit", str(spec)).returncode == 0

        def state() -> str:
            (group,) = json.loads(ctl(sock, "groups", "--json").stdout)
            return str(group["state"])

        wait_until(lambda: state() == "SUCCEEDED", 60)
        written = ctl(sock, "events", "--trace", str(out))
        assert written.returncode == 0, written.stderr
        assert f"as a Chrome trace in {out}" in written.stdout
        (dump,) = json.loads(ctl(sock, "dumps", "--json").stdout)
        assert ctl(sock, "events", "--trace", str(out), "--follow").returncode == 2
    trace = json.loads(out.read_text())
    (node,) = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert node == socket.gethostname()
    by_track = tracks(trace)
    assert {"watchdogd", "group job", "rank 0", "rank 1"} <= by_track.keys()

    group = by_track["group job"]
    assert [e["name"] for e in group if e["cat"] == "attempt"] == ["attempt 0", "attempt 1"]
    assert [e["name"] for e in group if e["cat"] == "rendezvous"] == ["rendezvous"] * 2
    assert [e["name"] for e in group if e["ph"] == "i"] == ["restart: attempt 1", "SUCCEEDED"]

    for rank in ("rank 0", "rank 1"):
        entries = by_track[rank]
        attempts = [e for e in entries if e["cat"] == "attempt"]
        assert [a["name"] for a in attempts] == ["attempt 0", "attempt 1"]
        timers = [e for e in entries if e["cat"] == "timer"]
        assert {t["name"] for t in timers} == {"step"}
        # Three steps and the hung one in attempt 0, three in attempt 1: each inside its attempt.
        assert [sum(inside(t, a) for t in timers) for a in attempts] == [4, 3]

    hung = by_track["rank 1"]
    (expired,) = [e for e in hung if e["cat"] == "timer" and e["args"]["outcome"] == "expired"]
    (kill,) = [e for e in hung if e["cat"] == "kill"]
    assert kill["name"] == "kill SIGKILL: step"
    assert kill["ts"] >= expired["ts"] + expired["dur"]  # after the deadline (and the dump)
    assert [e["name"] for e in hung if e["cat"] == "dump"] == [f"dump {dump['id']}"]
    # The other rank's step did not expire: it was ended by the kill of its group.
    outcomes = {e["args"]["outcome"] for e in by_track["rank 0"] if e["cat"] == "timer"}
    assert outcomes == {"released", "dropped"}
