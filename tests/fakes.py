"""Fakes at the ports, as supervisor's ``DummyOptions`` stands in for every syscall.

Each fake satisfies its Protocol (:class:`~watchdogd.service.timer_core.TimerOperations`,
:class:`~watchdogd.service.timer_core.Audit`, the session's ``Queries``, ``Scopes`` and
``StackDumps``, :class:`~watchdogd.core.ports.GroupControl`), records what it was asked,
and answers what the test set: a front driven with bytes is then checked by what it
asked of them. :class:`FakePorts` gathers them with the real ``EventLog`` and ``Stats``
(which do no I/O) into the :class:`~watchdogd.service.session.SessionPorts` a session takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from watchdogd.core.policy import Requester
from watchdogd.core.ports import GroupError
from watchdogd.linux.procs import ProcessHandle
from watchdogd.linux.stacks import StackStore
from watchdogd.service.eventlog import EventLog
from watchdogd.service.session import SessionPorts
from watchdogd.service.stats import Stats
from watchdogd.service.timer_core import ErrorReply
from watchdogd_client import protocol as p
from watchdogd_client.groups import Fault, GroupInfo, GroupSpec

__all__ = [
    "FakeAudit",
    "FakeDumps",
    "FakeGroups",
    "FakePorts",
    "FakeQueries",
    "FakeScopes",
    "FakeTimers",
    "TimerCall",
]


class TimerCall(NamedTuple):
    """One call to :class:`FakeTimers`; ``op`` is the method's name."""

    op: str
    requester: Requester | None = None
    pid: int | None = None
    scope_id: str = ""
    expiration_time: float = 0.0
    signal: int = 0
    pinned: ProcessHandle | None = None
    learn: bool = False


class FakeTimers:
    """``TimerOperations``: every call in order (``expire_due`` too), answered ``refusal``."""

    def __init__(self) -> None:
        self.calls: list[TimerCall] = []
        self.refusal: ErrorReply | None = None

    @property
    def expiry_checks(self) -> int:
        return sum(call.op == "expire_due" for call in self.calls)

    @property
    def requests(self) -> list[TimerCall]:
        """The calls a request made (every one but ``expire_due``)."""
        return [call for call in self.calls if call.op != "expire_due"]

    def arm(
        self,
        requester: Requester,
        pid: int,
        scope_id: str,
        expiration_time: float,
        signal: int,
        pinned: ProcessHandle | None = None,
        learn: bool = False,
    ) -> ErrorReply | None:
        call = TimerCall("arm", requester, pid, scope_id, expiration_time, signal, pinned, learn)
        self.calls.append(call)
        return self.refusal

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None:
        self.calls.append(TimerCall("release", requester, pid, scope_id))
        return self.refusal

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None:
        self.calls.append(TimerCall("release_all", requester, pid))
        return self.refusal

    def expire_due(self) -> None:
        self.calls.append(TimerCall("expire_due"))


class FakeAudit:
    """``Audit``: what a front reported, with the arguments it gave."""

    def __init__(self) -> None:
        self.bad_inputs: list[tuple[str, str, bytes, int | None]] = []
        self.refusals: list[tuple[str, int, str, ErrorReply, int | None]] = []
        self.connections_refused: list[tuple[int, int, str, str]] = []

    def bad_input(self, via: str, reason: str, sample: bytes, uid: int | None = None) -> None:
        self.bad_inputs.append((via, reason, sample, uid))

    def refused(
        self, via: str, pid: int, scope_id: str, error: ErrorReply, uid: int | None = None
    ) -> None:
        self.refusals.append((via, pid, scope_id, error, uid))

    def connection_refused(self, pid: int, uid: int, limit: str, reason: str) -> None:
        self.connections_refused.append((pid, uid, limit, reason))


class FakeQueries:
    """``Queries``: no timers; the uid each query was made for (None: all)."""

    def __init__(self) -> None:
        self.uids: list[int | None] = []

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList:
        self.uids.append(uid)
        return p.TimerList(seq, [], 0)

    def timeline_spans(self, uid: int | None) -> list[p.TimerSpan]:
        self.uids.append(uid)
        return []


