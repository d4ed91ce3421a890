"""The socket front: one task per connection, frames in, replies out.

Each connection is identified once, at accept, by ``SO_PEERCRED``; every
request on it then acts with that identity. Requests are decoded with one
typed decoder into the protocol's tagged union and dispatched with
``match``; timer requests call the daemon's shared operations, the same ones
the FIFO uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct

import anyio
import anyio.abc
import msgspec
from anyio.abc import SocketAttribute

from watchdogd.core.policy import Requester
from watchdogd.groups.supervisor import GroupError
from watchdogd.linux.procs import ProcessHandle, open_process
from watchdogd.service.framing import FrameSplitter, FrameTooLargeError
from watchdogd_client import protocol as p

TYPE_CHECKING = False
if TYPE_CHECKING:
    from watchdogd.daemon import Daemon, ErrorReply

__all__ = ["SocketFront"]

log = logging.getLogger("watchdogd")

_UCRED = struct.Struct("3i")
# Linux socket options the socket module does not name (linux/asm-generic/socket.h).
_SO_PEERGROUPS = 59
_SO_PEERPIDFD = 77
_MAX_GROUPS = 1024


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


_request_decoder = msgspec.msgpack.Decoder(p.Request)
_reply_encoder = msgspec.msgpack.Encoder()
_REQUEST_COUNTER = {kind: f"socket.{kind.__struct_config__.tag}" for kind in p.Request.__args__}


class _Peer:
    """A socket connection's kernel-checked identity and its request counter."""

    __slots__ = ("admin", "gid", "greeted", "handle", "pid", "requester", "seq", "uid")

    def __init__(self, pid: int, uid: int, gid: int, admin: bool) -> None:
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.admin = admin
        self.requester = Requester("socket", uid, admin)
        self.seq = 0
        self.greeted = False
        self.handle: ProcessHandle | None = None


class _WithFd(msgspec.Struct, frozen=True):
    """A reply that carries a descriptor (``SCM_RIGHTS``): the faulthandler file."""

    reply: p.Reply
    fd: int


class _Follow(msgspec.Struct, frozen=True):
    """Not a reply: the connection turns into a stream of events."""

    request: p.GetEvents
    seq: int


