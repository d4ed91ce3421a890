"""This node's membership of an etcd rendezvous: its record on a lease, kept alive, and its fence.

:class:`NodeLease` writes the node's record (``nodes/<node id>``) on a lease,
renews the lease from the event loop, and, if etcd lets it expire (the node
was cut off for longer than the TTL), registers again on a new lease under a
new node id: to the others, a new member. When renewals stop succeeding, it
fences the node a margin before the lease can have ended on etcd
(:class:`~watchdogd.core.rdzv_state.LeaseClock` says when), so that its
workers stop before the others can have re-formed without it; the next
renewal that succeeds lifts the fence.

It tells its owner through two callbacks, ``on_lost`` and ``on_fenced``,
called from the event loop, and reports through ``emit``.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Callable

import anyio

from watchdogd.core.rdzv_state import LeaseClock, NodeRecord, RendezvousConnectionError
from watchdogd.groups.etcd_documents import NODES, encode
from watchdogd.groups.etcd_store import EtcdStore, lease_not_found
from watchdogd_client.events import NodeState

__all__ = ["Emit", "NodeLease"]

log = logging.getLogger("watchdogd.rendezvous")

_REVOKE_TIMEOUT = 2.0

Emit = Callable[[str, str, NodeState], None]
"""Report a rendezvous event: its name, its message, the node's state."""


class NodeLease:
    """This node's leased record, its keep-alive and its self-fence (see the module docstring).

    ``record`` is what the node asks for: its owner replaces it, then calls
    :meth:`publish`.
    """

    def __init__(
        self,
        store: EtcdStore,
        record: NodeRecord,
        lease_ttl: int,
        *,
        emit: Emit,
        on_lost: Callable[[], None],
        on_fenced: Callable[[], None],
    ) -> None:
        self.record = record
        self.node_id = self._new_id()
        """Unique per registration (``name:pid:random``): a node cut off long enough
        to lose its lease comes back under a new one, as a new member."""
        self.lease = 0
        self.fenced_since: float | None = None
        """Wall-clock time this node fenced itself (None: it is not fenced)."""
        self._store = store
        self._clock = LeaseClock(lease_ttl, time.monotonic())
        self._emit = emit
        self._on_lost = on_lost
        self._on_fenced = on_fenced
        self._lock = anyio.Lock()
        self._renewal = anyio.Event()

    def _new_id(self) -> str:
        return f"{self.record.name.replace('/', '_')}:{os.getpid()}:{secrets.token_hex(3)}"

    async def wait_renewal(self) -> None:
        """Return at the next renewal that succeeds (which lifts a fence)."""
        await self._renewal.wait()

    async def publish(self, deadline: float = math.inf, *, fresh: bool = False) -> None:
        """Write this node's record; ``fresh``: on a new lease, under a new id (at start,
        and after the lease was lost)."""
        async with self._lock:
            while True:
                lease, node_id, sent = self.lease, self.node_id, 0.0
                if fresh:
                    lease, sent = await self._store.grant(self._clock.ttl, deadline=deadline)
                    node_id = self._new_id()
                record = encode(self.record)
                try:
                    await self._store.put(NODES + node_id, record, lease=lease, deadline=deadline)
                except Exception as e:
                    if lease_not_found(e):
                        fresh = True  # it expired (before the key was on it, or while cut off)
                        continue
                    raise
                if fresh:
                    self.lease, self.node_id = lease, node_id
                    self._renewed(sent)
                return

    async def revoke(self) -> None:
        """Revoke the lease: the others see this node leave now, not after the TTL."""
        with anyio.CancelScope(shield=True):
            try:
                await self._store.revoke(self.lease, deadline=time.monotonic() + _REVOKE_TIMEOUT)
            except RendezvousConnectionError as e:
                log.warning(
                    "could not revoke the lease; etcd drops it in %ds: %s", self._clock.ttl, e
                )

    async def keep_alive(self) -> None:
        """Renew the lease forever; register anew when etcd let it expire."""
        while True:
            await anyio.sleep(self._clock.renew_in(time.monotonic()))
            ttl, sent = await self._store.refresh(self.lease)
            if ttl > 0:
                self._renewed(sent)
            else:
                # etcd let the lease expire (we were cut off): the others dropped us.
                self._emit(
                    "node_lost",
                    f"{self.node_id}: lease expired while cut off from etcd; re-registering",
                    NodeState.FAILED,
                )
                self._on_lost()
                await self.publish(fresh=True)

    def _renewed(self, sent: float) -> None:
        self._clock.renewed(sent)
        self._renewal.set()
        self._renewal = anyio.Event()
        if self.fenced_since is not None:
            self.fenced_since = None
            self._emit("unfenced", f"{self.node_id}: etcd renews this node again", NodeState.INIT)

    async def fence_when_unrenewed(self) -> None:
        """Fence this node a margin before its lease can have run out on etcd."""
        while True:
            if self.fenced_since is not None:
                await self._renewal.wait()  # which unfences it
                continue
            left = self._clock.fence_in(time.monotonic())
            if left > 0:
                with anyio.move_on_after(left):
                    await self._renewal.wait()
                continue
            self.fenced_since = time.time()
            unrenewed = time.monotonic() - self._clock.renewed_at
            self._emit(
                "fenced",
                f"{self.node_id}: no lease renewal for {unrenewed:.1f} s "
                f"(TTL {self._clock.ttl} s): its workers are stopped before the others "
                "can have re-formed without it",
                NodeState.FAILED,
            )
            self._on_fenced()
