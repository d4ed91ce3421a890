"""A child the daemon started (a worker, a spare): pinned by its pidfd, watched from the loop.

Every child starts in a session of its own, so :meth:`ChildProcess.send_signal`
reaches its whole process group (data loaders, compilers), and
:meth:`~ChildProcess.kill_group` ends what it left there: called before
the exited child is reaped, while the zombie keeps that group id from being
reused. The pidfd has one owner, the child's
:class:`~watchdogd_client._proc.PinnedProcess`; :meth:`~ChildProcess.close`
stops watching it and lets it go, once, on every path — even when the
loop refuses the unwatch. The child's :class:`Cell` (its cgroup, or its
session in the fallback; :mod:`watchdogd.groups.containment`) holds all it
starts: :meth:`~ChildProcess.kill_group` ends them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import Protocol

from watchdogd.linux import aio
from watchdogd.linux.memory_cgroups import Memory
from watchdogd_client._proc import PinnedProcess

__all__ = ["Cell", "ChildProcess", "WorkerProcess"]


class Cell(Protocol):
    """Where one child and all it starts run: a cgroup, or a session found in ``/proc``."""

    procs: tuple[str, ...]
    """The ``cgroup.procs`` files the child writes ``0`` to before user code, in order
    (its v2 cgroup's, then a v1 memory cgroup's; none: no cgroup)."""

    @property
    def memory(self) -> Memory | None:
        """Its memory cgroup: the OOM killer's count, its peak (None: no memory controller)."""

    def bind(self, pid: int) -> None:
        """The child is ``pid``."""

    def kill(self) -> None:
        """SIGKILL everything in it."""

    def alive(self) -> list[int]:
        """The pids still running in it."""
        ...

    def remove(self) -> None:
        """Let it go, once empty."""


class WorkerProcess(Protocol):
    """How a child was started: ``subprocess.Popen`` is one."""

    @property
    def pid(self) -> int: ...

    def wait(self) -> int:
        """Its exit status, once its pidfd said it exited (negative: the signal)."""
        ...

    def poll(self) -> int | None: ...


class ChildProcess:
    """``process``, started by this daemon in a session of its own, pinned from now on."""

    def __init__(self, process: WorkerProcess, cell: Cell | None = None) -> None:
        self.process = process
        self.pid = process.pid
        self.pinned = PinnedProcess(process.pid)
        self.cell = cell
        if cell is not None:
            cell.bind(process.pid)
        self.returncode: int | None = None
        self._watched = False

    @property
    def pidfd(self) -> int:
        return self.pinned.pidfd

    def watch(self, on_exit: Callable[[], None]) -> None:
        """Call ``on_exit()`` from the loop once it has exited (until :meth:`unwatch`)."""
        aio.watch_readable(self.pinned.pidfd, on_exit)
        self._watched = True

    def unwatch(self) -> None:
        if self._watched:
            self._watched = False
            with contextlib.suppress(ValueError, OSError):
                aio.unwatch(self.pinned.pidfd)

    def exited(self) -> bool:
        """Gone, or going: reaped, closed, or its pidfd says so (its exit is being handled)."""
        return self.returncode is not None or self.pinned.exited()

    def send_signal(self, signum: int) -> None:
        """``signum`` to its process group while it runs; nothing once it has exited."""
        if self.exited():
            return
        # Alive, so its pid names its process group once it leads one; a callable's
        # worker makes its own as it starts: before that, only the pidfd reaches it.
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                self.pinned.send_signal(signum)

    def kill_group(self) -> None:
        """SIGKILL its process group and its cell, exited or not: what it left there,
        before it is reaped."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.cell is not None:
            self.cell.kill()

    def wait(self) -> int:
        """Close, and collect its exit status: once its pidfd said it exited, this never blocks."""
        self.close()
        self.returncode = self.process.wait()
        return self.returncode

    def let_go(self) -> int | None:
        """Close, and collect its exit status if it has one: never waits, so one that
        SIGKILL could not end (stuck in uninterruptible sleep) is left to the kernel
        rather than hang the loop."""
        self.close()
        self.returncode = self.process.poll()
        return self.returncode

    def close(self) -> None:
        """Stop watching and let the pidfd go; safe to call again."""
        try:
            self.unwatch()
        finally:
            self.pinned.close()
