"""The socket client: pipelined timer requests and blocking queries.

``acquire``/``release`` write one frame and return: the daemon answers them
only when they fail, and a failure is raised by the first call made a
millisecond or more after it arrived (see :mod:`._connection`).
:meth:`SocketTimerClient.sync` waits until the daemon has processed
everything sent so far.

The client remembers the scopes it holds. When the daemon goes away (it was
restarted, or upgraded), the next call reconnects and re-arms them before
sending its own request; a deadline that passed meanwhile fires at once.

Its parts: the connection (:mod:`._connection`), the cached frames
(:mod:`._frames`), stack dumps (:mod:`._stack_dumps`), injected faults
(:mod:`._faults`) and device time (:mod:`._device_time`).
"""

from __future__ import annotations

import math
import os
import signal as _signal
import time
import weakref
from collections.abc import Iterator
from functools import partial
from typing import TypeVar

from . import _faults
from . import protocol as p
from ._connection import Connection
from ._frames import acquire_frame, encode, release_frame
from ._paths import default_socket_path
from ._stack_dumps import StackDumpFile
from ._timer_client import TimerClient
from .groups import Fault, GroupInfo, GroupSpec

__all__ = ["SocketTimerClient"]

_R = TypeVar("_R", bound=p.Reply)

_live_clients: weakref.WeakSet[SocketTimerClient] = weakref.WeakSet()


