"""The socket client: pipelined timer requests and blocking queries.

``acquire``/``release`` write one frame and return: the daemon answers them
only when they fail, and a failure is raised by the first call made a
millisecond or more after it arrived (after that call's own request was
sent, so a release is never held back by an older error).
:meth:`SocketTimerClient.sync` waits until the daemon has processed
everything sent so far.

The client remembers the scopes it holds. When the daemon goes away (it was
restarted, or upgraded), the next call reconnects and re-arms them before
sending its own request; a deadline that passed meanwhile fires at once.

Stack dumps: the client registers :mod:`faulthandler` on its stack signal,
writing into a file the daemon handed over. Connected from the main thread,
it also installs a Python handler for that signal, which faulthandler
chains to once its dump is written: the handler appends
:data:`~watchdogd_client.protocol.DUMP_MARKER`, and the daemon signals the
process as soon as it reads it. A main thread stuck in C code runs no Python
handler; the daemon then waits until the file stops growing, as it does
for clients that write no marker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import select
import signal as _signal
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TypeVar

import msgspec

from . import _faults
from . import protocol as p
from ._errors import DaemonUnavailableError, ProtocolError, RequestError
from ._paths import default_socket_path
from ._timer_client import TimerClient
from .framing import FrameSplitter, FrameTooLargeError, frame
from .groups import Fault, GroupInfo, GroupSpec

__all__ = ["SocketTimerClient"]

_R = TypeVar("_R", bound=p.Reply)

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(p.Reply)
# How often acquire/release look for error replies (see _raise_pending).
_PENDING_CHECK_NS = 1_000_000
# The frames of acquire and release for the scopes in use, so that the hot
# path encodes nothing but the deadline (a third of the cost of encoding the
# Struct and framing it). Still msgspec's bytes, never msgpack written by
# hand: its output for a placeholder deadline, cut around msgspec's encoding
# of that float, is joined around msgspec's encoding of the real one. Bounded:
# a program that names a scope per step refills it instead of growing it.
_FRAME_CACHE_SIZE = 1024
_acquire_frames: dict[tuple[str, int], tuple[bytes, bytes] | None] = {}
"""(scope, signal) -> the frame before and after the deadline (None: cannot be cut)."""
_release_frames: dict[str, bytes] = {}
# A positive float: msgspec writes it as 0xcb then a byte below 0x80, and no
# UTF-8 text has 0xcb before such a byte, so no scope name can contain it.
_PLACEHOLDER = 1.5
_live_clients: weakref.WeakSet[SocketTimerClient] = weakref.WeakSet()
# stack signal -> the faulthandler file its dump marker goes to (the last one registered).
_marker_fds: dict[int, int] = {}


def _write_dump_marker(signum: int, frame: object) -> None:
    """Chained to by faulthandler's handler, so it runs once the dump is written."""
    fd = _marker_fds.get(signum, -1)
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(fd, p.DUMP_MARKER)


def _can_mark(signum: int) -> bool:
    """Whether this thread can have a dump marker written after faulthandler's output."""
    return (
        _signal.getsignal(signum) is _write_dump_marker
        or threading.current_thread() is threading.main_thread()
    )


_K = TypeVar("_K")
_V = TypeVar("_V")


