"""Rendezvous rounds by direct calls (no etcd, no clock), and the torchrun flag parsers."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given

from watchdogd.core.rdzv_state import (
    LastCall,
    LeaseClock,
    NodeRecord,
    Record,
    RendezvousClosedError,
    RestartCount,
    RoundState,
    asking,
    barrier_over,
    barrier_pending,
    count_restart,
    decide,
    last_call,
    membership,
    standing_by,
    stop_reason,
    succession_delay,
    waiting_count,
    where,
)
from watchdogd.groups.etcd_rendezvous import parse_endpoints


class Job:
    """The leader's view in a test: every live node's record, and etcd's revision counter."""

    def __init__(self, min_nodes: int = 2, max_nodes: int = 3) -> None:
        self.records: dict[str, Record] = {}
        self.revision = 0
        self.state = RoundState()
        self.restarts = 0
        self.ran: dict[str, int] = {}  # the last round each node ran
        self.limits = {"min_nodes": min_nodes, "max_nodes": max_nodes}

    def put(self, name: str, **fields: Any) -> None:
        old = self.records.get(name)
        base = old.value if old else NodeRecord(name=name, hostname=name, pid=1, addr=f"{name}.x")
        self.revision += 1
        self.records[name] = Record(msgspec.structs.replace(base, **fields), self.revision)

    def ask(self, name: str, port: int = 1000) -> None:
        """``name`` calls next_rendezvous: after the round it last ran, with its old rank."""
        rank = self.state.members.index(name) if name in self.state.members else None
        last = self.records.get(name)
        rank = rank if rank is not None else (last.value.rank if last else None)
        self.put(name, port=port, asks_after=self.ran.get(name, -1), rank=rank, ended=False)

    def end(self, name: str) -> None:
        self.put(name, asks_after=None, ended=True)

    def die(self, name: str) -> None:
        del self.records[name]

    def decide(self, last_call_over: bool = False) -> RoundState:
        self.state = decide(
            self.state, self.records, self.restarts, last_call_over=last_call_over, **self.limits
        )
        for name in self.state.members:  # the members see the round: they run it now
            self.ran[name] = self.state.round
        return self.state


def formed(*names: str, **limits: int) -> Job:
    """The job once these nodes asked in this order and the round completed."""
    job = Job(**limits)
    for index, name in enumerate(names):
        job.ask(name, 1000 + index)
    job.decide(last_call_over=True)
    assert job.state.complete
    return job


def test_max_nodes_asking_complete_the_round_in_the_order_they_asked() -> None:
    job = Job(max_nodes=2)
    job.ask("a", 1111)
    assert job.decide() == RoundState()  # 1 of max 2: nothing to write
    job.ask("b", 2222)
    state = job.decide()
    assert state.complete and state.members == ("a", "b")
    assert (state.master_addr, state.master_port) == ("a.x", 1111)
    assert where(state, "a", -1) == where(state, "b", -1) == "running"


def test_min_nodes_complete_only_once_the_last_call_is_over() -> None:
    job = Job()
    job.ask("a")
    job.ask("b")
    assert not job.decide().complete  # 2 of max 3: the window stays open
    assert job.decide(last_call_over=True).members == ("a", "b")


def test_the_last_call_never_completes_a_round_below_min_nodes() -> None:
    job = Job()
    job.ask("a")
    assert not job.decide(last_call_over=True).complete


def test_a_registered_node_that_does_not_ask_is_not_taken() -> None:
    job = Job(min_nodes=1)
    job.put("idle")
    job.ask("a")
    assert job.decide(last_call_over=True).members == ("a",)


def test_a_node_arriving_at_a_running_round_waits_and_the_runners_see_it() -> None:
    job = formed("a", "b")
    job.ask("c")
    state = job.decide()
    assert where(state, "c", -1) == "waiting"
    assert waiting_count(state, state.round) == 1
    assert membership(state, state.round) == "waiting"


