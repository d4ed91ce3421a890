"""watchdogd against torch's FileTimerServer, side by side, in one run.

    python bench/bench_timers.py            # full run (a few minutes on 2 cores)
    python bench/bench_timers.py --quick    # smaller samples (about a minute)
    python bench/bench_timers.py --json results.json

Measures, for our daemon and for torch.distributed.elastic's
``FileTimerServer``/``FileTimerClient``/``expires``:

1. the client cost of one ``with expires(after=60[, scope="s"])`` block;
2. expiry-to-signal latency with 100,000 other timers armed;
3. requests per second from 4 writer processes, counted by the server, and
   requests lost;
4. server CPU while idle with 10,000 timers, and memory per armed timer.

See bench/README.md for how each number is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from _harness import (
    CTX,
    Child,
    Distribution,
    TorchTimerServer,
    Watchdogd,
    cpu_seconds,
    run_child,
    settled_rss,
    wait_until,
)
from _workers import (
    CostResult,
    Impl,
    LatencyResult,
    WriterResult,
    arm_socket_timers,
    measure_expiry_latency,
    measure_wakeup_floor,
    time_expires_blocks,
    write_requests,
    write_torch_timers,
)
from tabulate import tabulate

OURS: tuple[Impl, Impl] = ("ours-socket", "ours-fifo")
IMPLS: tuple[Impl, Impl, Impl] = (*OURS, "torch")
LABELS: dict[Impl, str] = {
    "ours-socket": "ours socket",
    "ours-fifo": "ours FIFO",
    "torch": "torch",
}
_R = TypeVar("_R")

# Our daemon as benchmarked: its defaults, except that it signals at once
# (no stack capture first: torch captures none) and never escalates the
# latency victim's SIGUSR1 to SIGKILL. The stack dump row uses the default.
OUR_SETTINGS: dict[str, str | float] = {"stack_dumps": "off", "kill_grace": 3600.0}
WITH_STACK_DUMPS: dict[str, str | float] = {"kill_grace": 3600.0}

# Timers that must not expire during the run.
FAR_FUTURE_S = 3600.0


@dataclass(frozen=True)
class Plan:
    """How much of everything to measure."""

    cost_batches: int
    cost_warmup_batches: int
    # Blocks per timed batch: a batch should take about a millisecond.
    cost_batch_sizes: dict[str, int]
    cost_pause_s: float  # untimed, between batches: the server catches up
    latency_fillers: int
    latency_samples: dict[str, int]  # ours-socket, torch, with-dumps, floor
    latency_delay_s: tuple[float, float]
    torch_max_interval: float
    writers: int
    throughput_s: float
    idle_timers: int
    idle_window_s: float
    memory_stages: dict[str, tuple[int, ...]]
    memory_holders: int
    seed: int = 1234


FULL = Plan(
    cost_batches=200,
    cost_warmup_batches=10,
    cost_batch_sizes={
        "ours-scoped": 100,
        "ours-scopeless": 100,
        "torch-scoped": 10,
        "torch-scopeless": 2,
    },
    cost_pause_s=0.01,
    latency_fillers=100_000,
    latency_samples={"ours-socket": 100, "torch": 30, "with-dumps": 30, "floor": 60},
    latency_delay_s=(0.05, 0.2),
    torch_max_interval=0.1,
    writers=4,
    throughput_s=3.0,
    idle_timers=10_000,
    idle_window_s=10.0,
    memory_stages={"ours-socket": (100_000, 1_000_000), "torch": (100_000, 1_000_000)},
    memory_holders=4,
)

QUICK = replace(
    FULL,
    cost_batches=40,
    cost_warmup_batches=3,
    latency_samples={"ours-socket": 25, "torch": 10, "with-dumps": 10, "floor": 25},
    throughput_s=1.0,
    idle_window_s=3.0,
    memory_stages={"ours-socket": (100_000,), "torch": (100_000,)},
)


# -- results ------------------------------------------------------------------


@dataclass(frozen=True)
class CostReport:
    impl: Impl
    scoped: bool
    block_us: Distribution  # one value per batch: the batch's mean block cost
    blocks: int
    client_errors: dict[str, int]
    stack_depth: int


@dataclass(frozen=True)
class LatencyReport:
    impl: Impl
    other_timers: int
    latency_ms: Distribution
    missed: int
    senders: list[int]
    samples_ms: list[float]
    # Our daemon only: how late it sent each signal, by its own clock (event
    # log ``late_ms``); the rest of ``latency_ms`` is the signal's delivery.
    daemon_late_ms: Distribution | None = None
    stack_dumps: bool = False  # our daemon captured the stacks before signalling


@dataclass(frozen=True)
class ThroughputReport:
    impl: Impl
    writers: int
    sent: int  # calls that returned without an error
    registered: int  # counted by the server
    lost: int  # sent but never registered
    client_errors: dict[str, int]  # calls that raised, by exception type
    registered_despite_error: int  # registered beyond what was sent: calls that raised
    seconds: float  # first writer's start to the server's last registration
    per_second: float  # registered / seconds


@dataclass(frozen=True)
class IdleCpuReport:
    impl: Impl
    timers: int
    window_s: float
    cpu_s: float
    core_percent: float


@dataclass(frozen=True)
class MemoryReport:
    impl: Impl
    timers: int
    rss_before: int
    rss_after: int
    bytes_per_timer: float
    fill_s: float  # time to arm the stage's timers and see them all registered


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    value: str
    met: bool


@dataclass
class Results:
    quick: bool
    environment: dict[str, str]
    plan: Plan
    cost: list[CostReport] = field(default_factory=list)
    latency: list[LatencyReport] = field(default_factory=list)
    throughput: list[ThroughputReport] = field(default_factory=list)
    idle_cpu: list[IdleCpuReport] = field(default_factory=list)
    memory: list[MemoryReport] = field(default_factory=list)
    wakeup_floor_ms: Distribution | None = None
    daemon_config: str = ""
    goals: list[Goal] = field(default_factory=list)
    wall_s: float = 0.0


# -- helpers ------------------------------------------------------------------

_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal shares."""
    share, extra = divmod(total, parts)
    return [share + (1 if k < extra else 0) for k in range(parts)]


