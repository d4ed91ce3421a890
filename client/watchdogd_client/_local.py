"""The daemon-less pair: a parent process reaps the workers it started itself.

::

    queue = multiprocessing.get_context("spawn").Queue()
    server = LocalTimerServer(queue)          # in the parent; SIGKILL by default
    server.start()
    # each worker (a child process, given `queue` or a LocalTimerClient(queue)):
    configure(LocalTimerClient(queue))
    with expires(after=60):
        ...

torch's ``LocalTimerServer``/``LocalTimerClient``, with these differences:

- expiry happens at the deadline: the server's thread waits for requests
  only until the next deadline (torch's waits ``max_interval``, 60 s by
  default, and only then looks for expired timers);
- a timer belongs to a process, not to a number. The server opens a pidfd
  when a pid's first timer is registered and signals through it
  (``pidfd_send_signal``), which cannot reach a later process with the same
  pid; it closes the pidfd when the pid's last timer goes. A worker that
  exits with timers armed is dropped at the next round (a request, a
  deadline, or the once-a-second stop check), never signalled;
- requests from :class:`LocalTimerClient` carry the sender's start time
  (``/proc/PID/stat``, in 10 ms clock ticks), so one that arrives after its
  sender exited and the pid went to a process started in a later tick is
  ignored instead of arming a timer on the newcomer. Requests without it
  (torch's own ``LocalTimerClient`` works too) bind to whichever process has
  the pid when they are registered;
- both ``fork`` and ``spawn`` children work: the client is its queue and
  nothing else (the pid is read at each call), so it pickles with the
  queue when passed to a ``Process``, or is built in the child from it.
  ``multiprocessing`` only pickles its queues while starting a process:
  make the queue from the same context as the processes, or use a
  ``Manager().Queue()`` for pools;
- ``signal`` picks what a reap sends (SIGKILL, as torch); ``<= 0`` records
  the expiry (log and debug-info hook) without signalling.

Like torch's, a client's ``put`` returns before the request is written: the
queue's feeder thread writes it, and it needs the GIL to do so. A worker
that hangs holding the GIL right after ``acquire`` may never arm its timer;
the daemon's clients (:class:`~watchdogd_client.SocketTimerClient`) write
synchronously.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import threading
import time
from queue import Empty
from typing import Any, NamedTuple, Protocol

from ._api import RequestQueue, TimerRequest, TimerServer
from ._proc import PinnedProcess, stat_fields
from ._timer_client import TimerClient

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

logger = logging.getLogger("watchdogd_client.timer")

_CLOCK_NOISE = 1e-3


class _Sink(Protocol):
    def put(self, obj: Any, /) -> None: ...


class _Source(Protocol):
    def get(self, block: bool, timeout: float | None) -> Any: ...

    def qsize(self) -> int: ...


def _start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot); ProcessLookupError if none."""
    return int(stat_fields(pid)[19])


_own_identity: tuple[int, int] | None = None


def _identity() -> tuple[int, int]:
    """This process's (pid, start time), read once per process."""
    global _own_identity
    pid = os.getpid()
    if _own_identity is None or _own_identity[0] != pid:
        _own_identity = (pid, _start_time(pid))
    return _own_identity


class _LocalTimerRequest(TimerRequest):
    """A :class:`TimerRequest` that also says which process (not just which pid) sent it."""

    __slots__ = ("start_time",)

    def __init__(
        self, worker_id: int, scope_id: str, expiration_time: float, start_time: int
    ) -> None:
        super().__init__(worker_id, scope_id, expiration_time)
        self.start_time = start_time


class LocalTimerClient(TimerClient):
    """Sends this process's timer requests to a :class:`LocalTimerServer` over ``mp_queue``."""

    def __init__(self, mp_queue: _Sink) -> None:
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        pid, start_time = _identity()
        self._mp_queue.put(_LocalTimerRequest(pid, scope_id, expiration_time, start_time))

    def release(self, scope_id: str) -> None:
        pid, start_time = _identity()
        self._mp_queue.put(_LocalTimerRequest(pid, scope_id, -1, start_time))


class MultiprocessingRequestQueue(RequestQueue):
    """A :class:`RequestQueue` over a ``multiprocessing`` (or ``Manager``) queue."""

    def __init__(self, mp_queue: _Source) -> None:
        self._mp_queue = mp_queue

    def size(self) -> int:
        return self._mp_queue.qsize()

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + timeout
        for _ in range(size):
            try:
                item = self._mp_queue.get(True, max(0.0, deadline - time.monotonic()))
            except Empty:
                break
            if isinstance(item, TimerRequest):
                requests.append(item)
                continue
            try:
                # torch's own TimerRequest, or any object shaped like one.
                requests.append(TimerRequest(item.worker_id, item.scope_id, item.expiration_time))
            except AttributeError:
                logger.error("Ignoring %r on the timer queue: not a TimerRequest", item)
        return requests


class _Timer(NamedTuple):
    request: TimerRequest
    deadline: float  # time.monotonic(): a wall-clock step does not move it


class _Worker:
    """A process with timers: pinned by a pidfd, named by its start time."""

    __slots__ = ("process", "start_time", "timers")

    def __init__(self, process: PinnedProcess, start_time: int) -> None:
        self.process = process
        self.start_time = start_time
        self.timers: dict[str, _Timer] = {}


