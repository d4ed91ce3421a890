"""Straggler scores at runtime: the core's windows, the events they raise, the listing.

The timer service hands every released sample of a worker group's scope
(and every device time a client reports) to :class:`StragglerWatch`; a
rank becoming flagged is a ``straggler`` event (at WARNING), its recovery
a ``straggler_cleared`` one. Nothing here kills or restarts: the event is
the hook a policy can act on. A flag raised by a worker a drill slowed
(``watchdogctl inject … slow``) is the drill's: its events say
``injected=True``, and the metrics label it so.

It is also the worker groups' ``StragglerShare`` port: a group of a
multi-node job publishes :meth:`summary` through its rendezvous every
``straggler_publish_interval`` and hands back what the other nodes
published (:meth:`received`), so this node's ranks are scored against the
fastest of the job, and ``watchdogctl stragglers --job`` lists them all
(:mod:`watchdogd.core.job_stragglers` has the rules).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping

from watchdogd.core.config import StragglerSettings
from watchdogd.core.job_stragglers import NodeSummary, Peers, fastest, job_view, summarize
from watchdogd.core.ports import EventSink
from watchdogd.core.scope_stats import ScopeKey, ScopeStats
from watchdogd.core.stragglers import Stragglers
from watchdogd_client import protocol as p

__all__ = ["StragglerWatch"]


class StragglerWatch:
    """The straggler windows of every worker group's scopes on this node."""

    def __init__(
        self, settings: StragglerSettings, events: EventSink, scope_stats: ScopeStats
    ) -> None:
        self.board = Stragglers(settings.window, settings.threshold, settings.windows)
        self.events = events
        self.scope_stats = scope_stats
        self.hostname = socket.gethostname()
        self.publish_interval = settings.publish_interval
        self.peers: dict[str, Peers] = {}
        """Per job: the other nodes' summaries."""
        self.node_ranks: dict[str, int] = {}
        """Per job: this node's group rank, as of its last summary."""
        self.drilled: set[ScopeKey] = set()
        """The flagged ranks' scopes whose flag a drill caused."""
        self.drill_flags = 0
        """Of the board's flags, those a drill caused."""
        self.replacements = 0
        """Times this node stepped aside for a straggler of its own (a counter)."""

    def reconfigure(self, settings: StragglerSettings) -> None:
        self.board.configure(settings.window, settings.threshold, settings.windows)
        self.publish_interval = settings.publish_interval

    # -- across nodes (the StragglerShare port) ------------------------------------

    def summary(self, job: str, node_rank: int, seq: int) -> NodeSummary:
        """What this node publishes for ``job``: its ranks' last windows."""
        self.node_ranks[job] = node_rank
        return summarize(self.board, job, self.hostname, node_rank, seq)

    def received(self, job: str, summaries: Mapping[str, NodeSummary]) -> None:
        """The other nodes' summaries of ``job`` as the store holds them now (empty: none)."""
        now = time.monotonic()
        peers = self.peers.setdefault(job, Peers())
        peers.update(summaries, now)
        self.board.set_remote(job, fastest(peers.fresh(now, self.publish_interval)))
        if not summaries:
            del self.peers[job]
            self.node_ranks.pop(job, None)

    def fresh_peers(self, job: str) -> list[NodeSummary]:
        peers = self.peers.get(job)
        return [] if peers is None else peers.fresh(time.monotonic(), self.publish_interval)

    def stepped_aside(self, job: str, node: str, reason: str) -> None:
        self.replacements += 1
        self.events.emit_at(
            logging.WARNING, "straggler_replaced", group=job, node=node, reason=reason
        )

    def sample(
        self, key: ScopeKey, seconds: float, device: bool = False, injected: bool = False
    ) -> None:
        """One duration of a worker's scope whose sketch exists (the caps bound the windows);
        ``injected``: a drill's fault was injected into the worker."""
        change = self.board.add(key, seconds, device)
        if change is None:
            return
        drill = injected if change.flagged else key in self.drilled
        if change.flagged and injected:
            self.drilled.add(key)
            self.drill_flags += 1
        else:
            self.drilled.discard(key)
        level = logging.WARNING if change.flagged else logging.INFO
        name = "straggler" if change.flagged else "straggler_cleared"
        self.events.emit_at(
            level,
            name,
            group=key.job,
            scope=key.scope,
            rank=key.rank,
            hostname=self.hostname,
            relative=round(change.relative, 3),
            individual=round(change.individual, 3),
            windows=change.windows,
            clock="device" if device else "host",
            **({"injected": True} if drill else {}),
        )

    def listing(self, seq: int, uid: int | None, job: bool = False) -> p.StragglerList:
        """Every scored rank, or those of ``uid``'s processes; ``job``: with every node's
        ranks of each job one of them is in (other nodes' ranks have uid -1)."""
        owners = self.scope_stats.owners
        board = self.board
        ranks = [
            p.StragglerInfo(
                group=key.job,
                scope=key.scope,
                rank=key.rank,
                uid=owners[key],
                windows=rank.windows,
                relative=rank.relative,
                individual=rank.individual,
                p50_s=rank.median,
                device=rank.device,
                flagged=rank.flagged,
                hostname=self.hostname,
                node_rank=self.node_ranks.get(key.job, -1),
            )
            for key, rank in board.ranks()
            if key in owners and (uid is None or owners[key] == uid)
        ]
        if job:
            ranks = self._job_listing(ranks)
        return p.StragglerList(seq, ranks, board.window, board.threshold, board.windows)

    def _job_listing(self, local: list[p.StragglerInfo]) -> list[p.StragglerInfo]:
        """``local``, each job another node published for shown whole (by scope and rank)."""
        now = time.monotonic()
        owners = self.scope_stats.owners
        ranks = []
        for name in sorted({info.group for info in local}):
            peers = self.peers.get(name)
            if peers is None:
                ranks += [info for info in local if info.group == name]
                continue
            mine = summarize(self.board, name, self.hostname, self.node_ranks.get(name, -1), 0)
            for row in job_view(mine, peers.read(now, self.publish_interval)):
                rank = row.rank
                ranks.append(
                    p.StragglerInfo(
                        group=name,
                        scope=rank.scope,
                        rank=rank.rank,
                        uid=owners.get(ScopeKey(name, rank.scope, rank.rank), -1),
                        windows=rank.windows,
                        relative=row.relative,
                        individual=rank.individual,
                        p50_s=rank.median,
                        device=rank.device,
                        flagged=rank.flagged,
                        hostname=row.hostname,
                        node_rank=row.node_rank,
                        stale=row.stale,
                    )
                )
        return ranks
