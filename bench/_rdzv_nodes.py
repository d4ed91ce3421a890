"""Simulated nodes for ``bench_rendezvous.py``: many rendezvous participants in one process.

Each node process runs ``count`` participants of one backend and no workers:

- ``ours``: :class:`~watchdogd.groups.etcd_rendezvous.EtcdRendezvous` objects,
  all on one anyio loop (uvloop), each with its own etcd channel, lease and
  watch, as separate machines would have;
- ``torch``: ``DynamicRendezvousHandler`` objects from torch's registry
  (``c10d`` backend, a client of the bench's ``TCPStore``), each in its own
  thread because ``next_rendezvous()`` blocks; the handler's own heartbeat
  timer thread runs beside it.

Each participant loops as an agent does: rendezvous, then "run" until the
membership changes, then rendezvous again. Ours learns of a change from its
watch (``wait_for_membership_change``); torch's agent polls
``num_nodes_waiting()`` every ``monitor_interval`` (torchrun's default 0.1 s)
and hears of a failed peer only through its workers, which the bench plays
by sending ``fail`` to every node process the moment it kills one.

The control pipe carries commands from the bench (``("join", at)``,
``("fail",)``, ``("counts",)``, ``("stop",)``) and batches of reports back,
each a tuple ``(kind, node, monotonic time, *details)``: ``ready``, ``called``
(``next_rendezvous`` entered), ``joined`` (ours: the join was written),
``round`` (round, rank, world size), ``change`` (why the round ended),
``error``, ``event`` (ours: its own lease expired, it fenced itself, etcd
unreachable, it stands by beside a full round),
``counts`` (torch: store calls so far), ``fatal``, ``stopped``.
Times are ``time.monotonic()``, one clock for every process on the machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

Report = tuple[Any, ...]

__all__ = ["NodeSettings", "node_process", "store_host"]

_FLUSH_INTERVAL = 0.02
# How our participant says its own lease expired under it (it was starved or
# cut off): the bench counts those, self-fencing (no renewal for TTL - margin)
# and calls that found etcd unreachable.
_OWN_LEASE_EXPIRED = "lease expired while cut off from etcd; re-registering"


@dataclass(frozen=True)
class NodeSettings:
    """What every participant of one run is configured with (both backends)."""

    backend: str  # "ours" or "torch"
    endpoint: str  # etcd's client address, or the TCPStore's
    run_id: str
    min_nodes: int
    max_nodes: int
    last_call: int  # seconds; torch's last_call_timeout takes whole seconds
    join_timeout: int
    lease_ttl: int  # ours: the lease TTL
    keep_alive_interval: int  # torch: seconds between heartbeats
    keep_alive_attempts: int  # torch: missed heartbeats before a node is dead
    monitor_interval: float  # torch: the agent's num_nodes_waiting() poll
    register_concurrency: int = 16  # ours: registrations in flight per process
    # torch: share the rendezvous TCPStore with the job (torch's default). With
    # it, a node arriving in a later round blocks in next_rendezvous(): it
    # reads MASTER_ADDR under the new round's prefix, which a rank 0 that was
    # rank 0 before never writes again (torch 2.13).
    torch_shared_store: bool = False


def node_process(
    conn: multiprocessing.connection.Connection,
    settings: NodeSettings,
    first: int,
    count: int,
    deferred: bool,
) -> None:
    """Run participants ``first`` … ``first + count - 1`` until told to stop.

    ``deferred``: create (and register) them only on ``join``, so that an
    arriving node's time includes joining the store, as a new machine's does.
    """
    try:
        if settings.backend == "ours":
            from watchdogd.linux import aio

            aio.run(partial(_ours_main, conn, settings, first, count, deferred))
        else:
            _torch_main(conn, settings, first, count, deferred)
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send([("fatal", None, time.monotonic(), _describe(e))])
    # Blocked handler threads (torch) never return: leave without joining them.
    os._exit(0)


def store_host(conn: multiprocessing.connection.Connection) -> None:
    """Host the TCPStore torch's participants share (its own process: its CPU is measured)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    conn.send(store.port)
    with contextlib.suppress(EOFError, OSError):
        conn.recv()


# -- ours ----------------------------------------------------------------------


