"""Rendezvous rounds by direct calls (no etcd, no clock), and the torchrun flag parsers."""

from __future__ import annotations

from typing import Any

import pytest

from watchdogd.core.rdzv_state import (
    Member,
    RendezvousClosedError,
    RestartCount,
    RoundState,
    advance,
    count_restart,
    membership,
    waiting_count,
    where,
)
from watchdogd.groups.etcd_rendezvous import parse_endpoints, parse_nnodes


def node(name: str, port: int = 1000) -> Member:
    return Member(node=name, addr=f"{name}.example", port=port)


def step(
    state: RoundState,
    me: Member,
    alive: set[str] | None = None,
    *,
    leaving: bool = True,
    min_nodes: int = 2,
    max_nodes: int = 3,
    last_call_over: bool = False,
) -> RoundState:
    """One node's move; by default every node named in ``state`` (and ``me``) is alive."""
    if alive is None:
        alive = {m.node for m in (*state.participants, *state.waiting)}
    return advance(
        state,
        me,
        alive,
        leaving=leaving,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call_over=last_call_over,
    )


def ranks(state: RoundState) -> dict[str, Any]:
    return {m.node: m.rank for m in state.participants}


def formed(*names: str, **limits: Any) -> RoundState:
    """The complete round that these nodes form when they arrive in this order."""
    state = RoundState()
    for index, name in enumerate(names):
        state = step(state, node(name, 1000 + index), **limits)
    if not state.complete:
        state = step(state, node(names[0], 1000), leaving=False, last_call_over=True, **limits)
    assert state.complete
    return state


def test_max_nodes_arriving_complete_the_round_with_ranks_in_arrival_order() -> None:
    state = step(RoundState(), node("a", 1111), max_nodes=2)
    assert (where(state, "a"), state.complete) == ("joined", False)
    state = step(state, node("b", 2222), max_nodes=2)
    assert state.complete
    assert ranks(state) == {"a": 0, "b": 1}
    assert (state.world_size, state.master_addr, state.master_port) == (2, "a.example", 1111)
    assert where(state, "a") == where(state, "b") == "running"


def test_min_nodes_complete_only_once_the_last_call_is_over() -> None:
    state = step(step(RoundState(), node("a")), node("b"))
    assert not state.complete  # 2 of max 3: the window stays open
    assert step(state, node("a"), leaving=False) == state  # nothing to write yet
    state = step(state, node("a"), leaving=False, last_call_over=True)
    assert state.complete and ranks(state) == {"a": 0, "b": 1}


def test_the_last_call_never_completes_a_round_below_min_nodes() -> None:
    state = step(RoundState(), node("a"), last_call_over=True)
    assert not state.complete


def test_a_node_arriving_at_a_complete_round_waits_and_the_runners_see_it() -> None:
    state = formed("a", "b")
    state = step(state, node("c"))
    assert where(state, "c") == "waiting"
    assert waiting_count(state, state.round, max_nodes=3) == 1
    assert membership(state, state.round, ["a", "b"], {"a", "b", "c"}, 3) == "waiting"


def test_spare_nodes_beyond_max_are_no_reason_to_restart() -> None:
    state = step(formed("a", "b", max_nodes=2), node("c"), max_nodes=2)
    assert where(state, "c") == "waiting"
    assert waiting_count(state, state.round, max_nodes=2) == 0
    assert membership(state, state.round, ["a", "b"], {"a", "b", "c"}, 2) is None


def test_the_next_round_opens_when_every_runner_came_back_and_keeps_their_ranks() -> None:
    state = formed("a", "b")
    state = step(state, node("c", 3000))  # newcomer waits
    state = step(state, node("b", 2000))  # b restarts: it leaves its place
    assert state.complete and [m.node for m in state.participants] == ["a"]  # a still runs
    assert membership(state, state.round, ["a", "b"], {"a", "b", "c"}, 3) == "waiting"
    old_round = state.round
    state = step(state, node("a", 1000))  # the last runner comes back: round 2 opens, full
    assert state.round == old_round + 1
    assert state.complete and ranks(state) == {"a": 0, "b": 1, "c": 2}
    assert (state.master_addr, state.master_port) == ("a.example", 1000)
    assert state.waiting == ()


