"""Nothing outlives its attempt: every child in a cell of its own, ended with all it started.

:class:`Containment` is the daemon's, opened at start: a cgroup v2 per
child under a job cgroup of the daemon's own (:mod:`watchdogd.linux.cgroups`)
when the hierarchy may be written, with a keeper process that kills the job
if the daemon dies (:mod:`watchdogd.linux.keeper`); else the weaker
fallback of sessions and ``/proc`` (:mod:`watchdogd.linux.sessions`), with
the daemon as the child subreaper, and ``watchdogctl status`` and the
start-up log say so, and why. Opening it also ends what a dead daemon left
(the job cgroups whose owner is gone), with a ``stale_cgroups_removed`` event.
Where a memory controller may be written, each cell also has a memory cgroup
(:mod:`watchdogd.groups.cell_memory`): the OOM killer's count, the peak, a
group's ``worker_memory_max``.

Each group has an :class:`AttemptCells` feature: a cell per child (a worker,
a spare), into which the child places itself before user code
(:mod:`watchdogd.linux.enter_cell`). When the child exits its cell is
killed (:meth:`ChildProcess.kill_group`); before the next attempt starts,
and when the group ends, every cell of the last attempt is killed again and
must be empty within :data:`SETTLE_TIMEOUT`, or the group fails naming what
is still alive (an ``attempt_leftovers`` event first).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio

from watchdogd.core.ports import EventSink, GroupError
from watchdogd.groups.cell_memory import with_memory
from watchdogd.groups.child import Cell
from watchdogd.groups.features import Feature
from watchdogd.linux import cgroups, keeper, memory_cgroups, sessions
from watchdogd.linux.procs import read_stat

__all__ = ["SETTLE_TIMEOUT", "AttemptCells", "Containment"]

log = logging.getLogger("watchdogd.supervisor")

SETTLE_TIMEOUT = 10.0
"""How long an attempt's processes get to be gone once killed (one in D state may not go)."""

_POLL = 0.005


class Containment:
    """How this daemon's children are contained: ``cgroup`` or the weaker ``session``."""

    def __init__(
        self,
        job: cgroups.JobCgroup | None,
        reason: str,
        memory: memory_cgroups.MemoryJob | None = None,
        memory_reason: str = "",
    ) -> None:
        self.job = job
        self.reason = reason
        self.memory = memory
        """Where each cell's memory cgroup is made (None: no memory controller)."""
        self.memory_reason = memory_reason
        self.parent = os.getpid()
        self.known: set[int] = set()
        """The children this daemon started as workers and spares (the fallback's sweep
        leaves them to their owners)."""
        self._keeper: subprocess.Popen[bytes] | None = None

    @property
    def mode(self) -> str:
        return "cgroup" if self.job is not None else "session"

    def describe(self) -> str:
        """For ``watchdogctl status`` and the start-up log."""
        memory = self.memory.describe() if self.memory else f"no memory ({self.memory_reason})"
        if self.job is not None:
            return f"cgroup v2 per worker, under {self.job.path}; {memory}"
        return f"weaker: sessions and /proc, no cgroup ({self.reason}); {memory}"

    @classmethod
    async def open(cls, events: EventSink, *, cgroups_allowed: bool = True) -> Containment:
        """Sweep what dead daemons left, then take a job cgroup (or say why not)."""
        stale = cgroups.sweep_stale()
        if stale:
            cells = [cgroups.CgroupCell(Path(s.path)) for s in stale]
            await _until_gone(lambda: [pid for cell in cells for pid in cell.alive()])
            cgroups.remove_stale(stale)
        stale += memory_cgroups.sweep_stale()  # emptied by the v2 kill just now
        if stale:
            events.emit(
                "stale_cgroups_removed",
                cgroups=" ".join(s.path for s in stale),
                owners=" ".join(str(s.owner) for s in stale),
                pids=" ".join(str(pid) for s in stale for pid in s.pids),
            )
        job, reason = None, "process_containment = session"
        if cgroups_allowed:
            try:
                job = cgroups.open_job_cgroup()
            except OSError as e:
                reason = f"cgroup v2 cannot be written: {e.strerror or e}"
        memory, memory_reason = None, ""
        try:
            memory = memory_cgroups.open_memory_job(job.path if job is not None else None)
        except OSError as e:
            memory_reason = f"no memory cgroup can be written: {e.strerror or e}"
        containment = cls(job, reason, memory, memory_reason)
        if job is None:
            sessions.become_subreaper()
            log.warning("process containment is %s", containment.describe())
        else:
            containment._start_keeper()
        return containment

    def _start_keeper(self) -> None:
        assert self.job is not None
        jobs = [str(self.job.path)]
        if self.memory is not None:
            jobs += [str(path) for path in self.memory.own_dirs()]
        self._keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", keeper.__file__, str(self.parent), *jobs],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def cell(self, name: str, memory_max: int | None = None) -> Cell:
        """A new cell for one child, its memory capped at ``memory_max`` bytes (None: no
        cap; one that cannot be set is an OSError)."""
        cell = sessions.SessionCell(self.known) if self.job is None else self.job.cell(name)
        if self.memory is None:
            return cell
        return with_memory(cell, self.memory, name, memory_max)

    def leftovers(self, cells: list[Cell]) -> list[int]:
        """Kill what is left in ``cells`` (and, in the fallback, orphans adopted since the
        attempt began); the pids still alive."""
        for cell in cells:
            cell.kill()
        alive = [pid for cell in cells for pid in cell.alive()]
        if self.job is None:
            orphans = sessions.adopted(self.known)
            sessions.kill_matched(orphans)
            sessions.reap(list(orphans))
            alive += [pid for pid in orphans if _running(pid)]
        return alive

    async def settle(self, cells: list[Cell]) -> list[int]:
        """Kill every process of ``cells`` and wait until none is left (bounded): the pids
        still alive at the bound (empty: all gone; the cells are removed)."""
        alive = await _until_gone(partial(self.leftovers, cells))
        if not alive:
            for cell in cells:
                cell.remove()
        return alive

    def close(self) -> None:
        """The daemon ended its job itself: the keeper stands down, the job cgroup goes."""
        if self._keeper is not None and self._keeper.stdin is not None:
            try:
                self._keeper.stdin.write(b"stop\n")
                self._keeper.stdin.close()
            except OSError:
                pass
            self._keeper.wait()
        if self.job is not None:
            self.job.remove()
        if self.memory is not None:
            self.memory.remove()


