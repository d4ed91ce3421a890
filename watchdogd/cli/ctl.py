"""``watchdogctl``: ask a running daemon what it holds.

Each subcommand prints a table for people, or with ``--json`` the reply as
JSON for scripts. Exit status: 0 answered, 1 the daemon refused the request,
2 bad usage (an unreadable or invalid spec file), 3 the daemon is not reachable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import msgspec
from tabulate import tabulate

from watchdogd.cli.timeline import write_trace
from watchdogd.core.faults import parse_fault
from watchdogd.core.flight_recorder import (
    TRACE_COLUMNS,
    TraceError,
    decode_trace,
    summarize_trace,
    trace_header,
    trace_rows,
)
from watchdogd_client import (
    DaemonUnavailableError,
    RequestError,
    SocketTimerClient,
    default_socket_path,
)
from watchdogd_client import protocol as p
from watchdogd_client.events import Event
from watchdogd_client.groups import GroupInfo, GroupSpec

__all__ = ["main"]

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
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


def cmd_scopes(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """How long each named scope takes, per job and rank (released timers only)."""
    listing = client.scopes()
    if args.json:
        scopes = [msgspec.structs.asdict(s) for s in listing.scopes]
        _print_json({"scopes": scopes, "refused": listing.refused})
        return
    if not listing.scopes:
        print("no scope released yet")
    else:
        rows = [
            (
                s.job or "-",
                s.rank,
                s.scope,
                s.count,
                _ms(s.p50_s),
                _ms(s.p99_s),
                _ms(s.max_s),
                "-" if s.deadline_s is None else f"{s.deadline_s:.3f}",
                s.deadline_source or "-",
            )
            for s in listing.scopes
        ]
        headers = ["JOB", "RANK", "SCOPE", "COUNT", "P50 (ms)", "P99 (ms)", "MAX (ms)"]
        print(tabulate(rows, headers=[*headers, "LEARN DEADLINE (s)", "FROM"]))
        print("(RANK is the pid outside a worker group; MAX decays; LEARN: expires(after=LEARN))")
    if listing.refused:
        print(f"{listing.refused} samples refused: too many distinct scopes (limits.max_scope_*)")


def cmd_stragglers(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Straggler scores per scope of each worker group's ranks (flagged ones marked)."""
    listing = client.stragglers(job=args.job)
    if args.json:
        ranks = [msgspec.structs.asdict(s) for s in listing.stragglers]
        settings = {"window": listing.window, "threshold": listing.threshold}
        _print_json({"stragglers": ranks, **settings, "windows": listing.windows})
        return
    if not listing.stragglers:
        print(f"no rank has completed a window of {listing.window} releases yet")
        return
    rows = [
        (
            s.group,
            s.scope,
            s.rank,
            *((_node(s), s.hostname or "-") if args.job else ()),
            "stale" if s.stale else f"{s.relative:.2f}",
            f"{s.individual:.2f}",
            s.windows,
            _ms(s.p50_s) + (" (device)" if s.device else ""),
            "STRAGGLER" if s.flagged else "",
        )
        for s in listing.stragglers
    ]
    node = ["NODE", "HOST"] if args.job else []
    headers = ["GROUP", "SCOPE", "RANK", *node, "RELATIVE", "INDIVIDUAL", "WINDOWS", "P50 (ms)"]
    print(tabulate(rows, headers=[*headers, "FLAGGED"]))
    print(
        f"(scores over windows of {listing.window} releases, every {max(1, listing.window // 2)}; "
        f"flagged under {listing.threshold} for {listing.windows} scorings in a row)"
    )
    if args.job:
        print("(NODE: the group rank of the node that runs the rank and flags it)")


def _node(info: p.StragglerInfo) -> str:
    return "-" if info.node_rank < 0 else str(info.node_rank)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g}"


