"""The lead of an etcd rendezvous: who writes the round document, and how it decides.

Every node watches the ``leader`` key (:class:`RoundLeader`). Whoever holds
it (the first to create it, on its lease) watches every key of the run but
the straggler summaries, and writes the round document by compare-and-swap
whenever :func:`~watchdogd.core.rdzv_state.decide` changes it; it times the
last-call window on its own monotonic clock. When the holder's lease ends,
the key goes with it and the members of the last round try to take it in
rank order (:func:`~watchdogd.core.rdzv_state.succession_delay`). A fenced
node neither leads nor tries: its lease may be gone on etcd already.

A burst of records (a thousand nodes asking at once) makes one decision, not
one each: after a change the leader lets ``_DECISION_BATCH`` pass, and every
decision reads them all.
"""

from __future__ import annotations

import logging
import math
import time

import anyio
import anyio.abc

from watchdogd.core.rdzv_state import LastCall, Record, decide, last_call, succession_delay
from watchdogd.groups.etcd_documents import (
    LEADER,
    RESTARTS,
    STATE,
    STRAGGLERS,
    encode,
    restarts_of,
    state_of,
    update_records,
)
from watchdogd.groups.etcd_lease import NodeLease
from watchdogd.groups.etcd_store import EtcdStore, Mirror

__all__ = ["RoundLeader"]

log = logging.getLogger("watchdogd.rendezvous")

_DECISION_BATCH = 0.01


class RoundLeader:
    """This node's part in the lead: it takes the ``leader`` key when free and decides while ours.

    ``rank`` is this node's rank in the last round it ran (None before the
    first): its place in the succession. Its owner sets it.
    """

    def __init__(
        self,
        store: EtcdStore,
        lease: NodeLease,
        *,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        last_call: float,
    ) -> None:
        self.rank: int | None = None
        self._store = store
        self._lease = lease
        self._run_id = run_id
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._last_call = last_call
        self._mirror = Mirror(LEADER)
        self._scope: anyio.CancelScope | None = None

    @property
    def leading(self) -> bool:
        """This node holds the ``leader`` key and decides the rounds (not while fenced)."""
        holder = self._mirror.values.get(LEADER)
        mine = holder is not None and holder.value == self._lease.node_id.encode()
        return mine and self._lease.fenced_since is None

    def step_down(self) -> None:
        """Stop deciding now (fenced, or the lease is lost): another node may lead soon."""
        if self._scope is not None:
            self._scope.cancel()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch the ``leader`` key (started once the watch is), and lead whenever it is ours."""
        async with anyio.create_task_group() as tg:
            await tg.start(self._mirror.run, self._store)
            task_status.started()
            await self._lead()

    async def _lead(self) -> None:
        """Take the ``leader`` key whenever it is free; decide the rounds while it is ours."""
        leader = self._mirror
        while True:
            revision = leader.revision
            if self._lease.fenced_since is not None:
                await self._lease.wait_renewal()
            elif self.leading:
                with anyio.CancelScope() as self._scope:  # cancelled by step_down
                    log.info("%s leads rendezvous %s", self._lease.node_id, self._run_id)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._decide_rounds)
                        await leader.wait_past(revision)  # the key changed: look again
                        tg.cancel_scope.cancel()
                self._scope = None
            elif LEADER in leader.values:
                await leader.wait_past(revision)
            else:
                with anyio.move_on_after(succession_delay(self.rank)):
                    await leader.wait_past(revision)
                if LEADER not in leader.values:
                    node_id = self._lease.node_id.encode()
                    await self._store.create(LEADER, node_id, lease=self._lease.lease)
                    await leader.wait_past(revision)  # ours or another's: the watch says

    async def _decide_rounds(self) -> None:
        """Watch every key, and write the round document whenever :func:`decide` changes it."""
        mirror = Mirror(ignore=STRAGGLERS)  # they change every interval, and decide nothing
        records: dict[str, Record] = {}
        window: LastCall | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(mirror.run, self._store)
            while True:
                revision = mirror.revision
                update_records(records, mirror)
                found = mirror.values.get(STATE)
                state = state_of(found)
                restarts = restarts_of(mirror.values.get(RESTARTS)).count
                now = time.monotonic()
                window = last_call(
                    state, records, window, now, min_nodes=self._min_nodes, window=self._last_call
                )
                decided = decide(
                    state,
                    records,
                    restarts,
                    min_nodes=self._min_nodes,
                    max_nodes=self._max_nodes,
                    last_call_over=window is not None and now >= window.ends,
                )
                if decided != state:
                    # Written or not (a node closed the run meanwhile), the mirror
                    # moves past ``revision`` before the next decision.
                    await self._store.cas(
                        STATE, found.mod_revision if found else 0, encode(decided)
                    )
                    await mirror.wait_past(revision)
                    continue
                with anyio.move_on_after(window.ends - now if window is not None else math.inf):
                    await mirror.wait_past(revision)
                    await anyio.sleep(_DECISION_BATCH)  # the burst (module docstring)
