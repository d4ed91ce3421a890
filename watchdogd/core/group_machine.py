"""The worker group state machine. Pure: calls in, actions out, no clock of its own.

Rules
-----
- ``start`` spawns attempt 0: INIT -> HEALTHY.
- A worker that exits 0 is done; when every worker is done: HEALTHY -> SUCCEEDED.
- A worker that exits non-zero (a crash, or killed by its expired timer)
  fails the attempt: the others get SIGTERM, then SIGKILL ``shutdown_timeout``
  later (HEALTHY -> STOPPING). Once all have exited: STOPPING -> STOPPED, then
  STOPPED -> HEALTHY with a new attempt while restarts remain, else
  STOPPED -> FAILED.
- Progress (:class:`~watchdogd.core.progress.StepProgress`): a failed attempt
  that made none counts; at ``progress.limit`` such failures in a row,
  STOPPED -> FAILED instead of a restart (``progress.exhausted``: do not
  requeue). Each attempt's start and end is told to it.
- A worker stuck in D state, or a fatal fault of a GPU it uses:
  HEALTHY -> UNHEALTHY at once, every worker gets SIGKILL, and there is no
  restart (the node itself is suspect).
- ``stop`` (operator, shutdown): every worker is stopped, ending in STOPPED;
  ``abandon``: stopped before the attempt's workers started (it waited for its
  place in the job): HEALTHY -> STOPPED at once.
- ``signalled`` (the launcher received a signal it handles, torchrun's
  ``--signals-to-handle``): the same, the workers getting that signal
  instead of SIGTERM; a signal received while stopping is passed on too.
- ``error``: an attempt that cannot start (a command that is not there, a
  NUMA binding that cannot be applied, a rendezvous that failed) ends the
  group at once, no restart: any state but a final one -> FAILED. Whoever
  runs the machine kills what had started.
- ``restart`` (operator, or a node joined the job) stops the workers and
  starts a new attempt without spending a restart; ``fail`` (a peer node
  was lost) does the same as a worker failure, spending one.

Inputs come as methods, or as one :data:`Input` message fed to :meth:`feed`
(a runner's inbox holds them: each carries its reason). Actions are
returned in order: :class:`Transition` (record it),
:class:`Spawn` (start every worker of an attempt), :class:`Signal` (send to
these local ranks), :class:`Finished` (the group reached a final state).
``next_wake()`` says when to call ``tick`` (the SIGKILL escalation).
"""

from __future__ import annotations

import signal
from typing import Literal

import msgspec

from watchdogd.core.progress import StepProgress
from watchdogd_client.groups import GroupState

__all__ = [
    "Action",
    "Fail",
    "Finished",
    "GroupMachine",
    "Input",
    "Restart",
    "Signal",
    "Signalled",
    "Spawn",
    "Stop",
    "Transition",
    "Unhealthy",
    "WorkerExited",
    "WorkerStuck",
]

S = GroupState
AfterStop = Literal["restart", "restart_free", "fail", "stop"]


class Transition(msgspec.Struct, frozen=True):
    old: GroupState
    new: GroupState
    reason: str
    attempt: int


class Spawn(msgspec.Struct, frozen=True):
    attempt: int
    restart_count: int


class Signal(msgspec.Struct, frozen=True):
    local_ranks: tuple[int, ...]
    signal: int


class Finished(msgspec.Struct, frozen=True):
    state: GroupState


Action = Transition | Spawn | Signal | Finished


class WorkerExited(msgspec.Struct, frozen=True, tag=True):
    """Local rank ``local_rank`` of attempt ``attempt`` exited (an earlier attempt's: ignored)."""

    local_rank: int
    exitcode: int
    attempt: int


class WorkerStuck(msgspec.Struct, frozen=True, tag=True):
    local_rank: int


class Stop(msgspec.Struct, frozen=True, tag=True):
    reason: str = "stop requested"


class Signalled(msgspec.Struct, frozen=True, tag=True):
    signum: int


class Restart(msgspec.Struct, frozen=True, tag=True):
    reason: str = "restart requested"


