"""One socket connection's conversation, without I/O (as h11 is for HTTP).

The transport (:mod:`watchdogd.service.socket_front`) feeds a
:class:`Session` the bytes it received and carries out what comes back:
encoded replies to send, a reply that carries a descriptor, the switch to
an event stream, or the end of the connection. The session decodes frames
with one typed decoder into the protocol's tagged union and dispatches
them with ``match``; timer requests call the timer service's operations,
the same ones the FIFO front uses.

Rules
-----
- The peer's identity is fixed at accept (kernel credentials); every
  request acts with it. By default a request targets the peer's own pid,
  pinned by its pidfd.
- ``hello`` first, with the daemon's protocol version, or the request is
  refused (a version mismatch ends the connection).
- ``acquire``, ``release`` and ``release_all`` are answered only on error.
- A frame longer than ``max_frame`` cannot be skipped safely: it is
  reported and ends the connection. A bug costs one request (``internal``),
  never the daemon.
- What reads files (the dumps, their traces) is answered :class:`OffLoop`:
  the transport runs it in a worker thread, so a slow disk never holds the
  loop.
- Bounded work per turn: after every ``FRAMES_PER_TURN`` frames
  (``ADMIN_FRAMES_PER_TURN`` for root and the admin group, whose trainers
  arm the node's timers) the session yields :class:`Turn`, and the transport lets the rest of the
  loop run (the expiry loop first of all) before it asks for more. A peer
  that floods the socket gets the loop for ~64 requests at a time, never for
  the ~16,000 empty frames one 64 KiB read can hold. A query that walks a
  table or the event ring ends the turn by itself. Before each turn, and
  every ``EXPIRY_CHECK_FRAMES`` frames within one, it expires what is due
  (``TimerOperations.expire_due``): the expiry loop's own wake-up would wait
  for every other connection's turn of the same loop iteration, so a kill
  waits for a few frames, not a turn per flooding connection.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import NamedTuple, Protocol

import msgspec

from watchdogd.core.policy import Requester
from watchdogd.core.ports import GroupControl, GroupError, StepReports
from watchdogd.linux.procs import ProcessHandle
from watchdogd.linux.stacks import StackStore
from watchdogd.service.eventlog import EventLog
from watchdogd.service.stats import Stats
from watchdogd.service.timer_core import Audit, ErrorReply, TimerOperations
from watchdogd_client import protocol as p
from watchdogd_client.framing import FrameSplitter, FrameTooLargeError, frame

__all__ = [
    "ADMIN_FRAMES_PER_TURN",
    "FRAMES_PER_TURN",
    "Close",
    "Follow",
    "OffLoop",
    "Peer",
    "Queries",
    "Scopes",
    "SendFd",
    "Session",
    "SessionPorts",
    "Turn",
]

log = logging.getLogger("watchdogd")

_request_decoder = msgspec.msgpack.Decoder(p.Request)
_reply_encoder = msgspec.msgpack.Encoder()
# Frames served before a connection gives the loop back (about 1-2 ms of work).
FRAMES_PER_TURN = 64
ADMIN_FRAMES_PER_TURN = 512
# Frames served between two looks at the clock for deadlines that passed (~0.1 ms of work).
EXPIRY_CHECK_FRAMES = 16
# Replies made by walking the timers, the event ring or the sketches: up to
# milliseconds each (a full ring is ~2 ms), so each ends its connection's turn.
_SCANS = (p.TimerList, p.EventBatch, p.Timeline, p.ScopeList, p.StragglerList)
_REQUEST_COUNTER = {kind: f"socket.{kind.__struct_config__.tag}" for kind in p.Request.__args__}


def encode(reply: p.Reply) -> bytes:
    return frame(_reply_encoder.encode(reply))


class Queries(Protocol):
    """The live timers and the recent ones, as a peer may see them (``uid`` None: all)."""

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList: ...

    def timeline_spans(self, uid: int | None) -> list[p.TimerSpan]: ...


class Scopes(Protocol):
    """What released timers taught, and the GPU's time of a scope."""

    def scope_list(self, seq: int, uid: int | None) -> p.ScopeList: ...

    def straggler_list(self, seq: int, uid: int | None, job: bool) -> p.StragglerList: ...

    def device_time(self, pid: int, scope_id: str, seconds: float) -> ErrorReply | None: ...


class StackDumps(Protocol):
    def register_stack_dumps(self, pid: int, signal: int, marker: bool = False) -> int | None:
        """The file a client's faulthandler writes to; None when not wanted."""
        ...


class SessionPorts(NamedTuple):
    """What a session may reach, the same for every connection."""

    timers: TimerOperations
    audit: Audit
    queries: Queries
    scopes: Scopes
    dumps: StackDumps
    events: EventLog
    stacks: StackStore
    groups: GroupControl
    steps: StepReports
    stats: Stats
    status: Callable[[int, bool], p.StatusInfo]
    """``status(seq, admin)``: what the peer may see of the daemon's status."""


