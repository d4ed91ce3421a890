"""``watchdogd run`` as a torchrun drop-in: every torchrun flag, and what each new one does.

Each test runs the installed command as a real process, with real workers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from watchdogd.cli.run import add_run_arguments, options_from_args
from watchdogd.core.run_options import group_spec
from watchdogd.foreground import this_host
from watchdogd.groups.c10d_backend import _torch_conf_value

from ..conftest import kept_dumps, run_log_dir, wait_until
from ..conftest import watchdogd_run as run


def script(tmp_path: Path, code: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def plugin(tmp_path: Path, source: str, entry_points: str) -> dict[str, str]:
    """An installed distribution (a dist-info on ``PYTHONPATH``) with ``entry_points``."""
    site = tmp_path / "site"
    info = site / "wd_test_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wd-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (site / "wd_test_plugin.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


# -- every torchrun flag --------------------------------------------------------------


def test_every_torchrun_option_is_accepted() -> None:
    torch_run = pytest.importorskip("torch.distributed.run")
    theirs = {
        option
        for action in torch_run.get_args_parser()._actions
        for option in action.option_strings
    }
    ours = argparse.ArgumentParser()
    add_run_arguments(ours)
    assert theirs - set(ours._option_string_actions) == set()
    shown = subprocess.run(["watchdogd", "run", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0
    assert theirs - set(re.findall(r"(?<![\w-])--?[\w-]+", shown.stdout)) == set()


def test_an_unknown_flag_is_shown_with_the_usage_of_watchdogd_run() -> None:
    out = run("--nprocs", "--no-python", "true")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: watchdogd run ")
    assert "watchdogd run: error: unrecognized arguments: --nprocs\n" in out.stderr


# -- --log-level, --quiet ---------------------------------------------------------------

HOLDS_A_TIMER_AT_EXIT = """
import watchdogd_client as wd
wd.expires(after=60).__enter__()  # still armed when the worker exits 0
print("done")
"""


def test_routine_events_are_shown_only_at_debug(tmp_path: Path) -> None:
    worker = script(tmp_path, HOLDS_A_TIMER_AT_EXIT)
    default = run("--nproc-per-node", "2", worker)
    debug = run("--log-level", "debug", "--nproc-per-node", "2", worker)
    for out in default, debug:
        assert (out.returncode, out.stdout) == (0, "done\ndone\n"), out.stderr
    assert "state='SUCCEEDED'" in default.stderr and "timers_dropped" not in default.stderr
    assert debug.stderr.count("[watchdogd] timers_dropped reason='process exited'") == 2


def test_quiet_shows_only_what_went_wrong(tmp_path: Path) -> None:
    out = run("-q", "--nproc-per-node", "2", script(tmp_path, HOLDS_A_TIMER_AT_EXIT))
    assert (out.returncode, out.stdout, out.stderr) == (0, "done\ndone\n", "")
    failed = run("--quiet", "--no-python", "false")
    assert failed.returncode == 1
    assert "[watchdogd] worker_failed" in failed.stderr and "group_state" not in failed.stderr


# -- --numa-binding (the binding itself: tests/unit/test_numa.py, test_numa_binding.py) --


def test_numa_binding_that_cannot_be_applied_fails_the_launch_naming_the_rank() -> None:
    # No GPU is visible, whether or not this machine has one (and NVML).
    out = run("--numa-binding", "node", "--no-python", "true", env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 1
    assert "group default: numa binding 'node'" in out.stderr
    assert "local rank 0" in out.stderr
    out = run("--numa-binding", "rack", "--no-python", "true")
    assert out.returncode == 2 and "invalid choice: 'rack'" in out.stderr


# -- --signals-to-handle -----------------------------------------------------------------

RECORDER = """
import os, signal, sys, time
out = sys.argv[1]
def got(signum, frame):
    with open(os.path.join(out, "got-" + os.environ["RANK"]), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(0)
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"):
    signal.signal(getattr(signal, name), got)
open(os.path.join(out, "ready-" + os.environ["RANK"]), "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("sig", "flags"),
    [
        (signal.SIGTERM, []),
        (signal.SIGINT, []),
        (signal.SIGHUP, []),
        (signal.SIGQUIT, []),
        (signal.SIGUSR1, ["--signals-to-handle", "SIGTERM,SIGUSR1"]),
    ],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else "",
)
def test_a_handled_signal_reaches_every_worker_and_exits_1_as_torchrun(
    tmp_path: Path, sig: signal.Signals, flags: list[str]
) -> None:
    worker = script(tmp_path, RECORDER)
    proc = subprocess.Popen(
        ["watchdogd", "run", "--nproc-per-node", "2", *flags, worker, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with proc:
        wait_until(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)), timeout=30)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1, stderr
    assert [(tmp_path / f"got-{r}").read_text() for r in range(2)] == [sig.name, sig.name]
    assert f"{sig.name} received, passed to the workers; group STOPPED" in stderr


def test_signals_to_handle_must_name_signals() -> None:
    out = run("--signals-to-handle", "SIGTERM,SIGNOPE", "--no-python", "true")
    assert out.returncode == 2
    assert "--signals-to-handle: 'SIGNOPE' is not a signal name" in out.stderr
    out = run("--signals-to-handle", "SIGKILL", "--no-python", "true")
    assert out.returncode == 2 and "SIGKILL cannot be handled" in out.stderr


def test_straggler_flags_are_checked_as_the_config_keys_are() -> None:
    out = run("--straggler-publish-interval", "0.01", "--no-python", "true")
    assert out.returncode == 2
    assert "--straggler-publish-interval: Expected `float` >= 0.1" in out.stderr
    out = run("--straggler-window", "1", "--no-python", "true")
    assert out.returncode == 2 and "--straggler-window: " in out.stderr
    out = run("--straggler-window", "5", "--straggler-publish-interval", "1", "--no-python", "true")
    assert out.returncode == 0, out.stderr


# -- TORCHELASTIC_ERROR_FILE without --log-dir ----------------------------------------

ERROR_WRITER = """
import json, os, sys, time
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
path = os.environ["TORCHELASTIC_ERROR_FILE"]
told = os.path.join(sys.argv[1], f"{attempt}-{rank}")
with open(told + ".tmp", "w") as f:
    f.write(path)
os.replace(told + ".tmp", told)  # whole or absent, even if this rank is stopped now
if attempt == "0" and rank == "1":
    # Fail only once rank 0 has told its path: the failure stops rank 0.
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(sys.argv[1], "0-0")) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path, "w") as f:
        json.dump({"message": {"message": "RuntimeError: boom", "extraInfo": {}}}, f)
    sys.exit(3)
"""


PRIORITY_REPORTER = """
    import os, time
    import watchdogd_client as wd
    def sched(stat):  # (nice, policy): fields 19 and 41; the command name may hold spaces
        fields = open(stat).read().rpartition(")")[2].split()
        return int(fields[16]), int(fields[38])
    launcher = os.getppid()  # its loop runs on its main thread, whose tid is its pid
    def loop():
        return sched(f"/proc/{launcher}/stat")
    def becomes(policy, step=lambda: None):
        deadline = time.monotonic() + 5
        while loop()[1] != policy and time.monotonic() < deadline:
            step()
            time.sleep(0.005)
        return loop()
    calm = loop()
    client = wd.SocketTimerClient(signal=0)  # an expiry is only recorded
    # A deadline always within 50 ms keeps the loop real-time while we look.
    near = becomes(os.SCHED_FIFO, lambda: client.acquire("near", time.time() + 0.04))
    client.release("near")
    after = becomes(os.SCHED_OTHER)  # nothing due any more
    others = {sched(f"/proc/{launcher}/task/{tid}/stat")
              for tid in os.listdir(f"/proc/{launcher}/task") if tid != str(launcher)}
    print(f"worker={sched('/proc/self/stat')} calm={calm} near={near} after={after} "
          f"others={sorted(others)}")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="real time needs CAP_SYS_NICE")
def test_the_loop_runs_real_time_only_near_a_deadline_and_workers_start_plain(
    tmp_path: Path,
) -> None:
    out = run("--nproc-per-node", "1", script(tmp_path, PRIORITY_REPORTER))
    assert out.returncode == 0, out.stderr
    plain, fifo = (0, os.SCHED_OTHER), (0, os.SCHED_FIFO)
    expected = f"worker={plain} calm={plain} near={fifo} after={plain} others={[plain]}"
    assert expected in out.stdout, out.stdout


def test_every_worker_gets_an_error_file_per_attempt_without_a_log_dir(tmp_path: Path) -> None:
    worker = script(tmp_path, ERROR_WRITER)
    out = run("--nproc-per-node", "2", "--max-restarts", "1", worker, str(tmp_path))
    assert out.returncode == 0, out.stderr
    paths = {name: Path((tmp_path / name).read_text()) for name in ("0-0", "0-1", "1-0", "1-1")}
    run_dir = paths["0-0"].parents[2]
    assert run_dir.name.startswith("watchdogd-default-")
    assert {name: str(p.relative_to(run_dir)) for name, p in paths.items()} == {
        "0-0": "attempt_0/0/error.json",
        "0-1": "attempt_0/1/error.json",
        "1-0": "attempt_1/0/error.json",
        "1-1": "attempt_1/1/error.json",
    }
    assert not run_dir.exists()  # the group succeeded in the end: nothing left behind


def test_the_error_file_of_a_failure_is_reported_and_kept_without_a_log_dir(
    tmp_path: Path,
) -> None:
    worker = script(tmp_path, ERROR_WRITER)
    out = run("--nproc-per-node", "2", worker, str(tmp_path))
    assert out.returncode == 1
    assert "exited with status 3" in out.stderr
    assert "error: RuntimeError: boom" in out.stderr
    error_file = Path((tmp_path / "0-1").read_text())
    assert f"error file: {error_file}" in out.stderr
    assert error_file.exists()
    shutil.rmtree(error_file.parents[2])


def test_a_killed_rank_is_reported_without_an_error_file_it_never_wrote() -> None:
    out = run("--no-python", "sh", "-c", "kill -9 $$")
    assert out.returncode == 1
    assert "rank 0 (local rank 0" in out.stderr
    assert "error file:" not in out.stderr


# -- entrypoint forms -------------------------------------------------------------------


def test_a_missing_script_or_program_is_bad_usage_before_any_worker_starts() -> None:
    out = run("--nproc-per-node", "2", "nosuch.py")
    assert (out.returncode, out.stderr) == (2, "watchdogd run: SCRIPT: nosuch.py: no such file\n")
    out = run("--no-python", "./nosuch")
    assert out.returncode == 2
    assert "SCRIPT: ./nosuch: no such program" in out.stderr


def test_no_python_with_module_is_refused_in_torchruns_words() -> None:
    out = run("--no-python", "-m", "json.tool")
    assert out.returncode == 2
    assert (
        "Don't use both the '--no-python' flag and the '--module' flag at the same time"
        in out.stderr
    )


# -- TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE ------------------------------------------------


def test_the_prefix_template_from_the_environment_unless_the_flag_says_otherwise() -> None:
    command = ["--nproc-per-node", "2", "--tee", "3", "--no-python", "echo", "hello"]
    knob = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}
    out = run(*command, env=knob)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0]: hello", "[rank1]: hello"]
    out = run("--log-line-prefix-template", "<$local_rank>", *command, env=knob)
    assert sorted(out.stdout.splitlines()) == ["<0>hello", "<1>hello"]


# -- --event-log-handler ------------------------------------------------------------------

EVENTS_TO_FILE = """
import logging, os

def to_file():
    handler = logging.FileHandler(os.environ["WD_TEST_EVENTS"])
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler
"""


def test_an_event_handler_from_an_entry_point_receives_the_launchs_events(
    tmp_path: Path,
) -> None:
    env = plugin(
        tmp_path, EVENTS_TO_FILE, "[watchdogd.event_handlers]\nto_file = wd_test_plugin:to_file\n"
    )
    events = tmp_path / "events.jsonl"
    env["WD_TEST_EVENTS"] = str(events)
    out = run("--event-log-handler", "to_file", "--nproc-per-node", "2", "--no-python", "true",
              env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    recorded = [json.loads(line) for line in events.read_text().splitlines()]
    names = [event["name"] for event in recorded]
    assert names.count("worker_started") == names.count("worker_exited") == 2
    states = [e["metadata"]["state"] for e in recorded if e["name"] == "group_state"]
    assert states == ["HEALTHY", "SUCCEEDED"]
    assert {e["metadata"]["group"] for e in recorded if "group" in e["metadata"]} == {"default"}


def test_torchs_event_handler_names_and_an_unknown_one(tmp_path: Path) -> None:
    out = run("--event-log-handler", "console", "--no-python", "true")
    assert out.returncode == 0, out.stderr
    assert '{"name": "group_state", "source": "AGENT"' in out.stderr  # torch's JSON, on stderr
    out = run("--event_log_handler", "dynamic_rendezvous", "--no-python", "true")
    assert out.returncode == 0, out.stderr
    out = run("--event-log-handler", "nope", "--no-python", "true")
    assert out.returncode == 2
    assert "event_log_handler 'nope'" in out.stderr and "watchdogd.event_handlers" in out.stderr


# -- --logs-specs -----------------------------------------------------------------------


def test_logs_specs_default_and_a_missing_one(tmp_path: Path) -> None:
    out = run("--logs-specs", "default", "--log-dir", str(tmp_path), "-r", "1",
              "--no-python", "echo", "hello")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (run_log_dir(tmp_path) / "default/attempt_0/0/stdout.log").read_text() == "hello\n"
    out = run("--logs_specs", "DOESNOT_EXIST", "--no-python", "true")
    assert out.returncode == 2
    assert "Could not find entrypoint under 'torchrun.logs_specs[DOESNOT_EXIST]' key" in out.stderr


def test_a_log_dir_used_again_gets_a_directory_per_run_and_nothing_of_watchdogds(
    tmp_path: Path,
) -> None:
    worker = script(tmp_path, HOLDS_A_TIMER_AT_EXIT)  # so there are timers to snapshot
    logs = tmp_path / "logs"
    for _ in range(2):
        out = run("--log-dir", str(logs), "-r", "1", "--rdzv-id", "job", worker)
        assert out.returncode == 0, out.stderr
    runs = sorted(logs.iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2 and all(p.name.startswith("job_") for p in runs)
    assert f"log directory set to: {runs[1]}" in out.stderr
    files = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())
    assert files == sorted(f"{p.name}/default/attempt_0/0/stdout.log" for p in runs)
    assert [(p / "default/attempt_0/0/stdout.log").read_text() for p in runs] == ["done\n"] * 2


FLAT_LOGS_SPECS = """
    import os
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class FlatLogsSpecs(LogsSpecs):
        # Every rank's files side by side: LOG_DIR/RUN-aATTEMPT-rRANK.{out,err,json}
        @property
        def root_log_dir(self):
            return self._root_log_dir

        def reify(self, envs):
            if os.environ.get("BREAK_REIFY"):
                raise RuntimeError("no room for logs today")
            outs, errs, errors = {}, {}, {}
            for rank, env in envs.items():
                run, attempt = env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_RESTART_COUNT"]
                base = os.path.join(self._root_log_dir, f"{run}-a{attempt}-r{rank}")
                outs[rank], errs[rank], errors[rank] = base + ".out", base + ".err", base + ".json"
                env["TORCHELASTIC_ERROR_FILE"] = errors[rank]
                env["FLAT_LOGS"] = "yes"
            shown = set(self._local_ranks_filter or envs)
            tees = {rank: outs[rank] for rank in envs if rank in shown}
            return LogsDest(outs, errs, tees, {}, errors)
"""

FLAT_WORKER = """
    import os, pathlib, sys, time
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    flat, error_file = os.environ["FLAT_LOGS"], os.environ["TORCHELASTIC_ERROR_FILE"]
    print(f"rank {rank} flat={flat} error file {error_file}")
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    # Every rank has written before any fails: a failure stops the others.
    here = pathlib.Path(sys.argv[1])
    (here / f"wrote-{attempt}-{rank}").touch()
    while len(list(here.glob(f"wrote-{attempt}-*"))) < 2:
        time.sleep(0.01)
    sys.exit(3 if attempt == "0" else 0)
"""


def test_a_logs_specs_of_its_own_decides_every_attempts_files(tmp_path: Path) -> None:
    env = plugin(
        tmp_path, FLAT_LOGS_SPECS, "[torchrun.logs_specs]\nflat = wd_test_plugin:FlatLogsSpecs\n"
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    worker = script(tmp_path, FLAT_WORKER)
    out = run("--logs-specs", "flat", "--log-dir", str(logs), "--nproc-per-node", "2",
              "--max-restarts", "1", "--local-ranks-filter", "1", worker, str(tmp_path),
              env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for attempt in (0, 1):
        for rank in (0, 1):
            base = logs / f"none-a{attempt}-r{rank}"
            assert base.with_suffix(".out").read_text() == (
                f"rank {rank} flat=yes error file {base}.json\n"
            )
            assert base.with_suffix(".err").read_text() == f"stderr of rank {rank}\n"
    # Rank 1 is tee'd to the console (prefixed), rank 0 only to its files.
    assert "[default1]:rank 1 flat=yes" in out.stdout
    assert "rank 0" not in out.stdout
    assert sorted(p.name for p in logs.iterdir() if p.is_file()) == sorted(
        f"none-a{a}-r{r}.{ext}" for a in (0, 1) for r in (0, 1) for ext in ("out", "err")
    )


def test_a_logs_specs_that_fails_stops_the_launch_naming_it(tmp_path: Path) -> None:
    env = plugin(
        tmp_path, FLAT_LOGS_SPECS, "[torchrun.logs_specs]\nflat = wd_test_plugin:FlatLogsSpecs\n"
    )
    out = run("--logs-specs", "flat", "--log-dir", str(tmp_path), "--no-python", "true",
              env={**env, "BREAK_REIFY": "1"})  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "logs_specs 'flat'" in out.stderr and "no room for logs today" in out.stderr
    broken = plugin(
        tmp_path / "b", "import no_such_module\n", "[torchrun.logs_specs]\nx = wd_test_plugin:X\n"
    )
    out = run("--logs-specs", "x", "--no-python", "true", env=broken)
    assert out.returncode == 1, out.stderr
    assert "logs_specs 'x'" in out.stderr and "No module named 'no_such_module'" in out.stderr


# -- --shutdown-timeout and TORCH_ELASTIC_SHUTDOWN_TIMEOUT --------------------------------

STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
open(os.path.join(sys.argv[1], "ready"), "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("flags", "env"),
    [([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0.5"}), (["--shutdown-timeout", "0.5"], {})],
    ids=["environment", "flag"],
)
def test_the_sigkill_grace_from_the_flag_or_torchs_variable(
    tmp_path: Path, flags: list[str], env: dict[str, str]
) -> None:
    worker = script(tmp_path, STUBBORN)
    proc = subprocess.Popen(
        ["watchdogd", "run", *flags, worker, str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    with proc:
        wait_until(lambda: (tmp_path / "ready").exists(), timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)  # 30 s of grace would time out here
    assert proc.returncode == 1, stderr
    assert "SIGTERM received, passed to the workers; group STOPPED" in stderr


# -- durations in --rdzv-conf ------------------------------------------------------------


def test_every_duration_in_rdzv_conf_takes_a_fraction() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)

    def spec(*flags: str) -> object:
        options = options_from_args(parser.parse_args([*flags, "--no-python", "true"]))
        return group_spec(options, this_host()).rendezvous

    etcd = spec("--rdzv-backend=etcd", "--rdzv-endpoint=h:2379",
                "--rdzv-conf=lease_ttl=2.0,join_timeout=7.5,last_call_timeout=0.25")  # fmt: skip
    assert (etcd.lease_ttl, etcd.join_timeout, etcd.last_call) == (2.0, 7.5, 0.25)  # type: ignore[attr-defined]
    c10d = spec("--rdzv-backend=c10d", "--rdzv-conf=join_timeout=1.5,read_timeout=3.0,is_host=1")
    conf = c10d.c10d  # type: ignore[attr-defined]
    assert (conf.join_timeout, conf.read_timeout, conf.is_host) == (1.5, 3.0, True)
    # torch parses whole seconds: a fraction goes up to the next.
    assert [_torch_conf_value(v) for v in (1.5, 3.0, True)] == ["2", "3", "true"]


# -- beyond torchrun: --flight-recorder, --trace -----------------------------------------

STANDIN = str(Path(__file__).resolve().parent.parent / "flight_recorder_standin.py")


def test_flight_recorder_keeps_each_ranks_trace_of_a_hang_and_the_run_restarts(
    tmp_path: Path,
) -> None:
    logs, timeline = tmp_path / "logs", tmp_path / "run.json"
    out = run(
        "--flight-recorder", "--log-dir", str(logs), "--nproc-per-node", "2",
        "--max-restarts", "1", "--trace", str(timeline), STANDIN, "3", "1",
        env={"TORCH_NCCL_COORD_CHECK_MILSEC": "50"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"as a Chrome trace in {timeline}" in out.stderr
    trace = json.loads(timeline.read_text())["traceEvents"]
    kills = [e["name"] for e in trace if e.get("cat") == "kill"]
    assert kills == ["kill SIGKILL: step"]
    assert [e["name"] for e in trace if e.get("cat") == "restart"] == ["restart: attempt 1"]
    dumps = kept_dumps(out.stderr)
    (dump,) = dumps.glob("*.txt")
    assert sorted(p.name for p in dump.parent.glob("*.trace")) == [
        f"{dump.stem}.rank0.trace",
        f"{dump.stem}.rank1.trace",
    ]
    shutil.rmtree(dumps.parent)
    # Each attempt has a directory of its own for the ranks' pipes and traces.
    for attempt in (0, 1):
        recorder = run_log_dir(logs) / "default" / f"attempt_{attempt}" / "flight_recorder"
        assert {p.name for p in recorder.iterdir()} >= {"pipe_rank_0.pipe", "pipe_rank_1.pipe"}