def _drain(count: Callable[[], int], target: int, quiet_s: float) -> tuple[int, float | None]:
    """Poll ``count()`` until it reaches ``target`` or stops growing for ``quiet_s``.

    Returns the final count and when it last grew (None: it had already
    reached ``target`` at the first look).
    """
    last = count()
    if last >= target:
        return last, None
    grew_at = time.monotonic()
    while last < target:
        time.sleep(0.002)
        now_count, now = count(), time.monotonic()
        if now_count != last:
            last, grew_at = now_count, now
        elif now - grew_at > quiet_s:
            break
    return last, grew_at


def _wait_for_timers(
    timers: Callable[[], int],
    target: int,
    what: str,
    timeout: float = 600,
    *,
    exact: bool = False,
) -> None:
    """Wait until ``timers()`` reaches ``target`` (equals it, with ``exact``)."""

    def reached() -> bool:
        count = timers()
        return count == target if exact else count >= target

    wait_until(reached, timeout, what, interval=0.05)


# -- 1. client cost -----------------------------------------------------------


def measure_client_cost(
    plan: Plan, endpoints: dict[Impl, str], results: Results, timeout: float = 300
) -> None:
    for scoped in (True, False):
        for impl in IMPLS:
            kind = f"{'torch' if impl == 'torch' else 'ours'}-{'scoped' if scoped else 'scopeless'}"
            batch_size = plan.cost_batch_sizes[kind]
            log(f"client cost: {LABELS[impl]}, {'scope=' if scoped else 'no scope'}")
            result: CostResult = run_child(
                time_expires_blocks,
                impl,
                endpoints[impl],
                scoped,
                plan.cost_batches,
                batch_size,
                plan.cost_warmup_batches,
                plan.cost_pause_s,
                timeout=timeout,
            )
            results.cost.append(
                CostReport(
                    impl=impl,
                    scoped=scoped,
                    block_us=Distribution.of(result.block_ns, scale=1e-3),
                    blocks=result.blocks,
                    client_errors=result.errors,
                    stack_depth=result.stack_depth,
                )
            )