def _to_monotonic(wall_time: float) -> float:
    return wall_time - time.time() + time.monotonic()


class LocalTimerServer(TimerServer):
    """Reaps (signals) worker processes whose timers expire; runs in their parent.

    Workers are pids (``TimerRequest.worker_id``); ``mp_queue`` is the queue
    their :class:`LocalTimerClient` s write to. ``max_interval`` bounds the
    wait for requests when no deadline is nearer.
    """

    def __init__(
        self,
        mp_queue: _Source,
        max_interval: float = 60,
        daemon: bool = True,
        *,
        signal: int = _signal.SIGKILL,
        run_id: str = "",
    ) -> None:
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon, run_id=run_id)
        if signal > 0:
            _signal.Signals(signal)  # ValueError now, not a failed reap at the deadline
        self._signal = int(signal)
        # The watchdog thread and callers of the public methods share the table.
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        with self._lock:
            for request in timer_requests:
                self._register(request)

    def clear_timers(self, worker_ids: set[int]) -> None:
        with self._lock:
            for pid in worker_ids:
                self._drop(pid)

    def get_expired_timers(self, deadline: float) -> dict[int, list[TimerRequest]]:
        """Expired timers by pid, each pid's soonest first; exited pids' are dropped.

        Compared on the monotonic clock (``deadline`` and each expiration
        converted when received), so a wall-clock step neither expires nor
        postpones armed timers.
        """
        with self._lock:
            for pid in list(self._workers):
                self._live_worker(pid)
            horizon = _to_monotonic(deadline)
            expired = {}
            for pid, worker in self._workers.items():
                due = sorted(
                    (t for t in worker.timers.values() if t.deadline <= horizon),
                    key=lambda t: t.deadline,
                )
                if due:
                    expired[pid] = [t.request for t in due]
            return expired

    def _next_expiration_after(self, deadline: float) -> float | None:
        # A scan, not a heap: get_expired_timers visits every timer each round
        # anyway, and a parent's workers hold a handful each.
        with self._lock:
            # Converting the same wall time twice can differ by float rounding:
            # a timer in that sliver would be neither expired last round nor
            # waited for now. Counting it costs at most one extra round.
            after = _to_monotonic(deadline) - _CLOCK_NOISE
            soonest = min(
                (
                    t.deadline
                    for worker in self._workers.values()
                    for t in worker.timers.values()
                    if t.deadline > after
                ),
                default=None,
            )
        return None if soonest is None else soonest - time.monotonic() + time.time()

    def _reap_worker(self, worker_id: int) -> bool:
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                # Never fall back to kill(pid): the number may be someone else's by now.
                logger.info("pid %s holds no timers here: nothing to reap", worker_id)
                return True
            if self._signal <= 0:
                logger.warning(
                    "pid %s: timers expired; signal %s: not signalled", worker_id, self._signal
                )
                return True
            try:
                worker.process.send_signal(self._signal)
            except ProcessLookupError:
                logger.info("pid %s had already exited. Skipping", worker_id)
                return True
            except OSError:
                logger.exception("Error signalling pid=%s", worker_id)
                return False
            return True

    def _register(self, request: TimerRequest) -> None:
        pid = request.worker_id
        if type(pid) is not int or pid <= 0:
            logger.error("Ignoring %r: a LocalTimerServer's worker_id is a pid", request)
            return
        start_time = request.start_time if isinstance(request, _LocalTimerRequest) else None
        worker = self._live_worker(pid)
        if worker is not None and start_time not in (None, worker.start_time):
            logger.info("Ignoring %r: sent by an earlier process with pid %s", request, pid)
            return
        if request.expiration_time < 0:
            if worker is not None:
                worker.timers.pop(request.scope_id, None)
                if not worker.timers:
                    self._drop(pid)
            return
        if worker is None:
            worker = self._open(pid, start_time)
            if worker is None:
                return
            self._workers[pid] = worker
        deadline = _to_monotonic(request.expiration_time)
        worker.timers[request.scope_id] = _Timer(request, deadline)

    def _open(self, pid: int, start_time: int | None) -> _Worker | None:
        """Pin ``pid``, if it is still the process that sent ``start_time``."""
        try:
            process = PinnedProcess(pid)
        except ProcessLookupError:
            logger.info("Ignoring a timer for pid %s: no such process", pid)
            return None
        except OSError:
            logger.exception("Ignoring a timer for pid %s: cannot open a pidfd", pid)
            return None
        try:
            actual = _start_time(pid)
        except ProcessLookupError:
            actual = None
        # Checked after /proc was read: if the pinned process is still alive,
        # /proc described it and not a successor with its number.
        if actual is None or process.exited() or start_time not in (None, actual):
            process.close()
            logger.info("Ignoring a timer for pid %s: the process that asked has exited", pid)
            return None
        return _Worker(process, actual)

    def _live_worker(self, pid: int) -> _Worker | None:
        """``pid``'s worker, unless it has exited (then its timers are dropped)."""
        worker = self._workers.get(pid)
        if worker is not None and worker.process.exited():
            logger.info("pid %s exited with timers %s: dropped", pid, list(worker.timers))
            self._drop(pid)
            return None
        return worker

    def _drop(self, pid: int) -> None:
        worker = self._workers.pop(pid, None)
        if worker is not None:
            worker.process.close()
