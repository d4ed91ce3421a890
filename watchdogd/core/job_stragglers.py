"""Straggler scores across the nodes of a job: the summary each node publishes, and the
job-wide scores. Pure.

Theory of operation
-------------------
Each node scores the ranks it runs (:mod:`watchdogd.core.stragglers`); a
slow node (every rank on it throttled alike) looks healthy to itself. So
every node of a multi-node job publishes, once per
``straggler_publish_interval``, one :class:`NodeSummary` per job to the
rendezvous store the job already uses: for each of its ranks and scopes,
the last window's median, its scores, its flag and its clock. A node that
reads the others':

- hands its own board the fastest fresh median per ``(scope, clock)`` of
  the other nodes (:func:`fastest`, ``Stragglers.remote``): its ranks'
  relative scores, and so their flags, are against the fastest rank of the
  whole job;
- shows the whole job (:func:`job_view`): every node's ranks, each rank's
  relative score recomputed from the latest medians of all fresh summaries.

Rules
-----
- Only the node that runs a rank flags it and raises its ``straggler``
  event; a flag read from another node is shown, never raised again: one
  event per straggler, on the node whose logs, metrics and stack dumps
  have the rank, however many nodes read it.
- A summary's ``seq`` rises with every publication. One whose ``seq`` has
  not moved for :data:`STALE_INTERVALS` intervals, on the reader's own
  monotonic clock (nodes' clocks are never compared), is stale: shown as
  such with its last scores, never rescored, never the fastest.
- A document of another ``version`` (a node running another daemon
  release) or one that does not decode is skipped, not misread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import msgspec

from watchdogd.core.stragglers import Stragglers, ratio

__all__ = [
    "STALE_INTERVALS",
    "VERSION",
    "JobRank",
    "NodeSummary",
    "Peers",
    "RankSummary",
    "decode_summary",
    "encode_summary",
    "fastest",
    "job_view",
    "summarize",
]

VERSION = 1
STALE_INTERVALS = 3


class RankSummary(msgspec.Struct, array_like=True, frozen=True):
    """One rank's scores for one scope as of its last window (a row: the document stays small)."""

    scope: str
    rank: int
    median: float
    """The last window's median (seconds)."""
    relative: float
    individual: float
    windows: int
    device: bool
    flagged: bool
    """Flagged by the node that runs the rank."""


class NodeSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What one node publishes for one job, every interval."""

    version: int = VERSION
    hostname: str
    node_rank: int
    """The node's group rank in the current round."""
    seq: int
    """Rises with every publication: how readers tell a live node from a dead one."""
    ranks: list[RankSummary]


class _Header(msgspec.Struct):
    version: int


_encoder = msgspec.json.Encoder()
_header = msgspec.json.Decoder(_Header)
_summary = msgspec.json.Decoder(NodeSummary)


def encode_summary(summary: NodeSummary) -> bytes:
    return _encoder.encode(summary)


def decode_summary(data: bytes) -> NodeSummary | None:
    """The summary in ``data``; None for another version or a document that does not decode."""
    try:
        if _header.decode(data).version != VERSION:
            return None
        return _summary.decode(data)
    except msgspec.DecodeError:
        return None


SUMMARY_BUDGET = 32 * 1024
"""Bytes of scope names one summary carries at most (about 300 rows of short names): a
node's write stays small, and a c10d reply of every node's stays under the helper's frame
limit up to about 500 nodes."""
_ROW_BYTES = 64  # a row's encoded numbers and keys, beside its scope name


def summarize(board: Stragglers, job: str, hostname: str, node_rank: int, seq: int) -> NodeSummary:
    """This node's ranks of ``job`` that were scored, as published: flagged ranks first,
    then the others, while :data:`SUMMARY_BUDGET` lasts."""
    rows = sorted(
        (
            RankSummary(
                key.scope,
                key.rank,
                rank.median,
                rank.relative,
                rank.individual,
                rank.windows,
                rank.device,
                rank.flagged,
            )
            for key, rank in board.ranks()
            if key.job == job
        ),
        key=lambda row: (not row.flagged, row.scope, row.rank),
    )
    ranks, spent = [], 0
    for row in rows:
        spent += len(row.scope.encode()) + _ROW_BYTES
        if spent > SUMMARY_BUDGET:
            break
        ranks.append(row)
    return NodeSummary(hostname=hostname, node_rank=node_rank, seq=seq, ranks=ranks)


def fastest(summaries: Iterable[NodeSummary]) -> dict[tuple[str, bool], float]:
    """The smallest window median per ``(scope, device clock)`` over every rank of ``summaries``."""
    best: dict[tuple[str, bool], float] = {}
    for summary in summaries:
        for rank in summary.ranks:
            key = (rank.scope, rank.device)
            best[key] = min(best.get(key, math.inf), rank.median)
    return best


class Peers:
    """The other nodes' summaries of one job as last read, by store key, with when each moved."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[NodeSummary, float]] = {}
        """Store key -> (summary, reader's monotonic time its ``seq`` last changed)."""

    def update(self, summaries: Mapping[str, NodeSummary], now: float) -> None:
        """What the store holds now; a key no longer there (a lease that ended) is dropped."""
        nodes = {}
        for key, summary in summaries.items():
            old = self.nodes.get(key)
            moved = old[1] if old is not None and old[0].seq == summary.seq else now
            nodes[key] = (summary, moved)
        self.nodes = nodes

    def read(self, now: float, interval: float) -> Iterator[tuple[NodeSummary, bool]]:
        """Each summary and whether it is stale (unchanged for ``STALE_INTERVALS`` intervals)."""
        for summary, moved in self.nodes.values():
            yield summary, now - moved > STALE_INTERVALS * interval

    def fresh(self, now: float, interval: float) -> list[NodeSummary]:
        return [summary for summary, stale in self.read(now, interval) if not stale]


class JobRank(NamedTuple):
    """One rank of the job as :func:`job_view` shows it."""

    hostname: str
    node_rank: int
    rank: RankSummary
    relative: float
    """Against the fastest fresh rank of the job; a stale rank's is its node's last one."""
    stale: bool


def job_view(local: NodeSummary, peers: Iterable[tuple[NodeSummary, bool]]) -> list[JobRank]:
    """Every rank of the job, by scope and rank: this node's (``local``) and the others'."""
    nodes = [(local, False), *peers]
    best = fastest(summary for summary, stale in nodes if not stale)
    rows = [
        JobRank(
            summary.hostname,
            summary.node_rank,
            rank,
            rank.relative if stale else ratio(best[rank.scope, rank.device], rank.median),
            stale,
        )
        for summary, stale in nodes
        for rank in summary.ranks
    ]
    rows.sort(key=lambda row: (row.rank.scope, row.rank.rank))
    return rows
