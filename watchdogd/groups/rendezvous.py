"""How a worker group learns its place in the job: one interface, one class per backend.

A :class:`GroupRunner <watchdogd.groups.runner.GroupRunner>` holds a
:class:`Rendezvous` and never asks which backend it is (as torch's agent
holds a ``RendezvousHandler``):

- ``static`` (:class:`StaticRendezvous`, the embedded default): fixed nodes,
  this node's rank and the master from the spec; nothing crosses nodes, so
  restarts are the node-local machine's own, and straggler scores stay
  node-local. Node rank 0 hosts the job's
  store on the master port (:class:`~watchdogd.groups.agent_store.AgentStore`)
  when the workers' interpreter has torch, as torchrun's agent does;
- ``etcd`` (:class:`~watchdogd.groups.etcd_backend.EtcdBackend`): elastic
  between min and max nodes on a real etcd, restarts counted job-wide,
  membership changes restart the group, an exit barrier at the end;
- ``c10d`` (:class:`~watchdogd.groups.c10d_backend.C10dBackend`): torch's
  own rendezvous, run by a torch helper process, so that torchrun's nodes
  and ours form one job; restarts counted per node, as torch's agents do.

The etcd and c10d backends also carry each node's straggler summary to the
others (:meth:`Rendezvous.share`): one key per node in the job's store,
watched on etcd, read at each publication on c10d (a ``TCPStore`` has no
watch).

The etcd and c10d backends (and their clients) are imported only when a
spec asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Protocol, Self

import anyio

from watchdogd.core.rdzv_state import Change
from watchdogd.core.workerenv import Placement
from watchdogd.groups.agent_store import AgentStore, LocalAgentStore
from watchdogd.linux.net import free_port
from watchdogd_client.events import RdzvEvent
from watchdogd_client.groups import GroupSpec, GroupState, RendezvousInfo

__all__ = ["Rendezvous", "StaticRendezvous", "open_rendezvous"]

_TORCH_DEFAULT_PORT = 29500


class Rendezvous(Protocol):
    """A group's view of the job across nodes; entered for the group's whole run."""

    local_restarts: int
    """Restarts the node-local state machine may make by itself."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def next_round(self, restart_count: int) -> tuple[Placement, int]:
        """Before each attempt: this node's placement and the restart count workers see.

        ``restart_count`` is the local machine's; a rise since the last round
        means the previous attempt failed. Raises ``RendezvousError`` when the
        job is over (closed, out of restarts, unreachable).
        """
        ...

    async def watch(self, on_change: Callable[[Change], None]) -> None:
        """While workers run, report each change that ends the round (never returns)."""
        ...

    async def finish(self, state: GroupState) -> None:
        """The group reached ``state``: tell the job, wait for the others if it asks."""
        ...

    def restarts_left(self, local_left: int) -> int:
        """Restarts the job has left, given the local machine's ``local_left``."""
        ...

    def info(self) -> RendezvousInfo | None:
        """What ``watchdogctl groups`` shows of the rendezvous (None: nothing to show)."""
        ...

    async def share(self, summary: bytes) -> Mapping[str, bytes] | None:
        """Publish this node's straggler summary (one write) while a round runs; the other
        nodes' latest, by store key (empty while no round runs, or etcd or the store
        is unreachable). None: this backend carries nothing across nodes."""
        ...


class StaticRendezvous:
    """Fixed nodes: the placement comes from the spec; node rank 0 hosts the job's store."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        rdzv = spec.rendezvous
        if rdzv.master_port is not None:
            self.port = rdzv.master_port
        else:
            self.port = 0 if rdzv.nnodes == 1 else _TORCH_DEFAULT_PORT  # 0: a free one
        self.store: AgentStore | LocalAgentStore | None = None
        self.local_restarts = spec.max_restarts
        self._rounds = 0

    async def __aenter__(self) -> Self:
        rdzv = self.spec.rendezvous
        if rdzv.node_rank == 0:
            self.store = await AgentStore.start(rdzv.python, self.port)
        if self.store is not None:
            self.port = self.store.port
        elif self.port == 0:
            self.port = free_port(rdzv.master_addr)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.store is not None:
            await self.store.aclose()

    async def next_round(self, restart_count: int) -> tuple[Placement, int]:
        rdzv = self.spec.rendezvous
        if self.store is not None and self._rounds and not await self.store.renew():
            store, self.store = self.store, None
            await store.aclose()
        self._rounds += 1
        placement = Placement(
            group_rank=rdzv.node_rank,
            group_world_size=rdzv.nnodes,
            master_addr=rdzv.master_addr,
            master_port=self.port,
            run_id=rdzv.run_id,
            use_agent_store=self.store is not None,
        )
        return placement, restart_count

    async def watch(self, on_change: Callable[[Change], None]) -> None:
        if self.store is not None and not await self.store.serving():
            # The workers wait for a store that will not come: start them
            # again, with rank 0 hosting it (not a failure of theirs).
            store, self.store = self.store, None
            await store.aclose()
            on_change("waiting")
        await anyio.sleep_forever()

    async def finish(self, state: GroupState) -> None:
        return None

    def restarts_left(self, local_left: int) -> int:
        return local_left

    def info(self) -> RendezvousInfo | None:
        return None

    async def share(self, summary: bytes) -> None:
        return None  # node-local by design: a static job may have no store (no torch)


def open_rendezvous(spec: GroupSpec, on_event: Callable[[RdzvEvent], None]) -> Rendezvous:
    """The rendezvous ``spec`` asks for; ``on_event`` hears its ``RdzvEvent`` s."""
    if spec.rendezvous.backend == "etcd":
        from watchdogd.groups.etcd_backend import EtcdBackend

        return EtcdBackend(spec, on_event)
    if spec.rendezvous.backend == "c10d":
        from watchdogd.groups.c10d_backend import C10dBackend

        return C10dBackend(spec, on_event)
    return StaticRendezvous(spec)
