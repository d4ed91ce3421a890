"""etcd for the rendezvous: typed calls on aetcd that ride out outages, and a watched mirror.

aetcd (asyncio, gRPC, etcd v3) is untyped; this module is the only one that
touches it. Every call goes through :meth:`EtcdStore.call`, which retries a
transient failure (etcd down, restarting, a reset stream, a call past its
timeout) with jittered exponential backoff, moving to the next endpoint each
time on a fresh channel, so gRPC's own reconnect backoff (which grows to
minutes) never decides how soon a restarted etcd is used again. An outage is
reported once when it starts and once when it ends, not on every retry.

:class:`Mirror` keeps a local copy of every key under one prefix (or of one
key), current through a single watch: waiting code sleeps on its changes
instead of polling. A broken watch stream is re-created from the last revision seen;
if etcd compacted that history away, the mirror re-reads the prefix whole,
so a change is never silently lost.
"""

from __future__ import annotations

import logging
import math
import random
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, NoReturn, TypeVar

import aetcd  # type: ignore[import-untyped]
import aetcd.rtypes  # type: ignore[import-untyped]
import anyio
import anyio.abc
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc
from aetcd.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ConnectionFailedError,
    ConnectionTimeoutError,
    RevisionCompactedError,
    WatchTimeoutError,
)
from aetcd.rpc import StatusCode  # type: ignore[import-untyped]

from watchdogd.core.rdzv_state import RendezvousConnectionError

__all__ = [
    "EtcdStore",
    "KeyValue",
    "Listing",
    "Mirror",
    "lease_not_found",
    "parse_endpoints",
]

log = logging.getLogger("watchdogd.etcd")

T = TypeVar("T")

_BACKOFF_MIN = 0.1
_BACKOFF_MAX = 2.0
_CLOSE_TIMEOUT = 1.0
_SETTLE = 0.1
# Short channel-level reconnect backoff, and pings that notice a dead peer
# (a cut cable sends no RST) within seconds; etcd refuses pings more often
# than every 5 s by default.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
# Codes that a restarting or unreachable etcd produces besides UNAVAILABLE and
# DEADLINE_EXCEEDED: a call cut off by a channel we closed, a reset stream.
_TRANSIENT_CODES = {StatusCode.CANCELLED, StatusCode.UNKNOWN, StatusCode.ABORTED}
_TRANSIENT_ERRORS = (
    ConnectionFailedError,
    ConnectionTimeoutError,
    WatchTimeoutError,  # the watch was not confirmed within the call timeout
    TimeoutError,  # our own per-call bound
)


class KeyValue(NamedTuple):
    value: bytes
    mod_revision: int


class Listing(NamedTuple):
    """Every key under the prefix (relative to it) as of ``revision``."""

    revision: int
    values: dict[str, KeyValue]


def parse_endpoints(value: str, default_port: int = 2379) -> list[tuple[str, int]]:
    """torchrun's ``--rdzv-endpoint HOST[:PORT][,…]`` (IPv6 as ``[ADDR]:PORT``) as pairs."""
    endpoints = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        if item.startswith("["):
            close = item.find("]") + 1
            host, rest = item[:close], item[close:]
            well_formed = close > 2 and rest[:1] in ("", ":")
            sep, port = rest[:1], rest[1:]
        else:
            host, sep, port = item.partition(":")
            well_formed = bool(host)
        if not well_formed or (sep and not port.isdigit()):
            raise ValueError(f"bad etcd endpoint {item!r}: expected HOST:PORT or [IPV6]:PORT")
        endpoints.append((host, int(port) if sep else default_port))
    if not endpoints:
        raise ValueError("no etcd endpoint given (--rdzv-endpoint HOST:PORT[,HOST:PORT…])")
    return endpoints


def lease_not_found(error: BaseException) -> bool:
    """etcd no longer knows the lease a call named (it expired)."""
    code = getattr(error.__cause__, "code", None)
    return isinstance(error, ClientError) and callable(code) and code() == StatusCode.NOT_FOUND


def _transient(error: BaseException) -> bool:
    if isinstance(error, _TRANSIENT_ERRORS):
        return True
    cause = error.__cause__
    code = getattr(cause, "code", None)
    return isinstance(error, ClientError) and callable(code) and code() in _TRANSIENT_CODES


