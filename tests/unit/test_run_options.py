"""The one options model under ``watchdogd run`` and ``LaunchConfig``: direct calls, no processes.

Where torch's command line and torch's ``LaunchConfig`` differ by design,
each front keeps torch's own default: read from torch itself here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import pytest

from watchdogd.cli.run import add_run_arguments, options_from_args, run
from watchdogd.core.config import Config
from watchdogd.core.run_options import (
    DEFAULT_RDZV_TIMEOUT,
    Host,
    OptionsError,
    RunOptions,
    daemon_config,
    group_spec,
    handled_signals,
    parse_nnodes,
    run_options,
    unread_rdzv_conf,
)
from watchdogd.launcher import DefaultLogsSpecs, LaunchConfig, Std, launch_options, run_launch

torch_run = pytest.importorskip("torch.distributed.run")
torch_api = pytest.importorskip("torch.distributed.launcher.api")


@pytest.fixture(autouse=True)
def _no_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's parser and ours read ``PET_*``: none leaks in from the caller."""
    for name in list(os.environ):
        if name.startswith("PET_") or name == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(name)


def cli(*flags: str, environ: Mapping[str, str] | None = None) -> RunOptions:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, {} if environ is None else environ)
    return options_from_args(parser.parse_args([*flags, "train.py"]))


def host(tmp_path: Path, gpus: list[str] | None = None, **environ: str) -> Host:
    made = iter(range(100))
    return Host(
        environ=environ,
        gpus=gpus,
        cpus=6,
        executable="/usr/bin/python3",
        make_log_dir=lambda parent, run_id: f"{parent or tmp_path}/{run_id}_{next(made)}",
    )


# -- torch's defaults, read from torch -------------------------------------------------


def test_the_command_lines_defaults_are_torchruns() -> None:
    theirs = torch_run.get_args_parser().parse_args(["train.py"])
    ours = cli()
    assert parse_nnodes(theirs.nnodes) == (ours.min_nodes, ours.max_nodes)
    assert int(theirs.nproc_per_node) == ours.nproc_per_node
    assert theirs.rdzv_id == ours.run_id
    same = [
        "max_restarts", "role", "rdzv_backend", "rdzv_endpoint", "node_rank", "master_addr",
        "master_port", "monitor_interval", "start_method", "signals_to_handle", "standalone",
        "local_addr", "log_dir", "redirects", "tee", "event_log_handler", "logs_specs",
        "numa_binding", "shutdown_timeout", "virtual_local_rank", "no_python", "module",
        "run_path", "duplicate_stdout_filters", "duplicate_stderr_filters",
    ]  # fmt: skip
    assert {k: getattr(ours, k) for k in same} == {k: getattr(theirs, k) for k in same}
    # torch's design: the command line restarts nothing, as role "default", on static.
    assert (ours.max_restarts, ours.role, ours.rdzv_backend) == (0, "default", "static")


def test_launch_config_has_torchs_fields_in_torchs_order_with_torchs_defaults() -> None:
    theirs = dataclasses.fields(torch_api.LaunchConfig)
    ours = dataclasses.fields(LaunchConfig)
    assert [f.name for f in ours] == [f.name for f in theirs]
    for mine, torchs in zip(ours, theirs, strict=True):
        assert mine.default == torchs.default, mine.name
        factory = dataclasses.MISSING
        assert (mine.default_factory is factory) == (torchs.default_factory is factory)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    # torch's design: the API restarts 3 times, as role "default_role", on etcd.
    assert (config.max_restarts, config.role, config.rdzv_backend) == (3, "default_role", "etcd")
    torchs = torch_api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert config.rdzv_configs == torchs.rdzv_configs == {"timeout": DEFAULT_RDZV_TIMEOUT}
    assert config.shutdown_timeout == torchs.shutdown_timeout == 30


def test_both_fronts_keep_their_own_defaults_in_the_options(tmp_path: Path) -> None:
    from_cli = cli()
    from_api = launch_options(
        LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_endpoint="h:2379"),
        ["train"],
    )
    assert (from_cli.max_restarts, from_cli.role, from_cli.rdzv_backend) == (0, "default", "static")
    api_defaults = (from_api.max_restarts, from_api.role, from_api.rdzv_backend)
    assert api_defaults == (3, "default_role", "etcd")
    assert group_spec(from_api, host(tmp_path)).rendezvous.join_timeout == DEFAULT_RDZV_TIMEOUT


