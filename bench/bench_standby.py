"""A standby node taking a lost node's place: loss -> its rank at user code, cold and prewarmed.

Four ``watchdogd run`` nodes at ``--nnodes 4:4`` and one more (the standby)
on a real etcd on this machine (the binary the test suite would use,
``tests/etcd.py``), each worker importing torch. Each trial kills a member
(its agent and workers, SIGKILL, no word to etcd) once the standby stands
by, and measures from the kill to the standby's rank:

- ``user code``: the first line of the worker's script;
- ``torch ready``: after its ``import torch`` (with ``--prewarm torch`` the
  spare imported it while the node stood by).

Run: ``python bench/bench_standby.py [--trials 5] [--ttl 2] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _harness import percentile, wait_until

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.etcd import EtcdServer, find_etcd, running_etcd  # noqa: E402  (the suite's etcd)
from tests.report_then_wait import REPORT_THEN_WAIT  # noqa: E402

WORKER = (
    """
import json, os, sys, time
first_line = time.time()
import torch
ready = time.time()
out = sys.argv[1]
report = {"group_rank": os.environ["GROUP_RANK"], "agent": os.environ["BENCH_AGENT"],
          "first_line": first_line, "ready": ready}
"""
    + REPORT_THEN_WAIT
)


def agent(
    etcd: EtcdServer, run: str, directory: Path, name: str, ttl: float, prewarm: bool
) -> subprocess.Popen[bytes]:
    events = directory / f"{name}.jsonl"
    command = [
        "watchdogd", "run", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run, "--nnodes", "4:4",
        "--local-addr", "127.0.0.1", "--max-restarts", "3", "--event-log", str(events),
        "--rdzv-conf", f"last_call_timeout=0.3,lease_ttl={ttl},join_timeout=60",
        *(["--prewarm", "torch"] if prewarm else []),
        str(directory / "worker.py"), str(directory / "out"),
    ]  # fmt: skip
    env = {**os.environ, "BENCH_AGENT": name}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def reports(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in (directory / "out").glob("*.json")]


def descendants(pid: int) -> list[int]:
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                found += kids
                queue += kids
    return found


def standing_by_warm(events: Path) -> bool:
    """The node says it stands by, and its spares (if any) are warm."""
    text = events.read_text() if events.exists() else ""
    if '"daemon_started"' not in text:
        return False
    started = next(json.loads(line) for line in text.splitlines() if '"daemon_started"' in line)
    listing = subprocess.run(
        ["watchdogctl", "--socket", started["metadata"]["socket"], "groups", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if listing.returncode != 0:
        return False
    (group,) = json.loads(listing.stdout)
    return bool(group["rendezvous"]["standby"]) and all(s["ready"] for s in group["spares"])


@contextlib.contextmanager
def job(
    etcd: EtcdServer, ttl: float, prewarm: bool
) -> Iterator[tuple[Path, str, dict[str, subprocess.Popen[bytes]]]]:
    with tempfile.TemporaryDirectory(prefix="wd-standby-") as tmp:
        directory = Path(tmp)
        (directory / "out").mkdir()
        (directory / "worker.py").write_text(WORKER)
        run = f"bench-{uuid.uuid4().hex[:8]}"
        agents = {name: agent(etcd, run, directory, name, ttl, prewarm) for name in "abcd"}
        try:
            yield directory, run, agents
        finally:
            (directory / "out" / "done").touch()
            for proc in agents.values():
                with contextlib.suppress(ProcessLookupError):
                    for pid in descendants(proc.pid):
                        os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()


def trial(etcd: EtcdServer, ttl: float, prewarm: bool, lost: int) -> dict[str, float]:
    with job(etcd, ttl, prewarm) as (directory, run, agents):
        wait_until(lambda: len(reports(directory)) == 4, 120, "4 nodes")
        first = {r["agent"]: r["group_rank"] for r in reports(directory)}
        agents["e"] = agent(etcd, run, directory, "e", ttl, prewarm)
        events = directory / "e.jsonl"
        wait_until(lambda: standing_by_warm(events), 120, "the standby, warm", interval=0.2)
        time.sleep(1.0)  # settled: the spare idles, as it would for hours
        victim = next(name for name, rank in first.items() if rank == str(lost))
        pids = descendants(agents[victim].pid)
        agents[victim].kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lost_at = time.time()
        wait_until(lambda: any(r["agent"] == "e" for r in reports(directory)), 60, "its rank")
        (taken,) = (r for r in reports(directory) if r["agent"] == "e")
        assert taken["group_rank"] == str(lost), taken
        return {
            "user_code": taken["first_line"] - lost_at,
            "torch_ready": taken["ready"] - lost_at,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--ttl", type=float, default=2.0, help="lease TTL, seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    binary, source = find_etcd()
    if binary is None:
        raise SystemExit(f"no etcd: {source}")
    results: dict[str, list[dict[str, float]]] = {}
    with running_etcd(binary) as etcd:
        for prewarm in (False, True):
            mode = "--prewarm torch" if prewarm else "cold"
            results[mode] = [
                trial(etcd, args.ttl, prewarm, lost=index % 4) for index in range(args.trials)
            ]
    if args.json:
        print(json.dumps({"ttl": args.ttl, "trials": results}))
        return
    print(f"loss -> the standby's rank, 4 nodes + 1 standby, lease TTL {args.ttl:g} s, "
          f"{args.trials} trials each (lost rank 0, 1, 2, 3, ...)")  # fmt: skip
    print(f"{'':16} {'user code p50 / max':>22} {'torch ready p50 / max':>24}")
    for mode, trials in results.items():
        cells = []
        for key in ("user_code", "torch_ready"):
            values = [t[key] for t in trials]
            cells.append(f"{percentile(values, 50):.2f} / {max(values):.2f} s")
        print(f"{mode:16} {cells[0]:>22} {cells[1]:>24}")


if __name__ == "__main__":
    main()
