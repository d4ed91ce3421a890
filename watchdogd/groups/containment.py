"""Nothing outlives its attempt: every child in a cell of its own, ended with all it started.

:class:`Containment` is the daemon's, opened at start: a cgroup v2 per
child under a job cgroup of the daemon's own (:mod:`watchdogd.linux.cgroups`)
when the hierarchy may be written, with a keeper process that kills the job
if the daemon dies (:mod:`watchdogd.linux.keeper`); else the weaker
fallback of sessions and ``/proc`` (:mod:`watchdogd.linux.sessions`), with
the daemon as the child subreaper, and ``watchdogctl status`` and the
start-up log say so, and why. Both are a job with one interface
(:class:`~watchdogd.linux.cgroups.JobCgroup`,
:class:`~watchdogd.linux.sessions.SessionJob`): nothing here asks which.
Opening it also ends what a dead daemon left (the job cgroups whose owner
is gone), with a ``stale_cgroups_removed`` event.
Where a memory controller may be written, each cell also has a memory cgroup
(:mod:`watchdogd.groups.cell_memory`): the OOM killer's count, the peak, a
group's ``worker_memory_max``.

Each group has an :class:`AttemptCells` feature: a cell per child (a worker,
a spare), into which the child places itself before user code
(:mod:`watchdogd.linux.enter_cell`). When the child exits its cell is
killed (:meth:`ChildProcess.kill_group`); before the next attempt starts,
and when the group ends, every cell of the last attempt is killed again and
must be empty within :data:`SETTLE_TIMEOUT`, or the group fails naming what
is still alive (an ``attempt_leftovers`` event first). Emptied cells are
removed once the next attempt's workers run: off the restart's path.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from watchdogd.core.ports import EventSink, GroupError
from watchdogd.groups.cell_memory import with_memory
from watchdogd.groups.child import Cell
from watchdogd.groups.features import Feature
from watchdogd.linux import cgroups, memory_cgroups, sessions

__all__ = ["SETTLE_TIMEOUT", "AttemptCells", "Containment"]

log = logging.getLogger("watchdogd.supervisor")

SETTLE_TIMEOUT = 10.0
"""How long an attempt's processes get to be gone once killed (one in D state may not go)."""


class Containment:
    """How this daemon's children are contained: ``cgroup`` or the weaker ``session``."""

    def __init__(
        self,
        job: cgroups.JobCgroup | sessions.SessionJob,
        memory: memory_cgroups.MemoryJob | None = None,
        memory_reason: str = "",
    ) -> None:
        self.job = job
        self.memory = memory
        """Where each cell's memory cgroup is made (None: no memory controller)."""
        self.memory_reason = memory_reason

    @property
    def mode(self) -> str:
        return self.job.mode

    def describe(self) -> str:
        """For ``watchdogctl status`` and the start-up log."""
        memory = self.memory.describe() if self.memory else f"no memory ({self.memory_reason})"
        return f"{self.job.describe()}; {memory}"

    @classmethod
    async def open(cls, events: EventSink, *, cgroups_allowed: bool = True) -> Containment:
        """Sweep what dead daemons left, then take a job cgroup (or say why not)."""
        stale = cgroups.sweep_stale()
        if stale:
            cells = [cgroups.CgroupCell(Path(s.path)) for s in stale]
            with anyio.move_on_after(SETTLE_TIMEOUT):
                await cgroups.until_empty(cells)
            cgroups.remove_stale(stale)
        stale += memory_cgroups.sweep_stale()  # emptied by the v2 kill just now
        if stale:
            events.emit(
                "stale_cgroups_removed",
                cgroups=" ".join(s.path for s in stale),
                owners=" ".join(str(s.owner) for s in stale),
                pids=" ".join(str(pid) for s in stale for pid in s.pids),
            )
        job: cgroups.JobCgroup | sessions.SessionJob
        reason = "process_containment = session"
        if cgroups_allowed:
            try:
                job = cgroups.open_job_cgroup()
            except OSError as e:
                reason = f"cgroup v2 cannot be written: {e.strerror or e}"
            else:
                memory, memory_reason = _memory_job(job.path)
                job.start_keeper(memory.own_dirs() if memory is not None else [])
                return cls(job, memory, memory_reason)
        job = sessions.SessionJob(reason)
        containment = cls(job, *_memory_job(None))
        log.warning("process containment is %s", containment.describe())
        return containment

    def cell(self, name: str, memory_max: int | None = None) -> Cell:
        """A new cell for one child, its memory capped at ``memory_max`` bytes (None: no
        cap; one that cannot be set is an OSError)."""
        cell = self.job.cell(name)
        if self.memory is None:
            return cell
        return with_memory(cell, self.memory, name, memory_max)

    async def settle(self, cells: list[Cell]) -> list[int]:
        """Kill every process of ``cells`` and wait until none is left (bounded): the pids
        still alive at the bound (empty: all gone)."""
        with anyio.move_on_after(SETTLE_TIMEOUT) as bound:
            await self.job.settle(cells)
        return await self.job.alive(cells) if bound.cancelled_caught else []

    def close(self) -> None:
        """The daemon ended its job itself: the keeper stands down, the job cgroup goes."""
        self.job.close()
        if self.memory is not None:
            self.memory.remove()