def test_dead_nodes_are_dropped_and_the_survivors_keep_their_order() -> None:
    state = formed("a", "b", "c")
    assert membership(state, state.round, ["a", "b", "c"], {"b", "c"}, 3) == "lost"
    state = step(state, node("c"), alive={"b", "c"})
    state = step(state, node("b"), alive={"b", "c"})  # a is gone: b was the last runner
    assert not state.complete and [m.node for m in state.participants] == ["b", "c"]
    state = step(state, node("b"), alive={"b", "c"}, leaving=False, last_call_over=True)
    assert ranks(state) == {"b": 0, "c": 1}
    assert state.master_addr == "b.example"


def test_a_complete_round_whose_nodes_all_died_gives_way_to_a_newcomer() -> None:
    state = step(formed("a", "b"), node("c"), alive={"c"})
    assert state.round == 1 and [m.node for m in state.participants] == ["c"]


def test_a_participant_leaving_does_not_change_the_others_view_of_the_round() -> None:
    before = formed("a", "b")
    after = step(before, node("a"))  # a restarts before b even saw the round complete
    assert where(after, "b") == "running"
    assert (after.world_size, after.master_addr) == (before.world_size, before.master_addr)
    assert ranks(after) == {"b": 1}


def test_a_node_that_already_left_is_not_moved_again() -> None:
    state = step(formed("a", "b"), node("a"))
    assert step(state, node("a"), leaving=False) == state


def test_a_full_open_round_queues_the_next_node() -> None:
    state = step(step(RoundState(), node("a"), max_nodes=1), node("b"), max_nodes=1)
    assert (where(state, "a"), where(state, "b")) == ("running", "waiting")


def test_a_round_that_moved_on_means_this_node_was_dropped() -> None:
    state = formed("a", "b")
    later = RoundState(round=state.round + 1, participants=(node("b"),))
    assert membership(later, state.round, ["a", "b"], {"a", "b"}, 3) == "lost"


def test_closed_stops_joining_and_running() -> None:
    closed = RoundState(closed=True)
    with pytest.raises(RendezvousClosedError):
        step(closed, node("a"))
    assert membership(closed, 0, ["a"], {"a"}, 3) == "closed"


def test_the_same_inputs_give_the_same_ranks() -> None:
    assert formed("x", "y", "z") == formed("x", "y", "z")


def test_a_restart_is_counted_once_per_round() -> None:
    counter = count_restart(RestartCount(), round=0)
    assert counter == RestartCount(count=1, round=0)
    assert count_restart(counter, round=0) is counter  # a second node of the same round
    assert count_restart(counter, round=3) == RestartCount(count=2, round=3)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10.0.0.1:2379", [("10.0.0.1", 2379)]),
        ("etcd-a:2381,etcd-b", [("etcd-a", 2381), ("etcd-b", 2379)]),
        ("[::1]:2379, [fe80::1]", [("[::1]", 2379), ("[fe80::1]", 2379)]),
        ("[2001:db8::1:5]", [("[2001:db8::1:5]", 2379)]),
    ],
)
def test_endpoints_parse_like_torchruns(value: str, expected: list[tuple[str, int]]) -> None:
    assert parse_endpoints(value) == expected


@pytest.mark.parametrize(
    "value", ["", ",", "host:port", ":2379", "host:", "a:1:2", "::1", "[::1", "[]:1", "[::1]x"]
)
def test_bad_endpoints_are_named(value: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        parse_endpoints(value)


def test_nnodes_parse_as_min_and_max() -> None:
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "a", "1:", "1:b"):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)
