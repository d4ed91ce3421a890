"""What jobs learned, kept across runs: one JSON file per ``job_key``.

A learner of a group with a ``job_key`` asks for that key's file when it is
created (:attr:`LearnedDeadlines.to_load`); this task reads it at once, in
a worker thread, and seeds the learners, well before the run has the
samples that would let a seed count. What the run learns is written back, atomically
and off the loop, at most every ``interval`` seconds while it changes, and
once more when the daemon stops. A file that is not ours alone (another
owner, writable by others, a symlink) or does not decode is reported and
ignored: the run learns from scratch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import anyio
import anyio.to_thread
import msgspec

from watchdogd.core.config import LearnedSettings
from watchdogd.core.learned import LearnedDeadlines, SavedJob
from watchdogd.core.ports import EventSink
from watchdogd.linux.snapshot import UntrustedSnapshotError, read_own_file, write_atomically

__all__ = ["LearnedStore"]

log = logging.getLogger("watchdogd")

FORMAT_VERSION = 1

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SavedJob)


class LearnedSource(Protocol):
    """What the store reads and seeds: the timer service."""

    learned: LearnedDeadlines

    async def wait_load_wanted(self) -> None: ...


class LearnedStore:
    def __init__(
        self,
        settings: LearnedSettings,
        source: LearnedSource,
        *,
        events: EventSink,
        interval: float,
    ) -> None:
        self.directory = settings.directory
        self.source = source
        self.learned = source.learned
        self.events = events
        self.interval = interval

    def reconfigure(self, settings: LearnedSettings) -> None:
        """A reloaded directory: jobs load from and save to it from now on."""
        self.directory = settings.directory

    def path(self, job_key: str) -> Path:
        return self.directory / f"{job_key}.json"

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._load_when_wanted)
            while True:
                await anyio.sleep(self.interval)
                for job_key, data in self._take_dirty():
                    if not await anyio.to_thread.run_sync(self._write, job_key, data):
                        self.learned.dirty.add(job_key)  # again next time

    async def _load_when_wanted(self) -> None:
        while True:
            await self.source.wait_load_wanted()
            for job_key in sorted(self.learned.to_load):
                read = await anyio.to_thread.run_sync(self._read, job_key)
                self._loaded(job_key, read)

    def write_now(self) -> None:
        """The last save, on the way out."""
        for job_key, data in self._take_dirty():
            self._write(job_key, data)

    def _take_dirty(self) -> list[tuple[str, bytes]]:
        learned = self.learned
        dirty, learned.dirty = learned.dirty, set()
        now = time.time()
        return [
            (key, _encoder.encode(SavedJob(FORMAT_VERSION, key, now, learned.saved(key))))
            for key in sorted(dirty)
        ]

    def _loaded(self, job_key: str, read: SavedJob | str | None) -> None:
        path = str(self.path(job_key))
        if isinstance(read, str):
            self.events.emit("learned_refused", job_key=job_key, path=path, reason=read)
            read = None
        elif read is not None:
            self.events.emit("learned_loaded", job_key=job_key, path=path, scopes=len(read.scopes))
        self.learned.loaded(job_key, read)

    def _read(self, job_key: str) -> SavedJob | str | None:
        """What was saved under ``job_key``: None if nothing, why not if unusable."""
        try:
            data = read_own_file(self.path(job_key))
            if data is None:
                return None
            saved = _decoder.decode(data)
        except (UntrustedSnapshotError, msgspec.DecodeError) as e:
            return str(e)
        except OSError as e:
            return e.strerror or type(e).__name__
        if saved.version != FORMAT_VERSION or saved.job_key != job_key:
            return f"version {saved.version} of job {saved.job_key!r}, not this one's"
        return saved

    def _write(self, job_key: str, data: bytes) -> bool:
        path = self.path(job_key)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as e:
            log.error("cannot save learned deadlines to %s: %s", path, e.strerror)
            return False
        return True