class _Channel:
    """One aetcd client (one gRPC channel) and the calls running on it.

    gRPC cancels the calls still running on a channel being closed, and they
    raise asyncio's own ``CancelledError`` in their callers, which anyio
    takes for a cancellation of the caller itself: a task would end in
    silence. So a channel given up after a failure is only closed once idle.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.users = 0
        self.retired = False


class EtcdStore:
    """Calls on one etcd cluster for keys under ``prefix``, surviving outages."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        prefix: str,
        *,
        call_timeout: float,
        on_outage: Callable[[BaseException | None], None],
    ) -> None:
        self.endpoints = endpoints
        self.prefix = prefix.encode()
        self._call_timeout = call_timeout
        self._on_outage = on_outage
        self._index = 0
        self._channel: _Channel | None = None
        self._down = False
        self._lease_streams: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def _acquire(self) -> _Channel:
        if self._channel is None:
            host, port = self.endpoints[self._index]
            client = aetcd.Client(
                host=host, port=port, timeout=self._call_timeout, options=_CHANNEL_OPTIONS
            )
            self._channel = _Channel(client)
        self._channel.users += 1
        return self._channel

    async def _release(self, channel: _Channel) -> None:
        channel.users -= 1
        if channel.retired and channel.users == 0:
            await self._close(channel)

    @staticmethod
    async def _close(channel: _Channel) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
            await channel.client.close()

    async def aclose(self) -> None:
        """Close the channel, once the caller has stopped every task using this store.

        gRPC completes the calls that closing cancelled a moment later, on
        this event loop; it waits for that here, or those completions would
        reach a closed loop (``RuntimeError: Event loop is closed`` in a
        program that runs event loops in turn, such as a test suite).
        """
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.retired = True
            await self._close(channel)
            with anyio.CancelScope(shield=True):
                await anyio.sleep(_SETTLE)

    async def _failed(self, channel: _Channel, error: BaseException) -> None:
        """Report the outage (once); the next call uses the next endpoint, on a new channel."""
        if not self._down:
            self._down = True
            host, port = self.endpoints[self._index]
            log.warning("etcd at %s:%d unreachable (%s); retrying", host, port, error)
            self._on_outage(error)
        if channel is self._channel:
            self._index = (self._index + 1) % len(self.endpoints)
            self._channel = None
            channel.retired = True
            if channel.users == 0:
                await self._close(channel)

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            host, port = self.endpoints[self._index]
            log.warning("etcd at %s:%d reachable again", host, port)
            self._on_outage(None)

    async def call(
        self, op: Callable[[Any], Awaitable[T]], *, deadline: float = math.inf, what: str = ""
    ) -> T:
        """``await op(client)``, retried through transient failures until ``deadline``.

        Past ``deadline`` (monotonic) it raises :class:`RendezvousConnectionError`.
        Every op here is safe to repeat: a write whose reply was lost is
        found already done by the compare-and-swap that retries it.
        """
        delay = _BACKOFF_MIN
        while True:
            channel = self._acquire()
            try:
                with anyio.fail_after(self._call_timeout):
                    result = await op(channel.client)
            except Exception as e:
                if not _transient(e):
                    raise
                failure = e
            else:
                self._recovered()
                return result
            finally:
                await self._release(channel)
            if time.monotonic() + delay >= deadline:
                where = ",".join(f"{h}:{p}" for h, p in self.endpoints)
                raise RendezvousConnectionError(
                    f"etcd at {where} unreachable{' for ' + what if what else ''}: {failure}"
                ) from failure
            await self._failed(channel, failure)
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, _BACKOFF_MAX)

    # -- operations --------------------------------------------------------------

    async def read_all(self, name: str = "", *, deadline: float = math.inf) -> Listing:
        """Every key under the prefix (and under ``name`` in it), read at one revision."""
        key = self.key(name)
        found = await self.call(lambda c: c.get_prefix(key), deadline=deadline, what="read")
        skip = len(self.prefix)
        values = {kv.key[skip:].decode(): KeyValue(kv.value, kv.mod_revision) for kv in found}
        return Listing(found.header.revision, values)

    async def cas(
        self,
        name: str,
        mod_revision: int,
        value: bytes,
        *,
        lease: int = 0,
        deadline: float = math.inf,
    ) -> bool:
        """Write ``name`` if it is still at ``mod_revision`` (0: absent); True if written."""
        key = self.key(name)

        async def swap(client: Any) -> bool:
            ok, _ = await client.transaction(
                compare=[client.transactions.mod(key) == mod_revision],
                success=[client.transactions.put(key, value, lease=lease)],
                failure=[],
            )
            return bool(ok)

        return await self.call(swap, deadline=deadline, what=f"update of {name}")

    async def get(self, name: str, *, deadline: float = math.inf) -> KeyValue | None:
        key = self.key(name)
        found = await self.call(lambda c: c.get(key), deadline=deadline, what=f"read of {name}")
        return None if found is None else KeyValue(found.value, found.mod_revision)

    async def put(
        self, name: str, value: bytes, *, lease: int = 0, deadline: float = math.inf
    ) -> None:
        key = self.key(name)
        await self.call(lambda c: c.put(key, value, lease=lease), deadline=deadline, what=name)

    async def delete(self, name: str, *, deadline: float = math.inf) -> bool:
        """Delete ``name``; True if it was there (a repeat finds it gone: safe to retry)."""
        key = self.key(name)
        what = f"delete of {name}"
        found = await self.call(lambda c: c.delete(key), deadline=deadline, what=what)
        return found is not None

    async def create(
        self, name: str, value: bytes, *, lease: int, deadline: float = math.inf
    ) -> bool:
        """Write ``name`` on ``lease`` if it does not exist; True if written."""
        return await self.cas(name, 0, value, lease=lease, deadline=deadline)

    async def grant(self, ttl: int, *, deadline: float = math.inf) -> tuple[int, float]:
        """A new lease, and when the attempt that got it was sent (monotonic): its TTL
        runs on etcd from some moment after that."""

        async def lease(client: Any) -> tuple[int, float]:
            sent = time.monotonic()
            return int((await client.lease(ttl)).id), sent

        return await self.call(lease, deadline=deadline, what="lease")

    async def refresh(self, lease: int) -> tuple[int, float]:
        """Keep ``lease`` alive: its remaining TTL (0 when etcd no longer knows it), and
        when the attempt that renewed it was sent (monotonic).

        Renewals share one keep-alive stream per channel, as etcd's own client
        does: opening a stream per renewal costs the client more than the
        renewal itself, which counts with a thousand nodes on one machine.
        """

        async def keep_alive(client: Any) -> tuple[int, float]:
            stream = self._lease_streams.get(client)
            if stream is None:
                await client.connect()
                stream = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
                self._lease_streams[client] = stream
            try:
                sent = time.monotonic()
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease))
                reply = await stream.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionFailedError("keep-alive stream closed without a reply")
            except BaseException as e:
                del self._lease_streams[client]
                stream.cancel()
                if isinstance(e, grpc.aio.AioRpcError):
                    raise ConnectionFailedError(e.details()) from e
                raise
            return int(reply.TTL), sent

        return await self.call(keep_alive, what="lease keep-alive")

    async def revoke(self, lease: int, *, deadline: float) -> None:
        """Drop ``lease`` (and its keys); one that already expired is dropped already."""
        try:
            await self.call(lambda c: c.revoke_lease(lease), deadline=deadline, what="lease revoke")
        except ClientError as e:
            if not lease_not_found(e):
                raise

    async def follow(
        self,
        start_revision: int,
        apply: Callable[[str, bytes | None, int], None],
        *,
        name: str = "",
        prefix: bool = True,
        deletes_only: bool = False,
    ) -> NoReturn:
        """Call ``apply(name, value or None when deleted, revision)`` for every change, forever.

        Watches the keys under ``name`` (the whole prefix by default), or the
        key ``name`` alone; with ``deletes_only`` etcd sends deletions only.
        A stream that breaks (or ends) is re-created from the revision after
        the last one applied. Raises :class:`RevisionCompactedError` when etcd
        no longer has that history.
        """
        revision = start_revision - 1
        skip = len(self.prefix)
        key = self.key(name)
        kind = aetcd.rtypes.EventKind.DELETE if deletes_only else None
        watch_call = "watch_prefix" if prefix else "watch"
        delay = _BACKOFF_MIN
        while True:
            channel = self._acquire()
            failure: Exception | None = None
            try:
                with anyio.fail_after(self._call_timeout):
                    watch = await getattr(channel.client, watch_call)(
                        key, start_revision=revision + 1, kind=kind
                    )
                self._recovered()
                delay = _BACKOFF_MIN
                try:
                    async for event in watch:
                        deleted = event.kind == "DELETE"
                        revision = event.kv.mod_revision
                        value = None if deleted else event.kv.value
                        apply(event.kv.key[skip:].decode(), value, revision)
                finally:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                        await watch.cancel()
                log.info("etcd watch ended; re-creating it from revision %d", revision + 1)
            except RevisionCompactedError:
                raise
            except Exception as e:
                if not _transient(e):
                    raise
                failure = e
            finally:
                await self._release(channel)
            if failure is not None:
                await self._failed(channel, failure)
                await anyio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, _BACKOFF_MAX)


