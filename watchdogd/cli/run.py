"""``watchdogd run``: torchrun's command line, one group in the foreground, timers built in.

Replace the word ``torchrun`` in a launch script with ``watchdogd run``: the
flags keep their names and meanings (dashes or underscores, ``PET_*``
environment defaults), the workers get torchrun's environment, and the exit
status follows the group's: 0 when every worker succeeded, 1 with a summary
of the first failure otherwise, 2 on bad usage.

Signals are torchrun's: each one of ``--signals-to-handle`` (SIGTERM, SIGINT,
SIGHUP, SIGQUIT unless told otherwise) is passed to every worker, the group
stops (SIGKILL ``--shutdown-timeout`` later for a worker still alive, none is
left behind), and the exit status is 1, as torchrun's (its agent re-raises
the signal as an exception).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from functools import partial

import msgspec

from watchdogd.cli.timeline import write_trace
from watchdogd.core.config import Config, ConfigError, override
from watchdogd.core.faults import parse_fault
from watchdogd.core.numa import AFFINITY_MODES
from watchdogd.core.workerenv import apply_env_knobs
from watchdogd.daemon import Daemon
from watchdogd.foreground import run_group
from watchdogd.groups.runner import GroupRunner, visible_gpus
from watchdogd.linux.plugins import LOGS_SPECS_GROUP, has_entry_point, not_found
from watchdogd_client.groups import C10dConf, DeadlineRule, Fault, GroupSpec, GroupState

__all__ = ["add_run_arguments", "run", "spec_from_args"]

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's


def _flag(
    parser: argparse._ActionsContainer,
    environ: Mapping[str, str],
    name: str,
    *short: str,
    **kwargs: object,
) -> None:
    """A torchrun flag: ``--a-b`` and ``--a_b``, defaulting to ``$PET_A_B`` when set.

    A switch (``store_true``) is on when ``$PET_A_B`` is set to anything but
    ``0`` or nothing, as torchrun's ``check_env`` has it.
    """
    dest = name.lstrip("-").replace("-", "_")
    aliases = [*short, name] if "-" not in name[2:] else [*short, name, "--" + dest]
    from_env = environ.get(f"PET_{dest.upper()}")
    if kwargs.get("action") == "store_true":
        if from_env is not None:
            kwargs["default"] = from_env not in ("", "0")
    elif "default" in kwargs and from_env is not None:
        kwargs["default"] = from_env
    parser.add_argument(*aliases, dest=dest, **kwargs)  # type: ignore[arg-type]


def add_run_arguments(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ
) -> None:
    """torchrun's flags (and ours); ``environ``: where the ``PET_*`` defaults come from."""
    flag = partial(_flag, parser, environ)
    flag("--nproc-per-node", default="1", metavar="N",
          help="workers on this node: a number, 'gpu', 'cpu' or 'auto'")  # fmt: skip
    flag("--nnodes", default="1", metavar="N[:N]", help="nodes in the job (static: fixed)")
    flag("--node-rank", type=int, default=0, help="this node's rank")
    flag("--master-addr", default="127.0.0.1", help="rank 0's address")
    flag("--master-port", type=int, default=None, help="rank 0's port (default: free)")
    flag("--max-restarts", type=int, default=0, help="restarts before failing")
    flag("--rdzv-backend", default="static", help="static, c10d (torch's), or etcd (v3)")
    flag("--rdzv-endpoint", default="",
          help="static: the master; c10d: the store's HOST[:29400]; etcd: HOST:PORT,…")  # fmt: skip
    flag("--rdzv-id", default="none", help="job id (TORCHELASTIC_RUN_ID)")
    flag("--rdzv-conf", default="", help="join_timeout=…,last_call_timeout=…,…")
    flag("--local-addr", default=None, help="c10d, etcd: this node's address for others")
    flag("--standalone", action="store_true", help="single node, free port")
    flag("--role", default="default", help="worker role name")
    flag("--log-dir", default=None, help="per-attempt, per-rank logs go here")
    parser.add_argument(
        "-r",
        "--redirects",
        default=os.environ.get("PET_REDIRECTS", "0"),
        help="streams to files only: 0 none, 1 stdout, 2 stderr, 3 both; or per rank 0:1,1:3",
    )
    parser.add_argument(
        "-t",
        "--tee",
        default=os.environ.get("PET_TEE", "0"),
        help="streams to files and to the console with a prefix (same values as -r)",
    )
    flag("--local-ranks-filter", default="", help="ranks whose tee'd output is shown")
    flag("--duplicate-stdout-filters", default="", help="copy stdout lines holding any")
    flag("--duplicate-stderr-filters", default="", help="... and stderr lines")
    flag("--log-line-prefix-template", default=None, help="e.g. '[$rank]:'")
    flag("--virtual-local-rank", action="store_true", help="one GPU per worker")
    flag("--numa-binding", choices=AFFINITY_MODES, default=None,
          help="bind local rank i to CPUs near GPU i (torch's rules, no numactl)")  # fmt: skip
    flag("--shutdown-timeout", type=float, default=None,
          help="SIGTERM to SIGKILL (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)")  # fmt: skip
    flag("--idle-timeout", type=float, default=None, metavar="SECONDS",
          help="a worker holding no timer this long (after its first) is hung: dump, kill, "
          "restart (default: off)")  # fmt: skip
    flag("--job-key", default=None, metavar="KEY",
          help="names this job across runs: learned deadlines are saved under it and "
          "seed the next run with the same key (default: nothing saved)")  # fmt: skip
    flag("--deadline", action="append", default=[], metavar="PATTERN[:K=V,...]",
          help="how LEARN deadlines are derived for the scopes PATTERN matches, e.g. "
          "'step:initial=600,samples=200,margin=2,floor=1,skip=1'; repeatable, first "
          "match wins")  # fmt: skip
    flag("--inject", action="append", default=[], metavar="FAULT",
          help="a drill: inject KIND[:VALUE]:rank=R[:after=S] once (hang, sigstop, kill, "
          "exit[:CODE], slow[:FACTOR]; e.g. hang:rank=1:after=30); repeatable")  # fmt: skip
    flag("--straggler-window", type=int, default=None, metavar="N",
          help="releases of a rank's scope per straggler window (default 50)")  # fmt: skip
    flag("--straggler-publish-interval", type=float, default=None, metavar="SECONDS",
          help="multi-node jobs: seconds between this node's straggler summaries to the "
          "rendezvous store (default 10; the same on every node)")  # fmt: skip
    flag("--signals-to-handle", default=DEFAULT_SIGNALS,
          help="passed to the workers, stopping the group (default %(default)s)")  # fmt: skip
    flag("--no-python", action="store_true", help="run SCRIPT as a program")
    flag("--module", "-m", action="store_true", help="run SCRIPT as python -m")
    flag("--run-path", action="store_true", help="run SCRIPT as a path (the default)")
    flag("--monitor-interval", type=float, default=0.1,
          help="c10d: seconds between checks for waiting nodes (exits: at once)")  # fmt: skip
    flag("--start-method", default="spawn", help="accepted for compatibility")
    flag("--prewarm", default="", metavar="MODULE[,MODULE…]",
          help="keep a warm spare per local rank that has imported these (e.g. torch): "
          "restarts skip the imports")  # fmt: skip
    flag("--logs-specs", default=None, metavar="NAME",
          help="where workers' logs go: torch's 'default' (watchdogd's own layout), or a "
          "LogsSpecs class named in entry point group torchrun.logs_specs")  # fmt: skip
    flag("--event-log-handler", default="null", metavar="NAME",
          help="record events to this handler: null, console, dynamic_rendezvous, or an "
          "entry point in group watchdogd.event_handlers")  # fmt: skip
    parser.add_argument("--event-log", metavar="FILE", help="append events as JSON lines to FILE")
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="at exit, write the run's timeline as a Chrome trace (Perfetto) to FILE",
    )
    parser.add_argument(
        "--flight-recorder",
        action="store_true",
        help="turn on torch's NCCL flight recorder in the workers; every rank's trace is "
        "kept with the dump of a hung one",
    )
    parser.add_argument(
        "training_script", nargs="?", metavar="SCRIPT", help="script, module, or -- CMD ARGS"
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="ARGS")


