"""Straggler scores: uniform ranks stay unflagged, a slow rank is named, and recovers."""

from __future__ import annotations

import random

from watchdogd.core.scope_stats import ScopeKey
from watchdogd.core.stragglers import Change, Stragglers

WINDOW = 50
RANKS = 8


def steps(
    board: Stragglers, rng: random.Random, count: int, slow: dict[int, float] | None = None
) -> list[Change]:
    """``count`` synchronous steps: every rank releases ``compute`` once (log-normal, sigma 0.1)."""
    changes = []
    for _ in range(count):
        for rank in range(RANKS):
            seconds = 0.2 * rng.lognormvariate(0, 0.1) * (slow or {}).get(rank, 1.0)
            change = board.add(ScopeKey("train", "compute", rank), seconds)
            if change is not None:
                changes.append(change)
    return changes


def test_uniform_ranks_are_never_flagged_over_many_windows() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    assert steps(board, random.Random(1), 200 * WINDOW) == []
    scored = list(board.ranks())
    assert len(scored) == RANKS and all(
        rank.windows == 399 for _, rank in scored
    )  # every half window
    assert min(min(r.relative, r.individual) for _, r in scored) > 0.85
    assert board.flagged == set() and board.flags == 0


def test_a_rank_thirty_percent_slower_is_flagged_within_two_windows_once() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    changes = steps(board, random.Random(2), 2 * WINDOW, slow={3: 1.3})
    assert [(c.key, c.flagged, c.windows) for c in changes] == [
        (ScopeKey("train", "compute", 3), True, 2)
    ]
    assert 0.7 < changes[0].relative < 0.85  # about 1 / 1.3
    assert changes[0].individual > 0.9  # it was slow from the start: only its peers show it
    assert steps(board, random.Random(3), 10 * WINDOW, slow={3: 1.3}) == []  # flagged once
    assert board.flagged == {ScopeKey("train", "compute", 3)} and board.flags == 1


def test_a_rank_that_slows_down_alone_is_flagged_against_its_own_best() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    key = ScopeKey("solo", "compute", 0)
    rng = random.Random(4)
    for _ in range(5 * WINDOW):
        assert board.add(key, 0.1 * rng.lognormvariate(0, 0.1)) is None
    changes = [board.add(key, 0.14 * rng.lognormvariate(0, 0.1)) for _ in range(2 * WINDOW)]
    (change,) = [c for c in changes if c is not None]
    assert change.flagged and change.relative == 1.0 and change.individual < 0.8


def test_a_flagged_rank_that_recovers_is_cleared_after_as_many_good_windows() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    rng = random.Random(5)
    steps(board, rng, 3 * WINDOW, slow={6: 1.5})
    assert board.flagged == {ScopeKey("train", "compute", 6)}
    assert steps(board, rng, WINDOW) == []  # one good window: not yet
    assert board.flagged == {ScopeKey("train", "compute", 6)}
    (cleared,) = steps(board, rng, WINDOW)
    assert cleared.key.rank == 6 and not cleared.flagged and cleared.windows == 2
    assert cleared.relative > 0.85 and board.flagged == set()


def test_scores_change_every_half_window_not_per_release() -> None:
    board = Stragglers(4, threshold=0.85, windows=1)
    fast, slow = ScopeKey("j", "s", 0), ScopeKey("j", "s", 1)
    for _ in range(4):
        board.add(fast, 1.0)
    for _ in range(3):
        assert board.add(slow, 2.0) is None
    assert [key for key, _ in board.ranks()] == [fast]  # rank 1 has no window yet
    change = board.add(slow, 2.0)
    assert change == Change(slow, True, 0.5, 1.0, 1)
    assert board.add(fast, 1.0) is None  # its next scoring: two releases on
    assert board.add(fast, 1.0) is None
    assert next(r for k, r in board.ranks() if k == fast).windows == 2


def test_a_slowdown_at_any_point_is_flagged_within_one_and_a_half_windows() -> None:
    for offset in range(0, WINDOW, 5):
        board = Stragglers(WINDOW, threshold=0.85, windows=2)
        rng = random.Random(offset)
        steps(board, rng, 3 * WINDOW + offset)
        taken = next(n for n in range(1, 2 * WINDOW) if steps(board, rng, 1, slow={2: 1.3}))
        assert taken <= 1.5 * WINDOW, (offset, taken)


def test_device_time_replaces_the_host_time_of_that_ranks_scope() -> None:
    board = Stragglers(4, threshold=0.85, windows=1)
    key = ScopeKey("j", "s", 0)
    for _ in range(3):
        board.add(key, 0.001)  # host time: kernel launches
    for _ in range(3):
        assert board.add(key, 0.5, device=True) is None
        assert board.add(key, 0.001) is None  # ignored from now on
    board.add(key, 0.5, device=True)
    ((_, rank),) = board.ranks()
    assert rank.device and rank.median == 0.5 and rank.windows == 1
    host = ScopeKey("j", "s", 1)
    for _ in range(4):
        board.add(host, 0.001)
    # A rank on host time is not compared with ranks on device time.
    assert [r.relative for _, r in board.ranks()] == [1.0, 1.0]


def test_a_new_window_size_starts_afresh() -> None:
    board = Stragglers(4, threshold=0.85, windows=1)
    for _ in range(4):
        board.add(ScopeKey("j", "s", 0), 1.0)
    board.configure(6, 0.9, 3)
    assert list(board.ranks()) == []
    for _ in range(6):
        board.add(ScopeKey("j", "s", 0), 1.0)
    ((_, rank),) = board.ranks()
    assert len(rank.samples) == 6 and rank.windows == 1
