"""Rendezvous rounds: what each node asks for, and how one writer decides. Pure.

Who writes what
---------------
- Every node writes only its own record (:class:`NodeRecord`, one key on its
  lease): its address and master port, and whether it asks for a place
  (``asks_after``: a round newer than that one), or has ended (the exit
  barrier). No node contends with another for a key.
- One node, the leader, writes the round document (:class:`RoundState`),
  and only when the round changes: :func:`decide` maps the records it
  watches to the next document. The others watch that one key; none reads
  in a loop. Any node may still close the run (compare-and-swap on the
  document), so the leader's write is a compare-and-swap too.

Rules
-----
- A complete round runs while some member is *running*: alive, not ended,
  and asking for nothing newer than it. A member that asks again is
  restarting; newcomers asking while it runs are *waiting*.
- A member whose key is gone fails the running round: the leader names it
  in ``lost`` (once), and every member stops; nobody else watches the
  others' keys.
- ``waiting`` in the document (torch's ``num_nodes_waiting``) is the number
  of waiting nodes a new round would take: 0 while the round is full (the
  extra nodes are spares, no reason to restart), or once a member ended and
  none restarts (the round is finishing: its ended members never come
  back), else every asking node.
  The leader rewrites it only when it goes from zero to non-zero or back,
  never once per arrival: every node watching the document gets each write.
- A complete round with no member running ends: if some member ended and
  none asks again, the round is ``ended`` and the exit barrier is over;
  otherwise (a member restarts, or all died) the next round opens.
- An open round takes every asking node, up to ``max_nodes``: those that
  held a rank first, newcomers after them in the order they asked (their
  record's etcd revision: no clocks). It completes when ``max_nodes`` ask,
  or ``min_nodes`` ask and the leader says the last-call window passed (it
  times that on its own monotonic clock).
- Ranks stay where they were (:func:`ranked`), so that sharded checkpoints
  and data shards stay with their nodes: a node that held rank ``r`` keeps
  it, and the holes the lost left are filled with newcomers in the order
  they asked, so a standby takes a lost node's rank. Ranks are contiguous
  (``0..n-1``): when fewer nodes ask than before, the members whose rank is
  past the end move into the holes, and nobody else moves. Two claims on one
  rank (a node cut off and back, whose rank a standby took meanwhile): the
  one from the later round wins, the other asks as a newcomer. Rank 0's
  address and port are the master endpoint, so a standby taking rank 0
  becomes the master; where its agent hosts a store there (its record's
  ``store``), every rank is that store's client.
- The dead (their key is gone) are in no list: a round never waits for them.
- A node waiting beside a complete round with ``max_nodes`` members is a
  *standby* (:func:`standing_by`): no reason to restart, so it waits
  without a join timeout, and takes the rank of the next member lost. When
  the run closes or ends while it waits, the job is over without it
  (:func:`where` says ``over``): it leaves, a success, as torch's surplus
  nodes do (``RendezvousGracefulExitError``).
- Once ``closed``, no round opens or completes (every attempt to join raises
  :class:`RendezvousClosedError`); the exit barrier still ends.

Leases and the lead
-------------------
- A node renews its lease a third of the TTL after it sent the last renewal
  that succeeded (:class:`LeaseClock`). The lease lives on etcd's clock from
  the moment etcd took that renewal, which is after this node sent it, so
  the send time plus the TTL bounds the lease's end from below (both clocks
  run at the same rate to within NTP's 500 ppm). A node that has not renewed
  by ``margin`` before that bound fences itself: it stops its workers before
  the others can have dropped it and re-formed without it.
- A node running a round stops for its fence first, then for its own lost
  lease, then for what the round document says (:func:`stop_reason`).
- When the ``leader`` key is free, the members of the last round try to take
  it in rank order, 10 ms apart (:func:`succession_delay`),
  so that one node takes the lead, not a thousand at once.
- The leader opens a round's last-call window when ``min_nodes`` ask, on its
  own monotonic clock (:func:`last_call`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import msgspec

__all__ = [
    "Change",
    "LastCall",
    "LeaseClock",
    "NodeRecord",
    "Record",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousTimeoutError",
    "RestartCount",
    "RoundState",
    "Where",
    "asking",
    "asking_count",
    "barrier_over",
    "barrier_pending",
    "count_restart",
    "decide",
    "last_call",
    "membership",
    "ranked",
    "standing_by",
    "stop_reason",
    "succession_delay",
    "waiting_count",
    "where",
]

_SUCCESSION_STEP = 0.01  # seconds between two ranks' tries to take a free lead
_SUCCESSION_RANKS = 100  # ranks past this one try together, a second after the lead fell free


class RendezvousError(Exception):
    """Base of every rendezvous failure."""


class RendezvousClosedError(RendezvousError):
    """The job is over (finished, or out of restarts): no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """Too few nodes came within the join timeout (the message says who did)."""