def _nproc(value: str) -> int:
    if value.isdigit():
        return int(value)
    gpus = visible_gpus()
    if value == "gpu":
        if not gpus:
            raise ValueError("--nproc-per-node gpu: no GPU is visible")
        return len(gpus)
    if value == "cpu":
        return os.cpu_count() or 1
    if value == "auto":
        return len(gpus) if gpus else os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node: expected a number, gpu, cpu or auto, got {value!r}")


def _entrypoint(args: argparse.Namespace) -> list[str]:
    script, rest = args.training_script, list(args.training_script_args)
    if script is None:
        raise ValueError("no SCRIPT given (or -- CMD ARGS)")
    if script == "--":
        if not rest:
            raise ValueError("nothing to run after --")
        return rest
    if args.no_python and args.module and not args.run_path:  # torchrun's check, in its words
        raise ValueError(
            "Don't use both the '--no-python' flag and the '--module' flag at the same time."
        )
    if args.no_python:
        return [script, *rest]
    python = os.environ.get("PYTHON_EXEC", sys.executable)  # torchrun's choice
    if args.module:
        return [python, "-u", "-m", script, *rest]
    return [python, "-u", script, *rest]


def handled_signals(value: str) -> list[signal.Signals]:
    """``--signals-to-handle``: signal names, as torchrun reads them (``SIGTERM,SIGUSR1``)."""
    chosen: list[signal.Signals] = []
    for name in filter(None, (item.strip() for item in value.split(","))):
        try:
            signum = signal.Signals[name]
        except KeyError:
            raise ValueError(f"--signals-to-handle: {name!r} is not a signal name") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"--signals-to-handle: {name} cannot be handled")
        chosen.append(signum)
    return chosen


