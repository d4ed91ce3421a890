"""A bad program: every attempt of a run failed the same way, by the program's own fault. Pure.

Rules
-----
A requeue cannot help a program that cannot start (an ImportError, a
SyntaxError, a ``sys.exit(1)`` at the top); it may help after a node's
fault, since the scheduler may place the job elsewhere. So the verdict is
conservative: any doubt keeps "a requeue may help".

- An attempt counts once its workers started on this node. One whose round
  never came (the rendezvous ended the job, a stop while it waited) neither
  counts nor clears the verdict.
- A counted attempt is judged by the first worker of this node that failed
  while the attempt still ran. The failure is the program's own when the
  worker exited with a status of its own (above 0: an exception,
  ``sys.exit``) and neither the OOM killer nor an expired timer had a hand
  in it (:func:`~watchdogd.core.quarantine.node_fault`). A signal, an OOM
  kill, a hang, a lost peer (no worker of this node failed), an attempt
  that ended without failing (an operator's restart, a node that joined):
  any one of them clears the verdict for the run.
- The same way: the same exit status and the same error (the message of
  torch's error file, exception type and text, or no file in both). Which
  rank fails first among ranks that all fail alike is chance, so ranks may
  differ.
- The verdict needs two counted attempts at least (one failure says nothing
  of the next), and no step shown in the run (``StepProgress.seen``): a
  program that completed a step can run.

Each node judges from its own ranks. Its limit, plainly: a node whose own
environment breaks the program the same way in every attempt (a package
missing from this node's image) reads as a bad program, on that node; so
does a peer's fault that makes this node's ranks raise the same exception
before any step in every attempt.
"""

from __future__ import annotations

import msgspec

from watchdogd.core.quarantine import NodeFault

__all__ = ["BadProgram", "ProgramFailure"]


class ProgramFailure(msgspec.Struct, frozen=True):
    """How a worker failed, as far as "the same way" looks."""

    exitcode: int
    error: str | None
    """The message of its error file (None: it wrote none)."""


class BadProgram:
    """The attempts of one group's run, and whether they all failed the same program's way."""

    def __init__(self) -> None:
        self.attempts = 0
        """Attempts counted (their workers started), the running one included."""
        self.failure: ProgramFailure | None = None
        """The way every counted attempt so far failed (None: none yet, or cleared)."""
        self.ranks: set[int] = set()
        """The ranks that failed first, over the counted attempts."""
        self.cleared = False
        """An attempt did not fail the program's way, or failed another way."""
        self._judged = True
        """The running attempt's first failure was seen (True before any attempt)."""

    def attempt_started(self) -> None:
        """The workers of a new attempt started: the last one's verdict is in."""
        self._attempt_over()
        self.attempts += 1
        self._judged = False

    def first_failure(
        self, rank: int, exitcode: int, error: str | None, fault: NodeFault | None
    ) -> None:
        """The running attempt's first failure on this node: global rank ``rank``'s, which
        ended with ``exitcode`` and wrote ``error``; ``fault``: what in it points at the node
        (:func:`~watchdogd.core.quarantine.node_fault`)."""
        if self._judged:
            return
        self._judged = True
        failure = ProgramFailure(exitcode, error)
        if exitcode <= 0 or fault is not None or self.failure not in (None, failure):
            self.cleared = True
            return
        self.failure = failure
        self.ranks.add(rank)

    def verdict(self, *, step_seen: bool) -> ProgramFailure | None:
        """Once the run is over: the way every attempt failed, if it is a bad program."""
        self._attempt_over()
        if self.cleared or step_seen or self.attempts < 2:
            return None
        return self.failure

    def _attempt_over(self) -> None:
        if not self._judged:  # it ended with no failure of its own on this node
            self.cleared = True
            self._judged = True
