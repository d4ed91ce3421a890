"""The socket front's transport: accept, identify, move bytes for a :class:`Session`.

Each connection is identified once, at accept, by ``SO_PEERCRED`` (and its
pidfd and groups, where the kernel records them); the conversation itself
is the sans-IO :class:`~watchdogd.service.session.Session`. Replies are
sent in batches; once ``max_pending_bytes`` of them wait, the front sends
before it reads another request, so a client that sends and never reads
stalls only itself, at a bounded cost. Every ``FRAMES_PER_TURN`` requests
of one connection it gives the loop back (:class:`~watchdogd.service.session.Turn`),
so a connection that floods holds the loop for one turn at a time, and
every other connection and the expiry loop run in between.

A connection past ``limits.max_connections``, or past
``limits.max_connections_per_uid`` of its uid (root and the admin group are
held to the first only: they arm the node's timers), is answered
``Error(-1, limit_exceeded)`` and closed at accept, with a
``connection_refused`` event (rate-limited, as bad input is). The per-uid
cap keeps one unprivileged user from taking the whole connection table,
and bounds how many turns of its own it can have in each loop iteration.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import struct
from collections import Counter
from collections.abc import Callable

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import SocketAttribute

from watchdogd.core.config import SocketSettings
from watchdogd.linux.procs import ProcessHandle, open_process
from watchdogd.service.session import (
    Close,
    Follow,
    OffLoop,
    Peer,
    SendFd,
    Session,
    SessionPorts,
    Turn,
    encode,
)
from watchdogd_client import protocol as p

__all__ = ["SocketFront"]

_UCRED = struct.Struct("3i")
# Linux socket options the socket module does not name (linux/asm-generic/socket.h).
_SO_PEERGROUPS = 59
_SO_PEERPIDFD = 77
_MAX_GROUPS = 1024
# Events sent to a follower in one frame at most.
_EVENT_BATCH = 256
# The longest a reply read from disk may take (a hung filesystem ties up one thread).
_OFF_LOOP_TIMEOUT = 10.0

log = logging.getLogger("watchdogd")


def _pin_peer(raw: socket.socket, pid: int) -> ProcessHandle | None:
    """The peer process itself, by the pidfd the kernel took at connect (Linux 6.5+).

    A request with no pid targets this very process, never a later one that
    got its number after it exited. None where the kernel cannot say.
    """
    try:
        pidfd = raw.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        return None
    try:
        return open_process(pid, pidfd)
    except (ProcessLookupError, OSError):
        return None


def _group_gid(name: str | None) -> int | None:
    """The admin group's gid; None when there is none, or no such group (yet)."""
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _is_admin(raw: socket.socket, uid: int, gid: int, admin_gid: int | None) -> bool:
    """Root, or in the admin group — by the groups the kernel recorded at connect time.

    Not ``/proc/<peer pid>``: by now that pid may name another process.
    """
    if uid == 0:
        return True
    if admin_gid is None:
        return False
    if gid == admin_gid:
        return True
    try:
        data = raw.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError:
        return False
    groups = struct.unpack(f"{len(data) // 4}I", data)
    return admin_gid in groups


