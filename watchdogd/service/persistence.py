"""The daemon's timers on disk: rewritten after changes, read back at start.

The snapshot (:mod:`watchdogd.snapshot` has the format) is written by a
task of its own after the table changed, at most every
``snapshot_interval`` and spending at most about a tenth of the loop's
time on it: the chunks are built between other work, never in one stall.
At start, timers come back only for processes that are still the very
ones they were armed for (same pid, same start time); a deadline that
passed meanwhile fires at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import anyio.to_thread

from watchdogd.linux.procs import open_process
from watchdogd.linux.snapshot import (
    SNAPSHOT_NAME,
    SnapshotTimer,
    SnapshotWriter,
    UntrustedSnapshotError,
    read_snapshot,
)

if TYPE_CHECKING:
    from watchdogd.daemon import Daemon

__all__ = ["Persistence"]

log = logging.getLogger("watchdogd")


class Persistence:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.path = daemon.config.state_path() / SNAPSHOT_NAME
        self._dirty = False
        self._dirty_event = anyio.Event()

    def mark_dirty(self) -> None:
        if not self._dirty:  # a plain bool on the hot path; the event only on the edge
            self._dirty = True
            self._dirty_event.set()

    async def run(self) -> None:
        """Rewrite the snapshot after changes, spending at most ~10 % of the loop on it."""
        while True:
            await self._dirty_event.wait()
            self._dirty_event = anyio.Event()
            self._dirty = False
            started = time.monotonic()
            writer = SnapshotWriter(self.path, time.time())
            try:
                for chunk in self._chunks():
                    writer.write(chunk)
                    await anyio.lowlevel.checkpoint()  # requests and expiries in between
                await anyio.to_thread.run_sync(writer.commit)
            except BaseException:
                writer.abort()
                raise
            spent = time.monotonic() - started
            await anyio.sleep(max(self.daemon.config.snapshot_interval, 10 * spent))

    def _chunks(self, size: int = 1000) -> Iterator[list[SnapshotTimer]]:
        now, wall = time.monotonic(), time.time()
        processes = self.daemon.processes
        entries = self.daemon.table.entries()
        for start in range(0, len(entries), size):
            yield [
                SnapshotTimer(
                    t.pid,
                    processes[t.pid].start_time,
                    t.scope_id,
                    wall + (t.deadline - now),
                    t.signal,
                    t.source,
                    t.uid,
                )
                for t in entries[start : start + size]
                if t.live and t.pid in processes
            ]

    def write_now(self) -> None:
        """The final snapshot, on the way out."""
        try:
            writer = SnapshotWriter(self.path, time.time())
            for chunk in self._chunks():
                writer.write(chunk)
            writer.commit()
        except OSError as e:
            log.error("cannot write snapshot %s: %s", self.path, e.strerror)

    def restore(self) -> None:
        """Re-arm the timers of the last run whose processes are still the same ones."""
        daemon = self.daemon
        try:
            snapshot = read_snapshot(self.path)
        except UntrustedSnapshotError as e:
            daemon.emit("snapshot_refused", path=str(self.path), reason=str(e))
            return
        if snapshot is None:
            return
        header, saved_timers = snapshot
        now, wall = time.monotonic(), time.time()
        gone = 0
        for saved in saved_timers:
            handle = daemon.processes.get(saved.pid)
            if handle is None:
                try:
                    handle = open_process(saved.pid)
                except (ProcessLookupError, OSError):
                    gone += 1
                    continue
                if handle.start_time != saved.start_time:
                    handle.close()  # the pid now names another process
                    gone += 1
                    continue
                daemon.watch_process(handle)
            deadline = now + (saved.expiration_time - wall)
            daemon.table.arm(
                saved.pid, saved.scope_id, deadline, saved.signal, saved.source, saved.uid
            )
        daemon.counts["dropped"] += gone
        self.mark_dirty()
        daemon.emit(
            "snapshot_restored",
            path=str(self.path),
            timers=len(daemon.table),
            dropped=gone,
            age_s=round(wall - header.written_at, 3),
        )
