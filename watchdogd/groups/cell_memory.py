"""A cell with a memory cgroup: what the OOM killer did in it, its peak, its cap.

:func:`with_memory` gives a child's cell (:class:`~watchdogd.groups.child.Cell`)
the memory cgroup :class:`~watchdogd.linux.memory_cgroups.MemoryJob` makes for
it: the v2 cell itself where v2 has the memory controller, else a v1 memory
cgroup the child enters as well (a second ``cgroup.procs``), removed with the
cell. The cell's kill and its emptiness stay the inner cell's: every process
of one is in the other.

When a worker exits, the runner reads its cell's memory before the cell is
removed (:meth:`~watchdogd.linux.memory_cgroups.Memory.read`); the count of
OOM kills makes the reason (:func:`~watchdogd.groups.workers.describe_exit`).
"""

from __future__ import annotations

from watchdogd.groups.child import Cell
from watchdogd.linux.cgroups import CgroupCell
from watchdogd.linux.memory_cgroups import Memory, MemoryJob

__all__ = ["MeteredCell", "with_memory"]


class MeteredCell:
    """``inner``, and ``memory``: entered together, removed together."""

    def __init__(self, inner: Cell, memory: Memory) -> None:
        self.inner = inner
        self.memory = memory
        self.procs = inner.procs + memory.procs

    def bind(self, pid: int) -> None:
        self.inner.bind(pid)

    def kill(self) -> None:
        """The inner cell's kill (a v1 memory cgroup has no ``cgroup.kill``)."""
        self.inner.kill()

    def alive(self) -> list[int]:
        return self.inner.alive()

    def remove(self) -> None:
        """Both rmdirs, the v1 one after the v2 one: through the v2 job's writer thread
        where there is one, since an rmdir waits for ``cgroup_mutex``, which a child
        moving into its cell holds through a grace period (a restart's first placement)."""
        self.inner.remove()
        if isinstance(self.inner, CgroupCell):
            self.inner.write(self.memory.remove)
        else:
            self.memory.remove()


def with_memory(cell: Cell, job: MemoryJob, name: str, limit: int | None) -> MeteredCell:
    """``cell`` with a memory cgroup from ``job``, capped at ``limit`` bytes (None: no
    cap); OSError, and ``cell`` removed, when it cannot be made."""
    try:
        v2_dir = cell.path if isinstance(cell, CgroupCell) else None
        return MeteredCell(cell, job.cell(name, v2_dir, limit))
    except OSError:
        cell.remove()
        raise
