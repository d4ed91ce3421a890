"""Starting an attempt's workers: their environments, log streams, processes and copiers.

Every worker gets torchrun's environment (:func:`~watchdogd.core.workerenv.worker_env`)
plus what the group's features add, its streams where the group's
:class:`~watchdogd.groups.logs_specs.LogLayout` sends them, and torch's error
file. Workers start in the order of their local ranks, each in its own
session (see :mod:`watchdogd.groups.child`), and the group stops them in the
reverse order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio

from watchdogd.core.flight_recorder import Recorder, recorder_paths, trace_servers
from watchdogd.core.ports import EventSink, GroupError, SupervisedWorker
from watchdogd.core.workerenv import Placement, StreamRoute, log_prefix, worker_env
from watchdogd.groups.containment import AttemptCells
from watchdogd.groups.features import CpuBinding, Feature
from watchdogd.groups.logs_specs import LogLayout, Routes
from watchdogd.groups.starters import Started, WorkerStarter
from watchdogd.groups.worker_logs import StreamCopier, Target, open_target, start_copier
from watchdogd.groups.workers import Endpoints, Metadata, Worker, WorkerIndex
from watchdogd_client.groups import GroupSpec

__all__ = ["AttemptLauncher"]


class AttemptLauncher:
    """Starts each attempt's workers for one group; the copiers of their output stay here."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        events: EventSink,
        endpoints: Endpoints,
        index: WorkerIndex,
        starter: WorkerStarter,
        logs: LogLayout,
        binding: CpuBinding,
        cells: AttemptCells,
        features: list[Feature],
        gpus: dict[int, str | None],
        run_dir: Path,
        hostname: str,
    ) -> None:
        self.spec = spec
        self.events = events
        self.endpoints = endpoints
        self.index = index
        self.starter = starter
        self.logs = logs
        self.binding = binding
        self.cells = cells
        self.features = features
        self.gpus = gpus
        self.run_dir = run_dir
        self.hostname = hostname
        self.copiers: list[StreamCopier] = []

    async def start(
        self,
        attempt: int,
        restart_count: int,
        placement: Placement,
        workers: dict[int, Worker],
        on_exit: Callable[[Worker], None],
    ) -> None:
        """Start every rank into ``workers`` (so those started are there if one cannot be:
        GroupError); ``on_exit(worker)`` from the loop when one exits."""
        base = dict(os.environ)
        envs = await self._environments(attempt, restart_count, placement, base)
        routes = await self.logs.routes(attempt, envs, base)
        # Off the loop: a log directory on NFS may take its time.
        targets = await anyio.to_thread.run_sync(self._open_logs, envs, routes)
        about: Metadata = {
            "group": self.spec.name,
            "run_id": self.spec.rendezvous.run_id,
            "group_rank": placement.group_rank,
            "role": self.spec.role,
            "hostname": self.hostname,
            "attempt": attempt,
        }
        try:
            for local_rank, env in envs.items():
                rank = placement.rank(local_rank, self.spec.nproc)
                opened = targets.pop(local_rank)
                started = await self._spawn(local_rank, attempt, env, opened)
                self.cells.join(started.cell)
                worker = Worker(
                    local_rank,
                    rank,
                    attempt,
                    started.process,
                    started.cell,
                    error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
                    about={**about, "global_rank": rank, "local_rank": local_rank},
                )
                self._copy_output(
                    worker, routes[local_rank], opened, (started.stdout, started.stderr)
                )
                workers[local_rank] = worker
                spec = self.spec
                supervised = SupervisedWorker(
                    spec.name, rank, attempt, spec.idle_timeout, spec.job_key, spec.deadlines
                )
                self.index.add(worker.pid, supervised, self._recorder(env, worker))
                worker.child.watch(partial(on_exit, worker))
                self.events.emit_at(logging.DEBUG, "worker_started", **worker.about)
            for feature in self.features:
                feature.workers_started()
        finally:
            for pair in targets.values():  # ranks that never started
                for target in pair:
                    target.close()

    async def _environments(
        self, attempt: int, restart_count: int, placement: Placement, base: dict[str, str]
    ) -> dict[int, dict[str, str]]:
        recorder_dir = None
        if self.spec.flight_recorder:
            # The ranks' pipes live here: the daemon's uid only, so nobody else makes them dump.
            recorder_dir = self.run_dir / f"attempt_{attempt}" / "flight_recorder"
            mkdir = partial(recorder_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
            await anyio.to_thread.run_sync(mkdir)
        envs = {}
        for local_rank in range(self.spec.nproc):
            env = worker_env(
                self.spec,
                placement,
                local_rank,
                restart_count,
                base=base,
                cuda_visible=self.gpus[local_rank],
                socket_path=self.endpoints.socket_path,
                fifo_path=self.endpoints.fifo_path,
                error_path=self.run_dir / f"attempt_{attempt}" / str(local_rank) / "error.json",
                recorder_dir=recorder_dir,
            )
            for feature in self.features:
                env.update(feature.environment(local_rank))
            envs[local_rank] = env
        return envs

    @staticmethod
    def _recorder(env: dict[str, str], worker: Worker) -> Recorder | None:
        """The rank's flight recorder, if its environment turns one on: the NCCL pipe's,
        its worker servers' (gloo), or both."""
        pipe, trace = recorder_paths(env, worker.rank) or ("", "")
        servers = trace_servers(env)
        if not pipe and not servers:
            return None
        # The worker runs as the daemon does: its pipe, trace and sockets are the daemon's uid's.
        return Recorder(worker.rank, worker.pid, pipe, trace, os.geteuid(), servers)

    def _open_logs(
        self, envs: dict[int, dict[str, str]], routes: Routes
    ) -> dict[int, tuple[Target, Target]]:
        """Every rank's open streams, or GroupError naming the one that cannot be opened."""
        opened: dict[int, tuple[Target, Target]] = {}
        try:
            for local_rank, (out_route, err_route) in routes.items():
                self.logs.clear_error_file(envs[local_rank])
                stdout = open_target(out_route)
                try:
                    opened[local_rank] = (stdout, open_target(err_route))
                except OSError:
                    stdout.close()
                    raise
        except OSError as e:
            for pair in opened.values():
                for target in pair:
                    target.close()
            raise GroupError(
                f"group {self.spec.name}: cannot open {e.filename}: {e.strerror}"
            ) from None
        return opened

    async def _spawn(
        self, local_rank: int, attempt: int, env: dict[str, str], targets: tuple[Target, Target]
    ) -> Started:
        """Start one worker on its opened streams, which are closed on failure."""
        cpus = self.binding.cpus(local_rank)
        cell = self.cells.cell(f"rank{local_rank}")
        start = partial(self.starter.start, local_rank, attempt, env, targets, cpus, cell)
        try:
            return await anyio.to_thread.run_sync(start) if self.starter.off_loop else start()
        except BaseException as e:
            cell.remove()
            for target in targets:
                target.close()
            if not isinstance(e, OSError | GroupError):
                raise
            why = e.strerror if isinstance(e, OSError) else e
            raise GroupError(
                f"group {self.spec.name}: cannot start {self.spec.entrypoint[0]!r}: {why}"
            ) from None

    def _copy_output(
        self,
        worker: Worker,
        routes: tuple[StreamRoute, StreamRoute],
        targets: tuple[Target, Target],
        fds: tuple[int | None, int | None],
    ) -> None:
        """Copy each piped stream of ``worker`` to its target (the others' targets close)."""
        prefix = log_prefix(self.spec, worker.local_rank, worker.rank, self.hostname).encode()
        for route, target, fd in zip(routes, targets, fds, strict=True):
            if fd is not None:
                self.copiers.append(start_copier(fd, target, route, prefix))
            else:
                target.close()  # the worker holds its own descriptor
