"""The quarantine rule: which failures are the node's, which count, and when enough did."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from watchdogd.core.quarantine import NodeFailures, counts_against_node, node_fault


@pytest.mark.parametrize(
    ("exitcode", "oom_kills", "timer_expired", "fault"),
    [
        (-signal.SIGKILL, 1, False, "oom"),
        (-signal.SIGKILL, 0, True, "hang"),
        (-signal.SIGTERM, 0, True, "hang"),
        (-signal.SIGSEGV, 0, False, "signal"),
        (-signal.SIGKILL, 0, False, "signal"),
        (1, 0, False, None),  # a Python exception: the program's, on every node
        (3, 0, False, None),
        (137, 0, False, None),  # a status of its own, even one that reads like a signal
        (0, 0, False, None),
    ],
)
def test_only_kills_hangs_and_the_oom_killer_are_the_nodes(
    exitcode: int, oom_kills: int, timer_expired: bool, fault: str | None
) -> None:
    assert node_fault(exitcode, oom_kills=oom_kills, timer_expired=timer_expired) == fault


def test_a_failure_counts_only_when_the_nodes_and_the_first_in_the_job() -> None:
    assert counts_against_node("signal", first_in_job=True)
    assert not counts_against_node("hang", first_in_job=False)  # a collective's hang, second
    assert not counts_against_node(None, first_in_job=True)  # the program's exception


def test_f_failures_within_w_set_the_node_aside() -> None:
    failures = NodeFailures(after=3, window=60.0)
    assert not failures.count(0.0)
    assert not failures.count(30.0)
    assert failures.count(59.0) and len(failures) == 3


def test_failures_older_than_the_window_are_forgotten() -> None:
    failures = NodeFailures(after=2, window=60.0)
    assert not failures.count(0.0)
    assert not failures.count(60.0)  # the first one is exactly a window old: gone
    assert len(failures) == 1
    assert failures.count(119.0)


def test_zero_turns_the_rule_off_and_bad_settings_are_refused() -> None:
    off = NodeFailures(after=0, window=60.0)
    assert not any(off.count(float(t)) for t in range(100))
    with pytest.raises(ValueError):
        NodeFailures(after=-1, window=60.0)
    with pytest.raises(ValueError):
        NodeFailures(after=1, window=0.0)


@given(
    after=st.integers(min_value=1, max_value=5),
    gaps=st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=30),
)
def test_set_aside_exactly_when_after_failures_fall_in_one_window(
    after: int, gaps: list[float]
) -> None:
    window = 60.0
    failures = NodeFailures(after, window)
    times: list[float] = []
    now = 0.0
    for gap in gaps:
        now += gap
        times.append(now)
        recent = [t for t in times if t > now - window]
        assert failures.count(now) == (len(recent) >= after)
        assert len(failures) == len(recent)
