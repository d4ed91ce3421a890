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
from collections.abc import Callable, Iterable, Iterator, Sequence
from signal import SIGKILL
from typing import Literal, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from watchdogd.core.admission import admit
from watchdogd.core.config import Config
from watchdogd.core.learned import LearnedDeadlines, LearnKey
from watchdogd.core.policy import Policy, Requester, Target, check, check_pid, valid_signals
from watchdogd.core.ports import EventSink, Supervision
from watchdogd.core.scope_stats import ScopeKey, ScopeStats
from watchdogd.core.timers import Timer, TimerTable
from watchdogd.linux import aio
from watchdogd.linux.priority import set_loop_urgent
from watchdogd.linux.procs import ProcessHandle, ancestors, open_process
from watchdogd.linux.snapshot import SnapshotTimer
from watchdogd.linux.stacks import StackStore
from watchdogd.service.reaper import Reaper
from watchdogd.service.stats import Stats
from watchdogd.service.stragglers import StragglerWatch
from watchdogd.service.throttle import NoisyEvents
from watchdogd.service.timeline import Timeline
from watchdogd_client import protocol as p
from watchdogd_client.groups import DeadlineRule

__all__ = ["IDLE_SCOPE", "ErrorReply", "TimerOperations", "TimerService"]

IDLE_SCOPE = "(idle)"
"""The timer a worker with an idle timeout holds while it holds no other."""