# -- the command line: only the flags given, PET_* too ----------------------------------


def test_the_command_line_overrides_only_the_flags_given() -> None:
    options = cli("--nproc-per-node", "2", "--nnodes=1:3", "--rdzv-conf", "lease_ttl=4")
    expected = RunOptions(
        script="train.py", nproc_per_node=2, min_nodes=1, max_nodes=3, rdzv_conf={"lease_ttl": "4"}
    )
    assert options == expected


def test_the_command_line_reads_pet_variables_and_a_flag_wins() -> None:
    environ = {"PET_MAX_RESTARTS": "7", "PET_STANDALONE": "1", "PET_ROLE": "trainer"}
    options = cli("--role", "mine", environ=environ)
    assert (options.max_restarts, options.standalone, options.role) == (7, True, "mine")
    assert cli(environ={"PET_STANDALONE": "0"}).standalone is False


def test_the_api_reads_no_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    monkeypatch.setenv("PET_ROLE", "trainer")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "8")
    options = launch_options(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2), ["x"])
    assert (options.max_restarts, options.role, options.nproc_per_node) == (3, "default_role", 2)


# -- errors: a field named, in each front's words ---------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_restarts": -1}, "max_restarts"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes"),
        ({"signals_to_handle": "SIGTERM,SIGNOPE"}, "signals_to_handle"),
        ({"rdzv_backend": "zeus"}, "rdzv_backend"),
        ({"nproc_per_node": "many"}, "nproc_per_node"),
        ({"deadlines": [{"scope": ""}]}, "deadlines"),
        ({"no_python": True, "module": True}, "module"),
    ],
)
def test_a_bad_option_names_its_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(OptionsError) as caught:
        run_options(fields)
    assert caught.value.field == field


def test_the_log_level_from_the_flags_and_only_logging_s_names() -> None:
    assert (cli().log_level, cli("-q").log_level) == (None, "warning")
    assert cli("--quiet", "--log-level", "debug").log_level == "debug"  # the last one given
    with pytest.raises(OptionsError) as caught:
        run_options({"log_level": "loud"})
    assert caught.value.field == "log_level"


def test_the_api_raises_value_error_naming_the_configs_field() -> None:
    def launch(**fields: object) -> None:
        fields = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **fields}
        launch_options(LaunchConfig(**fields), ["x"])  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"^max_restarts: Expected `int` >= 0"):
        launch(max_restarts=-1)
    with pytest.raises(ValueError, match=r"^signals_to_handle: 'SIGNOPE' is not a signal name"):
        launch(signals_to_handle="SIGNOPE")
    with pytest.raises(ValueError, match=r"^min_nodes: 3 is above max_nodes 2"):
        launch(min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match=r"^metrics_cfg:"):
        launch(metrics_cfg={"a": "b"})
    with pytest.raises(ValueError, match=r"^rdzv_endpoint: the etcd backend needs"):
        group_spec(launch_options(LaunchConfig(1, 2, 1), ["x"]), host(Path("/nowhere")))
    conf = {"join_timeout": "x"}
    c10d = LaunchConfig(1, 2, 1, run_id="j", rdzv_backend="c10d", rdzv_configs=conf)
    with pytest.raises(ValueError, match=r"^rdzv_configs: join_timeout: Expected `float"):
        run_launch(c10d, "true", [])  # refused before anything runs


def test_the_command_line_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, {})
    for flags, said in [
        (["--max-restarts", "-1"], "--max-restarts: Expected `int` >= 0"),
        (["--nnodes", "2:x"], "--nnodes: '2:x': expected N or MIN:MAX"),
        (["--nnodes", "1:2"], "--nnodes: the static backend needs a fixed node count"),
        (["--rdzv-id", "x", "--rdzv-backend", "etcd"], "--rdzv-endpoint: the etcd backend"),
        (["--straggler-window", "1"], "--straggler-window: Expected `int` >= 2\n"),
        (["--rdzv-backend", "c10d", "--nnodes", "2", "--rdzv-conf", "join_timeout=x"],
         "--rdzv-conf: join_timeout: Expected `float | null`, got `str`\n"),
    ]:  # fmt: skip
        assert run(parser.parse_args([*flags, "--no-python", "true"]), Config()) == 2
        assert f"watchdogd run: {said}" in capsys.readouterr().err


