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
  ``WATCHDOGD_SOCKET``, then ``TORCHELASTIC_TIMER_FILE``, then the socket
  ``watchdogd serve`` listens on by default for this user, then the node's
  (``/run/watchdogd/watchdogd.sock``), if one is there;
- it is a class, so it works as a context manager and as a decorator;
- ``after=LEARN`` (or ``LEARN(initial=600)``) lets the daemon choose the
  deadline from the scope's history, with no extra round trip (see
  :class:`~watchdogd_client.Learn`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from types import TracebackType

from . import _device_time, _faults
from ._errors import NotConfiguredError, RequestError, WatchdogError
from ._fifo import FileTimerClient
from ._learn import Learn
from ._paths import default_socket_path, found_sockets
from ._socket import SocketTimerClient
from ._timer_client import TimerClient, acquire_learned

__all__ = ["configure", "expires", "get_client", "progress"]


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
    # Nothing said: where `watchdogd serve` listens by default for this user, or the node's.
    found = found_sockets()
    if found:
        return SocketTimerClient(str(found[0]))
    raise NotConfiguredError(
        f"no timer client: no daemon listens at {default_socket_path()} (watchdogd serve's "
        "default for this user) or at the node's; call "
        "watchdogd_client.configure(SocketTimerClient(path)) "
        "(or FileTimerClient(path)), pass client=..., or set WATCHDOGD_SOCKET "
        "(or TORCHELASTIC_TIMER_FILE) in the environment"
    )


def progress(step: int, client: TimerClient | None = None) -> None:
    """Tell the daemon that this worker completed training step ``step``.

    ``step`` is absolute: after a resume from a checkpoint, count on from the
    checkpoint's step. With reports, a group knows an attempt that only
    recomputes the steps since its checkpoint from one that gets further
    (``--max-no-progress-restarts``). One non-blocking send, no reply: call
    it every step. Only the socket carries it: with a FIFO client, or with no
    client configured (a script run by torchrun, or by hand), it does nothing.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if client is None:
        try:
            client = get_client()
        except NotConfiguredError:
            return
    if isinstance(client, SocketTimerClient):
        client.progress(step)


# (file, line) -> its scope name: one string per line, hashed once, not one per block.
_line_scopes: dict[tuple[str, int], str] = {}
_LINE_SCOPES_MAX = 4096


def _line_scope(line: tuple[str, int]) -> str:
    if len(_line_scopes) >= _LINE_SCOPES_MAX:
        _line_scopes.clear()  # a program that generates code: refill, never grow
    scope = _line_scopes[line] = f"{line[0]}:{line[1]}"
    return scope


class expires(contextlib.ContextDecorator):  # noqa: N801 - torch's name
    """Arm a timer for the enclosed block (or decorated function).

    ``device_time``: with torch and CUDA already imported, straggler scores of
    this scope use the GPU's time of the block (CUDA events), not the host's.
    """

    def __init__(
        self,
        after: float | Learn,
        scope: str | None = None,
        client: TimerClient | None = None,
        *,
        device_time: bool = False,
    ) -> None:
        if scope is None:
            caller = sys._getframe(1)
            line = (caller.f_code.co_filename, caller.f_lineno)
            scope = _line_scopes.get(line) or _line_scope(line)
        # Told apart once here, not at every enter.
        self._learn: Learn | None
        if isinstance(after, Learn):
            self._after, self._learn = 0.0, after
        else:
            self._after, self._learn = after, None
        self._scope = scope
        self._client = client
        if device_time and _device_time.cuda_module() is not None:
            # The GPU's time of the block scores it (see _device_time). Its class
            # changes rather than every enter and exit growing a branch.
            self.__class__ = _DeviceTimedExpires
            self._starts: list[_device_time.Event] = []

    @property
    def scope(self) -> str:
        return self._scope

    def __enter__(self) -> None:
        if _faults.active is not None:
            self._entered = time.monotonic()
        client = self._client or _configured or get_client()
        learn = self._learn
        try:
            if learn is None:
                client.acquire(self._scope, time.time() + self._after)
            elif isinstance(client, TimerClient):
                client.acquire_learned(self._scope, learn.initial)
            else:  # torch's own client
                acquire_learned(client, self._scope, learn.initial)
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
        if _faults.active is not None:  # an injected slowdown (watchdogd run --inject)
            _faults.slow_down(self.__dict__.pop("_entered", None))
        (self._client or _configured or get_client()).release(self._scope)


class _DeviceTimedExpires(expires):
    """An :class:`expires` that also brackets its block with CUDA events."""

    def __enter__(self) -> None:
        client = self._client or get_client()
        if not isinstance(client, SocketTimerClient):
            raise NotConfiguredError(
                f"expires(device_time=True) needs a SocketTimerClient, not "
                f"{type(client).__name__}: only the socket carries device times"
            )
        super().__enter__()
        self._starts.append(_device_time.record())  # a decorator may recurse

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = _device_time.record()
        client = self._client or get_client()
        if isinstance(client, SocketTimerClient) and self._starts:
            _device_time.queue(client, self._scope, self._starts.pop(), end)
        super().__exit__(exc_type, exc, tb)
        _device_time.report_completed()
