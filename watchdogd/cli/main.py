"""``watchdogd``: the daemon's command line.

Layers, as in uvicorn: this module parses flags into one :class:`Config`
(the file, then only the flags given on top), then runs :class:`Daemon`.
``main(argv)`` returns the exit status instead of exiting:

====  ======================================================
0     stopped cleanly (SIGTERM, SIGINT)
2     bad usage or an invalid config (the message names the key)
3     an endpoint cannot be created or another daemon owns it
====  ======================================================

``watchdogd run`` has its own (:mod:`watchdogd.cli.run`): 0, 1 (failed, a
requeue may help), 2 (usage), 93 (do not requeue: no progress).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from functools import partial

import anyio

from watchdogd import __version__
from watchdogd.cli import run as launch
from watchdogd.core.config import Config, ConfigError, override
from watchdogd.daemon import Daemon
from watchdogd.linux import aio as _aio
from watchdogd.linux.config_file import load_config
from watchdogd.linux.endpoints import EndpointError
from watchdogd.linux.logsink import stderr_logging
from watchdogd.linux.priority import prepare_loop_priority
from watchdogd.linux.proctitle import name_process

__all__ = ["main"]

log = logging.getLogger("watchdogd")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_ENDPOINT = 3

PROCESS_NAME = "watchdogd-serve"
"""What ``pgrep``/``pidof`` find the daemon by (``watchdogd`` is a kernel thread's name)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="watchdogd",
        description="Per-node watchdog: deadline timers for training processes, "
        "killing the ones that hang.",
    )
    parser.add_argument("--version", action="version", version=f"watchdogd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the timer daemon in the foreground. With no config it uses the "
        "embedded default: a runtime dir under $XDG_RUNTIME_DIR/watchdogd or "
        "/tmp/watchdogd-<uid> (as root: /run/watchdogd) holding watchdogd.sock and "
        "timer.fifo. Flags override the config file.",
    )
    serve.add_argument("--config", metavar="FILE", help="TOML config (see systemd/watchdogd.toml)")
    serve.add_argument("--runtime-dir", metavar="DIR", help="directory for the socket and FIFO")
    serve.add_argument("--socket", metavar="PATH", help="Unix socket path")
    serve.add_argument("--fifo", metavar="PATH", help="FIFO path (torch's TORCHELASTIC_TIMER_FILE)")
    serve.add_argument("--event-log", metavar="FILE", help="append events as JSON lines to FILE")
    serve.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default: info"
    )
    run = commands.add_parser(
        "run",
        help="launch one worker group in the foreground, like torchrun",
        description=launch.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_run_arguments(run)
    return parser


def build_config(args: argparse.Namespace) -> Config:
    """The config file, with the flags that were given laid over it."""
    config = load_config(args.config)
    overrides = {
        "runtime_dir": args.runtime_dir,
        "socket": args.socket,
        "fifo": args.fifo,
        "event_log": args.event_log,
        "log_level": args.log_level,
    }
    given = {key: value for key, value in overrides.items() if value is not None}
    return override(config, "flags", **given) if given else config


async def _until_stopped(daemon: Daemon, args: argparse.Namespace) -> None:
    """Signals are commands: SIGHUP reloads the config, SIGTERM and SIGINT stop.

    Once stopping, a second SIGINT finds Python's own handler back and
    interrupts the graceful shutdown.
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum != signal.SIGHUP:
                return
            try:
                daemon.reload(build_config(args))
            except ConfigError as e:
                log.error("reload refused, the running config stays: %s", e)


def _raise_open_file_limit() -> None:
    # One pidfd per process with timers, one per worker: use what we may.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _prepare_loop_priority(config: Config, level: int) -> None:
    """On the thread that will run the loop, before it starts any other."""
    problem = prepare_loop_priority(config.loop_nice, config.loop_realtime)
    if problem is not None:
        log.log(level, "%s", problem)


def _serve(config: Config, args: argparse.Namespace) -> int:
    # `pidof watchdogd` finds the kernel's own [watchdogd] thread: this name is ours alone.
    options = sys.argv[1:]
    if "serve" in options:
        options.remove("serve")
    name_process(PROCESS_NAME, [PROCESS_NAME, *options])
    _raise_open_file_limit()
    _prepare_loop_priority(config, logging.INFO)
    try:
        daemon = Daemon(config)
    except ConfigError as e:  # an event handler the config names cannot be had
        print(f"watchdogd: {e}", file=sys.stderr)
        return EXIT_USAGE

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(
                partial(daemon.serve, shutdown_trigger=partial(_until_stopped, daemon, args))
            )
            # One write, newline included: the log thread writes to the same
            # terminal and must not land inside the banner.
            sys.stdout.write(
                f"watchdogd {__version__} (pid {os.getpid()}) serving\n"
                f"  socket: {daemon.socket_path}   (WATCHDOGD_SOCKET)\n"
                f"  fifo:   {daemon.fifo_path}   (TORCHELASTIC_TIMER_FILE)\n"
            )
            sys.stdout.flush()

    _aio.run(run)
    return EXIT_OK


def _parse_known(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, but a flag it does not know is shown with the usage of the
    command that was given (``watchdogd run``'s), not the top-level one."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    if argv[:1] != ["run"] or "--" not in argv:
        return _parse_known(parser, argv)
    # `run [FLAGS] -- CMD ARGS`: everything after the first "--" is the command,
    # unless a script came before it, whose arguments then include the rest.
    split = argv.index("--")
    args = _parse_known(parser, argv[:split])
    if args.training_script is None:
        args.training_script, args.training_script_args = "--", argv[split + 1 :]
    else:
        args.training_script_args += argv[split:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.command == "run":
        with stderr_logging(launch.log_level(args), "[watchdogd] %(message)s"):
            config = Config()
            _prepare_loop_priority(config, logging.DEBUG)  # an unprivileged user's run: no noise
            return launch.run(args, config)
    try:
        config = build_config(args)
    except ConfigError as e:
        print(f"watchdogd: {e}", file=sys.stderr)
        return EXIT_USAGE
    with stderr_logging(config.log_level.upper(), "%(asctime)s %(name)s %(levelname)s %(message)s"):
        try:
            return _serve(config, args)
        except* EndpointError as group:
            for error in group.exceptions:
                print(f"watchdogd: {error}", file=sys.stderr)
    return EXIT_ENDPOINT


if __name__ == "__main__":
    sys.exit(main())
