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
  plain :class:`expires`, whose hot path knows nothing of it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from types import TracebackType
from typing import Any, Protocol

from ._errors import NotConfiguredError
from ._socket import SocketTimerClient
from ._timer import expires, get_client

__all__ = ["MAX_PENDING", "device_timed"]

MAX_PENDING = 256


class _Event(Protocol):
    """What is used of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: _Event) -> float: ...


# Completed-or-not pairs, oldest first: the client, the scope, start and end events.
_pending: deque[tuple[SocketTimerClient, str, _Event, _Event]] = deque(maxlen=MAX_PENDING)
_cuda: Any = None  # torch.cuda, once found available
_reporting = threading.Lock()


def _cuda_module() -> Any:
    """``torch.cuda`` if the trainer imported torch and has a GPU, else None."""
    global _cuda
    if _cuda is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            _cuda = torch.cuda
    return _cuda


def device_timed(timer: expires) -> None:
    """Make ``timer`` record device time, if torch with CUDA is there; else leave it be."""
    if _cuda_module() is not None:
        _DeviceTimedExpires.adopt(timer)


class _DeviceTimedExpires(expires):
    """An :class:`expires` that also brackets its block with CUDA events."""

    _starts: list[_Event]
    """Start events of the blocks entered and not yet left (a decorator may recurse)."""

    @classmethod
    def adopt(cls, timer: expires) -> None:
        # Its class changes rather than expires growing a branch on every enter and exit.
        timer.__class__ = cls
        assert isinstance(timer, cls)
        timer._starts = []

    def __enter__(self) -> None:
        client = self._client or get_client()
        if not isinstance(client, SocketTimerClient):
            raise NotConfiguredError(
                f"expires(device_time=True) needs a SocketTimerClient, not "
                f"{type(client).__name__}: only the socket carries device times"
            )
        super().__enter__()
        start: _Event = _cuda.Event(enable_timing=True)
        start.record()
        self._starts.append(start)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end: _Event = _cuda.Event(enable_timing=True)
        end.record()
        client = self._client or get_client()
        if isinstance(client, SocketTimerClient) and self._starts:
            _pending.append((client, self._scope, self._starts.pop(), end))
        super().__exit__(exc_type, exc, tb)
        _report_completed()


def _report_completed() -> None:
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
