"""Setting this node aside on etcd: a quarantine is a key of the job, outliving the agent.

The rule (which failures are the node's, which count, when enough did) is
:mod:`watchdogd.core.quarantine`'s. :class:`EtcdQuarantine` is the
:class:`~watchdogd.groups.features.Feature` of an etcd group with
``quarantine_after`` or ``replace_stragglers_after`` set (a node steps aside for
a straggler of its own through :meth:`~EtcdQuarantine.step_aside`:
:mod:`~watchdogd.groups.straggler_replacement`). Its keys, under the run's prefix, carry no lease:

- ``first_failure/<round>``: the job's first failure of that round. A node
  whose worker failed while the round still ran claims it at once, with a
  create-only write; the one written is first (etcd's order).
- ``stepped_aside/<round>``: the node that stepped aside for a straggler of
  its own in that round (create-only: one per round, so two nodes never
  both count on one standby);
- ``quarantine/<node name>``: the node is set aside (:class:`SetAside`: why,
  since when). A restarted agent finds it before its first round; only
  ``watchdogctl quarantine --clear NAME``, on any node of the job, deletes it.

A node set aside leaves the job: it deletes its own record, which the leader
takes for a lost member, so the others' round fails and the next one gives
its rank to a standby. It then waits, before its next round, until the key
is gone, and asks for a place as a newcomer (a standby, if the round is full),
or until the job is over, when it leaves as a standby the job ended without
does. Meanwhile ``/healthz`` answers 503 and ``watchdogctl status`` says why.
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.abc
import msgspec

from watchdogd.core.ports import EventSink, GroupError
from watchdogd.core.quarantine import NodeFailures, NodeFault, counts_against_node
from watchdogd.core.rdzv_state import (
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    asking,
    standing_by,
    where,
)
from watchdogd.groups.etcd_backend import EtcdBackend
from watchdogd.groups.etcd_documents import (
    NODES,
    STATE,
    encode,
    read_records,
    run_prefix,
    state_of,
)
from watchdogd.groups.etcd_store import EtcdStore, Mirror, parse_endpoints
from watchdogd.groups.features import Feature
from watchdogd_client.groups import GroupSpec

__all__ = ["QUARANTINE", "STEPPED_ASIDE", "EtcdQuarantine", "SetAside"]

log = logging.getLogger("watchdogd.rendezvous")

QUARANTINE = "quarantine/"
FIRST_FAILURE = "first_failure/"
STEPPED_ASIDE = "stepped_aside/"
_CALL_TIMEOUT = 5.0
_ETCD_TIMEOUT = 60.0


class SetAside(msgspec.Struct, frozen=True):
    """The value of ``quarantine/<node>``."""

    reason: str
    since: float
    """Wall-clock time."""


class _Claim:
    """This node's claim on a round's first failure, settled in the background."""

    def __init__(self, reason: str, fault: NodeFault | None) -> None:
        self.reason = reason
        self.fault = fault
        self.first_in_job = False
        self.settled = anyio.Event()


async def _then_cancel(mirror: Mirror, revision: int, scope: anyio.CancelScope) -> None:
    await mirror.wait_past(revision)
    scope.cancel()


class EtcdQuarantine(Feature):
    """This node's quarantine in its etcd job (see the module docstring)."""

    def __init__(self, spec: GroupSpec, backend: EtcdBackend, events: EventSink) -> None:
        rdzv = spec.rendezvous
        self.group = spec.name
        self.node = backend.node_name
        self.backend = backend
        self.events = events
        self.failures = NodeFailures(spec.quarantine_after, spec.quarantine_window)
        self.reason: str | None = None
        """Why this node is set aside (None: it is not)."""
        self.store = EtcdStore(
            parse_endpoints(",".join(rdzv.endpoints)),
            run_prefix(rdzv.run_id),
            call_timeout=_CALL_TIMEOUT,
            on_outage=self._on_outage,
        )
        self._patience = rdzv.join_timeout
        """How long a call before a round waits for etcd: as long as joining the round."""
        self._claim: _Claim | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    async def aclose(self) -> None:
        await self.store.aclose()

    @staticmethod
    def _on_outage(error: BaseException | None) -> None:
        if error is not None:  # the rendezvous reports the outage itself
            log.debug("quarantine: etcd unreachable, retrying: %s", error)

    # -- counting ----------------------------------------------------------------

    def first_failure(self, reason: str, fault: NodeFault | None) -> None:
        """The first failure of this node's attempt, while its round ran: claim the
        round's first failure in the job now (the others may be failing too)."""
        result = self.backend.result
        if result is None or self._tg is None:
            return  # no round ran: nobody else failed with it
        self._claim = _Claim(reason, fault)
        self._tg.start_soon(self._settle, self._claim, result.round)

    async def _settle(self, claim: _Claim, round: int) -> None:
        value = encode({"node": self.node, "reason": claim.reason})
        try:
            claim.first_in_job = await self.store.create(
                f"{FIRST_FAILURE}{round}", value, lease=0, deadline=self._deadline()
            )
        except RendezvousConnectionError as e:
            log.warning("quarantine: round %d's first failure not claimed: %s", round, e)
        finally:
            claim.settled.set()

    async def prepare(self) -> None:
        """Before each round: count the last attempt's failure, set the node aside when
        it was the last one needed, and sit out while the job's key says so."""
        claim, self._claim = self._claim, None
        if claim is not None:
            await claim.settled.wait()
            counted = counts_against_node(claim.fault, first_in_job=claim.first_in_job)
            if counted and self.failures.count(time.monotonic()):
                window = f"{self.failures.window / 60:g} min"
                reason = f"{len(self.failures)} node failure(s) within {window}, the last: "
                await self._set_aside(reason + claim.reason, self._before_round())
        found = await self.store.get(self._key(self.node), deadline=self._before_round())
        if found is not None:
            await self._sit_out(msgspec.json.decode(found.value, type=SetAside))

    async def unhealthy(self, reason: str) -> None:
        """The group cannot run here (a GPU's fatal error, a worker in D state): the node's
        beyond doubt, and no restart follows. Set it aside at once; the group's end
        revokes its lease, and the job goes on without it (a standby in its rank)."""
        try:
            aside = await self._set_aside(reason, self._deadline())
        except RendezvousConnectionError as e:
            log.warning("quarantine: %s not set aside: %s", self.node, e)
            return
        self.reason = reason
        self._emit_set_aside(aside)

    async def standby_waiting(self) -> bool:
        """Whether a node stands by beside this node's full round, to take a rank."""
        deadline = self._deadline()
        state = state_of(await self.store.get(STATE, deadline=deadline))
        if not standing_by(state, self.backend.spec.rendezvous.nnodes):
            return False
        return bool(asking(state, await read_records(self.store, deadline=deadline)))

    async def step_aside(self, reason: str) -> bool:
        """Set this node aside now (a straggler of its own); it leaves the job before
        its next round, the way a node whose failures counted does. One node per round:
        False when another claimed this round's step aside (the standby is its)."""
        result = self.backend.result
        if result is None:
            return False
        claim = encode({"node": self.node, "reason": reason})
        key, deadline = f"{STEPPED_ASIDE}{result.round}", self._deadline()
        if not await self.store.create(key, claim, lease=0, deadline=deadline):
            return False
        aside = await self._set_aside(reason, deadline)
        self.reason = aside.reason  # said at once: the workers are still being stopped
        return True

    async def _set_aside(self, reason: str, deadline: float) -> SetAside:
        aside = SetAside(reason, time.time())
        await self.store.put(self._key(self.node), encode(aside), deadline=deadline)
        return aside

    def _emit_set_aside(self, aside: SetAside) -> None:
        self.events.emit(
            "node_quarantined",
            group=self.group,
            node=self.node,
            run_id=self.backend.spec.rendezvous.run_id,
            reason=aside.reason,
            since=aside.since,
        )

    async def _sit_out(self, aside: SetAside) -> None:
        key = self._key(self.node)
        self.reason = aside.reason
        # Its record gone, the leader counts it lost: the others' round ends without it.
        record = NODES + self.backend.rendezvous.node_id
        await self.store.delete(record, deadline=self._before_round())
        self._emit_set_aside(aside)
        over = await self._until_cleared_or_over(key)
        self.reason = None
        if over:  # as a standby's: it had no place in the job's last round, no barrier
            self.backend.needed = False
            raise RendezvousGracefulExitError("the job ended while this node was set aside")
        self.events.emit("quarantine_over", group=self.group, node=self.node)

    async def _until_cleared_or_over(self, key: str) -> bool:
        """Wait until ``key`` is deleted (False) or the job is over (True: the run closed,
        or its last round ended), watching both keys."""
        aside, rounds = Mirror(key), Mirror(STATE)
        node_id = self.backend.rendezvous.node_id

        def over() -> bool:
            return where(state_of(rounds.values.get(STATE)), node_id, -1) == "over"

        async with anyio.create_task_group() as tg:
            await tg.start(aside.run, self.store)
            await tg.start(rounds.run, self.store)
            while key in aside.values and not over():
                seen = (aside.revision, rounds.revision)  # before any other task runs
                async with anyio.create_task_group() as either:
                    for mirror, revision in zip((aside, rounds), seen, strict=True):
                        either.start_soon(_then_cancel, mirror, revision, either.cancel_scope)
            tg.cancel_scope.cancel()
        return key in aside.values

    # -- the operator ------------------------------------------------------------

    def clear(self, node: str) -> str:
        """Bring ``node`` back into the job (its agent rejoins once it sees the key go)."""
        if self._tg is None:
            raise GroupError(f"group {self.group} has not started yet")
        self._tg.start_soon(self._delete, node)
        return f"clearing the quarantine of {node} in run {self.backend.spec.rendezvous.run_id}"

    async def _delete(self, node: str) -> None:
        try:
            if await self.store.delete(self._key(node), deadline=self._deadline()):
                self.events.emit("quarantine_cleared", group=self.group, node=node)
        except RendezvousConnectionError as e:
            log.warning("quarantine of %s not cleared: %s", node, e)

    @staticmethod
    def _key(node: str) -> str:
        return QUARANTINE + node

    @staticmethod
    def _deadline() -> float:
        return time.monotonic() + _ETCD_TIMEOUT

    def _before_round(self) -> float:
        return time.monotonic() + self._patience