class FakeSteps:
    """``StepReports``: the ``(pid, step)`` of each step reported."""

    def __init__(self) -> None:
        self.reported: list[tuple[int, int]] = []

    def step_reported(self, pid: int, step: int) -> None:
        self.reported.append((pid, step))


class FakeScopes:
    """``Scopes``: no scopes; the uid each query was made for, the device times reported."""

    def __init__(self) -> None:
        self.uids: list[int | None] = []
        self.device_times: list[tuple[int, str, float]] = []
        self.refusal: ErrorReply | None = None

    def scope_list(self, seq: int, uid: int | None) -> p.ScopeList:
        self.uids.append(uid)
        return p.ScopeList(seq, [], 0)

    def straggler_list(self, seq: int, uid: int | None, job: bool) -> p.StragglerList:
        self.uids.append(uid)
        return p.StragglerList(seq, [], window=0, threshold=0.0, windows=0)

    def device_time(self, pid: int, scope_id: str, seconds: float) -> ErrorReply | None:
        self.device_times.append((pid, scope_id, seconds))
        return self.refusal


class FakeDumps:
    """``StackDumps``: the registrations asked for, answered with ``fd`` (None: not wanted)."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, bool]] = []
        self.fd: int | None = None

    def register_stack_dumps(self, pid: int, signal: int, marker: bool = False) -> int | None:
        self.registered.append((pid, signal, marker))
        return self.fd


class FakeGroups:
    """``GroupControl``: no groups; each command as ``(op, name)``, refused with ``refusal``."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str]] = []
        self.refusal: str | None = None

    def _command(self, op: str, name: str) -> None:
        self.commands.append((op, name))
        if self.refusal is not None:
            raise GroupError(self.refusal)

    def submit(self, spec: GroupSpec) -> object:
        self._command("submit", spec.name)
        return None

    def stop(self, name: str) -> None:
        self._command("stop", name)

    def restart(self, name: str) -> None:
        self._command("restart", name)

    def inject(self, name: str, fault: Fault) -> None:
        self._command(f"inject {fault.kind}", name)

    def clear_quarantine(self, node: str) -> str:
        self._command("clear quarantine", node)
        return f"clearing {node}"

    def infos(self) -> list[GroupInfo]:
        return []


@dataclass
class FakePorts:
    """A fake of each port a session reaches, the real ``EventLog`` and ``Stats``.

    ``stacks`` is a real store over ``dumps_dir``: it reads the directory only
    when a dump request's off-loop work is run.
    """

    dumps_dir: Path
    timers: FakeTimers = field(default_factory=FakeTimers)
    audit: FakeAudit = field(default_factory=FakeAudit)
    queries: FakeQueries = field(default_factory=FakeQueries)
    scopes: FakeScopes = field(default_factory=FakeScopes)
    dumps: FakeDumps = field(default_factory=FakeDumps)
    groups: FakeGroups = field(default_factory=FakeGroups)
    steps: FakeSteps = field(default_factory=FakeSteps)
    events: EventLog = field(default_factory=EventLog)
    stats: Stats = field(default_factory=Stats)
    status_calls: list[tuple[int, bool]] = field(default_factory=list)
    """``(seq, admin)`` of each status asked."""

    def status(self, seq: int, admin: bool) -> p.StatusInfo:
        self.status_calls.append((seq, admin))
        return p.StatusInfo(
            seq=seq,
            version="test",
            pid=0,
            uptime_s=0.0,
            socket_path="",
            fifo_path="",
            timers=0,
            processes=0,
            connections=0,
            requests=dict(self.stats.requests),
            expired=0,
            signalled=0,
            refused=0,
            bad_input=0,
        )

    def ports(self) -> SessionPorts:
        return SessionPorts(
            timers=self.timers,
            audit=self.audit,
            queries=self.queries,
            scopes=self.scopes,
            dumps=self.dumps,
            events=self.events,
            stacks=StackStore(self.dumps_dir),
            groups=self.groups,
            steps=self.steps,
            stats=self.stats,
            status=self.status,
        )
