"""The keeper: ends a daemon's job cgroup when the daemon dies without doing so itself.

The parent-death signal reaches only the workers, not what they started
(a data loader, a ``setsid`` daemon). So each daemon with a job cgroup
starts this small process, in a session of its own, outside the job cgroup::

    python -I -S keeper.py DAEMON_PID JOB_CGROUP [MEMORY_JOB]

It holds a pidfd on the daemon and waits. If the daemon exits (an OOM kill,
a scheduler's SIGKILL), it writes ``cgroup.kill`` for the whole job, waits
for the job to empty (bounded), and removes its cgroups, and the v1 memory
cgroups of the same processes (``MEMORY_JOB``, emptied with it). A daemon that
stops as it should says so first by closing the keeper's stdin after a
``stop`` line: the keeper then exits and touches nothing. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time

_EMPTY_TIMEOUT = 10.0


def _remove(path: str) -> None:
    for directory, _, _ in sorted(os.walk(path), key=lambda d: -d[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _populated(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False


def main(argv: list[str]) -> None:
    daemon, job, memory = int(argv[0]), argv[1], argv[2:]
    try:
        pidfd = os.pidfd_open(daemon)
    except ProcessLookupError:
        pidfd = -1
    if pidfd >= 0 and os.getppid() == daemon:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN)
        ready = dict(poller.poll())
        if pidfd not in ready and sys.stdin.readline().strip() == "stop":
            return  # the daemon ended its job itself
    with contextlib.suppress(FileNotFoundError), open(os.path.join(job, "cgroup.kill"), "w") as f:
        f.write("1")
    deadline = time.monotonic() + _EMPTY_TIMEOUT
    while _populated(job) and time.monotonic() < deadline:
        time.sleep(0.01)
    for path in (job, *memory):
        _remove(path)


if __name__ == "__main__":
    main(sys.argv[1:])
