"""The ``etcd`` rendezvous backend: elastic multi-node jobs between MIN and MAX nodes.

One :class:`EtcdRendezvous` per node and job, selected by torchrun's flags
``--rdzv-backend etcd --rdzv-endpoint HOST:PORT[,HOST:PORT…] --rdzv-id RUN
--nnodes MIN:MAX`` (:func:`parse_endpoints`, :func:`parse_nnodes`). Its keys
live under ``/watchdogd/rdzv/<run id>/``:

- ``state``: the round document (:class:`~watchdogd.core.rdzv_state.RoundState`),
  changed only by compare-and-swap; the rules are in :mod:`watchdogd.core.rdzv_state`;
- ``nodes/<node>``: one key per live node, on a lease kept alive from the
  event loop; when a node dies or is cut off, etcd deletes it after the TTL;
- ``restarts``: the job's restart count, one per failed round;
- ``exit/<round>/<node>``: where each node's group ended, for the exit barrier.

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
``node_lost``, ``closed``, ``timeout``, ``exit_barrier``, ``etcd_unavailable``
and ``etcd_available``; failures carry their message in ``error_trace``.

A run id is single-use, as in torch: a finished run leaves its closed state
behind, so a late node learns the job is over rather than starting it anew.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from types import TracebackType
from typing import NamedTuple, Self

import anyio
import anyio.abc
import msgspec

from watchdogd.core.rdzv_state import (
    Change,
    Member,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
    RestartCount,
    RoundState,
    advance,
    count_restart,
    membership,
    waiting_count,
    where,
)
from watchdogd.core.workerenv import Placement
from watchdogd.groups.etcd_store import (
    EtcdStore,
    KeyValue,
    Mirror,
    lease_not_found,
    parse_endpoints,
)
from watchdogd_client.events import NodeState, RdzvEvent

__all__ = [
    "EtcdRendezvous",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousResult",
    "RendezvousTimeoutError",
    "parse_endpoints",
    "parse_nnodes",
]

log = logging.getLogger("watchdogd.rendezvous")

_REVOKE_TIMEOUT = 2.0


class RendezvousResult(msgspec.Struct, frozen=True, kw_only=True):
    """This node's place in a completed round."""

    run_id: str
    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    """The job's restarts so far (``TORCHELASTIC_RESTART_COUNT``), the same on every node."""

    def placement(self) -> Placement:
        return Placement(
            group_rank=self.group_rank,
            group_world_size=self.group_world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            run_id=self.run_id,
        )


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a node's leased key: who it is, for people reading etcd."""

    name: str
    hostname: str
    pid: int
    addr: str


class ExitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of ``exit/<round>/<node>``: how this node's group ended."""

    state: NodeState


class _View(NamedTuple):
    """The run's keys, decoded."""

    state: RoundState
    state_revision: int
    alive: frozenset[str]
    restarts: RestartCount
    restarts_revision: int


_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(RoundState)
_restarts_decoder = msgspec.json.Decoder(RestartCount)
_NODES = "nodes/"


