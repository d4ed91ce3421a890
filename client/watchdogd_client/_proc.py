"""Processes by identity: ``/proc`` reads and :class:`PinnedProcess`, stdlib only, shared
with the daemon.

:class:`PinnedProcess` is the one owner of a pidfd, on both sides of the
wire: the local timer server's targets here, and in the daemon its timer
targets, its workers and its spares (which build on it). Modelled on trio's
``Process``: signals go through the pidfd, so they reach this very process
and never a later one that got its number, and :meth:`~PinnedProcess.close`
may be called on every path, as often as it comes.
"""

from __future__ import annotations

import os
import select
import signal as _signal

__all__ = ["PinnedProcess", "pidfd_exited", "stat_fields"]


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


class PinnedProcess:
    """Process ``pid``, held by a pidfd of its own until :meth:`close`.

    ``pidfd``, when given, already pins it and is adopted (closed by
    :meth:`close`); else one is opened (ProcessLookupError if there is no
    such process). Once closed, the process counts as exited: nothing is
    sent to a number that may be someone else's by now.
    """

    __slots__ = ("_pidfd", "pid")

    def __init__(self, pid: int, pidfd: int | None = None) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid) if pidfd is None else pidfd

    @property
    def pidfd(self) -> int:
        """The descriptor, while open (-1 once closed): to watch, never to close."""
        return self._pidfd

    def exited(self) -> bool:
        """Whether it has exited (a closed handle says so: it was seen to)."""
        return self._pidfd < 0 or pidfd_exited(self._pidfd)

    def send_signal(self, signal: int) -> None:
        """Signal this very process; ProcessLookupError once it has exited or is closed."""
        if self._pidfd < 0:
            raise ProcessLookupError(self.pid)
        _signal.pidfd_send_signal(self._pidfd, signal)

    def close(self) -> None:
        """Let the pidfd go; safe to call again."""
        pidfd, self._pidfd = self._pidfd, -1
        if pidfd >= 0:
            os.close(pidfd)

    def __repr__(self) -> str:
        state = "closed" if self._pidfd < 0 else f"pidfd {self._pidfd}"
        return f"<{type(self).__name__} pid {self.pid}, {state}>"
