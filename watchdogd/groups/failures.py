"""A group's failures: the latest attempt's, the last one, the first of each recent attempt.

The runner records a worker that failed on its own (an exit, a timer's kill,
D state) here. The latest attempt's failures, by local rank, make torch's
``ChildFailedError``; the last one is the group's ``last_failure``; the first
failure of each of the latest attempts makes the summary of a run that ended
for lack of progress; the first failure of every attempt tells a bad program
(:mod:`watchdogd.core.bad_program`). Either verdict, "do not requeue", is
:meth:`AttemptFailures.do_not_requeue`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from watchdogd.core.bad_program import BadProgram
from watchdogd.core.progress import EXIT_NO_PROGRESS, StepProgress
from watchdogd.core.quarantine import NodeFault
from watchdogd.groups.workers import Worker, describe_exit, read_error_file
from watchdogd_client.groups import Failure

if TYPE_CHECKING:  # only an etcd group has one, and only it imports etcd's client
    from watchdogd.groups.etcd_quarantine import EtcdQuarantine

__all__ = ["AttemptFailures"]


class AttemptFailures:
    def __init__(
        self, progress: StepProgress, node: str, keep: int, quarantine: EtcdQuarantine | None
    ) -> None:
        """``node``: this node's name in the summary; ``keep``: how many attempts' first
        failures a summary may need (the no-progress limit, plus one); ``quarantine``: told
        each attempt's first failure, which alone counts against the node."""
        self.progress = progress
        self.quarantine = quarantine
        self.node = node
        self.last: Failure | None = None
        self.attempt: dict[int, Failure] = {}
        """The workers of the latest attempt that failed on their own, by local rank."""
        self.firsts: deque[Failure] = deque(maxlen=keep)
        """The first failure of each of the latest attempts that had one."""
        self.bad_program = BadProgram()

    def new_attempt(self) -> None:
        self.attempt = {}

    def record(
        self,
        worker: Worker,
        exitcode: int,
        reason: str,
        oom_kills: int = 0,
        fault: NodeFault | None = None,
    ) -> None:
        """Record ``worker``'s failure (``fault``: what in it points at the node)."""
        first = not self.attempt
        self.last = self.attempt[worker.local_rank] = Failure(
            local_rank=worker.local_rank,
            rank=worker.rank,
            pid=worker.pid,
            exitcode=exitcode,
            reason=reason,
            error_file=worker.error_file,
            error_message=read_error_file(worker.error_file),
            oom_kills=oom_kills,
            timestamp=time.time(),
        )
        if first:
            self.firsts.append(self.last)
            self.bad_program.first_failure(worker.rank, exitcode, self.last.error_message, fault)
            if self.quarantine is not None:
                self.quarantine.first_failure(f"rank {worker.rank}: {reason}", fault)

    def group_failed(self, reason: str, exitcode: int) -> None:
        """The group itself could not run: no worker to name."""
        self.last = Failure(
            local_rank=-1, rank=-1, pid=0, exitcode=exitcode, reason=reason, timestamp=time.time()
        )

    def do_not_requeue(self) -> list[str]:
        """Once the group failed: why the run must not be requeued, the summary's lines (the
        first says which verdict); none when a requeue may help. ``max_no_progress_restarts``
        0 turns both verdicts off."""
        if self.progress.exhausted:
            return self.no_progress_report()
        failure = self.bad_program.verdict(step_seen=self.progress.seen)
        if failure is None or not self.progress.limit:
            return []
        ranks = sorted(self.bad_program.ranks)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return [
            f"do not requeue (exit {EXIT_NO_PROGRESS}): bad program: {who} on {self.node} failed "
            f"the same way in all {self.bad_program.attempts} attempts: "
            f"{failure.error or describe_exit(failure.exitcode)}"
        ]

    def no_progress_report(self) -> list[str]:
        """Why a run that ended for lack of progress must not be requeued: what counted as
        a step, then each rank's failure on this node and in how many of the attempts
        without progress, the most frequent first."""
        streak = self.progress.streak
        lines = [
            f"do not requeue (exit {EXIT_NO_PROGRESS}): {streak} failed attempts in a row "
            f"made no progress ({self.progress.describe()})"
        ]
        recent = list(self.firsts)[-streak:] if streak else []
        causes = Counter((f.rank, f.error_message or f.reason) for f in recent)
        return lines + [
            f"rank {rank} on {self.node}: {what} ({count} of {streak} attempts)"
            for (rank, what), count in causes.most_common()
        ]
