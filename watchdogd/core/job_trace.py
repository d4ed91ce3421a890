"""A job's timeline as a Chrome trace (the JSON that Perfetto and Chrome's DevTools open). Pure.

Built from the daemon's events and its timers' spans (armed → released,
expired or dropped):

- a process per node, named after it, and in it a track (a "thread") per
  global rank, one per worker group, one per other process that armed
  timers, and one for the daemon itself;
- on a rank's track, a slice per attempt (the worker's start to its exit),
  and inside it a slice per timer, named after its scope;
- on a group's track, a slice per attempt (HEALTHY until it leaves it) and
  per rendezvous round;
- instants for kills (and escalations), dumps, restarts, and whatever the
  rendezvous reports (a node lost, nodes waiting, a node fenced off…).

A worker's timers land on its rank's track by its pid, as the
``worker_started`` events name it. Anything still open (a running attempt,
a timer still armed) ends at ``end``. Times are microseconds since the
epoch, so traces of several nodes line up when their ``traceEvents`` are
put in one file; each node's process id is derived from its name for that
reason.
"""

from __future__ import annotations

import signal
import zlib
from collections.abc import Iterable, Mapping
from typing import Literal, Protocol

import msgspec

__all__ = ["ChromeTrace", "EventRecord", "SpanRecord", "TraceEvent", "build_trace"]

Metadata = str | int | float | bool | None
_US = 1_000_000


class EventRecord(Protocol):
    """What the trace reads of an event (``watchdogd_client.events.Event``)."""

    @property
    def name(self) -> str: ...

    @property
    def timestamp(self) -> int:
        """Milliseconds since the epoch."""
        ...

    @property
    def metadata(self) -> Mapping[str, Metadata]: ...


class SpanRecord(Protocol):
    """What the trace reads of a timer's life (``watchdogd_client.protocol.TimerSpan``)."""

    @property
    def pid(self) -> int: ...

    @property
    def scope_id(self) -> str: ...

    @property
    def armed(self) -> float: ...

    @property
    def ended(self) -> float | None: ...

    @property
    def outcome(self) -> str: ...


class TraceEvent(msgspec.Struct, omit_defaults=True):
    """One entry of the Trace Event Format: a slice (``X``), an instant (``i``), a name (``M``)."""

    name: str
    ph: Literal["X", "i", "M"]
    pid: int
    tid: int
    ts: float = 0.0
    dur: float | None = None
    cat: str = ""
    s: Literal["t", "p", "g"] | None = None
    """An instant's scope: its track (``t``)."""
    args: dict[str, Metadata] = {}


class ChromeTrace(msgspec.Struct, rename="camel"):
    trace_events: list[TraceEvent]
    display_time_unit: str = "ms"


# Track order within a node: the daemon, the groups, the ranks, other processes.
_DAEMON_TID = 0
_GROUP_TID = 1
_RANK_TID = 1_000
_PID_TID = 10_000_000


class _Attempt(msgspec.Struct):
    """One worker's attempt, while the trace is built."""

    host: str
    rank: int
    name: str
    start: float
    args: dict[str, Metadata]
    end: float | None = None


