"""torchrun's own end-to-end launcher cases, with ``watchdogd run`` as the launcher.

These are the cases of torch 2.13's ``test/distributed/launcher/test_run.py``
that neither patch torch's internals nor need a GPU, written again here
with the same arguments and the same checks (the workers in
``launcher_bin/`` do what torch's ``bin/`` scripts do). torch's test calls
``launch.main(args)`` and expects it to return, to raise ``ValueError`` or
to raise ``ChildFailedError``; ``watchdogd run`` says the same by its exit
status: 0, 2 (a usage error) or anything else.

With ``WATCHDOGD_TEST_TORCHRUN=1`` every case also runs through torchrun's
``launch.main`` first, and the two launchers must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

import pytest

from watchdogd.linux.net import free_port

BIN = Path(__file__).parent / "launcher_bin"
Outcome = Literal["returns", "ValueError", "ChildFailedError"]

pytest.importorskip("torch.distributed.run")


class Case(NamedTuple):
    args: list[str]
    """``{dir}`` is a fresh directory, ``{port}`` a free port, ``{bin}`` launcher_bin/."""
    outcome: Outcome
    ranks: int | None = None
    """How many ``$DIR/$RANK`` files the workers must leave (None: not checked)."""
    env: dict[str, str] | None = None
    check: Callable[[Path, str], None] | None = None
    """Called with the directory and the launcher's stdout."""
    agents: int = 1
    """Launchers started at once with the same arguments (nodes of one job)."""
    runs: int = 1
    """Times in a row through ``watchdogd run`` (a case that once failed only now and then)."""


def _launched(directory: Path, _stdout: str) -> None:
    assert (directory / "out").read_text() == "True"


def _prefixed(directory: Path, stdout: str) -> None:
    for rank in range(4):
        assert f"[rank{rank}]: creating " in stdout, stdout


_SCRIPT = ["--monitor-interval=1", "--start-method=spawn", "{bin}/rank_file.py"]
_TOUCH = "--touch-file-dir={dir}"
_BASH = [
    "--monitor-interval=1",
    "--start-method=spawn",
    "--no-python",
    "{bin}/rank_file.sh",
    "{dir}",
]
_C10D = [
    "--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{port}",
]  # fmt: skip
_PET = {
    "PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": "pet",
    "PET_MONITOR_INTERVAL": "1", "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1",
}  # fmt: skip

CASES = {
    "launch_user_script_python": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=py", *_SCRIPT, _TOUCH], "returns", 4
    ),
    "launch_user_script_python_caffe2_bc": Case(
        [
            "--nnodes=1",
            "--nproc-per-node=4",
            "--master-addr=localhost",
            "--master-port={port}",
            "--node-rank=0",
            *_SCRIPT,
            _TOUCH,
        ],
        "returns",
        4,
    ),
    "launch_user_script_bash_refuses_module": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=sh", "--module", *_BASH], "ValueError"
    ),
    "launch_user_script_bash": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=sh", *_BASH], "returns", 4
    ),
    "launch_user_script_default_nproc": Case(["--nnodes=1", "--rdzv-id=one", *_BASH], "returns", 1),
    "launch_with_env_vars_refuses_module": Case(
        _BASH[-2:], "ValueError", env={**_PET, "PET_MODULE": "1"}
    ),
    "launch_with_env_vars": Case(_BASH[-2:], "returns", 4, env={**_PET, "PET_MODULE": "0"}),
    "nproc_launch_number_configurations": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=n", *_BASH], "returns", 4
    ),
    "nproc_launch_unknown_configurations": Case(
        ["--nnodes=1", "--nproc-per-node=unknown", "--rdzv-id=n", *_BASH], "ValueError"
    ),
    "launch_elastic": Case(
        [
            *_C10D,
            "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
            "--rdzv-id={run_id}",
            *_SCRIPT,
            _TOUCH,
        ],
        "returns",
        4,
    ),
    "launch_elastic_worker_raise_exception": Case(
        [
            *_C10D,
            "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
            "--rdzv-id={run_id}",
            "--max-restarts=0",
            *_SCRIPT,
            "--fail",
        ],
        "ChildFailedError",
    ),
    "launch_standalone": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--standalone", *_SCRIPT, _TOUCH], "returns", 4
    ),
    "launch_run_path": Case(
        ["--run-path", "--nnodes=1", "--nproc-per-node=4", *_SCRIPT, _TOUCH], "returns", 4
    ),
    "launch_elastic_multiple_agents": Case(
        [*_C10D, "--rdzv_conf=timeout=5", "--rdzv-id={run_id}", *_SCRIPT, _TOUCH],
        "returns",
        8,
        agents=2,
    ),
    "is_torchelastic_launched": Case(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--monitor-interval=1",
            "{bin}/launched.py",
            "--out-file={dir}/out",
        ],
        "returns",
        check=_launched,
    ),
    "is_torchelastic_launched_with_logs_spec_defined": Case(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--monitor-interval=1",
            "--logs_specs=default",
            "{bin}/launched.py",
            "--out-file={dir}/out",
        ],
        "returns",
        check=_launched,
    ),
    "logs_logs_spec_entrypoint_must_be_defined": Case(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--monitor-interval=1",
            "--logs_specs=DOESNOT_EXIST",
            "{bin}/launched.py",
        ],
        "ValueError",
    ),
    "init_method_tcp_with_torchelastic": Case(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--master-addr=localhost",
            "--master-port={port}",
            "--monitor-interval=1",
            "{bin}/init_method.py",
            "--init-method=tcp://localhost:{port}",
        ],
        "returns",
        # A store in rank 0 that exits first aborts the others: the job's store must outlive it.
        runs=2,
    ),
    "init_method_env_with_torchelastic": Case(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--master-addr=localhost",
            "--master-port={port}",
            "--monitor-interval=1",
            "{bin}/init_method.py",
            "--init-method=env://",
        ],
        "returns",
    ),
    "capture_logs_using_default_logs_specs": Case(
        ["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=logs", "--redirect=3", "--tee=3", *_BASH],
        "returns",
        env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "},
        check=_prefixed,
    ),
}

