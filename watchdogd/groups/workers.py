"""The workers this daemon launched: one started rank, the index of all by pid, how an
exit reads.

A :class:`Worker` is one local rank of one attempt. Its process is a
:class:`~watchdogd.groups.child.ChildProcess` (the one owner of its pidfd);
the :class:`WorkerIndex` is what the timer service sees of every group's
workers (its ``Supervision`` port), and where their steps reach their
group's progress (released timers, ``wd.progress`` reports) and whoever
waits for its workers to be at work (the warm spares' refill).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import anyio
import msgspec

from watchdogd.core.flight_recorder import Recorder
from watchdogd.core.ports import SupervisedWorker
from watchdogd.core.progress import StepProgress
from watchdogd.core.timers import IDLE_SCOPE, Ended
from watchdogd.groups.child import Cell, ChildProcess, WorkerProcess
from watchdogd.linux.memory_cgroups import MemoryReading

__all__ = [
    "OOM_KILLED",
    "Endpoints",
    "Worker",
    "WorkerIndex",
    "describe_exit",
    "read_error_file",
    "visible_gpus",
]

Metadata = dict[str, str | int | float | bool | None]


class Endpoints(NamedTuple):
    """The timer service's endpoints, handed to every worker."""

    socket_path: str
    fifo_path: str


class Worker:
    """Local rank ``local_rank`` (global ``rank``) of attempt ``attempt``, started."""

    def __init__(
        self,
        local_rank: int,
        rank: int,
        attempt: int,
        process: WorkerProcess,
        cell: Cell,
        *,
        error_file: str | None,
        about: Metadata,
    ) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.attempt = attempt
        self.child = ChildProcess(process, cell)
        self.pid = process.pid
        self.exited = anyio.Event()
        """Set once its exit was handled (reaped, reported to the group)."""
        self.started = time.time()
        self.error_file = error_file
        self.about: Metadata = {**about, "worker_id": self.pid}
        """torch's worker event metadata."""
        self.memory_at_exit: MemoryReading | None = None
        """What its cell's memory cgroup said once it exited, before the cell went."""

    @property
    def exitcode(self) -> int | None:
        return self.child.returncode

    def read_memory(self) -> MemoryReading | None:
        """Its cell's OOM kills and peak (None: no memory cgroup): as they were at its
        exit once it exited, else now (two small sysfs reads)."""
        if self.memory_at_exit is not None:
            return self.memory_at_exit
        memory = self.child.cell.memory if self.child.cell is not None else None
        return memory.read() if memory is not None else None

    def memory_peak(self) -> int | None:
        """The most memory its cell held at once, in bytes (None: unknown)."""
        memory = self.read_memory()
        return memory.peak_bytes if memory is not None else None


class WorkerIndex:
    """The workers this daemon launched, by pid: the timer service's ``Supervision`` port.

    FIFO requests may target these pids; a timer that signals one is kept
    for its group's failure report.
    """

    def __init__(self) -> None:
        self._workers: dict[int, SupervisedWorker] = {}
        self._expired_scopes: dict[int, str] = {}
        self._injected: set[int] = set()
        # group -> pid -> the flight recorder of that rank, for workers that run one.
        self._recorders: dict[str, dict[int, Recorder]] = {}
        self._progress: dict[str, StepProgress] = {}
        self._at_work: dict[str, Callable[[int], None]] = {}

    def add(self, pid: int, worker: SupervisedWorker, recorder: Recorder | None = None) -> None:
        self._workers[pid] = worker
        if recorder is not None:
            self._recorders.setdefault(worker.group, {})[pid] = recorder

    def remove(self, pid: int) -> None:
        worker = self._workers.pop(pid, None)
        self._injected.discard(pid)
        recorders = None if worker is None else self._recorders.get(worker.group)
        if recorders is not None:
            recorders.pop(pid, None)

    def track(self, group: str, progress: StepProgress) -> None:
        """Steps of ``group``'s workers go to ``progress`` (until ``untrack``)."""
        self._progress[group] = progress

    def watch_work(self, group: str, at_work: Callable[[int], None]) -> None:
        """``at_work(pid)`` on each release and step report of ``group``'s workers (until
        ``untrack``)."""
        self._at_work[group] = at_work

    def untrack(self, group: str) -> None:
        self._progress.pop(group, None)
        self._at_work.pop(group, None)

    def _worked(self, pid: int, worker: SupervisedWorker) -> StepProgress | None:
        """Worker ``pid`` showed work: tell its group's watcher; its group's progress."""
        if (at_work := self._at_work.get(worker.group)) is not None:
            at_work(pid)
        return self._progress.get(worker.group)

    def timer_ended(self, ended: Ended) -> None:
        """A timer observer: a worker's release may complete its group's step."""
        timer, _, outcome, _ = ended
        if outcome != "released" or timer.scope_id == IDLE_SCOPE:
            return
        if (worker := self._workers.get(timer.pid)) is None:
            return
        if (progress := self._worked(timer.pid, worker)) is not None:
            progress.released(worker.attempt, timer.scope_id)

    def step_reported(self, pid: int, step: int) -> None:
        """Worker ``pid`` completed step ``step`` (``wd.progress``); others are ignored."""
        worker = self._workers.get(pid)
        if worker is not None and (progress := self._worked(pid, worker)) is not None:
            progress.reported(worker.attempt, step)

    def take_expired_scope(self, pid: int) -> str | None:
        return self._expired_scopes.pop(pid, None)

    def is_supervised(self, pid: int) -> bool:
        return pid in self._workers

    def worker(self, pid: int) -> SupervisedWorker | None:
        return self._workers.get(pid)

    def timer_fired(self, pid: int, scope_id: str) -> None:
        if pid in self._workers:
            self._expired_scopes[pid] = scope_id

    def mark_injected(self, pid: int) -> None:
        """A drill's fault reached worker ``pid``."""
        if pid in self._workers:
            self._injected.add(pid)

    def injected(self, pid: int) -> bool:
        return pid in self._injected

    def flight_recorders(self, pid: int) -> list[Recorder]:
        worker = self._workers.get(pid)
        recorders = {} if worker is None else self._recorders.get(worker.group, {})
        return sorted(recorders.values(), key=lambda r: r.rank)

    def __contains__(self, pid: object) -> bool:
        return pid in self._workers


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES``, else the driver's list."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [d.strip() for d in configured.split(",") if d.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    if driver.is_dir():
        return [str(i) for i in range(len(list(driver.iterdir())))]
    return None


def read_error_file(path: str | None) -> str | None:
    """The message of a torch ``@record`` error file, if the worker wrote one."""
    if path is None:
        return None
    try:
        data = msgspec.json.decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return str(message) if message is not None else None


OOM_KILLED = "killed by the OOM killer"


def describe_exit(exitcode: int, oom_kills: int = 0) -> str:
    """How a worker's exit reads; ``oom_kills``: processes of its cell the OOM killer ended
    (a SIGKILL was then the OOM killer's)."""
    if oom_kills and exitcode == -signal.SIGKILL:
        return OOM_KILLED
    if exitcode < 0:
        try:
            reason = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            reason = f"killed by signal {-exitcode}"
    else:
        reason = f"exited with status {exitcode}"
    if oom_kills:
        reason += f" (the OOM killer ended {oom_kills} process(es) of its cell)"
    return reason
