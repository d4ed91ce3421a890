"""The composition root: build the parts, hand each its ports, run them in one task group.

Nothing but ``cli/`` imports this module. The parts never see the
:class:`Daemon`: the timer core gets the process watch, the reaper (its
``Killer``), the scope recorder (its ``DeadlineLearner``), an event sink,
its stats and the supervisor's worker index (``Supervision``); the timeline
and the scope recorder observe the timers that end; the fronts get the
core's operations and the request audit; the socket sessions get
``SessionPorts``; the supervisor gets the event sink, the endpoints, the
straggler watch's ``StragglerShare`` (what multi-node groups publish and
read back) and the recorder's ``GroupRuns``; metrics read typed stats.

One anyio task group holds everything: the socket's accept loop and one
task per connection, the expiry loop, the snapshot writer, the worker
groups, systemd's keep-alive and the loop monitor. The FIFO and the pidfds
are served by loop callbacks (:mod:`watchdogd.linux.aio`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec

from watchdogd import __version__
from watchdogd.core.config import Config
from watchdogd.core.ports import GroupError
from watchdogd.groups.runner import Endpoints, WorkerIndex
from watchdogd.groups.supervisor import CONFIG_CONSENT, Supervisor
from watchdogd.linux import aio
from watchdogd.linux.endpoints import (
    EndpointError,
    Lock,
    enlarge_pipe,
    group_id,
    open_fifo,
    open_socket,
    prepare_dir,
)
from watchdogd.linux.gpus import XidWatcher
from watchdogd.linux.logsink import LogSink
from watchdogd.linux.stacks import StackStore
from watchdogd.linux.systemd import Notifier, is_fifo, is_listening_unix_socket, listen_fds
from watchdogd.service.eventlog import EventLog, install_event_handler
from watchdogd.service.fifo import FifoFront
from watchdogd.service.gpu_status import GpuStatus
from watchdogd.service.learned_store import LearnedStore
from watchdogd.service.metrics import HealthServer, LoopMonitor, Metrics, parse_listen
from watchdogd.service.persistence import Persistence
from watchdogd.service.process_watch import ProcessWatch
from watchdogd.service.reaper import Reaper
from watchdogd.service.scope_recorder import ScopeRecorder
from watchdogd.service.session import SessionPorts
from watchdogd.service.socket_front import SocketFront
from watchdogd.service.stats import Stats
from watchdogd.service.throttle import NoisyEvents, RequestAudit
from watchdogd.service.timeline import Timeline
from watchdogd.service.timer_core import TimerCore
from watchdogd.service.timer_queries import TimerQueries
from watchdogd_client import protocol as p
from watchdogd_client.events import Event, EventSource, get_logging_handler, register_handler

__all__ = ["Daemon"]

log = logging.getLogger("watchdogd")

_EVENT_LOG = "watchdogd-event-log"
# Seconds between saves of what jobs learned, while it changes (and once on the way out).
_LEARNED_SAVE = 5.0


def _events_dropped(count: int) -> str:
    """The event log's own line for a gap: an event too, so the file stays JSON lines."""
    now = time.time_ns() // 1_000_000
    return Event("events_dropped", EventSource.AGENT, now, {"count": count}).serialize()