class SocketFront:
    """Serves the daemon's Unix socket."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def serve(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
            pid, uid, gid = _UCRED.unpack(
                raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if self.daemon.connections >= self.daemon.limits.max_connections:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await stream.send(
                        self._encode(
                            p.Error(-1, "limit_exceeded", "too many connections (max_connections)")
                        )
                    )
                return
            peer = _Peer(pid, uid, gid, self._is_admin(raw, uid, gid))
            peer.handle = _pin_peer(raw, pid)
            self.daemon.connections += 1
            try:
                await self._converse(stream, peer)
            finally:
                self.daemon.connections -= 1
                if peer.handle is not None:
                    peer.handle.close()

    def _is_admin(self, raw: socket.socket, uid: int, gid: int) -> bool:
        """Root, or in the admin group — by the groups the kernel recorded at connect time.

        Not ``/proc/<peer pid>``: by now that pid may name another process.
        """
        admin_gid = self.daemon.admin_gid
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

    async def _converse(self, stream: anyio.abc.SocketStream, peer: _Peer) -> None:
        """Serve one connection until it closes or must be closed.

        Replies are sent in batches; once ``max_pending_bytes`` of them wait,
        the daemon sends before it reads another request, so a client that
        sends and never reads stalls only itself, at a bounded cost.
        """
        splitter = FrameSplitter(self.daemon.limits.max_frame)
        limit = self.daemon.limits.max_pending_bytes
        outbox: list[bytes] = []
        pending = 0

        async def flush() -> None:
            nonlocal pending
            if outbox:
                data = b"".join(outbox)
                outbox.clear()
                pending = 0
                await stream.send(data)

        try:
            while True:
                try:
                    data = await stream.receive(1 << 16)
                except anyio.EndOfStream:
                    return
                try:
                    for payload in splitter.feed(data):
                        reply = self._handle_frame(peer, payload)
                        if reply is None:
                            continue
                        if isinstance(reply, _Follow):
                            await flush()
                            await self._stream_events(stream, reply)
                            return
                        if isinstance(reply, _WithFd):
                            await flush()
                            await self._send_with_fd(stream, reply)
                            continue
                        encoded = self._encode(reply)
                        outbox.append(encoded)
                        pending += len(encoded)
                        if isinstance(reply, p.Error) and reply.code == "version_mismatch":
                            await flush()
                            return
                        if pending >= limit:
                            await flush()
                except FrameTooLargeError as e:
                    self.daemon.bad_input("socket", str(e), b"")
                    outbox.append(self._encode(p.Error(peer.seq, "bad_frame", f"{e}; closing")))
                    await flush()
                    return
                await flush()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return

    async def _stream_events(self, stream: anyio.abc.SocketStream, follow: _Follow) -> None:
        since, limit = follow.request.since_ms, follow.request.limit
        with self.daemon.events.follow(since, limit) as (backlog, follower):
            await stream.send(self._encode(p.EventBatch(follow.seq, backlog)))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._until_closed, stream, tg.cancel_scope)
                async for event in follower.receive:
                    batch = [event]
                    while len(batch) < 256:
                        try:
                            batch.append(follower.receive.receive_nowait())
                        except anyio.WouldBlock:
                            break
                    reply = p.EventBatch(follow.seq, batch, follower.take_dropped())
                    await stream.send(self._encode(reply))

    @staticmethod
    async def _until_closed(stream: anyio.abc.SocketStream, scope: anyio.CancelScope) -> None:
        """A follower sends nothing more: what arrives is the end (or ignored)."""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                await stream.receive()
        scope.cancel()

    def _faulthandler_fd(self, pid: int, signal: int) -> int | None:
        daemon = self.daemon
        if not 0 < signal < 65 or signal == 9:
            return None
        handle = daemon.processes.get(pid)
        if handle is None:
            try:
                handle = open_process(pid)
            except (ProcessLookupError, OSError):
                return None
            daemon.watch_process(handle)
        try:
            return daemon.reaper.register_faulthandler(handle, signal)
        except OSError as e:
            log.error("cannot open a stack dump file for pid %d: %s", pid, e.strerror)
            return None

    async def _send_with_fd(self, stream: anyio.abc.SocketStream, item: _WithFd) -> None:
        try:
            if isinstance(stream, anyio.abc.UNIXSocketStream):
                await stream.send_fds(self._encode(item.reply), [item.fd])
            else:
                await stream.send(self._encode(item.reply))
        finally:
            os.close(item.fd)

    @staticmethod
    def _encode(reply: p.Reply) -> bytes:
        return p.frame(_reply_encoder.encode(reply))

    def _handle_frame(self, peer: _Peer, payload: bytes) -> p.Reply | _Follow | _WithFd | None:
        seq = peer.seq
        peer.seq += 1
        try:
            request = _request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            self.daemon.bad_input("socket", str(e), payload[:64])
            return p.Error(seq, "bad_request", str(e))
        try:
            return self._dispatch(seq, peer, request)
        except Exception as e:
            # A bug must cost one request, never the daemon and its timers.
            log.exception("internal error serving %s from pid %d", type(request).__name__, peer.pid)
            return p.Error(seq, "internal", f"{type(e).__name__}: {e}")

    def _dispatch(
        self, seq: int, peer: _Peer, request: p.Request
    ) -> p.Reply | _Follow | _WithFd | None:
        if not peer.greeted:
            if not isinstance(request, p.Hello):
                return p.Error(seq, "hello_required", "send hello before any other request")
            if request.version != p.PROTOCOL_VERSION:
                return p.Error(
                    seq,
                    "version_mismatch",
                    f"daemon speaks protocol {p.PROTOCOL_VERSION}, client {request.version}",
                )
            peer.greeted = True
            welcome = p.Welcome(seq, p.PROTOCOL_VERSION, os.getpid(), peer.pid, peer.uid)
            if request.stack_signal is None:
                return welcome
            fd = self._faulthandler_fd(peer.pid, request.stack_signal)
            if fd is None:
                return welcome
            return _WithFd(msgspec.structs.replace(welcome, stack_dumps=True), fd)
        self.daemon.requests[_REQUEST_COUNTER[type(request)]] += 1
        error: ErrorReply | None
        target = peer.pid
        match request:
            case p.Acquire(scope_id, expiration_time, signal, pid):
                target = peer.pid if pid is None else pid
                pinned = peer.handle if pid is None else None
                error = self.daemon.arm(
                    peer.requester, target, scope_id, expiration_time, signal, pinned
                )
            case p.Release(scope_id, pid):
                target = peer.pid if pid is None else pid
                error = self.daemon.release(peer.requester, target, scope_id)
            case p.ReleaseAll(pid):
                target = peer.pid if pid is None else pid
                error = self.daemon.release_all(peer.requester, target)
            case p.Sync():
                return p.Synced(seq)
            case p.ListTimers():
                # Operators see every timer; others only those on their own processes.
                return self.daemon.timer_list(seq, None if peer.admin else peer.uid)
            case p.GetStatus():
                return self.daemon.status(seq)
            case p.GetEvents(since_ms=since_ms, limit=limit, follow=follow):
                if follow:
                    return _Follow(request, seq)
                return p.EventBatch(seq, self.daemon.events.since(since_ms, limit))
            case p.ListDumps():
                return p.DumpList(seq, self.daemon.reaper.stacks.list())
            case p.GetDump(dump_id):
                found = self.daemon.reaper.stacks.read(dump_id)
                if found is None:
                    return p.Error(seq, "bad_request", f"no stack dump {dump_id!r}")
                return p.DumpText(seq, *found)
            case p.ListGroups():
                return p.GroupList(seq, [r.info() for r in self.daemon.supervisor.groups.values()])
            case p.SubmitGroup() | p.StopGroup() | p.RestartGroup():
                return self._control_group(seq, peer, request)
            case p.Hello():
                return p.Error(seq, "bad_request", "hello was already sent on this connection")
        if error is None:
            return None
        self.daemon.refused("socket", target, getattr(request, "scope_id", ""), error)
        return p.Error(seq, *error)

    def _control_group(
        self, seq: int, peer: _Peer, request: p.SubmitGroup | p.StopGroup | p.RestartGroup
    ) -> p.Reply:
        if not peer.admin:
            return p.Error(
                seq, "refused", "only root and the admin group may submit, stop or restart groups"
            )
        try:
            match request:
                case p.SubmitGroup(spec):
                    self.daemon.supervisor.submit(spec)
                    return p.Ok(seq, f"group {spec.name} started")
                case p.StopGroup(name):
                    self.daemon.supervisor.get(name).stop()
                    return p.Ok(seq, f"group {name} stopping")
                case p.RestartGroup(name):
                    self.daemon.supervisor.get(name).restart()
                    return p.Ok(seq, f"group {name} restarting")
        except GroupError as e:
            return p.Error(seq, "group_error", str(e))
