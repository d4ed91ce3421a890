"""torch's timer extension points: the parts a custom timer pair is built from.

The names, signatures and meanings of ``torch.distributed.elastic.timer.api``
(and of its ``debug_info_logging``), so a pair written against torch's ABCs
ports by changing one import:

- :class:`TimerRequest`: what a client sends, ``(worker_id, scope_id,
  expiration_time)``; a negative ``expiration_time`` is a release;
- ``TimerClient`` (in ``_timer``, with ``expires``): ``acquire``/``release``
  for the worker that holds the client;
- :class:`RequestQueue`: the server's end of the channel, ``size()`` and
  ``get(size, timeout)``;
- :class:`TimerServer`: a thread that drains the queue and reaps the workers
  whose timers expired.

Rules / theory of operation — one round of the watchdog thread:

1. wait for requests, at most ``max_interval``; when the server tells when
   its next timer expires (:meth:`TimerServer._next_expiration_after`, an
   optional override) no longer than that, so a timer is acted on at its
   deadline rather than at the next tick. "Next" means after the previous
   round's check: a timer that round already handed to ``_reap_worker``
   does not cut the wait short again, so a failing reap cannot spin;
2. ``register_timers``: acquires and releases, in queue order;
3. ``get_expired_timers(now)``, handed to
   :func:`log_debug_info_for_expired_timers`;
4. ``_reap_worker`` for each worker with an expired timer. A reap that
   returned True or raised clears the worker's timers (``clear_timers``);
   one that returned False keeps them for the next round.

Where this differs from torch: the deadline-bounded wait (1.); the loop also
wakes at least once a second (``_STOP_CHECK_INTERVAL``), because a
``RequestQueue`` cannot be interrupted and ``stop()`` should not take
``max_interval`` (60 s for ``LocalTimerServer``); every server calls the
debug-info hook (torch: only ``FileTimerServer``); a repeating fault pauses
the loop instead of spinning; ``max_interval`` must be positive. As in
torch, a second ``start()`` on a running server and a second ``stop()``
change nothing.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from typing import Any

__all__ = [
    "RequestQueue",
    "TimerRequest",
    "TimerServer",
    "log_debug_info_for_expired_timers",
]

logger = logging.getLogger("watchdogd_client.timer")

# The longest one wait for requests may last: the bound on how long stop()
# takes, and on how long a wall-clock step can delay an expiry.
_STOP_CHECK_INTERVAL = 1.0


class TimerRequest:
    """An acquire (``expiration_time`` >= 0, a ``time.time()`` value) or a
    release (negative) of the timer ``scope_id`` of ``worker_id``.

    ``worker_id`` is whatever identifies a worker to the pair using it (a pid
    for :class:`~watchdogd_client.LocalTimerServer`).
    """

    __slots__ = ("expiration_time", "scope_id", "worker_id")

    def __init__(self, worker_id: Any, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TimerRequest):
            return False
        return (self.worker_id, self.scope_id, self.expiration_time) == (
            other.worker_id,
            other.scope_id,
            other.expiration_time,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_id={self.worker_id!r}, "
            f"scope_id={self.scope_id!r}, expiration_time={self.expiration_time!r})"
        )


class RequestQueue(abc.ABC):
    """The consumer end of the channel that carries :class:`TimerRequest` s."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many requests are waiting now (it may grow before ``get``, not shrink)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` requests, blocking no longer than ``timeout`` seconds."""


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[Any, list[str]]) -> None:
    """The hook a server calls with the expired timers it is about to reap.

    ``expired_timers`` maps each worker to its expired scopes. Logged at INFO
    on the ``watchdogd_client.timer`` logger (attach a handler to route it);
    nothing when there are none.
    """
    if expired_timers:
        logger.info("Timers expired for run:[%s] [%s].", run_id, expired_timers)


class TimerServer(abc.ABC):
    """Watches timers and reaps the workers whose timers expire.

    Subclasses implement :meth:`register_timers`, :meth:`clear_timers`,
    :meth:`get_expired_timers` and :meth:`_reap_worker`, and may override
    :meth:`_next_expiration_after` to be woken at each deadline. ``start()``
    runs the loop in a thread (a daemon thread unless ``daemon=False``);
    ``stop()`` ends it. ``run_id`` is passed to the debug-info hook.
    """

    def __init__(
        self,
        request_queue: RequestQueue,
        max_interval: float,
        daemon: bool = True,
        *,
        run_id: str = "",
    ) -> None:
        if not max_interval > 0:
            raise ValueError(f"max_interval must be positive, not {max_interval!r}")
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._run_id = run_id
        self._watchdog_thread: threading.Thread | None = None
        self._stop_signaled = threading.Event()
        # The deadline the last round expired timers up to (wall clock).
        self._last_check = -math.inf

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply acquires and releases (negative ``expiration_time``), in order."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Forget every timer of ``worker_ids``."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """The timers with ``expiration_time <= deadline``, by worker."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Reap ``worker_id``: True once done, False to retry next round.

        An exception counts as reaped (the worker's timers are cleared).
        """

    def _next_expiration_after(self, deadline: float) -> float | None:
        """The earliest ``expiration_time`` later than ``deadline``; None if none.

        The loop waits for requests no longer than until then. The default
        (None) leaves every wait at ``max_interval``, as torch does.
        """
        return None

    def _reap_worker_no_throw(self, worker_id: Any) -> bool:
        try:
            return self._reap_worker(worker_id)
        except Exception:
            logger.exception("_reap_worker(%r) raised: counting the worker as reaped", worker_id)
            return True

    def _watchdog_loop(self) -> None:
        while not self._stop_signaled.is_set():
            try:
                self._run_watchdog()
            except Exception:
                logger.exception("Error running watchdog")
                # A fault that repeats every round (a closed queue) must not spin a core.
                self._stop_signaled.wait(min(self._max_interval, _STOP_CHECK_INTERVAL))

    def _run_watchdog(self) -> None:
        timeout = min(self._max_interval, _STOP_CHECK_INTERVAL)
        next_expiration = self._next_expiration_after(self._last_check)
        if next_expiration is not None:
            timeout = min(timeout, max(0.0, next_expiration - time.time()))
        batch_size = max(1, self._request_queue.size())
        self.register_timers(self._request_queue.get(batch_size, timeout))
        now = self._last_check = time.time()
        expired = self.get_expired_timers(now)
        log_debug_info_for_expired_timers(
            self._run_id,
            {worker_id: [r.scope_id for r in requests] for worker_id, requests in expired.items()},
        )
        reaped = set()
        for worker_id, requests in expired.items():
            logger.info(
                "Reaping worker_id=[%s]. Expired timers: %s",
                worker_id,
                [r.scope_id for r in requests],
            )
            if self._reap_worker_no_throw(worker_id):
                reaped.add(worker_id)
            else:
                logger.error("Error reaping worker=[%s]. Will retry next round.", worker_id)
        self.clear_timers(reaped)

    def start(self) -> None:
        if self._watchdog_thread is not None:
            logger.debug("%s is already running", type(self).__name__)
            return
        self._stop_signaled.clear()
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop, name=f"{type(self).__name__}-watchdog", daemon=self._daemon
        )
        self._watchdog_thread.start()

    def stop(self) -> None:
        self._stop_signaled.set()
        thread = self._watchdog_thread
        if thread is None:
            return
        thread.join(self._max_interval + _STOP_CHECK_INTERVAL)
        if thread.is_alive():
            # Keep the reference: a start() now would race the round still running.
            logger.warning("%s's watchdog thread is still in a round", type(self).__name__)
        else:
            self._watchdog_thread = None