def _duration(seconds: float) -> str:
    """``19.4 s``, ``3 min 12 s``, ``2 h 05 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, whole = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {whole} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def cmd_status(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Show the daemon's endpoints, counts and counters."""
    status = client.status()
    info = msgspec.structs.asdict(status)
    del info["seq"]
    if args.json:
        _print_json(info)
        return
    counters = {key: info.pop(key) for key in ("requests", "connections_refused", "suppressed")}
    gpus, gpu_note = info.pop("gpus"), info.pop("gpu_note")
    info["uptime"] = _duration(info.pop("uptime_s"))
    rows = [(key.replace("_", " "), value) for key, value in info.items()]
    for key, counts in counters.items():
        rows += [(f"{key.replace('_', ' ')} {name}", n) for name, n in sorted(counts.items())]
    print(tabulate(rows, tablefmt="plain"))
    for group in client.list_groups():
        rdzv = group.rendezvous
        if rdzv is not None:
            if rdzv.quarantined is not None:
                place = f"QUARANTINED, out of the job until cleared: {rdzv.quarantined}"
            elif rdzv.standby:
                place = "STANDBY: waits beside the full round, to take a lost node's rank"
            else:
                place = f"rank {rdzv.group_rank} of {rdzv.group_world_size} nodes"
            print(
                f"rendezvous {group.name}: {rdzv.backend}, run {rdzv.run_id}, round {rdzv.round}, "
                f"{place}, {rdzv.waiting} waiting"
                + (", leads the rounds" if rdzv.leader else "")
                + _fenced(rdzv.fenced_since)
            )
    print()
    if not gpus:
        print(f"GPUs: {gpu_note or 'none'}")
        return
    gpu_rows = [
        (
            g.index,
            g.name,
            f"{g.memory_used_mib}/{g.memory_total_mib} MiB",
            f"{g.temperature_c} C",
            " ".join(
                f"{proc.pid}" + (f"({proc.group}:{proc.rank})" if proc.group else "")
                for proc in g.processes
            ),
        )
        for g in status.gpus
    ]
    print(tabulate(gpu_rows, headers=["GPU", "NAME", "MEMORY", "TEMP", "PROCESSES (GROUP:RANK)"]))


def _fenced(since: float | None) -> str:
    if since is None:
        return ""
    when = time.strftime("%H:%M:%S", time.localtime(since))
    return f"; FENCED since {when} ({time.time() - since:.0f} s): cut off from the rendezvous"


def _mib(size: int | None) -> str:
    return f" {size / 2**20:.0f}MiB" if size is not None else ""


