"""Prometheus metrics and a health check, on an optional HTTP listener.

Counters are the daemon's own (plain ints bumped on the hot path) and are
read only when Prometheus scrapes, by a custom collector: serving a request
costs no metrics work. The one histogram, expiry-to-signal latency, is
observed only when a timer fires.

The listener runs in a thread of its own, so that it can still answer when
the event loop is stuck: ``/healthz`` is 200 while the loop makes progress
and 503, with the lag, once it has not for ``health_max_lag`` seconds —
which is exactly when an operator needs to know. It is 503 too while a
group's job keeps this node set aside (quarantined), saying why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
import msgspec
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from watchdogd.linux.procs import RunQueueClock
from watchdogd.service.stats import Stats
from watchdogd.service.stragglers import StragglerWatch
from watchdogd_client.groups import GroupInfo, GroupState

# Each group's state and how many restarts it used (the groups' port for metrics).
GroupStates = Callable[[], Iterable[tuple[GroupState, int]]]
# What the groups show of themselves: restarts left, where their rendezvous stands.
GroupInfos = Callable[[], Iterable[GroupInfo]]

__all__ = ["HealthServer", "LoopMonitor", "Metrics", "parse_listen"]

# Often enough to see a stall within a second, rarely enough to cost ~0.05 % of a core.
_TICK = 0.5


class LoopMonitor:
    """Measures the event loop's lag: how late a short sleep wakes up.

    ``lag`` is the last tick's lateness, whatever its cause (the metric and
    ``/healthz``). ``max_stall`` is the worst lateness the loop caused
    itself, since start: the lag less the time its thread waited for a CPU
    meanwhile (a busy machine delays a tick without anything blocking the
    loop). The test harness runs the daemon with a short ``tick`` and fails
    any test during which ``max_stall`` passed 50 ms.
    """

    def __init__(self, tick: float = _TICK) -> None:
        self.tick = tick
        self.last_progress = time.time()
        self._last_tick = time.monotonic()
        self.lag = 0.0
        self.max_stall = 0.0

    async def run(self) -> None:
        tick = self.tick
        run_queue = RunQueueClock()  # opened here: it is the loop thread's clock
        try:
            while True:
                before, waited = time.monotonic(), run_queue.waited()
                await anyio.sleep(tick)
                now = time.monotonic()
                self.lag = max(0.0, now - before - tick)
                stall = self.lag - (run_queue.waited() - waited)
                self.max_stall = max(self.max_stall, stall)
                self._last_tick = now
                self.last_progress = time.time()
        finally:
            run_queue.close()

    def stalled_for(self) -> float:
        """Seconds since the loop last ticked, beyond the tick itself (0 when healthy)."""
        return max(0.0, time.monotonic() - self._last_tick - self.tick)


class Metrics(Collector):
    """The daemon's state as Prometheus metrics, read at scrape time."""

    def __init__(
        self,
        stats: Stats,
        timers: Sized,
        processes: Sized,
        stragglers: StragglerWatch,
        groups: GroupStates,
        infos: GroupInfos,
        loop: LoopMonitor,
    ) -> None:
        self.stats = stats
        self.timers = timers
        self.processes = processes
        self.stragglers = stragglers
        self.groups = groups
        self.infos = infos
        self.loop = loop
        self.registry = CollectorRegistry(auto_describe=False)
        self.expiry_latency = Histogram(
            "watchdogd_expiry_to_signal_seconds",
            "From a timer's deadline to its signal being sent.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.registry.register(self)

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        yield GaugeMetricFamily("watchdogd_active_timers", "Timers armed now.", len(self.timers))
        yield GaugeMetricFamily(
            "watchdogd_watched_processes", "Processes held by pidfd.", len(self.processes)
        )
        yield GaugeMetricFamily(
            "watchdogd_connections", "Open socket connections.", stats.connections
        )
        requests = CounterMetricFamily(
            "watchdogd_requests", "Requests served.", labels=["transport", "op"]
        )
        for key, count in sorted(stats.requests.items()):
            transport, _, op = key.partition(".")
            requests.add_metric([transport, op or "timer"], count)
        yield requests
        expiries = CounterMetricFamily(
            "watchdogd_expiries",
            "Timers that expired (injected: a drill's fault caused it).",
            labels=["injected"],
        )
        expiries.add_metric(["false"], stats.expired - stats.expired_injected)
        expiries.add_metric(["true"], stats.expired_injected)
        yield expiries
        kills = CounterMetricFamily("watchdogd_kills", "Signals sent.", labels=["signal"])
        for signum, count in sorted(stats.signals.items()):
            kills.add_metric([str(signum)], count)
        yield kills
        yield CounterMetricFamily(
            "watchdogd_escalations", "SIGKILLs after a grace.", stats.escalated
        )
        refusals = CounterMetricFamily("watchdogd_refusals", "Refused requests.", labels=["reason"])
        for code, count in sorted(stats.refusals.items()):
            refusals.add_metric([code], count)
        yield refusals
        bad = CounterMetricFamily("watchdogd_bad_input", "Undecodable input.", labels=["transport"])
        for transport, count in sorted(stats.bad_inputs.items()):
            bad.add_metric([transport], count)
        yield bad
        refused = CounterMetricFamily(
            "watchdogd_connections_refused", "Connections refused at accept.", labels=["limit"]
        )
        for limit, count in sorted(stats.connections_refused.items()):
            refused.add_metric([limit], count)
        yield refused
        suppressed = CounterMetricFamily(
            "watchdogd_events_suppressed",
            "Events counted but not recorded (max_noisy_events_per_s).",
            labels=["event"],
        )
        for name, count in sorted(stats.suppressed.items()):
            suppressed.add_metric([name], count)
        yield suppressed
        groups = GaugeMetricFamily("watchdogd_groups", "Worker groups.", labels=["state"])
        states = list(self.groups())
        for state in GroupState:
            groups.add_metric([state.value], sum(1 for s, _ in states if s is state))
        yield groups
        yield CounterMetricFamily(
            "watchdogd_worker_restarts",
            "Group restarts after failures.",
            sum(restarts for _, restarts in states),
        )
        yield from self._per_group()
        yield from self._stragglers()
        yield GaugeMetricFamily(
            "watchdogd_event_loop_lag_seconds",
            "How late the event loop woke for its last tick.",
            max(self.loop.lag, self.loop.stalled_for()),
        )

    def _per_group(self) -> Iterator[Metric]:
        left = _group_gauge("watchdogd_group_restarts_left", "Restarts a group has left.")
        round_ = _group_gauge("watchdogd_rendezvous_round", "The group's rendezvous round.")
        waiting = _group_gauge(
            "watchdogd_rendezvous_waiting_nodes",
            "Nodes waiting to join the group's job (a scale-up restart is coming).",
        )
        standby = _group_gauge(
            "watchdogd_rendezvous_standby",
            "1 while this node stands by beside a full round, to take a lost node's rank.",
        )
        quarantined = _group_gauge(
            "watchdogd_quarantined",
            "1 while this node is set aside, out of the group's job until an operator clears it.",
        )
        peak = GaugeMetricFamily(
            "watchdogd_worker_memory_peak_bytes",
            "The most memory a worker's cell held at once (where it has a memory cgroup).",
            labels=["group", "rank"],
        )
        oom = CounterMetricFamily(
            "watchdogd_worker_oom_kills",
            "Processes of a group's workers' cells the kernel's OOM killer ended.",
            labels=["group"],
        )
        spares_ready = _group_gauge(
            "watchdogd_spares_ready",
            "Warm spares ready to take a rank (--prewarm): back to nproc once the pool refilled.",
        )
        no_progress = _group_gauge(
            "watchdogd_group_failed_without_progress",
            "Attempts in a row that failed without a new step (past max_no_progress_restarts "
            "the run ends, not to be requeued).",
        )
        for info in self.infos():
            left.add_metric([info.name], info.restarts_left)
            no_progress.add_metric([info.name], info.failed_without_progress)
            if info.spares:
                spares_ready.add_metric([info.name], sum(s.ready for s in info.spares))
            rdzv = info.rendezvous
            if rdzv is not None and rdzv.round is not None:
                round_.add_metric([info.name], rdzv.round)
            if rdzv is not None:
                waiting.add_metric([info.name], rdzv.waiting)
                standby.add_metric([info.name], int(rdzv.standby))
                quarantined.add_metric([info.name], int(rdzv.quarantined is not None))
            for worker in info.workers:
                if worker.memory_peak_bytes is not None:
                    peak.add_metric([info.name, str(worker.rank)], worker.memory_peak_bytes)
            oom.add_metric([info.name], info.oom_kills)
        yield from (
            left,
            no_progress,
            spares_ready,
            round_,
            waiting,
            standby,
            quarantined,
            peak,
            oom,
        )

    def _stragglers(self) -> Iterator[Metric]:
        watch = self.stragglers
        flagged = GaugeMetricFamily(
            "watchdogd_stragglers",
            "Worker ranks flagged as stragglers now, per scope (1 each; injected: a drill's).",
            labels=["group", "scope", "rank", "injected"],
        )
        drilled = watch.drilled.copy()  # one call each: the loop may change the sets
        for key in sorted(watch.board.flagged.copy()):
            injected = "true" if key in drilled else "false"
            flagged.add_metric([key.job, key.scope, str(key.rank), injected], 1)
        yield flagged
        flags = CounterMetricFamily(
            "watchdogd_straggler_flags",
            "Times a rank was flagged as a straggler (injected: a drill caused it).",
            labels=["injected"],
        )
        drill_flags = watch.drill_flags
        flags.add_metric(["false"], watch.board.flags - drill_flags)
        flags.add_metric(["true"], drill_flags)
        yield flags
        yield CounterMetricFamily(
            "watchdogd_straggler_replacements",
            "Times this node left its job for a straggler of its own, for a standby to take "
            "its rank (replace_stragglers_after).",
            watch.replacements,
        )


class Health(msgspec.Struct):
    status: str
    lag_s: float
    last_progress_time: float
    quarantined: str | None = None
    """Why this node is set aside (a group's job keeps it out until an operator clears it)."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news."""


def parse_listen(value: str) -> tuple[str, int]:
    """``PORT`` (loopback) or ``HOST:PORT``."""
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


class HealthServer:
    """``/metrics`` and ``/healthz`` from a thread, alive even when the loop is not."""

    def __init__(self, metrics: Metrics, address: tuple[str, int], max_lag: float) -> None:
        self.metrics = metrics
        self.max_lag = max_lag
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._server: WSGIServer = make_server(
            address[0], address[1], self._app, handler_class=_QuietHandler
        )
        self.address = (address[0], self._server.server_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="watchdogd-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _app(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterator[bytes] | list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            loop = self.metrics.loop
            lag = loop.stalled_for()
            quarantined = self._quarantined()
            healthy = lag < self.max_lag and quarantined is None
            word = "stalled" if lag >= self.max_lag else "quarantined" if quarantined else "ok"
            body = msgspec.json.encode(Health(word, round(lag, 3), loop.last_progress, quarantined))
            status = "200 OK" if healthy else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [body + b"\n"]
        if path == "/metrics":
            result: Iterator[bytes] = self._metrics_app(environ, start_response)
            return result
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"try /metrics or /healthz\n"]

    def _quarantined(self) -> str | None:
        """Why a group's job set this node aside, if one did (a node out of its job is
        not one to schedule onto)."""
        for info in self.metrics.infos():
            if info.rendezvous is not None and info.rendezvous.quarantined is not None:
                return f"{info.name}: {info.rendezvous.quarantined}"
        return None


def _group_gauge(name: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=["group"])
