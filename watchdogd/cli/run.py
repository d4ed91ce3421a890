"""``watchdogd run``: torchrun's command line, one group in the foreground, timers built in.

Replace the word ``torchrun`` in a launch script with ``watchdogd run``: the
flags keep their names and meanings (dashes or underscores, ``PET_*``
environment defaults), the workers get torchrun's environment, and the exit
status follows the group's:

====  ==============================================================
0     every worker succeeded
1     the group failed (a summary of the first failure): a requeue may help
2     bad usage
93    do not requeue: ``--max-no-progress-restarts`` restarts in a row
      made no progress (the summary names each rank's failure and how
      often); NVRx's code for the same, so one scheduler rule serves both
====  ==============================================================

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
from collections.abc import Mapping
from functools import partial

import msgspec

from watchdogd.cli.timeline import write_trace
from watchdogd.core.config import Config, ConfigError
from watchdogd.core.faults import parse_fault
from watchdogd.core.numa import AFFINITY_MODES
from watchdogd.core.progress import EXIT_NO_PROGRESS
from watchdogd.core.run_options import (
    OptionsError,
    RunOptions,
    daemon_config,
    group_spec,
    handled_signals,
    parse_nnodes,
    run_options,
    unread_rdzv_conf,
)
from watchdogd.daemon import Daemon
from watchdogd.foreground import check_entrypoint, run_group, this_host
from watchdogd.groups.runner import GroupRunner
from watchdogd.linux.plugins import LOGS_SPECS_GROUP, has_entry_point, not_found
from watchdogd_client.groups import DeadlineRule, Fault, GroupState

__all__ = ["add_run_arguments", "log_level", "options_from_args", "run"]

EXIT_FAILED = 1
EXIT_USAGE = 2
_FAULT_CONSENT = "start `watchdogd run` with --fault-injection"
_DEFAULT = RunOptions()
LOG_LEVELS = ("debug", "info", "warning", "error")


def _flag(
    parser: argparse._ActionsContainer,
    environ: Mapping[str, str],
    name: str,
    *short: str,
    **kwargs: object,
) -> None:
    """A torchrun flag: ``--a-b`` and ``--a_b``, given when on the command line or in ``$PET_A_B``.

    Not given, it is left out of the namespace (and the options keep their
    default). A switch (``store_true``) set in ``$PET_A_B`` is on unless that
    is ``0`` or nothing, as torchrun's ``check_env`` has it.
    """
    dest = name.lstrip("-").replace("-", "_")
    aliases = [*short, name] if "-" not in name[2:] else [*short, name, "--" + dest]
    from_env = environ.get(f"PET_{dest.upper()}")
    default: object = argparse.SUPPRESS
    if from_env is not None:
        default = from_env not in ("", "0") if kwargs.get("action") == "store_true" else from_env
    parser.add_argument(*aliases, dest=dest, default=default, **kwargs)  # type: ignore[arg-type]


def add_run_arguments(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ
) -> None:
    """torchrun's flags (and ours); ``environ``: where the ``PET_*`` values come from.

    The defaults are :class:`~watchdogd.core.run_options.RunOptions`' (torchrun's).
    """
    flag = partial(_flag, parser, environ)
    flag("--nproc-per-node", metavar="N",
          help="workers on this node: a number, 'gpu', 'cpu' or 'auto' "
          f"(default {_DEFAULT.nproc_per_node})")  # fmt: skip
    flag("--nnodes", metavar="N[:N]",
          help=f"nodes in the job (static: fixed; default {_DEFAULT.max_nodes})")  # fmt: skip
    flag("--node-rank", type=int, help=f"this node's rank (default {_DEFAULT.node_rank})")
    flag("--master-addr", help=f"rank 0's address (default {_DEFAULT.master_addr})")
    flag("--master-port", type=int, help="rank 0's port (default: free)")
    flag("--max-restarts", type=int,
          help=f"restarts before failing (default {_DEFAULT.max_restarts})")  # fmt: skip
    flag("--max-no-progress-restarts", type=int, metavar="K",
          help="end the run with exit status 93 (do not requeue) once K restarts in a row "
          "made no progress: no step past the highest reached, or once every attempt failed "
          "the same way before any step, a bad program (0: off; default "
          f"{_DEFAULT.max_no_progress_restarts})")  # fmt: skip
    flag("--progress-scope", metavar="SCOPE",
          help="the scope whose release is a step (default: any scope's; "
          "wd.progress(step) reports take its place)")  # fmt: skip
    flag("--rdzv-backend",
          help=f"static, c10d (torch's) or etcd (default {_DEFAULT.rdzv_backend})")  # fmt: skip
    flag("--rdzv-endpoint",
          help="static: the master; c10d: the store's HOST[:29400]; etcd: HOST:PORT,…")  # fmt: skip
    flag("--rdzv-id", help=f"job id (TORCHELASTIC_RUN_ID; default {_DEFAULT.run_id})")
    flag("--rdzv-conf", help="join_timeout=…,last_call_timeout=…,…")
    flag("--local-addr", help="c10d, etcd: this node's address for others")
    flag("--node-name", metavar="NAME",
          help="etcd: this node's stable name in the job, which a quarantine names "
          "(default: the host name)")  # fmt: skip
    flag("--quarantine-after", type=int, metavar="F",
          help="etcd: set this node aside (out of the job until `watchdogctl quarantine "
          "--clear NAME`) once F of its failures within the window were the node's: a "
          "signal, a hang, the OOM killer, each first in its round "
          f"(0: off; default {_DEFAULT.quarantine_after})")  # fmt: skip
    flag(
        "--quarantine-window",
        type=float,
        metavar="MINUTES",
        help=f"the window of --quarantine-after (default {_DEFAULT.quarantine_window:g})",
    )
    flag("--replace-stragglers-after", type=float, metavar="SECONDS",
          help="etcd: once one of this node's ranks stays named a straggler this long (a "
          "minority of the job's ranks flagged on a scope) while a standby waits, this node "
          "steps aside: quarantined until `watchdogctl quarantine --clear NAME`, the standby "
          "in its group rank (default: off; a straggler is never killed)")  # fmt: skip
    flag("--standalone", action="store_true", help="single node, free port")
    flag("--role", help=f"worker role name (default {_DEFAULT.role})")
    flag("--log-dir", help="per-attempt, per-rank logs go here")
    flag("--redirects", "-r",
          help="streams to files only: 0 none (default), 1 stdout, 2 stderr, 3 both; "
          "or per rank 0:1,1:3")  # fmt: skip
    flag("--tee", "-t",
          help="streams to files and to the console with a prefix (same values as -r)")  # fmt: skip
    flag("--local-ranks-filter", help="ranks whose tee'd output is shown")
    flag("--duplicate-stdout-filters", help="copy stdout lines holding any")
    flag("--duplicate-stderr-filters", help="... and stderr lines")
    flag("--log-line-prefix-template", help="e.g. '[$rank]:'")
    flag("--virtual-local-rank", action="store_true", help="one GPU per worker")
    flag("--numa-binding", choices=AFFINITY_MODES,
          help="bind local rank i to CPUs near GPU i (torch's rules, no numactl)")  # fmt: skip
    flag("--shutdown-timeout", type=float,
          help="SIGTERM to SIGKILL (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)")  # fmt: skip
    flag("--gpu-release-timeout", type=float, metavar="SECONDS",
          help="before a restart, wait this long at most for the last attempt's processes "
          "to give their GPU memory back (NVML; 0: don't wait; default 30)")  # fmt: skip
    flag("--idle-timeout", type=float, metavar="SECONDS",
          help="a worker holding no timer this long (after its first) is hung: dump, kill, "
          "restart (default: off)")  # fmt: skip
    flag("--job-key", metavar="KEY",
          help="names this job across runs: learned deadlines are saved under it and "
          "seed the next run with the same key (default: nothing saved)")  # fmt: skip
    parser.add_argument("--deadline", action="append", default=argparse.SUPPRESS,
          metavar="PATTERN[:K=V,...]",
          help="how LEARN deadlines are derived for the scopes PATTERN matches, e.g. "
          "'step:initial=600,samples=200,margin=2,floor=1,skip=1'; repeatable, first "
          "match wins")  # fmt: skip
    parser.add_argument("--inject", action="append", default=argparse.SUPPRESS, metavar="FAULT",
          help="a drill: inject KIND[:VALUE]:rank=R[:after=S] once (hang, sigstop, kill, "
          "exit[:CODE], slow[:FACTOR]; e.g. hang:rank=1:after=30); repeatable; "
          "implies --fault-injection")  # fmt: skip
    flag("--fault-injection", action="store_true",
          help="allow drills on this run: `watchdogctl inject` (root and the admin group) "
          "(default: off, so that no command sent to the wrong socket kills a job)")  # fmt: skip
    flag("--straggler-window", type=int, metavar="N",
          help="releases of a rank's scope per straggler window (default 50)")  # fmt: skip
    flag("--straggler-publish-interval", type=float, metavar="SECONDS",
          help="multi-node jobs: seconds between this node's straggler summaries to the "
          "rendezvous store (default 10; the same on every node)")  # fmt: skip
    flag("--signals-to-handle",
          help=f"passed to the workers, stopping the group "
          f"(default {_DEFAULT.signals_to_handle})")  # fmt: skip
    flag("--no-python", action="store_true", help="run SCRIPT as a program")
    flag("--module", "-m", action="store_true", help="run SCRIPT as python -m")
    flag("--run-path", action="store_true", help="run SCRIPT as a path (the default)")
    flag("--monitor-interval", type=float,
          help="c10d: seconds between checks for waiting nodes (exits: at once; "
          f"default {_DEFAULT.monitor_interval})")  # fmt: skip
    flag("--start-method", help="accepted for compatibility")
    flag("--prewarm", metavar="MODULE[,MODULE…]",
          help="keep a warm spare per local rank that has imported these (e.g. torch): "
          "restarts skip the imports")  # fmt: skip
    flag("--process-containment", choices=("auto", "session"),
          help="auto: a cgroup v2 per worker where the hierarchy may be written, else the "
          "weaker session mode; session: always the weaker mode (default auto)")  # fmt: skip
    flag("--worker-memory-max", metavar="SIZE",
          help="cap each worker's memory, with all it starts (bytes, or 50M, 2G); past "
          "it the OOM killer ends it, and its failure says so (default: none)")  # fmt: skip
    flag("--logs-specs", metavar="NAME",
          help="where workers' logs go: torch's 'default' (watchdogd's own layout), or a "
          "LogsSpecs class named in entry point group torchrun.logs_specs")  # fmt: skip
    flag("--event-log-handler", metavar="NAME",
          help="record events to this handler: null, console, dynamic_rendezvous, or an "
          "entry point in group watchdogd.event_handlers "
          f"(default {_DEFAULT.event_log_handler})")  # fmt: skip
    parser.add_argument("--event-log", metavar="FILE", default=argparse.SUPPRESS,
                        help="append events as JSON lines to FILE")  # fmt: skip
    parser.add_argument("--metrics-listen", metavar="[HOST:]PORT", default=argparse.SUPPRESS,
                        help="serve /metrics and /healthz (503 while the node is stalled or "
                        "quarantined) there; loopback for a bare PORT")  # fmt: skip
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="watchdogd's own messages on stderr, not the workers' "
                        "output (default info; debug adds routine per-worker events)")  # fmt: skip
    parser.add_argument("-q", "--quiet", dest="log_level", action="store_const",
                        const="warning", default=argparse.SUPPRESS,
                        help="--log-level warning: only what went wrong")  # fmt: skip
    parser.add_argument(
        "--trace",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="at exit, write the run's timeline as a Chrome trace (Perfetto) to FILE",
    )
    parser.add_argument(
        "--flight-recorder",
        action="store_true",
        default=argparse.SUPPRESS,
        help="turn on torch's flight recorder in the workers (NCCL and gloo); every rank's "
        "trace is kept with the dump of a hung one",
    )
    parser.add_argument(
        "training_script", nargs="?", metavar="SCRIPT", help="script, module, or -- CMD ARGS"
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="ARGS")


def log_level(args: argparse.Namespace) -> str:
    """The level of ``watchdogd run``'s own log on stderr (``logging``'s name for it)."""
    return str(getattr(args, "log_level", None) or "info").upper()


def _logs_specs_name(name: str) -> str:
    """``--logs-specs``: torch's ``default``, else a ``torchrun.logs_specs`` entry point.

    It is found as torchrun finds it, and loaded, with torch, by the group's
    helper process, never here.
    """
    if name != "default" and not has_entry_point(LOGS_SPECS_GROUP, name):
        raise OptionsError("logs_specs", not_found(LOGS_SPECS_GROUP, name))
    return name


def _comma_list(value: str) -> list[str]:
    return [item for item in value.split(",") if item]


def _key_values(value: str) -> dict[str, str]:
    """``--rdzv-conf KEY=VALUE,…``."""
    conf = {}
    for item in _comma_list(value):
        key, equals, setting = item.partition("=")
        if not equals:
            raise OptionsError("rdzv_conf", f"{item!r}: expected KEY=VALUE")
        conf[key] = setting
    return conf


def _deadline_rule(value: str) -> DeadlineRule:
    """``--deadline PATTERN[:KEY=VALUE,...]``; OptionsError names what is wrong.

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
            raise OptionsError("deadlines", f"{value!r}: {setting!r} is not KEY=VALUE")
        fields[key] = number
    try:
        return msgspec.convert(fields, DeadlineRule, strict=False)  # "600" is 600
    except msgspec.ValidationError as e:
        raise OptionsError("deadlines", f"{value!r}: {e}") from None


