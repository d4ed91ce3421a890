"""The daemon: endpoints in, timers in the table, signals out.

One anyio task group holds everything: the socket's accept loop and one
task per connection, the expiry loop, and the shutdown watcher. The FIFO
and the pidfds of processes with timers are served by loop callbacks
(``_aio``), which run the same synchronous request code as the socket.

The expiry loop sleeps until the table's next deadline, or until a request
arms an earlier one — never on a polling interval.
"""

from __future__ import annotations

import contextlib
import grp
import heapq
import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

from watchdogd import __version__
from watchdogd.core.config import Config
from watchdogd.core.policy import Policy, Requester, Target, check, valid_signals
from watchdogd.core.timers import Timer, TimerTable
from watchdogd.groups.supervisor import GroupError, Supervisor
from watchdogd.linux import aio as _aio
from watchdogd.linux.endpoints import (
    EndpointError,
    Lock,
    enlarge_pipe,
    group_id,
    open_fifo,
    open_socket,
    prepare_dir,
)
from watchdogd.linux.gpus import XidWatcher, read_gpus
from watchdogd.linux.procs import ProcessHandle, ancestors, open_process
from watchdogd.linux.systemd import Notifier, is_fifo, is_listening_unix_socket, listen_fds
from watchdogd.service.connections import SocketFront
from watchdogd.service.eventlog import EventLog
from watchdogd.service.fifo import FifoFront
from watchdogd.service.metrics import HealthServer, LoopMonitor, Metrics, parse_listen
from watchdogd.service.persistence import Persistence
from watchdogd.service.reaper import Reaper
from watchdogd_client import protocol as p
from watchdogd_client.events import Event, EventSource, record, register_handler

__all__ = ["Daemon", "EndpointError"]

log = logging.getLogger("watchdogd")

# libuv's timer resolution (uvloop): wake this much early, then watch the clock.
_TIMER_SLACK = 0.0015

_EVENT_LOG = "watchdogd-event-log"

ErrorReply = tuple[p.ErrorCode, str]


