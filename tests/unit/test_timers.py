"""The timer table against a naive model, plus the properties the daemon relies on."""

from __future__ import annotations

import array
import heapq
import math

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from watchdogd.core.timers import ReleaseMark, SlotPage, Timer, TimerTable
from watchdogd_client.slot_layout import (
    HELD_RING,
    PAGE_HELD,
    PAGE_HELD_WRITING,
    RELEASE_SLOT_FLOATS,
)

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


def _page(floats: int) -> memoryview[float]:
    return memoryview(array.array("d", [0.0] * floats)).cast("B").cast("d")


def test_a_release_mark_reads_the_latest_arm_until_it_is_released() -> None:
    slots = _page(8)
    mark = ReleaseMark(slots, 1, 2.0)  # the second arm of slot 1 (floats 4..7)
    slots[4:7] = array.array("d", [1.0, 2.0, 100.0])  # the first arm released, the second held
    assert mark.latest() == (2.0, 100.0)
    slots[5:7] = array.array("d", [3.0, 200.0])  # a store arm since
    assert mark.latest() == (3.0, 200.0)
    assert mark.armed() == 3.0
    slots[4] = 3.0  # released too: every arm up to it is
    assert mark.latest() is None
    slots[4] = math.nan  # garbage the owner wrote: never a release
    assert mark.latest() == (3.0, 200.0)
    mark.accept(3.0)
    assert slots[4 + 3] == 3.0


def test_a_release_mark_follows_store_arms_only() -> None:
    mark = ReleaseMark(_page(8), 1, 2.0)  # armed by a request: no deadline read yet
    assert not mark.newer(3.0, math.nan)  # a later arm whose request is on its way
    assert not mark.newer(1.0, 50.0)  # an older one
    assert mark.newer(3.0, 50.0)
    mark.arm, mark.written = 3.0, 50.0
    assert not mark.newer(3.0, 50.0)
    # The count was seen before its deadline (stores visible out of order): read again.
    assert mark.newer(3.0, 60.0)


def test_a_released_arm_stays_released_while_the_next_arm_is_a_request_or_refused() -> None:
    slots = _page(8)
    mark = ReleaseMark(slots, 1, 2.0)
    slots[4:7] = array.array("d", [2.0, 3.0, math.nan])  # arm 2 released; arm 3 sent as a frame
    assert mark.since() == "released"  # not held (and killed) until arm 3's request is read
    slots[4] = 1.0  # only arm 1 released: arm 2 holds
    assert mark.since() == "held"
    slots[5:7] = array.array("d", [3.0, 90.0])  # arm 3 a store arm: the timer now
    assert mark.since() == (3.0, 90.0)
    slots[4] = 3.0
    assert mark.since() == "released"


def test_held_ring_entries_being_written_over_are_lost_not_read() -> None:
    ring = 4 * RELEASE_SLOT_FLOATS
    floats = _page(ring + 3 * HELD_RING)
    page = SlotPage(floats, 4)
    page.scopes.update({1: "a", 2: "b"})

    def put(n: int, slot: int, armed: float, released: float) -> None:
        at = ring + 3 * (n % HELD_RING)
        floats[at : at + 3] = array.array("d", [slot, armed, released])

    for n in range(HELD_RING):
        put(n, 1, 100.0 + n, 101.0 + n)
    floats[PAGE_HELD_WRITING] = floats[PAGE_HELD] = HELD_RING
    # The owner is writing entry 1024 over entry 0 when the daemon reads.
    floats[PAGE_HELD_WRITING] = HELD_RING + 1
    put(HELD_RING, 2, 5000.0, 5010.0)
    first = page.held()
    assert len(first) == HELD_RING - 1 and page.lost == 1  # entry 0: maybe torn
    assert all(scope == "a" and released - armed == 1.0 for scope, armed, released in first)
    floats[PAGE_HELD] = HELD_RING + 1
    assert page.held() == [("b", 5000.0, 5010.0)]  # read once, as itself


def test_a_held_ring_read_can_stop_short_and_go_on_later() -> None:
    ring = 4 * RELEASE_SLOT_FLOATS
    floats = _page(ring + 3 * HELD_RING)
    page = SlotPage(floats, 4)
    page.scopes[1] = "a"
    for n in range(10):
        at = ring + 3 * n
        floats[at : at + 3] = array.array("d", [1, n, n + 0.5])
    floats[PAGE_HELD_WRITING] = floats[PAGE_HELD] = 10
    assert [armed for _, armed, _ in page.held(4)] == [0, 1, 2, 3]
    assert page.held(0) == []
    assert [armed for _, armed, _ in page.held()] == [4, 5, 6, 7, 8, 9]
    assert page.lost == 0


def test_timers_that_tie_up_to_their_marks_still_order() -> None:
    marked = Timer(1.0, 7, "step", 9, "socket", 0, 0.5, ReleaseMark(_page(4), 0, 1.0))
    plain = Timer(1.0, 7, "step", 9, "socket", 0, 0.5)
    heap = [marked, plain, Timer(1.0, 7, "step", 9, "socket", 0, 0.5)]
    heapq.heapify(heap)
    assert not marked < plain and not plain < marked