async def _until_gone(alive: Callable[[], list[int]]) -> list[int]:
    """Poll ``alive()`` until it is empty or :data:`SETTLE_TIMEOUT` passed; its last answer.

    ``cgroup.events`` announces a change through inotify only, which the
    standard library lacks: a kill takes a few milliseconds, polled at 5 ms.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT
    left = alive()
    while left and time.monotonic() < deadline:
        await anyio.sleep(_POLL)
        left = alive()
    return left


def _running(pid: int) -> bool:
    try:
        return read_stat(pid).state not in ("Z", "X")
    except ProcessLookupError:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{pid} ({f.read().strip()})"
    except OSError:
        return str(pid)


class AttemptCells(Feature):
    """A group's cells: the current attempt's; killed and awaited before the next one."""

    def __init__(
        self,
        containment: Containment,
        group: str,
        events: EventSink,
        memory_max: int | None = None,
    ) -> None:
        """``memory_max``: each child's memory cap, in bytes (the spec's ``worker_memory_max``)."""
        self.containment = containment
        self.group = group
        self.events = events
        self.memory_max = memory_max
        self.cells: list[Cell] = []

    def cell(self, name: str) -> Cell:
        """A new cell for a child of this group (a spare's stays the pool's until it works)."""
        return self.containment.cell(f"{self.group}.{name}", self.memory_max)

    def join(self, cell: Cell) -> None:
        """``cell`` holds a worker of the current attempt."""
        self.cells.append(cell)

    async def prepare(self) -> None:
        """The last attempt's processes are all gone, or GroupError naming those still alive
        (or saying why ``worker_memory_max`` cannot be honoured)."""
        if self.memory_max is not None and self.containment.memory is None:
            raise GroupError(
                f"group {self.group}: worker_memory_max cannot be set: "
                f"{self.containment.memory_reason}"
            )
        await self._settle("before the next attempt")

    async def aclose(self) -> None:
        try:
            await self._settle("at the group's end")
        except GroupError as e:
            log.warning("%s", e)

    async def _settle(self, when: str) -> None:
        cells, self.cells = self.cells, []
        alive = await self.containment.settle(cells)
        if alive:
            self.cells = cells  # tried again, and swept with the job
            names = ", ".join(_comm(pid) for pid in alive)
            self.events.emit("attempt_leftovers", group=self.group, alive=names, when=when)
            raise GroupError(
                f"group {self.group}: still alive {SETTLE_TIMEOUT:.0f} s after the kill "
                f"{when}: {names}"
            )