class _Outbox:
    """Reports collected on the loop and sent in batches from a thread (a pipe write can block)."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn
        self._items: list[Report] = []

    def put(self, item: Report) -> None:
        self._items.append(item)

    async def flush(self) -> None:
        import anyio.to_thread

        if self._items:
            batch, self._items = self._items, []
            await anyio.to_thread.run_sync(self._conn.send, batch)

    async def run(self) -> None:
        import anyio

        while True:
            await anyio.sleep(_FLUSH_INTERVAL)
            await self.flush()


async def _ours_main(
    conn: multiprocessing.connection.Connection,
    settings: NodeSettings,
    first: int,
    count: int,
    deferred: bool,
) -> None:
    import anyio
    import anyio.to_thread

    outbox = _Outbox(conn)
    start = anyio.Event()
    start_at: list[float] = [0.0]
    pending = [count]
    limiter = anyio.CapacityLimiter(settings.register_concurrency)

    def registered() -> None:
        pending[0] -= 1
        if pending[0] == 0:
            outbox.put(("ready", None, time.monotonic()))

    if deferred:
        outbox.put(("ready", None, time.monotonic()))
    async with anyio.create_task_group() as tg:
        tg.start_soon(outbox.run)
        for index in range(first, first + count):
            tg.start_soon(
                _ours_node, index, settings, limiter, start, start_at, outbox, registered, deferred
            )
        while True:
            command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
            if command[0] == "join":
                start_at[0] = command[1]
                start.set()
            elif command[0] == "stop":
                # Each participant revokes its lease on the way out (shielded, bounded).
                tg.cancel_scope.cancel()
                break
    outbox.put(("stopped", None, time.monotonic()))
    await outbox.flush()


async def _ours_node(
    index: int,
    settings: NodeSettings,
    limiter: Any,
    start: Any,
    start_at: list[float],
    outbox: _Outbox,
    registered: Any,
    deferred: bool,
) -> None:

    from watchdogd.groups.etcd_rendezvous import EtcdRendezvous, RendezvousError

    def on_event(event: Any) -> None:
        if event.name == "join":
            outbox.put(("joined", index, time.monotonic()))
        elif event.name in ("etcd_unavailable", "fenced", "standby"):
            outbox.put(("event", index, time.monotonic(), event.name, event.message))
        elif event.name == "node_lost" and event.message.endswith(_OWN_LEASE_EXPIRED):
            # node_lost also reports a lost peer; this one is the node's own lease
            outbox.put(("event", index, time.monotonic(), "own_lease_expired", event.message))

    rdzv = EtcdRendezvous(
        [settings.endpoint], settings.run_id, settings.min_nodes, settings.max_nodes,
        node_name=f"n{index}", advertise_addr="127.0.0.1", lease_ttl=settings.lease_ttl,
        last_call=settings.last_call, join_timeout=settings.join_timeout, on_event=on_event,
    )  # fmt: skip
    try:
        await _ours_rounds(rdzv, index, limiter, start, start_at, outbox, registered, deferred)
    except RendezvousError as e:
        outbox.put(("error", index, time.monotonic(), f"{type(e).__name__}: {e}"))
    except Exception as e:
        # One machine's failure, not its process's: the other participants go on,
        # and the bench learns what happened to this one.
        outbox.put(("error", index, time.monotonic(), _describe(e)))


async def _ours_rounds(
    rdzv: Any,
    index: int,
    limiter: Any,
    start: Any,
    start_at: list[float],
    outbox: _Outbox,
    registered: Any,
    deferred: bool,
) -> None:
    import anyio

    async with AsyncExitStack() as stack:
        if not deferred:
            async with limiter:
                await stack.enter_async_context(rdzv)
            registered()
        await start.wait()
        await anyio.sleep(max(0.0, start_at[0] - time.monotonic()))
        if deferred:
            await stack.enter_async_context(rdzv)
        port = 20000 + index % 40000  # published, never listened on: no workers here
        while True:
            outbox.put(("called", index, time.monotonic()))
            result = await rdzv.next_rendezvous(master_port=port)
            outbox.put(
                ("round", index, time.monotonic(), result.round, result.group_rank,
                 result.group_world_size)
            )  # fmt: skip
            change = await rdzv.wait_for_membership_change()
            outbox.put(("change", index, time.monotonic(), change))
            if change == "closed":
                return


def _describe(error: BaseException) -> str:
    """An exception (a group: each distinct leaf, counted) and where the first one came from."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(error)
    kinds = Counter(f"{type(e).__module__}.{type(e).__name__}: {e}" for e in leaves)
    summary = "; ".join(f"{count} x {kind}" for kind, count in kinds.most_common())
    where = "".join(traceback.format_exception(leaves[0])[-6:]) if leaves else ""
    # What the first one interrupted (a failed clean-up hides the failure it was for).
    causes, cause = [], leaves[0].__context__ if leaves else None
    while cause is not None and len(causes) < 4:
        causes.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__context__
    during = f"\nwhile handling: {' <- '.join(causes)}" if causes else ""
    return f"{summary}{during}\n{where}"