def logs_specs_name(name: str | None) -> str | None:
    """``--logs-specs``: None for torch's ``default``, which is watchdogd's own layout.

    Another name must be a ``torchrun.logs_specs`` entry point, as torchrun
    finds it; it is loaded, with torch, by the group's helper process, never here.
    """
    if name is None or name == "default":
        return None
    if not has_entry_point(LOGS_SPECS_GROUP, name):
        raise ValueError(f"--logs-specs: {not_found(LOGS_SPECS_GROUP, name)}")
    return name


def _comma_list(value: str) -> list[str]:
    return [item for item in value.split(",") if item]


def _fault(text: str) -> Fault:
    try:
        return parse_fault(text)
    except ValueError as e:
        raise ValueError(f"--inject {e}") from None


def _deadline_rule(value: str) -> DeadlineRule:
    """``--deadline PATTERN[:KEY=VALUE,...]``; ValueError names what is wrong.

    The settings follow the last colon, so a pattern may hold colons of its own
    (``train.py:42``, the default scope of a line).
    """
    pattern, colon, settings = value.rpartition(":")
    if not colon or "=" not in settings:
        pattern, settings = value, ""
    fields = {"scope": pattern}
    for setting in _comma_list(settings):
        key, equals, number = setting.partition("=")
        if not equals or key == "scope":
            raise ValueError(f"--deadline {value!r}: {setting!r} is not KEY=VALUE")
        fields[key] = number
    try:
        return msgspec.convert(fields, DeadlineRule, strict=False)  # "600" is 600
    except msgspec.ValidationError as e:
        raise ValueError(f"--deadline {value!r}: {e}") from None


_RDZV_CONF = {
    "join_timeout": "join_timeout",
    "timeout": "join_timeout",
    "last_call_timeout": "last_call",
    "last_call": "last_call",
    "lease_ttl": "lease_ttl",
}


def _c10d_conf(value: str) -> C10dConf:
    """``--rdzv-conf`` as torch's c10d backend reads it; keys torch ignores: dropped, said so."""
    conf = {}
    for item in filter(None, value.split(",")):
        key, equals, setting = item.partition("=")
        if not equals:
            raise ValueError(f"--rdzv-conf {item!r}: expected KEY=VALUE")
        conf[key] = setting
    ignored = [key for key in conf if key not in C10dConf.__struct_fields__]
    if ignored:
        print(
            f"watchdogd run: warning: --rdzv-conf {', '.join(ignored)}: "
            "not read by torch's c10d backend, ignored",
            file=sys.stderr,
        )
    read = {key: setting for key, setting in conf.items() if key not in ignored}
    try:
        return msgspec.convert(read, C10dConf, strict=False)  # "5" is 5, "true" is True
    except msgspec.ValidationError as e:
        raise ValueError(f"--rdzv-conf: {e}") from None


