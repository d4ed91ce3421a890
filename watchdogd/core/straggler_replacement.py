"""When a node steps aside for a persistent straggler (``replace_stragglers_after``). Pure.

Theory of operation
-------------------
A straggler flag (:mod:`watchdogd.core.stragglers`) is a diagnosis: the
rank is slower than its peers, or than itself. Killing a slow but live
rank is the operator's call, so this policy is off unless asked for. When
asked, a node whose own rank stays named a straggler for
``after`` seconds, while a standby waits in the job, leaves the round as a
quarantined node does: the standby takes its group rank, the others keep
theirs. This module decides when a flag *names* a rank, and when it has
named it long enough; whether a standby waits is the caller's to ask.

Rules
-----
- A flag names a rank only where it singles out a minority of the job's
  ranks on that scope: fewer than half of them flagged. On a scope where
  half or more are flagged, every rank is slow alike (the scope holds a
  collective, which makes each rank wait for the slowest; or the whole job
  slowed down): it names nobody.
- A scope is judged on the whole job only: this node's ranks and those of
  every other node's fresh summary (:mod:`watchdogd.core.job_stragglers`)
  must cover the job's ``world_size`` ranks. Until then (a node's summary
  not read yet, or stale), nobody is named.
- Only this node's own ranks are its to act on: the node that runs a rank
  flags it, and only that node steps aside for it.
- A rank is persistent once every check for ``after`` seconds named it (on
  the same scope); a check that does not name it starts its time over.
- A rank's relative score is taken against the fastest rank of the whole
  job, as ``watchdogctl stragglers --job`` shows it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from watchdogd.core.job_stragglers import NodeSummary, RankSummary, fastest
from watchdogd.core.stragglers import ratio

__all__ = ["PersistentStragglers", "Straggler", "named"]


class Straggler(NamedTuple):
    """One of this node's ranks, named a straggler on ``scope`` for ``seconds``."""

    scope: str
    rank: int
    relative: float
    """Against the fastest rank of the job."""
    seconds: float

    def reason(self) -> str:
        """Why the node steps aside, as its quarantine says it."""
        return (
            f"straggler: rank {self.rank} scope {self.scope} relative {self.relative:.2f} "
            f"for {self.seconds:.0f} s"
        )


def named(
    local: NodeSummary, peers: Iterable[NodeSummary], world_size: int
) -> dict[tuple[str, int], float]:
    """This node's ranks a flag names now, by ``(scope, rank)``, with each one's relative
    score against the job's fastest (see the rules)."""
    summaries = [local, *peers]
    ranks: dict[str, set[int]] = defaultdict(set)
    flagged: dict[str, set[int]] = defaultdict(set)
    for summary in summaries:
        for row in summary.ranks:
            ranks[row.scope].add(row.rank)
            if row.flagged:
                flagged[row.scope].add(row.rank)
    best = fastest(summaries)

    def names(row: RankSummary) -> bool:
        seen, slow = ranks[row.scope], flagged[row.scope]
        return row.flagged and len(seen) >= world_size and 2 * len(slow) < len(seen)

    return {
        (row.scope, row.rank): ratio(best[row.scope, row.device], row.median)
        for row in local.ranks
        if names(row)
    }


class PersistentStragglers:
    """Since when each of this node's ranks has been named at every check."""

    def __init__(self, after: float) -> None:
        """``after``: seconds a rank must stay named before it is returned."""
        if after <= 0:
            raise ValueError(f"need after > 0, got {after}")
        self.after = after
        self.since: dict[tuple[str, int], float] = {}

    def check(
        self, now: float, local: NodeSummary, peers: Iterable[NodeSummary], world_size: int
    ) -> Straggler | None:
        """The rank named for longest, once that is ``after`` seconds; None before."""
        now_named = named(local, peers, world_size)
        self.since = {key: self.since.get(key, now) for key in now_named}
        if not self.since:
            return None
        key = min(self.since, key=lambda k: (self.since[k], k))
        seconds = now - self.since[key]
        if seconds < self.after:
            return None
        scope, rank = key
        return Straggler(scope, rank, now_named[key], seconds)

    def reset(self) -> None:
        """Start every rank's time over (the node stepped aside, or has no round)."""
        self.since.clear()
