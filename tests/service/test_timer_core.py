"""The timer core under a fake clock, against a plain model (extends ``TableMatchesModel``).

``tests/unit/test_timers.py`` checks the heap table alone. Here the whole
core runs — admission, the policy, the process watch's port, expiry, the
snapshot and its restore — with fakes at its ports: a clock the test moves,
processes that exist only as numbers, and a killer that writes down what it
was told to signal. Its decisions are the daemon's; only the I/O is fake.

Invariants, over many pids and random steps:
- no signal for a timer that was released, re-armed later, or whose process exited;
- every held timer is signalled at its deadline (simulated time), not later and not before;
- a restart from the snapshot restores the table exactly.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from watchdogd.core.config import Config
from watchdogd.core.policy import Requester
from watchdogd.core.ports import Metadata, SupervisedWorker
from watchdogd.core.timers import Ended, Timer
from watchdogd.linux.procs import ProcessHandle, ancestors
from watchdogd.linux.snapshot import SnapshotTimer
from watchdogd.service.reaper import Expiry
from watchdogd.service.stats import Stats
from watchdogd.service.timer_core import TimerCore

# Numbers no real process of this test's ancestry has (the policy protects those).
_FIRST_PID = 3_000_001
assert not set(range(_FIRST_PID, _FIRST_PID + 8)) & {1, os.getpid(), *ancestors(os.getpid())}
pids = st.integers(_FIRST_PID, _FIRST_PID + 5)
scopes = st.sampled_from(["step", "ckpt", "eval", "load"])
# Whole seconds: every deadline is exact in float64, so the model's arithmetic is the core's.
delays = st.integers(0, 100).map(float)
signals = st.sampled_from([9, 15])
_WALL_OFFSET = 1_700_000_000.0
_ROOT = Requester("socket", 0, True)


class FakeProcesses:
    """Processes that are numbers: alive until the test ends them, then a pid may come back."""

    def __init__(self, start_times: dict[int, int]) -> None:
        self.start_times = start_times
        """pid -> start time of the live process with that number (shared across restarts)."""
        self.watched: dict[int, ProcessHandle] = {}
        self.observers: list[Callable[[ProcessHandle], None]] = []

    def process(self, pid: int) -> ProcessHandle | None:
        return self.watched.get(pid)

    def open(self, pid: int) -> ProcessHandle:
        started = self.start_times.get(pid)
        if started is None:
            raise ProcessLookupError(pid)
        return ProcessHandle(pid, -1, 0, started, False)

    def watch(self, handle: ProcessHandle) -> None:
        self.watched[handle.pid] = handle

    def on_exit(self, observer: Callable[[ProcessHandle], None]) -> None:
        self.observers.append(observer)

    def owner(self, pid: int) -> int:
        return 0 if pid in self.watched else -1

    def start_time(self, pid: int) -> int | None:
        handle = self.watched.get(pid)
        return None if handle is None else handle.start_time

    def exit(self, pid: int) -> None:
        """The process ``pid`` exits; its number is taken by a new one at once."""
        self.start_times[pid] += 1
        handle = self.watched.pop(pid, None)
        if handle is not None:
            for observer in self.observers:
                observer(handle)


class FakeKiller:
    capturing = 0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.signalled: list[tuple[int, str, int, float]] = []
        """(pid, scope, signal, when) in the order they were sent."""

    def attach(self, task_group: object) -> None:
        raise AssertionError("the expiry loop is not run here")

    def expire(self, expired: list[Timer]) -> list[Expiry]:
        now = self.clock()
        self.signalled += [(t.pid, t.scope_id, t.signal, now) for t in expired]
        return []

    def record(self, done: list[Expiry]) -> None:
        assert done == []


class NoSupervision:
    def is_supervised(self, pid: int) -> bool:
        return False

    def worker(self, pid: int) -> SupervisedWorker | None:
        return None

    def timer_fired(self, pid: int, scope_id: str) -> None:
        raise AssertionError("no group here")

    def injected(self, pid: int) -> bool:
        return False

    def flight_recorders(self, pid: int) -> list[object]:
        return []


class NoLearner:
    def learned_expiration(
        self, uid: int, pid: int, scope_id: str, expiration_time: float
    ) -> float | str:
        raise AssertionError("no LEARN arms here")


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Metadata]]] = []

    def emit(self, name: str, /, **metadata: Metadata) -> None:
        self.emitted.append((name, metadata))

    def emit_at(self, level: int, name: str, /, **metadata: Metadata) -> None:
        self.emit(name, **metadata)


class CoreMatchesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.start_times = {pid: 1 for pid in range(_FIRST_PID, _FIRST_PID + 6)}
        self.killer = FakeKiller(lambda: self.now)
        self.model: dict[tuple[int, str], tuple[float, int]] = {}
        """(pid, scope) -> (deadline, signal): what must be armed."""
        self.ended: list[Ended] = []
        self.core = self._start()

    def _start(self) -> TimerCore:
        """A daemon starting: a new core, watching nothing yet."""
        self.processes = FakeProcesses(self.start_times)
        core = TimerCore(
            Config().timer_settings(),
            watch=self.processes,
            killer=self.killer,
            supervision=NoSupervision(),
            learner=NoLearner(),
            events=Events(),
            stats=Stats(),
            clock=lambda: self.now,
            wall_clock=lambda: self.now + _WALL_OFFSET,
        )
        core.on_ended(self.ended.append)
        return core

    @rule(pid=pids, scope=scopes, delay=delays, signal=signals)
    def arm(self, pid: int, scope: str, delay: float, signal: int) -> None:
        """A first arm, or a re-arm earlier or later: the latest deadline is the timer."""
        expiration = self.now + _WALL_OFFSET + delay
        assert self.core.arm(_ROOT, pid, scope, expiration, signal) is None
        self.model[(pid, scope)] = (self.now + delay, signal)

    @rule(pid=pids, scope=scopes)
    def release(self, pid: int, scope: str) -> None:
        assert self.core.release(_ROOT, pid, scope) is None
        if self.model.pop((pid, scope), None) is not None:
            timer, _, outcome, _ = self.ended[-1]
            assert (timer.pid, timer.scope_id, outcome) == (pid, scope, "released")

    @rule(pid=pids)
    def release_all(self, pid: int) -> None:
        assert self.core.release_all(_ROOT, pid) is None
        for key in [key for key in self.model if key[0] == pid]:
            del self.model[key]

    @rule(pid=pids)
    def process_exits(self, pid: int) -> None:
        self.processes.exit(pid)
        for key in [key for key in self.model if key[0] == pid]:
            del self.model[key]

    @rule(step=delays)
    def time_passes(self, step: float) -> None:
        self.now += step
        self._expire()

    @precondition(lambda self: bool(self.model))
    @rule()
    def until_the_next_deadline(self) -> None:
        self.now = min(deadline for deadline, _ in self.model.values())
        self._expire()

    @rule()
    def daemon_restarts(self) -> None:
        """The snapshot of this core, restored by the next one, is the same table."""
        saved: list[SnapshotTimer] = list(itertools.chain(*self.core.snapshot_timers(size=3)))
        self.core = self._start()
        for timer in saved:
            assert self.core.restore_timer(timer, self.now, self.now + _WALL_OFFSET)

    def _expire(self) -> None:
        sent = len(self.killer.signalled)
        self.core.expire(self.now)
        signalled = self.killer.signalled[sent:]
        due = {key for key, (deadline, _) in self.model.items() if deadline <= self.now}
        # Exactly the held timers whose deadline came, each once, with its own signal.
        assert sorted((pid, scope) for pid, scope, _, _ in signalled) == sorted(due)
        for pid, scope, signal, when in signalled:
            deadline, armed_signal = self.model.pop((pid, scope))
            assert signal == armed_signal
            assert when == self.now >= deadline

    @invariant()
    def the_table_is_the_model(self) -> None:
        table = {(t.pid, t.scope_id): (t.deadline, t.signal) for t in self.core.table}
        assert table == self.model
        soonest = min((deadline for deadline, _ in self.model.values()), default=None)
        assert self.core.table.next_deadline() == soonest


TestCoreMatchesModel = CoreMatchesModel.TestCase
TestCoreMatchesModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_a_peers_request_read_after_its_pid_was_taken_arms_nothing() -> None:
    # The peer (start time 1) exited with its acquire unread; its number now names
    # another process (start time 2) that the watch pinned meanwhile.
    machine = CoreMatchesModel()
    pid = _FIRST_PID
    machine.processes.exit(pid)
    assert machine.core.arm(_ROOT, pid, "other's", machine.now + _WALL_OFFSET + 60, 9) is None
    peer = ProcessHandle(pid, -1, 0, 1, False)
    refusal = machine.core.arm(_ROOT, pid, "peer's", machine.now + _WALL_OFFSET + 1, 9, peer)
    assert refusal is not None and refusal[0] == "no_such_process"
    assert [t.scope_id for t in machine.core.table] == ["other's"]
