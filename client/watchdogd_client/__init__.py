"""watchdogd_client: arm deadline timers around work that can hang.

::

    import watchdogd_client as wd

    with wd.expires(after=60):  # killed by watchdogd if the block runs past 60 s
        train_step()
    wd.progress(step)  # the step it completed: restarts that get no further are counted

Transports: :class:`SocketTimerClient` (the daemon's Unix socket, identity
from the kernel) and :class:`FileTimerClient` (torch's FIFO wire format).
Both implement torch's ``TimerClient``, so they also work with
``torch.distributed.elastic.timer.configure``/``expires``. Without a daemon,
:class:`LocalTimerServer`/:class:`LocalTimerClient` let a parent reap the
workers it started; :class:`TimerRequest`, :class:`RequestQueue` and
:class:`TimerServer` are torch's extension points for a pair of your own.
Imports nothing beyond the standard library and msgspec.
"""

from __future__ import annotations

from . import events, protocol
from ._api import RequestQueue, TimerRequest, TimerServer, log_debug_info_for_expired_timers
from ._errors import (
    DaemonUnavailableError,
    FifoFullError,
    NotConfiguredError,
    ProtocolError,
    RequestError,
    WatchdogError,
)
from ._fifo import FileTimerClient
from ._learn import LEARN, Learn
from ._local import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue
from ._paths import default_fifo_path, default_runtime_dir, default_socket_path
from ._socket import SocketTimerClient
from ._timer import configure, expires, get_client, progress
from ._timer_client import TimerClient

__version__ = "0.1.0"

__all__ = [
    "LEARN",
    "DaemonUnavailableError",
    "FifoFullError",
    "FileTimerClient",
    "Learn",
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "NotConfiguredError",
    "ProtocolError",
    "RequestError",
    "RequestQueue",
    "SocketTimerClient",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "WatchdogError",
    "__version__",
    "configure",
    "default_fifo_path",
    "default_runtime_dir",
    "default_socket_path",
    "events",
    "expires",
    "get_client",
    "list_timers",
    "log_debug_info_for_expired_timers",
    "progress",
    "status",
]


def list_timers(path: str | None = None) -> list[protocol.TimerInfo]:
    """Every timer the daemon at ``path`` (default socket) holds, soonest first."""
    with SocketTimerClient(path, name="query") as client:
        return client.list_timers()


def status(path: str | None = None) -> protocol.StatusInfo:
    """The daemon's status: endpoints, counts, counters."""
    with SocketTimerClient(path, name="query") as client:
        return client.status()
