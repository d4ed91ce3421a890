"""Straggler scores across nodes: the published summary, its staleness, job-wide scores."""

from __future__ import annotations

import msgspec

from watchdogd.core.job_stragglers import (
    STALE_INTERVALS,
    SUMMARY_BUDGET,
    NodeSummary,
    Peers,
    RankSummary,
    decode_summary,
    encode_summary,
    fastest,
    job_view,
    summarize,
)
from watchdogd.core.scope_stats import ScopeKey
from watchdogd.core.stragglers import Stragglers

WINDOW = 5


def windows(board: Stragglers, ranks: dict[int, float], count: int) -> list[int]:
    """``count`` windows of ``compute`` per rank at these durations; the ranks flagged."""
    flagged = []
    for _ in range(count * WINDOW):
        for rank, seconds in ranks.items():
            change = board.add(ScopeKey("train", "compute", rank), seconds)
            if change is not None and change.flagged:
                flagged.append(change.key.rank)
    return flagged


def node(node_rank: int, seq: int, *ranks: RankSummary) -> NodeSummary:
    return NodeSummary(hostname=f"n{node_rank}", node_rank=node_rank, seq=seq, ranks=list(ranks))


def rank(
    number: int, median: float, *, scope: str = "compute", device: bool = False
) -> RankSummary:
    return RankSummary(scope, number, median, 1.0, 1.0, 2, device, False)


def test_a_slow_node_is_invisible_to_itself_and_flagged_against_the_job() -> None:
    # Node 1 runs ranks 2 and 3, both 1.5x slower than node 0's: alike on node 1.
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    assert windows(board, {2: 0.15, 3: 0.15}, 4) == []
    published = summarize(board, "train", "n1", 1, seq=1)
    assert [(r.rank, r.relative, r.flagged) for r in published.ranks] == [
        (2, 1.0, False),
        (3, 1.0, False),
    ]
    # Node 0's summary arrives: its fastest median is node 1's yardstick from now on.
    board.set_remote("train", fastest([node(0, 1, rank(0, 0.1), rank(1, 0.1))]))
    assert sorted(windows(board, {2: 0.15, 3: 0.15}, 2)) == [2, 3]
    again = summarize(board, "train", "n1", 1, seq=2)
    assert all(r.flagged and abs(r.relative - 0.1 / 0.15) < 1e-9 for r in again.ranks)
    # Node 0 gone: set_remote with nothing; node 1's ranks recover after two windows.
    board.set_remote("train", {})
    windows(board, {2: 0.15, 3: 0.15}, 2)
    assert board.flagged == set()


def test_the_remote_fastest_is_per_job_scope_and_clock() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=2)
    board.set_remote("train", {("compute", False): 0.1, ("compute", True): 0.01})
    board.set_remote("eval", {("compute", False): 0.5})
    board.set_remote("train", {("compute", True): 0.02})
    assert board.remote == {("eval", "compute", False): 0.5, ("train", "compute", True): 0.02}


def test_a_summary_round_trips_and_another_version_is_skipped() -> None:
    summary = node(1, 7, rank(2, 0.15), rank(3, 0.2, device=True))
    data = encode_summary(summary)
    assert decode_summary(data) == summary
    assert len(data) < 200  # one small write
    newer = msgspec.json.encode({"version": 2, "anything": ["else"]})
    assert decode_summary(newer) is None
    assert decode_summary(b"{not json") is None
    assert decode_summary(b'{"version": 1, "hostname": 3}') is None


def test_a_summary_that_stops_moving_goes_stale_and_a_deleted_one_is_dropped() -> None:
    peers = Peers()
    interval = 1.0
    peers.update({"a": node(0, 1), "b": node(2, 1)}, now=0.0)
    for step in range(1, 10):  # a moves every interval; b never again
        peers.update({"a": node(0, 1 + step), "b": node(2, 1)}, now=float(step))
        stale = {s.node_rank: old for s, old in peers.read(float(step), interval)}
        assert stale == {0: False, 2: step > STALE_INTERVALS}
    assert [s.node_rank for s in peers.fresh(9.0, interval)] == [0]
    peers.update({"a": node(0, 11)}, now=10.0)  # b's key deleted (its lease ended)
    assert [s.node_rank for s, _ in peers.read(10.0, interval)] == [0]


def test_the_job_view_scores_every_rank_against_the_fastest_fresh_one() -> None:
    local = node(0, 0, rank(0, 0.10), rank(1, 0.11), rank(0, 0.01, scope="load"))
    slow = node(1, 5, rank(2, 0.20), rank(3, 0.10, device=True))
    dead = node(2, 3, RankSummary("compute", 4, 0.05, 0.4, 1.0, 9, False, True))
    rows = {(r.rank.scope, r.rank.rank): r for r in job_view(local, [(slow, False), (dead, True)])}
    assert sorted(rows) == [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3),
                            ("compute", 4), ("load", 0)]  # fmt: skip
    # The stale rank's 0.05 is not the yardstick: node 0's rank 0 is.
    assert rows["compute", 0].relative == 1.0
    assert abs(rows["compute", 2].relative - 0.5) < 1e-9
    assert (rows["compute", 2].hostname, rows["compute", 2].node_rank) == ("n1", 1)
    assert rows["compute", 3].relative == 1.0  # the only device-timed rank
    assert rows["compute", 4].stale and rows["compute", 4].relative == 0.4
    assert rows["compute", 4].rank.flagged  # its own node's flag, shown as it was


def test_a_summary_keeps_to_its_budget_flagged_ranks_first() -> None:
    board = Stragglers(WINDOW, threshold=0.85, windows=1)
    for index in range(2000):  # 2,000 scopes of 200-character names, one slow rank in each
        for _ in range(WINDOW):
            for number, seconds in ((0, 1.0), (1, 2.0)):
                board.add(ScopeKey("train", f"{index:04d}" + "x" * 196, number), seconds)
    summary = summarize(board, "train", "n0", 0, 1)
    assert len(encode_summary(summary)) < 2 * SUMMARY_BUDGET
    assert 0 < len(summary.ranks) < 4000
    assert all(row.flagged for row in summary.ranks)  # the flagged ones come first
