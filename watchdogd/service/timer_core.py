"""The timer core: the table, arm/release/expire, and the expiry loop.

Both fronts (FIFO and socket) call the same synchronous operations here —
``arm``, ``release``, ``release_all`` — from the event loop. Arming pins the
target process in the :class:`~watchdogd.service.process_watch.ProcessWatch`
the first time it gets a timer; its exit drops its timers. The expiry loop
sleeps until the table's next deadline, or until a request arms an earlier
one — never on a polling interval — and hands what expired to the reaper.

A timer that ends — released, expired, or dropped with its process — is
handed to every observer registered with :meth:`TimerCore.on_ended` (the
timeline, the scope recorder: :mod:`watchdogd.daemon` wires them). The core
names none of them.

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
- The kill comes first: on expiry every due timer is signalled before any
  observer hears of it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from signal import SIGKILL
from typing import Literal, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from watchdogd.core.admission import admit
from watchdogd.core.config import PolicyConfig, TimerSettings
from watchdogd.core.policy import Policy, Requester, Target, check, check_pid, valid_signals
from watchdogd.core.ports import EventSink, Supervision
from watchdogd.core.timers import IDLE_SCOPE, Ended, Outcome, Timer, TimerTable
from watchdogd.linux.priority import set_loop_urgent
from watchdogd.linux.procs import ProcessHandle, ancestors
from watchdogd.linux.snapshot import SnapshotTimer
from watchdogd.service.reaper import Expiry
from watchdogd.service.stats import Stats
from watchdogd_client import protocol as p

__all__ = [
    "IDLE_SCOPE",
    "Audit",
    "DeadlineLearner",
    "ErrorReply",
    "Killer",
    "Processes",
    "TimerCore",
    "TimerObserver",
    "TimerOperations",
    "build_policy",
]

# libuv's timer resolution (uvloop): wake this much early, then watch the clock.
_TIMER_SLACK = 0.0015
# How long before a deadline the loop is raised: a calm wake-up on a busy CPU
# may wait a few milliseconds for it.
_URGENT_AHEAD = 0.05
# How often a raised loop looks whether the captures that keep it raised are done.
_CAPTURE_RECHECK = 0.005

ErrorReply = tuple[p.ErrorCode, str]

TimerObserver = Callable[[Ended], None]
"""Told of every timer that ended, on the loop: keep it to microseconds."""


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

    def expire_due(self) -> None: ...


class Audit(Protocol):
    """Where a front reports what it could not decode or had to refuse."""

    def bad_input(self, via: str, reason: str, sample: bytes, uid: int | None = None) -> None: ...

    def refused(
        self, via: str, pid: int, scope_id: str, error: ErrorReply, uid: int | None = None
    ) -> None: ...

    def connection_refused(self, pid: int, uid: int, limit: str, reason: str) -> None: ...


class Processes(Protocol):
    """The processes timers are armed on (the process watch)."""

    def process(self, pid: int) -> ProcessHandle | None:
        """The watched process ``pid``, if it is watched."""
        ...

    def open(self, pid: int) -> ProcessHandle:
        """Pin ``pid`` (not yet watched); ProcessLookupError or OSError when it cannot be."""
        ...

    def watch(self, handle: ProcessHandle) -> None: ...

    def on_exit(self, observer: Callable[[ProcessHandle], None]) -> None: ...

    def owner(self, pid: int) -> int: ...

    def start_time(self, pid: int) -> int | None: ...


class DeadlineLearner(Protocol):
    """Resolves the deadline of a ``LEARN`` arm (the scope recorder)."""

    def learned_expiration(
        self, uid: int, pid: int, scope_id: str, expiration_time: float
    ) -> float | str:
        """The expiration time to arm, or why there is none."""
        ...


class Killer(Protocol):
    """Signals what expired (the reaper)."""

    capturing: int
    """Expiries whose stack dump is being taken: their signal is still to come."""

    def attach(self, task_group: anyio.abc.TaskGroup) -> None: ...

    def expire(self, expired: list[Timer]) -> list[Expiry]:
        """Signal ``expired``; what :meth:`record` records once every signal went out."""
        ...

    def record(self, done: list[Expiry]) -> None: ...


def build_policy(settings: PolicyConfig) -> Policy:
    own = os.getpid()
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


class TimerCore:
    """Timers armed over either front, on the processes of ``watch``."""

    def __init__(
        self,
        settings: TimerSettings,
        *,
        watch: Processes,
        killer: Killer,
        supervision: Supervision,
        learner: DeadlineLearner,
        events: EventSink,
        stats: Stats,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.table = TimerTable()
        self.events = events
        self.stats = stats
        self.watch = watch
        self.killer = killer
        self.supervision = supervision
        self.learner = learner
        self.limits = settings.admission
        self._policy = build_policy(settings.policy)
        # pid -> (via, uid, admin, signal) the policy allowed, until the process exits.
        self._approved: dict[int, set[tuple[str, int, bool, int]]] = {}
        self._observers: list[TimerObserver] = []
        self._clock = clock
        self._wall_clock = wall_clock
        # Made by the tasks that wait on them, so the core needs no event loop to be driven.
        self._wake: anyio.Event | None = None
        self._dirty = False
        self._changed: anyio.Event | None = None
        self._expiring = False
        """The expiry loop runs (so the reaper can act on what a front finds due)."""
        watch.on_exit(self._process_exited)

    def __len__(self) -> int:
        return len(self.table)

    def on_ended(self, observer: TimerObserver) -> None:
        self._observers.append(observer)

    def reconfigure(self, settings: TimerSettings) -> None:
        """Apply reloaded limits and policy; timers are untouched."""
        self.limits = settings.admission
        self._policy = build_policy(settings.policy)
        self._approved.clear()

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
        handle = self.watch.process(pid)
        new_handle = handle is None
        if handle is not None and pinned is not None and pinned.start_time != handle.start_time:
            # The watch holds another process under the peer's number: the peer
            # exited with this request unread, and the number was taken since.
            return "no_such_process", f"process {pid} exited before its request was read"
        if handle is None:
            opened = self._open(pid, pinned)
            if isinstance(opened, tuple):
                return opened
            handle = opened
        refusal = self._permitted(requester, handle, signal)
        if refusal is None and learn:
            learned = self.learner.learned_expiration(requester.uid, pid, scope_id, expiration_time)
            if isinstance(learned, str):
                refusal = "bad_request", learned
            else:
                expiration_time = learned
        if refusal is not None:
            if new_handle:
                handle.close()
            return refusal
        if new_handle:
            self.watch.watch(handle)
        now = self._clock()
        deadline = now + (expiration_time - self._wall_clock())
        source: Literal["fifo", "socket"] = requester.via
        if self.table.arm(pid, scope_id, deadline, signal, source, requester.uid, now):
            self._wake_loop()
        if scope_id != IDLE_SCOPE:
            self.table.release(pid, IDLE_SCOPE)  # it holds a timer: not idle
        self._mark_changed()
        return None

    def _open(self, pid: int, pinned: ProcessHandle | None) -> ProcessHandle | ErrorReply:
        """A handle on ``pid``, not yet watched; or why it may not, or cannot, be had."""
        protected = check_pid(self._policy, pid)
        if protected is not None:
            return protected.code, protected.reason
        try:
            if pinned is not None and pinned.pid == pid:
                if pinned.exited():
                    raise ProcessLookupError(pid)
                return pinned.duplicate()
            return self.watch.open(pid)
        except ProcessLookupError:
            return "no_such_process", f"no process with pid {pid}"
        except OSError as e:
            return "refused", f"cannot watch pid {pid}: {e.strerror}"

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None:
        timer = self.table.get(pid, scope_id)
        if timer is None:
            return None
        handle = self.watch.process(pid)
        assert handle is not None  # a pid with timers is watched
        refusal = self._permitted(requester, handle, 0)
        if refusal is not None:
            return refusal
        self.table.release(pid, scope_id)
        now = self._clock()
        self._ended((timer,), now, "released", handle.uid)
        self._arm_idle(pid, now, handle.uid)
        self._mark_changed()
        return None

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None:
        if self.table.count_for(pid) == 0:
            return None
        handle = self.watch.process(pid)
        assert handle is not None  # a pid with timers is watched
        refusal = self._permitted(requester, handle, 0)
        if refusal is not None:
            return refusal
        now = self._clock()
        self._ended(self.table.release_pid(pid), now, "released", handle.uid)
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
            self._wake_loop()

    def _wake_loop(self) -> None:
        """A new soonest deadline: the expiry loop sleeps until it instead."""
        if self._wake is not None:
            self._wake.set()

    def _ended(
        self,
        timers: tuple[Timer, ...] | list[Timer],
        now: float,
        outcome: Outcome,
        uid: int,
    ) -> None:
        observers = self._observers
        for timer in timers:
            ended = (timer, now, outcome, uid)
            for observer in observers:
                observer(ended)

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

    def _process_exited(self, handle: ProcessHandle) -> None:
        self._approved.pop(handle.pid, None)
        dropped = self.table.release_pid(handle.pid)
        if dropped:
            self._ended(dropped, self._clock(), "dropped", handle.uid)
            self._mark_changed()
            self.stats.dropped += len(dropped)
            self.events.emit_at(  # routine: every worker that stops holding a timer
                logging.DEBUG,
                "timers_dropped",
                reason="process exited",
                pid=handle.pid,
                timers=len(dropped),
                scopes=",".join(t.scope_id for t in dropped[:16]),
            )

    # -- expiry ---------------------------------------------------------------------

    async def run(self, task_group: anyio.abc.TaskGroup) -> None:
        """The expiry loop; the killer's captures and escalations run in ``task_group``."""
        self.killer.attach(task_group)
        self._expiring = True
        table = self.table
        while True:
            deadline = table.next_deadline()
            now = self._clock()
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
            capturing = self.killer.capturing > 0
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
            now = self._clock()
            if deadline <= now:
                self.expire(now)

    def expire(self, now: float) -> None:
        """Signal every timer due by ``now``, and those due by the time that is done.

        The observers and the killer's records hear of them once every signal went out.
        """
        self._mark_changed()
        signalled: list[tuple[list[Timer], float]] = []
        done: list[Expiry] = []
        while expired := self.table.pop_expired(now):
            done += self.killer.expire(expired)
            signalled.append((expired, now))
            now = self._clock()
        owner = self.watch.owner
        for expired, at in signalled:
            for timer in expired:
                self._ended((timer,), at, "expired", owner(timer.pid))
        self.killer.record(done)

    # -- persistence's port -----------------------------------------------------------

    def _mark_changed(self) -> None:
        if not self._dirty:  # a plain bool on the hot path; the event only on the edge
            self._dirty = True
            if self._changed is not None:
                self._changed.set()

    async def wait_changed(self) -> None:
        """Return once the table changed since the last return."""
        if not self._dirty:
            self._changed = anyio.Event()
            await self._changed.wait()
        self._changed = None
        self._dirty = False

    def snapshot_timers(self, size: int = 1000) -> Iterator[list[SnapshotTimer]]:
        """The live timers as snapshot records, ``size`` at a time (wall-clock deadlines)."""
        now, wall = self._clock(), self._wall_clock()
        start_time = self.watch.start_time
        entries = self.table.entries()
        for start in range(0, len(entries), size):
            chunk = []
            for t in entries[start : start + size]:
                started = start_time(t.pid)
                if t.live and started is not None:
                    deadline = wall + (t.deadline - now)
                    chunk.append(
                        SnapshotTimer(
                            t.pid, started, t.scope_id, deadline, t.signal, t.source, t.uid
                        )
                    )
            yield chunk

    def restore_timer(self, saved: SnapshotTimer, now: float, wall: float) -> bool:
        """Re-arm a saved timer if its process is still the very same one."""
        handle = self.watch.process(saved.pid)
        if handle is None:
            try:
                handle = self.watch.open(saved.pid)
            except (ProcessLookupError, OSError):
                return False
            if handle.start_time != saved.start_time:
                handle.close()  # the pid now names another process
                return False
            self.watch.watch(handle)
        deadline = now + (saved.expiration_time - wall)
        # When it was first armed is not saved: its slice starts at the restore.
        self.table.arm(
            saved.pid, saved.scope_id, deadline, saved.signal, saved.source, saved.uid, now
        )
        self._mark_changed()
        return True
