"""``expires(..., device_time=True)``: score a scope on GPU time, never syncing the host.

CUDA runs asynchronously: the host time of a scope that launches kernels
is mostly launch time, and a slow GPU's delay shows at the next sync,
where every rank waits alike. So a device-timed scope records a CUDA
event (``torch.cuda.Event(enable_timing=True)``) when it is armed and
another when it is released; a pair whose end event has completed
(``query()``, which does not wait) is reported with a later request
(:class:`~watchdogd_client.protocol.DeviceTime`) as
``start.elapsed_time(end)``, and the daemon scores that scope's
stragglers on it instead of the host time.

Rules
-----
- torch is never imported here: only a torch the trainer already imported
  (``sys.modules``) with ``torch.cuda.is_available()`` is used. Without
  one, ``device_time=True`` changes nothing (the host time is scored).
- Never a host sync: pairs whose end has not completed wait for a later
  release, oldest first; at most :data:`MAX_PENDING` wait, the oldest
  dropped beyond that (a GPU that far behind is reported late, not waited on).
- Only the socket carries device times: with any other client, arming a
  device-timed scope raises :class:`NotConfiguredError`.
- Nothing of this runs for a scope without ``device_time``: its timer is a
  plain ``expires``, whose hot path knows nothing of it (the device-timed
  one, in :mod:`watchdogd_client._timer`, calls here; nothing here calls back).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from typing import Any, Protocol

from ._socket import SocketTimerClient

__all__ = ["MAX_PENDING", "Event", "cuda_module", "queue", "record", "report_completed"]

MAX_PENDING = 256


class Event(Protocol):
    """What is used of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Event) -> float: ...


# Completed-or-not pairs, oldest first: the client, the scope, start and end events.
_pending: deque[tuple[SocketTimerClient, str, Event, Event]] = deque(maxlen=MAX_PENDING)
_cuda: Any = None  # torch.cuda, once found available
_reporting = threading.Lock()


def cuda_module() -> Any:
    """``torch.cuda`` if the trainer imported torch and has a GPU, else None."""
    global _cuda
    if _cuda is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            _cuda = torch.cuda
    return _cuda


def record() -> Event:
    """A timing event recorded now on the current stream (after :func:`cuda_module` found one)."""
    event: Event = _cuda.Event(enable_timing=True)
    event.record()
    return event


def queue(client: SocketTimerClient, scope: str, start: Event, end: Event) -> None:
    """Report ``scope``'s device time to ``client`` once ``end`` completed."""
    _pending.append((client, scope, start, end))


def report_completed() -> None:
    """Send the device time of every pair at the head of the queue whose end completed."""
    while True:
        with _reporting:  # threads that release at once take turns at the head
            if not _pending or not _pending[0][3].query():
                return  # later pairs on the stream complete after this one
            client, scope, start, end = _pending.popleft()
        seconds = start.elapsed_time(end) / 1000
        if seconds >= 0:  # a pair crossed by threads sharing one decorator means nothing
            client.device_time(scope, seconds)


# A forked child's pairs are its parent's (and its connections are new ones).
os.register_at_fork(after_in_child=_pending.clear)