def _rendezvous(args: argparse.Namespace) -> dict[str, object]:
    """``--rdzv-*``, ``--nnodes`` and friends, as a RendezvousSpec table."""
    low, _, high = args.nnodes.partition(":")
    if not low.isdigit() or (high and not high.isdigit()):
        raise ValueError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX")
    min_nodes, max_nodes = int(low), int(high or low)
    # torchrun's --standalone is c10d on a store of its own; one node needs no
    # store to meet on: static, on a free port (its own store, as torchrun's).
    backend = "static" if args.standalone else args.rdzv_backend
    python = os.environ.get("PYTHON_EXEC")
    if backend == "c10d":
        return {
            "backend": "c10d",
            "endpoints": [args.rdzv_endpoint] if args.rdzv_endpoint else [],
            "nnodes": max_nodes,
            "min_nodes": min_nodes,
            "run_id": args.rdzv_id,
            "advertise_addr": args.local_addr,
            "c10d": _c10d_conf(args.rdzv_conf),
            "monitor_interval": args.monitor_interval,
            "python": python,
        }
    if backend in ("etcd", "etcd-v2", "etcd-v3"):
        if not args.rdzv_endpoint:
            raise ValueError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT…]")
        table: dict[str, object] = {
            "backend": "etcd",
            "endpoints": args.rdzv_endpoint.split(","),
            "nnodes": max_nodes,
            "min_nodes": min_nodes,
            "run_id": args.rdzv_id,
            "advertise_addr": args.local_addr,
        }
        for item in filter(None, args.rdzv_conf.split(",")):
            key, _, value = item.partition("=")
            if key not in _RDZV_CONF:
                raise ValueError(f"--rdzv-conf {key!r}: known keys are {', '.join(_RDZV_CONF)}")
            table[_RDZV_CONF[key]] = float(value) if "." in value else int(value)
        return table
    if backend != "static":
        raise ValueError(f"--rdzv-backend {backend!r}: use static, c10d or etcd")
    if min_nodes != max_nodes:
        raise ValueError(f"--nnodes {args.nnodes!r}: the static backend needs a fixed count")
    master_addr, master_port = args.master_addr, args.master_port
    if args.rdzv_endpoint and not args.standalone:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        master_addr, master_port = host or args.rdzv_endpoint, int(port) if port else master_port
    return {
        "nnodes": max_nodes,
        "node_rank": args.node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "run_id": args.rdzv_id,
        "python": python,
    }


def _shutdown_timeout(flag: float | None) -> float:
    """The flag, else torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else torch's 30 s."""
    if flag is not None:
        return flag
    value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value!r} is not a number") from None


def spec_from_args(args: argparse.Namespace) -> GroupSpec:
    """The group torchrun would launch for these flags; ValueError names a bad one."""
    rendezvous = _rendezvous(args)
    nproc = _nproc(args.nproc_per_node)
    # torchrun's agent exports this, so a launcher nested in a worker handles the same.
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": args.signals_to_handle}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, so workers don't oversubscribe
    logs_specs = logs_specs_name(args.logs_specs)
    log_dir = args.log_dir
    filters = args.duplicate_stdout_filters or args.duplicate_stderr_filters
    writes_files = args.redirects != "0" or args.tee != "0" or filters
    if log_dir is None and writes_files and logs_specs is None:
        log_dir = tempfile.mkdtemp(prefix="watchdogd-logs-")  # torch's default does so too
    ranks_filter = (
        [int(r) for r in args.local_ranks_filter.split(",")] if args.local_ranks_filter else None
    )
    try:
        spec = msgspec.convert(
            {
                "name": args.role,
                "entrypoint": _entrypoint(args),
                "nproc": nproc,
                "max_restarts": args.max_restarts,
                "role": args.role,
                "env": env,
                "log_dir": log_dir,
                "logs_specs": logs_specs,
                "redirects": args.redirects,
                "tee": args.tee,
                "local_ranks_filter": ranks_filter,
                "log_line_prefix_template": args.log_line_prefix_template,
                "virtual_local_rank": args.virtual_local_rank,
                "numa_binding": args.numa_binding,
                "shutdown_timeout": _shutdown_timeout(args.shutdown_timeout),
                "duplicate_stdout_filters": _comma_list(args.duplicate_stdout_filters),
                "duplicate_stderr_filters": _comma_list(args.duplicate_stderr_filters),
                "prewarm": _comma_list(args.prewarm),
                "flight_recorder": args.flight_recorder,
                "idle_timeout": args.idle_timeout,
                "job_key": args.job_key,
                "deadlines": [_deadline_rule(rule) for rule in args.deadline],
                "faults": [_fault(text) for text in args.inject],
                "rendezvous": rendezvous,
            },
            GroupSpec,
        )
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
    return apply_env_knobs(spec, os.environ)


