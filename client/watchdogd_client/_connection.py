"""One client's connection to the daemon: hello, pipelined frames, replies, reconnects.

Requests are sent and not waited for: the daemon answers a timer request
only when it fails, and :meth:`Connection.raise_pending` raises such an
answer at the first call made a millisecond or more after it arrived (after
that call's own request was sent, so a release is never held back by an
older error). :meth:`Connection.request` waits for the reply to its own.

When the daemon goes away (a restart, an upgrade), the next send connects
again, and sends what the owner wants re-sent (``rearm``: the timers it
holds) before its own request.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec

from . import protocol as p
from ._errors import DaemonUnavailableError, ProtocolError, RequestError
from ._frames import encode
from ._stack_dumps import StackDumpFile, can_mark
from ._trace_server import serve_trace
from .framing import FrameSplitter, FrameTooLargeError

__all__ = ["Connection"]

_R = TypeVar("_R", bound=p.Reply)

_reply_decoder = msgspec.msgpack.Decoder(p.Reply)
# How often a call looks for error replies (see raise_pending).
PENDING_CHECK_NS = 1_000_000


class Connection:
    """The socket to the daemon at ``path``, connected on first use and again after a loss."""

    def __init__(
        self,
        path: str,
        *,
        timeout: float,
        name: str,
        stack_dumps: StackDumpFile,
        rearm: Callable[[], Iterable[bytes]],
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.name = name
        self.stack_dumps = stack_dumps
        self.rearm = rearm
        self.sock: socket.socket | None = None
        self._poller = select.poll()
        self._next_seq = 0
        self._splitter = FrameSplitter(p.MAX_FRAME_SIZE)
        self._frames: deque[bytes] = deque()  # received, not yet decoded
        self.errors: list[RequestError] = []
        self.next_check = 0
        """When :meth:`raise_pending` next polls for replies (``time.monotonic_ns()``)."""
        self.welcome: p.Welcome | None = None

    def send(self, data: bytes) -> int:
        """Send one framed request; its seq. Errors already waiting are collected, not raised."""
        sock = self.sock or self.connect()
        try:
            self._sendall(sock, data)
        except DaemonUnavailableError:
            raise
        except OSError:
            # The daemon went away (restart, upgrade): reconnect once, re-arm
            # what the owner holds, then send this request.
            self.close()
            sock = self.connect()
            self._sendall(sock, data)
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def request(self, message: p.Request, expect: type[_R]) -> _R:
        """Send ``message`` and wait for its reply, which must be an ``expect``."""
        seq = self.send(encode(message))
        sock = self.sock or self.connect()
        while True:
            reply = self.next_reply(sock)
            if reply.seq == seq:
                break
            if isinstance(reply, p.Error):
                self.errors.append(RequestError(reply.code, reply.message, reply.seq))
        self.raise_pending()
        if isinstance(reply, p.Error):
            raise RequestError(reply.code, reply.message, reply.seq)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.__name__} for seq {seq}, got {reply!r}")
        return reply

    def raise_pending(self) -> None:
        """Raise the oldest error reply that arrived (looking at most every millisecond)."""
        # A poll() costs more than the rest of an acquire; a clock read is a
        # tenth of one. Looking at most every PENDING_CHECK_NS bounds how late
        # an answer is seen: the first call that long after it arrived raises it.
        now = time.monotonic_ns()
        if now >= self.next_check:
            self.next_check = now + PENDING_CHECK_NS
            sock = self.sock
            if sock is not None and self._poller.poll(0):
                self._recv(sock, 0)
                while (reply := self._pop_frame()) is not None:
                    if isinstance(reply, p.Error):
                        self.errors.append(RequestError(reply.code, reply.message, reply.seq))
        if self.errors:
            raise self.errors.pop(0)

    def next_reply(self, sock: socket.socket, wait: float | None = -1.0) -> p.Reply:
        """The next reply, waiting up to ``wait`` seconds (-1: the timeout; None: forever)."""
        timeout = self.timeout if wait is not None and wait < 0 else wait
        while True:
            reply = self._pop_frame()
            if reply is not None:
                return reply
            self._recv(sock, timeout)

    def close(self) -> None:
        if self.sock is not None:
            self._poller.unregister(self.sock)
            self.sock.close()
            self.sock = None

    def forget_after_fork(self) -> None:
        """Drop the parent's socket and errors (the child's requests need its own)."""
        self.stack_dumps.forget()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self._poller = select.poll()
        self.errors.clear()

    # -- connecting --------------------------------------------------------------

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError, TimeoutError) as e:
            sock.close()
            raise DaemonUnavailableError(self.path, e.strerror or type(e).__name__) from None
        self.sock = sock
        self._poller.register(sock, select.POLLIN)
        self._splitter = FrameSplitter(p.MAX_FRAME_SIZE)
        self._frames.clear()
        self._next_seq = 1
        self._hello(sock)
        serve_trace()
        for data in self.rearm():
            self._sendall(sock, data)
            self._next_seq += 1
        return sock

    def _hello(self, sock: socket.socket) -> None:
        stack_signal = self.stack_dumps.free_signal()
        marker = stack_signal is not None and can_mark(stack_signal)
        try:
            sock.sendall(encode(p.Hello(p.PROTOCOL_VERSION, self.name, stack_signal, marker)))
            fds = self._recv_welcome(sock)
            sock.setblocking(False)
            welcome = self.next_reply(sock)
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
            self.stack_dumps.register(stack_signal, fds.pop(0), marker)
        for fd in fds:
            os.close(fd)

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

    # -- bytes -----------------------------------------------------------------------

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
