"""Progress across attempts, and the group machine that stops restarting without it.

Direct calls, no processes, no sleeps: the rules of :mod:`watchdogd.core.progress`.
"""

from __future__ import annotations

from watchdogd.core.group_machine import Finished, GroupMachine, Spawn, Transition
from watchdogd.core.progress import StepProgress
from watchdogd_client.groups import GroupState as S


def fail_attempts(progress: StepProgress, count: int, *, first: int = 0) -> list[bool]:
    """``count`` attempts from ``first`` that fail having shown nothing; each one's verdict."""
    verdicts = []
    for attempt in range(first, first + count):
        progress.begin(attempt)
        verdicts.append(progress.attempt_ended(failed=True))
    return verdicts


def test_nothing_is_judged_before_a_step_was_ever_shown() -> None:
    # A program with no timers and no reports: never stopped, whatever the limit.
    progress = StepProgress(limit=1)
    assert fail_attempts(progress, 10) == [False] * 10
    assert progress.streak == 0


def test_releases_any_release_is_progress_and_a_silent_failure_is_not() -> None:
    progress = StepProgress(limit=2)
    progress.begin(0)
    progress.released(0, "train.py:42")
    assert progress.progressed()
    assert progress.attempt_ended(failed=True) is False
    assert progress.streak == 0
    # The second restart in a row without a release reaches the limit of 2.
    assert fail_attempts(progress, 2, first=1) == [False, True]
    assert progress.exhausted


def test_releases_one_step_after_a_resume_counts_however_few() -> None:
    # Attempt 0 ran 100 steps; attempt 1 resumed from a checkpoint and did one before failing.
    # Its absolute step is unknown, so it may be past 100: it must count.
    progress = StepProgress(limit=1)
    progress.begin(0)
    for _ in range(100):
        progress.released(0, "step")
    progress.attempt_ended(failed=True)
    for attempt in range(1, 6):
        progress.begin(attempt)
        progress.released(attempt, "step")
        assert progress.attempt_ended(failed=True) is False
    assert progress.streak == 0


def test_a_named_scope_counts_only_its_own_releases() -> None:
    progress = StepProgress(limit=1, scope="step")
    progress.begin(0)
    progress.released(0, "load")
    assert not progress.progressed() and not progress.seen  # "load" shows no step
    progress.released(0, "step")
    assert progress.progressed()
    progress.attempt_ended(failed=True)
    progress.begin(1)
    progress.released(1, "load")
    assert progress.attempt_ended(failed=True) is True
    assert progress.describe() == "no release of scope 'step'"


def test_late_releases_and_reports_of_an_earlier_attempt_are_ignored() -> None:
    progress = StepProgress(limit=1)
    progress.begin(0)
    progress.released(0, "step")
    progress.attempt_ended(failed=True)
    progress.begin(1)
    progress.released(0, "step")  # a worker of attempt 0 still exiting
    progress.reported(0, 500)
    assert not progress.progressed()


def test_reported_steps_recomputed_ones_do_not_count() -> None:
    progress = StepProgress(limit=2)
    progress.begin(0)
    for step in range(1, 106):
        progress.reported(0, step)
    assert progress.attempt_ended(failed=True) is False
    assert progress.highest == 105
    # Each later attempt resumes from the checkpoint at 100 and fails at 105 again, its
    # steps released as well: recomputed steps, no progress, whatever the releases say.
    verdicts = []
    for attempt in range(1, 3):
        progress.begin(attempt)
        for step in range(101, 106):
            progress.released(attempt, "step")
            progress.reported(attempt, step)
        verdicts.append(progress.attempt_ended(failed=True))
    assert verdicts == [False, True]
    assert progress.describe() == "no step past 105 reported (wd.progress)"


def test_reported_steps_one_step_further_each_time_is_progress() -> None:
    progress = StepProgress(limit=1)
    for attempt in range(20):
        progress.begin(attempt)
        progress.reported(attempt, 100)  # resumed from the checkpoint at 100
        progress.reported(attempt, 100 + attempt + 1)
        assert progress.attempt_ended(failed=True) is False
    assert progress.highest == 120


def test_an_attempt_that_ends_without_failing_neither_counts_nor_breaks_the_run() -> None:
    progress = StepProgress(limit=2)
    progress.begin(0)
    progress.released(0, "step")
    progress.attempt_ended(failed=True)
    fail_attempts(progress, 1, first=1)
    progress.begin(2)
    assert progress.attempt_ended(failed=False) is False  # an operator's restart
    assert progress.streak == 1
    assert fail_attempts(progress, 1, first=3) == [True]


def test_limit_zero_is_off() -> None:
    progress = StepProgress(limit=0)
    progress.begin(0)
    progress.released(0, "step")
    progress.attempt_ended(failed=True)
    assert fail_attempts(progress, 50, first=1) == [False] * 50
    assert progress.streak == 50


def fail_once(machine: GroupMachine, now: float) -> list[object]:
    """The single worker of ``machine``'s attempt exits 1."""
    return list(machine.worker_exited(0, 1, now))


def test_machine_ends_after_k_restarts_without_progress() -> None:
    progress = StepProgress(limit=3)
    m = GroupMachine(nproc=1, max_restarts=100, shutdown_timeout=5, progress=progress)
    m.start()
    progress.released(0, "step")
    for attempt in range(1, 4):  # attempt 0 progressed; 1..3, after restarts 1..3, do not
        actions = fail_once(m, attempt)
        assert Spawn(attempt, attempt) in actions
    actions = fail_once(m, 4)  # the third restart in a row without progress: no fourth
    assert m.restarts_used == 3
    moves = [a.new for a in actions if isinstance(a, Transition)]
    assert moves == [S.STOPPING, S.STOPPED, S.FAILED]
    assert actions[-1] == Finished(S.FAILED)
    failed = [a for a in actions if isinstance(a, Transition) and a.new is S.FAILED]
    assert failed[0].reason == "no progress in 3 failed attempts in a row (no timer released)"
    assert progress.exhausted


def test_machine_keeps_restarting_a_job_that_progresses() -> None:
    progress = StepProgress(limit=1)
    m = GroupMachine(nproc=1, max_restarts=50, shutdown_timeout=5, progress=progress)
    m.start()
    for attempt in range(50):
        progress.reported(attempt, 1000 + attempt)
        assert Spawn(attempt + 1, attempt + 1) in fail_once(m, attempt)
    assert not progress.exhausted and m.state is S.HEALTHY


def test_machine_without_restarts_left_and_no_progress_is_exhausted_too() -> None:
    progress = StepProgress(limit=2)
    m = GroupMachine(nproc=1, max_restarts=2, shutdown_timeout=5, progress=progress)
    m.start()
    progress.released(0, "step")
    fail_once(m, 1)
    fail_once(m, 2)  # attempt 1: a restart without progress, one below the limit
    assert m.state is S.HEALTHY
    fail_once(m, 3)  # attempt 2: no restart left, and the limit reached
    assert m.state is S.FAILED and progress.exhausted