class RendezvousConnectionError(RendezvousError):
    """etcd stayed unreachable past the operation's bound."""


class RendezvousGracefulExitError(RendezvousClosedError):
    """The job ended while this node waited for a place (a standby never needed):
    nothing failed (torch's name)."""


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a node's leased key ``nodes/<node>``: who it is and what it asks for."""

    name: str
    hostname: str
    pid: int
    addr: str
    port: int = 0
    """The master port this node would serve as rank 0 (set when it asks)."""
    store: bool = False
    """Its agent hosts an empty store on ``port`` for the round it asks for (else rank 0's
    process would host one)."""
    asks_after: int | None = None
    """It asks for a place in a round newer than this one (-1: any); None: it does not ask."""
    rank: int | None = None
    """Its rank in the last round it ran; None for a newcomer."""
    ended: bool = False
    """Its group finished: it waits at the exit barrier."""


class Record(NamedTuple):
    """A node's record and the etcd revision it was written at (the order it asked in)."""

    value: NodeRecord
    revision: int


class RoundState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The run's current round, stored as JSON under ``<prefix>/state`` by the leader."""

    round: int = 0
    complete: bool = False
    members: tuple[str, ...] = ()
    """Complete: the round's nodes, in rank order (the world size is its length)."""
    master_addr: str = ""
    master_port: int = 0
    master_store: bool = False
    """Rank 0's agent hosts the job's store on the master port: every rank is a client."""
    restarts: int = 0
    """The job's restart count when the round completed."""
    waiting: int = 0
    lost: tuple[str, ...] = ()
    """Members of the running round whose key is gone (dead, cut off, or left):
    the round has failed. Written once, when the first is seen."""
    ended: bool = False
    """Every member ended or died: the exit barrier of this round is over."""
    closed: bool = False


class RestartCount(msgspec.Struct, frozen=True, kw_only=True):
    """The job's restart counter, stored under ``<prefix>/restarts``."""

    count: int = 0
    round: int = -1
    """The last round whose failure was counted: one failure per round."""


Where = Literal["running", "waiting", "pending", "over"]
Change = Literal["waiting", "lost", "fenced", "closed"]


def _running(state: RoundState, records: Mapping[str, Record]) -> set[str]:
    """Members of the complete round still in it (alive, not ended, not asking again)."""
    running = set()
    for node in state.members:
        record = records.get(node)
        if record is None or record.value.ended:
            continue
        asks = record.value.asks_after
        if asks is None or asks < state.round:
            running.add(node)
    return running


def _asks(record: Record) -> bool:
    return record.value.asks_after is not None and not record.value.ended


def asking(state: RoundState, records: Mapping[str, Record]) -> list[str]:
    """The nodes asking for a place in a round after the one running, in the rank
    order a round of them all would give them (:func:`ranked`)."""
    running = _running(state, records) if state.complete else set()
    asked = [node for node, record in records.items() if _asks(record) and node not in running]
    return ranked(asked, records, len(asked))


def asking_count(state: RoundState, records: Mapping[str, Record]) -> int:
    """``len(asking(state, records))``, without the sort."""
    running = _running(state, records) if state.complete else set()
    return sum(1 for node, record in records.items() if _asks(record) and node not in running)