class Daemon:
    """The timer service and the worker groups. ``await Daemon(config).serve()`` runs them."""

    def __init__(
        self,
        config: Config,
        *,
        loop_tick: float = 0.5,
        embedded: bool = False,
        fault_consent: str = CONFIG_CONSENT,
    ) -> None:
        """ConfigError when the event handler the config names cannot be had.

        ``fault_consent``: what allows injected faults, for the refusals to name.

        ``embedded``: it runs in someone else's process (``watchdogd.launcher``),
        which may be a systemd service of its own: it adopts no ``LISTEN_FDS``,
        tells systemd nothing, and leaves the process's garbage collector alone.
        """
        self.config = config
        self.embedded = embedded
        self.socket_path = config.socket_path()
        self.fifo_path = config.fifo_path()
        self.started_at = time.monotonic()
        destinations = []
        if config.event_log_handler != "null":
            install_event_handler(config.event_log_handler, config.event_handlers)
            destinations.append(config.event_log_handler)
        if config.event_log:
            event_file = logging.FileHandler(config.event_log)
            event_file.setFormatter(logging.Formatter("%(message)s"))
            register_handler(_EVENT_LOG, event_file)
            destinations.append(_EVENT_LOG)
        # Every destination is written by a sink's thread: a slow disk or
        # console, or a handler of the user's, holds the loop for no event.
        self._event_sinks: dict[str, tuple[LogSink, logging.Handler]] = {}
        for name in destinations:
            handler = get_logging_handler(name)
            if not isinstance(handler, logging.NullHandler):
                sink = LogSink(handler, notice=_events_dropped)
                self._event_sinks[name] = sink, handler
                register_handler(name, sink.handler)
        self.events = EventLog(
            config.event_ring_size, log_format=config.log_format, destinations=tuple(destinations)
        )
        self.stats = Stats()
        self.loop_monitor = LoopMonitor(loop_tick)
        workers = WorkerIndex()
        self.stacks = StackStore(config.state_path() / "dumps", config.dumps_kept)
        self.watch = ProcessWatch()
        self.reaper = Reaper(
            config.reaper_settings(),
            processes=self.watch,
            events=self.events,
            stats=self.stats,
            supervision=workers,
            stacks=self.stacks,
            observe_latency=lambda late: self.metrics.expiry_latency.observe(late),
        )
        self.scopes = ScopeRecorder(
            config.scope_settings(), events=self.events, supervision=workers
        )
        self.noisy = NoisyEvents(self.events, self.stats, config.noisy_settings())
        self.audit = RequestAudit(self.noisy)
        self.timers = TimerCore(
            config.timer_settings(),
            watch=self.watch,
            killer=self.reaper,
            supervision=workers,
            learner=self.scopes,
            events=self.events,
            stats=self.stats,
        )
        self.timeline = Timeline(config.timeline_settings())
        # The observers of ended timers: the timeline first, so a release's
        # statistics never come before its span.
        self.timers.on_ended(self.timeline.timer_ended)
        self.timers.on_ended(self.scopes.timer_ended)
        self.timers.on_ended(workers.timer_ended)  # a release may be a group's step
        self.watch.on_exit(self.reaper.forget)
        self.watch.on_exit(self.scopes.process_exited)
        self.queries = TimerQueries(
            self.timers.table, self.watch, self.timeline, config.query_settings()
        )
        self.supervisor = Supervisor(
            self.events,
            Endpoints(str(self.socket_path), str(self.fifo_path)),
            workers=workers,
            stragglers=self.scopes.stragglers,
            runs=self.scopes,
            settings=config.supervisor_settings(),
            fault_consent=fault_consent,
        )
        self.metrics = Metrics(
            self.stats,
            self.timers,
            self.watch,
            self.scopes.stragglers,
            self.supervisor.states,
            self.supervisor.infos,
            self.loop_monitor,
        )
        self.gpus = GpuStatus()
        self.persistence = Persistence(
            config.state_path(),
            self.timers,
            events=self.events,
            stats=self.stats,
            settings=config.persistence_settings(),
        )
        self.learned_store = LearnedStore(
            config.learned_settings(), self.scopes, events=self.events, interval=_LEARNED_SAVE
        )
        self.fifo_front = FifoFront(self.timers, self.audit, self.stats, config.fifo_settings())
        self.socket_front = SocketFront(
            SessionPorts(
                self.timers,
                self.audit,
                self.queries,
                self.scopes,
                self.reaper,
                self.events,
                self.stacks,
                self.supervisor,
                workers,
                self.stats,
                self.status,
            ),
            config.socket_settings(),
        )
        self.notifier = Notifier({} if embedded else None)
        self.http_address: tuple[str, int] | None = None
        self._activated = False

    # -- running -----------------------------------------------------------------

    async def serve(
        self,
        *,
        shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
        task_status: anyio.abc.TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the endpoints, report ready through ``task_status``, serve until shutdown.

        Raises :class:`~watchdogd.linux.endpoints.EndpointError` before
        ``task_status.started()`` when an endpoint cannot be created or another
        daemon owns it.
        """
        async with contextlib.AsyncExitStack() as cleanup:
            for name, (sink, handler) in self._event_sinks.items():
                sink.start()
                cleanup.push_async_callback(self._close_event_log, name, sink, handler)
            raw_socket, fifo_fd = self._open_endpoints(cleanup)
            # systemd may have passed endpoints at other paths than the config's.
            self.supervisor.endpoints = Endpoints(str(self.socket_path), str(self.fifo_path))
            listener = await anyio.abc.SocketListener.from_socket(raw_socket)
            cleanup.callback(self.watch.close)
            await self.supervisor.open_containment(self.config.process_containment == "auto")
            cleanup.callback(self.supervisor.close_containment)
            self.persistence.restore()
            async with anyio.create_task_group() as tg, listener:
                aio.watch_readable(fifo_fd, partial(self.fifo_front.on_readable, fifo_fd))
                cleanup.callback(aio.unwatch, fifo_fd)
                tg.start_soon(self.timers.run, tg)
                tg.start_soon(self.noisy.run)
                tg.start_soon(listener.serve, self.socket_front.serve, tg)
                tg.start_soon(self.persistence.run)
                tg.start_soon(self.learned_store.run)
                tg.start_soon(self._notify_loop)
                tg.start_soon(self.loop_monitor.run)
                self._start_http(cleanup)
                self._start_gpu_watch(cleanup)
                self.gpus.attach(tg)
                self.supervisor.attach(tg)
                self.events.emit(
                    "daemon_started",
                    version=__version__,
                    socket=str(self.socket_path),
                    fifo=str(self.fifo_path),
                    activated=self._activated,
                    restored=len(self.timers),
                    containment=self.supervisor.containment_info(),
                )
                for spec in self.config.groups:
                    self.supervisor.submit(spec)
                # What is alive now (modules, classes, the config) lives as long
                # as the process: never scanning it again keeps a full garbage
                # collection, which runs on the loop, at milliseconds rather
                # than the 70+ ms it takes with torch's modules in the process.
                if not self.embedded:
                    gc.freeze()
                task_status.started(self)
                self.notifier.notify("READY=1", self._status_line())
                if shutdown_trigger is None:
                    await anyio.sleep_forever()
                else:
                    await shutdown_trigger()
                self.notifier.notify("STOPPING=1")
                self.events.emit_at(logging.DEBUG, "daemon_stopping", timers=len(self.timers))
                await self.supervisor.stop_all()
                tg.cancel_scope.cancel()
            self.persistence.write_now()
            self.learned_store.write_now()

    @staticmethod
    async def _close_event_log(name: str, sink: LogSink, handler: logging.Handler) -> None:
        """Write out the events still queued for ``name``, off the loop and bounded.

        The destination gets its own handler back: a later daemon in this
        process (the tests run many) writes through a sink of its own.
        """
        with anyio.CancelScope(shield=True):
            written = await anyio.to_thread.run_sync(sink.close)
        register_handler(name, handler)
        if not written:
            log.warning("event destination %s: the last events could not be written in time", name)

    def _open_endpoints(self, cleanup: contextlib.AsyncExitStack) -> tuple[socket.socket, int]:
        """Adopt the endpoints systemd passed, or create them; both locked against a twin."""
        limits = self.config.limits
        raw_socket: socket.socket | None = None
        fifo_fd: int | None = None
        for fd in listen_fds() if not self.embedded else ():
            if raw_socket is None and is_listening_unix_socket(fd):
                raw_socket = socket.socket(fileno=fd)
                raw_socket.setblocking(False)
                self.socket_path = Path(raw_socket.getsockname())
            elif fifo_fd is None and is_fifo(fd):
                fifo_fd = fd
                os.set_blocking(fd, False)
                enlarge_pipe(fd, limits.fifo_pipe_size)
                with contextlib.suppress(OSError):
                    self.fifo_path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            else:
                os.close(fd)
        self._activated = raw_socket is not None or fifo_fd is not None
        if raw_socket is None or fifo_fd is None:
            for path in {self.socket_path.parent, self.fifo_path.parent}:
                prepare_dir(path)
        cleanup.callback(Lock(self.socket_path).release)
        fifo_lock = Lock(self.fifo_path)
        cleanup.callback(fifo_lock.release)
        gid = group_id(self.config.group)
        if raw_socket is None:
            raw_socket = open_socket(self.socket_path, self.config.socket_mode, gid)
            # Only a socket we created is ours to remove; systemd keeps its own.
            cleanup.callback(self._unlink_socket)
        cleanup.callback(raw_socket.close)
        if fifo_fd is None:
            fifo_fd = open_fifo(self.fifo_path, self.config.fifo_mode, gid, limits.fifo_pipe_size)
        cleanup.callback(os.close, fifo_fd)
        fifo_lock.publish(fifo_fd)
        return raw_socket, fifo_fd

    def _unlink_socket(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    # -- systemd ---------------------------------------------------------------

    async def _notify_loop(self) -> None:
        """Tell systemd we are alive (from the event loop itself) and how busy we are."""
        interval = self.notifier.watchdog_interval
        if not self.notifier.enabled:
            return
        while True:
            await anyio.sleep(interval if interval is not None else 5.0)
            lines = [self._status_line()]
            if interval is not None:
                lines.append("WATCHDOG=1")
            self.notifier.notify(*lines)

    def _status_line(self) -> str:
        return (
            f"STATUS={len(self.timers)} timers, {len(self.watch)} processes, "
            f"{self.stats.connections} connections, {self.supervisor.running()} groups"
        )

    def reload(self, config: Config) -> None:
        """Apply a changed config: limits, policy, groups. Timers are untouched."""
        self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        moved = [
            name
            for name, old, new in (
                ("socket", self.config.socket_path(), config.socket_path()),
                ("fifo", self.config.fifo_path(), config.fifo_path()),
            )
            if old != new
        ]
        if moved:
            log.warning("%s path changes take effect on restart, not reload", " and ".join(moved))
        old_groups = {g.name for g in self.config.groups}
        new_groups = {g.name: g for g in config.groups}
        self.config = config
        self._reconfigure_parts(config)
        for name in old_groups - new_groups.keys():
            with contextlib.suppress(GroupError):
                self.supervisor.stop(name)
        started = []
        for name, spec in new_groups.items():
            if name not in old_groups:
                try:
                    self.supervisor.submit(spec)
                    started.append(name)
                except GroupError as e:
                    log.error("reload: %s", e)
        self.events.emit(
            "config_reloaded",
            groups_started=",".join(started),
            groups_stopped=",".join(sorted(old_groups - new_groups.keys())),
        )
        self.notifier.notify("READY=1", self._status_line())

    def _reconfigure_parts(self, config: Config) -> None:
        """Hand each part its view of a reloaded ``config``: every setting a reload
        changes goes through here. What is not in a view (the endpoints, the state
        directory, logging, metrics) takes effect on restart."""
        self.timers.reconfigure(config.timer_settings())
        self.reaper.reconfigure(config.reaper_settings())
        self.scopes.reconfigure(config.scope_settings())
        self.noisy.reconfigure(config.noisy_settings())
        self.timeline.reconfigure(config.timeline_settings())
        self.queries.reconfigure(config.query_settings())
        self.persistence.reconfigure(config.persistence_settings())
        self.learned_store.reconfigure(config.learned_settings())
        self.supervisor.reconfigure(config.supervisor_settings())
        self.fifo_front.reconfigure(config.fifo_settings())
        self.socket_front.reconfigure(config.socket_settings())

    # -- observability -----------------------------------------------------------

    def _start_http(self, cleanup: contextlib.AsyncExitStack) -> None:
        listen = self.config.metrics_listen
        if listen is None:
            return
        try:
            server = HealthServer(self.metrics, parse_listen(listen), self.config.health_max_lag)
        except (OSError, ValueError) as e:
            raise EndpointError(f"cannot serve metrics on {listen}: {e}") from None
        server.start()
        cleanup.callback(server.stop)
        self.http_address = server.address
        self.events.emit("metrics_listening", address=f"{server.address[0]}:{server.address[1]}")

    def _start_gpu_watch(self, cleanup: contextlib.AsyncExitStack) -> None:
        if not self.config.gpu_health:
            return
        token = anyio.lowlevel.current_token()

        def from_thread(index: int, description: str) -> None:
            anyio.from_thread.run_sync(self.supervisor.gpu_fault, index, description, token=token)

        watcher = XidWatcher(from_thread)
        if watcher.start():
            cleanup.callback(watcher.stop)
        else:
            log.warning("gpu_health is on but GPUs cannot be watched: %s", watcher.unavailable)

    def status(self, seq: int, admin: bool) -> p.StatusInfo:
        """The daemon's status; GPUs from the last NVML reading, never read here.

        Only root and the admin group see which processes run on each GPU.
        """
        gpus, gpu_note = self.gpus.current(self.supervisor.worker_ranks)
        if not admin:
            gpus = [msgspec.structs.replace(gpu, processes=[]) for gpu in gpus]
        stats = self.stats
        return p.StatusInfo(
            seq=seq,
            version=__version__,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started_at,
            socket_path=str(self.socket_path),
            fifo_path=str(self.fifo_path),
            timers=len(self.timers),
            processes=len(self.watch),
            connections=stats.connections,
            requests=dict(stats.requests),
            expired=stats.expired,
            signalled=stats.signalled,
            refused=stats.refused,
            bad_input=stats.bad_input,
            connections_refused=dict(stats.connections_refused),
            suppressed=dict(stats.suppressed),
            gpus=gpus,
            gpu_note=gpu_note,
            containment=self.supervisor.containment_info(),
        )
