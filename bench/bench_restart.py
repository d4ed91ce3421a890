"""Group restart latency: ``watchdogd run`` vs ``torchrun``, side by side.

A toy job of ``--nproc`` workers; in every attempt local rank 0 exits with
status 1 as soon as all ranks are up, so the group restarts ``--restarts``
times. Each worker records when it started (after interpreter start-up,
the same for both launchers), and rank 0 when it exited. From those:

- restart latency: rank 0's exit in attempt n to the last replacement worker
  of attempt n+1 being up (and to the first one);
- watchdogd only, from its event log: rank 0's exit to the daemon's
  ``worker_failed`` event (detection), and to its last ``worker_started``
  (every replacement spawned, before the interpreters start up).

"Up" includes each worker's interpreter start-up, the same for both
launchers: on 2 cores, 8 Python start-ups take ~100-150 ms of it.

torchrun runs at its agent's ``--monitor-interval 0.1`` (its default); ours
needs no interval. Usage::

    python bench/bench_restart.py [--nproc 8] [--restarts 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import os, sys, time
started = time.time()
out = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["LOCAL_RANK"]
nproc = int(os.environ["LOCAL_WORLD_SIZE"])
name = f"start-{attempt}-{rank}"
with open(os.path.join(out, "." + name), "w") as f:
    f.write(repr(started))
os.rename(os.path.join(out, "." + name), os.path.join(out, name))  # never seen half-written
last = int(sys.argv[2])
if rank == "0" and int(attempt) < last:
    # Fail once every rank of this attempt is up, so the whole group is restarted.
    while len([n for n in os.listdir(out) if n.startswith(f"start-{attempt}-")]) < nproc:
        time.sleep(0.001)
    with open(os.path.join(out, f"exit-{attempt}"), "w") as f:
        f.write(repr(time.time()))
    os._exit(1)  # no interpreter teardown: the exit is now
if int(attempt) < last:
    time.sleep(600)  # the others wait to be stopped
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(command: list[str], out: Path, restarts: int, nproc: int) -> dict[str, list[float]]:
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{command[:3]} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    last_up, first_up = [], []
    for attempt in range(restarts):
        exited = float((out / f"exit-{attempt}").read_text())
        starts = [float((out / f"start-{attempt + 1}-{r}").read_text()) for r in range(nproc)]
        last_up.append(max(starts) - exited)
        first_up.append(min(starts) - exited)
    return {"all_up": last_up, "first_up": first_up, "wall": [wall]}


def from_events(event_log: Path, out: Path, restarts: int) -> dict[str, list[float]]:
    """watchdogd's own view: when it saw the exit, when it had spawned the replacements."""
    events = [json.loads(line) for line in event_log.read_text().splitlines()]
    failed = {
        e["metadata"]["attempt"]: e["timestamp"] / 1000
        for e in events
        if e["name"] == "worker_failed"
    }
    spawned: dict[int, float] = {}
    for e in events:
        if e["name"] == "worker_started":
            attempt = e["metadata"]["attempt"]
            spawned[attempt] = max(spawned.get(attempt, 0.0), e["timestamp"] / 1000)
    exits = [float((out / f"exit-{attempt}").read_text()) for attempt in range(restarts)]
    return {
        "detect": [failed[a] - exits[a] for a in range(restarts)],
        "spawned": [spawned[a + 1] - exits[a] for a in range(restarts)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wd-bench-restart-"))
    try:
        worker = work / "worker.py"
        worker.write_text(WORKER)
        results: dict[str, dict[str, list[float]]] = {}
        for name in ("watchdogd", "torchrun"):
            out = work / name
            out.mkdir()
            flags = ["--nproc-per-node", str(args.nproc), "--max-restarts", str(args.restarts)]
            tail = [str(worker), str(out), str(args.restarts)]
            if name == "watchdogd":
                event_log = work / "events.jsonl"
                command = ["watchdogd", "run", "--event-log", str(event_log), *flags, *tail]
                results[name] = measure(command, out, args.restarts, args.nproc)
                results[name].update(from_events(event_log, out, args.restarts))
            else:
                command = [
                    sys.executable, "-m", "torch.distributed.run", *flags,
                    "--monitor-interval", "0.1", *tail,
                ]  # fmt: skip
                results[name] = measure(command, out, args.restarts, args.nproc)
        print(f"group restart, nproc={args.nproc}, {args.restarts} restarts each")
        print(f"{'':28}{'watchdogd':>12}{'torchrun':>12}{'ratio':>9}")
        for key, label in (
            ("first_up", "exit -> first worker up"),
            ("all_up", "exit -> all workers up"),
        ):
            for q, qname in ((0.5, "p50"), (0.99, "p99")):
                ours = percentile(results["watchdogd"][key], q) * 1000
                theirs = percentile(results["torchrun"][key], q) * 1000
                print(
                    f"{label + ' ' + qname:28}{ours:10.1f}ms{theirs:10.1f}ms{theirs / ours:8.1f}x"
                )
        print(
            f"{'whole run (wall)':28}{results['watchdogd']['wall'][0]:11.2f}s"
            f"{results['torchrun']['wall'][0]:11.2f}s"
        )
        ours = results["watchdogd"]
        for key, label in (("detect", "exit seen"), ("spawned", "all replacements spawned")):
            print(
                f"watchdogd, exit -> {label}: median {statistics.median(ours[key]) * 1000:.1f} ms, "
                f"p99 {percentile(ours[key], 0.99) * 1000:.1f} ms (event timestamps: 1 ms steps)"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