def _fault(text: str) -> Fault:
    try:
        return parse_fault(text)
    except ValueError as e:
        raise OptionsError("faults", str(e)) from None


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """The options the flags given (on the command line or as ``PET_*``) ask for.

    The namespace holds only the flags given (``add_run_arguments``): the
    rest keep :class:`RunOptions`' defaults. OptionsError names a bad one.
    """
    given = {key: value for key, value in vars(args).items() if key != "command"}
    script, rest = given.pop("training_script", None), given.pop("training_script_args", [])
    if script == "--":  # `-- CMD ARGS`: a program
        if not rest:
            raise OptionsError("script", "nothing to run after --")
        script, rest = rest[0], rest[1:]
        given.update(no_python=True, module=False)
    if script is not None:
        given.update(script=script, script_args=list(rest))
    if "nnodes" in given:
        given["min_nodes"], given["max_nodes"] = parse_nnodes(given.pop("nnodes"))
    if "rdzv_id" in given:
        given["run_id"] = given.pop("rdzv_id")
    if "rdzv_conf" in given:
        given["rdzv_conf"] = _key_values(given["rdzv_conf"])
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters", "prewarm"):
        if name in given:  # as torchrun takes them: a filter cannot hold a comma
            given[name] = _comma_list(given[name])
    if "local_ranks_filter" in given:
        given["local_ranks_filter"] = _comma_list(given["local_ranks_filter"]) or None
    if "logs_specs" in given:
        given["logs_specs"] = _logs_specs_name(given["logs_specs"])
    given["deadlines"] = [_deadline_rule(rule) for rule in given.pop("deadline", [])]
    given["faults"] = [_fault(text) for text in given.pop("inject", [])]
    return run_options(given)


