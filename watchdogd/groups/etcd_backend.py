"""The ``etcd`` rendezvous backend: an etcd round before every attempt.

The group's state machine stays node-local; this backend adds what crosses
nodes (the design's part 6, on
:class:`~watchdogd.groups.etcd_rendezvous.EtcdRendezvous`), behind the
:class:`~watchdogd.groups.rendezvous.Rendezvous` interface:

- before each attempt, a round: this node's group rank, the world size and
  the master come from it, and ``TORCHELASTIC_RESTART_COUNT`` is the job's;
- a failed attempt is counted once for the whole job (:meth:`add_restart`),
  so a quick rejoin cannot dodge ``max_restarts``; past it the rendezvous is
  closed, which stops every node;
- while workers run, a node waiting to join (scale-up) restarts the group
  without counting; a lost node fails the attempt (counted); a closed
  rendezvous stops it; a round this node leaves by itself (its attempt
  ended here) is watched no more, so its own asking never restarts the next;
- a node beyond ``max_nodes`` stands by in its round (no join timeout), its
  spares warm; when the job ends without it, its group SUCCEEDED;
- at the end, the exit barrier holds this node until every node's group
  finished (bounded by ``exit_barrier_timeout``);
- straggler summaries: one leased key per node, watched by every node
  (:meth:`~watchdogd.groups.etcd_rendezvous.EtcdRendezvous.share_summary`);
- the job's store: each node's agent hosts an empty one for every round it
  asks for, on a new port (:class:`~watchdogd.groups.agent_store.RoundStores`),
  and rank 0's is the job's.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Self

import anyio

from watchdogd.core.rdzv_state import (
    Change,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
)
from watchdogd.core.workerenv import Placement
from watchdogd.groups.agent_store import RoundStores
from watchdogd.groups.etcd_rendezvous import EtcdRendezvous, RendezvousResult
from watchdogd.linux.net import free_port, route_address
from watchdogd_client.events import NodeState, RdzvEvent, record_rdzv_event
from watchdogd_client.groups import GroupSpec, GroupState, RendezvousInfo

__all__ = ["EtcdBackend"]

log = logging.getLogger("watchdogd.rendezvous")

# Across nodes the job counts restarts: the node-local machine only restarts.
_UNBOUNDED = 2**62


class EtcdBackend:
    local_restarts = _UNBOUNDED

    def __init__(self, spec: GroupSpec, on_event: Callable[[RdzvEvent], None]) -> None:
        rdzv = spec.rendezvous
        self.spec = spec
        self.advertise = rdzv.advertise_addr or route_address(rdzv.endpoints[0], 2379)
        self._on_event = on_event
        self.node_name = rdzv.node_name or socket.gethostname()
        """Stable across agents, unlike the rendezvous's node id: what a quarantine names."""
        self.rendezvous = EtcdRendezvous(
            rdzv.endpoints,
            rdzv.run_id,
            rdzv.min_nodes or rdzv.nnodes,
            rdzv.nnodes,
            node_name=self.node_name,
            advertise_addr=self.advertise,
            lease_ttl=math.ceil(rdzv.lease_ttl),  # etcd grants whole seconds
            last_call=rdzv.last_call,
            join_timeout=rdzv.join_timeout,
            exit_barrier_timeout=spec.exit_barrier_timeout,
            on_event=self._event,
        )
        self.result: RendezvousResult | None = None
        self.restarts = 0
        self.needed = True
        """False once the job ended while this node stood by: it has no barrier to wait at."""
        self._local_restarts_seen = 0
        self._new_round = anyio.Event()
        self._watching: anyio.CancelScope | None = None
        self.stores = RoundStores(spec.rendezvous.python)
        self._exit = AsyncExitStack()

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self.rendezvous)
            tasks = self._tasks = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self.stores.aclose)
            stack.callback(tasks.cancel_scope.cancel)  # first of all on the way out
            tasks.start_soon(self.stores.run)
            self._exit = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit.__aexit__(exc_type, exc, tb)

    def _event(self, event: RdzvEvent) -> None:
        record_rdzv_event(event)
        self._on_event(event)

    async def next_round(self, restart_count: int) -> tuple[Placement, int]:
        """This attempt's placement and the job's restart count; raises when the job is over.

        A failed attempt (the local count rose) is counted once for the whole job.
        """
        self._stop_watching()
        counted = restart_count > self._local_restarts_seen
        self._local_restarts_seen = restart_count
        if counted:
            self.restarts = await self.rendezvous.add_restart()
            if self.restarts > self.spec.max_restarts:
                await self.rendezvous.set_closed()
                raise RendezvousClosedError(
                    f"the job used its {self.spec.max_restarts} restarts: closed on every node"
                )
        port = await self.stores.next_port()
        offering = anyio.CancelScope()
        if port is None:
            self._tasks.start_soon(self._offer_store, offering)
        try:
            self.result = await self.rendezvous.next_rendezvous(
                port or free_port(self.advertise), store=port is not None
            )
        except RendezvousGracefulExitError:
            self.needed = False
            raise
        finally:
            offering.cancel()
        self.restarts = self.result.restart_count
        self._new_round.set()
        return self.result.placement(), self.result.restart_count

    async def _offer_store(self, scope: anyio.CancelScope) -> None:
        """Asked before its store was ready (at start): offer it once it is, if the node
        still waits then (a standby that takes rank 0 would otherwise host none)."""
        with scope:
            port = await self.stores.ready_port()
            if port is not None:
                try:
                    await self.rendezvous.offer_store(port)
                except RendezvousError as e:  # the next round asks with it anyway
                    log.warning("store of %s not offered: %s", self.node_name, e)

    async def watch(self, on_change: Callable[[Change], None]) -> None:
        """Report the change that ends each round (once: the next round must start first)."""
        while True:
            await self._new_round.wait()
            self._new_round = anyio.Event()
            with anyio.CancelScope() as self._watching:
                on_change(await self.rendezvous.wait_for_membership_change())

    def _stop_watching(self) -> None:
        """This node left its round (its attempt ended here): stop watching that round.

        Its own asking for the next round shows in the old round's document
        as a node waiting; reported, that change would restart the next
        attempt, whose asking the others see as waiting, and so on forever.
        """
        if self._watching is not None:
            self._watching.cancel()

    async def finish(self, state: GroupState) -> None:
        """Close the job on failure, then wait at the exit barrier for the others
        (a node that never had a place leaves: the job goes on without it)."""
        if state is GroupState.STOPPED or not self.needed:
            # Stopped here by an operator, or a standby the job ended without:
            # leaving is enough, the others see it.
            return
        outcome = NodeState.SUCCEEDED if state is GroupState.SUCCEEDED else NodeState.FAILED
        if self.result is None:
            return  # it never ran in the job: its failure is its own, and no barrier waits
        try:
            if outcome is NodeState.FAILED:
                await self.rendezvous.set_closed()
            await self.rendezvous.exit_barrier(outcome)
        except RendezvousError as e:
            log.warning("exit barrier of %s: %s", self.spec.name, e)

    def restarts_left(self, local_left: int) -> int:
        return max(0, self.spec.max_restarts - self.restarts)

    def info(self) -> RendezvousInfo:
        result = self.result
        return RendezvousInfo(
            backend="etcd",
            run_id=self.spec.rendezvous.run_id,
            round=result.round if result else None,
            group_rank=result.group_rank if result else -1,
            group_world_size=result.group_world_size if result else 0,
            waiting=self.rendezvous.num_nodes_waiting(),
            fenced_since=self.rendezvous.fenced_since,
            leader=self.rendezvous.leading,
            standby=self.rendezvous.standby,
        )

    async def share(self, summary: bytes) -> Mapping[str, bytes]:
        return await self.rendezvous.share_summary(summary)
