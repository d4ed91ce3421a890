"""The timer table against a naive model, plus the properties the daemon relies on."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from watchdogd.core.timers import TimerTable

pids = st.integers(min_value=2, max_value=6)
scopes = st.sampled_from(["a", "b", "c", "d"])
times = st.floats(min_value=0, max_value=100, allow_nan=False)


class TableMatchesModel(RuleBasedStateMachine):
    """Random arm/release/expire sequences: the heap table and a plain dict agree."""

    def __init__(self) -> None:
        super().__init__()
        self.table = TimerTable()
        self.model: dict[tuple[int, str], tuple[float, int]] = {}
        self.now = 0.0

    @rule(pid=pids, scope=scopes, delay=times, signal=st.integers(-1, 15))
    def arm(self, pid: int, scope: str, delay: float, signal: int) -> None:
        deadline = self.now + delay
        earlier = [d for d, _ in self.model.values()]
        became_first = self.table.arm(pid, scope, deadline, signal)
        self.model[(pid, scope)] = (deadline, signal)
        if not earlier or deadline < min(earlier):
            assert became_first

    @rule(pid=pids, scope=scopes)
    def release(self, pid: int, scope: str) -> None:
        removed = self.table.release(pid, scope)
        expected = self.model.pop((pid, scope), None)
        assert (removed is None) == (expected is None)

    @rule(pid=pids)
    def release_pid(self, pid: int) -> None:
        removed = {t.scope_id for t in self.table.release_pid(pid)}
        expected = {scope for (p, scope) in self.model if p == pid}
        assert removed == expected
        for scope in expected:
            del self.model[(pid, scope)]

    @rule(step=times)
    def advance(self, step: float) -> None:
        self.now += step
        expired = self.table.pop_expired(self.now)
        expected = sorted(
            (deadline, key) for key, (deadline, _) in self.model.items() if deadline <= self.now
        )
        assert [(t.deadline, (t.pid, t.scope_id)) for t in expired] == expected
        for _, key in expected:
            del self.model[key]

    @invariant()
    def same_contents(self) -> None:
        assert len(self.table) == len(self.model)
        assert {(t.pid, t.scope_id): (t.deadline, t.signal) for t in self.table} == self.model
        expected_next = min((d for d, _ in self.model.values()), default=None)
        assert self.table.next_deadline() == expected_next

    @invariant()
    def heap_stays_bounded(self) -> None:
        # Lazy deletion must not let dead entries pile up without bound.
        assert len(self.table._heap) <= max(64, 2 * len(self.table)) + 1


TestTableMatchesModel = TableMatchesModel.TestCase
TestTableMatchesModel.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_rearm_replaces_deadline_and_signal() -> None:
    table = TimerTable()
    table.arm(10, "step", 5.0, 9)
    table.arm(10, "step", 50.0, 15)
    assert table.pop_expired(10.0) == []
    (timer,) = table.pop_expired(60.0)
    assert (timer.deadline, timer.signal) == (50.0, 15)


def test_earlier_arm_reports_new_first_deadline() -> None:
    table = TimerTable()
    assert table.arm(10, "late", 100.0, 9)
    assert not table.arm(11, "later", 200.0, 9)
    assert table.arm(12, "soon", 1.0, 9)
    assert table.next_deadline() == 1.0


def test_churn_keeps_memory_proportional_to_live_timers() -> None:
    table = TimerTable()
    for i in range(100_000):
        table.arm(7, "step", float(i), 9)
        table.release(7, "step")
    assert len(table) == 0
    assert len(table._heap) <= 64 + 1
    assert table.next_deadline() is None


def test_equal_keys_from_both_transports_never_break_heap_order() -> None:
    table = TimerTable()
    table.arm(5, "s", 1.0, 9, "fifo", -1)
    table.arm(5, "s", 1.0, 9, "socket", 1000)
    table.arm(5, "s", 1.0, 9, "fifo", -1)
    assert [t.source for t in table.pop_expired(2.0)] == ["fifo"]
