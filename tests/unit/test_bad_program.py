"""A bad program: every attempt failed the same way, by the program's own fault.

Direct calls, no processes, no sleeps: the rules of :mod:`watchdogd.core.bad_program`.
"""

from __future__ import annotations

import signal

import pytest

from watchdogd.core.bad_program import BadProgram, ProgramFailure
from watchdogd.core.quarantine import NodeFault

IMPORT_ERROR = "ModuleNotFoundError: No module named 'nope'"


def attempts(*failures: tuple[int, int, str | None, NodeFault | None] | None) -> BadProgram:
    """A run whose attempts failed so: (rank, exitcode, error, fault) each, or None for an
    attempt whose workers started and none of them failed on this node."""
    bad = BadProgram()
    for failure in failures:
        bad.attempt_started()
        if failure is not None:
            bad.first_failure(*failure)
    return bad


def test_every_attempt_failing_alike_is_a_bad_program_whichever_rank_failed_first() -> None:
    bad = attempts(
        (1, 1, IMPORT_ERROR, None), (0, 1, IMPORT_ERROR, None), (1, 1, IMPORT_ERROR, None)
    )
    assert bad.verdict(step_seen=False) == ProgramFailure(1, IMPORT_ERROR)
    assert (bad.attempts, bad.ranks) == (3, {0, 1})
    # Only the first failure of an attempt is judged: the others' are its consequences.
    bad = attempts((0, 2, None, None), (0, 2, None, None))
    bad.first_failure(1, -signal.SIGKILL, None, "signal")
    assert bad.verdict(step_seen=False) == ProgramFailure(2, None)


@pytest.mark.parametrize(
    "second",
    [
        (0, -signal.SIGKILL, None, "signal"),  # a signal
        (0, -signal.SIGKILL, None, "oom"),  # the OOM killer
        (0, 1, IMPORT_ERROR, "hang"),  # exited 1 on the timer's SIGTERM
        (0, 0, None, None),  # stuck in D state
        (0, 2, IMPORT_ERROR, None),  # another status
        (0, 1, "SyntaxError: invalid syntax", None),  # another error
        (0, 1, None, None),  # no error file this time
        None,  # a peer was lost, or a restart: no worker of this node failed
    ],
    ids=["signal", "oom", "hang", "d-state", "status", "error", "no-file", "no-failure"],
)
def test_any_other_attempt_keeps_a_requeue(
    second: tuple[int, int, str | None, NodeFault | None] | None,
) -> None:
    bad = attempts((0, 1, IMPORT_ERROR, None), second, (0, 1, IMPORT_ERROR, None))
    assert bad.verdict(step_seen=False) is None


def test_a_step_or_a_single_attempt_keeps_a_requeue() -> None:
    assert attempts((0, 1, None, None), (0, 1, None, None)).verdict(step_seen=True) is None
    assert attempts((0, 1, None, None)).verdict(step_seen=False) is None


def test_a_last_attempt_with_no_failure_of_its_own_keeps_a_requeue() -> None:
    # The last attempt's workers were stopped for a lost peer: judged when the run ends.
    bad = attempts((0, 1, None, None), (0, 1, None, None), None)
    assert bad.verdict(step_seen=False) is None


def test_an_attempt_whose_workers_never_started_does_not_count() -> None:
    # The rendezvous ended the job before the third attempt's round: two attempts count.
    bad = attempts((0, 1, None, None), (0, 1, None, None))
    assert bad.verdict(step_seen=False) == ProgramFailure(1, None)
    assert bad.attempts == 2
