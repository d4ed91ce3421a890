"""The daemon's timers on disk: rewritten after changes, read back at start.

The snapshot (:mod:`watchdogd.linux.snapshot` has the format) is written
by a task of its own after the table changed, at most every
``snapshot_interval`` and spending at most about a tenth of the loop's
time on it: the chunks are taken from the table between other work, and
every write, the fsync and the rename run in a worker thread.
At start, timers come back only for processes that are still the very
ones they were armed for (same pid, same start time); a deadline that
passed meanwhile fires at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import anyio
import anyio.to_thread

from watchdogd.core.config import PersistenceSettings
from watchdogd.core.ports import EventSink
from watchdogd.linux.snapshot import (
    SNAPSHOT_NAME,
    SnapshotTimer,
    SnapshotWriter,
    UntrustedSnapshotError,
    read_snapshot,
)
from watchdogd.service.stats import Stats

__all__ = ["Persistence", "TimerStore"]

log = logging.getLogger("watchdogd")


class TimerStore(Protocol):
    """What persistence reads and restores: the timer service."""

    def __len__(self) -> int: ...

    async def wait_changed(self) -> None: ...

    def snapshot_timers(self) -> Iterator[list[SnapshotTimer]]: ...

    def restore_timer(self, saved: SnapshotTimer, now: float, wall: float) -> bool: ...


class Persistence:
    def __init__(
        self,
        state_dir: Path,
        store: TimerStore,
        *,
        events: EventSink,
        stats: Stats,
        settings: PersistenceSettings,
    ) -> None:
        self.path = state_dir / SNAPSHOT_NAME
        self.store = store
        self.events = events
        self.stats = stats
        self.settings = settings

    def reconfigure(self, settings: PersistenceSettings) -> None:
        """A reloaded interval, from the next snapshot on (its place is kept until a restart)."""
        self.settings = settings

    async def run(self) -> None:
        """Rewrite the snapshot after changes, spending at most ~10 % of the loop on it."""
        while True:
            await self.store.wait_changed()
            started = time.monotonic()
            # Every file operation in a worker thread: a slow or hung disk (a
            # network filesystem) delays the snapshot, never the loop.
            writer = await anyio.to_thread.run_sync(SnapshotWriter, self.path, time.time())
            try:
                for chunk in self.store.snapshot_timers():
                    await anyio.to_thread.run_sync(writer.write, chunk)
                await anyio.to_thread.run_sync(writer.commit)
            except BaseException:
                writer.abort()
                raise
            spent = time.monotonic() - started
            await anyio.sleep(max(self.settings.interval, 10 * spent))

    def write_now(self) -> None:
        """The final snapshot, on the way out."""
        try:
            writer = SnapshotWriter(self.path, time.time())
            for chunk in self.store.snapshot_timers():
                writer.write(chunk)
            writer.commit()
        except OSError as e:
            log.error("cannot write snapshot %s: %s", self.path, e.strerror)

    def restore(self) -> None:
        """Re-arm the timers of the last run whose processes are still the same ones."""
        try:
            snapshot = read_snapshot(self.path)
        except UntrustedSnapshotError as e:
            self.events.emit("snapshot_refused", path=str(self.path), reason=str(e))
            return
        if snapshot is None:
            return
        header, saved_timers = snapshot
        now, wall = time.monotonic(), time.time()
        gone = sum(not self.store.restore_timer(saved, now, wall) for saved in saved_timers)
        self.stats.dropped += gone
        self.events.emit(
            "snapshot_restored",
            path=str(self.path),
            timers=len(self.store),
            dropped=gone,
            age_s=round(wall - header.written_at, 3),
        )
