"""The weaker containment, where cgroup v2 cannot be written: sessions and ``/proc``.

Each child leads a session of its own. Ending it is ``killpg`` plus a sweep
of ``/proc`` for every process of its session and every descendant of
either, each matched by its start time (never one that merely got a
recycled number) and signalled through a pidfd. The daemon makes itself a
child subreaper (``PR_SET_CHILD_SUBREAPER``), so a descendant whose parent
exits is re-parented to the daemon rather than to init, and an attempt's
end sweeps those too (:func:`adopted`).

What it cannot catch: a process that left the session *and* whose parent
chain no longer leads to the child or to the daemon — one re-parented to a
subreaper of its own making (a container's init), or started for it by
another daemon (systemd-run, a container runtime); and a process forked
between the sweep's read of ``/proc`` and its signal (the sweep repeats
until it finds nothing, which narrows that window, not closes it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

from watchdogd.linux.procs import read_stat
from watchdogd_client._proc import PinnedProcess, stat_fields

__all__ = ["SessionCell", "adopted", "become_subreaper", "kill_matched", "reap"]

_PR_SET_CHILD_SUBREAPER = 36
_SWEEPS = 5


def become_subreaper() -> None:
    """Orphaned descendants come to this process, not to init (OSError if refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _table() -> dict[int, tuple[int, int, int]]:
    """Every process: pid -> (ppid, session, start time)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(ProcessLookupError, IndexError, ValueError):
                fields = stat_fields(int(entry))
                table[int(entry)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def _tree(table: dict[int, tuple[int, int, int]], roots: set[int]) -> set[int]:
    """``roots`` and every descendant of theirs in ``table``."""
    found = set(roots)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _) in table.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def kill_matched(pids: dict[int, int]) -> None:
    """SIGKILL each ``pid: start_time`` that is still that very process, through a pidfd."""
    for pid, start in pids.items():
        try:
            pinned = PinnedProcess(pid)
        except OSError:
            continue
        try:
            if read_stat(pid).start_time == start:
                pinned.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            pinned.close()


def reap(pids: list[int]) -> None:
    """Collect those of ``pids`` that are this process's children and have exited."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


_own_children: set[int] = set()
"""Children this process started for itself in sessions of their own (a torch
helper): what ``adopted`` must never take for a worker's orphan."""


def started_own(pid: int) -> None:
    """``pid`` is a child this process started for itself, not for a job."""
    _own_children.add(pid)


def ended_own(pid: int) -> None:
    _own_children.discard(pid)


def adopted(known: set[int]) -> dict[int, int]:
    """This process's children that it did not start (``known``, or for itself) and that
    are not of its session (a forkserver), and what they started: the re-parented
    descendants of children that exited."""
    table = _table()
    me, session = os.getpid(), os.getsid(0)
    orphans = {
        pid
        for pid, (ppid, sid, _) in table.items()
        if ppid == me and pid not in known and pid not in _own_children and sid != session
    }
    return {pid: table[pid][2] for pid in _tree(table, orphans)}


class SessionCell:
    """One child's session and its descendants, found in ``/proc``."""

    procs: tuple[str, ...] = ()
    memory = None  # none of its own: groups.cell_memory adds one

    def __init__(self, known: set[int]) -> None:
        self.known = known
        self.leader: tuple[int, int] | None = None

    def bind(self, pid: int) -> None:
        """The child is ``pid``: it joins ``known``, the children the daemon started."""
        self.known.add(pid)
        with contextlib.suppress(ProcessLookupError):
            self.leader = (pid, read_stat(pid).start_time)

    def _members(self) -> dict[int, int]:
        if self.leader is None:
            return {}
        leader, since = self.leader
        table = _table()
        roots = {
            pid
            for pid, (_, session, start) in table.items()
            if (session == leader and start >= since) or (pid == leader and start == since)
        }
        members = _tree(table, roots)
        return {pid: table[pid][2] for pid in members if pid in table}

    def kill(self) -> None:
        if self.leader is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.leader[0], signal.SIGKILL)
        for _ in range(_SWEEPS):
            members = self._members()
            members.pop(self.leader[0], None)  # the leader: its own pidfd's, and reaped
            if not members:
                return
            kill_matched(members)

    def alive(self) -> list[int]:
        """Its processes still running (a zombie counts as gone)."""
        alive = []
        for pid in self._members():
            with contextlib.suppress(ProcessLookupError):
                if read_stat(pid).state not in ("Z", "X"):
                    alive.append(pid)
        return alive

    def remove(self) -> None:
        if self.leader is not None:
            self.known.discard(self.leader[0])