def _cache(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    if len(cache) >= _FRAME_CACHE_SIZE:
        cache.clear()
    cache[key] = value
    return value


def _acquire_parts(scope_id: str, signal: int) -> tuple[bytes, bytes] | None:
    """The framed ``Acquire`` of ``scope_id`` cut around its deadline, if it can be."""
    data = frame(_encoder.encode(p.Acquire(scope_id, _PLACEHOLDER, signal)))
    placeholder = _encoder.encode(_PLACEHOLDER)
    if data.count(placeholder) != 1:
        return None
    head, _, tail = data.partition(placeholder)
    return head, tail


def _acquire_frame(scope_id: str, expiration_time: float, signal: int) -> bytes:
    """``frame(encode(Acquire(scope_id, expiration_time, signal)))``, from the cache.

    msgspec writes every float in 9 bytes (float64), so the frame's length
    is the placeholder's and only the deadline's bytes differ.
    """
    key = (scope_id, signal)
    try:
        parts = _acquire_frames[key]
    except KeyError:
        parts = _cache(_acquire_frames, key, _acquire_parts(scope_id, signal))
    if parts is None:
        return frame(_encoder.encode(p.Acquire(scope_id, expiration_time, signal)))
    return parts[0] + _encoder.encode(expiration_time) + parts[1]


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
        self._sock: socket.socket | None = None
        self._poller = select.poll()
        self._next_seq = 0
        self._splitter = FrameSplitter(p.MAX_FRAME_SIZE)
        self._frames: deque[bytes] = deque()  # received, not yet decoded
        self._errors: list[RequestError] = []
        self._next_check = 0
        """When ``_raise_pending`` next polls for replies (``time.monotonic_ns()``)."""
        self._held: dict[str, tuple[float, int, bool]] = {}
        """Scope -> (expiration time, signal, learned): what a reconnect re-arms."""
        self.welcome: p.Welcome | None = None
        self.stack_signal = stack_signal
        self._stack_fd = -1
        _live_clients.add(self)
        _faults.install()  # only where the daemon offers fault injection

    # -- TimerClient -----------------------------------------------------------

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm ``scope_id`` for this process, expiring at ``expiration_time`` (wall clock)."""
        if expiration_time < 0:
            self.release(scope_id)
            return
        self._send_frame(_acquire_frame(scope_id, float(expiration_time), self.signal))
        self._held[scope_id] = (expiration_time, self.signal, False)
        self._raise_pending()

    def acquire_learned(self, scope_id: str, initial: float | None) -> None:
        """Arm ``scope_id`` with the deadline the daemon learned for it (``LEARN``).

        ``initial``: seconds, the deadline while the scope is still being
        learned (None: the daemon's rule for the scope must give one).
        """
        expiration_time = math.inf if initial is None else time.time() + initial
        self._send(p.Acquire(scope_id, expiration_time, self.signal, learn=True))
        self._held[scope_id] = (expiration_time, self.signal, True)
        self._raise_pending()

    def release(self, scope_id: str) -> None:
        """Disarm ``scope_id`` for this process."""
        if _faults.active is not None:
            _faults.hang_if_injected()
        self._held.pop(scope_id, None)
        data = _release_frames.get(scope_id)
        if data is None:
            data = _cache(_release_frames, scope_id, frame(_encoder.encode(p.Release(scope_id))))
        self._send_frame(data)
        self._raise_pending()

    # -- beyond torch ----------------------------------------------------------

    def acquire_for(self, pid: int, scope_id: str, expiration_time: float, signal: int) -> None:
        """Arm a timer on another process (needs the daemon's permission)."""
        self._send(p.Acquire(scope_id, expiration_time, signal, pid))
        self._raise_pending()

    def release_for(self, pid: int, scope_id: str) -> None:
        self._send(p.Release(scope_id, pid))
        self._raise_pending()

    def release_all(self, pid: int | None = None) -> None:
        """Disarm every timer of ``pid`` (default: this process)."""
        if pid is None:
            self._held.clear()
        self._send(p.ReleaseAll(pid))
        self._raise_pending()

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
        sock = self._connected()
        while True:
            reply = self._next_reply(sock, wait=None)  # events come when they happen
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
        self._raise_pending()

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
        seq = self._send(message)
        sock = self._connected()
        while True:
            reply = self._next_reply(sock)
            if reply.seq == seq:
                break
            if isinstance(reply, p.Error):
                self._errors.append(RequestError(reply.code, reply.message, reply.seq))
        self._raise_pending()
        if isinstance(reply, p.Error):
            raise RequestError(reply.code, reply.message, reply.seq)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.__name__} for seq {seq}, got {reply!r}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SocketTimerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------

    def _send(self, message: p.Request) -> int:
        """Send one request; its seq. Errors already waiting are collected, not raised."""
        return self._send_frame(frame(_encoder.encode(message)))

    def _send_frame(self, data: bytes) -> int:
        """Send one framed request; its seq."""
        sock = self._sock or self._connect()
        try:
            self._sendall(sock, data)
        except DaemonUnavailableError:
            raise
        except OSError:
            # The daemon went away (restart, upgrade): reconnect once, re-arm
            # what we hold, then send this request.
            self.close()
            sock = self._connect()
            self._sendall(sock, data)
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _sendall(self, sock: socket.socket, data: bytes) -> None:
        """Send without waiting when the kernel has room (the usual case), else wait, bounded.

        The socket is non-blocking: a blocking one with a timeout costs a
        ``poll`` per send, which is most of the price of an ``acquire``.
        """
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        rest = memoryview(data)[sent:]
        room = select.poll()
        room.register(sock, select.POLLOUT)
        deadline = time.monotonic() + self.timeout
        while rest:
            if not room.poll(max(0.0, deadline - time.monotonic()) * 1000):
                self.close()
                raise DaemonUnavailableError(self.path, "the daemon stopped reading requests")
            try:
                rest = rest[sock.send(rest) :]
            except BlockingIOError:
                continue

    def _raise_pending(self) -> None:
        # A poll() costs more than the rest of an acquire; a clock read is a
        # tenth of one. Looking at most every _PENDING_CHECK_NS bounds how late
        # an answer is seen: the first call that long after it arrived raises it.
        now = time.monotonic_ns()
        if now >= self._next_check:
            self._next_check = now + _PENDING_CHECK_NS
            sock = self._sock
            if sock is not None and self._poller.poll(0):
                self._read_available(sock)
        if self._errors:
            raise self._errors.pop(0)

    def _connected(self) -> socket.socket:
        return self._sock or self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError, TimeoutError) as e:
            sock.close()
            raise DaemonUnavailableError(self.path, e.strerror or type(e).__name__) from None
        self._sock = sock
        self._poller.register(sock, select.POLLIN)
        self._splitter = FrameSplitter(p.MAX_FRAME_SIZE)
        self._frames.clear()
        self._next_seq = 1
        stack_signal = self._free_stack_signal()
        marker = stack_signal is not None and _can_mark(stack_signal)
        hello = p.Hello(p.PROTOCOL_VERSION, self.name, stack_signal, marker)
        try:
            sock.sendall(frame(_encoder.encode(hello)))
            fds = self._recv_welcome(sock)
            sock.setblocking(False)
            welcome = self._next_reply(sock)
        except DaemonUnavailableError:
            self.close()
            raise
        if isinstance(welcome, p.Error):
            self.close()
            raise ProtocolError(f"daemon at {self.path} refused hello: {welcome.message}")
        if not isinstance(welcome, p.Welcome):
            self.close()
            raise ProtocolError(f"daemon at {self.path} answered hello with {welcome!r}")
        self.welcome = welcome
        if stack_signal is not None and welcome.stack_dumps and fds:
            self._register_faulthandler(stack_signal, fds.pop(0), marker)
        for fd in fds:
            os.close(fd)
        for scope_id, (expiration_time, signal, learn) in self._held.items():
            # A learned one is resolved again, by the daemon now serving.
            rearm = p.Acquire(scope_id, expiration_time, signal, learn=learn)
            self._sendall(sock, frame(_encoder.encode(rearm)))
            self._next_seq += 1
        return sock

    def _free_stack_signal(self) -> int | None:
        """The stack signal, if nobody else handles it (or we registered it ourselves)."""
        if self.stack_signal is None:
            return None
        handler = _signal.getsignal(self.stack_signal)
        if self._stack_fd < 0 and handler not in (_signal.SIG_DFL, _write_dump_marker):
            return None
        return self.stack_signal

    def _recv_welcome(self, sock: socket.socket) -> list[int]:
        """Read the start of the welcome, keeping any descriptors that came with it.

        Up to two: the faulthandler file, and the shared-memory page an older
        daemon (release slots) sent after it, which the caller closes unused.
        """
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
        except OSError as e:
            raise DaemonUnavailableError(self.path, e.strerror or type(e).__name__) from None
        if not data:
            raise DaemonUnavailableError(self.path, "the daemon closed the connection")
        self._received(data)
        return list(fds)

    def _register_faulthandler(self, signal: int, fd: int, marker: bool) -> None:
        if marker:
            _marker_fds[signal] = fd
            if _signal.getsignal(signal) is not _write_dump_marker:
                # faulthandler chains to the handler it found when first registered:
                # ours must be there first (a registration without it is redone).
                faulthandler.unregister(signal)
                _signal.signal(signal, _write_dump_marker)
        faulthandler.register(signal, file=fd, all_threads=True, chain=marker)
        if self._stack_fd >= 0:
            os.close(self._stack_fd)  # the previous daemon's file
        self._stack_fd = fd

    def _next_reply(self, sock: socket.socket, wait: float | None = -1.0) -> p.Reply:
        """The next reply, waiting up to ``wait`` seconds (-1: the client's timeout)."""
        timeout = self.timeout if wait is not None and wait < 0 else wait
        while True:
            reply = self._pop_frame()
            if reply is not None:
                return reply
            self._recv(sock, timeout)

    def _read_available(self, sock: socket.socket) -> None:
        self._recv(sock, 0)
        while (reply := self._pop_frame()) is not None:
            if isinstance(reply, p.Error):
                self._errors.append(RequestError(reply.code, reply.message, reply.seq))

    def _recv(self, sock: socket.socket, timeout: float | None) -> None:
        """Read what has arrived, waiting up to ``timeout`` seconds (None: forever)."""
        if not self._poller.poll(None if timeout is None else timeout * 1000):
            self.close()
            raise DaemonUnavailableError(self.path, f"no reply within {timeout}s")
        try:
            chunk = sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as e:
            self.close()
            raise DaemonUnavailableError(self.path, e.strerror or type(e).__name__) from None
        if not chunk:
            self.close()
            raise DaemonUnavailableError(self.path, "the daemon closed the connection")
        self._received(chunk)

    def _pop_frame(self) -> p.Reply | None:
        if not self._frames:
            return None
        try:
            reply: p.Reply = _reply_decoder.decode(self._frames.popleft())
        except msgspec.DecodeError as e:
            self.close()
            raise ProtocolError(f"daemon at {self.path} sent an undecodable reply: {e}") from None
        return reply

    def _received(self, data: bytes) -> None:
        try:
            self._frames.extend(self._splitter.feed(data))
        except FrameTooLargeError as e:
            self.close()
            raise ProtocolError(f"daemon at {self.path} sent a {e.size}-byte frame") from None


def _forget_connections_after_fork() -> None:
    # The daemon identifies a connection by the pid that opened it: a forked
    # child must open its own rather than arm timers on its parent, and must
    # not dump its stacks into the file named for its parent.
    for client in list(_live_clients):
        if client._stack_fd >= 0 and client.stack_signal is not None:
            faulthandler.unregister(client.stack_signal)
            if _signal.getsignal(client.stack_signal) is _write_dump_marker:
                with contextlib.suppress(ValueError):
                    _signal.signal(client.stack_signal, _signal.SIG_DFL)
            _marker_fds.pop(client.stack_signal, None)
            os.close(client._stack_fd)
            client._stack_fd = -1
        if client._sock is not None:
            client._sock.close()
            client._sock = None
            client._poller = select.poll()
        client._held.clear()
        client._errors.clear()


os.register_at_fork(after_in_child=_forget_connections_after_fork)
