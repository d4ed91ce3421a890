"""``replace_stragglers_after``: this node steps aside for a persistent straggler of its own.

Off by default: a flag is a diagnosis, and killing a slow but live rank is
the operator's decision. On (etcd only), :class:`StragglerReplacement`
checks once per straggler publish interval, while the node runs in a round
of several nodes, what :mod:`watchdogd.core.straggler_replacement` names
among this node's ranks, against every node's fresh summary. Once one rank
stayed named for the set time and a standby waits beside the full round,
the node sets itself aside through its quarantine
(:meth:`~watchdogd.groups.etcd_quarantine.EtcdQuarantine.step_aside`:
``quarantine/<node>``, the reason "straggler: rank R scope S relative X for
N s") and restarts its attempt; the quarantine's ``prepare`` then takes it
out of the job before its next round, as for a node whose failures
counted: the others re-form, the standby in its group rank, and the node
waits until ``watchdogctl quarantine --clear`` or the job's end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from watchdogd.core.group_machine import Input, Restart
from watchdogd.core.ports import StragglerShare
from watchdogd.core.rdzv_state import RendezvousConnectionError
from watchdogd.core.straggler_replacement import PersistentStragglers
from watchdogd.core.workerenv import Placement
from watchdogd.groups.features import Feature

if TYPE_CHECKING:  # aetcd stays unimported by groups on other backends
    from watchdogd.groups.etcd_quarantine import EtcdQuarantine

__all__ = ["StragglerReplacement"]

log = logging.getLogger("watchdogd.supervisor")


class StragglerReplacement(Feature):
    """Steps this node aside for a persistent straggler of its own (see the module docstring)."""

    def __init__(
        self,
        after: float,
        share: StragglerShare,
        quarantine: EtcdQuarantine,
        nproc: int,
        placement: Callable[[], Placement | None],
        post: Callable[[Input], None],
    ) -> None:
        """``placement``: the node's round while its workers run (None between rounds);
        ``post``: the group's inbox."""
        self.stragglers = PersistentStragglers(after)
        self.share = share
        self.quarantine = quarantine
        self.nproc = nproc
        self.placement = placement
        self.post = post

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._run)

    async def _run(self) -> None:
        share, job = self.share, self.quarantine.group
        while True:
            await anyio.sleep(share.publish_interval)
            placement = self.placement()
            if placement is None or placement.group_world_size < 2 or self.quarantine.reason:
                self.stragglers.reset()  # no round of several nodes, or already set aside
                continue
            local = share.summary(job, placement.group_rank, 0)
            world_size = placement.group_world_size * self.nproc
            found = self.stragglers.check(
                time.monotonic(), local, share.fresh_peers(job), world_size
            )
            if found is None:
                continue
            try:
                if not await self.quarantine.standby_waiting():
                    continue  # asked again next interval, while the rank stays named
                reason = found.reason()
                if not await self.quarantine.step_aside(reason):
                    continue  # another node stepped aside in this round: its standby
            except RendezvousConnectionError as e:
                log.warning("group %s: no step aside for %s: %s", job, found, e)
                continue
            share.stepped_aside(job, self.quarantine.node, reason)
            self.post(Restart(reason))
            self.stragglers.reset()
