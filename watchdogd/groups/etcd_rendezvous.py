"""The ``etcd`` rendezvous backend: elastic multi-node jobs between MIN and MAX nodes.

One :class:`EtcdRendezvous` per node and job, selected by torchrun's flags
``--rdzv-backend etcd --rdzv-endpoint HOST:PORT[,HOST:PORT…] --rdzv-id RUN
--nnodes MIN:MAX`` (:func:`parse_endpoints`). Its keys
live under ``/watchdogd/rdzv/<run id>/``: every node's record (``nodes/``),
the ``leader``, the round document (``state``), the job's ``restarts`` and
the nodes' straggler summaries (``stragglers/``, :meth:`EtcdRendezvous.share_summary`);
:mod:`~watchdogd.groups.etcd_documents` says what each holds. This class
composes three parts: this node's leased record and its self-fence
(:class:`~watchdogd.groups.etcd_lease.NodeLease`), the lead that writes the
round document (:class:`~watchdogd.groups.etcd_leader.RoundLeader`), and, here,
the node's own side of the rounds, the job-wide state and the exit barrier.
The rules of the rounds are pure, in :mod:`watchdogd.core.rdzv_state`.

Each node watches two keys, ``state`` and ``leader``, and, once its group
publishes straggler summaries, the ``stragglers/`` keys; only the leader
watches every key (its decisions ignore the summaries), and tells the
others of a lost member through the document. (A watch of the whole prefix
on every node, even for deletions only, would make etcd match each of a
thousand nodes' writes against a thousand watchers.) So a round costs one
write per node (its record) plus a few writes of the document, each pushed
once to every node, and the steady state is lease keep-alives, plus one
summary per node per publish interval, pushed to every node (N nodes: N²
small messages per interval, so a larger job wants a longer interval): no
node reads in a loop or contends for a key.

A supervisor drives it like this (``run_attempt`` stands for its own code:
spawn the workers with the placement, stop them on a membership change)::

    async with EtcdRendezvous(endpoints, run_id, min_nodes, max_nodes,
                              node_name=hostname, advertise_addr=addr,
                              on_event=record) as rdzv:
        while True:
            result = await rdzv.next_rendezvous(master_port=free_port(addr))
            # RANK, WORLD_SIZE, MASTER_*: result.placement();
            # TORCHELASTIC_RESTART_COUNT: result.restart_count (job-wide).
            outcome = await run_attempt(result, rdzv.wait_for_membership_change)
            if outcome == "waiting":            # scale-up, or a peer restarting
                continue                         # a free restart
            if outcome in ("lost", "failed"):  # a node died, or our workers did
                if await rdzv.add_restart() <= max_restarts:
                    continue
                await rdzv.set_closed()          # out of restarts: every node stops
                outcome = "failed"
            state = NodeState.SUCCEEDED if outcome == "succeeded" else NodeState.FAILED
            await rdzv.exit_barrier(state)       # "closed" too: the job is over
            break

Errors (all :class:`RendezvousError`): :class:`RendezvousClosedError` (the
job is over), :class:`RendezvousTimeoutError` (too few nodes within
``join_timeout``; the message names who came), :class:`RendezvousConnectionError`
(etcd unreachable past ``etcd_timeout``). Background work (lease keep-alive,
the watch) never gives up: it retries with backoff and reports the outage
through ``on_event``.

Events (:class:`~watchdogd_client.events.RdzvEvent`, through ``on_event``):
``join``, ``round_complete`` (with rank and master endpoint), ``nodes_waiting``,
``standby`` (a node beyond ``max_nodes``: no join timeout, it takes a lost
one's rank), ``graceful_exit`` (the job ended without this node),
``node_lost``, ``closed``, ``timeout``, ``exit_barrier``, ``etcd_unavailable``
and ``etcd_available``; failures carry their message in ``error_trace``.

A run id is single-use, as in torch: a finished run leaves its closed state
behind, so a late node learns the job is over rather than starting it anew.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
import msgspec

from watchdogd.core.rdzv_state import (
    Change,
    NodeRecord,
    Record,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    RoundState,
    asking,
    barrier_over,
    barrier_pending,
    standing_by,
    stop_reason,
    waiting_count,
    where,
)
from watchdogd.core.workerenv import Placement
from watchdogd.groups.etcd_documents import (
    STATE,
    STRAGGLERS,
    close_run,
    count_failure,
    read_records,
    run_closed,
    run_prefix,
    state_of,
    summaries_of,
)
from watchdogd.groups.etcd_leader import RoundLeader
from watchdogd.groups.etcd_lease import NodeLease
from watchdogd.groups.etcd_store import EtcdStore, Mirror, lease_not_found, parse_endpoints
from watchdogd_client.events import NodeState, RdzvEvent

__all__ = [
    "EtcdRendezvous",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousResult",
    "RendezvousTimeoutError",
    "parse_endpoints",
]

log = logging.getLogger("watchdogd.rendezvous")


class RendezvousResult(msgspec.Struct, frozen=True, kw_only=True):
    """This node's place in a completed round."""

    run_id: str
    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    master_store: bool = False  # rank 0's agent hosts the job's store (use_agent_store)
    restart_count: int
    """The job's restarts so far (``TORCHELASTIC_RESTART_COUNT``), the same on every node."""

    def placement(self) -> Placement:
        return Placement(
            group_rank=self.group_rank,
            group_world_size=self.group_world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            run_id=self.run_id,
            use_agent_store=self.master_store,
        )