class _Builder:
    def __init__(self, hostname: str, end: float) -> None:
        self.hostname = hostname
        self.end_us = end * _US
        self.out: list[TraceEvent] = []
        self.nodes: dict[str, int] = {}
        self.tracks: dict[tuple[int, int], str] = {}
        self.groups: dict[tuple[str, str], int] = {}
        # worker pid -> (node, rank), from worker_started
        self.workers: dict[int, tuple[str, int]] = {}
        # worker pid -> its attempt: start, end (None: running), and what is shown of it
        self.attempts: dict[int, _Attempt] = {}
        # worker pid -> when its last timer ended: an attempt's slice holds its timers,
        # whose times are finer than the events' milliseconds
        self.last_timer: dict[int, float] = {}
        self.healthy: dict[tuple[str, str], tuple[float, int]] = {}

    # -- tracks --------------------------------------------------------------------

    def node(self, hostname: object) -> int:
        host = str(hostname) if hostname else self.hostname
        pid = self.nodes.get(host)
        if pid is None:
            pid = self.nodes[host] = zlib.crc32(host.encode()) & 0x7FFFFFFF
            self.out.append(TraceEvent("process_name", "M", pid, 0, args={"name": host}))
        return pid

    def track(self, pid: int, tid: int, name: str) -> tuple[int, int]:
        if (pid, tid) not in self.tracks:
            self.tracks[pid, tid] = name
            self.out.append(TraceEvent("thread_name", "M", pid, tid, args={"name": name}))
            self.out.append(
                TraceEvent("thread_sort_index", "M", pid, tid, args={"sort_index": tid})
            )
        return pid, tid

    def rank_track(self, hostname: object, rank: int) -> tuple[int, int]:
        return self.track(self.node(hostname), _RANK_TID + rank, f"rank {rank}")

    def group_track(self, hostname: object, group: str) -> tuple[int, int]:
        node = self.node(hostname)
        key = (str(hostname or self.hostname), group)
        if key not in self.groups:
            self.groups[key] = _GROUP_TID + len([k for k in self.groups if k[0] == key[0]])
        return self.track(node, self.groups[key], f"group {group}")

    def pid_track(self, pid: int) -> tuple[int, int]:
        """The rank's track of a worker, else a track of the process's own."""
        worker = self.workers.get(pid)
        if worker is not None:
            return self.rank_track(*worker)
        return self.track(self.node(None), _PID_TID + pid, f"pid {pid}")

    def daemon_track(self) -> tuple[int, int]:
        return self.track(self.node(None), _DAEMON_TID, "watchdogd")

    # -- entries -------------------------------------------------------------------

    def slice(
        self,
        where: tuple[int, int],
        name: str,
        cat: str,
        start_us: float,
        end_us: float,
        /,
        **args: Metadata,
    ) -> None:
        pid, tid = where
        duration = max(0.0, end_us - start_us)
        self.out.append(TraceEvent(name, "X", pid, tid, start_us, duration, cat, args=args))

    def instant(
        self, where: tuple[int, int], name: str, cat: str, at_us: float, /, **args: Metadata
    ) -> None:
        pid, tid = where
        self.out.append(TraceEvent(name, "i", pid, tid, at_us, cat=cat, s="t", args=args))

    # -- events --------------------------------------------------------------------

    def event(self, event: EventRecord) -> None:
        at = event.timestamp * 1000.0
        meta = event.metadata
        name = event.name
        if name == "worker_started":
            self._worker_started(at, meta)
        elif name in ("worker_exited", "worker_failed"):
            self._worker_ended(at, meta)
        elif name == "group_state":
            self._group_state(at, meta)
        elif name == "rendezvous_round":
            where = self.group_track(meta.get("hostname"), str(meta.get("group")))
            waited = float(meta.get("waited_s") or 0)
            self.slice(where, "rendezvous", "rendezvous", at - waited * _US, at, **meta)
        elif name.startswith("rdzv_"):
            where = self.group_track(None, str(meta.get("group")))
            what = name.removeprefix("rdzv_").replace("_", " ")
            self.instant(where, what, "rendezvous", at, **meta)
        elif name == "timer_expired":
            self._expired(at, meta)
        elif name == "process_escalated":
            where = self.pid_track(int(meta.get("pid") or 0))
            self.instant(where, "SIGKILL after the grace", "kill", at, **meta)
        elif name in _DAEMON_INSTANTS:
            self.instant(self.daemon_track(), name.replace("_", " "), "daemon", at, **meta)

    def _worker_started(self, at: float, meta: Mapping[str, Metadata]) -> None:
        pid, rank = int(meta.get("worker_id") or 0), int(meta.get("global_rank") or 0)
        host = str(meta.get("hostname") or self.hostname)
        self.workers[pid] = (host, rank)
        attempt = f"attempt {meta.get('attempt') or 0}"
        self.attempts[pid] = _Attempt(host, rank, attempt, at, {"group": meta.get("group")})

    def _worker_ended(self, at: float, meta: Mapping[str, Metadata]) -> None:
        attempt = self.attempts.get(int(meta.get("worker_id") or 0))
        if attempt is not None:
            attempt.end = at
            attempt.args.update(exitcode=meta.get("exitcode"), reason=meta.get("reason"))

    def _group_state(self, at: float, meta: Mapping[str, Metadata]) -> None:
        group, host = str(meta.get("group")), meta.get("hostname")
        where = self.group_track(host, group)
        key = (str(host or self.hostname), group)
        old, new, attempt = meta.get("old"), meta.get("state"), int(meta.get("attempt") or 0)
        if new == "HEALTHY":
            self.healthy[key] = (at, attempt)
            if old == "STOPPED":
                self.instant(where, f"restart: attempt {attempt}", "restart", at, **meta)
        elif old == "HEALTHY" and key in self.healthy:
            start, attempt = self.healthy.pop(key)
            name = f"attempt {attempt}"
            self.slice(where, name, "attempt", start, at, ended=str(new), reason=meta.get("reason"))
        if new in ("SUCCEEDED", "FAILED", "UNHEALTHY"):
            self.instant(where, str(new), "group", at, **meta)

    def _expired(self, at: float, meta: Mapping[str, Metadata]) -> None:
        where = self.pid_track(int(meta.get("pid") or 0))
        scope, action = meta.get("scope_id"), meta.get("action")
        if meta.get("dump"):
            self.instant(where, f"dump {meta['dump']}", "dump", at, **meta)
        if action == "signalled":
            killed = f"kill {_signal_name(meta.get('signal'))}: {scope}"
            self.instant(where, killed, "kill", at, **meta)
        else:
            self.instant(where, f"expired: {scope} ({action})", "expiry", at, **meta)

    def span(self, span: SpanRecord) -> None:
        end = self.end_us if span.ended is None else span.ended * _US
        where = self.pid_track(span.pid)
        start = span.armed * _US
        self.slice(where, span.scope_id, "timer", start, end, pid=span.pid, outcome=span.outcome)
        self.last_timer[span.pid] = max(end, self.last_timer.get(span.pid, 0.0))

    def close(self) -> None:
        """Each worker's attempt, around its timers; what is still open ends at the trace's end."""
        for pid, a in self.attempts.items():
            end = max(self.end_us if a.end is None else a.end, self.last_timer.get(pid, 0.0))
            where = self.rank_track(a.host, a.rank)
            self.slice(where, a.name, "attempt", a.start, end, pid=pid, **a.args)
        for (host, group), (start, attempt) in self.healthy.items():
            where = self.group_track(host, group)
            self.slice(where, f"attempt {attempt}", "attempt", start, self.end_us, ended=None)