# -- group_spec: pure, the host passed in -----------------------------------------------


def test_the_host_decides_nproc_the_interpreter_and_the_grace(tmp_path: Path) -> None:
    gpus = host(tmp_path, gpus=["0", "1", "2"], PYTHON_EXEC="/opt/py")
    assert group_spec(run_options({"script": "t.py", "nproc_per_node": "gpu"}), gpus).nproc == 3
    assert group_spec(run_options({"script": "t.py", "nproc_per_node": "auto"}), gpus).nproc == 3
    no_gpu = host(tmp_path, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2.5")
    assert group_spec(run_options({"script": "t.py", "nproc_per_node": "auto"}), no_gpu).nproc == 6
    with pytest.raises(OptionsError, match="no GPU is visible"):
        group_spec(run_options({"script": "t.py", "nproc_per_node": "gpu"}), no_gpu)
    spec = group_spec(run_options({"script": "t.py", "module": True, "nproc_per_node": 2}), gpus)
    assert spec.entrypoint == ["/opt/py", "-u", "-m", "t.py"]
    assert spec.env["OMP_NUM_THREADS"] == "1" and spec.shutdown_timeout == 30
    assert group_spec(run_options({"script": "t.py"}), no_gpu).shutdown_timeout == 2.5
    grace = run_options({"script": "t.py", "shutdown_timeout": 4})
    assert group_spec(grace, no_gpu).shutdown_timeout == 4


def test_each_run_gets_a_log_dir_of_its_own_as_under_torchrun(tmp_path: Path) -> None:
    machine = host(tmp_path)
    assert group_spec(run_options({"script": "t"}), machine).log_dir is None
    assert group_spec(run_options({"script": "t", "tee": "3"}), machine).log_dir == str(
        tmp_path / "none_0"
    )  # files nobody placed: a temporary directory of their own
    placed = run_options({"script": "t", "log_dir": "/var/log/x", "run_id": "job"})
    assert group_spec(placed, machine).log_dir == "/var/log/x/job_1"
    assert group_spec(placed, machine).log_dir == "/var/log/x/job_2"  # never the last one's
    theirs = run_options({"script": "t", "log_dir": "/var/log/x", "logs_specs": "flat"})
    assert group_spec(theirs, machine).log_dir == "/var/log/x"  # a LogsSpecs makes its own


def test_the_static_master_comes_from_the_endpoint_unless_standalone(tmp_path: Path) -> None:
    fields = {"script": "t", "rdzv_endpoint": "node0:1234", "max_nodes": 2, "min_nodes": 2}
    rdzv = group_spec(run_options({**fields, "node_rank": 1}), host(tmp_path)).rendezvous
    assert (rdzv.master_addr, rdzv.master_port, rdzv.node_rank) == ("node0", 1234, 1)
    alone = run_options({"script": "t", "rdzv_endpoint": "node0:1234", "standalone": True})
    rdzv = group_spec(alone, host(tmp_path)).rendezvous
    assert (rdzv.backend, rdzv.master_addr, rdzv.master_port) == ("static", "127.0.0.1", None)


def test_c10d_keys_torch_does_not_read_are_named(tmp_path: Path) -> None:
    options = run_options(
        {"script": "t", "rdzv_backend": "c10d", "rdzv_conf": {"read_timeout": "3", "rank": "1"}}
    )
    assert unread_rdzv_conf(options) == ["rank"]
    assert group_spec(options, host(tmp_path)).rendezvous.c10d.read_timeout == 3


# -- LaunchConfig into options ----------------------------------------------------------


def test_launch_config_maps_into_the_options(tmp_path: Path) -> None:
    logs = DefaultLogsSpecs(
        log_dir=str(tmp_path), redirects={1: Std.ERR}, tee=Std.ALL, local_ranks_filter={1, 0}
    )
    alone = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
        rdzv_endpoint="localhost:0", logs_specs=logs, duplicate_stdout_filters=["a,b"],
    )  # fmt: skip
    options = launch_options(alone, ["prog", "arg"], master_port=1234)
    assert (options.standalone, options.script, options.script_args) == (True, "prog", ["arg"])
    assert (options.redirects, options.tee, options.log_dir) == ("1:2", "3", str(tmp_path))
    assert options.local_ranks_filter == [0, 1] and options.master_port == 1234
    assert options.duplicate_stdout_filters == ["a,b"]  # a list from Python stays one
    c10d = LaunchConfig(
        min_nodes=2, max_nodes=4, nproc_per_node=1, rdzv_backend="c10d",
        rdzv_endpoint="store:29400", rdzv_configs={"read_timeout": 9},
    )  # fmt: skip
    options = launch_options(c10d, ["prog"])
    assert options.rdzv_conf == {"read_timeout": "9"}  # not __post_init__'s timeout
    assert (options.min_nodes, options.max_nodes) == (2, 4)
    static = LaunchConfig(
        min_nodes=2, max_nodes=2, nproc_per_node=1, rdzv_backend="static",
        rdzv_endpoint="node0:29500", rdzv_configs={"rank": 1},
    )  # fmt: skip
    rdzv = group_spec(launch_options(static, ["prog"]), host(tmp_path)).rendezvous
    assert (rdzv.node_rank, rdzv.master_addr, rdzv.master_port) == (1, "node0", 29500)


