"""Faults on demand: a group's injected faults, delivered once each, as the real ones.

``watchdogd run --inject`` (the group's ``faults``) and ``watchdogctl
inject`` queue a :class:`~watchdogd_client.groups.Fault`; ``after`` seconds
later (from the group's start, or from the request) it reaches the worker
of its global rank on this node, waiting for the next attempt's workers
if that rank has none running:

- ``sigstop`` and ``kill``: the daemon sends SIGSTOP or SIGKILL to the
  worker's process group (a trainer under a wrapper script too). A stopped
  worker is found by its timer (or the idle timeout), as a real one is;
  a killed one is a worker failure.
- ``hang``, ``exit`` and ``slow``: the worker's timer client carries them
  out (``watchdogd_client._faults``): the daemon writes the fault into the
  worker's fault file (in a directory of its own, ``mkdtemp``: 0700,
  never one a user could have planted) and sends the fault signal to the
  worker itself, once it catches
  it (its first timer client installs the handler). One that does not
  within 30 s is never sent it, which would kill it: the fault is
  reported undelivered instead.

Each delivery is a ``fault_injected`` event, and the failure it causes is
reported with "(injected fault: KIND)". The worker is marked as drilled
(``mark_injected``), so that the timer service marks the expiries and
straggler flags it causes ``injected=True``.
"""

from __future__ import annotations

import math
import shutil
import signal
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.to_thread
import msgspec

from watchdogd.core.ports import EventSink
from watchdogd.groups.child import ChildProcess
from watchdogd.linux.procs import catches_signal
from watchdogd.linux.snapshot import write_atomically
from watchdogd_client._faults import FAULT_FILE_ENV, FAULT_SIGNAL_ENV, Injected
from watchdogd_client.groups import Fault

__all__ = ["FAULT_SIGNAL", "FaultInjector", "RankProcess"]

FAULT_SIGNAL = signal.SIGRTMIN + 2
# A worker just started may not have made its timer client (its handler) yet.
_HANDLER_WAIT = 30.0
_HANDLER_POLL = 0.05
_encoder = msgspec.json.Encoder()


class RankProcess(NamedTuple):
    """The running worker of a global rank."""

    child: ChildProcess
    local_rank: int

    @property
    def pid(self) -> int:
        return self.child.pid


class FaultInjector:
    def __init__(
        self,
        group: str,
        events: EventSink,
        worker_of: Callable[[int], RankProcess | None],
        mark_injected: Callable[[int], None],
    ) -> None:
        self.group = group
        self.events = events
        self.directory = Path(tempfile.mkdtemp(prefix=f"watchdogd-faults-{group}-"))
        self.worker_of = worker_of
        self.mark_injected = mark_injected
        self.injected: dict[int, str] = {}
        """Pid -> the kind of fault injected into it (its failure report says so)."""
        self._queue, self._queued = anyio.create_memory_object_stream[Fault](math.inf)
        self._started = anyio.Event()

    def workers_started(self) -> None:
        """An attempt's workers run: faults waiting for their rank look again."""
        self._started.set()
        self._started = anyio.Event()

    def env(self, local_rank: int) -> dict[str, str]:
        """What each worker gets, so that its timer client takes the fault signal."""
        return {
            FAULT_SIGNAL_ENV: str(int(FAULT_SIGNAL)),
            FAULT_FILE_ENV: str(self.directory / f"{local_rank}.json"),
        }

    def schedule(self, fault: Fault) -> None:
        self._queue.send_nowait(fault)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg, self._queued:
            async for fault in self._queued:
                tg.start_soon(self._deliver, fault)

    async def _deliver(self, fault: Fault) -> None:
        await anyio.sleep(fault.after)
        while (worker := self.worker_of(fault.rank)) is None:
            await self._started.wait()
        send: Callable[[], None]
        if fault.kind == "kill":
            send = partial(worker.child.send_signal, signal.SIGKILL)
        else:
            # A hang (and a stop) must come once the worker has a timer client: before
            # its first timer, nothing would see it, and the drill would test nothing.
            path = self.directory / f"{worker.local_rank}.json"
            injected = Injected(fault.kind, fault.code, fault.factor)
            prepare = None if fault.kind == "sigstop" else (path, injected)
            if not await self._when_caught(worker, fault.rank, prepare):
                self.events.emit(
                    "fault_not_delivered",
                    group=self.group,
                    kind=fault.kind,
                    rank=fault.rank,
                    pid=worker.pid,
                    reason=f"the worker took no fault signal in {_HANDLER_WAIT:.0f} s "
                    "(it made no timer client), or ended",
                )
                return
            if self.worker_of(fault.rank) != worker:
                return  # it ended meanwhile: its successor gets nothing of this one's
            if fault.kind == "sigstop":
                send = partial(worker.child.send_signal, signal.SIGSTOP)
            else:
                send = partial(worker.child.pinned.send_signal, FAULT_SIGNAL)
        try:
            send()
        except ProcessLookupError:
            return
        self.injected[worker.pid] = fault.kind
        self.mark_injected(worker.pid)
        self.events.emit(
            "fault_injected",
            group=self.group,
            kind=fault.kind,
            rank=fault.rank,
            pid=worker.pid,
            code=fault.code if fault.kind == "exit" else None,
            factor=fault.factor if fault.kind == "slow" else None,
            injected=True,
        )

    async def _when_caught(
        self, worker: RankProcess, rank: int, prepare: tuple[Path, Injected] | None
    ) -> bool:
        """Wait for the worker to take the fault signal (its first timer client), then
        write ``prepare``'s fault file, if any."""
        for _ in range(int(_HANDLER_WAIT / _HANDLER_POLL)):
            if await anyio.to_thread.run_sync(self._prepare, worker.pid, prepare):
                return True
            if self.worker_of(rank) != worker:
                return False
            await anyio.sleep(_HANDLER_POLL)
        return False

    @staticmethod
    def _prepare(pid: int, prepare: tuple[Path, Injected] | None) -> bool:
        """Write the worker's fault file; False if it would die of the signal instead."""
        if not catches_signal(pid, FAULT_SIGNAL):
            return False
        if prepare is not None:
            path, injected = prepare
            write_atomically(path, _encoder.encode(injected))
        return True