def test_each_arrival_is_not_a_write_once_the_runners_were_told() -> None:
    job = formed("a", "b", max_nodes=4)
    job.ask("c")
    told = job.decide()
    job.ask("d")
    assert job.decide() is told  # still "waiting": nothing new for the runners


def test_spare_nodes_beyond_max_are_no_reason_to_restart() -> None:
    job = formed("a", "b", max_nodes=2)
    job.ask("c")
    state = job.decide()
    assert where(state, "c", -1) == "waiting"
    assert waiting_count(state, state.round) == 0
    assert membership(state, state.round) is None


def test_the_next_round_opens_when_every_runner_came_back_and_keeps_their_ranks() -> None:
    job = formed("a", "b")
    first = job.state.round
    job.ask("c", 3000)  # newcomer waits
    job.decide()
    job.ask("b", 2000)  # b restarts: it leaves its place
    state = job.decide()
    assert state.complete and state.round == first  # a still runs
    assert membership(state, first) == "waiting"
    job.ask("a", 1000)  # the last runner comes back: the next round opens, full
    state = job.decide()
    assert state.round == first + 1 and state.complete
    assert state.members == ("a", "b", "c")
    assert (state.master_addr, state.master_port, state.waiting) == ("a.x", 1000, 0)


def test_dead_nodes_are_dropped_and_the_last_rank_moves_into_the_hole() -> None:
    job = formed("a", "b", "c", max_nodes=3)
    job.die("a")
    state = job.decide()
    assert state.lost == ("a",)  # the leader tells the members, once
    assert membership(state, state.round) == "lost"
    job.ask("c")
    job.ask("b")
    state = job.decide()
    assert not state.complete and state.round == 1  # opened, waiting out the last call
    assert asking(state, job.records) == ["c", "b"]  # b keeps rank 1, c fills rank 0
    state = job.decide(last_call_over=True)
    assert state.members == ("c", "b") and state.master_addr == "c.x"


def standby_took(lost: str) -> RoundState:
    """Four nodes and a standby ``e`` (max 4); ``lost`` dies, the survivors ask again."""
    job = formed("a", "b", "c", "d", min_nodes=4, max_nodes=4)
    job.ask("e")
    assert waiting_count(job.decide(), 0) == 0  # a standby: no reason to restart
    job.die(lost)
    assert job.decide().lost == (lost,)
    for name in reversed("abcd"):  # the survivors come back in any order
        if name != lost:
            job.ask(name)
    state = job.decide()  # four ask: max, complete at once
    assert state.complete and state.round == 1
    return state


def test_a_standby_takes_a_lost_middle_ranks_place_and_the_others_keep_theirs() -> None:
    assert standby_took("b").members == ("a", "e", "c", "d")


def test_a_standby_takes_rank_zero_and_becomes_the_master() -> None:
    state = standby_took("a")
    assert state.members == ("e", "b", "c", "d")
    assert state.master_addr == "e.x"


def test_the_round_uses_rank_0s_store_when_its_agent_hosts_one() -> None:
    job = Job(max_nodes=2)
    job.put("a", port=1111, store=True, asks_after=-1)
    job.put("b", port=2222, asks_after=-1)
    state = job.decide()
    assert (state.master_port, state.master_store) == (1111, True)
    job = Job(max_nodes=2)
    job.put("a", port=1111, asks_after=-1)  # its helper still imports torch
    job.put("b", port=2222, store=True, asks_after=-1)
    assert (job.decide().master_port, job.state.master_store) == (1111, False)


def test_standbys_fill_the_lost_ranks_lowest_first_in_the_order_they_asked() -> None:
    job = formed("a", "b", "c", "d", max_nodes=4)
    job.ask("f")
    job.ask("e")
    job.die("d")
    job.die("b")
    job.decide()
    job.ask("c")
    job.ask("a")
    assert job.decide().members == ("a", "f", "c", "e")