class Daemon:
    """The timer service. ``await Daemon(config).serve()`` runs it until shutdown."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.limits = config.limits
        self.socket_path = config.socket_path()
        self.fifo_path = config.fifo_path()
        self.table = TimerTable()
        self.processes: dict[int, ProcessHandle] = {}
        # pid -> (via, uid, admin, signal) the policy allowed, until the process exits.
        self._approved: dict[int, set[tuple[str, int, bool, int]]] = {}
        self.requests: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.connections = 0
        self.started_at = time.monotonic()
        self.supervisor = Supervisor(self)
        self.reaper = Reaper(self)
        self.signals: Counter[int] = Counter()
        self.refusals: Counter[str] = Counter()
        self.bad_inputs: Counter[str] = Counter()
        self.loop_monitor = LoopMonitor()
        self.metrics = Metrics(self, self.loop_monitor)
        self.events = EventLog(config.event_ring_size)
        self.notifier = Notifier()
        self.persistence = Persistence(self)
        self._mark_dirty = self.persistence.mark_dirty
        self._activated = False
        self.http_address: tuple[str, int] | None = None
        # Worker pids this daemon launched (pid -> group): FIFO requests may target them.
        self.supervised: dict[int, str] = {}
        # The scope whose expiry signalled a worker, for its group's failure report.
        self.expired_scopes: dict[int, str] = {}
        self._wake = anyio.Event()
        self._policy = self._build_policy()
        self.admin_gid = self._lookup_admin_gid()
        self.fifo_front = FifoFront(self, self.limits.max_line)
        self.socket_front = SocketFront(self)
        self._event_destination = "null"
        if config.event_log:
            handler = logging.FileHandler(config.event_log)
            handler.setFormatter(logging.Formatter("%(message)s"))
            register_handler(_EVENT_LOG, handler)
            self._event_destination = _EVENT_LOG

    def _build_policy(self) -> Policy:
        own = os.getpid()
        settings = self.config.policy
        fifo_uids = settings.fifo_allowed_uids
        return Policy(
            protected_pids=frozenset({1, own, *ancestors(own), *settings.protected_pids}),
            fifo_allowed_uids=frozenset([os.geteuid()] if fifo_uids is None else fifo_uids),
            allowed_signals=(
                valid_signals()
                if settings.allowed_signals is None
                else frozenset(settings.allowed_signals)
            ),
        )

    def _lookup_admin_gid(self) -> int | None:
        name = self.config.policy.admin_group
        if name is None:
            return None
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            return None

    # -- running -----------------------------------------------------------------

    async def serve(
        self,
        *,
        shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
        task_status: anyio.abc.TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the endpoints, report ready through ``task_status``, serve until shutdown.

        Raises :class:`EndpointError` before ``task_status.started()`` when an
        endpoint cannot be created or another daemon owns it.
        """
        with contextlib.ExitStack() as cleanup:
            raw_socket, fifo_fd = self._open_endpoints(cleanup)
            listener = await anyio.abc.SocketListener.from_socket(raw_socket)
            cleanup.callback(self._close_processes)
            self.persistence.restore()
            async with anyio.create_task_group() as tg, listener:
                _aio.watch_readable(fifo_fd, lambda: self.fifo_front.on_readable(fifo_fd))
                cleanup.callback(_aio.unwatch, fifo_fd)
                tg.start_soon(self._expiry_loop)
                tg.start_soon(listener.serve, self.socket_front.serve, tg)
                tg.start_soon(self.persistence.run)
                tg.start_soon(self._notify_loop)
                tg.start_soon(self.loop_monitor.run)
                self._start_http(cleanup)
                self._start_gpu_watch(cleanup)
                self.supervisor.attach(tg)
                self.reaper.attach(tg)
                self.emit(
                    "daemon_started",
                    version=__version__,
                    socket=str(self.socket_path),
                    fifo=str(self.fifo_path),
                    activated=self._activated,
                    restored=len(self.table),
                )
                for spec in self.config.groups:
                    self.supervisor.submit(spec)
                task_status.started(self)
                self.notifier.notify("READY=1", self._status_line())
                if shutdown_trigger is None:
                    await anyio.sleep_forever()
                else:
                    await shutdown_trigger()
                self.notifier.notify("STOPPING=1")
                self.emit("daemon_stopping", timers=len(self.table))
                await self.supervisor.stop_all()
                tg.cancel_scope.cancel()
            self.persistence.write_now()

    def _open_endpoints(self, cleanup: contextlib.ExitStack) -> tuple[socket.socket, int]:
        """Adopt the endpoints systemd passed, or create them; both locked against a twin."""
        raw_socket: socket.socket | None = None
        fifo_fd: int | None = None
        for fd in listen_fds():
            if raw_socket is None and is_listening_unix_socket(fd):
                raw_socket = socket.socket(fileno=fd)
                raw_socket.setblocking(False)
                self.socket_path = Path(raw_socket.getsockname())
            elif fifo_fd is None and is_fifo(fd):
                fifo_fd = fd
                os.set_blocking(fd, False)
                enlarge_pipe(fd, self.limits.fifo_pipe_size)
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
            fifo_fd = open_fifo(
                self.fifo_path, self.config.fifo_mode, gid, self.limits.fifo_pipe_size
            )
        cleanup.callback(os.close, fifo_fd)
        fifo_lock.publish(fifo_fd)
        return raw_socket, fifo_fd

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
        groups = sum(1 for r in self.supervisor.groups.values() if not r.finished.is_set())
        return (
            f"STATUS={len(self.table)} timers, {len(self.processes)} processes, "
            f"{self.connections} connections, {groups} groups"
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
        self.limits = config.limits
        self.fifo_front.splitter.max_line = config.limits.max_line
        self._policy = self._build_policy()
        self._approved.clear()
        self.admin_gid = self._lookup_admin_gid()
        for name in old_groups - new_groups.keys():
            with contextlib.suppress(GroupError):
                self.supervisor.get(name).stop()
        started = []
        for name, spec in new_groups.items():
            if name not in old_groups:
                try:
                    self.supervisor.submit(spec)
                    started.append(name)
                except GroupError as e:
                    log.error("reload: %s", e)
        self.emit(
            "config_reloaded",
            groups_started=",".join(started),
            groups_stopped=",".join(sorted(old_groups - new_groups.keys())),
        )
        self.notifier.notify("READY=1", self._status_line())

    def _start_http(self, cleanup: contextlib.ExitStack) -> None:
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
        self.emit("metrics_listening", address=f"{server.address[0]}:{server.address[1]}")

    def _start_gpu_watch(self, cleanup: contextlib.ExitStack) -> None:
        if not self.config.gpu_health:
            return
        token = anyio.lowlevel.current_token()

        def from_thread(index: int, description: str) -> None:
            anyio.from_thread.run_sync(self.gpu_fault, index, description, token=token)

        watcher = XidWatcher(from_thread)
        if watcher.start():
            cleanup.callback(watcher.stop)
        else:
            log.warning("gpu_health is on but GPUs cannot be watched: %s", watcher.unavailable)

    def gpu_fault(self, index: int, description: str) -> None:
        """A GPU reported a fatal error: the groups that may use it are UNHEALTHY."""
        self.emit("gpu_fault", gpu=index, fault=description)
        if index < 0:
            return
        for runner in self.supervisor.groups.values():
            if not runner.finished.is_set() and runner.uses_gpu(index):
                with contextlib.suppress(GroupError):
                    runner.mark_unhealthy(f"GPU {index}: {description}")

    def _unlink_socket(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _close_processes(self) -> None:
        for handle in self.processes.values():
            with contextlib.suppress(ValueError, OSError):
                _aio.unwatch(handle.pidfd)
            handle.close()
        self.processes.clear()

    # -- events ------------------------------------------------------------------

    def emit(self, name: str, **metadata: str | int | float | bool | None) -> None:
        """Record an event: one line in the daemon's log, one in the event log if configured."""
        self.emit_at(logging.INFO, name, **metadata)

    def emit_at(
        self, level: int, name: str, /, **metadata: str | int | float | bool | None
    ) -> None:
        """:meth:`emit`, logged at ``level``."""
        event = Event(name, EventSource.AGENT, time.time_ns() // 1_000_000, metadata)
        self.events.append(event)
        if log.isEnabledFor(level):
            if self.config.log_format == "json":
                log.log(level, "%s", event.serialize())
            else:
                fields = " ".join(f"{key}={value!r}" for key, value in metadata.items())
                log.log(level, "%s %s", name, fields)
        record(event, self._event_destination)

    # -- the timer operations, shared by both transports -------------------------

    def arm(
        self,
        requester: Requester,
        pid: int,
        scope_id: str,
        expiration_time: float,
        signal: int,
        pinned: ProcessHandle | None = None,
    ) -> ErrorReply | None:
        """Arm ``(pid, scope_id)``; an error code and message when refused.

        ``pinned``: the process ``pid`` must be (a socket peer, by its pidfd).
        """
        if not math.isfinite(expiration_time):
            return "bad_request", f"expiration_time must be finite, got {expiration_time}"
        if expiration_time < 0:
            return self.release(requester, pid, scope_id)
        if len(scope_id) > self.limits.max_scope_len:
            return "limit_exceeded", (
                f"scope_id of {len(scope_id)} characters exceeds max_scope_len "
                f"({self.limits.max_scope_len})"
            )
        existing = self.table.get(pid, scope_id)
        if existing is None:
            if len(self.table) >= self.limits.max_timers:
                return "limit_exceeded", f"the daemon holds max_timers ({self.limits.max_timers})"
            if self.table.count_for(pid) >= self.limits.max_timers_per_pid:
                return "limit_exceeded", (
                    f"pid {pid} holds max_timers_per_pid ({self.limits.max_timers_per_pid})"
                )
        handle = self.processes.get(pid)
        new_handle = handle is None
        if handle is None:
            try:
                if pinned is not None and pinned.pid == pid:
                    if pinned.exited():
                        raise ProcessLookupError(pid)
                    handle = pinned.duplicate()
                else:
                    handle = open_process(pid)
            except ProcessLookupError:
                return "no_such_process", f"no process with pid {pid}"
            except OSError as e:
                return "refused", f"cannot watch pid {pid}: {e.strerror}"
        refusal = self._permitted(requester, handle, signal)
        if refusal is not None:
            if new_handle:
                handle.close()
            return refusal
        if new_handle:
            self.watch_process(handle)
        deadline = time.monotonic() + (expiration_time - time.time())
        source: Literal["fifo", "socket"] = requester.via
        if self.table.arm(pid, scope_id, deadline, signal, source, requester.uid):
            self._wake.set()
        self._mark_dirty()
        return None

    def release(self, requester: Requester, pid: int, scope_id: str) -> ErrorReply | None:
        timer = self.table.get(pid, scope_id)
        if timer is None:
            return None
        refusal = self._check_existing(requester, pid)
        if refusal is not None:
            return refusal
        self.table.release(pid, scope_id)
        self._mark_dirty()
        return None

    def release_all(self, requester: Requester, pid: int) -> ErrorReply | None:
        if self.table.count_for(pid) == 0:
            return None
        refusal = self._check_existing(requester, pid)
        if refusal is not None:
            return refusal
        self.table.release_pid(pid)
        self._mark_dirty()
        return None

    def _check_existing(self, requester: Requester, pid: int) -> ErrorReply | None:
        return self._permitted(requester, self.processes[pid], 0)

    def _permitted(
        self, requester: Requester, handle: ProcessHandle, signal: int
    ) -> ErrorReply | None:
        """The policy's verdict, remembered per process: a trainer arms the same timer often."""
        approved = self._approved.get(handle.pid)
        key = (requester.via, requester.uid, requester.admin, signal)
        if approved is not None and key in approved:
            return None
        target = Target(handle.pid, handle.uid, handle.kernel_thread, handle.pid in self.supervised)
        refusal = check(self._policy, requester, target, signal)
        if refusal is not None:
            return refusal.code, refusal.reason
        if approved is None:
            approved = self._approved[handle.pid] = set()
        approved.add(key)
        return None

    def watch_process(self, handle: ProcessHandle) -> None:
        self.processes[handle.pid] = handle
        _aio.watch_readable(handle.pidfd, lambda: self._on_process_exit(handle))

    def _on_process_exit(self, handle: ProcessHandle) -> None:
        _aio.unwatch(handle.pidfd)
        handle.close()
        if self.processes.get(handle.pid) is handle:
            del self.processes[handle.pid]
        self.reaper.forget(handle)
        self._approved.pop(handle.pid, None)
        dropped = self.table.release_pid(handle.pid)
        if dropped:
            self._mark_dirty()
            self.counts["dropped"] += len(dropped)
            self.emit(
                "timers_dropped",
                reason="process exited",
                pid=handle.pid,
                timers=len(dropped),
                scopes=",".join(t.scope_id for t in dropped[:16]),
            )

    # -- expiry ------------------------------------------------------------------

    async def _expiry_loop(self) -> None:
        table = self.table
        while True:
            deadline = table.next_deadline()
            now = time.monotonic()
            if deadline is not None and deadline <= now:
                self._expire(now)
                continue
            if deadline is not None and deadline - now < _TIMER_SLACK:
                # The loop's timers round up to whole milliseconds: for the last
                # one, yield to other work but check the clock every iteration.
                await anyio.lowlevel.checkpoint()
                continue
            self._wake = anyio.Event()
            delay = math.inf if deadline is None else deadline - now - _TIMER_SLACK
            with anyio.move_on_after(delay):
                await self._wake.wait()

    def _expire(self, now: float) -> None:
        self._mark_dirty()
        self.reaper.expire(self.table.pop_expired(now))

    def bad_input(self, via: str, reason: str, sample: bytes) -> None:
        self.counts["bad_input"] += 1
        self.bad_inputs[via] += 1
        self.emit("bad_input", via=via, reason=reason, sample=sample[:200].decode(errors="replace"))

    def refused(self, via: str, pid: int, scope_id: str, error: ErrorReply) -> None:
        self.counts["refused"] += 1
        code, message = error
        self.refusals[code] += 1
        self.emit("request_refused", via=via, pid=pid, scope_id=scope_id, code=code, reason=message)

    # -- queries -----------------------------------------------------------------

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList:
        """The soonest timers (of processes of ``uid``; all when None), and how many exist."""
        limit = self.limits.max_listed_timers
        if uid is None:
            timers: Iterable[Timer] = self.table
            total = len(self.table)
        else:
            processes = self.processes
            own = [t for t in self.table if t.pid in processes and processes[t.pid].uid == uid]
            timers, total = own, len(own)
        return p.TimerList(seq, self._timer_infos(heapq.nsmallest(limit, timers)), total)

    def _timer_infos(self, timers: list[Timer]) -> list[p.TimerInfo]:
        now = time.monotonic()
        wall = time.time()
        return [
            p.TimerInfo(
                pid=t.pid,
                scope_id=t.scope_id,
                remaining_s=t.deadline - now,
                expiration_time=wall + (t.deadline - now),
                signal=t.signal,
                source=t.source,
                uid=None if t.uid < 0 else t.uid,
            )
            for t in timers
        ]

    def status(self, seq: int) -> p.StatusInfo:
        workers = {
            worker.pid: (runner.spec.name, worker.rank)
            for runner in self.supervisor.groups.values()
            for worker in runner.workers.values()
        }
        gpus, gpu_note = read_gpus(workers)
        return p.StatusInfo(
            seq=seq,
            version=__version__,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started_at,
            socket_path=str(self.socket_path),
            fifo_path=str(self.fifo_path),
            timers=len(self.table),
            processes=len(self.processes),
            connections=self.connections,
            requests=dict(self.requests),
            expired=self.counts["expired"],
            signalled=self.counts["signalled"],
            refused=self.counts["refused"],
            bad_input=self.counts["bad_input"],
            gpus=gpus,
            gpu_note=gpu_note,
        )