def _view(values: Mapping[str, KeyValue]) -> _View:
    state = values.get("state")
    restarts = values.get("restarts")
    return _View(
        state=_state_decoder.decode(state.value) if state else RoundState(),
        state_revision=state.mod_revision if state else 0,
        alive=frozenset(k.removeprefix(_NODES) for k in values if k.startswith(_NODES)),
        restarts=_restarts_decoder.decode(restarts.value) if restarts else RestartCount(),
        restarts_revision=restarts.mod_revision if restarts else 0,
    )


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX`` as (min, max)."""
    low, sep, high = value.partition(":")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise ValueError(f"--nnodes {value!r}: expected N or MIN:MAX")
    min_nodes, max_nodes = int(low), int(high) if sep else int(low)
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"--nnodes {value!r}: need 1 <= MIN <= MAX")
    return min_nodes, max_nodes


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
        self.node_name = node_name
        self.node_id = f"{node_name.replace('/', '_')}:{os.getpid()}:{secrets.token_hex(3)}"
        self.advertise_addr = advertise_addr
        self.lease_ttl = lease_ttl
        self.last_call = last_call
        self.join_timeout = join_timeout
        self.etcd_timeout = etcd_timeout
        self.exit_barrier_timeout = exit_barrier_timeout
        self._on_event = on_event
        self._hostname = socket.gethostname()
        self._store = EtcdStore(
            parse_endpoints(joined),
            f"/watchdogd/rdzv/{run_id}/",
            call_timeout=call_timeout,
            on_outage=self._on_outage,
        )
        self._mirror = Mirror()
        self._lease = 0
        self._register_lock = anyio.Lock()
        self._stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        # The last round this node ran in: number, members, and the revision
        # of the state that completed it (the mirror is stale before that).
        self._round: int | None = None
        self._members: tuple[str, ...] = ()
        self._round_revision = 0
        self._lost_self = False
        # Self-fencing: the lease lives on etcd's clock from the moment etcd took a
        # renewal, which is after this node sent it. So the send time of the last
        # renewal that succeeded, plus the TTL, bounds the lease's end from below
        # (both clocks run at the same rate to within NTP's 500 ppm): stopping the
        # workers a margin before that, on the monotonic clock, stops them before
        # the others can have dropped this node and re-formed without it.
        self.fence_margin = max(0.5, lease_ttl / 4)
        self.fenced_since: float | None = None
        """Wall-clock time this node fenced itself (None: it is not fenced)."""
        self._renewed_at = time.monotonic()
        self._renewal = anyio.Event()
        self._fenced = anyio.Event()

    # -- lifetime ----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Register this node (a leased key), start the watch and the lease keep-alive."""
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._store.aclose)
            await self._register(deadline=time.monotonic() + self.etcd_timeout)
            stack.push_async_callback(self._revoke)
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            await self._task_group.start(self._mirror.run, self._store)
            self._task_group.start_soon(self._keep_alive)
            self._task_group.start_soon(self._fence_when_unrenewed)
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

    async def _register(self, deadline: float = math.inf) -> None:
        """Put this node's key on a fresh lease (at start, and after the lease was lost)."""
        record = NodeRecord(
            name=self.node_name, hostname=self._hostname, pid=os.getpid(), addr=self.advertise_addr
        )
        async with self._register_lock:
            while True:
                lease, sent = await self._store.grant(self.lease_ttl, deadline=deadline)
                try:
                    await self._store.put(
                        _NODES + self.node_id,
                        _encoder.encode(record),
                        lease=lease,
                        deadline=deadline,
                    )
                except Exception as e:
                    if lease_not_found(e):
                        continue  # it expired before the key was on it (a slow etcd): again
                    raise
                self._lease = lease
                self._renewed(sent)
                return

    async def _revoke(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._store.revoke(self._lease, deadline=time.monotonic() + _REVOKE_TIMEOUT)
            except RendezvousConnectionError as e:
                log.warning(
                    "could not revoke the lease; etcd drops it in %ds: %s", self.lease_ttl, e
                )

    async def _keep_alive(self) -> None:
        while True:
            # A third of the TTL after the last renewal, not after a slow call's end.
            await anyio.sleep(max(0.0, self._renewed_at + self.lease_ttl / 3 - time.monotonic()))
            ttl, sent = await self._store.refresh(self._lease)
            if ttl > 0:
                self._renewed(sent)
            else:
                # etcd let the lease expire (we were cut off): the others dropped us.
                self._lost_self = True
                self._emit(
                    "node_lost",
                    f"{self.node_id}: lease expired while cut off from etcd; re-registering",
                    NodeState.FAILED,
                )
                await self._register()

    def _renewed(self, sent: float) -> None:
        self._renewed_at = max(self._renewed_at, sent)
        self._renewal.set()
        self._renewal = anyio.Event()
        if self.fenced_since is not None:
            self.fenced_since = None
            self._fenced = anyio.Event()
            self._emit("unfenced", f"{self.node_id}: etcd renews this node again", NodeState.INIT)

    async def _fence_when_unrenewed(self) -> None:
        """Fence this node ``fence_margin`` before its lease can have run out on etcd."""
        while True:
            if self.fenced_since is not None:
                await self._renewal.wait()  # which unfences it
                continue
            left = self._renewed_at + self.lease_ttl - self.fence_margin - time.monotonic()
            if left > 0:
                with anyio.move_on_after(left):
                    await self._renewal.wait()
                continue
            self.fenced_since = time.time()
            unrenewed = time.monotonic() - self._renewed_at
            self._emit(
                "fenced",
                f"{self.node_id}: no lease renewal for {unrenewed:.1f} s (TTL {self.lease_ttl} s): "
                "its workers are stopped before the others can have re-formed without it",
                NodeState.FAILED,
            )
            self._fenced.set()

    # -- rendezvous --------------------------------------------------------------

    async def _read(self, deadline: float) -> tuple[_View, int]:
        listing = await self._store.read_all(deadline=deadline)
        return _view(listing.values), listing.revision

    async def next_rendezvous(self, master_port: int) -> RendezvousResult:
        """Take a place in the next round and wait until it completes.

        Called first at start and again after every restart: a node still in
        a running round leaves it, which tells the others to come back too.
        ``master_port`` is where this node would serve as rank 0; rank 0's is
        the job's. Raises :class:`RendezvousClosedError`,
        :class:`RendezvousTimeoutError`, :class:`RendezvousConnectionError`.
        """
        deadline = time.monotonic() + self.join_timeout
        me = Member(node=self.node_id, addr=self.advertise_addr, port=master_port)
        leaving = True
        last_call: tuple[int, float] | None = None  # (round, when its window ends)
        while True:
            view, revision = await self._read(deadline)
            if self.node_id not in view.alive:
                await self._register(deadline)
                continue
            now = time.monotonic()
            over = (
                last_call is not None and last_call[0] == view.state.round and now >= last_call[1]
            )
            try:
                state = advance(
                    view.state,
                    me,
                    view.alive,
                    leaving=leaving,
                    min_nodes=self.min_nodes,
                    max_nodes=self.max_nodes,
                    last_call_over=over,
                )
            except RendezvousClosedError:
                self._emit("closed", "the rendezvous is closed", NodeState.RUNNING)
                raise
            if state != view.state:
                encoded = _encoder.encode(state)
                if await self._store.cas("state", view.state_revision, encoded, deadline=deadline):
                    if leaving:
                        self._emit_join(state)
                    leaving = False
                continue
            leaving = False
            position = where(state, self.node_id)
            if position == "running":
                return self._ran(state, view)
            if position == "joined" and len(state.participants) >= self.min_nodes:
                if last_call is None or last_call[0] != state.round:
                    last_call = (state.round, now + self.last_call)
                wake = last_call[1]
            else:
                last_call, wake = None, math.inf
            if now >= deadline:
                raise self._timed_out(state)
            with anyio.move_on_after(min(wake, deadline) - now):
                await self._mirror.wait_past(revision)

    def _emit_join(self, state: RoundState) -> None:
        if where(state, self.node_id) == "waiting":
            message = f"{self.node_id} waits for round {state.round + 1}"
        else:
            message = f"{self.node_id} joined round {state.round}"
        self._emit("join", message, NodeState.INIT)

    def _ran(self, state: RoundState, view: _View) -> RendezvousResult:
        mine = next(m for m in state.participants if m.node == self.node_id)
        assert mine.rank is not None
        self._round = state.round
        self._members = tuple(m.node for m in state.participants)
        self._round_revision = view.state_revision
        self._lost_self = False
        result = RendezvousResult(
            run_id=self.run_id,
            round=state.round,
            group_rank=mine.rank,
            group_world_size=state.world_size,
            master_addr=state.master_addr,
            master_port=state.master_port,
            restart_count=view.restarts.count,
        )
        self._emit(
            "round_complete",
            f"round {state.round} complete: rank {mine.rank} of {state.world_size}",
            NodeState.RUNNING,
            rank=mine.rank,
            master=f"{state.master_addr}:{state.master_port}",
        )
        return result

    def _timed_out(self, state: RoundState) -> RendezvousTimeoutError:
        names = ", ".join(m.node for m in state.participants) or "none"
        if where(state, self.node_id) == "waiting":
            message = (
                f"rendezvous {self.run_id}: no place after {self.join_timeout:g}s; round "
                f"{state.round} runs with {len(state.participants)} node(s) ({names}), "
                f"max {self.max_nodes}"
            )
        else:
            message = (
                f"rendezvous {self.run_id}: only {len(state.participants)} of at least "
                f"{self.min_nodes} nodes joined round {state.round} within "
                f"{self.join_timeout:g}s ({names})"
            )
        self._emit("timeout", message, NodeState.FAILED, error=message)
        return RendezvousTimeoutError(message)

    # -- while the group runs ----------------------------------------------------

    def _current(self) -> _View | None:
        """The mirror's view, once it has caught up with the round this node runs."""
        if self._round is None or self._mirror.revision < self._round_revision:
            return None
        return _view(self._mirror.values)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a place in a new round (a running node restarts for them)."""
        view = self._current()
        if view is None or self._round is None:
            return 0
        return waiting_count(view.state, self._round, self.max_nodes)

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
            view = self._current()
            if self.fenced_since is not None:
                change: Change | None = "fenced"
            elif self._lost_self:
                change = "lost"
            elif view is None:
                change = None
            else:
                change = membership(
                    view.state, self._round, self._members, view.alive, self.max_nodes
                )
            if change is not None:
                self._report(change, view)
                return change
            await self._news()

    async def _news(self) -> None:
        """The mirror moved on, or this node fenced itself (the mirror cannot move then)."""
        async with anyio.create_task_group() as tg:

            async def first(wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                tg.cancel_scope.cancel()

            tg.start_soon(first, partial(self._mirror.wait_past, self._mirror.revision))
            tg.start_soon(first, self._fenced.wait)

    def _report(self, change: Change, view: _View | None) -> None:
        match change:
            case "waiting":
                count = len(view.state.waiting) if view is not None else 0
                message = f"{count} node(s) waiting for a new round"
                self._emit("nodes_waiting", message, NodeState.RUNNING)
            case "lost":
                gone = [m for m in self._members if view is None or m not in view.alive]
                message = (
                    f"lost {', '.join(gone)}" if gone else "this node's round went on without it"
                )
                self._emit("node_lost", message, NodeState.FAILED)
            case "closed":
                self._emit("closed", "the rendezvous is closed", NodeState.RUNNING)

    # -- job-wide state ----------------------------------------------------------

    async def set_closed(self) -> None:
        """Close the rendezvous: every node's next round attempt fails, running ones stop."""
        deadline = time.monotonic() + self.etcd_timeout
        while True:
            view, _ = await self._read(deadline)
            if view.state.closed:
                return
            closed = msgspec.structs.replace(view.state, closed=True)
            if await self._store.cas(
                "state", view.state_revision, _encoder.encode(closed), deadline=deadline
            ):
                self._emit("closed", f"{self.node_id} closed the rendezvous", NodeState.RUNNING)
                return

    async def is_closed(self) -> bool:
        view, _ = await self._read(time.monotonic() + self.etcd_timeout)
        return view.state.closed

    async def add_restart(self) -> int:
        """Count the failure of this node's round, once for the whole job; the new total.

        Every node whose group failed in the same round calls this; the count
        goes up once. It lives in etcd, so a node that quickly rejoins cannot
        reset it (torch counts per agent).
        """
        if self._round is None:
            raise RuntimeError("add_restart() before next_rendezvous()")
        deadline = time.monotonic() + self.etcd_timeout
        while True:
            view, _ = await self._read(deadline)
            counted = count_restart(view.restarts, self._round)
            if counted == view.restarts:
                return counted.count
            encoded = _encoder.encode(counted)
            if await self._store.cas(
                "restarts", view.restarts_revision, encoded, deadline=deadline
            ):
                return counted.count

    async def exit_barrier(self, outcome: NodeState = NodeState.SUCCEEDED) -> bool:
        """Record that this node's group ended, then wait for every member of its round.

        A member counts once it recorded its end, or once its lease is gone.
        True when all did within ``exit_barrier_timeout``; False (reported) otherwise.
        """
        if self._round is None:
            raise RuntimeError("exit_barrier() before next_rendezvous()")
        started = time.monotonic()
        prefix = f"exit/{self._round}/"
        pending: list[str] = list(self._members)
        with anyio.move_on_after(self.exit_barrier_timeout):
            record = _encoder.encode(ExitRecord(state=outcome))
            await self._store.put(prefix + self.node_id, record)
            while True:
                values = self._mirror.values
                alive = {k.removeprefix(_NODES) for k in values if k.startswith(_NODES)}
                pending = [m for m in self._members if prefix + m not in values and m in alive]
                if not pending:
                    break
                await self._mirror.wait_past(self._mirror.revision)
        waited = time.monotonic() - started
        if pending:
            message = f"exit barrier timed out after {waited:.1f}s waiting for {', '.join(pending)}"
            self._emit("exit_barrier", message, outcome, error=message)
            return False
        self._emit("exit_barrier", f"all {len(self._members)} nodes done in {waited:.1f}s", outcome)
        return True

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
