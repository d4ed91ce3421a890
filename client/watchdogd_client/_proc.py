"""Reading process identity from ``/proc`` and pidfds: stdlib only, shared with the daemon."""

from __future__ import annotations

import select

__all__ = ["pidfd_exited", "stat_fields"]


def stat_fields(pid: int) -> list[bytes]:
    """``/proc/PID/stat`` from field 3 (state) on; ProcessLookupError if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(b")") + 2 :].split()


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd is readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