def _memory_job(v2_job: Path | None) -> tuple[memory_cgroups.MemoryJob | None, str]:
    """Where cells' memory cgroups go (None, and why not, when none can be written)."""
    try:
        return memory_cgroups.open_memory_job(v2_job), ""
    except OSError as e:
        return None, f"no memory cgroup can be written: {e.strerror or e}"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{pid} ({f.read().strip()})"
    except OSError:
        return str(pid)


class AttemptCells(Feature):
    """A group's cells: the current attempt's; killed and awaited before the next one.

    Each attempt's cells are made ahead, in a thread, once the last attempt's
    workers run (a cgroup's mkdir waits while children move into theirs), and
    the emptied ones removed then: a restart's path makes and removes none.
    """

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
        self._emptied: list[Cell] = []
        self._asked: list[str] = []
        self._ahead: dict[str, Cell] = {}
        self._started = anyio.Event()

    def cell(self, name: str) -> Cell:
        """A new cell for a child of this group (a spare's stays the pool's until it works)."""
        name = f"{self.group}.{name}"
        self._asked.append(name)
        made = self._ahead.pop(name, None)
        return made if made is not None else self.containment.cell(name, self.memory_max)

    def join(self, cell: Cell) -> None:
        """``cell`` holds a worker of the current attempt."""
        self.cells.append(cell)

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._make_ahead)

    async def _make_ahead(self) -> None:
        """Once each attempt's workers run: the cells that the next will ask for."""
        while True:
            await self._started.wait()
            self._started = anyio.Event()
            names = {name for name in self._asked if name not in self._ahead}
            self._asked = []
            self._ahead.update(await anyio.to_thread.run_sync(self._make, names))

    def _make(self, names: set[str]) -> dict[str, Cell]:
        made = {}
        for name in names:
            # One that cannot be made now is made, or fails, on the restart's path.
            with contextlib.suppress(OSError):
                made[name] = self.containment.cell(name, self.memory_max)
        return made

    async def prepare(self) -> None:
        """The last attempt's processes are all gone, or GroupError naming those still alive
        (or saying why ``worker_memory_max`` cannot be honoured)."""
        if self.memory_max is not None and self.containment.memory is None:
            raise GroupError(
                f"group {self.group}: worker_memory_max cannot be set: "
                f"{self.containment.memory_reason}"
            )
        await self._settle("before the next attempt")

    def workers_started(self) -> None:
        emptied, self._emptied = self._emptied, []
        for cell in emptied:
            cell.remove()
        self._started.set()

    async def aclose(self) -> None:
        try:
            await self._settle("at the group's end")
        except GroupError as e:
            log.warning("%s", e)
        unused, self._ahead = list(self._ahead.values()), {}
        for cell in [*self._emptied, *unused]:
            cell.remove()
        self._emptied = []

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
        self._emptied += cells
