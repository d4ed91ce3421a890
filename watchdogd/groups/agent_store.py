"""The job's store on ``MASTER_PORT``, hosted outside the ranks (torchrun's agent store).

Without it, rank 0's ``init_process_group`` hosts the ``TCPStore`` that
every rank uses, and the store dies with rank 0 — often before the others
are done with it. torchrun's agent hosts it instead and tells the workers
so (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank is a client).

Here a torch helper hosts it, run with the workers' interpreter (which has
torch whenever the workers use ``torch.distributed``):

- the daemon binds the port itself, at once, and hands the socket over, so
  the port is known (and taken) before any worker starts; the workers do
  not wait for torch's import: their clients retry until the store listens;
- no torch in that interpreter, or the port taken: no agent store, and
  ``TORCHELASTIC_USE_AGENT_STORE=False`` (rank 0 hosts, as before);
- the helper failing later (a broken torch) is reported by :meth:`serving`,
  so that the attempt can be started again without it;
- each attempt after the first gets an empty store on the same socket
  (:meth:`renew`), as torch's agent makes a new one for every round;
- in a process that had imported torch already (``watchdogd.launcher``
  under a caller that uses torch), the store is served from that process
  (:class:`LocalAgentStore`), as torch's own agent serves it.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

import anyio

from watchdogd.groups.helper_process import HelperError, TorchHelper
from watchdogd.groups.torch_helper import serve_tcp_store
from watchdogd.groups.torch_wire import Hosting, HostStore
from watchdogd.linux.net import bind_any

__all__ = ["AgentStore", "LocalAgentStore", "RoundStores"]

log = logging.getLogger("watchdogd.rendezvous")


class AgentStore:
    def __init__(self, helper: TorchHelper, fd: int, port: int) -> None:
        self.helper = helper
        self.fd = fd
        """The listening socket's descriptor in the helper (pass_fds keeps its number)."""
        self.port = port

    @classmethod
    async def start(cls, python: str | None, port: int) -> AgentStore | LocalAgentStore | None:
        """Host the store on ``port`` (0: a free one); None when it cannot be done here."""
        try:
            sock = bind_any(port)
        except OSError as e:
            log.warning("port %d: %s; the job's store stays with rank 0", port, e.strerror)
            return None
        if "torch" in sys.modules:
            # torch's launch API, called by a process that already uses torch: host it
            # here, as torch's agent does, rather than import torch once more beside
            # the workers (the daemon itself never imports torch for this).
            return await LocalAgentStore.start(sock)
        # The helper holds its own copy of the socket from its first instant.
        with sock:
            port = sock.getsockname()[1]
            helper = TorchHelper(python, pass_fds=[sock.fileno()])
            try:
                ready = await helper.start()
                if ready.torch:
                    await helper.send(HostStore(fd=sock.fileno(), port=port))
                    return cls(helper, sock.fileno(), port)
            except HelperError as e:
                log.warning("the job's store stays with rank 0: %s", e)
            except BaseException:
                await helper.aclose()
                raise
        await helper.aclose()
        return None

    async def serving(self) -> bool:
        """Wait for the store to serve: False (reported) when the helper could not."""
        try:
            await self.helper.receive(Hosting)
        except HelperError as e:
            log.warning("the job's store could not start; it goes to rank 0: %s", e)
            return False
        return True

    async def renew(self) -> bool:
        """An empty store for the next attempt, on the same port, as torch's agent makes
        one per round: keys of the last attempt's ranks (their addresses) would mislead
        the new ones. False (reported) when the helper could not."""
        try:
            await self.helper.call(HostStore(fd=self.fd, port=self.port), Hosting)
        except HelperError as e:
            log.warning("the job's store could not be renewed; it goes to rank 0: %s", e)
            return False
        return True

    async def aclose(self) -> None:
        await self.helper.aclose()


class LocalAgentStore:
    """The job's store served from this process, which had imported torch already.

    A ``TCPStore`` serves from threads of its own; making and dropping one
    (a millisecond) is done off the loop all the same.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self._store: Any = None

    @classmethod
    async def start(cls, sock: socket.socket) -> LocalAgentStore:
        store = cls(sock)
        await store.renew()
        return store

    def _host(self) -> None:
        self._store = None  # the last attempt's, dropped first: the new one is empty
        self._store = serve_tcp_store(self.port, self.sock.fileno())

    async def serving(self) -> bool:
        return True

    async def renew(self) -> bool:
        await anyio.to_thread.run_sync(self._host)
        return True

    async def aclose(self) -> None:
        def drop() -> None:
            self._store = None
            self.sock.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(drop)


class RoundStores:
    """An empty store for each etcd round this node asks for, on a port made for it.

    Without one, rank 0's process hosts the job's store in
    ``init_process_group``; the other ranks, often up first (warm spares),
    find nothing listening, and torch's client backs off 0.25-0.75 s before
    it knocks again: the new process group's 0.5-0.8 s after every restart in
    the goodput record. Here the agent hosts one before it asks for the
    round, so whichever node gets rank 0 has a store listening before any
    worker starts, and every rank is its client
    (``TORCHELASTIC_USE_AGENT_STORE=True``), as under torchrun's agent.

    Each round gets a new port: a store is advertised only in the round it
    was made for, so no worker of an earlier round, however late it dies,
    writes into the next round's store. The helper starts and imports torch
    in the background (:meth:`run`); a round asked for meanwhile goes
    without (rank 0 hosts), and so do all once the helper failed, or when
    the workers' interpreter has no torch.
    """

    def __init__(self, python: str | None) -> None:
        self.helper = TorchHelper(python)
        self._ready = anyio.Event()
        self._usable = False

    async def run(self) -> None:
        """Start the helper and have it import torch (seconds), by serving a first store."""
        try:
            if (await self.helper.start()).torch:
                await self.helper.call(HostStore(), Hosting)  # torch imported, a store served
                self._usable = True
        except HelperError as e:
            log.warning("the job's store stays with rank 0: %s", e)
        finally:
            self._ready.set()

    async def next_port(self) -> int | None:
        """The port of an empty store for the round about to be asked for; None while the
        helper starts, or once it failed (rank 0 hosts)."""
        if not (self._ready.is_set() and self._usable):
            return None
        try:  # a new one each time, also proof that the helper still serves
            return (await self.helper.call(HostStore(), Hosting)).port
        except HelperError as e:
            self._usable = False
            log.warning("the job's store goes to rank 0 from now on: %s", e)
            return None

    async def ready_port(self) -> int | None:
        """:meth:`next_port`, once the helper has started."""
        await self._ready.wait()
        return await self.next_port()

    async def aclose(self) -> None:
        await self.helper.aclose()
