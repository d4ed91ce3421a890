"""The daemon's side of the torch helper: start it, ask it, stop it — never blocking the loop.

The helper (:mod:`watchdogd.groups.torch_helper`) runs with the workers'
interpreter, which needs watchdogd (this package and the client) and torch.
It writes its own errors (and torch's logs) to the daemon's stderr. Each
:meth:`TorchHelper.call` sends one request and awaits its reply on the
socket that is the helper's stdin and stdout, one call at a time; a helper
that died, or answers out of step, raises :class:`HelperError`.

It is started with ``subprocess`` (vfork: ~1 ms at any size of the daemon)
on the loop's own thread, which lives as long as the daemon: the helper's
parent-death signal follows the thread that made it, and anyio ends idle
worker threads. The loop's own spawn would fork the daemon on the loop's
thread and wait there for the exec (~5 ms plus ~0.07 ms per MB it holds).
It is reaped from worker threads.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

import anyio
import anyio.abc
import msgspec

from watchdogd.groups.torch_wire import MAX_FRAME, Failed, Ready, Reply, Request
from watchdogd.linux import sessions
from watchdogd_client.framing import FrameSplitter, frame

__all__ = ["HelperError", "HelperFailedError", "TorchHelper"]

_STOP_TIMEOUT = 5.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Reply)

R = TypeVar("R", bound=Reply)


class HelperError(Exception):
    """The helper could not start, died, or answered out of step."""


class HelperFailedError(HelperError):
    """The helper answered :class:`Failed`: torch raised (``failure`` says what)."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(failure.message)
        self.failure = failure


class TorchHelper:
    """One helper process; ``python`` is the workers' interpreter (None: the daemon's)."""

    def __init__(self, python: str | None, *, pass_fds: Sequence[int] = ()) -> None:
        self.python = python or sys.executable
        self.pass_fds = tuple(pass_fds)
        self.ready: Ready | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._stream: anyio.abc.SocketStream | None = None
        self._splitter = FrameSplitter(MAX_FRAME)
        self._replies: deque[Reply] = deque()
        self._lock = anyio.Lock()

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "watchdogd.groups.torch_helper", str(os.getpid())]

    async def start(self) -> Ready:
        """Start the helper and wait for its first word; HelperError if it cannot run."""
        ours, theirs = socket.socketpair()
        try:
            with theirs:
                self._process = self._spawn(theirs.fileno())
            self._stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
        except BaseException as e:
            ours.close()
            if isinstance(e, OSError):
                raise HelperError(f"cannot start {self.python}: {e.strerror}") from None
            raise
        self.ready = await self._receive(Ready)
        return self.ready

    def _spawn(self, stdio: int) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            self.command,
            stdin=stdio,
            stdout=stdio,
            stderr=None,
            # Its own session: a Ctrl-C at the terminal is the daemon's to handle.
            start_new_session=True,
            pass_fds=self.pass_fds,
        )
        # The daemon's own child, not a worker's orphan (session containment's sweep).
        sessions.started_own(process.pid)
        return process

    async def call(self, request: Request, expect: type[R]) -> R:
        """Send ``request``, return its reply; HelperFailedError when torch raised."""
        async with self._lock:
            await self.send(request)
            return await self._receive(expect)

    async def send(self, request: Request) -> None:
        """Send ``request`` without waiting (its reply comes from :meth:`receive`)."""
        assert self._stream is not None
        try:
            await self._stream.send(frame(_encoder.encode(request)))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise HelperError(await self._gone()) from None

    async def receive(self, expect: type[R]) -> R:
        async with self._lock:
            return await self._receive(expect)

    async def _receive(self, expect: type[R]) -> R:
        assert self._stream is not None
        while not self._replies:
            try:
                chunk = await self._stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                raise HelperError(await self._gone()) from None
            self._replies.extend(_decoder.decode(p) for p in self._splitter.feed(chunk))
        reply = self._replies.popleft()
        if isinstance(reply, Failed):
            raise HelperFailedError(reply)
        if not isinstance(reply, expect):
            raise HelperError(f"the helper answered {type(reply).__name__}, not {expect.__name__}")
        return reply

    async def _gone(self) -> str:
        assert self._process is not None
        with anyio.move_on_after(_STOP_TIMEOUT):
            await self._wait()
        status = self._process.poll()
        how = "is stuck" if status is None else f"exited with status {status}"
        return (
            f"the torch helper ({' '.join(self.command[:3])}) {how}; its error, "
            f"if it wrote one, is above (it needs watchdogd and torch in {self.python})"
        )

    async def aclose(self) -> None:
        """Stop the helper (SIGTERM, SIGKILL after a grace) and reap it."""
        process = self._process
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
                with anyio.move_on_after(_STOP_TIMEOUT):
                    await self._wait()
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await self._wait()
            sessions.ended_own(process.pid)
            if self._stream is not None:
                await self._stream.aclose()

    async def _wait(self) -> None:
        """Reap the helper; cancelled, the abandoned thread reaps it later."""
        assert self._process is not None
        await anyio.to_thread.run_sync(self._process.wait, abandon_on_cancel=True)
