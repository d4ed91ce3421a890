"""GPU information for ``status``, read off the event loop and cached.

NVML can take a second or more to initialise (GPUs without persistence
mode) and can hang on a sick GPU, while the loop fires every deadline on
the node. So ``status`` answers at once from the last reading; a reading
older than ``max_age`` starts a new one in a worker thread, at most one at
a time, given up after ``timeout`` (the thread is left to finish on its own,
and no other starts until it has).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import anyio
import anyio.abc
import anyio.to_thread

from watchdogd.linux.gpus import read_gpus
from watchdogd_client.protocol import GpuInfo

__all__ = ["GpuStatus"]

Workers = dict[int, tuple[str, int]]
Reader = Callable[[Workers], tuple[list[GpuInfo], str | None]]


class GpuStatus:
    def __init__(self, read: Reader = read_gpus, *, max_age: float = 5.0, timeout: float = 10.0):
        self._read = read
        self.max_age = max_age
        self.timeout = timeout
        self._gpus: list[GpuInfo] = []
        self._note: str | None = "GPU information is being read (NVML); ask again"
        self._taken = -math.inf
        self._reading = threading.Event()  # set while a reader thread runs, abandoned or not
        self._task_group: anyio.abc.TaskGroup | None = None

    def attach(self, task_group: anyio.abc.TaskGroup) -> None:
        """Read once at start, so that the first ``status`` has an answer (none yet)."""
        self._task_group = task_group
        self._reading.set()
        task_group.start_soon(self._refresh, {})

    def current(self, workers: Callable[[], Workers]) -> tuple[list[GpuInfo], str | None]:
        """The last reading (and why there is none); refreshed in the background when old."""
        stale = time.monotonic() - self._taken > self.max_age
        if stale and not self._reading.is_set() and self._task_group is not None:
            self._reading.set()
            self._task_group.start_soon(self._refresh, workers())
        return self._gpus, self._note

    async def _refresh(self, workers: Workers) -> None:
        def read() -> tuple[list[GpuInfo], str | None]:
            try:
                return self._read(workers)
            finally:
                self._reading.clear()

        with anyio.move_on_after(self.timeout) as scope:
            gpus, note = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        if scope.cancelled_caught:
            gpus, note = [], f"NVML did not answer within {self.timeout:g} s"
        self._gpus, self._note, self._taken = gpus, note, time.monotonic()
