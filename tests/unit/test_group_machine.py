"""The group state machine, by direct calls: no processes, no sleeps."""

from __future__ import annotations

import signal
from typing import Literal

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from watchdogd.core.group_machine import (
    Action,
    Fail,
    Finished,
    GroupMachine,
    Input,
    Restart,
    Signal,
    Signalled,
    Spawn,
    Stop,
    Transition,
    Unhealthy,
    WorkerExited,
    WorkerStuck,
)
from watchdogd.core.progress import StepProgress
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


def test_a_standby_the_job_ended_without_succeeds_with_nobody_to_stop() -> None:
    m = GroupMachine(nproc=2, max_restarts=1, shutdown_timeout=5)
    m.start()  # spawned: the attempt waits for its place in the job
    actions = m.not_needed("the job ended without it")
    assert moves(actions) == [(S.HEALTHY, S.SUCCEEDED)]
    assert actions[-1] == Finished(S.SUCCEEDED) and m.next_wake() is None
    assert m.stop(now=1) == [] and m.not_needed("again") == []


def test_an_attempt_stopped_while_it_waits_for_its_place_stops_at_once() -> None:
    m = GroupMachine(nproc=2, max_restarts=1, shutdown_timeout=5)
    m.start()  # spawned: a standby, or a node set aside, waits for a place
    actions = m.abandon("SIGTERM received")
    assert moves(actions) == [(S.HEALTHY, S.STOPPED)]
    assert actions[-1] == Finished(S.STOPPED) and m.next_wake() is None
    assert m.stop(now=1) == [] and m.abandon("again") == []


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


# -- the machine under random runs --------------------------------------------------