def test_fewer_nodes_than_before_move_only_the_ranks_past_the_end() -> None:
    job = formed("a", "b", "c", "d", "e", min_nodes=2, max_nodes=5)
    job.die("b")
    job.die("c")
    job.decide()
    for name in "ade":
        job.ask(name)
    # Ranks stay contiguous: d and e (3, 4) move into 1 and 2; a keeps 0.
    assert job.decide(last_call_over=True).members == ("a", "d", "e")


def test_a_lost_node_back_under_a_new_id_is_the_next_standby() -> None:
    job = formed("a", "b", "c", "d", max_nodes=4)
    job.ask("e")
    job.die("b")
    job.decide()
    for name in "acd":
        job.ask(name)
    assert job.decide().members == ("a", "e", "c", "d")
    # b was cut off, and comes back registered anew: still claiming its rank of round 0.
    job.put("b2", port=1000, asks_after=0, rank=1, ended=False)
    state = job.decide()
    assert where(state, "b2", 0) == "waiting" and waiting_count(state, 1) == 0
    job.die("c")
    job.decide()
    for name in "ade":
        job.ask(name)
    # e's claim on rank 1 is from round 1, b2's from round 0: b2 takes the hole c left.
    assert job.decide().members == ("a", "e", "b2", "d")


def test_a_round_never_drops_a_member_for_a_newcomer() -> None:
    job = formed("a", "b", "c", min_nodes=1, max_nodes=3)
    job.ask("n1")
    job.ask("n2")
    job.ask("c")  # c restarts; the others follow: the new round has five asking for three
    job.ask("b")
    job.ask("a")
    assert job.decide().members == ("a", "b", "c")


@given(
    before=st.integers(1, 8),
    lost=st.sets(st.integers(0, 7)),
    newcomers=st.integers(0, 4),
    extra=st.integers(0, 3),
)
def test_survivors_keep_their_ranks_and_only_those_past_the_end_move(
    before: int, lost: set[int], newcomers: int, extra: int
) -> None:
    names = [f"n{rank}" for rank in range(before)]
    max_nodes = before + extra
    job = formed(*names, min_nodes=1, max_nodes=max_nodes)
    joining = [f"new{index}" for index in range(newcomers)]
    for name in joining:
        job.ask(name)
    survivors = [name for rank, name in enumerate(names) if rank not in lost]
    for rank in sorted(lost & set(range(before))):
        job.die(names[rank])
    job.decide()
    for name in survivors:
        job.ask(name)
    if not survivors and not joining:
        return
    state = job.decide(last_call_over=True)
    size = min(len(survivors) + len(joining), max_nodes)
    assert len(state.members) == size and set(survivors) <= set(state.members)
    moved = [name for name in survivors if state.members.index(name) != names.index(name)]
    assert moved == [name for name in survivors if names.index(name) >= size]
    taken = [name for name in state.members if name in joining]
    assert taken == joining[: len(taken)]  # newcomers in the order they asked


def test_a_finishing_round_restarts_for_no_newcomer_and_the_standby_is_over() -> None:
    job = formed("a", "b", min_nodes=1, max_nodes=2)
    job.ask("c")
    assert standing_by(job.decide(), 2) and where(job.state, "c", -1) == "waiting"
    job.end("a")
    state = job.decide()
    assert waiting_count(state, 0) == 0  # b finishes its work: a never comes back
    assert where(state, "c", -1) == "waiting"
    job.end("b")
    assert where(job.decide(), "c", -1) == "over"  # the job ended without it


def test_a_member_restarting_while_another_ended_still_brings_everyone_back() -> None:
    job = formed("a", "b", "c", max_nodes=3)
    job.end("a")
    job.ask("b")
    assert waiting_count(job.decide(), 0) == 1  # c must come back for b's new round