# torchrun's launch.main, reporting how it ended the way torch's test sees it.
_TORCHRUN = """
import sys
import torch.distributed.run as launch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
try:
    launch.main(sys.argv[1:])
except ValueError:
    sys.exit(2)
except ChildFailedError:
    sys.exit(1)
"""


def _outcome(returncode: int) -> Outcome:
    if returncode == 0:
        return "returns"
    return "ValueError" if returncode == 2 else "ChildFailedError"


def _launch(command: list[str], case: Case, env: dict[str, str]) -> tuple[Outcome, str]:
    procs = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(case.agents)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    outcomes = {_outcome(proc.returncode) for proc in procs}
    stdout = "".join(out for out, _ in results)
    assert len(outcomes) == 1, f"the agents disagree: {outcomes}\n" + "".join(e for _, e in results)
    (outcome,) = outcomes
    if outcome != case.outcome:
        print("".join(err for _, err in results)[-4000:])
    return outcome, stdout


def _run(launcher: Literal["torchrun", "watchdogd"], case: Case, tmp_path: Path) -> None:
    directory = tmp_path / launcher
    directory.mkdir()
    fields = {"dir": str(directory), "port": str(free_port("127.0.0.1")), "bin": str(BIN),
              "run_id": uuid.uuid4().hex}  # fmt: skip
    args = [arg.format(**fields) for arg in case.args]
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PET_", "TORCHELASTIC_", "WATCHDOGD_"))
    }
    env.update(case.env or {}, LAUNCHER_CASE_SENTINEL="FOOBAR")
    if launcher == "torchrun":
        command = [sys.executable, "-c", _TORCHRUN, *args]
    else:
        command = [sys.executable, "-m", "watchdogd.cli.main", "run", *args]
    outcome, stdout = _launch(command, case, env)
    assert outcome == case.outcome, f"{launcher}: {outcome}, torch's test expects {case.outcome}"
    if case.ranks is not None:
        assert sorted(os.listdir(directory), key=int) == [str(r) for r in range(case.ranks)]
    if case.check is not None:
        case.check(directory, stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CASES)
def test_torchrun_case(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    if os.environ.get("WATCHDOGD_TEST_TORCHRUN") == "1":
        _run("torchrun", case, tmp_path)
    for run in range(case.runs):
        (tmp_path / str(run)).mkdir()
        _run("watchdogd", case, tmp_path / str(run))
