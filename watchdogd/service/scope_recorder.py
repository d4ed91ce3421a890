"""What released timers teach: scope statistics, stragglers and learned deadlines.

The scope recorder observes the timer core (:meth:`ScopeRecorder.timer_ended`)
and the process watch (:meth:`ScopeRecorder.process_exited`). Every release
is a sample of its scope's duration, kept per (job, scope, rank) in constant
memory (:mod:`watchdogd.core.scope_stats`); a group's ranks are also scored
against each other (:mod:`watchdogd.service.stragglers`), and scopes with a
learned deadline learn from it (:mod:`watchdogd.core.learned`). It resolves
the deadline of a ``LEARN`` arm for the core, and answers ``scopes``.

Outside groups the "rank" is the pid, and there is one attempt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import anyio

from watchdogd.core.config import ScopeSettings
from watchdogd.core.learned import LearnedDeadlines, LearnKey
from watchdogd.core.ports import EventSink, Supervision
from watchdogd.core.scope_stats import ScopeKey, ScopeStats
from watchdogd.core.timers import Ended
from watchdogd.linux.procs import ProcessHandle
from watchdogd.service.stragglers import StragglerWatch
from watchdogd.service.timer_core import IDLE_SCOPE, ErrorReply
from watchdogd_client import protocol as p
from watchdogd_client.groups import DeadlineRule

__all__ = ["ScopeRecorder"]


class ScopeRecorder:
    """Scope statistics, stragglers and learned deadlines, fed by released timers."""

    def __init__(
        self, settings: ScopeSettings, *, events: EventSink, supervision: Supervision
    ) -> None:
        self.supervision = supervision
        self.scope_stats = ScopeStats(
            per_uid=settings.max_per_uid,
            per_job=settings.max_per_job,
            half_life=settings.half_life,
        )
        self.learned = LearnedDeadlines(settings.deadlines, per_uid=settings.max_per_uid)
        self.stragglers = StragglerWatch(settings.stragglers, events, self.scope_stats)
        self._load_wanted = anyio.Event()

    def reconfigure(self, settings: ScopeSettings) -> None:
        self.scope_stats.reconfigure(
            per_uid=settings.max_per_uid,
            per_job=settings.max_per_job,
            half_life=settings.half_life,
        )
        self.learned.reconfigure(settings.deadlines, settings.max_per_uid)
        self.stragglers.reconfigure(settings.stragglers)

    # -- observing ------------------------------------------------------------------

    def timer_ended(self, ended: Ended) -> None:
        """A release is a sample of its scope's duration (an expiry or a drop is not)."""
        timer, now, outcome, uid = ended
        if outcome != "released" or timer.scope_id == IDLE_SCOPE:
            return  # the idle timer is the daemon's own: not a scope of the trainer's
        held = now - timer.armed
        worker = self.supervision.worker(timer.pid)
        job, rank, attempt = (
            ("", timer.pid, 0) if worker is None else (worker.group, worker.rank, worker.attempt)
        )
        key = ScopeKey(job, timer.scope_id, rank)
        if self.scope_stats.add(key, uid, held) and job:
            # Only a group's ranks are comparable.
            self.stragglers.sample(key, held, injected=self.supervision.injected(timer.pid))
        if self.learned.learners:
            self.learned.observe(LearnKey.of(job, rank, timer.scope_id), attempt, held, rank)

    def process_exited(self, handle: ProcessHandle) -> None:
        if self.supervision.worker(handle.pid) is None:
            self.scope_stats.forget("", handle.pid)  # its "rank" was its pid
            self.learned.forget_pid(handle.pid)

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
            self.stragglers.sample(
                key, seconds, device=True, injected=self.supervision.injected(pid)
            )
        return None

    # -- the GroupRuns port ----------------------------------------------------------

    def run_started(self, group: str) -> None:
        self.learned.forget_group(group)
        self.stragglers.board.forget_job(group)

    def run_ended(self, group: str) -> None:
        self.learned.retire_group(group)

    # -- learned deadlines (the core's DeadlineLearner port, the store's source) -----

    def learned_expiration(
        self, uid: int, pid: int, scope_id: str, expiration_time: float
    ) -> float | str:
        """The expiration time of a ``LEARN`` arm, or why there is none."""
        worker = self.supervision.worker(pid)
        rules: Sequence[DeadlineRule] = ()
        job, attempt, job_key, rank = "", 0, None, None
        if worker is not None:
            job, attempt, job_key, rank = worker.group, worker.attempt, worker.job_key, worker.rank
            rules = worker.deadlines
        outcome = self.learned.resolve(
            LearnKey.of(job, pid, scope_id),
            uid,
            attempt,
            call_initial=expiration_time != math.inf,
            group_rules=rules,
            job_key=job_key,
            rank=rank,
        )
        if self.learned.to_load:
            self._load_wanted.set()
        if isinstance(outcome, str):
            return outcome
        return expiration_time if outcome.seconds is None else time.time() + outcome.seconds

    async def wait_load_wanted(self) -> None:
        """Return once a job's saved learned deadlines are wanted (``learned.to_load``)."""
        await self._load_wanted.wait()
        self._load_wanted = anyio.Event()

    # -- the query --------------------------------------------------------------------

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

    def straggler_list(self, seq: int, uid: int | None, job: bool) -> p.StragglerList:
        """Every scored rank, or those of ``uid``'s processes (``job``: every node's too)."""
        return self.stragglers.listing(seq, uid, job)