def test_a_standby_is_one_only_beside_a_full_round_that_lost_nobody() -> None:
    job = formed("a", "b", min_nodes=1, max_nodes=3)
    assert not standing_by(job.state, 3)  # room: a waiting node is taken
    assert standing_by(job.state, 2)
    job.die("a")
    assert not standing_by(job.decide(), 2)  # the lost node's rank is coming free


def test_a_closed_run_is_over_for_whoever_still_asks() -> None:
    job = formed("a", "b", max_nodes=2)
    closed = msgspec.structs.replace(job.state, closed=True)
    assert where(closed, "c", -1) == where(closed, "a", 0) == "over"


def test_a_second_death_in_a_failed_round_is_not_another_write() -> None:
    job = formed("a", "b", "c", "d", max_nodes=4)
    job.die("a")
    failed = job.decide()
    job.die("b")
    assert job.decide() is failed  # every member already stops: nothing new to tell


def test_a_complete_round_whose_nodes_all_died_gives_way_to_a_newcomer() -> None:
    job = formed("a", "b", min_nodes=1)
    job.die("a")
    job.die("b")
    job.ask("c")
    assert job.decide(last_call_over=True).members == ("c",)


def test_a_restarting_member_does_not_change_the_others_view_of_the_round() -> None:
    job = formed("a", "b")
    before = job.state
    job.ask("a")  # a restarts before b even saw the round complete
    after = job.decide()
    assert where(after, "b", -1) == "running"
    assert (after.members, after.master_addr) == (before.members, before.master_addr)


def test_a_full_open_round_leaves_the_next_node_waiting() -> None:
    job = Job(min_nodes=1, max_nodes=1)
    job.ask("a")
    job.ask("b")
    state = job.decide()
    assert (where(state, "a", -1), where(state, "b", -1)) == ("running", "waiting")


def test_the_round_ends_when_every_member_ended_or_died() -> None:
    job = formed("a", "b", "c", max_nodes=3)
    job.end("a")
    assert not job.decide().ended  # b and c still run
    job.end("b")
    job.die("c")
    state = job.decide()
    assert state.ended and state.round == 0  # no next round for the dead
    assert job.decide() is state


def test_the_barrier_holds_while_a_member_restarts_instead() -> None:
    job = formed("a", "b")
    job.end("a")
    job.ask("b")  # b failed and asks again: a waits for b's end, which is in a later round
    state = job.decide()
    assert not state.ended and state.round == 1


def test_the_job_restart_count_is_in_the_completed_round() -> None:
    job = formed("a", "b", max_nodes=2)
    job.restarts = 1
    job.ask("a")
    job.ask("b")
    assert job.decide().restarts == 1


def test_a_round_that_moved_on_means_this_node_was_dropped() -> None:
    state = formed("a", "b").state
    later = RoundState(round=state.round + 1, complete=True, members=("b",))
    assert membership(later, state.round) == "lost"


def test_a_closed_run_stops_running_nodes_and_the_leader_decides_nothing_more() -> None:
    job = formed("a", "b")
    job.state = msgspec.structs.replace(job.state, closed=True)
    assert membership(job.state, job.state.round) == "closed"
    job.ask("a")
    job.ask("b")
    assert job.decide() == job.state  # no next round once closed
    job.end("a")
    job.end("b")
    assert job.decide().ended  # but the exit barrier still ends


def test_closed_is_an_error_class_of_its_own() -> None:
    assert issubclass(RendezvousClosedError, Exception)


def test_the_same_inputs_give_the_same_ranks() -> None:
    assert formed("x", "y", "z").state == formed("x", "y", "z").state


def test_a_restart_is_counted_once_per_round() -> None:
    counter = count_restart(RestartCount(), round=0)
    assert counter == RestartCount(count=1, round=0)
    assert count_restart(counter, round=0) is counter  # a second node of the same round
    assert count_restart(counter, round=3) == RestartCount(count=2, round=3)


