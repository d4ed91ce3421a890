"""The noisy-event limiter: rate per key in a sliding window, summaries, bounded memory."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from watchdogd.core.throttle import Throttle


def test_a_key_gets_rate_events_then_the_rest_are_counted_in_one_summary() -> None:
    throttle: Throttle[str] = Throttle(3, window=1.0)
    verdicts = [throttle.allow("nobody", 10.0 + i / 1000) for i in range(10)]
    assert verdicts == [True] * 3 + [False] * 7
    assert throttle.next_due() == pytest.approx(10.003 + 1.0)
    assert throttle.due(10.5) == []  # not due yet
    assert throttle.due(11.003) == [("nobody", 7)]
    assert throttle.next_due() is None


def test_keys_are_limited_apart() -> None:
    throttle: Throttle[tuple[str, int]] = Throttle(2)
    for _ in range(5):
        throttle.allow(("socket", 65534), 0.0)
    assert throttle.allow(("socket", 1000), 0.0)  # another uid is not held back
    assert throttle.allow(("fifo", 65534), 0.0)
    assert throttle.due(1.0) == [(("socket", 65534), 3)]


def test_the_window_slides_an_event_is_allowed_once_the_oldest_is_a_window_old() -> None:
    throttle: Throttle[str] = Throttle(2, window=1.0)
    assert throttle.allow("k", 0.0)
    assert throttle.allow("k", 0.6)
    assert not throttle.allow("k", 0.9)
    assert throttle.allow("k", 1.0)  # the one at 0.0 left the window
    assert not throttle.allow("k", 1.5)  # 0.6 and 1.0 are in it
    assert throttle.allow("k", 1.6)


def test_each_summary_closes_the_next_suppressed_event_opens_another() -> None:
    throttle: Throttle[str] = Throttle(1, window=1.0)
    throttle.allow("k", 0.0)
    throttle.allow("k", 0.1)  # suppressed: a summary due at 1.1
    throttle.allow("k", 0.2)
    assert throttle.due(1.1) == [("k", 2)]
    assert throttle.allow("k", 1.2)  # a fresh window: allowed again
    assert not throttle.allow("k", 1.3)  # opens the next summary, due at 2.3
    assert throttle.next_due() == pytest.approx(2.3)
    assert throttle.due(2.3) == [("k", 1)]


def test_summaries_come_in_order_of_being_due() -> None:
    throttle: Throttle[str] = Throttle(1)
    for key, t in (("a", 0.0), ("b", 0.2), ("c", 0.4)):
        throttle.allow(key, t)
        throttle.allow(key, t)
    assert throttle.due(1.3) == [("a", 1), ("b", 1)]
    assert throttle.due(5.0) == [("c", 1)]


def test_a_key_quiet_for_a_window_is_forgotten_when_its_summary_is_due() -> None:
    throttle: Throttle[int] = Throttle(1)
    for uid in range(1000):
        throttle.allow(uid, 0.0)
        throttle.allow(uid, 0.0)
    assert len(throttle.due(1.0)) == 1000
    assert throttle._sources == {}  # the flood left nothing behind


def test_a_larger_rate_takes_effect_at_once() -> None:
    throttle: Throttle[str] = Throttle(1)
    throttle.allow("k", 0.0)
    assert not throttle.allow("k", 0.1)
    throttle.resize(3)
    assert throttle.allow("k", 0.2)
    assert throttle.allow("k", 0.3)
    assert not throttle.allow("k", 0.4)
    with pytest.raises(ValueError, match="rate must be >= 1"):
        throttle.resize(0)


@given(
    rate=st.integers(1, 5),
    gaps=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=300),
)
def test_at_most_rate_events_and_one_summary_in_any_window_and_nothing_lost(
    rate: int, gaps: list[float]
) -> None:
    """Against a flood at any pace: the promise the events' readers rely on."""
    throttle: Throttle[str] = Throttle(rate, window=1.0)
    now = 0.0
    recorded: list[float] = []
    summaries: list[tuple[float, int]] = []
    for gap in gaps:
        now += gap
        due = throttle.next_due()
        if due is not None and due <= now:  # the summariser wakes when due
            summaries += [(due, count) for _, count in throttle.due(due)]
        if throttle.allow("k", now):
            recorded.append(now)
    summaries += [(now + 1.0, count) for _, count in throttle.due(now + 1.0)]
    assert len(recorded) + sum(count for _, count in summaries) == len(gaps)
    for start in recorded + [t for t, _ in summaries]:
        in_window = [t for t in recorded if start <= t < start + 1.0]
        assert len(in_window) <= rate
        assert sum(1 for t, _ in summaries if start <= t < start + 1.0) <= 1


def test_a_seeded_flood_of_a_million_events_yields_rate_per_second() -> None:
    rng = random.Random(3)
    throttle: Throttle[str] = Throttle(10)
    now, allowed = 0.0, 0
    for _ in range(1_000_000):
        now += rng.expovariate(100_000)  # ~10 s at 100,000 events a second
        allowed += throttle.allow("nobody", now)
    assert allowed <= 10 * (int(now) + 1)