# -- 2. expiry latency ---------------------------------------------------------


def _daemon_lateness(ours: Watchdogd, prefix: str) -> Distribution:
    late_ms = [
        float(event["metadata"]["late_ms"])
        for event in ours.events("timer_expired")
        if str(event["metadata"].get("scope_id", "")).startswith(prefix)
        and "late_ms" in event["metadata"]
    ]
    return Distribution.of(late_ms)


Server = Watchdogd | TorchTimerServer


def _holder(server: Server, count: int, prefix: str) -> Child:
    """A child that arms ``count`` far-future timers in ``server`` and holds them until stopped.

    Our daemon gets them by socket, torch's server by its FIFO.
    """
    if isinstance(server, Watchdogd):
        return Child(
            arm_socket_timers, str(server.socket_path), count, FAR_FUTURE_S, prefix, hold=True
        )
    return Child(write_torch_timers, str(server.fifo_path), count, FAR_FUTURE_S, prefix, hold=True)


def _latency_run(plan: Plan, server: Server, samples: int, results: Results) -> None:
    """Arm the filler timers from a live process, then time ``samples`` expiries."""
    ours = server if isinstance(server, Watchdogd) else None
    impl: Impl = "torch" if ours is None else "ours-socket"
    endpoint = str(server.fifo_path if ours is None else ours.socket_path)
    fillers = plan.latency_fillers
    dumps = " with stack dumps" if ours is not None and ours.stack_dumps else ""
    log(f"expiry latency: {LABELS[impl]}{dumps}, arming {fillers:,} other timers")
    wait_s = 5.0  # how long past its expiration a signal may be late before it counts as missed
    with _holder(server, fillers, "filler-") as filler:
        filler.result(timeout=600)
        _wait_for_timers(server.timers, fillers, f"{fillers:,} timers in {impl}")
        log(f"expiry latency: {LABELS[impl]}, {samples} samples")
        result: LatencyResult = run_child(
            measure_expiry_latency,
            impl,
            endpoint,
            samples,
            plan.latency_delay_s,
            wait_s,
            plan.seed,
            timeout=samples * (plan.latency_delay_s[1] + wait_s) + 60,
        )
    # The filler exited: both servers drop a dead process's timers.
    _wait_for_timers(server.timers, 0, f"{impl} to drop the filler's timers", exact=True)
    results.latency.append(_latency_report(impl, fillers, result, ours))


def _latency_report(
    impl: Impl, other_timers: int, result: LatencyResult, ours: Watchdogd | None
) -> LatencyReport:
    return LatencyReport(
        impl=impl,
        other_timers=other_timers,
        latency_ms=Distribution.of(result.latencies_s, scale=1e3),
        missed=result.missed,
        senders=result.senders,
        samples_ms=[round(s * 1e3, 3) for s in result.latencies_s],
        daemon_late_ms=None if ours is None else _daemon_lateness(ours, "latency-"),
        stack_dumps=ours is not None and ours.stack_dumps,
    )


def measure_latency(
    plan: Plan, ours: Watchdogd, torch_server: TorchTimerServer, results: Results
) -> None:
    """One server at a time, so that neither one's load slows the other."""
    log("expiry latency: this machine's wake-up floor")
    floor: list[float] = run_child(
        measure_wakeup_floor,
        plan.latency_samples["floor"],
        plan.latency_delay_s,
        plan.seed,
        timeout=plan.latency_samples["floor"] * plan.latency_delay_s[1] + 60,
    )
    results.wakeup_floor_ms = Distribution.of(floor, scale=1e3)
    _latency_run(plan, ours, plan.latency_samples["ours-socket"], results)
    _latency_run(plan, torch_server, plan.latency_samples["torch"], results)


def measure_latency_with_stack_dumps(plan: Plan, workdir: Path, results: Results) -> None:
    """Our daemon with stack dumps as it ships (on): it captures stacks, then signals."""
    with Watchdogd(workdir / "dumps", WITH_STACK_DUMPS) as ours:
        _latency_run(plan, ours, plan.latency_samples["with-dumps"], results)


# -- 3. throughput ------------------------------------------------------------


