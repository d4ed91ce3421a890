"""``watchdogctl``: ask a running daemon what it holds.

Each subcommand prints a table for people, or with ``--json`` the reply as
JSON for scripts. Exit status: 0 answered, 1 the daemon refused the request,
3 the daemon is not reachable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

import msgspec
from tabulate import tabulate

from watchdogd_client import (
    DaemonUnavailableError,
    RequestError,
    SocketTimerClient,
    default_socket_path,
)
from watchdogd_client import protocol as p

__all__ = ["main"]

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3


def _signal_name(number: int) -> str:
    if number <= 0:
        return f"{number} (record only)"
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


def cmd_timers(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """List active timers, soonest first."""
    listing = client.request(p.ListTimers(), p.TimerList)
    timers = listing.timers
    if args.json:
        _print_json([msgspec.structs.asdict(t) for t in timers])
        return
    if not timers:
        print("no active timers")
        return
    rows = [
        (t.pid, t.scope_id, f"{t.remaining_s:.3f}", _signal_name(t.signal), t.source, t.uid)
        for t in timers
    ]
    print(tabulate(rows, headers=["PID", "SCOPE", "REMAINING (s)", "SIGNAL", "VIA", "UID"]))
    if listing.total > len(timers):
        print(f"(the {len(timers)} soonest of {listing.total} timers)")


def cmd_status(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Show the daemon's endpoints, counts and counters."""
    status = client.status()
    info = msgspec.structs.asdict(status)
    del info["seq"]
    if args.json:
        _print_json(info)
        return
    requests = info.pop("requests")
    rows = [(key.replace("_", " "), value) for key, value in info.items()]
    rows += [(f"requests {name}", count) for name, count in sorted(requests.items())]
    print(tabulate(rows, tablefmt="plain"))


COMMANDS = {"timers": cmd_timers, "status": cmd_status}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="watchdogctl", description="Query and control a running watchdogd."
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=os.environ.get("WATCHDOGD_SOCKET") or str(default_socket_path()),
        help="the daemon's socket (default: $WATCHDOGD_SOCKET, else %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, handler in COMMANDS.items():
        sub = commands.add_parser(name, help=handler.__doc__, description=handler.__doc__)
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with SocketTimerClient(args.socket, name="watchdogctl") as client:
            COMMANDS[args.command](client, args)
    except DaemonUnavailableError as e:
        print(f"watchdogctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RequestError as e:
        print(f"watchdogctl: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
