"""Restarts without progress end a run "do not requeue"; a run that progresses goes on.

Real ``watchdogd run`` processes, real workers (``progress_trainer.py``), each
attempt resuming from a checkpoint file as a trainer would.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from watchdogd import launcher
from watchdogd.core.progress import EXIT_NO_PROGRESS
from watchdogd.launcher import LaunchConfig, elastic_launch

from ..conftest import watchdogd_run as run

TRAINER = str(Path(__file__).with_name("progress_trainer.py"))


def train(tmp_path: Path, *flags: str, **knobs: str) -> tuple[int, str]:
    """``watchdogd run FLAGS progress_trainer.py``, told ``knobs``: its status and stderr."""
    out = run(*flags, TRAINER, str(tmp_path), env=knobs, timeout=120)
    return out.returncode, out.stderr


def test_no_progress_after_k_restarts_ends_with_the_code_naming_the_rank(tmp_path: Path) -> None:
    # Attempt 0 completes a step; every later one, rank 1 fails before any.
    events = tmp_path / "events.jsonl"
    status, stderr = train(
        tmp_path,
        "--nproc-per-node", "2", "--max-restarts", "10", "--max-no-progress-restarts", "2",
        "--event-log", str(events),
        FAIL_AT="2 if n == 0 else 1", FAIL_RANK="1", OTHERS_WAIT="30", FINISH_AT="100",
    )  # fmt: skip
    assert status == EXIT_NO_PROGRESS == 93, stderr
    assert "FAILED after 3 attempt(s), 2 restart(s)" in stderr
    assert (
        "do not requeue (exit 93): 2 failed attempts in a row made no progress "
        "(no timer released)" in stderr
    )
    cause = f"rank 1 on {socket.gethostname()}: exited with status 1 (2 of 2 attempts)"
    assert cause in stderr
    (event,) = [e for e in map(json.loads, events.read_text().splitlines())
                if e["name"] == "no_progress"]  # fmt: skip
    assert (event["metadata"]["attempts"], event["metadata"]["causes"]) == (2, cause)


@pytest.mark.parametrize("report", ["0", "1"], ids=["releases", "reported"])
def test_a_run_that_gets_further_each_attempt_is_never_stopped(tmp_path: Path, report: str) -> None:
    # Checkpoints every 3 steps; attempt n fails at step 5 + 2n, recomputing the steps
    # since its checkpoint but getting past the last attempt's: 5 failures, K = 1.
    status, stderr = train(
        tmp_path,
        "--max-restarts", "10", "--max-no-progress-restarts", "1",
        FAIL_AT="5 + 2 * n if n < 5 else 0", CKPT_EVERY="3", FINISH_AT="20", REPORT=report,
    )  # fmt: skip
    assert status == 0, stderr
    assert (tmp_path / "checkpoint").read_text() == "18"


def test_recomputed_steps_are_no_progress_once_reported_and_releases_cannot_tell(
    tmp_path: Path,
) -> None:
    # Every attempt resumes from the checkpoint at 3, does step 4 again, and fails at 5.
    knobs = {"FAIL_AT": "5", "CKPT_EVERY": "3", "FINISH_AT": "20"}
    flags = ("--max-restarts", "4", "--max-no-progress-restarts", "1")
    status, stderr = train(tmp_path, *flags, **knobs, REPORT="1")
    assert status == EXIT_NO_PROGRESS, stderr
    assert "FAILED after 2 attempt(s), 1 restart(s)" in stderr
    assert "(no step past 4 reported (wd.progress))" in stderr
    # The documented limit: with releases alone each attempt completed a step, so it
    # counts as progress, and the run ends at max_restarts, a requeue allowed.
    (tmp_path / "checkpoint").unlink()
    status, stderr = train(tmp_path, *flags, **knobs)
    assert status == 1, stderr
    assert "FAILED after 5 attempt(s), 4 restart(s)" in stderr


BAD_PROGRAMS = {
    "import": ("import no_such_module\n", "exited with status 1"),
    "recorded": (
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    import no_such_module\n"
        "main()\n",
        "ModuleNotFoundError: No module named 'no_such_module'",
    ),
}


@pytest.mark.parametrize("program", BAD_PROGRAMS, ids=["no-error-file", "error-file"])
def test_a_program_that_fails_alike_before_any_step_in_every_attempt_is_not_requeued(
    tmp_path: Path, program: str
) -> None:
    code, error = BAD_PROGRAMS[program]
    worker = tmp_path / "bad.py"
    worker.write_text(code)
    events = tmp_path / "events.jsonl"
    out = run("--max-restarts", "2", "--event-log", str(events), str(worker), timeout=120)
    assert out.returncode == EXIT_NO_PROGRESS, out.stderr
    assert "FAILED after 3 attempt(s), 2 restart(s)" in out.stderr
    assert (
        f"do not requeue (exit 93): bad program: rank 0 on {socket.gethostname()} failed "
        f"the same way in all 3 attempts: {error}" in out.stderr
    )
    (event,) = [e for e in map(json.loads, events.read_text().splitlines())
                if e["name"] == "bad_program"]  # fmt: skip
    assert event["metadata"]["attempts"] == 3
    assert event["metadata"]["ranks"] == "0"
    assert event["metadata"]["error"] == (None if program == "import" else error)


@pytest.mark.parametrize(
    "code",
    [
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "import os\nraise SystemExit(1 + int(os.environ['TORCHELASTIC_RESTART_COUNT']))\n",
    ],
    ids=["killed-by-a-signal", "fails-differently"],
)
def test_a_program_that_fails_otherwise_before_any_step_may_be_requeued(
    tmp_path: Path, code: str
) -> None:
    # No step shown: the no-progress rule never judges, and this is no bad program.
    worker = tmp_path / "crash.py"
    worker.write_text(code)
    out = run("--max-restarts", "2", "--max-no-progress-restarts", "1", str(worker))
    assert out.returncode == 1, out.stderr
    assert "after 3 attempt(s), 2 restart(s)" in out.stderr
    assert "do not requeue" not in out.stderr


def test_the_launch_api_raises_no_progress_error_a_child_failed_error(tmp_path: Path) -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="t", max_restarts=9)
    launch = elastic_launch(config, sys.executable, max_no_progress_restarts=2)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FAIL_AT", "2 if n == 0 else 1")
        env.setenv("FINISH_AT", "100")
        with pytest.raises(ChildFailedError) as caught:  # torch's, as torch users catch it
            launch("-u", TRAINER, str(tmp_path))
    assert isinstance(caught.value, launcher.NoProgressError)
    assert caught.value.exit_code == 93
    assert "2 failed attempts in a row made no progress (no timer released)" in str(caught.value)
    assert f"rank 0 on {socket.gethostname()}: exited with status 1 (2 of 2 attempts)" in (
        caught.value.reason
    )
    assert set(caught.value.failures) == {0}


def test_the_launch_api_raises_no_progress_error_for_a_bad_program(tmp_path: Path) -> None:
    worker = tmp_path / "bad.py"
    worker.write_text("raise SystemExit(3)\n")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="t", max_restarts=1)
    with pytest.raises(launcher.NoProgressError) as caught:
        elastic_launch(config, sys.executable)(str(worker))
    assert caught.value.exit_code == 93
    assert caught.value.reason == (
        f"do not requeue (exit 93): bad program: rank 0 on {socket.gethostname()} failed "
        "the same way in all 2 attempts: exited with status 3"
    )