def measure_throughput(
    plan: Plan,
    ours: Watchdogd,
    torch_server: TorchTimerServer,
    endpoints: dict[Impl, str],
    results: Results,
) -> None:
    def socket_count() -> int:
        requests = ours.status().requests
        return requests.get("socket.acquire", 0) + requests.get("socket.release", 0)

    def fifo_count() -> int:
        return ours.status().requests.get("fifo", 0)

    def torch_count() -> int:
        return torch_server.stats().requests

    counters: dict[Impl, Callable[[], int]] = {
        "ours-socket": socket_count,
        "ours-fifo": fifo_count,
        "torch": torch_count,
    }
    for impl in IMPLS:
        log(f"throughput: {LABELS[impl]}, {plan.writers} writers for {plan.throughput_s:.0f}s")
        count = counters[impl]
        before = count()
        barrier = CTX.Barrier(plan.writers + 1)
        with contextlib.ExitStack() as stack:
            writers = [
                stack.enter_context(
                    Child(write_requests, impl, endpoints[impl], plan.throughput_s, barrier)
                )
                for _ in range(plan.writers)
            ]
            barrier.wait(timeout=120)
            reports: list[WriterResult] = [
                w.result(timeout=plan.throughput_s + 120) for w in writers
            ]
        sent = sum(r.sent for r in reports)
        # torch's server registers what it read once per loop (max_interval).
        final, grew_at = _drain(count, before + sent, quiet_s=max(1.0, 5 * plan.torch_max_interval))
        started = min(r.started for r in reports)
        finished = max(r.finished for r in reports)
        if grew_at is not None:
            finished = max(finished, grew_at)
        registered = final - before
        seconds = finished - started
        errors: Counter[str] = Counter()
        for r in reports:
            errors.update(r.errors)
        results.throughput.append(
            ThroughputReport(
                impl=impl,
                writers=plan.writers,
                sent=sent,
                registered=registered,
                lost=max(0, sent - registered),
                client_errors=dict(errors),
                registered_despite_error=max(0, registered - sent),
                seconds=seconds,
                per_second=registered / seconds,
            )
        )


# -- 4. idle CPU and memory ---------------------------------------------------


def measure_idle_cpu(
    plan: Plan, ours: Watchdogd, torch_server: TorchTimerServer, results: Results
) -> None:
    """Both servers idle in the same window, each holding ``idle_timers`` far-future timers."""
    count = plan.idle_timers
    log(f"idle CPU: arming {count:,} timers in each server")
    with (
        _holder(ours, count, "idle-") as ours_holder,
        _holder(torch_server, count, "idle-") as torch_holder,
    ):
        ours_holder.result(timeout=300)
        torch_holder.result(timeout=300)
        _wait_for_timers(ours.timers, count, "our timers", exact=True)
        _wait_for_timers(torch_server.timers, count, "torch's timers", exact=True)
        time.sleep(1.0)  # let the fill's work settle
        log(f"idle CPU: measuring for {plan.idle_window_s:.0f}s")
        pids: dict[Impl, int] = {"ours-socket": ours.pid, "torch": torch_server.pid}
        before = {impl: cpu_seconds(pid) for impl, pid in pids.items()}
        started = time.monotonic()
        time.sleep(plan.idle_window_s)
        window = time.monotonic() - started
        used = {impl: cpu_seconds(pid) - before[impl] for impl, pid in pids.items()}
    for impl, cpu in used.items():
        results.idle_cpu.append(IdleCpuReport(impl, count, window, cpu, 100 * cpu / window))


def measure_our_memory(plan: Plan, workdir: Path, results: Results) -> None:
    with Watchdogd(workdir / "mem", OUR_SETTINGS) as ours, contextlib.ExitStack() as holders:
        rss_before = settled_rss(ours.pid)
        armed = 0
        for stage in plan.memory_stages["ours-socket"]:
            log(f"memory: our daemon, arming up to {stage:,} timers")
            started = time.monotonic()
            children = [
                holders.enter_context(_holder(ours, share, f"m{stage}-"))
                for share in _split(stage - armed, plan.memory_holders)
            ]
            for child in children:
                child.result(timeout=600)  # each synced: the daemon holds its timers
            fill_s = time.monotonic() - started
            armed = stage
            timers = ours.status().timers
            if timers != stage:
                raise RuntimeError(f"our daemon holds {timers:,} timers, expected {stage:,}")
            rss_after = settled_rss(ours.pid)
            results.memory.append(
                MemoryReport(
                    "ours-socket",
                    stage,
                    rss_before,
                    rss_after,
                    (rss_after - rss_before) / stage,
                    fill_s,
                )
            )


