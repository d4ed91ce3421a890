"""The ``c10d`` rendezvous backend: torch's own, so torchrun and ``watchdogd run`` share a job.

torchrun's agents meet through more than torch's ``DynamicRendezvousHandler``
over a ``TCPStore``: through that store they also share the role and rank
assignment (``torchelastic/role_info/*``, ``torchelastic/assigned_ranks/*``),
the master address and port, the store rank 0's agent hosts for the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``), and the exit barrier
(``torchelastic/agent/terminal_state``). All of it is torch's code, run in a
torch helper process (:mod:`watchdogd.groups.torch_helper`) — a handler
built by torch's registry for torchrun's flags and torch's
``LocalElasticAgent`` — so it is the same protocol by construction. Its
calls block, torch is a large import and its threads would hold the GIL:
none of it runs in the daemon, which only waits on the helper's pipe.

As torch's agent does:

- before each attempt, a round (``next_rendezvous``, then the rank
  assignment): group rank, ranks, world size, the master;
- restarts are counted per node (torch's ``max_restarts`` is per agent):
  ``TORCHELASTIC_RESTART_COUNT`` is this node's own, and a peer's restart
  reaches this node as a waiting node, which restarts it without counting;
- while workers run, every ``monitor_interval`` it asks torch for waiting
  nodes (``num_nodes_waiting()``): any means a new round (not counted);
  closed means the job is over. Beyond torch: a member of the round whose
  heartbeats stopped (torch drops it from the rendezvous) is a lost node,
  which fails the attempt — torch leaves that to the workers, who may hang;
- at the end: the exit barrier when the group succeeded, then torch's
  ``shutdown()``, which closes the rendezvous (on failure too); a group
  stopped by an operator or a signal leaves it open, as torch's agent does
  on a signal.

Beyond torch: each node writes its straggler summary to the round's store
at ``watchdogd/stragglers/<group rank>`` and reads the other group ranks',
in one helper call per publish interval (:meth:`C10dBackend.share`): a
``TCPStore`` has no watch, and no lease either, so a dead node's summary
stays until the next round's store, aged out as stale meanwhile.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Self, TypeVar

import anyio
import msgspec

from watchdogd.core.ports import GroupError
from watchdogd.core.rdzv_state import (
    Change,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from watchdogd.core.workerenv import Placement
from watchdogd.groups.helper_process import HelperError, HelperFailedError, TorchHelper
from watchdogd.groups.torch_wire import (
    Done,
    Finish,
    NextRound,
    Open,
    Opened,
    Poll,
    Polled,
    Reply,
    Request,
    Round,
    Share,
    Shared,
)
from watchdogd_client.events import NodeState, RdzvEvent, record_rdzv_event
from watchdogd_client.groups import GroupSpec, GroupState, RendezvousInfo

__all__ = ["C10dBackend"]

log = logging.getLogger("watchdogd.rendezvous")

# torch re-reads the shared state at most once a second, and a peer that
# restarts leaves its place in one write and queues for the next round in
# another: a member missing this long is gone, not between the two.
_LOST_AFTER = 3.0

R = TypeVar("R", bound=Reply)

_SUMMARY_KEY = "watchdogd/stragglers/{}"

_ERRORS: dict[str, type[RendezvousError]] = {
    "closed": RendezvousClosedError,
    "graceful": RendezvousGracefulExitError,
    "timeout": RendezvousTimeoutError,
    "connection": RendezvousConnectionError,
}


def _torch_conf_value(value: bool | float | str) -> str:
    """A c10d setting as torch parses it: ``true``/``false``, whole seconds (rounded up)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return str(math.ceil(value))
    return str(value)


