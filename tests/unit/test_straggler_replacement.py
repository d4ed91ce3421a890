"""When a node steps aside for its straggler: which flags name a rank, and for how long."""

from __future__ import annotations

import pytest

from watchdogd.core.job_stragglers import NodeSummary, RankSummary, fastest, summarize
from watchdogd.core.scope_stats import ScopeKey
from watchdogd.core.straggler_replacement import PersistentStragglers, Straggler, named
from watchdogd.core.stragglers import Stragglers

WINDOW = 6
AFTER = 10.0


def row(number: int, median: float, flagged: bool, scope: str = "compute") -> RankSummary:
    return RankSummary(scope, number, median, 1.0, 1.0, 3, False, flagged)


def node(node_rank: int, *ranks: RankSummary) -> NodeSummary:
    return NodeSummary(hostname=f"n{node_rank}", node_rank=node_rank, seq=1, ranks=list(ranks))


# Node 1 runs ranks 2 (slow on compute) and 3; node 0 runs ranks 0 and 1.
MINE = node(1, row(2, 0.075, True), row(3, 0.05, False))
PEER = node(0, row(0, 0.05, False), row(1, 0.05, False))


def test_a_flag_that_singles_out_a_minority_names_the_rank_against_the_job() -> None:
    assert named(MINE, [PEER], world_size=4) == {("compute", 2): pytest.approx(2 / 3)}


def test_a_scope_where_half_or_more_are_flagged_names_nobody() -> None:
    # A step that holds the collective: every rank waits for the slowest, all flagged alike.
    alike = node(1, row(2, 0.15, True, "step"), row(3, 0.15, True, "step"))
    peer = node(0, row(0, 0.15, True, "step"), row(1, 0.15, True, "step"))
    assert named(alike, [peer], world_size=4) == {}
    # A whole node slow in a job of two: half of the ranks, not a minority.
    half = node(1, row(2, 0.075, True), row(3, 0.075, True))
    assert named(half, [PEER], world_size=4) == {}


def test_nobody_is_named_until_the_job_is_seen_whole() -> None:
    assert named(MINE, [], world_size=4) == {}  # the other node's summary not read (or stale)


def test_only_this_nodes_ranks_are_named() -> None:
    assert named(PEER, [MINE], world_size=4) == {}


def test_a_rank_named_for_the_whole_duration_is_returned_once_that_long() -> None:
    policy = PersistentStragglers(AFTER)
    assert policy.check(100.0, MINE, [PEER], 4) is None
    assert policy.check(109.9, MINE, [PEER], 4) is None
    found = policy.check(110.0, MINE, [PEER], 4)
    assert found == Straggler("compute", 2, pytest.approx(2 / 3), 10.0)
    assert found.reason() == "straggler: rank 2 scope compute relative 0.67 for 10 s"


def test_a_check_that_does_not_name_the_rank_starts_its_time_over() -> None:
    policy = PersistentStragglers(AFTER)
    assert policy.check(100.0, MINE, [PEER], 4) is None
    assert policy.check(105.0, MINE, [], 4) is None  # the peer's summary went stale
    assert policy.check(110.0, MINE, [PEER], 4) is None
    assert policy.check(120.0, MINE, [PEER], 4) is not None
    policy.reset()
    assert policy.check(121.0, MINE, [PEER], 4) is None


def test_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="after > 0"):
        PersistentStragglers(0)


def test_the_goodput_trainers_scopes_name_only_the_slow_rank() -> None:
    """Two nodes' boards, each rank timing ``compute`` (its own work) inside ``step``
    (compute and the all-reduce): rank 2's compute turns 1.5x slower, which makes every
    rank's step 1.5x longer. Only rank 2 is named, on compute; the step names nobody."""
    boards = {0: Stragglers(WINDOW, 0.85, 2), 1: Stragglers(WINDOW, 0.85, 2)}
    nodes = {0: (0, 1), 1: (2, 3)}

    def steps(count: int, slow: bool) -> None:
        for _ in range(count):
            for number, board in boards.items():
                for rank in nodes[number]:
                    compute = 0.075 if slow and rank == 2 else 0.05
                    board.add(ScopeKey("train", "compute", rank), compute)
                    board.add(ScopeKey("train", "step", rank), 0.15 if slow else 0.1)
            summaries = {n: summarize(b, "train", f"n{n}", n, 1) for n, b in boards.items()}
            for number, board in boards.items():
                board.set_remote("train", fastest([summaries[1 - number]]))

    steps(3 * WINDOW, slow=False)
    steps(3 * WINDOW, slow=True)
    flagged = sorted((key.scope, key.rank) for b in boards.values() for key in b.flagged)
    assert flagged == [("compute", 2), *(("step", rank) for rank in range(4))]
    summaries = {n: summarize(b, "train", f"n{n}", n, 1) for n, b in boards.items()}
    assert named(summaries[1], [summaries[0]], 4) == {("compute", 2): pytest.approx(2 / 3)}
    assert named(summaries[0], [summaries[1]], 4) == {}
