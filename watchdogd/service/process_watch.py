"""The processes the daemon holds timers or stack-dump files for, pinned by pidfds.

A process is watched from its first timer (or dump registration) until it
exits: its pidfd becoming readable is the exit, learned from the event loop
with no polling. Whoever must forget a process then (the timer core drops
its timers, the reaper its dump file, the scope recorder its pid-keyed
statistics) registers an exit observer; the watch names none of them.

Rules
-----
- One handle per pid; the handle owns its pidfd and is closed exactly once,
  at the exit or at :meth:`ProcessWatch.close`.
- A pid the watch holds is the very process that was pinned: a reused
  number is another process, which :func:`open_process` pins afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from watchdogd.linux import aio
from watchdogd.linux.procs import ProcessHandle, open_process

__all__ = ["ExitObserver", "ProcessWatch"]

ExitObserver = Callable[[ProcessHandle], None]
"""Called once a watched process exited, after it left the watch (its handle still open)."""


class ProcessWatch:
    """Pinned processes by pid, and by owner uid (a peer's queries walk its own only)."""

    def __init__(self) -> None:
        self._handles: dict[int, ProcessHandle] = {}
        self._pids_of: dict[int, set[int]] = {}
        self._on_exit: list[ExitObserver] = []

    def __len__(self) -> int:
        return len(self._handles)

    def on_exit(self, observer: ExitObserver) -> None:
        self._on_exit.append(observer)

    def process(self, pid: int) -> ProcessHandle | None:
        """The watched process ``pid`` (the reaper's port)."""
        return self._handles.get(pid)

    @staticmethod
    def open(pid: int) -> ProcessHandle:
        """Pin ``pid`` by a pidfd, not yet watched (ProcessLookupError: it is gone)."""
        return open_process(pid)

    def pin(self, pid: int) -> ProcessHandle | None:
        """The watched process ``pid``, watching it now if it is not yet; None if it is gone."""
        handle = self._handles.get(pid)
        if handle is None:
            try:
                handle = self.open(pid)
            except (ProcessLookupError, OSError):
                return None
            self.watch(handle)
        return handle

    def pids_of(self, uid: int) -> Iterator[int]:
        yield from self._pids_of.get(uid, ())

    def owner(self, pid: int) -> int:
        """The uid that owns watched ``pid``; -1 if it is not watched."""
        handle = self._handles.get(pid)
        return -1 if handle is None else handle.uid

    def start_time(self, pid: int) -> int | None:
        handle = self._handles.get(pid)
        return None if handle is None else handle.start_time

    def watch(self, handle: ProcessHandle) -> None:
        self._handles[handle.pid] = handle
        self._pids_of.setdefault(handle.uid, set()).add(handle.pid)
        aio.watch_readable(handle.pidfd, lambda: self._exited(handle))

    def _exited(self, handle: ProcessHandle) -> None:
        aio.unwatch(handle.pidfd)
        try:
            if self._handles.get(handle.pid) is handle:
                del self._handles[handle.pid]
                owned = self._pids_of[handle.uid]
                owned.discard(handle.pid)
                if not owned:
                    del self._pids_of[handle.uid]
            for observer in self._on_exit:
                observer(handle)
        finally:
            handle.close()

    def close(self) -> None:
        """Stop watching every process and close their pidfds (the daemon is stopping)."""
        for handle in self._handles.values():
            with contextlib.suppress(ValueError, OSError):
                aio.unwatch(handle.pidfd)
            handle.close()
        self._handles.clear()
        self._pids_of.clear()