class Unhealthy(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Fail(msgspec.Struct, frozen=True, tag=True):
    reason: str


Input = WorkerExited | WorkerStuck | Stop | Signalled | Restart | Unhealthy | Fail


class GroupMachine:
    def __init__(
        self,
        nproc: int,
        max_restarts: int,
        shutdown_timeout: float,
        progress: StepProgress | None = None,
    ) -> None:
        """``progress``: the steps its workers complete (None: not watched)."""
        self.nproc = nproc
        self.progress = StepProgress() if progress is None else progress
        self.max_restarts = max_restarts
        self.shutdown_timeout = shutdown_timeout
        self.state = S.INIT
        self.reason = "not started"
        """Why it is in its state (the last transition's reason)."""
        self.attempt = 0
        self.restarts_used = 0
        self.alive: set[int] = set()
        self.exitcodes: dict[int, int] = {}
        self._after_stop: AfterStop = "stop"
        self._kill_at: float | None = None

    @property
    def restarts_left(self) -> int:
        return self.max_restarts - self.restarts_used

    def next_wake(self) -> float | None:
        return self._kill_at

    # -- inputs ------------------------------------------------------------------

    def feed(self, event: Input, now: float) -> list[Action]:
        match event:
            case WorkerExited(local_rank, exitcode, attempt):
                if attempt != self.attempt:
                    return []
                return self.worker_exited(local_rank, exitcode, now)
            case WorkerStuck(local_rank):
                return self.worker_stuck(local_rank, now)
            case Stop(reason):
                return self.stop(now, reason)
            case Signalled(signum):
                return self.signalled(signum, now)
            case Restart(reason):
                return self.restart(now, reason)
            case Unhealthy(reason):
                return self.unhealthy(reason, now)
            case Fail(reason):
                return self.fail(reason, now)

    def start(self) -> list[Action]:
        if self.state is not S.INIT:
            raise RuntimeError(f"start() in state {self.state.value}")
        return self._spawn("starting")  # INIT -> HEALTHY

    def worker_exited(self, local_rank: int, exitcode: int, now: float) -> list[Action]:
        if local_rank not in self.alive:
            return []
        self.alive.discard(local_rank)
        self.exitcodes[local_rank] = exitcode
        if self.state is S.HEALTHY:
            if exitcode != 0:
                after: AfterStop = "restart" if self.restarts_left > 0 else "fail"
                return self._stop_workers(now, after, f"local rank {local_rank} failed")
            if not self.alive:
                return [self._move(S.SUCCEEDED, "every worker exited 0"), Finished(S.SUCCEEDED)]
            return []
        if self.state is S.STOPPING and not self.alive:
            return self._stopped()
        return []

    def worker_stuck(self, local_rank: int, now: float) -> list[Action]:
        """A worker stayed in D state past the timeout."""
        return self.unhealthy(f"local rank {local_rank} stuck in D state", now)

    def unhealthy(self, reason: str, now: float) -> list[Action]:
        """The node cannot run this group (D state, a GPU fault): stop, no restart."""
        if self.state not in (S.HEALTHY, S.STOPPING):
            return []
        actions: list[Action] = [self._move(S.UNHEALTHY, reason)]  # -> UNHEALTHY
        if self.alive:
            actions.append(Signal(tuple(sorted(self.alive)), signal.SIGKILL))
        self._kill_at = None
        actions.append(Finished(S.UNHEALTHY))
        return actions

    def fail(self, reason: str, now: float) -> list[Action]:
        """The attempt failed for a reason outside this node (a peer node was lost)."""
        if self.state is not S.HEALTHY:
            return []
        after: AfterStop = "restart" if self.restarts_left > 0 else "fail"
        return self._stop_workers(now, after, reason)

    def error(self, reason: str) -> list[Action]:
        """The group cannot run (its attempt cannot start): FAILED, with no restart."""
        if self.state in (S.SUCCEEDED, S.FAILED, S.STOPPED, S.UNHEALTHY):
            return []  # finished (STOPPED rests only once the group is over)
        self._kill_at = None
        return [self._move(S.FAILED, reason), Finished(S.FAILED)]  # any -> FAILED

    def not_needed(self, reason: str) -> list[Action]:
        """The job ended while this node waited for a place (a standby): no worker ran."""
        if self.state is not S.HEALTHY:
            return []
        self.alive = set()  # spawned, but the attempt never started: nobody to stop
        return [self._move(S.SUCCEEDED, reason), Finished(S.SUCCEEDED)]  # HEALTHY -> SUCCEEDED

    def abandon(self, reason: str) -> list[Action]:
        """Stopped while the attempt waited for its place (a standby, a node set aside),
        before any worker started: nobody to stop."""
        if self.state is not S.HEALTHY:
            return []
        self.alive = set()
        return [self._move(S.STOPPED, reason), Finished(S.STOPPED)]  # HEALTHY -> STOPPED

    def stop(self, now: float, reason: str = "stop requested") -> list[Action]:
        if self.state is S.HEALTHY:
            return self._stop_workers(now, "stop", reason)
        if self.state is S.STOPPING:
            self._after_stop = "stop"
        return []

    def signalled(self, signum: int, now: float) -> list[Action]:
        """The launcher got ``signum``: the workers get it, and the group stops."""
        reason = f"{signal.Signals(signum).name} received"
        if self.state is S.HEALTHY:
            return self._stop_workers(now, "stop", reason, signum)
        if self.state is S.STOPPING:
            self._after_stop = "stop"  # no restart after this attempt either
            return [Signal(tuple(sorted(self.alive)), signum)] if self.alive else []
        return []

    def restart(self, now: float, reason: str = "restart requested") -> list[Action]:
        """Start a new attempt without spending a restart (operator, scale-up)."""
        if self.state is S.HEALTHY:
            return self._stop_workers(now, "restart_free", reason)
        return []

    def tick(self, now: float) -> list[Action]:
        if self._kill_at is None or now < self._kill_at or self.state is not S.STOPPING:
            return []
        self._kill_at = None
        return [Signal(tuple(sorted(self.alive)), signal.SIGKILL)]

    # -- transitions -------------------------------------------------------------

    def _move(self, new: GroupState, reason: str) -> Transition:
        old, self.state, self.reason = self.state, new, reason
        return Transition(old, new, reason, self.attempt)

    def _spawn(self, reason: str) -> list[Action]:
        self.progress.begin(self.attempt)
        self.alive = set(range(self.nproc))
        self.exitcodes = {}
        return [
            self._move(S.HEALTHY, reason),
            Spawn(self.attempt, self.restarts_used),
        ]

    def _stop_workers(
        self, now: float, after: AfterStop, reason: str, signum: int = signal.SIGTERM
    ) -> list[Action]:
        self._after_stop = after
        actions: list[Action] = [self._move(S.STOPPING, reason)]  # HEALTHY -> STOPPING
        if not self.alive:
            return actions + self._stopped()
        self._kill_at = now + self.shutdown_timeout
        actions.append(Signal(tuple(sorted(self.alive)), signum))
        return actions

    def _stopped(self) -> list[Action]:
        self._kill_at = None
        actions: list[Action] = [self._move(S.STOPPED, "every worker exited")]
        after: AfterStop | Literal["no_progress"] = self._after_stop
        if after in ("restart", "fail", "restart_free"):
            failed = after != "restart_free"
            if self.progress.attempt_ended(failed=failed):
                after = "no_progress"
        match after:
            case "no_progress":  # STOPPED -> FAILED, do not requeue
                reason = (
                    f"no progress in {self.progress.streak} failed attempts in a row "
                    f"({self.progress.describe()})"
                )
                actions += [self._move(S.FAILED, reason), Finished(S.FAILED)]
            case "restart":
                self.restarts_used += 1
                self.attempt += 1
                actions += self._spawn(f"restart {self.restarts_used} of {self.max_restarts}")
            case "restart_free":
                self.attempt += 1
                actions += self._spawn("restart (not counted)")
            case "fail":
                actions += [self._move(S.FAILED, "no restarts left"), Finished(S.FAILED)]
            case "stop":
                actions.append(Finished(S.STOPPED))
        return actions