# libuv's timer resolution (uvloop): wake this much early, then watch the clock.
_TIMER_SLACK = 0.0015
# How long before a deadline the loop is raised: a calm wake-up on a busy CPU
# may wait a few milliseconds for it.
_URGENT_AHEAD = 0.05
# How often a raised loop looks whether the captures that keep it raised are done.
_CAPTURE_RECHECK = 0.005

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
        learn: bool = False,
    ) -> ErrorReply | None: ...

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None: ...

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None: ...

    def bad_input(self, via: str, reason: str, sample: bytes, uid: int | None = None) -> None: ...

    def refused(
        self, via: str, pid: int, scope_id: str, error: ErrorReply, uid: int | None = None
    ) -> None: ...

    def expire_due(self) -> None: ...


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
        # uid -> the pids in ``processes`` it owns: a peer's queries walk its own timers only.
        self._pids_of: dict[int, set[int]] = {}
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
        self.noisy = NoisyEvents(events, stats, config.limits.max_noisy_events_per_s)
        self.timeline = Timeline(config.timeline_size)
        self.scope_stats = ScopeStats(
            per_uid=config.limits.max_scope_stats_per_uid,
            per_job=config.limits.max_scope_stats_per_job,
            half_life=config.scope_stats_half_life,
        )
        self.learned = LearnedDeadlines(
            config.deadlines, per_uid=config.limits.max_scope_stats_per_uid
        )
        self.stragglers = StragglerWatch(config, events, self.scope_stats)
        self._policy = build_policy(config)
        # pid -> (via, uid, admin, signal) the policy allowed, until the process exits.
        self._approved: dict[int, set[tuple[str, int, bool, int]]] = {}
        self._wake = anyio.Event()
        self._dirty = False
        self._changed = anyio.Event()
        self._load_wanted = anyio.Event()
        self._expiring = False
        """The expiry loop runs (so the reaper can act on what a front finds due)."""

    def __len__(self) -> int:
        return len(self.table)

    def reconfigure(self, config: Config) -> None:
        """Apply reloaded limits, policy and reaper settings; timers are untouched."""
        self.limits = config.limits
        self.noisy.resize(config.limits.max_noisy_events_per_s)
        self.timeline.resize(config.timeline_size)
        self.scope_stats.per_uid = config.limits.max_scope_stats_per_uid
        self.scope_stats.per_job = config.limits.max_scope_stats_per_job
        self.learned.reconfigure(config.deadlines, config.limits.max_scope_stats_per_uid)
        self.stragglers.configure(config)
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
        learn: bool = False,
    ) -> ErrorReply | None:
        """Arm ``(pid, scope_id)``; an error code and message when refused.

        ``pinned``: the process ``pid`` must be (a socket peer, by its pidfd).
        ``learn``: the deadline is learned (:mod:`watchdogd.core.learned`);
        ``expiration_time`` is the call's initial one, ``inf`` for none.
        """
        if expiration_time < 0 and math.isfinite(expiration_time):
            return self.release(requester, pid, scope_id)
        checked = 0.0 if learn and expiration_time == math.inf else expiration_time
        rejection = admit(self.limits, self.table, pid, scope_id, checked)
        if rejection is not None:
            return rejection
        handle = self.processes.get(pid)
        new_handle = handle is None
        if handle is None:
            protected = check_pid(self._policy, pid)
            if protected is not None:
                return protected.code, protected.reason
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
        if refusal is None and learn:
            learned = self._learned_expiration(requester.uid, pid, scope_id, expiration_time)
            if isinstance(learned, str):
                refusal = "bad_request", learned
            else:
                expiration_time = learned
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

    # -- the GroupRuns port ----------------------------------------------------------

    def run_started(self, group: str) -> None:
        self.learned.forget_group(group)
        self.stragglers.board.forget_job(group)

    def run_ended(self, group: str) -> None:
        self.learned.retire_group(group)

    def _learned_expiration(
        self, uid: int, pid: int, scope_id: str, expiration_time: float
    ) -> float | str:
        """The expiration time of a ``LEARN`` arm, or why there is none."""
        worker = self.supervision.worker(pid)
        rules: Sequence[DeadlineRule] = ()
        job, attempt, job_key = "", 0, None
        if worker is not None:
            job, attempt, job_key = worker.group, worker.attempt, worker.job_key
            rules = worker.deadlines
        outcome = self.learned.resolve(
            LearnKey.of(job, pid, scope_id),
            uid,
            attempt,
            call_initial=expiration_time != math.inf,
            group_rules=rules,
            job_key=job_key,
        )
        if self.learned.to_load:
            self._load_wanted.set()
        if isinstance(outcome, str):
            return outcome
        return expiration_time if outcome.seconds is None else time.time() + outcome.seconds

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
        worker = self.supervision.worker(pid)
        idle = None if worker is None else worker.idle_timeout
        if idle is not None and self.table.arm(
            pid, IDLE_SCOPE, now + idle, SIGKILL, uid=uid, armed=now
        ):
            self._wake.set()

    def _released(self, timer: Timer, now: float, uid: int) -> None:
        """A timer its owner released: on the timeline, and a sample of its scope's duration."""
        self.timeline.record((timer, now, "released", uid))
        if timer.scope_id == IDLE_SCOPE:
            return  # the daemon's own timer: not a scope of the trainer's
        held = now - timer.armed
        worker = self.supervision.worker(timer.pid)
        # Outside groups the "rank" is the pid (and there is one attempt).
        job, rank, attempt = (
            ("", timer.pid, 0) if worker is None else (worker.group, worker.rank, worker.attempt)
        )
        key = ScopeKey(job, timer.scope_id, rank)
        if self.scope_stats.add(key, uid, held) and job:
            self.stragglers.sample(key, held)  # only a group's ranks are comparable
        if self.learned.learners:
            self.learned.observe(LearnKey.of(job, rank, timer.scope_id), attempt, held, rank)

    def device_time(self, pid: int, scope_id: str, seconds: float) -> ErrorReply | None:
        """What the GPU took for ``pid``'s last ``scope_id``: its straggler sample from now on.

        Only a worker's scope that already has a sketch is scored (the caps hold);
        anything else is accepted and ignored, as a release of an unknown timer is.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            return (
                "bad_request",
                f"device time must be a finite number of seconds >= 0, got {seconds}",
            )
        worker = self.supervision.worker(pid)
        if worker is None:
            return None
        key = ScopeKey(worker.group, scope_id, worker.rank)
        if key in self.scope_stats.sketches:
            self.stragglers.sample(key, seconds, device=True)
        return None

    def scope_list(self, seq: int, uid: int | None) -> p.ScopeList:
        """Every scope's statistics, or those of ``uid``'s processes."""
        stats = self.scope_stats
        learned = self.learned
        scopes = []
        for key, sketch in sorted(stats.sketches.items()):
            if uid is not None and stats.owners[key] != uid:
                continue
            deadline = learned.describe(LearnKey.of(key.job, key.rank, key.scope))
            scopes.append(
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
                    deadline_s=None if deadline is None else deadline.seconds,
                    deadline_source="" if deadline is None else deadline.source,
                )
            )
        return p.ScopeList(seq, scopes, stats.refused + learned.refused)

    def bad_input(self, via: str, reason: str, sample: bytes, uid: int | None = None) -> None:
        """Count undecodable input from ``uid`` (None: the FIFO); an event, rate-limited."""
        self.stats.bad_input += 1
        self.stats.bad_inputs[via] += 1
        if self.noisy.allow("bad_input", via, uid):
            self.events.emit(
                "bad_input",
                via=via,
                uid=uid,
                reason=reason,
                sample=sample[:200].decode(errors="replace"),
            )

    def refused(
        self, via: str, pid: int, scope_id: str, error: ErrorReply, uid: int | None = None
    ) -> None:
        """Count a refused request from ``uid`` (None: the FIFO); an event, rate-limited."""
        self.stats.refused += 1
        code, message = error
        self.stats.refusals[code] += 1
        if self.noisy.allow("request_refused", via, uid):
            self.events.emit(
                "request_refused",
                via=via,
                uid=uid,
                pid=pid,
                scope_id=scope_id,
                code=code,
                reason=message,
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
        self._pids_of.setdefault(handle.uid, set()).add(handle.pid)
        aio.watch_readable(handle.pidfd, lambda: self._on_process_exit(handle))

    def _on_process_exit(self, handle: ProcessHandle) -> None:
        aio.unwatch(handle.pidfd)
        handle.close()
        if self.processes.get(handle.pid) is handle:
            del self.processes[handle.pid]
            owned = self._pids_of[handle.uid]
            owned.discard(handle.pid)
            if not owned:
                del self._pids_of[handle.uid]
        self.reaper.forget(handle)
        self._approved.pop(handle.pid, None)
        if self.supervision.worker(handle.pid) is None:
            self.scope_stats.forget("", handle.pid)  # its "rank" was its pid
            self.learned.forget_pid(handle.pid)
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
        self._pids_of.clear()

    # -- expiry ---------------------------------------------------------------------

    async def run(self, task_group: anyio.abc.TaskGroup) -> None:
        """The expiry loop; the reaper's captures and escalations run in ``task_group``."""
        self.reaper.attach(task_group)
        self._expiring = True
        task_group.start_soon(self.noisy.run)
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
            # Raised from shortly before a deadline until its dumps are taken and its
            # signals sent; calm otherwise (see watchdogd.linux.priority).
            capturing = self.reaper.capturing > 0
            urgent = delay <= _URGENT_AHEAD or capturing
            set_loop_urgent(urgent)
            if not urgent:
                delay -= _URGENT_AHEAD  # wake calm, raise, then sleep the rest
            elif capturing:
                delay = min(delay, _CAPTURE_RECHECK)
            with anyio.move_on_after(delay):
                await self._wake.wait()

    def expire_due(self) -> None:
        """Expire what is due now, from a front between two turns of a flood.

        The expiry loop's own wake-up waits for every other callback ready in
        the same loop iteration: behind N flooding connections, N turns. A
        front that checks here between its turns bounds that wait to one turn.
        """
        if not self._expiring:
            return  # the expiry loop has not started (a restored snapshot): it will
        deadline = self.table.next_deadline()
        if deadline is not None:
            now = time.monotonic()
            if deadline <= now:
                self.expire(now)

    def expire(self, now: float) -> None:
        """Hand every timer due by ``now`` to the reaper, and those due by the time it is done.

        Their events are recorded once every signal went out (see ``Reaper.expire``).
        """
        self._mark_changed()
        processes = self.processes
        done = []
        while expired := self.table.pop_expired(now):
            for timer in expired:
                handle = processes.get(timer.pid)
                self.timeline.record((timer, now, "expired", -1 if handle is None else handle.uid))
            done += self.reaper.expire(expired)
            now = time.monotonic()
        self.reaper.record(done)

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

    async def wait_load_wanted(self) -> None:
        """Return once a job's saved learned deadlines are wanted (``learned.to_load``)."""
        await self._load_wanted.wait()
        self._load_wanted = anyio.Event()

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
        holds; for others, as for ``timer_list``, only their own are walked.
        """
        processes = self.processes

        def owner(timer: Timer) -> int:
            handle = processes.get(timer.pid)
            return -1 if handle is None else handle.uid

        live: Iterable[tuple[Timer, int]] = (
            ((t, owner(t)) for t in self.table)
            if uid is None
            else ((t, uid) for t in self._owned(uid))
        )
        return self.timeline.spans(itertools.islice(live, self.timeline.ended.maxlen or 0), uid)

    def _owned(self, uid: int) -> Iterator[Timer]:
        """The live timers on ``uid``'s processes: a walk of those, not of the table."""
        table = self.table
        for pid in self._pids_of.get(uid, ()):
            yield from table.of_pid(pid)

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList:
        """The soonest timers (of processes of ``uid``; all when None), and how many exist."""
        limit = self.limits.max_listed_timers
        if uid is None:
            timers: Iterable[Timer] = self.table
            total = len(self.table)
        else:
            own = list(self._owned(uid))
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
