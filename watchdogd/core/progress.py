"""Whether a group's attempts make progress, and when to stop restarting one that does not.

Theory of operation
-------------------
A job that fails the same way on every attempt wastes its allocation, and a
scheduler that requeues it wastes the next one. The group counts the
attempts that failed in a row without progress; once ``limit`` restarts in
a row got none (each restarted attempt failed again without a new step),
it ends with :data:`EXIT_NO_PROGRESS` ("do not requeue") instead of
restarting once more.

Progress means a step past the highest step any earlier attempt reached.
Steps come from the workers of this node, in one of two ways:

- **reported** (``wd.progress(step)``): the step is absolute, so the rule is
  exact. Once any worker has reported a step in this run, an attempt
  progressed if and only if some worker reported a step above the highest
  that the earlier attempts reported. Recomputed steps (an attempt resumed
  from a checkpoint that does its last steps again) do not count. Releases
  no longer count once steps are reported.
- **released**: a release of the step scope (``--progress-scope``), or
  without one, of any scope (the scope with the most releases in an
  attempt has at least one if any has). The daemon does not know which
  step a release completes: an attempt resumed from a checkpoint at the
  highest step reached could progress with its first step. So the only
  attempt that surely made no progress is one that completed no step at
  all, and that is the rule: an attempt progressed if it released the step
  scope at least once. The limit, plainly: a job that resumes from a
  checkpoint and fails again before getting past where it failed last time
  still completes steps, and with releases alone it counts as progressing;
  ``wd.progress(step)`` tells it apart.

Never ending a healthy job comes first, so nothing is judged until a worker
of this run has shown a step (released the step scope, or reported one): a
program that uses no timers and reports no step is never stopped by this
rule, whatever ``limit`` says, and neither is a node whose ranks show none
(each node judges from its own ranks). ``limit`` 0 turns the rule off.
Attempts that end without failing (a restart an operator or a joining node
asked for) neither count nor break a run of failures.
"""

from __future__ import annotations

__all__ = ["EXIT_NO_PROGRESS", "StepProgress"]

EXIT_NO_PROGRESS = 93
"""The exit status of a job that must not be requeued (NVRx's, so one scheduler rule
serves both)."""


class StepProgress:
    """The steps of one group's attempts, and the failures in a row without progress."""

    def __init__(self, limit: int = 0, scope: str | None = None) -> None:
        """``limit``: restarts in a row without progress before the group ends (0: off);
        ``scope``: the scope whose release is a step (None: any scope)."""
        self.limit = limit
        self.scope = scope
        self.attempt = 0
        self.streak = 0
        """Failed attempts in a row, the latest included, that made no progress."""
        self.exhausted = False
        """The group ended for lack of progress."""
        self.highest: int | None = None
        """The highest step reported by the attempts before this one."""
        self.reporting = False
        """A worker of this run reported a step: the exact rule holds from now on."""
        self.seen = False
        """A worker of this run showed a step (released the step scope, or reported one)."""
        self._reported: int | None = None
        self._released = 0

    def begin(self, attempt: int) -> None:
        """Attempt ``attempt`` starts; what comes for any other attempt is ignored."""
        self.attempt = attempt
        self._reported = None
        self._released = 0

    def released(self, attempt: int, scope_id: str) -> None:
        """A worker of attempt ``attempt`` released ``scope_id``."""
        if attempt == self.attempt and (self.scope is None or scope_id == self.scope):
            self._released += 1
            self.seen = True

    def reported(self, attempt: int, step: int) -> None:
        """A worker of attempt ``attempt`` reported completing step ``step``."""
        if attempt != self.attempt:
            return
        self.reporting = self.seen = True
        if self._reported is None or step > self._reported:
            self._reported = step

    def progressed(self) -> bool:
        """Whether the current attempt got past the steps of the ones before it."""
        if self.reporting:
            reached = self._reported
            return reached is not None and (self.highest is None or reached > self.highest)
        return self._released > 0

    def attempt_ended(self, *, failed: bool) -> bool:
        """The current attempt is over; True if its failure reached the limit, which ends the
        group (``exhausted``)."""
        if self.progressed():
            self.streak = 0
            if self.reporting:
                self.highest = self._reported
        elif failed and self.seen:
            self.streak += 1
        self.exhausted = failed and 0 < self.limit <= self.streak
        return self.exhausted

    def describe(self) -> str:
        """What counted as a step, for the summary of a group that ended for lack of one."""
        if self.reporting:
            return f"no step past {self.highest} reported (wd.progress)"
        return f"no release of scope {self.scope!r}" if self.scope else "no timer released"