class Mirror:
    """Every key under the store's prefix (and ``name`` in it), as of ``revision``,
    kept current by a watch; keys under ``ignore`` are neither kept nor waited for."""

    def __init__(self, name: str = "", *, ignore: str | None = None) -> None:
        self.name = name
        self.ignore = ignore
        self.values: dict[str, KeyValue] = {}
        self.changed: set[str] = set()
        """Names changed (or deleted) since the reader last cleared this set."""
        self.revision = 0
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _apply(self, name: str, value: bytes | None, revision: int) -> None:
        if self.ignore is not None and name.startswith(self.ignore):
            return
        if value is None:
            self.values.pop(name, None)
        else:
            self.values[name] = KeyValue(value, revision)
        self.changed.add(name)
        self.revision = max(self.revision, revision)
        self._notify()

    async def run(
        self,
        store: EtcdStore,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Read the prefix, report started, then follow it (re-reading it after a compaction)."""
        while True:
            listing = await store.read_all(self.name)
            values = listing.values
            if self.ignore is not None:
                values = {k: v for k, v in values.items() if not k.startswith(self.ignore)}
            self.changed.update(self.values, values)
            self.values = values
            self.revision = max(self.revision, listing.revision)
            self._notify()
            task_status.started()
            task_status = anyio.TASK_STATUS_IGNORED
            try:
                await store.follow(listing.revision + 1, self._apply, name=self.name)
            except RevisionCompactedError as e:
                log.warning("etcd compacted the watched history (%s); re-reading", e)

    async def wait_past(self, revision: int) -> None:
        """Return once the mirror has seen a change newer than ``revision``."""
        while self.revision <= revision:
            await self._changed.wait()