_FLAG_OF = {
    "min_nodes": "--nnodes",
    "max_nodes": "--nnodes",
    "run_id": "--rdzv-id",
    "script": "SCRIPT",
    "script_args": "ARGS",
    "deadlines": "--deadline",
    "faults": "--inject",
}


def _usage_error(error: ValueError) -> str:
    """``error`` in the command line's words: the flag, not the option's field."""
    if isinstance(error, OptionsError):
        flag = _FLAG_OF.get(error.field, "--" + error.field.replace("_", "-"))
        return f"{flag}: {error.message}"
    return str(error)


def summarize(runner: GroupRunner, state: GroupState) -> str:
    info = runner.info()
    lines = [
        f"watchdogd run: group {info.name} {state.value} "
        f"after {info.attempt + 1} attempt(s), {runner.machine.restarts_used} restart(s)"
    ]
    lines += [f"  {line}" for line in runner.do_not_requeue]
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
        if failure.error_file and os.path.exists(failure.error_file):  # a killed rank wrote none
            lines.append(f"  error file: {failure.error_file}")
    return "\n".join(lines)


def run(args: argparse.Namespace, config: Config) -> int:
    try:
        options = options_from_args(args)
        signals = handled_signals(options.signals_to_handle)
        check_entrypoint(options)
        run_config = daemon_config(options, config)
        spec = group_spec(options, this_host())  # last: it makes the run's log directory
    except ValueError as e:
        print(f"watchdogd run: {_usage_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    unread = unread_rdzv_conf(options)
    if unread:
        print(f"watchdogd run: warning: --rdzv-conf {', '.join(unread)}: "
              "not read by torch's c10d backend, ignored", file=sys.stderr)  # fmt: skip
    try:
        outcome = run_group(run_config, spec, signals=signals, fault_consent=_FAULT_CONSENT)
    except ConfigError as e:
        print(f"watchdogd run: {e}", file=sys.stderr)
        return EXIT_USAGE
    if options.trace and outcome.daemon is not None:
        _write_trace(outcome.daemon, options.trace)
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
    return EXIT_NO_PROGRESS if outcome.runner.do_not_requeue else EXIT_FAILED


def _write_trace(daemon: Daemon, path: str) -> None:
    """The run's timeline, once it is over (the loop has stopped: nothing to hold up)."""
    try:
        summary = write_trace(path, daemon.events.since(), daemon.queries.timeline_spans(None))
    except OSError as e:
        print(f"watchdogd run: --trace {path}: {e.strerror}", file=sys.stderr)
        return
    print(f"watchdogd run: {summary}", file=sys.stderr)