def test_the_gpu_release_wait_from_either_front_or_the_groups_default(tmp_path: Path) -> None:
    assert group_spec(cli(), host(tmp_path)).gpu_release_timeout == 30.0
    flagged = cli("--gpu-release-timeout", "12.5")
    assert group_spec(flagged, host(tmp_path)).gpu_release_timeout == 12.5
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    options = launch_options(config, ["prog"], gpu_release_timeout=0)
    assert group_spec(options, host(tmp_path)).gpu_release_timeout == 0
    with pytest.raises(OptionsError) as caught:
        run_options({"gpu_release_timeout": -1})
    assert caught.value.field == "gpu_release_timeout"


def test_the_no_progress_limit_and_step_scope_from_either_front(tmp_path: Path) -> None:
    spec = group_spec(cli(), host(tmp_path))
    assert (spec.max_no_progress_restarts, spec.progress_scope) == (3, None)
    flagged = cli("--max-no-progress-restarts", "0", "--progress-scope", "step")
    spec = group_spec(flagged, host(tmp_path))
    assert (spec.max_no_progress_restarts, spec.progress_scope) == (0, "step")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    options = launch_options(config, ["prog"], max_no_progress_restarts=1, progress_scope="s")
    spec = group_spec(options, host(tmp_path))
    assert (spec.max_no_progress_restarts, spec.progress_scope) == (1, "s")
    with pytest.raises(OptionsError) as caught:
        cli("--max-no-progress-restarts", "-1")
    assert caught.value.field == "max_no_progress_restarts"


def test_a_workers_memory_cap_from_either_front_in_bytes(tmp_path: Path) -> None:
    assert group_spec(cli(), host(tmp_path)).worker_memory_max is None
    flagged = cli("--worker-memory-max", "50M")
    assert group_spec(flagged, host(tmp_path)).worker_memory_max == 50 << 20
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    options = launch_options(config, ["prog"], worker_memory_max=2 << 30)
    assert group_spec(options, host(tmp_path)).worker_memory_max == 2 << 30
    with pytest.raises(OptionsError) as caught:
        run_options({"worker_memory_max": "50 MB"})
    assert caught.value.field == "worker_memory_max"
    with pytest.raises(OptionsError) as caught:  # below what an interpreter needs to start
        group_spec(run_options({"script": "t.py", "worker_memory_max": "4K"}), host(tmp_path))
    assert caught.value.field == "worker_memory_max"


# -- the daemon's config: every change checked ------------------------------------------