# -- torch ---------------------------------------------------------------------


class _Counters:
    """torch's store calls (by operation) and the bytes they carried, from every thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def add(self, op: str, size: int) -> None:
        with self._lock:
            self.calls[op] += 1
            self.bytes[op] += size

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


class _ThreadOutbox:
    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._items: list[Report] = []
        threading.Thread(target=self._run, name="outbox", daemon=True).start()

    def put(self, item: Report) -> None:
        with self._lock:
            self._items.append(item)

    def flush(self) -> None:
        with self._lock:
            batch, self._items = self._items, []
        if batch:
            self._conn.send(batch)

    def _run(self) -> None:
        while True:
            time.sleep(_FLUSH_INTERVAL)
            self.flush()


def _size(value: object) -> int:
    return len(value) if isinstance(value, str | bytes) else 0


def _torch_handler(settings: NodeSettings, counters: _Counters) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend="c10d", endpoint=settings.endpoint, run_id=settings.run_id,
        min_nodes=settings.min_nodes, max_nodes=settings.max_nodes, local_addr="127.0.0.1",
        is_host=False, join_timeout=settings.join_timeout,
        last_call_timeout=settings.last_call, keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_attempts, read_timeout=300,
    )  # fmt: skip
    handler = get_rendezvous_handler(params)
    # Count every call the rendezvous makes on its store, with what it sent and
    # got back: a TCPStore keeps no request counters of its own. This reaches
    # into torch's private attributes (the state holder's backend), for counting only.
    backend = handler._state_holder._backend
    call = backend._call_store

    def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        value = call(op, *args, **kwargs)
        counters.add(op, sum(_size(a) for a in args) + _size(value))
        return value

    backend._call_store = counted
    return handler


def _torch_main(
    conn: multiprocessing.connection.Connection,
    settings: NodeSettings,
    first: int,
    count: int,
    deferred: bool,
) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousError

    if not settings.torch_shared_store:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    outbox = _ThreadOutbox(conn)
    counters = _Counters()
    handlers: dict[int, Any] = {}
    if not deferred:
        for index in range(first, first + count):
            handlers[index] = _torch_handler(settings, counters)
    outbox.put(("ready", None, time.monotonic()))
    # Bumped by "fail": every running participant's workers "failed" at once.
    failures = [0]

    def node(index: int, at: float) -> None:
        try:
            run_node(index, at)
        except Exception:  # a thread's exception would otherwise only reach stderr
            outbox.put(("error", index, time.monotonic(), traceback.format_exc()))

    def run_node(index: int, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        handler = handlers.get(index) or _torch_handler(settings, counters)
        while True:
            outbox.put(("called", index, time.monotonic()))
            try:
                info = handler.next_rendezvous()
            except RendezvousError as e:
                outbox.put(("error", index, time.monotonic(), f"{type(e).__name__}: {e}"))
                return
            outbox.put(("round", index, time.monotonic(), None, info.rank, info.world_size))
            seen = failures[0]
            while True:  # the agent's monitor loop
                if failures[0] != seen:
                    change = "lost"
                    break
                if handler.num_nodes_waiting() > 0:
                    change = "waiting"
                    break
                time.sleep(settings.monitor_interval)
            outbox.put(("change", index, time.monotonic(), change))

    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command[0] == "join":
            for index in range(first, first + count):
                threading.Thread(
                    target=node, args=(index, command[1]), name=f"node-{index}", daemon=True
                ).start()
        elif command[0] == "fail":
            failures[0] += 1
        elif command[0] == "counts":
            outbox.put(("counts", None, time.monotonic(), counters.snapshot()))
        elif command[0] == "stop":
            outbox.put(("stopped", None, time.monotonic()))
            outbox.flush()
            return