class EtcdRendezvous:
    """This node's side of one job's rendezvous on etcd (see the module docstring).

    ``lease_ttl`` (whole seconds, as etcd grants them): how long after a node
    dies or is cut off the others notice. ``last_call``: how long a round
    with at least ``min_nodes`` stays open for more. ``join_timeout``: how
    long ``next_rendezvous`` waits for enough nodes. ``etcd_timeout``: how
    long the other calls retry an unreachable etcd. ``exit_barrier_timeout``:
    how long a finished node waits for the others'. ``call_timeout``: one
    etcd call. ``on_event`` is called from the event loop and must not block.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        node_name: str,
        advertise_addr: str,
        lease_ttl: int = 10,
        last_call: float = 1.0,
        join_timeout: float = 600.0,
        etcd_timeout: float = 60.0,
        exit_barrier_timeout: float = 300.0,
        call_timeout: float = 5.0,
        on_event: Callable[[RdzvEvent], None] | None = None,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        if not run_id or "/" in run_id:
            raise ValueError(f"bad run id {run_id!r}: it must be non-empty and without '/'")
        if lease_ttl < 2:
            raise ValueError("lease_ttl must be at least 2 s (etcd's shortest lease)")
        joined = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.lease_ttl = lease_ttl
        self.last_call = last_call
        self.join_timeout = join_timeout
        self.etcd_timeout = etcd_timeout
        self.exit_barrier_timeout = exit_barrier_timeout
        self._on_event = on_event
        self._hostname = socket.gethostname()
        self._store = EtcdStore(
            parse_endpoints(joined),
            run_prefix(run_id),
            call_timeout=call_timeout,
            on_outage=self._on_outage,
        )
        record = NodeRecord(
            name=node_name, hostname=self._hostname, pid=os.getpid(), addr=advertise_addr
        )
        self._lease = NodeLease(
            self._store,
            record,
            lease_ttl,
            emit=self._emit,
            on_lost=self._lost_lease,
            on_fenced=self._fenced,
        )
        self._leader = RoundLeader(
            self._store,
            self._lease,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            last_call=last_call,
        )
        self._stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        # What this node watches: the round document (and the leader key's end).
        self._state_mirror = Mirror(STATE)
        self._state = RoundState()
        self._changed = anyio.Event()
        # The other nodes' straggler summaries: watched from the first publication on.
        self._summaries: Mirror | None = None
        # The last round this node ran in: number, members (its rank is the leader's).
        self._round: int | None = None
        self._members: tuple[str, ...] = ()
        self._lost_self = False
        self.standby = False  # it waits beside a full round without it: no join timeout
        self._waiting_for_place = False  # in next_rendezvous

    @property
    def node_id(self) -> str:
        """Unique per registration (``name:pid:random``): a node cut off long enough
        to lose its lease comes back under a new one, as a new member."""
        return self._lease.node_id

    @property
    def fenced_since(self) -> float | None:
        """Wall-clock time this node fenced itself (None: it is not fenced)."""
        return self._lease.fenced_since

    @property
    def leading(self) -> bool:
        """This node holds the ``leader`` key and decides the rounds (not while fenced)."""
        return self._leader.leading

    # -- lifetime ----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Register this node (a leased key), start the watches, the keep-alive, the lead."""
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._store.aclose)
            await self._lease.publish(time.monotonic() + self.etcd_timeout, fresh=True)
            stack.push_async_callback(self._lease.revoke)
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            await self._task_group.start(self._follow_state)
            await self._task_group.start(self._leader.run)
            self._task_group.start_soon(self._lease.keep_alive)
            self._task_group.start_soon(self._lease.fence_when_unrenewed)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the background tasks and revoke the lease: the others see this node leave."""
        assert self._stack is not None and self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._stack.__aexit__(exc_type, exc, tb)

    def _lost_lease(self) -> None:
        """etcd let the lease expire (this node was cut off): the others dropped it."""
        self._lost_self = True
        self._leader.step_down()
        self._notify()

    def _fenced(self) -> None:
        self._leader.step_down()  # the others may soon elect another leader
        self._notify()

    # -- what every node watches -------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _news(self) -> None:
        """Return once the round document or this node's fence changed."""
        await self._changed.wait()

    async def _follow_state(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self._state_mirror.run, self._store)
            task_status.started()
            while True:
                revision = self._state_mirror.revision
                self._state = state_of(self._state_mirror.values.get(STATE))
                self._notify()
                await self._state_mirror.wait_past(revision)

    # -- rendezvous --------------------------------------------------------------

    async def next_rendezvous(self, master_port: int, *, store: bool = False) -> RendezvousResult:
        """Take a place in the next round and wait until it completes.

        Called first at start and again after every restart: a node still in
        a running round leaves it, which tells the others to come back too.
        ``master_port`` is where this node would serve as rank 0 (``store``: its agent's
        store for this round); rank 0's is the job's. Raises :class:`RendezvousClosedError`
        (or its subclass :class:`RendezvousGracefulExitError`: the job ended while this
        node waited beside it), :class:`RendezvousTimeoutError`, :class:`RendezvousConnectionError`.
        """
        deadline = time.monotonic() + self.join_timeout
        after = -1 if self._round is None else self._round
        if where(self._state, self.node_id, after) == "over":
            raise self._closed(graceful=False)
        self._lease.record = msgspec.structs.replace(
            self._lease.record,
            port=master_port,
            store=store,
            asks_after=after,
            rank=self._leader.rank,
            ended=False,
        )
        await self._lease.publish(deadline)
        self._emit(
            "join", f"{self.node_id} asks for a place in a round after {after}", NodeState.INIT
        )
        waited = False  # beside a round without this node: the job may end without it
        self._waiting_for_place = True
        try:
            while True:
                state = self._state
                position = where(state, self.node_id, after)
                if position == "over":
                    raise self._closed(graceful=waited)
                if position == "running":
                    return self._ran(state)
                waited = waited or position == "waiting"
                self._stand_by(position == "waiting" and standing_by(state, self.max_nodes))
                if self.standby:  # no join timeout: it counts from when that changes
                    await self._news()
                    deadline = time.monotonic() + self.join_timeout
                elif (now := time.monotonic()) >= deadline:
                    raise await self._timed_out(state, position)
                else:
                    with anyio.move_on_after(deadline - now):
                        await self._news()
        finally:
            self._waiting_for_place = False
            self._stand_by(False)

    async def offer_store(self, port: int) -> None:
        """This node's agent now hosts a store on ``port``: offered while the node waits."""
        if self._waiting_for_place and not self._lease.record.store:
            self._lease.record = msgspec.structs.replace(self._lease.record, port=port, store=True)
            await self._lease.publish(time.monotonic() + self.etcd_timeout)

    def _stand_by(self, standby: bool) -> None:
        if standby and not self.standby:
            beside = f"beside round {self._state.round}, full at {self.max_nodes} nodes"
            message = f"{self.node_id} stands by {beside}: it takes the next lost node's rank"
            self._emit("standby", message, NodeState.INIT)
        self.standby = standby

    def _closed(self, *, graceful: bool) -> RendezvousClosedError:
        if graceful:
            message = "the job ended while this node waited for a place: not needed"
            self._emit("graceful_exit", message, NodeState.SUCCEEDED)
            return RendezvousGracefulExitError(message)
        self._emit("closed", "the rendezvous is closed", NodeState.RUNNING)
        return RendezvousClosedError("the rendezvous is closed: the job has finished")

    def _ran(self, state: RoundState) -> RendezvousResult:
        rank = state.members.index(self.node_id)
        self._round, self._members, self._leader.rank = state.round, state.members, rank
        self._lost_self = False
        result = RendezvousResult(
            run_id=self.run_id,
            round=state.round,
            group_rank=rank,
            group_world_size=len(state.members),
            master_addr=state.master_addr,
            master_port=state.master_port,
            master_store=state.master_store,
            restart_count=state.restarts,
        )
        self._emit(
            "round_complete",
            f"round {state.round} complete: rank {rank} of {len(state.members)}",
            NodeState.RUNNING,
            rank=rank,
            master=f"{state.master_addr}:{state.master_port}",
        )
        return result

    async def _timed_out(self, state: RoundState, position: str) -> RendezvousTimeoutError:
        if position == "waiting":
            message = (
                f"rendezvous {self.run_id}: no place after {self.join_timeout:g}s; round "
                f"{state.round} runs with {len(state.members)} node(s) "
                f"({', '.join(state.members)}), max {self.max_nodes}"
            )
        else:
            queue = await self._asking(state)
            message = (
                f"rendezvous {self.run_id}: only {len(queue)} of at least "
                f"{self.min_nodes} nodes joined round {state.round + state.complete} within "
                f"{self.join_timeout:g}s ({', '.join(queue) or 'none'})"
            )
        self._emit("timeout", message, NodeState.FAILED, error=message)
        return RendezvousTimeoutError(message)

    async def _records(self) -> dict[str, Record]:
        return await read_records(self._store, deadline=time.monotonic() + self.etcd_timeout)

    async def _asking(self, state: RoundState) -> list[str]:
        try:
            return asking(state, await self._records())
        except RendezvousConnectionError:
            return []

    # -- while the group runs ----------------------------------------------------

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a place in a new round (a running node restarts for them)."""
        return 0 if self._round is None else waiting_count(self._state, self._round)

    async def wait_for_membership_change(self) -> Change:
        """Return why this node's round is over: ``waiting``, ``lost`` or ``closed``.

        ``waiting``: a node arrived, or a peer left to restart: stop the
        workers and call ``next_rendezvous`` (not a failure). ``lost``: a
        member's lease expired (or this node's own): the group has failed.
        ``fenced``: this node has not renewed its lease for long enough that
        the others may soon drop it: stop the workers now (a failure too).
        ``closed``: the job is over. Woken by the watch, never by a poll.
        """
        if self._round is None:
            raise RuntimeError("wait_for_membership_change() before next_rendezvous()")
        while True:
            state = self._state
            fenced = self.fenced_since is not None
            change = stop_reason(state, self._round, fenced=fenced, lost=self._lost_self)
            if change is not None:
                self._report(change, state)
                return change
            await self._news()

    def _report(self, change: Change, state: RoundState) -> None:
        match change:
            case "waiting":
                message = f"{state.waiting} node(s) waiting for a new round"
                self._emit("nodes_waiting", message, NodeState.RUNNING)
            case "lost":
                message = (
                    f"lost {', '.join(state.lost)}"
                    if state.lost
                    else "this node's round went on without it"
                )
                self._emit("node_lost", message, NodeState.FAILED)
            case "closed":
                self._emit("closed", "the rendezvous is closed", NodeState.RUNNING)

    async def share_summary(self, summary: bytes) -> dict[str, bytes]:
        """Write this node's straggler summary on its lease; the other nodes', by node id.

        The first call starts the watch of every node's summary; later calls
        read the watched copy, never etcd. A write that fails (no lease: the
        keep-alive re-registers; etcd unreachable past a TTL; refused) is
        skipped, never the group's failure: the next interval writes a newer one.
        """
        if self._summaries is None:
            assert self._task_group is not None
            self._summaries = Mirror(STRAGGLERS)
            await self._task_group.start(self._summaries.run, self._store)
        try:
            await self._store.put(
                STRAGGLERS + self.node_id,
                summary,
                lease=self._lease.lease,
                deadline=time.monotonic() + self.lease_ttl,
            )
        except RendezvousConnectionError:
            pass  # reported once by the store, as the outage
        except Exception as e:
            if not lease_not_found(e):
                log.warning("straggler summary of %s not written: %s", self.node_id, e)
        return summaries_of(self._summaries, self.node_id)

    # -- job-wide state ----------------------------------------------------------

    async def set_closed(self) -> None:
        """Close the rendezvous: every node's next round attempt fails, running ones stop."""
        if await close_run(self._store, deadline=time.monotonic() + self.etcd_timeout):
            self._emit("closed", f"{self.node_id} closed the rendezvous", NodeState.RUNNING)

    async def is_closed(self) -> bool:
        return await run_closed(self._store, deadline=time.monotonic() + self.etcd_timeout)

    async def add_restart(self) -> int:
        """Count the failure of this node's round, once for the whole job; the new total.

        Every node whose group failed in the same round calls this; the count
        goes up once. It lives in etcd, so a node that quickly rejoins cannot
        reset it (torch counts per agent).
        """
        if self._round is None:
            raise RuntimeError("add_restart() before next_rendezvous()")
        deadline = time.monotonic() + self.etcd_timeout
        return await count_failure(self._store, self._round, deadline=deadline)

    async def exit_barrier(self, outcome: NodeState = NodeState.SUCCEEDED) -> bool:
        """Record that this node's group ended, then wait for every member of its round.

        A member counts once it recorded its end, or once its lease is gone;
        the leader says when all did (``ended`` in the round document).
        True when all did within ``exit_barrier_timeout``; False (reported) otherwise.
        """
        if self._round is None:
            raise RuntimeError("exit_barrier() before next_rendezvous()")
        started = time.monotonic()
        done = False
        with anyio.move_on_after(self.exit_barrier_timeout):
            self._lease.record = msgspec.structs.replace(
                self._lease.record, asks_after=None, ended=True
            )
            await self._lease.publish()
            while not done:
                done = barrier_over(self._state, self._round)
                if not done:
                    await self._news()
        waited = time.monotonic() - started
        if not done:
            pending = await self._pending()
            message = f"exit barrier timed out after {waited:.1f}s waiting for {', '.join(pending)}"
            self._emit("exit_barrier", message, outcome, error=message)
            return False
        self._emit("exit_barrier", f"all {len(self._members)} nodes done in {waited:.1f}s", outcome)
        return True

    async def _pending(self) -> list[str]:
        """Members of this node's round alive and not ended (read once, for the message)."""
        try:
            records = await self._records()
        except RendezvousConnectionError:
            return list(self._members)
        return barrier_pending(self._members, records)

    # -- events ------------------------------------------------------------------

    def _on_outage(self, error: BaseException | None) -> None:
        state = NodeState.INIT if self._round is None else NodeState.RUNNING
        if error is None:
            self._emit("etcd_available", "etcd is reachable again", state)
        else:
            self._emit("etcd_unavailable", f"etcd unreachable, retrying: {error}", state)

    def _emit(
        self,
        name: str,
        message: str,
        state: NodeState,
        *,
        rank: int | None = None,
        master: str = "",
        error: str = "",
    ) -> None:
        if self._on_event is None:  # nobody records the event: log it here
            log.log(logging.WARNING if error else logging.INFO, "rendezvous %s: %s", name, message)
        else:
            self._on_event(
                RdzvEvent(
                    name=name,
                    run_id=self.run_id,
                    message=message,
                    hostname=self._hostname,
                    pid=os.getpid(),
                    node_state=state,
                    master_endpoint=master,
                    rank=rank,
                    error_trace=error,
                )
            )