def ranked(nodes: Sequence[str], records: Mapping[str, Record], max_nodes: int) -> list[str]:
    """A round of ``nodes`` (asking, alive), at most ``max_nodes``, in rank order.

    Each rank goes back to the node that held it, the one from the latest
    round when two claim it; newcomers (and a claim's loser) fill the holes
    in the order they asked, then the members whose old rank is past the
    round's end, in rank order: every other node keeps its rank.
    """
    claims: dict[int, str] = {}
    newcomers: list[str] = []
    # Claims from the latest round first: an older claim on a rank taken asks as a newcomer.
    for node in sorted(nodes, key=lambda node: _claim_order(records[node])):
        rank = records[node].value.rank
        if rank is None or rank in claims:
            newcomers.append(node)
        else:
            claims[rank] = node
    newcomers.sort(key=lambda node: records[node].revision)
    size = min(len(nodes), max_nodes)
    held = sorted(claims.items())[:size]  # members first: a round never drops one for a newcomer
    members = [claims.get(rank) for rank in range(size)]
    # Newcomers into the lowest holes (a standby takes the lost node's rank), then
    # the members whose rank is past the end.
    moving = newcomers[: size - len(held)] + [node for rank, node in held if rank >= size]
    holes = (rank for rank, member in enumerate(members) if member is None)
    for rank, node in zip(holes, moving, strict=True):
        members[rank] = node
    return [member for member in members if member is not None]


def _claim_order(record: Record) -> tuple[int, int]:
    """Later rounds' claims first; in one round, the one that asked first."""
    asks = record.value.asks_after
    return (-(asks if asks is not None else -1), record.revision)


def _complete(
    state: RoundState, members: list[str], records: Mapping[str, Record], restarts: int
) -> RoundState:
    master = records[members[0]].value
    return RoundState(
        round=state.round,
        complete=True,
        members=tuple(members),
        master_addr=master.addr,
        master_port=master.port,
        master_store=master.store,
        restarts=restarts,
    )


def _takes_more(
    state: RoundState, running: set[str], records: Mapping[str, Record], max_nodes: int
) -> bool:
    """A new round would take the asking nodes: a member restarts (every one must come
    back), or the round has room and is not ending (a member that ended never comes
    back: a newcomer then waits for nothing but the end)."""
    if len(running) >= max_nodes:
        return False
    alive = [records[node].value for node in state.members if node in records]
    if any(member.ended for member in alive):
        return len(running) + sum(member.ended for member in alive) < len(alive)
    return True


def decide(
    state: RoundState,
    records: Mapping[str, Record],
    restarts: int,
    *,
    min_nodes: int,
    max_nodes: int,
    last_call_over: bool,
) -> RoundState:
    """The document the leader should write (``state`` itself when nothing changes).

    ``records``: every live node's record; ``restarts``: the job's count now.
    Linear in the number of nodes: the leader calls it after every batch of changes.
    """
    if state.complete:
        running = _running(state, records)
        if running:
            if state.closed:
                return state
            count = (
                asking_count(state, records)
                if _takes_more(state, running, records, max_nodes)
                else 0
            )
            lost = state.lost or tuple(node for node in state.members if node not in records)
            if (count > 0) == (state.waiting > 0) and lost == state.lost:
                return state
            return msgspec.structs.replace(state, waiting=count, lost=lost)
        members = [records[node] for node in state.members if node in records]
        if any(m.value.ended for m in members) and not any(_asks(m) for m in members):
            # Its nodes ended (or died) and none asks again: the exit barrier is over,
            # closed or not (a failed job closes the run, then waits at the barrier).
            return state if state.ended else msgspec.structs.replace(state, ended=True)
        if state.closed:
            return state
        state = RoundState(round=state.round + 1)  # the next round opens
    if state.closed:
        return state
    count = asking_count(state, records)
    if count >= max_nodes or (last_call_over and count >= min_nodes):
        asked = [node for node, record in records.items() if _asks(record)]
        return _complete(state, ranked(asked, records, max_nodes), records, restarts)
    return state


