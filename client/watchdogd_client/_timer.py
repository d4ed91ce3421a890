"""``configure`` and ``expires``: torch's countdown-timer API, without its costs.

``expires(after, scope=None, client=None)`` means what torch's does: arm a
timer that expires ``after`` seconds from now, release it when the block
ends. It differs where torch's hurts:

- the default scope is the caller's ``file:line``, read from the caller's
  frame (``sys._getframe``), not from ``inspect.stack()`` (which reads every
  source file on the stack). torch resolves it inside ``contextlib``, so two
  nested scope-less timers share one scope; ours name the line that wrote
  the ``with``;
- without :func:`configure`, the client comes from the environment:
  ``WATCHDOGD_SOCKET``, then ``TORCHELASTIC_TIMER_FILE``;
- it is a class, so it works as a context manager and as a decorator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from types import TracebackType

from ._errors import NotConfiguredError, RequestError, WatchdogError
from ._fifo import FileTimerClient
from ._socket import SocketTimerClient
from ._timer_client import TimerClient

__all__ = ["configure", "expires", "get_client"]


_configured: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """Make ``timer_client`` the one :func:`expires` uses when given none."""
    global _configured
    _configured = timer_client


def get_client() -> TimerClient:
    """The configured client, else one built from the environment (and kept)."""
    global _configured
    if _configured is None:
        _configured = _client_from_environment()
    return _configured


def _client_from_environment() -> TimerClient:
    socket_path = os.environ.get("WATCHDOGD_SOCKET")
    if socket_path:
        return SocketTimerClient(socket_path)
    fifo_path = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if fifo_path:
        return FileTimerClient(fifo_path)
    raise NotConfiguredError(
        "no timer client: call watchdogd_client.configure(SocketTimerClient()) "
        "(or FileTimerClient(path)), pass client=..., or set WATCHDOGD_SOCKET "
        "(or TORCHELASTIC_TIMER_FILE) in the environment"
    )


class expires(contextlib.ContextDecorator):  # noqa: N801 - torch's name
    """Arm a timer for the enclosed block (or decorated function)."""

    def __init__(
        self, after: float, scope: str | None = None, client: TimerClient | None = None
    ) -> None:
        if scope is None:
            caller = sys._getframe(1)
            scope = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        self._after = after
        self._scope = scope
        self._client = client

    @property
    def scope(self) -> str:
        return self._scope

    def __enter__(self) -> None:
        client = self._client or get_client()
        try:
            client.acquire(self._scope, time.time() + self._after)
        except RequestError:
            # The error belongs to an earlier request; this acquire was
            # delivered, and nobody will release it unless we do.
            with contextlib.suppress(WatchdogError):
                client.release(self._scope)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        (self._client or get_client()).release(self._scope)
