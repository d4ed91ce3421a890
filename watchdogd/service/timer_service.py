"""The timer service: the table, the processes it watches, and the expiry loop.

Both fronts (FIFO and socket) call the same synchronous operations here —
``arm``, ``release``, ``release_all`` — from the event loop. Arming pins the
target process by a pidfd the first time it gets a timer; the pidfd
becoming readable (the process exited) drops its timers. The expiry loop
sleeps until the table's next deadline, or until a request arms an earlier
one — never on a polling interval — and hands what expired to the reaper.

Rules
-----
- A request is judged by admission (limits, :mod:`watchdogd.core.admission`)
  and by the policy (who may target whom, :mod:`watchdogd.core.policy`); a
  refusal is an error code and a message, never an exception.
- The policy's verdict is cached per (process, requester, signal) until
  the process exits or the config is reloaded: a trainer re-arms the same
  timer thousands of times.
- Deadlines are monotonic; a wall-clock ``expiration_time`` is converted on
  receipt.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from signal import SIGKILL
from typing import Literal, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from watchdogd.core.admission import admit
from watchdogd.core.config import Config
from watchdogd.core.policy import Policy, Requester, Target, check, valid_signals
from watchdogd.core.ports import EventSink, Supervision
from watchdogd.core.scope_stats import ScopeKey, ScopeStats
from watchdogd.core.timers import Timer, TimerTable
from watchdogd.linux import aio
from watchdogd.linux.procs import ProcessHandle, ancestors, open_process
from watchdogd.linux.snapshot import SnapshotTimer
from watchdogd.linux.stacks import StackStore
from watchdogd.service.reaper import Reaper
from watchdogd.service.stats import Stats
from watchdogd.service.timeline import Timeline
from watchdogd_client import protocol as p

__all__ = ["IDLE_SCOPE", "ErrorReply", "TimerOperations", "TimerService"]

IDLE_SCOPE = "(idle)"
"""The timer a worker with an idle timeout holds while it holds no other."""

# libuv's timer resolution (uvloop): wake this much early, then watch the clock.
_TIMER_SLACK = 0.0015

ErrorReply = tuple[p.ErrorCode, str]


class TimerOperations(Protocol):
    """What a front does with a decoded request (both fronts, the same code)."""

    def arm(
        self,
        requester: Requester,
        pid: int,
        scope_id: str,
        expiration_time: float,
        signal: int,
        pinned: ProcessHandle | None = None,
    ) -> ErrorReply | None: ...

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None: ...

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None: ...

    def bad_input(self, via: str, reason: str, sample: bytes) -> None: ...

    def refused(self, via: str, pid: int, scope_id: str, error: ErrorReply) -> None: ...


def build_policy(config: Config) -> Policy:
    own = os.getpid()
    settings = config.policy
    fifo_uids = settings.fifo_allowed_uids
    return Policy(
        protected_pids=frozenset({1, own, *ancestors(own), *settings.protected_pids}),
        fifo_allowed_uids=frozenset([os.geteuid()] if fifo_uids is None else fifo_uids),
        allowed_signals=(
            valid_signals()
            if settings.allowed_signals is None
            else frozenset(settings.allowed_signals)
        ),
    )


class TimerService:
    """Timers armed over either front, and the processes they are armed on."""

    def __init__(
        self,
        config: Config,
        *,
        events: EventSink,
        stats: Stats,
        supervision: Supervision,
        stacks: StackStore,
        observe_latency: Callable[[float], None],
    ) -> None:
        self.table = TimerTable()
        self.processes: dict[int, ProcessHandle] = {}
        self.events = events
        self.stats = stats
        self.supervision = supervision
        self.reaper = Reaper(
            config,
            processes=self,
            events=events,
            stats=stats,
            supervision=supervision,
            stacks=stacks,
            observe_latency=observe_latency,
        )
        self.limits = config.limits
        self.timeline = Timeline(config.timeline_size)
        self.scope_stats = ScopeStats(
            per_uid=config.limits.max_scope_stats_per_uid,
            per_job=config.limits.max_scope_stats_per_job,
            half_life=config.scope_stats_half_life,
        )
        self._policy = build_policy(config)
        # pid -> (via, uid, admin, signal) the policy allowed, until the process exits.
        self._approved: dict[int, set[tuple[str, int, bool, int]]] = {}
        self._wake = anyio.Event()
        self._dirty = False
        self._changed = anyio.Event()

    def __len__(self) -> int:
        return len(self.table)

    def reconfigure(self, config: Config) -> None:
        """Apply reloaded limits, policy and reaper settings; timers are untouched."""
        self.limits = config.limits
        self.timeline.resize(config.timeline_size)
        self.scope_stats.per_uid = config.limits.max_scope_stats_per_uid
        self.scope_stats.per_job = config.limits.max_scope_stats_per_job
        self._policy = build_policy(config)
        self._approved.clear()
        self.reaper.settings = config

    def process(self, pid: int) -> ProcessHandle | None:
        """The pinned process ``pid`` (the reaper's port)."""
        return self.processes.get(pid)

    # -- the operations, shared by both fronts ------------------------------------

    def arm(
        self,
        requester: Requester,
        pid: int,
        scope_id: str,
        expiration_time: float,
        signal: int,
        pinned: ProcessHandle | None = None,
    ) -> ErrorReply | None:
        """Arm ``(pid, scope_id)``; an error code and message when refused.

        ``pinned``: the process ``pid`` must be (a socket peer, by its pidfd).
        """
        if expiration_time < 0 and math.isfinite(expiration_time):
            return self.release(requester, pid, scope_id)
        rejection = admit(self.limits, self.table, pid, scope_id, expiration_time)
        if rejection is not None:
            return rejection
        handle = self.processes.get(pid)
        new_handle = handle is None
        if handle is None:
            try:
                if pinned is not None and pinned.pid == pid:
                    if pinned.exited():
                        raise ProcessLookupError(pid)
                    handle = pinned.duplicate()
                else:
                    handle = open_process(pid)
            except ProcessLookupError:
                return "no_such_process", f"no process with pid {pid}"
            except OSError as e:
                return "refused", f"cannot watch pid {pid}: {e.strerror}"
        refusal = self._permitted(requester, handle, signal)
        if refusal is not None:
            if new_handle:
                handle.close()
            return refusal
        if new_handle:
            self.watch_process(handle)
        now = time.monotonic()
        deadline = now + (expiration_time - time.time())
        source: Literal["fifo", "socket"] = requester.via
        if self.table.arm(pid, scope_id, deadline, signal, source, requester.uid, now):
            self._wake.set()
        if scope_id != IDLE_SCOPE:
            self.table.release(pid, IDLE_SCOPE)  # it holds a timer: not idle
        self._mark_changed()
        return None

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None:
        timer = self.table.get(pid, scope_id)
        if timer is None:
            return None
        handle = self.processes[pid]
        refusal = self._permitted(requester, handle, 0)
        if refusal is not None:
            return refusal
        self.table.release(pid, scope_id)
        now = time.monotonic()
        self._released(timer, now, handle.uid)
        self._arm_idle(pid, now, handle.uid)
        self._mark_changed()
        return None

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None:
        if self.table.count_for(pid) == 0:
            return None
        handle = self.processes[pid]
        refusal = self._permitted(requester, handle, 0)
        if refusal is not None:
            return refusal
        now = time.monotonic()
        for timer in self.table.release_pid(pid):
            self._released(timer, now, handle.uid)
        self._arm_idle(pid, now, handle.uid)
        self._mark_changed()
        return None

    def _arm_idle(self, pid: int, now: float, uid: int) -> None:
        """A worker with an idle timeout that holds no timer now gets the ``(idle)`` one.

        Its expiry is a hang like any other (stack dump, kill, the group restarts).
        """
        if self.table.count_for(pid):
            return
        idle = self.supervision.idle_timeout(pid)
        if idle is not None and self.table.arm(
            pid, IDLE_SCOPE, now + idle, SIGKILL, uid=uid, armed=now
        ):
            self._wake.set()

    def _released(self, timer: Timer, now: float, uid: int) -> None:
        """A timer its owner released: on the timeline, and a sample of its scope's duration."""
        self.timeline.record((timer, now, "released", uid))
        if timer.scope_id == IDLE_SCOPE:
            return  # the daemon's own timer: not a scope of the trainer's
        placement = self.supervision.rank_of(timer.pid)
        job, rank = placement if placement is not None else ("", timer.pid)
        self.scope_stats.add(ScopeKey(job, timer.scope_id, rank), uid, now - timer.armed)

    def scope_list(self, seq: int, uid: int | None) -> p.ScopeList:
        """Every scope's statistics, or those of ``uid``'s processes."""
        stats = self.scope_stats
        scopes = [
            p.ScopeInfo(
                job=key.job,
                scope=key.scope,
                rank=key.rank,
                uid=stats.owners[key],
                count=sketch.count,
                p50_s=sketch.quantile(0.5),
                p99_s=sketch.quantile(0.99),
                max_s=sketch.decayed_max,
                mean_s=sketch.total / sketch.count,
            )
            for key, sketch in sorted(stats.sketches.items())
            if uid is None or stats.owners[key] == uid
        ]
        return p.ScopeList(seq, scopes, stats.refused)

    def bad_input(self, via: str, reason: str, sample: bytes) -> None:
        self.stats.bad_input += 1
        self.stats.bad_inputs[via] += 1
        self.events.emit(
            "bad_input", via=via, reason=reason, sample=sample[:200].decode(errors="replace")
        )

    def refused(self, via: str, pid: int, scope_id: str, error: ErrorReply) -> None:
        self.stats.refused += 1
        code, message = error
        self.stats.refusals[code] += 1
        self.events.emit(
            "request_refused", via=via, pid=pid, scope_id=scope_id, code=code, reason=message
        )

    def register_stack_dumps(self, pid: int, signal: int, marker: bool = False) -> int | None:
        """The descriptor a client's faulthandler should write to; None when not wanted.

        ``marker``: the client writes the end-of-dump marker after each dump.
        """
        if not 0 < signal < 65 or signal == 9:
            return None
        handle = self.processes.get(pid)
        if handle is None:
            try:
                handle = open_process(pid)
            except (ProcessLookupError, OSError):
                return None
            self.watch_process(handle)
        return self.reaper.register_faulthandler(handle, signal, marker)

    def _permitted(
        self, requester: Requester, handle: ProcessHandle, signal: int
    ) -> ErrorReply | None:
        approved = self._approved.get(handle.pid)
        key = (requester.via, requester.uid, requester.admin, signal)
        if approved is not None and key in approved:
            return None
        supervised = self.supervision.is_supervised(handle.pid)
        target = Target(handle.pid, handle.uid, handle.kernel_thread, supervised)
        refusal = check(self._policy, requester, target, signal)
        if refusal is not None:
            return refusal.code, refusal.reason
        if approved is None:
            approved = self._approved[handle.pid] = set()
        approved.add(key)
        return None

    # -- processes ------------------------------------------------------------------

    def watch_process(self, handle: ProcessHandle) -> None:
        self.processes[handle.pid] = handle
        aio.watch_readable(handle.pidfd, lambda: self._on_process_exit(handle))

    def _on_process_exit(self, handle: ProcessHandle) -> None:
        aio.unwatch(handle.pidfd)
        handle.close()
        if self.processes.get(handle.pid) is handle:
            del self.processes[handle.pid]
        self.reaper.forget(handle)
        self._approved.pop(handle.pid, None)
        if self.supervision.rank_of(handle.pid) is None:
            self.scope_stats.forget("", handle.pid)  # its "rank" was its pid
        dropped = self.table.release_pid(handle.pid)
        if dropped:
            now = time.monotonic()
            for timer in dropped:
                self.timeline.record((timer, now, "dropped", handle.uid))
            self._mark_changed()
            self.stats.dropped += len(dropped)
            self.events.emit(
                "timers_dropped",
                reason="process exited",
                pid=handle.pid,
                timers=len(dropped),
                scopes=",".join(t.scope_id for t in dropped[:16]),
            )

    def close_processes(self) -> None:
        for handle in self.processes.values():
            with contextlib.suppress(ValueError, OSError):
                aio.unwatch(handle.pidfd)
            handle.close()
        self.processes.clear()

    # -- expiry ---------------------------------------------------------------------

    async def run(self, task_group: anyio.abc.TaskGroup) -> None:
        """The expiry loop; the reaper's captures and escalations run in ``task_group``."""
        self.reaper.attach(task_group)
        table = self.table
        while True:
            deadline = table.next_deadline()
            now = time.monotonic()
            if deadline is not None and deadline <= now:
                self.expire(now)
                continue
            if deadline is not None and deadline - now < _TIMER_SLACK:
                # The loop's timers round up to whole milliseconds: for the last
                # one, yield to other work but check the clock every iteration.
                await anyio.lowlevel.checkpoint()
                continue
            self._wake = anyio.Event()
            delay = math.inf if deadline is None else deadline - now - _TIMER_SLACK
            with anyio.move_on_after(delay):
                await self._wake.wait()

    def expire(self, now: float) -> None:
        """Hand every timer due by ``now`` to the reaper."""
        self._mark_changed()
        expired = self.table.pop_expired(now)
        processes = self.processes
        for timer in expired:
            handle = processes.get(timer.pid)
            self.timeline.record((timer, now, "expired", -1 if handle is None else handle.uid))
        self.reaper.expire(expired)

    # -- persistence's port -----------------------------------------------------------

    def _mark_changed(self) -> None:
        if not self._dirty:  # a plain bool on the hot path; the event only on the edge
            self._dirty = True
            self._changed.set()

    async def wait_changed(self) -> None:
        """Return once the table changed since the last return."""
        await self._changed.wait()
        self._changed = anyio.Event()
        self._dirty = False

    def snapshot_timers(self, size: int = 1000) -> Iterator[list[SnapshotTimer]]:
        """The live timers as snapshot records, ``size`` at a time (wall-clock deadlines)."""
        now, wall = time.monotonic(), time.time()
        processes = self.processes
        entries = self.table.entries()
        for start in range(0, len(entries), size):
            yield [
                SnapshotTimer(
                    t.pid,
                    processes[t.pid].start_time,
                    t.scope_id,
                    wall + (t.deadline - now),
                    t.signal,
                    t.source,
                    t.uid,
                )
                for t in entries[start : start + size]
                if t.live and t.pid in processes
            ]

    def restore_timer(self, saved: SnapshotTimer, now: float, wall: float) -> bool:
        """Re-arm a saved timer if its process is still the very same one."""
        handle = self.processes.get(saved.pid)
        if handle is None:
            try:
                handle = open_process(saved.pid)
            except (ProcessLookupError, OSError):
                return False
            if handle.start_time != saved.start_time:
                handle.close()  # the pid now names another process
                return False
            self.watch_process(handle)
        deadline = now + (saved.expiration_time - wall)
        # When it was first armed is not saved: its slice starts at the restore.
        self.table.arm(
            saved.pid, saved.scope_id, deadline, saved.signal, saved.source, saved.uid, now
        )
        self._mark_changed()
        return True

    # -- queries ----------------------------------------------------------------------

    def timeline_spans(self, uid: int | None) -> list[p.TimerSpan]:
        """Recent timers from arming to their end, then live ones (those of ``uid``'s processes).

        At most ``timeline_size`` live ones, whichever come first, unsorted: for an
        operator the work on the loop stays bounded however many timers the node
        holds; for others it is a scan for their own, as ``timer_list``'s.
        """
        processes = self.processes

        def owner(timer: Timer) -> int:
            handle = processes.get(timer.pid)
            return -1 if handle is None else handle.uid

        live = ((t, owner(t)) for t in self.table if uid is None or owner(t) == uid)
        return self.timeline.spans(itertools.islice(live, self.timeline.ended.maxlen or 0), uid)

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList:
        """The soonest timers (of processes of ``uid``; all when None), and how many exist."""
        limit = self.limits.max_listed_timers
        if uid is None:
            timers: Iterable[Timer] = self.table
            total = len(self.table)
        else:
            processes = self.processes
            own = [t for t in self.table if t.pid in processes and processes[t.pid].uid == uid]
            timers, total = own, len(own)
        now = time.monotonic()
        wall = time.time()
        infos = [
            p.TimerInfo(
                pid=t.pid,
                scope_id=t.scope_id,
                remaining_s=t.deadline - now,
                expiration_time=wall + (t.deadline - now),
                signal=t.signal,
                source=t.source,
                uid=None if t.uid < 0 else t.uid,
            )
            for t in heapq.nsmallest(limit, timers)
        ]
        return p.TimerList(seq, infos, total)
