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

A child's exit sweeps once, from the event loop; waiting for an attempt to
be gone (:meth:`SessionJob.settle`) sweeps every 5 ms in a worker thread,
each pass from one read of ``/proc``, until a pass finds nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import anyio
import anyio.to_thread

from watchdogd.linux.enter_cell import PR_SET_CHILD_SUBREAPER, prctl
from watchdogd.linux.procs import read_stat, still_runs
from watchdogd_client._proc import PinnedProcess, stat_fields

__all__ = ["SessionCell", "SessionJob", "adopted", "kill_matched", "reap"]

_POLL = 0.005
"""Between sweeps while an attempt's processes go: no event says a session emptied."""


class _Proc(NamedTuple):
    ppid: int
    session: int
    start_time: int
    running: bool
    """Not a zombie."""


_Table = dict[int, _Proc]


def _table() -> _Table:
    """Every process, read from ``/proc`` once."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(ProcessLookupError, IndexError, ValueError):
                fields = stat_fields(int(entry))
                running = fields[0] not in (b"Z", b"X")
                table[int(entry)] = _Proc(int(fields[1]), int(fields[3]), int(fields[19]), running)
    return table


def _tree(table: _Table, roots: set[int]) -> set[int]:
    """``roots`` and every descendant of theirs in ``table``."""
    found = set(roots)
    grew = True
    while grew:
        more = {pid for pid, proc in table.items() if proc.ppid in found} - found
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
            # Read once pinned: the pidfd is on the process that started then.
            if still_runs(pid, start):
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


def adopted(known: set[int], table: _Table | None = None) -> dict[int, int]:
    """This process's children that it did not start (``known``, or for itself) and that
    are not of its session (a forkserver), and what they started: the re-parented
    descendants of children that exited (``pid: start_time``; from ``table``, or
    ``/proc`` read now)."""
    table = _table() if table is None else table
    me, session = os.getpid(), os.getsid(0)
    orphans = {
        pid
        for pid, proc in table.items()
        if proc.ppid == me
        and pid not in known
        and pid not in _own_children
        and proc.session != session
    }
    return {pid: table[pid].start_time for pid in _tree(table, orphans)}


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

    def members(self, table: _Table) -> dict[int, int]:
        """Its processes in ``table`` (``pid: start_time``), the leader too."""
        if self.leader is None:
            return {}
        leader, since = self.leader
        roots = {
            pid
            for pid, proc in table.items()
            if (proc.session == leader and proc.start_time >= since)
            or (pid == leader and proc.start_time == since)
        }
        return {pid: table[pid].start_time for pid in _tree(table, roots)}

    def killpg(self) -> None:
        """SIGKILL its process group (nothing once the leader is reaped)."""
        if self.leader is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.leader[0], signal.SIGKILL)

    def kill(self) -> None:
        """``killpg``, then one sweep of ``/proc`` for what is left."""
        if self.leader is None:
            return
        self.killpg()
        members = self.members(_table())
        members.pop(self.leader[0], None)  # the leader: its own pidfd's, and reaped
        kill_matched(members)

    def alive(self) -> list[int]:
        """Its processes still running (a zombie counts as gone)."""
        table = _table()
        return [pid for pid in self.members(table) if table[pid].running]

    def remove(self) -> None:
        if self.leader is not None:
            self.known.discard(self.leader[0])


class Cell(Protocol):
    """A cell as :class:`SessionJob` is handed it back (``groups.child.Cell``)."""

    def kill(self) -> None: ...

    def alive(self) -> list[int]: ...


class SessionJob:
    """The fallback's job: sessions and ``/proc``, with this process as child subreaper."""

    mode = "session"

    def __init__(self, reason: str) -> None:
        """OSError if this process cannot be made the child subreaper."""
        self.reason = reason
        self.known: set[int] = set()
        """The children this process started as workers and spares (the orphan sweep
        leaves them to their owners)."""
        prctl(PR_SET_CHILD_SUBREAPER, 1)

    def describe(self) -> str:
        return f"weaker: sessions and /proc, no cgroup ({self.reason})"

    def cell(self, name: str) -> SessionCell:
        return SessionCell(self.known)

    async def settle(self, cells: Sequence[Cell]) -> None:
        """Kill every process of ``cells`` and every orphan adopted since, until a sweep
        finds none running (cancel to bound it)."""
        while True:
            if not await anyio.to_thread.run_sync(self._sweep, cells):
                return
            await anyio.sleep(_POLL)

    async def alive(self, cells: Sequence[Cell]) -> list[int]:
        """The pids still running in ``cells``, and the orphans adopted since."""
        return await anyio.to_thread.run_sync(self._running, cells)

    def close(self) -> None:
        pass

    def _found(self, cells: Sequence[Cell], table: _Table) -> tuple[dict[int, int], dict[int, int]]:
        """What ``table`` holds of ``cells`` (this job's: session cells), and the orphans
        adopted since (``pid: start_time`` each, zombies too)."""
        members: dict[int, int] = {}
        for cell in cells:
            if isinstance(cell, SessionCell):
                members.update(cell.members(table))
        return members, adopted(self.known, table)

    def _sweep(self, cells: Sequence[Cell]) -> bool:
        """One pass (in a thread): kill what it finds; whether any of it ran."""
        table = _table()
        members, orphans = self._found(cells, table)
        for cell in cells:
            if isinstance(cell, SessionCell):
                cell.killpg()
        kill_matched(members | orphans)
        reap(list(orphans))
        return any(table[pid].running for pid in members | orphans)

    def _running(self, cells: Sequence[Cell]) -> list[int]:
        table = _table()
        members, orphans = self._found(cells, table)
        return [pid for pid in members | orphans if table[pid].running]
