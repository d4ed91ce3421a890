"""The torch helper: torch's own agent code, in a process of its own.

Run as ``PYTHON -m watchdogd.groups.torch_helper`` by the daemon, with the
workers' interpreter: torch's rendezvous calls block, torch is a large
import, and its threads would hold the daemon's GIL — so none of it runs in
the daemon. It answers the requests of :mod:`watchdogd.groups.torch_wire`,
one at a time, blocking as torch's agent does:

- ``HostStore``: serve the job's ``TCPStore`` on the socket the daemon
  bound, or on a port of its own (torchrun's agent store,
  ``TORCHELASTIC_USE_AGENT_STORE=True``), so the store outlives every rank;
  asked again, an empty one instead;
- ``Open`` / ``NextRound`` / ``Poll`` / ``Finish``: the c10d rendezvous,
  through the handler torch's registry builds for torchrun's flags and a
  ``LocalElasticAgent`` whose ``_rendezvous`` and ``_exit_barrier`` are the
  ones torchrun runs — role and rank assignment, the master address and
  port, the store rank 0's agent hosts for the workers, the exit barrier —
  so a torchrun node and this one share one job. The agent never starts a
  worker: the daemon does;
- ``LoadLogsSpecs`` / ``Reify``: a ``--logs-specs`` class of the user's,
  made as torchrun makes it and asked, each attempt, where the logs go;
- ``Share``: one key written and the other nodes' read in the round's
  store (the ``PrefixStore`` torch's rendezvous hands its agent), for the
  daemon's straggler summaries.

It needs msgspec and torch; it imports torch only when asked to use it,
and dies with the daemon (the kernel's parent-death signal). Its stdout is
stderr from the start, so nothing torch prints can break a reply frame.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any

import msgspec

from watchdogd.core.workerenv import LogsDest
from watchdogd.groups.torch_wire import (
    MAX_FRAME,
    Done,
    Failed,
    Finish,
    Hosting,
    HostStore,
    LoadLogsSpecs,
    NextRound,
    Open,
    Opened,
    Poll,
    Polled,
    Ready,
    Reified,
    Reify,
    Reply,
    Request,
    Round,
    Share,
    Shared,
)
from watchdogd.linux.enter_cell import die_with_parent
from watchdogd.linux.net import bind_any
from watchdogd.linux.plugins import LOGS_SPECS_GROUP, load_entry_point, not_found
from watchdogd_client.framing import FrameSplitter, frame

# How long a node that closed the run keeps its store up for the nodes beyond
# max_nodes: two of their syncs, one a second (torch's), with room for a busy host.
_SURPLUS_SYNC = 2.5

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Request)


def _describe(error: BaseException) -> str:
    """The error and its causes: torch's say "see inner exception" and the inner one says why."""
    parts = []
    seen: BaseException | None = error
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}" if str(seen) else type(seen).__name__)
        seen = seen.__cause__
    return " <- ".join(parts)


def _failure(error: Exception) -> Failed:
    if isinstance(error, ImportError):
        return Failed(kind="torch", message=_describe(error))
    from torch.distributed.elastic.rendezvous import api

    kind: Any = "error"
    if isinstance(error, api.RendezvousGracefulExitError):
        kind = "graceful"
    elif isinstance(error, api.RendezvousClosedError):
        kind = "closed"
    elif isinstance(error, api.RendezvousTimeoutError):
        kind = "timeout"
    elif isinstance(error, api.RendezvousConnectionError):
        kind = "connection"
    return Failed(kind=kind, message=_describe(error))


def serve_tcp_store(port: int, listen_fd: int) -> Any:
    """The job's ``TCPStore``, listening on ``listen_fd``, a socket already bound to ``port``.

    Workers may be knocking already. torch listens on a copy of the socket, so
    that the next attempt's store can listen on it too once this one is dropped;
    its own client reaches it over loopback. Imports torch: call it where that
    is allowed (the helper, or a process that imported torch already).
    """
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=os.dup(listen_fd),
    )


