"""What a worker's children leave behind: ``torchrun`` and ``watchdogd run`` side by side.

The README's comparison row, measured. Each worker (2 ranks) starts two
children that sleep: one in a session of its own (as a daemonizing tool
would), one in the worker's own session (as a data loader's workers are).
The worker script is the containment tests' (``tests/system/test_containment.py``).

- *ended 0*: rank 1 exits 3 in attempt 0, attempt 1 succeeds; the children
  still running once the launcher returned 0, of each kind.
- *agent killed*: the launcher is SIGKILLed while its 2 workers and their
  4 children run; what is still running 1 s later.

``watchdogd run`` runs in both containment modes: ``auto`` (a cgroup v2 per
worker, where one can be written) and the weaker ``session``. Usage::

    python bench/bench_leftovers.py [--json FILE]
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
import textwrap
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _harness import wait_until  # noqa: E402

from tests.system.test_containment import CHILDREN, alive  # noqa: E402  (the tests' worker)

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "watchdogd (cgroup)": ["watchdogd", "run", "--process-containment", "auto"],
    "watchdogd (session)": ["watchdogd", "run", "--process-containment", "session"],
}


def _command(launcher: list[str], work: Path, marker: str, behaviour: str) -> list[str]:
    script = work / "worker.py"
    script.write_text(textwrap.dedent(CHILDREN))
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    return [*launcher, *flags, str(script), str(work), marker, behaviour]


def _children(work: Path) -> dict[int, bool]:
    """Each child's pid, and whether it leads a session of its own."""
    found = {}
    for path in work.glob("child-*"):
        pid = int(path.name.split("-")[1])
        try:
            found[pid] = os.getsid(pid) == pid
        except ProcessLookupError:
            found[pid] = False  # gone: its kind does not matter
    return found


def ended_0(launcher: list[str], work: Path) -> dict[str, object]:
    marker = uuid.uuid4().hex[:12]
    try:
        kinds = {}
        with (work / "run.log").open("w") as log:
            proc = subprocess.Popen(
                _command(launcher, work, marker, "exit"), stdout=log, stderr=log
            )
            # Each child's session is read while it runs, before the job ends.
            while proc.poll() is None:
                kinds.update({pid: own for pid, own in _children(work).items() if pid not in kinds})
                time.sleep(0.02)
        left = set(alive(marker))
        own = [pid for pid, is_own in kinds.items() if is_own]
        shared = [pid for pid, is_own in kinds.items() if not is_own]
        return {
            "code": proc.returncode,
            "own_session_left": f"{len(left & set(own))} of {len(own)}",
            "worker_session_left": f"{len(left & set(shared))} of {len(shared)}",
        }
    finally:
        _kill(marker)


def agent_killed(launcher: list[str], work: Path) -> dict[str, object]:
    marker = uuid.uuid4().hex[:12]
    try:
        with subprocess.Popen(
            _command(launcher, work, marker, "hang"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ) as agent:
            wait_until(lambda: len(list(work.glob("child-*"))) == 4, 60, "4 children")
            # The launcher's own command line holds the marker too.
            wait_until(lambda: len(alive(marker)) >= 7, 30, "workers and children")
            agent.kill()
        time.sleep(1.0)
        left = alive(marker)
        return {"left_after_1s": f"{len(left)} of 6"}
    finally:
        _kill(marker)


def _kill(marker: str) -> None:
    for pid in alive(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    for name, launcher in LAUNCHERS.items():
        with tempfile.TemporaryDirectory(prefix="wdb-leftovers-") as one, \
                tempfile.TemporaryDirectory(prefix="wdb-leftovers-") as two:  # fmt: skip
            results[name] = ended_0(launcher, Path(one)) | agent_killed(launcher, Path(two))
    print(f"{'launcher':<22}{'exit':>5}  {'own session left':>17}  "
          f"{'worker session left':>20}  {'agent SIGKILLed: left 1 s on':>29}")  # fmt: skip
    for name, row in results.items():
        print(f"{name:<22}{row['code']:>5}  {row['own_session_left']:>17}  "
              f"{row['worker_session_left']:>20}  {row['left_after_1s']:>29}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
