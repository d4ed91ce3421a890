"""One worker group in the foreground, with a timer service of its own.

What ``watchdogd run`` runs for its command line and ``watchdogd.launcher``
for a Python call: a :class:`~watchdogd.daemon.Daemon` on a private
runtime directory (so it never collides with the node's daemon), one group
submitted to it, and the daemon stopped once the group is over. The
runtime directory is also the daemon's state directory (its snapshot, the
stack dumps of hung workers): none of it goes among the user's logs, which
get a directory per run, as torch's do. It is removed on every way out but
for stack dumps, which outlive the run there; a runtime directory whose run
was killed before it could is swept by the next run
(:mod:`watchdogd.linux.run_dirs`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
from anyio.from_thread import start_blocking_portal

from watchdogd.core.config import Config, override
from watchdogd.core.ports import GroupError
from watchdogd.core.run_options import Host, OptionsError, RunOptions
from watchdogd.daemon import Daemon
from watchdogd.groups.runner import GroupRunner, visible_gpus
from watchdogd.groups.starters import WorkerStarter
from watchdogd.groups.supervisor import CONFIG_CONSENT
from watchdogd.linux import aio as _aio
from watchdogd.linux.run_dirs import make_run_dir, sweep, tidy
from watchdogd_client.groups import GroupSpec, GroupState

__all__ = ["Outcome", "check_entrypoint", "run_group", "this_host"]

log = logging.getLogger("watchdogd")


@dataclass
class Outcome:
    """How the run ended."""

    state: GroupState | None = None
    """The group's final state (None: it never ran: see ``error``)."""
    runner: GroupRunner | None = None
    signal: int | None = None
    """A handled signal that stopped the run."""
    error: str | None = None
    """Why the group could not be submitted."""
    dumps: Path | None = None
    """Where stacks of hung workers were kept, if there are any."""
    daemon: Daemon | None = None
    """The daemon that ran it, stopped: its events and timeline remain."""


def this_host() -> Host:
    """What this machine contributes to a group spec: its environment, GPUs, CPUs."""
    return Host(
        environ=os.environ,
        gpus=visible_gpus(),
        cpus=os.cpu_count() or 1,
        executable=sys.executable,
        make_log_dir=_make_run_log_dir,
    )


def _make_run_log_dir(parent: str | None, run_id: str) -> str:
    """torch's ``DefaultLogsSpecs`` run directory: ``<parent>/<run id>_<random>``."""
    root = tempfile.mkdtemp(prefix="watchdogd-logs-") if parent is None else parent
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)


def check_entrypoint(options: RunOptions) -> None:
    """OptionsError (``script``) naming a script or program that is not there, before
    any worker starts; a module (``-m``) is left to the workers' interpreter to find."""
    script = options.script
    if script is None or options.module:
        return
    if options.no_python:
        if shutil.which(script) is None:
            raise OptionsError("script", f"{script}: no such program (or not executable)")
    elif not os.path.exists(script):
        raise OptionsError("script", f"{script}: no such file")


def _run_config(config: Config, spec: GroupSpec) -> tuple[Config, Path | None]:
    """The config with a private runtime dir unless one is set; that dir, if made."""
    changes: dict[str, object] = {}
    timer_file = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if timer_file and config.fifo is None:
        changes["fifo"] = timer_file  # serve torch's path
    health_port = os.environ.get("TORCHELASTIC_HEALTH_CHECK_PORT")
    if health_port and config.metrics_listen is None:
        changes["metrics_listen"] = health_port
    runtime_dir = None
    if config.runtime_dir is None and config.socket is None:
        runtime_dir = make_run_dir()
        changes["runtime_dir"] = str(runtime_dir)
    if config.state_dir is None and runtime_dir is not None:
        # The snapshot and stack dumps are the run's own, never among the user's logs.
        changes["state_dir"] = str(runtime_dir)
    try:
        return override(config, "the run's environment", **changes), runtime_dir
    except BaseException:
        if runtime_dir is not None:
            tidy(runtime_dir)
        raise