class C10dBackend:
    def __init__(self, spec: GroupSpec, on_event: Callable[[RdzvEvent], None]) -> None:
        rdzv = spec.rendezvous
        self.spec = spec
        self.local_restarts = spec.max_restarts  # per node, as torch's agents count
        self.endpoint = rdzv.endpoints[0] if rdzv.endpoints else ""
        self.helper = TorchHelper(rdzv.python)
        self.round: Round | None = None
        self.needed = True
        """False once the run closed while this node waited in torch's redundancy list."""
        self.waiting = 0
        self._on_event = on_event
        self._hostname = socket.gethostname()
        self._new_round = anyio.Event()
        self._finishing = False
        self._placing = False

    @property
    def _where(self) -> str:
        endpoint = self.endpoint or "localhost:29400"  # torch's default
        return f"c10d rendezvous {self.spec.rendezvous.run_id} at {endpoint}"

    def _no_torch(self, detail: str = "") -> str:
        return (
            f"the c10d rendezvous runs torch's own code, and {self.helper.python} cannot "
            f"import torch{detail}: install torch there (pip install torch), "
            "or use --rdzv-backend etcd"
        )

    async def __aenter__(self) -> Self:
        """Start the helper and open torch's rendezvous; GroupError names what went wrong."""
        rdzv = self.spec.rendezvous
        try:
            ready = await self.helper.start()
            if not ready.torch:
                raise GroupError(f"group {self.spec.name}: {self._no_torch()}")
            conf = {
                key: _torch_conf_value(value)
                for key, value in msgspec.structs.asdict(rdzv.c10d).items()
                if value is not None
            }
            await self._call(
                Open(
                    endpoint=self.endpoint,
                    run_id=rdzv.run_id,
                    min_nodes=rdzv.min_nodes or rdzv.nnodes,
                    max_nodes=rdzv.nnodes,
                    local_addr=rdzv.advertise_addr,
                    conf=conf,
                    role=self.spec.role,
                    nproc=self.spec.nproc,
                    max_restarts=self.spec.max_restarts,
                    monitor_interval=rdzv.monitor_interval,
                    entrypoint=self.spec.entrypoint[0],
                    exit_barrier_timeout=self.spec.exit_barrier_timeout,
                ),
                Opened,
            )
        except (HelperError, RendezvousError) as e:
            await self.helper.aclose()
            raise GroupError(f"group {self.spec.name}: {e}") from None
        except BaseException:
            await self.helper.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.helper.aclose()

    async def _call(self, request: Request, expect: type[R]) -> R:
        """One helper call; torch's failures as this package's rendezvous errors."""
        try:
            return await self.helper.call(request, expect)
        except HelperFailedError as e:
            failure = e.failure
            if failure.kind == "torch":
                raise RendezvousError(self._no_torch(f" ({failure.message})")) from None
            if failure.kind == "timeout":
                message = (
                    f"{self._where}: too few nodes within join_timeout "
                    f"({self._join_timeout()}s): {failure.message}"
                )
            else:
                message = f"{self._where}: {failure.message}"
            raise _ERRORS.get(failure.kind, RendezvousError)(message) from None
        except HelperError as e:
            raise RendezvousError(f"{self._where}: {e}") from None

    def _join_timeout(self) -> float:
        configured = self.spec.rendezvous.c10d.join_timeout
        return 600 if configured is None else math.ceil(configured)  # torch's default

    def _event(self, name: str, message: str, state: NodeState, *, error: str = "") -> None:
        placed = self.round
        event = RdzvEvent(
            name=name,
            run_id=self.spec.rendezvous.run_id,
            message=message,
            hostname=self._hostname,
            pid=os.getpid(),
            node_state=state,
            master_endpoint=f"{placed.master_addr}:{placed.master_port}" if placed else "",
            rank=placed.group_rank if placed else None,
            error_trace=error,
        )
        record_rdzv_event(event)
        self._on_event(event)

    async def next_round(self, restart_count: int) -> tuple[Placement, int]:
        """This attempt's placement; ``restart_count`` is this node's, as torch's is per agent."""
        self._placing = True
        try:
            self.round = placed = await self._call(NextRound(restart_count=restart_count), Round)
        except RendezvousGracefulExitError as e:
            self.needed = False
            self._event("graceful_exit", str(e), NodeState.SUCCEEDED)
            raise
        except RendezvousError as e:
            self._event("failed", str(e), NodeState.FAILED, error=str(e))
            raise
        finally:
            self._placing = False
        self.waiting = 0
        self._new_round.set()
        self._event(
            "round_complete",
            f"round {placed.round} complete: rank {placed.group_rank} of {placed.group_world_size}",
            NodeState.RUNNING,
        )
        placement = Placement(
            group_rank=placed.group_rank,
            group_world_size=placed.group_world_size,
            master_addr=placed.master_addr,
            master_port=placed.master_port,
            run_id=self.spec.rendezvous.run_id,
            first_rank=placed.first_rank,
            world_size=placed.world_size,
            role_first_rank=placed.role_first_rank,
            role_world_size=placed.role_world_size,
            use_agent_store=placed.use_agent_store,
        )
        return placement, restart_count

    async def watch(self, on_change: Callable[[Change], None]) -> None:
        """Poll torch as its agent does; report the change that ends each round, once."""
        while True:
            await self._new_round.wait()
            self._new_round = anyio.Event()
            change = await self._until_change()
            if not self._finishing:
                on_change(change)

    async def _until_change(self) -> Change:
        missing_since: float | None = None
        while True:
            await anyio.sleep(self.spec.rendezvous.monitor_interval)
            if self._finishing:
                await anyio.sleep_forever()
            try:
                polled = await self._call(Poll(), Polled)
            except RendezvousError as e:
                # torch's agent would raise out of its loop: the attempt cannot go on.
                self._event("node_lost", str(e), NodeState.FAILED, error=str(e))
                return "lost"
            self.waiting = polled.waiting
            if polled.closed:
                self._event("closed", "the rendezvous is closed", NodeState.RUNNING)
                return "closed"
            if polled.waiting > 0:
                message = f"{polled.waiting} node(s) waiting for a new round"
                self._event("nodes_waiting", message, NodeState.RUNNING)
                return "waiting"
            now = time.monotonic()
            if not polled.missing:
                missing_since = None
            elif missing_since is None:
                missing_since = now
            elif now - missing_since >= _LOST_AFTER:
                self._event("node_lost", f"lost {', '.join(polled.missing)}", NodeState.FAILED)
                return "lost"

    async def finish(self, state: GroupState) -> None:
        """As torch's agent ends: the exit barrier on success, then close the rendezvous."""
        self._finishing = True
        if state is GroupState.STOPPED or not self.needed:
            # Stopped here by an operator or a signal, or a surplus node the run
            # closed without: the others go on, or are done.
            return
        succeeded = state is GroupState.SUCCEEDED
        outcome = NodeState.SUCCEEDED if succeeded else NodeState.FAILED
        try:
            done = await self._call(Finish(barrier=succeeded), Done)
        except RendezvousError as e:
            log.warning("exit barrier of %s: %s", self.spec.name, e)
            return
        self._event("exit_barrier", f"done after {done.waited:.1f}s at the barrier", outcome)

    def restarts_left(self, local_left: int) -> int:
        return local_left

    def info(self) -> RendezvousInfo:
        placed = self.round
        return RendezvousInfo(
            backend="c10d",
            run_id=self.spec.rendezvous.run_id,
            round=placed.round if placed else None,
            group_rank=placed.group_rank if placed else -1,
            group_world_size=placed.group_world_size if placed else 0,
            waiting=self.waiting,
        )

    async def share(self, summary: bytes) -> Mapping[str, bytes]:
        """Write ours and read the other group ranks' keys, in the helper (its calls block)."""
        placed = self.round
        if placed is None or self._placing or self._finishing:
            return {}  # no round's store to write to (or, placing, the next one's rank)
        own = _SUMMARY_KEY.format(placed.group_rank)
        peers = [_SUMMARY_KEY.format(rank) for rank in range(placed.group_world_size)]
        request = Share(key=own, value=summary, peers=[key for key in peers if key != own])
        try:
            shared = await self._call(request, Shared)
        except RendezvousError as e:
            log.debug("straggler summaries of %s: %s", self.spec.name, e)
            return {}
        return shared.values
