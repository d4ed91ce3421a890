"""Expiry -> kill on an idle daemon, one fresh client process per trial.

    python bench/bench_expiry_probe.py                   # 40 trials, stack dumps off
    python bench/bench_expiry_probe.py --dumps default   # the default faulthandler capture
    python bench/bench_expiry_probe.py --trials 100 --json probe.json

What ``../shared/bench``'s expiry section measures, without its torch side:
each trial forks a process that connects (``SocketTimerClient``, hello and
all), arms one SIGKILL timer ``--delay`` seconds ahead (absolute
``time.time()``, T) and sleeps; the bench waits on a pidfd and takes
``death seen - T``. The daemon is otherwise idle (one trial at a time, a
pause between trials). The daemon's own ``late_ms`` (deadline -> signal
sent, by its clock) comes from its event log, so the table splits the
latency into the daemon's part and the kernel's (signal -> death seen by
the bench). See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _harness import Watchdogd, percentile

import watchdogd_client as wd


def _trial_child(socket_path: str, delay: float, report: int) -> None:
    """In the forked child: connect, arm, report T, sleep until killed."""
    client = wd.SocketTimerClient(socket_path, signal=signal.SIGKILL)
    expiration = time.time() + delay
    client.acquire("probe", expiration)
    os.write(report, f"{expiration!r}\n".encode())
    time.sleep(3600)


def trial(socket_path: str, delay: float) -> tuple[int, float] | None:
    """One probe: (child pid, death seen - T in seconds), or None if it was not killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            _trial_child(socket_path, delay, w)
        except BaseException:  # report anything, then leave without the parent's cleanup
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    try:
        with os.fdopen(r) as f:
            line = f.readline()
        if not line:
            return None
        expiration = float(line)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll((expiration - time.time() + 5) * 1000):
            os.kill(pid, signal.SIGKILL)
            return None
        seen = time.time()
        return pid, seen - expiration
    finally:
        os.close(pidfd)
        os.waitpid(pid, 0)


def summary(values_ms: Sequence[float]) -> str:
    if not values_ms:
        return "no samples"
    qs = [percentile(values_ms, q) for q in (50, 90, 99)]
    return "n={}  p50 {:.2f}  p90 {:.2f}  p99 {:.2f}  max {:.2f} ms".format(
        len(values_ms), *qs, max(values_ms)
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument(
        "--dumps",
        choices=("off", "default"),
        default="off",
        help="stack_dumps off, or the daemon's default (faulthandler first)",
    )
    ap.add_argument("--delay", type=float, default=0.25, help="timer length, s (±20 %% jitter)")
    ap.add_argument("--pause", type=float, default=0.2, help="idle time between trials, s")
    ap.add_argument(
        "--import-torch",
        action="store_true",
        help="import torch before forking the clients, as ../shared/bench's harness does "
        "(a bigger process takes longer to die)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every sample here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    if args.import_torch:
        import torch  # noqa: F401
    workdir = Path(tempfile.mkdtemp(prefix="wdp-", dir="/tmp"))
    settings: dict[str, str | int | float | bool] = {}
    if args.dumps == "off":
        settings["stack_dumps"] = "off"
    daemon = Watchdogd(workdir / "rt", settings)
    results: list[tuple[int, float]] = []
    missed = 0
    try:
        with daemon:
            for _ in range(args.trials):
                time.sleep(args.pause * rng.uniform(0.5, 1.5))
                got = trial(str(daemon.socket_path), args.delay * rng.uniform(0.8, 1.2))
                if got is None:
                    missed += 1
                else:
                    results.append(got)
            time.sleep(0.3)  # the last events reach the event log
            late = {
                int(e["metadata"]["pid"]): float(e["metadata"]["late_ms"])
                for e in daemon.events("timer_expired")
                if e["metadata"].get("action") == "signalled"
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_ms = [lat * 1000 for _, lat in results]
    daemon_ms = [late[pid] for pid, _ in results if pid in late]
    kernel_ms = [lat * 1000 - late[pid] for pid, lat in results if pid in late]
    forked = "a torch-importing process" if args.import_torch else "a small process"
    print(
        f"expiry -> kill, idle daemon, one client per trial (forks of {forked}), "
        f"stack dumps {args.dumps}"
    )
    print(f"  deadline -> death seen:        {summary(total_ms)}   missed {missed}")
    print(f"  deadline -> signal (daemon):   {summary(daemon_ms)}")
    print(f"  signal -> death seen (kernel): {summary(kernel_ms)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "dumps": args.dumps,
                    "trials": args.trials,
                    "missed": missed,
                    "total_ms": total_ms,
                    "daemon_ms": daemon_ms,
                    "kernel_ms": kernel_ms,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