def run_group(
    config: Config,
    spec: GroupSpec,
    *,
    signals: Sequence[signal.Signals] = (),
    starter: WorkerStarter | None = None,
    on_started: Callable[[Callable[[int], object]], None] | None = None,
    fault_consent: str = CONFIG_CONSENT,
) -> Outcome:
    """Run ``spec`` to its end; ConfigError (before anything runs) on a bad ``config``.

    ``signals`` are taken on the loop, in this thread (the main one), passed
    to the workers, and stop the group. With ``on_started`` the loop runs in
    a thread of its own instead, in someone else's process (the daemon is
    ``embedded``), and ``on_started`` gets a function that hands it a signal
    from any thread. ``fault_consent``: how the caller's user allows injected
    faults, which a refusal names.
    """
    swept = sweep()
    config, runtime_dir = _run_config(config, spec)
    try:
        daemon = Daemon(config, embedded=on_started is not None, fault_consent=fault_consent)
    except BaseException:
        if runtime_dir is not None:
            tidy(runtime_dir)
        raise
    if swept:
        daemon.events.emit_at(
            logging.DEBUG, "stale_run_dirs_swept", paths=" ".join(map(str, swept))
        )
    if spec.log_dir is not None:
        log.info("log directory set to: %s", spec.log_dir)  # torch's words
    group = _GroupRun(daemon, spec, starter)
    group.outcome.daemon = daemon
    try:
        if on_started is None:
            _aio.run(partial(group.serve, signals))
        else:
            with start_blocking_portal("asyncio", {"use_uvloop": True}) as portal:
                on_started(lambda signum: portal.start_task_soon(group.signalled, signum))
                portal.call(group.serve, ())
    finally:
        if daemon.stacks.directory.is_dir() and daemon.stacks.list():
            group.outcome.dumps = daemon.stacks.directory
        if runtime_dir is not None:
            tidy(runtime_dir)
    outcome = group.outcome
    if outcome.error is None:
        outcome.runner = daemon.supervisor.groups[spec.name]
        if outcome.state is None:
            outcome.state = outcome.runner.state
    return outcome


class _GroupRun:
    """The daemon serving one group until the group is over."""

    def __init__(self, daemon: Daemon, spec: GroupSpec, starter: WorkerStarter | None) -> None:
        self.daemon = daemon
        self.spec = spec
        self.starter = starter
        self.outcome = Outcome()
        self.done = anyio.Event()

    async def signalled(self, signum: int) -> None:
        """Pass ``signum`` to the workers; the group stops, and the run ends once it has."""
        if self.outcome.signal is None:
            self.outcome.signal = signum
        try:
            self.daemon.supervisor.get(self.spec.name).signalled(signum)
        except GroupError:  # not started, or over: nobody to pass it to
            self.done.set()

    def _finished(self, runner: GroupRunner, state: GroupState) -> None:
        self.outcome.state = state
        self.done.set()

    async def serve(self, signals: Sequence[signal.Signals]) -> None:
        async def until_done(received: AsyncIterator[signal.Signals]) -> None:
            async with anyio.create_task_group() as tg:
                if signals:
                    tg.start_soon(forward, received)
                await self.done.wait()
                tg.cancel_scope.cancel()

        async def forward(received: AsyncIterator[signal.Signals]) -> None:
            async for signum in received:
                await self.signalled(signum)

        self.daemon.supervisor.on_finished = self._finished
        # Taken before anything is served: once the health port answers, a signal is
        # the group's to handle, never the default action that would kill the run.
        with anyio.open_signal_receiver(*signals) as received:
            async with anyio.create_task_group() as tg:
                serve = partial(self.daemon.serve, shutdown_trigger=partial(until_done, received))
                await tg.start(serve)
                try:
                    self.daemon.supervisor.submit(self.spec, self.starter)
                except GroupError as e:
                    self.outcome.error = str(e)
                    self.done.set()
