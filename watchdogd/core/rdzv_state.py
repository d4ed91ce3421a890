"""Rendezvous rounds: the state document in etcd and how a node moves it. Pure.

Rules
-----
- One document per run (:class:`RoundState`) holds the current round: its
  number, whether it is complete, its participants and the nodes waiting for
  the next one. Nodes change it only by compare-and-swap on its revision, so
  every function here maps one state to the next and never reads a clock.
- A node that wants a place (:func:`advance` with ``leaving=True``):
  joins an open round while it has room, else waits; in a complete round it
  leaves its place (it is restarting) and waits for the next round.
- A complete round ends when none of its participants is left: each came
  back (waiting) or died. The next round opens with the waiting nodes:
  those that held a rank first, in their old rank order, so rank 0 and the
  master stay put while they live; newcomers after them in arrival order.
- A round completes when ``max_nodes`` joined, or ``min_nodes`` joined and
  the caller says the last-call window passed (each node times it on its
  own monotonic clock: no cross-node clocks). Ranks are the join order above;
  rank 0's published address and port are the master endpoint.
- Nodes whose leased key is gone (``alive`` lacks them) are dropped from
  every list: a round never waits for the dead.
- Once ``closed``, every attempt to join raises :class:`RendezvousClosedError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from typing import Literal

import msgspec

__all__ = [
    "Change",
    "Member",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "RestartCount",
    "RoundState",
    "Where",
    "advance",
    "count_restart",
    "membership",
    "waiting_count",
    "where",
]


class RendezvousError(Exception):
    """Base of every rendezvous failure."""


class RendezvousClosedError(RendezvousError):
    """The job is over (finished, or out of restarts): no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """Too few nodes came within the join timeout (the message says who did)."""


class RendezvousConnectionError(RendezvousError):
    """etcd stayed unreachable past the operation's bound."""


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """A node as the round document lists it: what it published when it arrived."""

    node: str
    """Unique per rendezvous session: ``name:pid:random``."""
    addr: str
    port: int
    """The master port this node would serve as rank 0."""
    rank: int | None = None
    """Its rank in the last complete round it was part of; None for a newcomer."""


class RoundState(msgspec.Struct, frozen=True, kw_only=True):
    """The whole rendezvous of one run, stored as JSON under ``<prefix>/state``."""

    round: int = 0
    complete: bool = False
    participants: tuple[Member, ...] = ()
    """Open round: in arrival order. Complete: by rank, minus those that left."""
    waiting: tuple[Member, ...] = ()
    world_size: int = 0
    """Set when the round completes; unchanged as participants leave it."""
    master_addr: str = ""
    master_port: int = 0
    closed: bool = False


class RestartCount(msgspec.Struct, frozen=True, kw_only=True):
    """The job's restart counter, stored under ``<prefix>/restarts``."""

    count: int = 0
    round: int = -1
    """The last round whose failure was counted: one failure per round."""


Where = Literal["running", "joined", "waiting", "absent"]
Change = Literal["waiting", "lost", "fenced", "closed"]


def _has(members: Iterable[Member], node: str) -> bool:
    return any(m.node == node for m in members)


def _by_old_rank(members: Iterable[Member]) -> tuple[Member, ...]:
    """Former rank holders first, in rank order; newcomers after, in arrival order."""
    return tuple(sorted(members, key=lambda m: (m.rank is None, m.rank or 0)))


def _complete(state: RoundState) -> RoundState:
    ranked = tuple(
        msgspec.structs.replace(m, rank=i) for i, m in enumerate(_by_old_rank(state.participants))
    )
    return msgspec.structs.replace(
        state,
        complete=True,
        participants=ranked,
        world_size=len(ranked),
        master_addr=ranked[0].addr,
        master_port=ranked[0].port,
    )


def _open_next(state: RoundState, max_nodes: int) -> RoundState:
    queue = _by_old_rank(state.waiting)
    return RoundState(
        round=state.round + 1,
        participants=queue[:max_nodes],
        waiting=queue[max_nodes:],
        closed=state.closed,
    )


def advance(
    state: RoundState,
    me: Member,
    alive: Set[str],
    *,
    leaving: bool,
    min_nodes: int,
    max_nodes: int,
    last_call_over: bool,
) -> RoundState:
    """The state this node should write (``state`` itself when nothing changes).

    ``leaving``: this node has not yet taken its place for this rendezvous
    (the first call of ``next_rendezvous``): if it holds a place in a complete
    round, it gives it up. Later calls only re-queue a node that was dropped.
    """
    if state.closed:
        raise RendezvousClosedError("the rendezvous is closed: the job has finished")
    alive = set(alive) | {me.node}
    participants = tuple(m for m in state.participants if m.node in alive)
    waiting = tuple(m for m in state.waiting if m.node in alive)
    queued = _has(participants, me.node) or _has(waiting, me.node)
    if state.complete:
        mine = next((m for m in participants if m.node == me.node), None)
        if mine is not None and leaving:  # participant -> waiting (it restarts)
            participants = tuple(m for m in participants if m.node != me.node)
            waiting += (msgspec.structs.replace(me, rank=mine.rank),)
        elif not queued:  # newcomer (or a dropped node) -> waiting
            waiting += (me,)
        state = msgspec.structs.replace(state, participants=participants, waiting=waiting)
        if not participants:  # complete -> next round open: all came back or died
            state = _open_next(state, max_nodes)
    else:
        if not queued:
            if len(participants) < max_nodes:
                participants += (me,)  # newcomer -> participant
            else:
                waiting += (me,)  # newcomer -> waiting: this round is full
        state = msgspec.structs.replace(state, participants=participants, waiting=waiting)
    if not state.complete:
        full = len(state.participants) >= max_nodes
        if full or (last_call_over and len(state.participants) >= min_nodes):
            state = _complete(state)  # open -> complete: ranks assigned
    return state


def where(state: RoundState, node: str) -> Where:
    """Where ``node`` stands in ``state``."""
    if _has(state.participants, node):
        return "running" if state.complete else "joined"
    return "waiting" if _has(state.waiting, node) else "absent"


def waiting_count(state: RoundState, round: int, max_nodes: int) -> int:
    """Nodes waiting to join that a new round of ``round`` would take (torch's meaning).

    Newcomers waiting while the round is full are spare nodes, not a reason
    to restart; a participant that left to restart always counts.
    """
    if state.round != round or not state.complete:
        return 0
    if len(state.participants) >= max_nodes:
        return 0
    return len(state.waiting)


def membership(
    state: RoundState, round: int, members: Iterable[str], alive: Set[str], max_nodes: int
) -> Change | None:
    """Why a node running ``round`` with ``members`` should stop, if it should."""
    if state.closed:
        return "closed"
    if state.round != round or any(m not in alive for m in members):
        return "lost"
    if waiting_count(state, round, max_nodes) > 0:
        return "waiting"
    return None


def count_restart(counter: RestartCount, round: int) -> RestartCount:
    """Count the failure of ``round`` once, however many nodes report it."""
    if counter.round >= round:
        return counter
    return RestartCount(count=counter.count + 1, round=round)