class Peer:
    """A connection's kernel-checked identity."""

    __slots__ = ("admin", "handle", "pid", "requester", "uid")

    def __init__(self, pid: int, uid: int, admin: bool, handle: ProcessHandle | None) -> None:
        self.pid = pid
        self.uid = uid
        self.admin = admin
        self.requester = Requester("socket", uid, admin)
        self.handle = handle
        """The peer itself, pinned by the pidfd the kernel took at connect (None if unknown)."""


class SendFd(NamedTuple):
    """Send this encoded reply with ``fd`` attached (``SCM_RIGHTS``), then close ``fd``."""

    data: bytes
    fd: int


class Follow(NamedTuple):
    """Send what is queued, then stream events on this connection until it closes."""

    request: p.GetEvents
    seq: int


class Close(NamedTuple):
    """Send what is queued, then close the connection."""


class OffLoop(NamedTuple):
    """Send what is queued, then the reply ``work`` makes in a worker thread (it reads files)."""

    seq: int
    work: Callable[[], p.Reply]


class Turn(NamedTuple):
    """Send what is queued and let the loop run other work before the next frames."""


_TURN = Turn()

Outgoing = bytes | SendFd | Follow | OffLoop | Close | Turn


class Session:
    def __init__(self, ports: SessionPorts, peer: Peer, max_frame: int) -> None:
        self.ports = ports
        self.peer = peer
        self.seq = 0
        self.greeted = False
        self._splitter = FrameSplitter(max_frame)

    def feed(self, data: bytes) -> Iterator[Outgoing]:
        """What to send in answer to ``data``, in order; a :class:`Close` is last.

        A :class:`Turn` every ``FRAMES_PER_TURN`` frames (``ADMIN_FRAMES_PER_TURN``
        for an admin peer): the caller yields to the loop there, then goes on iterating.
        """
        per_turn = ADMIN_FRAMES_PER_TURN if self.peer.admin else FRAMES_PER_TURN
        budget = per_turn
        timers = self.ports.timers
        timers.expire_due()
        try:
            for payload in self._splitter.feed(data):
                budget -= 1
                if budget < 0:
                    budget = per_turn - 1
                    yield _TURN
                    timers.expire_due()
                elif not budget % EXPIRY_CHECK_FRAMES:
                    timers.expire_due()  # within a turn too: an admin's is ~2 ms
                reply = self._handle_frame(payload)
                if reply is None:
                    continue
                if isinstance(reply, _SCANS):
                    budget = 0  # it walked a table or the event ring: its turn is over
                if isinstance(reply, Follow | SendFd | OffLoop):
                    yield reply
                    continue
                yield self._encode(reply)
                if isinstance(reply, p.Error) and reply.code == "version_mismatch":
                    yield Close()
                    return
        except FrameTooLargeError as e:
            self.ports.audit.bad_input("socket", str(e), b"", self.peer.uid)
            yield encode(p.Error(self.seq, "bad_frame", f"{e}; closing"))
            yield Close()

    def _handle_frame(self, payload: bytes) -> p.Reply | Follow | SendFd | OffLoop | None:
        seq = self.seq
        self.seq += 1
        try:
            request = _request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            self.ports.audit.bad_input("socket", str(e), payload[:64], self.peer.uid)
            return p.Error(seq, "bad_request", str(e))
        try:
            return self._dispatch(seq, request)
        except Exception as e:
            # A bug must cost one request, never the daemon and its timers.
            log.exception(
                "internal error serving %s from pid %d", type(request).__name__, self.peer.pid
            )
            return p.Error(seq, "internal", f"{type(e).__name__}: {e}")

    def _encode(self, reply: p.Reply) -> bytes:
        """``reply``'s frame; one a port made wrong costs its request, as a bug in it would."""
        try:
            return encode(reply)
        except Exception as e:
            log.exception(
                "internal error encoding %s for pid %d", type(reply).__name__, self.peer.pid
            )
            return encode(p.Error(reply.seq, "internal", f"{type(e).__name__}: {e}"))

    def _greet(self, seq: int, request: p.Request) -> p.Reply | SendFd:
        if not isinstance(request, p.Hello):
            return p.Error(seq, "hello_required", "send hello before any other request")
        if request.version != p.PROTOCOL_VERSION:
            return p.Error(
                seq,
                "version_mismatch",
                f"daemon speaks protocol {p.PROTOCOL_VERSION}, client {request.version}",
            )
        self.greeted = True
        peer = self.peer
        welcome = p.Welcome(seq, p.PROTOCOL_VERSION, os.getpid(), peer.pid, peer.uid)
        if request.stack_signal is None:
            return welcome
        try:
            fd = self.ports.dumps.register_stack_dumps(
                peer.pid, request.stack_signal, request.dump_marker
            )
        except OSError as e:
            log.error("cannot open a stack dump file for pid %d: %s", peer.pid, e.strerror)
            fd = None
        if fd is None:
            return welcome
        return SendFd(encode(msgspec.structs.replace(welcome, stack_dumps=True)), fd)

    def _dispatch(self, seq: int, request: p.Request) -> p.Reply | Follow | SendFd | OffLoop | None:
        if not self.greeted:
            return self._greet(seq, request)
        ports, peer = self.ports, self.peer
        ports.stats.requests[_REQUEST_COUNTER[type(request)]] += 1
        timers = ports.timers
        error: ErrorReply | None
        target = peer.pid
        match request:
            case p.Acquire(scope_id, expiration_time, signal, pid, learn):
                target = peer.pid if pid is None else pid
                pinned = peer.handle if pid is None else None
                error = timers.arm(
                    peer.requester, target, scope_id, expiration_time, signal, pinned, learn
                )
            case p.Release(scope_id, pid):
                target = peer.pid if pid is None else pid
                error = timers.release(peer.requester, target, scope_id)
            case p.ReleaseAll(pid):
                target = peer.pid if pid is None else pid
                error = timers.release_all(peer.requester, target)
            case p.Sync():
                return p.Synced(seq)
            case p.ListTimers():
                # Operators see every timer; others only those on their own processes.
                return ports.queries.timer_list(seq, None if peer.admin else peer.uid)
            case p.GetStatus():
                return ports.status(seq, peer.admin)
            case p.GetEvents(since_ms=since_ms, limit=limit, follow=follow):
                if follow:
                    return Follow(request, seq)
                return p.EventBatch(seq, ports.events.since(since_ms, limit))
            case p.ListDumps():
                return OffLoop(seq, lambda: p.DumpList(seq, ports.stacks.list()))
            case p.GetDump(dump_id, None):
                return OffLoop(seq, partial(self._read_dump, seq, dump_id))
            case p.GetDump(dump_id, int(rank)):
                return OffLoop(seq, partial(self._read_trace, seq, dump_id, rank))
            case p.GetTimeline():
                # As for timers: operators see every one, others those of their processes.
                spans = ports.queries.timeline_spans(None if peer.admin else peer.uid)
                return p.Timeline(seq, spans)
            case p.GetScopes():
                # As for timers: operators see every scope, others those of their processes.
                return ports.scopes.scope_list(seq, None if peer.admin else peer.uid)
            case p.GetStragglers(job=job):
                # As for scopes: operators see every rank, others those of their processes
                # (and, with ``job``, the other nodes' ranks of those processes' jobs).
                return ports.scopes.straggler_list(seq, None if peer.admin else peer.uid, job)
            case p.DeviceTime(scope_id, seconds):
                error = ports.scopes.device_time(peer.pid, scope_id, seconds)
            case p.Progress(step):
                ports.steps.step_reported(peer.pid, step)
                return None
            case p.ListGroups():
                return p.GroupList(seq, ports.groups.infos())
            case (
                p.SubmitGroup()
                | p.StopGroup()
                | p.RestartGroup()
                | p.InjectFault()
                | p.ClearQuarantine()
            ):
                return self._control_group(seq, request)
            case p.Hello():
                return p.Error(seq, "bad_request", "hello was already sent on this connection")
        if error is None:
            return None
        ports.audit.refused("socket", target, getattr(request, "scope_id", ""), error, peer.uid)
        return p.Error(seq, *error)

    def _read_dump(self, seq: int, dump_id: str) -> p.Reply:
        found = self.ports.stacks.read(dump_id)
        if found is None:
            return p.Error(seq, "bad_request", f"no stack dump {dump_id!r}")
        return p.DumpText(seq, *found)

    def _read_trace(self, seq: int, dump_id: str, rank: int) -> p.Reply:
        found = self.ports.stacks.read_trace(dump_id, rank)
        if isinstance(found, str):
            return p.Error(seq, "bad_request", found)
        info, data = found
        return p.DumpTrace(seq, info, rank, data)

    def _control_group(
        self,
        seq: int,
        request: p.SubmitGroup | p.StopGroup | p.RestartGroup | p.InjectFault | p.ClearQuarantine,
    ) -> p.Reply:
        if not self.peer.admin:
            return p.Error(
                seq,
                "refused",
                "only root and the admin group may submit, stop, restart or inject faults into "
                "groups, or clear a quarantine",
            )
        groups = self.ports.groups
        try:
            match request:
                case p.SubmitGroup(spec):
                    groups.submit(spec)
                    return p.Ok(seq, f"group {spec.name} started")
                case p.StopGroup(name):
                    groups.stop(name)
                    return p.Ok(seq, f"group {name} stopping")
                case p.RestartGroup(name):
                    groups.restart(name)
                    return p.Ok(seq, f"group {name} restarting")
                case p.InjectFault(name, fault):
                    groups.inject(name, fault)
                    return p.Ok(seq, f"{fault.kind} injected into rank {fault.rank} of {name}")
                case p.ClearQuarantine(node):
                    return p.Ok(seq, groups.clear_quarantine(node))
        except GroupError as e:
            return p.Error(seq, "group_error", str(e))