class SocketTimerClient(TimerClient):
    """A connection to the daemon's Unix socket.

    ``path`` defaults to ``$WATCHDOGD_SOCKET``, else the daemon's default
    socket. ``signal`` is sent to this process when one of its timers expires
    (``<= 0``: record the expiry only). ``timeout`` bounds connecting and
    waiting for replies. ``stack_signal``: register :mod:`faulthandler` on
    this signal, writing into a file the daemon hands over, so the daemon can
    capture this process's stacks before killing it (None: don't; skipped if
    the program already handles that signal).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        signal: int = _signal.SIGKILL,
        *,
        timeout: float = 10.0,
        name: str = "",
        stack_signal: int | None = _signal.SIGUSR2,
    ) -> None:
        if path is None:
            path = os.environ.get("WATCHDOGD_SOCKET") or default_socket_path()
        self.path = str(path)
        self.signal = int(signal)
        self.timeout = timeout
        self.name = name
        self.stack_signal = stack_signal
        held: dict[str, tuple[float, int, bool]] = {}
        self._held = held
        """Scope -> (expiration time, signal, learned): what a reconnect re-arms."""
        self._conn = Connection(
            self.path,
            timeout=timeout,
            name=name,
            stack_dumps=StackDumpFile(stack_signal),
            # Not a bound method: the connection must not keep the client alive, so a
            # client dropped without close() is freed (and its socket closed) at once.
            rearm=partial(_rearm_frames, held),
        )
        _live_clients.add(self)
        _faults.install()  # only where the daemon offers fault injection

    # -- TimerClient -----------------------------------------------------------

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm ``scope_id`` for this process, expiring at ``expiration_time`` (wall clock)."""
        if expiration_time < 0:
            self.release(scope_id)
            return
        conn = self._conn
        conn.send(acquire_frame(scope_id, float(expiration_time), self.signal))
        self._held[scope_id] = (expiration_time, self.signal, False)
        if conn.errors or time.monotonic_ns() >= conn.next_check:
            conn.raise_pending()

    def acquire_learned(self, scope_id: str, initial: float | None) -> None:
        """Arm ``scope_id`` with the deadline the daemon learned for it (``LEARN``).

        ``initial``: seconds, the deadline while the scope is still being
        learned (None: the daemon's rule for the scope must give one).
        """
        expiration_time = math.inf if initial is None else time.time() + initial
        self._conn.send(encode(p.Acquire(scope_id, expiration_time, self.signal, learn=True)))
        self._held[scope_id] = (expiration_time, self.signal, True)
        self._conn.raise_pending()

    def release(self, scope_id: str) -> None:
        """Disarm ``scope_id`` for this process."""
        if _faults.active is not None:
            _faults.hang_if_injected()
        self._held.pop(scope_id, None)
        conn = self._conn
        conn.send(release_frame(scope_id))
        if conn.errors or time.monotonic_ns() >= conn.next_check:
            conn.raise_pending()

    # -- beyond torch ----------------------------------------------------------

    def acquire_for(self, pid: int, scope_id: str, expiration_time: float, signal: int) -> None:
        """Arm a timer on another process (needs the daemon's permission)."""
        self._send(p.Acquire(scope_id, expiration_time, signal, pid))

    def release_for(self, pid: int, scope_id: str) -> None:
        if pid == os.getpid():  # its own: a reconnect must not bring it back
            self._held.pop(scope_id, None)
        self._send(p.Release(scope_id, pid))

    def release_all(self, pid: int | None = None) -> None:
        """Disarm every timer of ``pid`` (default: this process)."""
        if pid is None or pid == os.getpid():
            self._held.clear()
        self._send(p.ReleaseAll(pid))

    def sync(self) -> None:
        """Wait until the daemon processed every request sent so far; raise its errors."""
        self.request(p.Sync(), p.Synced)

    def list_timers(self) -> list[p.TimerInfo]:
        return self.request(p.ListTimers(), p.TimerList).timers

    def status(self) -> p.StatusInfo:
        return self.request(p.GetStatus(), p.StatusInfo)

    def events(
        self, since_ms: int | None = None, limit: int | None = None, follow: bool = False
    ) -> Iterator[p.EventBatch]:
        """Recent events; with ``follow``, keep yielding batches as they happen.

        A following connection carries nothing else: use a client of its own.
        """
        first = self.request(
            p.GetEvents(since_ms=since_ms, limit=limit, follow=follow), p.EventBatch
        )
        yield first
        if not follow:
            return
        conn = self._conn
        sock = conn.sock or conn.connect()
        while True:
            reply = conn.next_reply(sock, wait=None)  # events come when they happen
            if isinstance(reply, p.EventBatch) and reply.seq == first.seq:
                yield reply

    def list_dumps(self) -> list[p.DumpInfo]:
        """Saved stack dumps of processes killed for expired timers, oldest first."""
        return self.request(p.ListDumps(), p.DumpList).dumps

    def get_dump(self, dump_id: str) -> p.DumpText:
        return self.request(p.GetDump(dump_id), p.DumpText)

    def get_trace(self, dump_id: str, rank: int) -> p.DumpTrace:
        """The NCCL flight-recorder trace of global rank ``rank`` kept with a dump."""
        return self.request(p.GetDump(dump_id, trace=rank), p.DumpTrace)

    def timeline(self) -> list[p.TimerSpan]:
        """Recent timers from arming to their end, then those still armed (yours, if not admin)."""
        return self.request(p.GetTimeline(), p.Timeline).spans

    def scopes(self) -> p.ScopeList:
        """Duration statistics of released named scopes (yours, if not admin)."""
        return self.request(p.GetScopes(), p.ScopeList)

    def stragglers(self, job: bool = False) -> p.StragglerList:
        """Straggler scores of worker ranks per scope (yours, if not admin); ``job``: with
        every node's ranks of their jobs."""
        return self.request(p.GetStragglers(job), p.StragglerList)

    def device_time(self, scope_id: str, seconds: float) -> None:
        """Report the device time of this process's last completed ``scope_id`` (pipelined)."""
        self._send(p.DeviceTime(scope_id, seconds))

    def progress(self, step: int) -> None:
        """Report that this process completed training step ``step`` (pipelined)."""
        self._send(p.Progress(step))

    def list_groups(self) -> list[GroupInfo]:
        return self.request(p.ListGroups(), p.GroupList).groups

    def submit_group(self, spec: GroupSpec) -> str:
        """Start a worker group in the daemon (root or the admin group only)."""
        return self.request(p.SubmitGroup(spec), p.Ok).message

    def stop_group(self, name: str) -> str:
        return self.request(p.StopGroup(name), p.Ok).message

    def restart_group(self, name: str) -> str:
        return self.request(p.RestartGroup(name), p.Ok).message

    def inject_fault(self, name: str, fault: Fault) -> str:
        """Inject ``fault`` into group ``name`` (a drill: the config must enable it)."""
        return self.request(p.InjectFault(name, fault), p.Ok).message

    def request(self, message: p.Request, expect: type[_R]) -> _R:
        """Send ``message`` and wait for its reply, which must be an ``expect``."""
        return self._conn.request(message, expect)

    @property
    def welcome(self) -> p.Welcome | None:
        """The daemon's answer to this connection's hello (None before the first call)."""
        return self._conn.welcome

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SocketTimerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, message: p.Request) -> None:
        """Send one request (pipelined); raise an error that arrived for an earlier one."""
        conn = self._conn
        conn.send(encode(message))
        conn.raise_pending()


def _rearm_frames(held: dict[str, tuple[float, int, bool]]) -> Iterator[bytes]:
    """What a new connection must carry first: the timers the client holds."""
    for scope_id, (expiration_time, signal, learn) in held.items():
        # A learned one is resolved again, by the daemon now serving.
        yield encode(p.Acquire(scope_id, expiration_time, signal, learn=learn))


def _forget_connections_after_fork() -> None:
    # The daemon identifies a connection by the pid that opened it: a forked
    # child must open its own rather than arm timers on its parent, and must
    # not dump its stacks into the file named for its parent.
    for client in list(_live_clients):
        client._conn.forget_after_fork()
        client._held.clear()


os.register_at_fork(after_in_child=_forget_connections_after_fork)
