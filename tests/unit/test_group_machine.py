"""The group state machine, by direct calls: no processes, no sleeps."""

from __future__ import annotations

import signal

from watchdogd.core.group_machine import Finished, GroupMachine, Signal, Spawn, Transition
from watchdogd_client.groups import GroupState as S


def moves(actions: list[object]) -> list[tuple[S, S]]:
    return [(a.old, a.new) for a in actions if isinstance(a, Transition)]


def test_success_when_every_worker_exits_zero() -> None:
    m = GroupMachine(nproc=2, max_restarts=1, shutdown_timeout=5)
    actions = m.start()
    assert moves(actions) == [(S.INIT, S.HEALTHY)]
    assert Spawn(0, 0) in actions
    assert m.worker_exited(0, 0, now=1) == []
    actions = m.worker_exited(1, 0, now=2)
    assert moves(actions) == [(S.HEALTHY, S.SUCCEEDED)]
    assert actions[-1] == Finished(S.SUCCEEDED)


def test_failure_stops_the_others_then_restarts_under_max_restarts() -> None:
    m = GroupMachine(nproc=3, max_restarts=1, shutdown_timeout=5)
    m.start()
    actions = m.worker_exited(1, -signal.SIGKILL, now=10)
    assert moves(actions) == [(S.HEALTHY, S.STOPPING)]
    assert Signal((0, 2), signal.SIGTERM) in actions
    assert m.next_wake() == 15
    assert m.tick(14.9) == []
    assert m.tick(15) == [Signal((0, 2), signal.SIGKILL)]
    assert m.worker_exited(0, -signal.SIGKILL, now=15.1) == []
    actions = m.worker_exited(2, -signal.SIGKILL, now=15.2)
    assert moves(actions) == [(S.STOPPING, S.STOPPED), (S.STOPPED, S.HEALTHY)]
    assert Spawn(1, 1) in actions
    assert (m.attempt, m.restarts_left) == (1, 0)
    # The second failure has no restart left.
    actions = m.worker_exited(0, 1, now=20)
    assert Signal((1, 2), signal.SIGTERM) in actions
    m.worker_exited(1, -signal.SIGTERM, now=20.1)
    actions = m.worker_exited(2, -signal.SIGTERM, now=20.2)
    assert moves(actions) == [(S.STOPPING, S.STOPPED), (S.STOPPED, S.FAILED)]
    assert actions[-1] == Finished(S.FAILED)


def test_single_worker_failure_goes_straight_to_restart() -> None:
    m = GroupMachine(nproc=1, max_restarts=2, shutdown_timeout=5)
    m.start()
    actions = m.worker_exited(0, 1, now=1)
    assert moves(actions) == [
        (S.HEALTHY, S.STOPPING),
        (S.STOPPING, S.STOPPED),
        (S.STOPPED, S.HEALTHY),
    ]
    assert m.next_wake() is None


def test_d_state_makes_the_group_unhealthy_without_restart() -> None:
    m = GroupMachine(nproc=2, max_restarts=5, shutdown_timeout=5)
    m.start()
    actions = m.worker_stuck(1, now=3)
    assert moves(actions) == [(S.HEALTHY, S.UNHEALTHY)]
    assert Signal((0, 1), signal.SIGKILL) in actions
    assert actions[-1] == Finished(S.UNHEALTHY)
    assert m.worker_exited(0, -9, now=4) == []
    assert m.state is S.UNHEALTHY


def test_operator_stop_ends_stopped_and_restart_is_free() -> None:
    m = GroupMachine(nproc=2, max_restarts=0, shutdown_timeout=5)
    m.start()
    actions = m.restart(now=1)
    assert Signal((0, 1), signal.SIGTERM) in actions
    m.worker_exited(0, -15, now=2)
    actions = m.worker_exited(1, -15, now=2)
    assert Spawn(1, 0) in actions
    assert m.restarts_left == 0
    m.stop(now=3)
    m.worker_exited(0, -15, now=4)
    actions = m.worker_exited(1, 0, now=4)
    assert moves(actions) == [(S.STOPPING, S.STOPPED)]
    assert actions[-1] == Finished(S.STOPPED)


def test_exits_after_success_or_of_unknown_ranks_are_ignored() -> None:
    m = GroupMachine(nproc=1, max_restarts=0, shutdown_timeout=5)
    m.start()
    assert m.worker_exited(7, 1, now=1) == []
    m.worker_exited(0, 0, now=1)
    assert m.worker_exited(0, 1, now=2) == []
    assert m.state is S.SUCCEEDED


def test_an_attempt_that_cannot_start_fails_the_group_without_a_restart() -> None:
    m = GroupMachine(nproc=2, max_restarts=3, shutdown_timeout=5)
    m.start()
    actions = m.error("cannot start '/nonexistent'")
    assert moves(actions) == [(S.HEALTHY, S.FAILED)]
    assert actions[-1] == Finished(S.FAILED)
    assert m.restarts_left == 3
    assert m.error("again") == []


def test_a_signal_the_launcher_received_reaches_the_workers_and_stops_the_group() -> None:
    m = GroupMachine(nproc=2, max_restarts=3, shutdown_timeout=5)
    m.start()
    actions = m.signalled(signal.SIGHUP, now=1)
    assert moves(actions) == [(S.HEALTHY, S.STOPPING)]
    assert Signal((0, 1), signal.SIGHUP) in actions
    assert m.next_wake() == 6  # SIGKILL after shutdown_timeout, as for SIGTERM
    assert m.worker_exited(0, -signal.SIGHUP, now=2) == []
    assert m.signalled(signal.SIGINT, now=3) == [Signal((1,), signal.SIGINT)]  # passed on
    actions = m.worker_exited(1, 0, now=4)
    assert moves(actions) == [(S.STOPPING, S.STOPPED)]
    assert actions[-1] == Finished(S.STOPPED)


def test_a_signal_while_stopping_for_a_restart_cancels_the_restart() -> None:
    m = GroupMachine(nproc=2, max_restarts=3, shutdown_timeout=5)
    m.start()
    m.worker_exited(0, 1, now=1)  # a failure: stopping to restart
    assert m.signalled(signal.SIGTERM, now=2) == [Signal((1,), signal.SIGTERM)]
    actions = m.worker_exited(1, -signal.SIGTERM, now=3)
    assert moves(actions) == [(S.STOPPING, S.STOPPED)]
    assert actions[-1] == Finished(S.STOPPED)
    assert m.restarts_used == 0