def summarize(runner: GroupRunner, state: GroupState) -> str:
    info = runner.info()
    lines = [
        f"watchdogd run: group {info.name} {state.value} "
        f"after {info.attempt + 1} attempt(s), {runner.machine.restarts_used} restart(s)"
    ]
    failure = info.last_failure
    if failure is not None and failure.rank < 0:  # the group itself: no worker to name
        lines.append(f"  {failure.reason}")
    elif failure is not None:
        lines.append(
            f"  rank {failure.rank} (local rank {failure.local_rank}, pid {failure.pid}): "
            f"{failure.reason}"
        )
        if failure.error_message:
            lines.append(f"  error: {failure.error_message}")
        if failure.error_file:
            lines.append(f"  error file: {failure.error_file}")
    return "\n".join(lines)


def run(args: argparse.Namespace, config: Config) -> int:
    try:
        signals = handled_signals(args.signals_to_handle)
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"watchdogd run: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.event_log:
        config = msgspec.structs.replace(config, event_log=args.event_log)
    if args.event_log_handler != "null":
        config = msgspec.structs.replace(config, event_log_handler=args.event_log_handler)
    if spec.faults:  # asking for a drill on the command line is the operator's consent
        config = msgspec.structs.replace(config, fault_injection=True)
    try:
        config = _straggler_settings(config, args)
        outcome = run_group(config, spec, signals=signals)
    except ConfigError as e:
        print(f"watchdogd run: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.trace and outcome.daemon is not None:
        _write_trace(outcome.daemon, args.trace)
    if outcome.dumps is not None:
        print(f"watchdogd run: stacks of hung workers in {outcome.dumps}", file=sys.stderr)
    if outcome.error is not None:
        print(f"watchdogd run: {outcome.error}", file=sys.stderr)
        return EXIT_USAGE
    assert outcome.runner is not None and outcome.state is not None
    if outcome.signal is not None:
        name = signal.Signals(outcome.signal).name
        print(f"watchdogd run: {name} received, passed to the workers; group {outcome.state.value}",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    if outcome.state is GroupState.SUCCEEDED:
        return 0
    print(summarize(outcome.runner, outcome.state), file=sys.stderr)
    return EXIT_FAILED


def _straggler_settings(config: Config, args: argparse.Namespace) -> Config:
    """The ``--straggler-*`` flags given, checked as the config's keys; ConfigError if bad."""
    given = {
        key: value
        for key, value in (
            ("straggler_window", args.straggler_window),
            ("straggler_publish_interval", args.straggler_publish_interval),
        )
        if value is not None
    }
    return override(config, "--straggler-* flags", **given) if given else config


def _write_trace(daemon: Daemon, path: str) -> None:
    """The run's timeline, once it is over (the loop has stopped: nothing to hold up)."""
    try:
        summary = write_trace(path, daemon.events.since(), daemon.queries.timeline_spans(None))
    except OSError as e:
        print(f"watchdogd run: --trace {path}: {e.strerror}", file=sys.stderr)
        return
    print(f"watchdogd run: {summary}", file=sys.stderr)