class SocketFront:
    """Serves the daemon's Unix socket."""

    def __init__(self, ports: SessionPorts, settings: SocketSettings) -> None:
        self.ports = ports
        self.settings = settings
        self.admin_gid = _group_gid(settings.admin_group)
        self.per_uid: Counter[int] = Counter()
        """Connections open now, by the peer's uid (root's and the admin group's too)."""

    def reconfigure(self, settings: SocketSettings) -> None:
        """Apply reloaded limits to the connections still to come; look the admin group up
        again (it may have been created since)."""
        self.settings = settings
        self.admin_gid = _group_gid(settings.admin_group)

    async def serve(self, stream: anyio.abc.SocketStream) -> None:
        stats, limits = self.ports.stats, self.settings
        async with stream:
            raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
            pid, uid, gid = _UCRED.unpack(
                raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            admin = _is_admin(raw, uid, gid, self.admin_gid)
            per_uid = self.per_uid
            if stats.connections >= limits.max_connections:
                reason = f"too many connections (max_connections {limits.max_connections})"
                await self._refuse(stream, pid, uid, "max_connections", reason)
                return
            if not admin and per_uid[uid] >= limits.max_connections_per_uid:
                reason = (
                    f"too many connections from uid {uid} "
                    f"(max_connections_per_uid {limits.max_connections_per_uid})"
                )
                await self._refuse(stream, pid, uid, "max_connections_per_uid", reason)
                return
            peer = Peer(pid, uid, admin, _pin_peer(raw, pid))
            stats.connections += 1
            per_uid[uid] += 1
            try:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._converse(stream, Session(self.ports, peer, limits.max_frame))
            finally:
                stats.connections -= 1
                per_uid[uid] -= 1
                if not per_uid[uid]:
                    del per_uid[uid]
                if peer.handle is not None:
                    peer.handle.close()

    async def _refuse(
        self, stream: anyio.abc.SocketStream, pid: int, uid: int, limit: str, reason: str
    ) -> None:
        """Answer a connection past ``limit`` with ``Error(-1, limit_exceeded)``; it closes next."""
        self.ports.audit.connection_refused(pid, uid, limit, reason)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await stream.send(encode(p.Error(-1, "limit_exceeded", reason)))

    async def _converse(self, stream: anyio.abc.SocketStream, session: Session) -> None:
        """Serve one connection until it closes or must be closed."""
        limit = self.settings.max_pending_bytes
        outbox: list[bytes] = []
        pending = 0

        async def flush() -> None:
            nonlocal pending
            if outbox:
                data = b"".join(outbox)
                outbox.clear()
                pending = 0
                await stream.send(data)

        while True:
            try:
                data = await stream.receive(1 << 16)
            except anyio.EndOfStream:
                return
            for outgoing in session.feed(data):
                match outgoing:
                    case bytes():
                        outbox.append(outgoing)
                        pending += len(outgoing)
                        if pending >= limit:
                            await flush()
                    case SendFd(reply, fd):
                        await flush()
                        await self._send_with_fd(stream, reply, fd)
                    case OffLoop(seq, work):
                        await flush()
                        await stream.send(await self._off_loop(seq, work))
                    case Follow(request, seq):
                        await flush()
                        await self._stream_events(stream, request, seq)
                        return
                    case Close():
                        await flush()
                        return
                    case Turn():
                        await flush()
                        await anyio.lowlevel.checkpoint()
            await flush()

    @staticmethod
    async def _off_loop(seq: int, work: Callable[[], p.Reply]) -> bytes:
        """``work``'s reply, made and encoded in a thread (a trace may be megabytes), bounded."""

        def reply() -> bytes:
            try:
                return encode(work())
            except OSError as e:
                return encode(p.Error(seq, "internal", f"{e.filename}: {e.strerror}"))
            except Exception as e:  # a bug costs this request, never the connection
                log.exception("internal error reading a reply from disk")
                return encode(p.Error(seq, "internal", f"{type(e).__name__}: {e}"))

        with anyio.move_on_after(_OFF_LOOP_TIMEOUT):
            return await anyio.to_thread.run_sync(reply, abandon_on_cancel=True)
        message = f"the dumps directory did not answer within {_OFF_LOOP_TIMEOUT:.0f} s"
        return encode(p.Error(seq, "internal", message))

    async def _stream_events(
        self, stream: anyio.abc.SocketStream, request: p.GetEvents, seq: int
    ) -> None:
        with self.ports.events.follow(request.since_ms, request.limit) as (backlog, follower):
            await stream.send(encode(p.EventBatch(seq, backlog)))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._until_closed, stream, tg.cancel_scope)
                async for event in follower.receive:
                    batch = [event]
                    while len(batch) < _EVENT_BATCH:
                        try:
                            batch.append(follower.receive.receive_nowait())
                        except anyio.WouldBlock:
                            break
                    await stream.send(encode(p.EventBatch(seq, batch, follower.take_dropped())))

    @staticmethod
    async def _until_closed(stream: anyio.abc.SocketStream, scope: anyio.CancelScope) -> None:
        """A follower sends nothing more: what arrives is the end (or ignored)."""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                await stream.receive()
        scope.cancel()

    @staticmethod
    async def _send_with_fd(stream: anyio.abc.SocketStream, reply: bytes, fd: int) -> None:
        try:
            if isinstance(stream, anyio.abc.UNIXSocketStream):
                await stream.send_fds(reply, [fd])
            else:
                await stream.send(reply)
        finally:
            os.close(fd)