def where(state: RoundState, node: str, asks_after: int) -> Where:
    """Where a node asking for a round newer than ``asks_after`` stands in ``state``.

    ``over``: the run closed, or its last round ended without this node.
    """
    if state.closed or (state.ended and node not in state.members):
        return "over"
    if not state.complete or state.round <= asks_after:
        return "pending"
    return "running" if node in state.members else "waiting"


def standing_by(state: RoundState, max_nodes: int) -> bool:
    """A node waiting beside ``state`` is a standby: the round runs full, and has lost nobody."""
    return state.complete and not state.lost and len(state.members) >= max_nodes


class LastCall(NamedTuple):
    """The last-call window of an open round: it completes with ``min_nodes`` at ``ends``."""

    round: int
    ends: float


def last_call(
    state: RoundState,
    records: Mapping[str, Record],
    previous: LastCall | None,
    now: float,
    *,
    min_nodes: int,
    window: float,
) -> LastCall | None:
    """The open round's last-call window: opened at ``now`` when ``min_nodes`` ask.

    None while the round is complete or too few ask (a window that opened
    and then lost an asking node starts over once enough ask again).
    """
    if state.complete or asking_count(state, records) < min_nodes:
        return None
    if previous is None or previous.round != state.round:
        return LastCall(state.round, now + window)
    return previous


def waiting_count(state: RoundState, round: int) -> int:
    """Nodes waiting for a new round of ``round`` that it would take (torch's meaning)."""
    if state.round != round or not state.complete:
        return 0
    return state.waiting


def membership(state: RoundState, round: int) -> Change | None:
    """Why a node running ``round`` should stop, if it should."""
    if state.closed:
        return "closed"
    if state.round != round or state.lost:
        return "lost"
    if waiting_count(state, round) > 0:
        return "waiting"
    return None


def stop_reason(state: RoundState, round: int, *, fenced: bool, lost: bool) -> Change | None:
    """Why a node running ``round`` should stop: its fence, its own lost lease, the document."""
    if fenced:
        return "fenced"
    if lost:
        return "lost"
    return membership(state, round)


def barrier_over(state: RoundState, round: int) -> bool:
    """Every member of ``round`` ended or died: the leader said so in the document."""
    return state.round == round and state.ended


def barrier_pending(members: Sequence[str], records: Mapping[str, Record]) -> list[str]:
    """The members the exit barrier still waits for: alive and not ended."""
    return [node for node in members if node in records and not records[node].value.ended]


def count_restart(counter: RestartCount, round: int) -> RestartCount:
    """Count the failure of ``round`` once, however many nodes report it."""
    if counter.round >= round:
        return counter
    return RestartCount(count=counter.count + 1, round=round)


class LeaseClock:
    """When this node renews its lease and when it fences itself, on the monotonic clock.

    ``renewed_at`` is the send time of the last renewal that succeeded (see
    the module docstring for why the send time, and why ``margin``).
    """

    def __init__(self, ttl: int, now: float) -> None:
        self.ttl = ttl
        self.margin = max(0.5, ttl / 4)
        self.renewed_at = now

    def renewed(self, sent: float) -> None:
        """A renewal sent at ``sent`` succeeded (one answered late never moves it back)."""
        self.renewed_at = max(self.renewed_at, sent)

    def renew_in(self, now: float) -> float:
        """Seconds to the next renewal: a third of the TTL after the last one was sent."""
        return max(0.0, self.renewed_at + self.ttl / 3 - now)

    def fence_in(self, now: float) -> float:
        """Seconds until this node must fence itself (zero or less: now)."""
        return self.renewed_at + self.ttl - self.margin - now


def succession_delay(rank: int | None) -> float:
    """How long a node with this rank in the last round lets others take a free lead.

    A node in no round yet tries at once; the others see it taken and never ask.
    """
    if rank is None:
        return 0.0
    return _SUCCESSION_STEP * min(rank, _SUCCESSION_RANKS)