def measure_torch_memory(plan: Plan, workdir: Path, results: Results) -> None:
    fifo = workdir / "mem-torch.fifo"
    with (
        TorchTimerServer(fifo, plan.torch_max_interval) as server,
        contextlib.ExitStack() as holders,
    ):
        rss_before = settled_rss(server.pid)
        armed = 0
        for stage in plan.memory_stages["torch"]:
            log(f"memory: torch's server, writing up to {stage:,} timers")
            started = time.monotonic()
            child = holders.enter_context(_holder(server, stage - armed, f"m{stage}-"))
            child.result(timeout=900)
            _wait_for_timers(server.timers, stage, f"{stage:,} timers in torch's server", 900)
            fill_s = time.monotonic() - started
            armed = stage
            rss_after = settled_rss(server.pid)
            results.memory.append(
                MemoryReport(
                    "torch", stage, rss_before, rss_after, (rss_after - rss_before) / stage, fill_s
                )
            )


# -- goals and the report -----------------------------------------------------


def _find(items: Sequence[_R], **attrs: object) -> _R | None:
    """The first of ``items`` whose attributes equal ``attrs``."""
    for item in items:
        if all(getattr(item, key) == value for key, value in attrs.items()):
            return item
    return None


def evaluate_goals(results: Results) -> list[Goal]:
    goals: list[Goal] = []
    # Scoped: 6x since every arm and release is a frame again (the house renovated:
    # no shared memory, provable before fast); the last microsecond is not worth a false kill.
    for scoped, factor in ((True, 6), (False, 100)):
        torch_cost = _find(results.cost, impl="torch", scoped=scoped)
        for impl in OURS:
            ours_cost = _find(results.cost, impl=impl, scoped=scoped)
            if torch_cost is None or ours_cost is None:
                continue
            times = torch_cost.block_us.median / ours_cost.block_us.median
            what = 'expires(60, scope="s")' if scoped else "expires(60), no scope"
            goals.append(
                Goal(
                    f"{what} block, {LABELS[impl]}: median cheaper than torch",
                    f">= {factor}x",
                    f"{times:.1f}x",
                    times >= factor,
                )
            )
    latency = _find(results.latency, impl="ours-socket", stack_dumps=False)
    if latency is not None:
        goals.append(
            Goal(
                f"expiry-to-signal p99, ours, {latency.other_timers:,} other timers",
                "< 5 ms",
                f"{latency.latency_ms.p99:.2f} ms",
                latency.latency_ms.p99 < 5 and latency.missed == 0,
            )
        )
    torch_rate = _find(results.throughput, impl="torch")
    for impl in OURS:
        rate = _find(results.throughput, impl=impl)
        if rate is None:
            continue
        if torch_rate is not None:
            times = rate.per_second / torch_rate.per_second
            goals.append(
                Goal(
                    f"requests/s, {LABELS[impl]} vs torch",
                    ">= 10x",
                    f"{times:.1f}x",
                    times >= 10,
                )
            )
        goals.append(
            Goal(
                f"requests lost, {LABELS[impl]}",
                "0",
                f"{rate.lost} (client errors: {sum(rate.client_errors.values())})",
                rate.lost == 0 and not rate.client_errors,
            )
        )
    ours_memory = [m for m in results.memory if m.impl == "ours-socket"]
    if ours_memory:
        largest = max(ours_memory, key=lambda m: m.timers)
        goals.append(
            Goal(
                f"memory per timer, ours, at {largest.timers:,} timers",
                "< 300 B",
                f"{largest.bytes_per_timer:.0f} B",
                largest.bytes_per_timer < 300,
            )
        )
    return goals


