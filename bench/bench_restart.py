"""Group restart latency: ``watchdogd run`` (cold, and with warm spares) vs ``torchrun``.

A toy job of ``--nproc`` workers; in every attempt local rank 0 exits with
status 1 once all ranks are up (after ``--gap`` seconds more, the time a
job trains between failures), so the group restarts ``--restarts`` times.
Each worker records when its user code started: with ``--import-torch``
that is after ``import torch``, as in a real trainer. From those:

- restart latency: rank 0's exit in attempt n to the last replacement worker
  of attempt n+1 at user code (and to the first one);
- watchdogd only, from its event log: rank 0's exit to the daemon's
  ``worker_failed`` event (detection), and to its last ``worker_started``
  (every replacement spawned or handed a spare, before user code runs).

The launchers, one after the other on the same job: ``torchrun``
(``--monitor-interval 0.1``, its default), ``watchdogd run``, and with
``--import-torch`` also ``watchdogd run --prewarm torch``, whose spares
have imported torch before the failure; rank 0 then also reports the
spares' resident memory (``watchdogctl groups``' figure). The gap must let
the replacement spares finish their imports (8 ranks on 2 cores: ~6 s).
Usage::

    python bench/bench_restart.py [--nproc 8] [--restarts 20] [--import-torch] [--gap S]
                                  [--json out.json] [--no-torchrun]

``--no-torchrun`` leaves torchrun out, to compare two versions of watchdogd
(the ``watchdogd`` found first on ``PATH``, with the ``PYTHONPATH`` given).
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
IMPORTS
started = time.time()
out = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["LOCAL_RANK"]
nproc = int(os.environ["LOCAL_WORLD_SIZE"])
name = f"start-{attempt}-{rank}"
with open(os.path.join(out, "." + name), "w") as f:
    f.write(repr(started))
os.rename(os.path.join(out, "." + name), os.path.join(out, name))  # never seen half-written
last, gap = int(sys.argv[2]), float(sys.argv[3])
if rank == "0" and int(attempt) < last:
    # Fail once every rank of this attempt is up, so the whole group is restarted.
    while len([n for n in os.listdir(out) if n.startswith(f"start-{attempt}-")]) < nproc:
        time.sleep(0.001)
    time.sleep(gap)
    if "WATCHDOGD_SOCKET" in os.environ and "torch" in sys.modules:
        import watchdogd_client as wd
        spares = wd.SocketTimerClient(os.environ["WATCHDOGD_SOCKET"]).list_groups()[0].spares
        with open(os.path.join(out, f"spares-{attempt}"), "w") as f:
            f.write(repr(sum(s.rss_bytes or 0 for s in spares if s.ready)))
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
    spares = [float(f.read_text()) for f in sorted(out.glob("spares-*"))]
    return {"all_up": last_up, "first_up": first_up, "wall": [wall], "spare_rss": spares}


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
    parser.add_argument("--import-torch", action="store_true", help="workers import torch first")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds each attempt runs")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--no-torchrun",
        action="store_true",
        help="watchdogd only (to compare two versions of it; ratios to torchrun are left out)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wd-bench-restart-"))
    launchers = [] if args.no_torchrun else ["torchrun"]
    launchers += ["watchdogd"] + (["prewarm"] if args.import_torch else [])
    try:
        worker = work / "worker.py"
        worker.write_text(WORKER.replace("IMPORTS", "import torch" if args.import_torch else ""))
        results: dict[str, dict[str, list[float]]] = {}
        for name in launchers:
            out = work / name
            out.mkdir()
            flags = ["--nproc-per-node", str(args.nproc), "--max-restarts", str(args.restarts)]
            tail = [str(worker), str(out), str(args.restarts), str(args.gap)]
            if name == "torchrun":
                command = [
                    sys.executable, "-m", "torch.distributed.run", *flags,
                    "--monitor-interval", "0.1", *tail,
                ]  # fmt: skip
                results[name] = measure(command, out, args.restarts, args.nproc)
                continue
            event_log = work / f"{name}.jsonl"
            prewarm = ["--prewarm", "torch"] if name == "prewarm" else []
            command = ["watchdogd", "run", "--event-log", str(event_log), *prewarm, *flags, *tail]
            results[name] = measure(command, out, args.restarts, args.nproc)
            results[name].update(from_events(event_log, out, args.restarts))
        report(results, launchers, args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(
    results: dict[str, dict[str, list[float]]], launchers: list[str], args: argparse.Namespace
) -> None:
    titles = {"torchrun": "torchrun", "watchdogd": "watchdogd", "prewarm": "--prewarm"}
    torch_note = ", workers import torch" if args.import_torch else ""
    print(f"group restart, nproc={args.nproc}, {args.restarts} restarts each{torch_note}, "
          f"gap {args.gap:g} s")  # fmt: skip
    ours = [n for n in launchers if n != "torchrun"]
    against = ours if "torchrun" in launchers else []
    print(f"{'':30}" + "".join(f"{titles[n]:>12}" for n in launchers)
          + "".join(f"{'torchrun/' + titles[n]:>22}" for n in against))  # fmt: skip
    for key, label in (
        ("first_up", "exit -> first at user code"),
        ("all_up", "exit -> all at user code"),
    ):
        for q, qname in ((0.5, "p50"), (0.99, "p99")):
            values = [percentile(results[n][key], q) * 1000 for n in launchers]
            ratios = [values[0] / v for v in values[1:]] if against else []
            print(f"{label + ' ' + qname:30}" + "".join(f"{v:10.1f}ms" for v in values)
                  + "".join(f"{r:21.1f}x" for r in ratios))  # fmt: skip
    print(
        f"{'whole run (wall)':30}" + "".join(f"{results[n]['wall'][0]:11.2f}s" for n in launchers)
    )
    for name in ours:
        for key, label in (("detect", "exit seen"), ("spawned", "all replacements started")):
            values = results[name][key]
            median, p99 = statistics.median(values) * 1000, percentile(values, 0.99) * 1000
            print(
                f"{titles[name]}, exit -> {label}: median {median:.1f} ms, p99 {p99:.1f} ms "
                "(event timestamps: 1 ms steps)"
            )
    if "prewarm" in results and results["prewarm"]["spare_rss"]:
        rss = statistics.median(results["prewarm"]["spare_rss"]) / 2**20
        print(f"--prewarm: the ready spares' resident memory, median {rss:.0f} MiB "
              f"({rss / args.nproc:.0f} MiB per rank)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