def cmd_groups(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """List worker groups: state, attempt, restarts left, workers, spares, failure, stragglers."""
    groups = client.list_groups()
    if args.json:
        _print_json([msgspec.structs.asdict(g) for g in groups])
        return
    if not groups:
        print("no worker groups")
        return
    stragglers: dict[str, set[int]] = {}
    for ranked in client.stragglers().stragglers:
        if ranked.flagged:
            stragglers.setdefault(ranked.group, set()).add(ranked.rank)
    rows = []
    for group in groups:
        workers = " ".join(
            f"{w.local_rank}:{w.pid}" + _mib(w.memory_peak_bytes)
            for w in sorted(group.workers, key=lambda w: w.local_rank)
        )
        spares = " ".join(
            f"{s.local_rank}:{s.pid}"
            + (f" ready {s.ready_after_s:.1f}s" if s.ready_after_s is not None else " warming")
            + _mib(s.rss_bytes)
            for s in group.spares
        )
        failure = group.last_failure
        rows.append(
            (
                group.name,
                _shown_state(group),
                group.attempt,
                group.restarts_left,
                workers,
                spares,
                f"rank {failure.rank}: {failure.reason}" if failure else "",
                " ".join(str(rank) for rank in sorted(stragglers.get(group.name, ()))),
            )
        )
    headers = ["GROUP", "STATE", "ATTEMPT", "RESTARTS LEFT", "RANK:PID PEAK",
               "SPARES (RANK:PID WARM-UP RSS)", "LAST FAILURE", "STRAGGLERS"]  # fmt: skip
    print(tabulate(rows, headers=headers))


def _shown_state(group: GroupInfo) -> str:
    """The group's state, or where its rendezvous keeps it (fenced, standing by)."""
    rdzv = group.rendezvous
    if rdzv is not None and rdzv.fenced_since is not None:
        return "FENCED"
    if rdzv is not None and rdzv.quarantined is not None:
        return "QUARANTINED"
    if rdzv is not None and rdzv.standby:
        return "STANDBY"
    return group.state.value


def cmd_submit(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Start the worker group described by a TOML spec file (relative paths in it are
    the file's directory's; the workers start there unless it sets cwd)."""
    try:
        spec = msgspec.toml.decode(Path(args.spec).read_bytes(), type=GroupSpec)
    except OSError as e:
        raise UsageError(f"cannot read {args.spec}: {e.strerror}") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise UsageError(f"{args.spec}: {e}") from None
    print(client.submit_group(_beside(spec, Path(args.spec).resolve().parent)))


def _beside(spec: GroupSpec, directory: Path) -> GroupSpec:
    """``spec``'s relative paths (``cwd``, ``log_dir``, ``rendezvous.python``) made absolute
    in ``directory``, which is also ``cwd`` unless set: the daemon's own working directory
    (``/`` under systemd) must not decide what they mean, nor where a script is found."""
    python = spec.rendezvous.python
    if python is not None and "/" in python:  # a name is looked up on PATH
        python = str(directory / python)
    return msgspec.structs.replace(
        spec,
        cwd=str(directory / (spec.cwd or "")),
        log_dir=None if spec.log_dir is None else str(directory / spec.log_dir),
        rendezvous=msgspec.structs.replace(spec.rendezvous, python=python),
    )


def cmd_stop(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Stop a group's workers (SIGTERM, then SIGKILL after its shutdown_timeout)."""
    print(client.stop_group(args.name))


def cmd_restart(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Restart a group's workers now, without spending one of its restarts."""
    print(client.restart_group(args.name))


def cmd_quarantine(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Bring a node its etcd job set aside back into the job (it rejoins as a newcomer)."""
    print(client.request(p.ClearQuarantine(args.clear), p.Ok).message)


def cmd_inject(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Inject a fault into a group's rank, as a drill (the config must enable it)."""
    try:
        fault = parse_fault(args.fault)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(client.inject_fault(args.name, fault))


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since_ms(text: str | None) -> int | None:
    """``30s``/``5m``/``2h``/``1d`` ago, or seconds since the epoch."""
    if text is None:
        return None
    try:
        if text[-1:] in _UNITS:
            return int((time.time() - float(text[:-1]) * _UNITS[text[-1]]) * 1000)
        return int(float(text) * 1000)
    except ValueError:
        raise UsageError(f"--since {text!r}: expected 30s, 5m, 2h, 1d or epoch seconds") from None


def _format_event(event: Event) -> str:
    when = datetime.fromtimestamp(event.timestamp / 1000).isoformat(timespec="milliseconds")
    fields = " ".join(f"{key}={value!r}" for key, value in event.metadata.items())
    return f"{when} {event.name} {fields}"


def cmd_events(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Show recent events; with --follow, keep printing them as they happen.

    With --trace FILE, write them instead, with the recent timers, as a
    Chrome trace (Perfetto, chrome://tracing, Chrome DevTools): a track per
    rank, slices for attempts, timers and rendezvous rounds, marks for
    kills, dumps and restarts.
    """
    if args.trace is not None:
        if args.follow:
            raise UsageError("--trace writes what happened so far: not with --follow")
        since_ms = _since_ms(args.since)
        (batch,) = client.events(since_ms, args.limit)
        spans = client.timeline()
        if since_ms is not None:  # the timers that were armed within the window
            spans = [s for s in spans if s.ended is None or s.ended * 1000 >= since_ms]
        try:
            print(write_trace(args.trace, batch.events, spans))
        except OSError as e:
            raise UsageError(f"--trace {args.trace}: {e.strerror}") from None
        return
    try:
        for batch in client.events(_since_ms(args.since), args.limit, args.follow):
            if batch.dropped:
                print(f"... {batch.dropped} events dropped: reading too slowly", file=sys.stderr)
            for event in batch.events:
                print(event.serialize() if args.json else _format_event(event), flush=True)
    except KeyboardInterrupt:
        pass


def cmd_dumps(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """List the stack dumps taken of hung processes before they were killed."""
    dumps = client.list_dumps()
    if args.json:
        _print_json([msgspec.structs.asdict(d) for d in dumps])
        return
    if not dumps:
        print("no stack dumps")
        return
    rows = [
        (
            d.id,
            datetime.fromtimestamp(d.timestamp).isoformat(timespec="seconds"),
            d.pid,
            d.scope_id,
            d.method or "-",
            d.size,
            ",".join(str(t.rank) for t in d.traces if t.size) or "-",
        )
        for d in dumps
    ]
    headers = ["ID", "TIME", "PID", "SCOPE", "METHOD", "BYTES", "TRACES (RANKS)"]
    print(tabulate(rows, headers=headers))


def _trace_summary(client: SocketTimerClient, dump_id: str, trace: p.TraceInfo) -> str:
    if not trace.size:
        return trace.problem
    try:
        summary = summarize_trace(decode_trace(client.get_trace(dump_id, trace.rank).data))
    except TraceError as e:
        summary = str(e)
    return f"{summary} ({trace.problem})" if trace.problem else summary


def cmd_dump(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """Print one dump: the stacks, then each rank's collective trace in a line."""
    if args.trace is not None:
        _print_trace(client, args)
        return
    dump = client.get_dump(args.id)
    info = dump.info
    if args.json:
        _print_json({**msgspec.structs.asdict(info), "text": dump.text})
        return
    print(f"# pid {info.pid}, timer {info.scope_id!r}, via {info.method or 'no stacks'}")
    sys.stdout.write(dump.text)
    if info.traces:
        print("\n# flight-recorder traces (watchdogctl dump ID --trace RANK)")
        rows = [
            (t.rank, t.pid, t.size or "-", _trace_summary(client, info.id, t)) for t in info.traces
        ]
        print(tabulate(rows, headers=["RANK", "PID", "BYTES", "COLLECTIVES"]))


def _print_trace(client: SocketTimerClient, args: argparse.Namespace) -> None:
    """One rank's trace: decoded (values only, never objects), as JSON, or raw (torch's pickle
    from an NCCL pipe, torch's JSON from a worker server)."""
    data = client.get_trace(args.id, args.trace).data
    if args.raw:
        sys.stdout.buffer.write(data)
        return
    try:
        trace = decode_trace(data)
    except TraceError as e:
        raise UsageError(f"dump {args.id}, rank {args.trace}: {e}; --raw prints it as is") from None
    if args.json:
        _print_json(trace)
        return
    for line in trace_header(trace):
        print(f"# {line}")
    print(tabulate(trace_rows(trace), headers=TRACE_COLUMNS))


class UsageError(Exception):
    pass


COMMANDS = {
    "timers": cmd_timers,
    "scopes": cmd_scopes,
    "stragglers": cmd_stragglers,
    "status": cmd_status,
    "groups": cmd_groups,
    "events": cmd_events,
    "dumps": cmd_dumps,
    "dump": cmd_dump,
    "submit": cmd_submit,
    "stop": cmd_stop,
    "restart": cmd_restart,
    "inject": cmd_inject,
    "quarantine": cmd_quarantine,
}


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
    subs = {
        name: commands.add_parser(name, help=handler.__doc__, description=handler.__doc__)
        for name, handler in COMMANDS.items()
    }
    subs["dump"].add_argument("id", metavar="ID", help="a dump id from `watchdogctl dumps`")
    subs["dump"].add_argument(
        "--trace", type=int, metavar="RANK", help="print this global rank's collective trace"
    )
    subs["dump"].add_argument(
        "--raw",
        action="store_true",
        help="with --trace: the trace as the rank gave it (NCCL: pickle; gloo: JSON)",
    )
    for name in ("timers", "scopes", "stragglers", "status", "groups", "events", "dumps", "dump"):
        subs[name].add_argument("--json", action="store_true", help="print JSON, not a table")
    subs["stragglers"].add_argument(
        "--job",
        action="store_true",
        help="every node's ranks of the job, as each node last published them (etcd, c10d), "
        "scored against the job's fastest rank, with NODE and HOST columns",
    )
    subs["events"].add_argument("--since", metavar="T", help="30s, 5m, 2h, 1d ago, or epoch secs")
    subs["events"].add_argument("--limit", type=int, metavar="N", help="at most the last N")
    subs["events"].add_argument("--follow", "-f", action="store_true", help="keep printing")
    subs["events"].add_argument(
        "--trace", metavar="FILE", help="write a Chrome trace (Perfetto) of the job's timeline"
    )
    subs["submit"].add_argument(
        "spec",
        metavar="SPEC.toml",
        help='a group spec (docs/operations.md, "Groups in the daemon")',
    )
    for name in ("stop", "restart", "inject"):
        subs[name].add_argument("name", metavar="NAME", help="the group's name")
    subs["quarantine"].add_argument(
        "--clear", required=True, metavar="NODE", help="the node's name (--node-name)"
    )
    subs["inject"].add_argument(
        "fault",
        metavar="FAULT",
        help="KIND[:VALUE]:rank=R[:after=S]: hang, sigstop, kill, exit[:CODE], slow[:FACTOR]; "
        "e.g. hang:rank=1:after=30",
    )
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
    except UsageError as e:
        print(f"watchdogctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