FINAL = (S.SUCCEEDED, S.FAILED, S.STOPPED, S.UNHEALTHY)
# Every edge the module's rules draw; `error` may fail a group from any state but a final one.
EDGES = {
    (S.INIT, S.HEALTHY),
    (S.HEALTHY, S.SUCCEEDED),
    (S.HEALTHY, S.STOPPING),
    (S.STOPPING, S.STOPPED),
    (S.STOPPED, S.HEALTHY),
    (S.STOPPED, S.FAILED),
    (S.HEALTHY, S.UNHEALTHY),
    (S.STOPPING, S.UNHEALTHY),
    (S.HEALTHY, S.FAILED),
    (S.STOPPING, S.FAILED),
}
exitcodes = st.sampled_from([0, 1, 2, -signal.SIGSEGV, -signal.SIGTERM, -signal.SIGKILL])
forwarded = st.sampled_from([signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
Cause = Literal["failure", "free", "stop"]


class MachineRuns(RuleBasedStateMachine):
    """A group's life as a runner lives it: a round is met (or fails) after each spawn,
    then workers exit, hang, stick in D state, and operators and peers step in.

    The model keeps what a runner would see: which workers run, which were sent a
    signal, why the last stop began, and how many restarts each kind there were;
    and, as a worker's steps would tell it, whether each attempt made progress and
    how many failed in a row without.
    While a round is being met the runner reads no input, so no rule but the
    round's fires then.
    """

    def __init__(self) -> None:
        super().__init__()
        self.machine = GroupMachine(1, 0, shutdown_timeout=5)  # until `start` picks one
        self.now = 0.0
        self.spawns = 0
        self.failure_restarts = 0
        self.free_restarts = 0
        self.running: set[int] = set()
        self.asked_to_stop: set[int] = set()
        self.meeting = False
        self.cause: Cause | None = None
        self.finished: S | None = None
        self.stepped = False
        """A worker of the current attempt completed a step."""
        self.seen = False
        self.no_progress_failures = 0
        """Failed attempts in a row, once a step was seen, that completed none."""

    @initialize(nproc=st.integers(1, 3), max_restarts=st.integers(0, 3), limit=st.integers(0, 2))
    def start(self, nproc: int, max_restarts: int, limit: int) -> None:
        progress = StepProgress(limit)
        self.machine = GroupMachine(nproc, max_restarts, shutdown_timeout=5, progress=progress)
        self.apply(self.machine.start())
        self.rendezvous_round("met")  # the first: a round that fails is a later one's

    # -- carrying out what the machine says --------------------------------------------

    def feed(self, event: Input) -> None:
        before = self.machine.state
        actions = self.machine.feed(event, self.now)
        if (S.HEALTHY, S.STOPPING) in moves(actions) or (
            before is S.STOPPING and isinstance(event, Stop | Signalled)
        ):
            match event:
                case WorkerExited() | Fail():
                    self.cause = "failure"
                case Restart():
                    self.cause = "free"
                case Stop() | Signalled():
                    self.cause = "stop"
        self.apply(actions)

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            assert self.finished is None, f"{action} after the group finished"
            match action:
                case Transition(old, new):
                    assert (old, new) in EDGES
                    if (old, new) == (S.STOPPING, S.STOPPED):
                        self.attempt_ended()
                    if (old, new) == (S.STOPPED, S.FAILED):
                        assert self.cause == "failure"
                        assert self.failure_restarts == self.machine.max_restarts or (
                            self.machine.progress.exhausted
                        )
                case Spawn(attempt, restart_count):
                    assert attempt == self.spawns
                    if self.spawns:
                        if self.cause == "failure":
                            self.failure_restarts += 1
                        else:
                            assert self.cause == "free", f"a restart after {self.cause}"
                            self.free_restarts += 1
                    assert restart_count == self.failure_restarts
                    self.spawns += 1
                    self.meeting = True  # the runner meets the round before any worker starts
                    assert not self.machine.progress.exhausted  # never a restart after it
                    self.running, self.asked_to_stop, self.cause = set(), set(), None
                    self.stepped = False
                case Signal(local_ranks):
                    assert set(local_ranks) <= self.running
                    self.asked_to_stop |= set(local_ranks)
                case Finished(state):
                    assert state in FINAL
                    if state is S.STOPPED:
                        assert self.cause == "stop"
                    self.finished = state

    def attempt_ended(self) -> None:
        """The model's count of failures without progress, as the attempt stops."""
        if self.cause not in ("failure", "free"):
            return
        if self.stepped:
            self.no_progress_failures = 0
        elif self.cause == "failure" and self.seen:
            self.no_progress_failures += 1

    def pick_running(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.running)))

    # -- rules ------------------------------------------------------------------------

    @precondition(lambda self: self.meeting and self.finished is None)
    @rule(outcome=st.sampled_from(["met", "met", "met", "failed"]))  # a failed round ends it
    def rendezvous_round(self, outcome: str) -> None:
        if outcome == "failed":
            self.apply(self.machine.error("rendezvous failed"))
            return
        self.meeting = False
        self.running = set(range(self.machine.nproc))

    @precondition(lambda self: not self.meeting and self.running and self.finished is None)
    @rule(data=st.data(), exitcode=exitcodes)
    def worker_exits(self, data: st.DataObject, exitcode: int) -> None:
        local_rank = self.pick_running(data)
        self.running.discard(local_rank)
        self.feed(WorkerExited(local_rank, exitcode, self.machine.attempt))

    @precondition(lambda self: not self.meeting and self.running and self.finished is None)
    @rule(data=st.data())
    def worker_hangs_and_its_timer_kills_it(self, data: st.DataObject) -> None:
        local_rank = self.pick_running(data)
        self.running.discard(local_rank)
        self.feed(WorkerExited(local_rank, -signal.SIGKILL, self.machine.attempt))

    @precondition(lambda self: not self.meeting and self.asked_to_stop & self.running)
    @rule(data=st.data())
    def signalled_worker_exits(self, data: st.DataObject) -> None:
        local_rank = data.draw(st.sampled_from(sorted(self.asked_to_stop & self.running)))
        self.running.discard(local_rank)
        if self.finished is None:
            self.feed(WorkerExited(local_rank, -signal.SIGTERM, self.machine.attempt))

    @precondition(lambda self: not self.meeting and self.running and self.finished is None)
    @rule(data=st.data())
    def a_worker_completes_a_step(self, data: st.DataObject) -> None:
        self.machine.progress.released(self.machine.attempt, f"scope {self.pick_running(data)}")
        self.stepped = self.seen = True

    @precondition(lambda self: not self.meeting and self.machine.attempt > 0 and self.running)
    @rule(data=st.data())
    def an_earlier_attempts_exit_is_ignored(self, data: st.DataObject) -> None:
        stale = WorkerExited(self.pick_running(data), 1, self.machine.attempt - 1)
        assert self.machine.feed(stale, self.now) == []

    # One rule for the inputs that end a group, so that runs go on long enough to restart.
    @precondition(lambda self: not self.meeting and self.running and self.finished is None)
    @rule(data=st.data(), kind=st.sampled_from(["stop", "signal", "d_state", "gpu_fault"]))
    def the_group_is_ended(self, data: st.DataObject, kind: str) -> None:
        match kind:
            case "stop":
                self.feed(Stop())
            case "signal":
                self.feed(Signalled(data.draw(forwarded)))
            case "d_state":
                self.feed(WorkerStuck(self.pick_running(data)))
            case "gpu_fault":
                self.feed(Unhealthy("GPU 0: XID 79"))

    @precondition(lambda self: not self.meeting and self.finished is None)
    @rule()
    def a_node_waits_to_join(self) -> None:
        self.feed(Restart("a node is waiting to join"))  # scale-up: a restart that is free

    @precondition(lambda self: not self.meeting and self.finished is None)
    @rule()
    def a_peer_node_is_lost(self) -> None:
        self.feed(Fail("a node of the job was lost"))

    @precondition(lambda self: self.machine.next_wake() is not None and self.finished is None)
    @rule()
    def shutdown_timeout_passes(self) -> None:
        wake = self.machine.next_wake()
        assert wake is not None
        self.now = max(self.now, wake)
        self.apply(self.machine.tick(self.now))
        self.now += 1

    @precondition(lambda self: self.finished is not None)
    @rule(
        event=st.one_of(
            st.builds(Stop),
            st.builds(Signalled, forwarded),
            st.builds(Restart),
            st.builds(Fail, st.just("late")),
            st.builds(Unhealthy, st.just("late")),
            st.builds(WorkerStuck, st.integers(0, 2)),
        )
    )
    def a_finished_group_takes_no_more_input(self, event: Input) -> None:
        assert self.machine.feed(event, self.now) == []
        assert self.machine.error("late") == []

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def restarts_are_counted_by_kind(self) -> None:
        assert self.machine.restarts_used == self.failure_restarts
        assert self.machine.attempt == self.failure_restarts + self.free_restarts

    @invariant()
    def only_failures_without_progress_up_to_the_limit_end_it_for_good(self) -> None:
        progress = self.machine.progress
        at_the_limit = 0 < progress.limit <= self.no_progress_failures
        assert progress.exhausted == at_the_limit
        if at_the_limit:
            assert self.finished is S.FAILED

    @invariant()
    def no_more_failure_restarts_than_allowed(self) -> None:
        assert self.failure_restarts <= self.machine.max_restarts
        assert self.machine.restarts_left >= 0

    @invariant()
    def a_finished_group_has_asked_every_running_worker_to_stop(self) -> None:
        if self.finished is not None:
            assert self.machine.state is self.finished
            assert self.running <= self.asked_to_stop, (
                f"{self.finished.value} with local ranks {sorted(self.running)} running, "
                "never signalled"
            )

    @invariant()
    def the_machine_knows_who_runs(self) -> None:
        if not self.meeting and self.finished is None:
            assert self.machine.alive == self.running


TestMachineRuns = MachineRuns.TestCase
TestMachineRuns.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