class _Helper:
    def __init__(self) -> None:
        self.store: Any = None
        self.agent: Any = None
        self.members: set[Any] = set()
        self.logs_specs: Any = None

    def handle(self, request: Request) -> Reply:
        try:
            match request:
                case HostStore():
                    return self.host_store(request)
                case Open():
                    return self.open(request)
                case NextRound(restart_count=restart_count):
                    return self.next_round(restart_count)
                case Poll():
                    return self.poll()
                case Finish(barrier=barrier):
                    return self.finish(barrier)
                case LoadLogsSpecs():
                    return self.load_logs_specs(request)
                case Reify(envs=envs):
                    return self.reify(envs)
                case Share():
                    return self.share(request)
        except Exception as e:
            return _failure(e)

    def host_store(self, request: HostStore) -> Hosting:
        self.store = None  # the last attempt's, dropped first: the new one is empty
        if request.fd is not None:
            self.store = serve_tcp_store(request.port, request.fd)
        else:
            with bind_any(0) as sock:
                self.store = serve_tcp_store(sock.getsockname()[1], sock.fileno())
        return Hosting(port=self.store.port)

    def open(self, request: Open) -> Opened:
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        params = RendezvousParameters(
            backend="c10d",
            endpoint=request.endpoint,
            run_id=request.run_id,
            min_nodes=request.min_nodes,
            max_nodes=request.max_nodes,
            local_addr=request.local_addr,
            **request.conf,
        )
        spec = WorkerSpec(
            role=request.role,
            local_world_size=request.nproc,
            rdzv_handler=get_rendezvous_handler(params),
            entrypoint=request.entrypoint,
            max_restarts=request.max_restarts,
            monitor_interval=request.monitor_interval,
            local_addr=request.local_addr,
        )
        self.agent = LocalElasticAgent(
            spec,
            DefaultLogsSpecs(log_dir=os.devnull),  # the daemon keeps the logs
            exit_barrier_timeout=request.exit_barrier_timeout,
        )
        return Opened()

    @property
    def _state(self) -> Any:
        # The round and its members: torch's handler keeps them in its state
        # holder and offers no public accessor.
        return self.agent.get_worker_group().spec.rdzv_handler._state_holder.state

    def next_round(self, restart_count: int) -> Round:
        group = self.agent.get_worker_group()
        # torch counts restarts per agent: its log of the round says this one.
        self.agent._remaining_restarts = group.spec.max_restarts - restart_count
        self.agent._rendezvous(group)
        state = self._state
        self.members = set(state.participants)
        first = group.workers[0]
        return Round(
            round=state.round,
            group_rank=group.group_rank,
            group_world_size=group.group_world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            first_rank=first.global_rank,
            world_size=first.world_size,
            role_first_rank=first.role_rank,
            role_world_size=first.role_world_size,
            use_agent_store=group.spec.rdzv_handler.use_agent_store,
        )

    def poll(self) -> Polled:
        handler = self.agent.get_worker_group().spec.rdzv_handler
        waiting = handler.num_nodes_waiting()  # syncs the state and drops the dead
        state = self._state
        present = set(state.participants) | state.wait_list | state.redundancy_list
        return Polled(
            waiting=waiting,
            closed=state.closed,
            missing=sorted(str(node) for node in self.members - present),
        )

    def finish(self, barrier: bool) -> Done:
        started = time.monotonic()
        if barrier:
            self.agent._exit_barrier()  # torch's: logs a timeout, never raises one
        waited = time.monotonic() - started
        self.agent.get_worker_group().spec.rdzv_handler.shutdown()
        if self._state.redundancy_list:
            # Nodes beyond max_nodes learn of the close at their next sync (torch's:
            # every second), and leave with RendezvousGracefulExitError; the store this
            # node may host must outlive that, or they fail on a closed socket instead.
            time.sleep(_SURPLUS_SYNC)
        return Done(waited=waited)

    def load_logs_specs(self, request: LoadLogsSpecs) -> Opened:
        from torch.distributed.elastic.multiprocessing import Std

        cls: Any = load_entry_point(LOGS_SPECS_GROUP, request.name)
        if cls is None:
            raise LookupError(not_found(LOGS_SPECS_GROUP, request.name))
        ranks = request.local_ranks_filter
        self.logs_specs = cls(
            log_dir=request.log_dir,
            redirects=Std.from_str(request.redirects),
            tee=Std.from_str(request.tee),
            local_ranks_filter=set(ranks) if ranks is not None else None,
        )
        return Opened()

    def reify(self, envs: dict[int, dict[str, str]]) -> Reified:
        dest = self.logs_specs.reify(envs)  # may set variables in envs, as torch's does
        return Reified(dest=msgspec.convert(dest, LogsDest, from_attributes=True), envs=envs)

    def share(self, request: Share) -> Shared:
        store = self.agent.get_worker_group().store
        store.set(request.key, request.value)
        # get() waits for a missing key (a node that has not published yet): check first.
        found = [key for key in request.peers if store.check([key])]
        values = store.multi_get(found) if found else []
        return Shared(values=dict(zip(found, values, strict=True)))


def _send(fd: int, reply: Reply) -> None:
    data = frame(_encoder.encode(reply))
    while data:
        data = data[os.write(fd, data) :]


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    has_torch = importlib.util.find_spec("torch") is not None
    _send(replies, Ready(torch=has_torch, python=sys.executable))
    helper = _Helper()
    splitter = FrameSplitter(MAX_FRAME)
    while chunk := os.read(requests, 65536):
        for payload in splitter.feed(chunk):
            _send(replies, helper.handle(_decoder.decode(payload)))


if __name__ == "__main__":
    main()