def test_the_last_call_window_opens_at_min_nodes_and_keeps_its_end() -> None:
    job = Job(min_nodes=2, max_nodes=4)
    job.ask("a")
    settings = {"min_nodes": 2, "window": 1.0}
    assert last_call(job.state, job.records, None, 10.0, **settings) is None  # one of two
    job.ask("b")
    opened = last_call(job.state, job.records, None, 10.0, **settings)
    assert opened == LastCall(round=0, ends=11.0)
    job.ask("c")  # a later arrival does not push the end back
    assert last_call(job.state, job.records, opened, 10.5, **settings) is opened
    job.die("c")
    job.die("b")  # below min_nodes again: the window is gone, and starts over later
    assert last_call(job.state, job.records, opened, 10.6, **settings) is None


def test_the_last_call_window_closes_with_its_round_and_reopens_for_the_next() -> None:
    job = formed("a", "b", min_nodes=2, max_nodes=4)
    settings = {"min_nodes": 2, "window": 1.0}
    stale = LastCall(round=0, ends=11.0)
    assert last_call(job.state, job.records, stale, 12.0, **settings) is None  # complete
    job.ask("a")
    job.ask("b")
    state = job.decide()  # every runner came back: round 1 opens
    assert last_call(state, job.records, stale, 20.0, **settings) == LastCall(1, 21.0)


def test_a_node_stops_for_its_fence_first_then_its_lost_lease_then_the_document() -> None:
    job = formed("a", "b")
    job.die("b")
    failed = job.decide()
    running = formed("a", "b").state
    assert stop_reason(failed, failed.round, fenced=True, lost=True) == "fenced"
    assert stop_reason(failed, failed.round, fenced=False, lost=True) == "lost"
    assert stop_reason(running, running.round, fenced=False, lost=True) == "lost"
    assert stop_reason(failed, failed.round, fenced=False, lost=False) == "lost"
    assert stop_reason(running, running.round, fenced=False, lost=False) is None


def test_the_exit_barrier_is_over_only_for_the_round_the_node_ran() -> None:
    job = formed("a", "b", "c", max_nodes=3)
    job.end("a")
    job.die("b")
    assert barrier_pending(job.state.members, job.records) == ["c"]  # the dead count as done
    assert not barrier_over(job.decide(), 0)
    job.end("c")
    assert barrier_pending(job.state.members, job.records) == []
    state = job.decide()
    assert barrier_over(state, 0) and not barrier_over(state, 1)


def test_the_lease_renews_a_third_of_the_ttl_after_the_last_renewal_was_sent() -> None:
    clock = LeaseClock(ttl=9, now=100.0)
    assert clock.renew_in(100.0) == 3.0
    assert clock.renew_in(104.0) == 0.0  # overdue: at once, never a negative sleep
    clock.renewed(sent=102.0)
    assert clock.renew_in(103.0) == 2.0  # from the send, not from the slow answer
    clock.renewed(sent=101.0)  # an older renewal answered late
    assert clock.renewed_at == 102.0


def test_a_node_fences_itself_a_margin_before_its_lease_can_end() -> None:
    clock = LeaseClock(ttl=8, now=100.0)
    assert clock.margin == 2.0  # a quarter of the TTL
    assert clock.fence_in(100.0) == 6.0
    assert clock.fence_in(107.0) == -1.0  # past due: fence now
    clock.renewed(sent=105.0)
    assert clock.fence_in(107.0) == 4.0
    assert LeaseClock(ttl=2, now=0.0).margin == 0.5  # never under half a second


def test_the_lead_passes_in_rank_order_and_a_newcomer_tries_at_once() -> None:
    assert succession_delay(None) == 0.0
    assert succession_delay(0) == 0.0
    assert succession_delay(3) == pytest.approx(0.03)
    assert succession_delay(100) == succession_delay(5000) == pytest.approx(1.0)


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