def _num(value: float, digits: int = 2) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(ours: float | None, torch: float | None) -> str:
    if ours is None or torch is None or not torch or math.isnan(ours) or math.isnan(torch):
        return ""
    return f"{ours / torch:.3g}"


def render_table(results: Results) -> str:
    """One row per measurement and statistic; ``x/torch`` columns are ours divided by torch."""
    headers = ["measurement", "stat", *(LABELS[impl] for impl in IMPLS), "socket/torch"]
    headers += ["FIFO/torch"]
    rows: list[list[str]] = []

    def add(
        name: str, stat: str, values: dict[Impl, float], digits: int = 2, ratio: bool = True
    ) -> None:
        """A row; counts (``ratio=False``) get no ours/torch ratio."""

        def cell(impl: Impl) -> str:
            value = values.get(impl)
            return "" if value is None else _num(value, digits)

        def ratio_to_torch(impl: Impl) -> str:
            return _ratio(values.get(impl), values.get("torch")) if ratio else ""

        rows.append(
            [name, stat, *(cell(impl) for impl in IMPLS), *(ratio_to_torch(i) for i in OURS)]
        )

    for scoped in (True, False):
        reports = {c.impl: c for c in results.cost if c.scoped == scoped}
        name = 'expires(60, scope="s") block, µs' if scoped else "expires(60) block, no scope, µs"
        add(name, "median", {impl: r.block_us.median for impl, r in reports.items()})
        add("", "p99", {impl: r.block_us.p99 for impl, r in reports.items()})

    plain = [r for r in results.latency if not r.stack_dumps]
    if plain:
        latency = {r.impl: r.latency_ms for r in plain}
        name = f"expiry -> signal, {plain[0].other_timers:,} other timers, ms"
        add(name, "p50", {impl: d.median for impl, d in latency.items()})
        add("", "p99", {impl: d.p99 for impl, d in latency.items()})
        add("", "max", {impl: d.max for impl, d in latency.items()})
        add("", "samples", {impl: d.n for impl, d in latency.items()}, 0, ratio=False)
    for dumps in (r for r in results.latency if r.stack_dumps):
        name = "  same, stack dumps on (default), ms"
        add(name, "p50", {dumps.impl: dumps.latency_ms.median})
        add("", "p99", {dumps.impl: dumps.latency_ms.p99})

    if results.throughput:
        rate = {r.impl: r for r in results.throughput}
        writers = results.throughput[0].writers
        add(
            f"requests/s registered, {writers} writers",
            "rate",
            {impl: r.per_second for impl, r in rate.items()},
            0,
        )
        add("", "sent", {impl: r.sent for impl, r in rate.items()}, 0, ratio=False)
        add("", "lost", {impl: r.lost for impl, r in rate.items()}, 0, ratio=False)
        errors = {impl: sum(r.client_errors.values()) for impl, r in rate.items()}
        add("", "client errors", dict(errors), 0, ratio=False)

    if results.idle_cpu:
        timers = results.idle_cpu[0].timers
        window = results.idle_cpu[0].window_s
        add(
            f"idle CPU, {timers:,} timers, {window:.0f}s, % of a core",
            "mean",
            {r.impl: r.core_percent for r in results.idle_cpu},
            3,
        )

    for stage in sorted({m.timers for m in results.memory}):
        memory = {m.impl: m.bytes_per_timer for m in results.memory if m.timers == stage}
        add(f"memory per timer at {stage:,} timers, B", "RSS delta", dict(memory), 0)

    align = ("left", "left", *["right"] * (len(headers) - 2))
    table = tabulate(rows, headers=headers, disable_numparse=True, colalign=align)
    goal_rows = [[g.name, g.target, g.value, "yes" if g.met else "NO"] for g in results.goals]
    goals = tabulate(goal_rows, headers=["goal", "target", "measured", "met"])
    return f"{table}\n\n{goals}\n\n{_notes(results)}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{name} x{count}" for name, count in sorted(errors.items()))