# Daemon-wide events worth a mark on the timeline; per-request ones (refusals, bad
# input) are not: they can come by the thousand.
_DAEMON_INSTANTS = frozenset(
    {"daemon_started", "daemon_stopping", "config_reloaded", "gpu_fault", "group_error"}
)


def _signal_name(number: Metadata) -> str:
    try:
        return signal.Signals(int(number or 0)).name
    except ValueError:
        return f"signal {number}"


def build_trace(
    events: Iterable[EventRecord], spans: Iterable[SpanRecord], *, hostname: str, end: float
) -> ChromeTrace:
    """The timeline of ``events`` and ``spans`` on node ``hostname``, open ends closed at ``end``.

    ``end`` is seconds since the epoch (the time the trace is taken).
    """
    builder = _Builder(hostname, end)
    builder.daemon_track()
    # Events first: their worker_started tell whose rank each timer's pid was.
    for event in sorted(events, key=lambda e: e.timestamp):
        builder.event(event)
    for span in spans:
        builder.span(span)
    builder.close()
    # Metadata first; then by time, the longer of two slices that start together first,
    # so that slices nest as the viewers expect.
    builder.out.sort(key=lambda e: (e.ph != "M", e.ts, -(e.dur or 0.0)))
    return ChromeTrace(builder.out)