def test_daemon_config_checks_what_the_options_ask() -> None:
    assert daemon_config(run_options({}), Config()) == Config()
    drill = run_options({"faults": [{"kind": "kill", "rank": 0}], "event_log": "/tmp/e"})
    changed = daemon_config(drill, Config())
    assert (changed.fault_injection, changed.event_log) == (True, "/tmp/e")
    assert daemon_config(cli("--metrics-listen", "9400"), Config()).metrics_listen == "9400"
    with pytest.raises(OptionsError, match=r"^straggler_window: Expected `int` >= 2$") as caught:
        daemon_config(run_options({"straggler_window": 1}), Config())
    assert caught.value.field == "straggler_window"


def test_handled_signals_are_torchruns() -> None:
    assert handled_signals("SIGTERM, SIGUSR1") == [signal.SIGTERM, signal.SIGUSR1]
    with pytest.raises(OptionsError, match="SIGKILL cannot be handled"):
        handled_signals("SIGKILL")


def test_what_the_group_spec_refuses_is_named_as_the_option(tmp_path: Path) -> None:
    with pytest.raises(OptionsError) as caught:
        group_spec(run_options({"script": "t", "role": "a role"}), host(tmp_path))
    assert caught.value.field == "role"
    with pytest.raises(OptionsError) as caught:
        group_spec(run_options({"script": "t", "tee": "9"}), host(tmp_path))
    assert caught.value.field == "tee"
    with pytest.raises(ValueError, match=r"^node_rank 3 must be below nnodes 1$"):
        group_spec(run_options({"script": "t", "node_rank": 3}), host(tmp_path))


def test_the_quarantine_rule_and_node_name_from_either_front(tmp_path: Path) -> None:
    etcd = ("--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd:2379", "--nnodes", "2:3")
    spec = group_spec(cli(*etcd), host(tmp_path))
    assert (spec.quarantine_after, spec.quarantine_window) == (3, 3600.0)
    assert spec.rendezvous.node_name is None  # the agent takes the host name
    flagged = cli(*etcd, "--quarantine-after", "1", "--quarantine-window", "2.5",
                  "--node-name", "gpu-a7")  # fmt: skip
    spec = group_spec(flagged, host(tmp_path))
    assert (spec.quarantine_after, spec.quarantine_window) == (1, 150.0)
    assert spec.rendezvous.node_name == "gpu-a7"
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_backend="etcd",
                          rdzv_endpoint="etcd:2379")  # fmt: skip
    options = launch_options(config, ["prog"], quarantine_after=0, node_name="n1")
    spec = group_spec(options, host(tmp_path))
    assert (spec.quarantine_after, spec.rendezvous.node_name) == (0, "n1")
    with pytest.raises(OptionsError) as caught:
        cli("--quarantine-window", "0")
    assert caught.value.field == "quarantine_window"
    with pytest.raises(OptionsError) as caught:
        group_spec(cli(*etcd, "--node-name", "a/b"), host(tmp_path))
    assert caught.value.field == "node_name"


def test_replacing_stragglers_is_off_unless_asked_and_only_on_etcd(tmp_path: Path) -> None:
    etcd = ("--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd:2379", "--nnodes", "2:3")
    assert group_spec(cli(*etcd), host(tmp_path)).replace_stragglers_after is None
    spec = group_spec(cli(*etcd, "--replace-stragglers-after", "90"), host(tmp_path))
    assert spec.replace_stragglers_after == 90.0
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_backend="etcd",
                          rdzv_endpoint="etcd:2379")  # fmt: skip
    options = launch_options(config, ["prog"], replace_stragglers_after=30)
    assert group_spec(options, host(tmp_path)).replace_stragglers_after == 30.0
    with pytest.raises(OptionsError) as caught:
        cli(*etcd, "--replace-stragglers-after", "0")
    assert caught.value.field == "replace_stragglers_after"
    c10d = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "store:29400", "--nnodes", "2")
    for front in (c10d, ()):
        with pytest.raises(ValueError, match=r"^replace_stragglers_after: needs the etcd"):
            group_spec(cli(*front, "--replace-stragglers-after", "30"), host(tmp_path))