def _notes(results: Results) -> str:
    notes = []
    depth = {cost.stack_depth for cost in results.cost if not cost.scoped}
    if depth:
        notes.append(f"- scope-less blocks ran {max(depth)} frames deep (torch walks them all)")
    for cost in results.cost:
        if cost.client_errors:
            errors = _errors(cost.client_errors)
            notes.append(f"- {LABELS[cost.impl]} expires blocks: client errors: {errors}")
    for rate in results.throughput:
        if rate.client_errors:
            notes.append(
                f"- {LABELS[rate.impl]} writers: client errors: {_errors(rate.client_errors)}"
            )
        if rate.registered_despite_error:
            notes.append(
                f"- {LABELS[rate.impl]}: {rate.registered_despite_error} requests whose call "
                "raised were registered anyway"
            )
    floor = results.wakeup_floor_ms
    if floor is not None:
        notes.append(
            f"- wake-up floor of this machine (a sigtimedwait timeout, no server): "
            f"p50 {floor.median:.2f} ms, p99 {floor.p99:.2f} ms, max {floor.max:.2f} ms late"
        )
    for latency in results.latency:
        dumps = ", stack dumps on" if latency.stack_dumps else ""
        if latency.missed:
            notes.append(
                f"- {LABELS[latency.impl]}{dumps}: {latency.missed} expiry signals never came"
            )
        late = latency.daemon_late_ms
        if late is not None and late.n:
            notes.append(
                f"- expiry{dumps}: our daemon sent its signals p50 {late.median:.2f} ms / p99 "
                f"{late.p99:.2f} ms / max {late.max:.2f} ms after the deadline (late_ms in its "
                "event log); the rest of the latency is the signal's delivery"
            )
    for memory in results.memory:
        notes.append(
            f"- memory: {LABELS[memory.impl]} took {memory.fill_s:.1f}s to register "
            f"{memory.timers:,} timers, writers' start-up included (RSS "
            f"{memory.rss_before / 2**20:.0f} -> "
            f"{memory.rss_after / 2**20:.0f} MiB)"
        )
    if results.latency:
        notes.append(f"- torch's server runs with max_interval={results.plan.torch_max_interval}")
    notes.append(
        f"- run took {results.wall_s:.0f}s; load average at its start: "
        f"{results.environment['loadavg_at_start']} (other work on the machine adds noise)"
    )
    return "notes:\n" + "\n".join(notes)


# -- main ---------------------------------------------------------------------


def environment() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "python": platform.python_version(),
        "watchdogd": version("watchdogd"),
        "torch": version("torch"),
        "msgspec": version("msgspec"),
        "uvloop": version("uvloop"),
        "kernel": platform.release(),
        "cpus": str(os.cpu_count()),
        "loadavg_at_start": " ".join(f"{load:.2f}" for load in os.getloadavg()),
    }


def run(plan: Plan, quick: bool) -> Results:
    results = Results(quick=quick, environment=environment(), plan=plan)
    workdir = Path(tempfile.mkdtemp(prefix="wdb-", dir="/tmp"))
    try:
        with (
            Watchdogd(workdir / "ours", OUR_SETTINGS) as ours,
            TorchTimerServer(workdir / "torch.fifo", plan.torch_max_interval) as torch_server,
        ):
            endpoints: dict[Impl, str] = {
                "ours-socket": str(ours.socket_path),
                "ours-fifo": str(ours.fifo_path),
                "torch": str(torch_server.fifo_path),
            }
            measure_client_cost(plan, endpoints, results)
            measure_throughput(plan, ours, torch_server, endpoints, results)
            measure_latency(plan, ours, torch_server, results)
            measure_idle_cpu(plan, ours, torch_server, results)
            results.daemon_config = ours.config_text
        measure_latency_with_stack_dumps(plan, workdir, results)
        measure_our_memory(plan, workdir, results)
        measure_torch_memory(plan, workdir, results)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results.goals = evaluate_goals(results)
    results.wall_s = time.monotonic() - _T0
    return results


def _json_safe(value: object) -> object:
    """``asdict`` output with NaN/inf as null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark watchdogd against torch's FileTimerServer, side by side."
    )
    parser.add_argument("--quick", action="store_true", help="smaller samples (about a minute)")
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    results = run(plan, quick=args.quick)
    print(render_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(_json_safe(asdict(results)), indent=2) + "\n")
        log(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
