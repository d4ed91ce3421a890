"""torch's launch API and agent over the group runner, with real processes.

``elastic_launch`` and ``LocalElasticAgent`` run in this process (the
group's loop in a thread of its own), and the workers are started by
``multiprocessing``, as they would be in a user's script.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import errors
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from watchdogd import launcher
from watchdogd.agent import LocalElasticAgent, RunResult, WorkerSpec, WorkerState
from watchdogd.launcher import LaunchConfig, LaunchError, elastic_launch, launch_agent_async

from . import launch_workers as workers

REPO = Path(__file__).resolve().parents[2]


def config(nproc: int = 2, **fields: object) -> LaunchConfig:
    fields.setdefault("max_restarts", 0)
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="t", **fields)  # type: ignore[arg-type]


def test_a_4_rank_callable_returns_each_ranks_value() -> None:
    values = elastic_launch(config(4), workers.rank_and_args)("x", "${local_rank}", 3)
    assert values == {r: (r, r, ("x", str(r), 3)) for r in range(4)}


def test_a_rank_that_raises_is_restarted_and_the_restart_count_reaches_the_function(
    tmp_path: Path,
) -> None:
    values = elastic_launch(config(2, max_restarts=1), workers.fails_once)(str(tmp_path))
    assert values == {0: "attempt 1", 1: "attempt 1"}
    assert {p.name for p in tmp_path.iterdir()} == {"0-0", "1-0", "0-1", "1-1"}


def test_a_hung_rank_is_killed_with_its_stack_dumped_then_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = time.monotonic()
    values = elastic_launch(config(2, max_restarts=1), workers.hangs_once)()
    assert values == {0: 1, 1: 1}
    assert time.monotonic() - started < 30  # not the 60 s the rank slept
    kept = [r.getMessage() for r in caplog.records if "stacks of hung workers" in r.getMessage()]
    assert kept, caplog.text
    dumps = Path(kept[0].rpartition(" in ")[2])
    assert any("stuck_in_allreduce" in p.read_text() for p in dumps.iterdir())


def test_past_max_restarts_torchs_child_failed_error_carries_the_traceback() -> None:
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(2, max_restarts=1), workers.always_fails)()
    assert caught.value.name == "always_fails"
    assert list(caught.value.failures) == [1]  # rank 0 was stopped by the group, not failed
    failure = caught.value.failures[1]
    assert failure.local_rank == 1 and failure.exitcode == 1
    assert failure.message["message"] == "ValueError: the loss is NaN"  # torch's shape
    assert "always_fails" in failure.message["extraInfo"]["py_callstack"]  # the traceback
    assert 'raise ValueError("the loss is NaN")' in caught.value.format_msg()


def test_what_cannot_be_sent_is_refused_before_anything_starts() -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="lambda"):
        elastic_launch(config(2), lambda: 1)()
    with pytest.raises(ValueError, match=r"start_method 'fork'.*spawn"):
        elastic_launch(config(2, start_method="fork"), workers.rank_and_args)()
    with pytest.raises(ValueError, match="metrics_cfg"):
        elastic_launch(config(2, metrics_cfg={"a": "b"}), workers.rank_and_args)()
    assert time.monotonic() - started < 5


def test_a_return_value_that_cannot_be_pickled_is_that_ranks_error() -> None:
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(1), workers.unpicklable_result)()
    message = caught.value.failures[0].message["message"]
    assert "return value of local rank 0 cannot be pickled" in message


def test_a_multiprocessing_queue_reaches_the_workers_under_forkserver() -> None:
    queue = multiprocessing.get_context("forkserver").Queue()
    values = elastic_launch(config(2, start_method="forkserver"), workers.from_the_queue)(queue)
    assert values == {0: "sent", 1: "sent"}
    assert sorted(queue.get(timeout=10) for _ in range(2)) == [0, 1]


def test_the_callers_process_serves_the_jobs_store() -> None:
    # torch is imported here (this module uses it): the store is served from this
    # process, as torch's agent serves it, with no helper importing torch beside.
    values = elastic_launch(config(2), workers.all_reduce)()
    assert values == {0: (2.0, 0), 1: (2.0, 0)}


def test_a_program_entrypoint_returns_none_per_rank() -> None:
    assert elastic_launch(config(2), "true")() == {0: None, 1: None}
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(1), "sh")("-c", "exit 3")
    assert caught.value.failures[0].exitcode == 3
    with pytest.raises(ValueError, match=r"^entrypoint: \./nosuch: no such program"):
        elastic_launch(config(1), "./nosuch")()


def test_default_logs_specs_makes_a_directory_per_run_in_its_log_dir_as_torchs(
    tmp_path: Path,
) -> None:
    logs = launcher.DefaultLogsSpecs(log_dir=str(tmp_path), redirects=launcher.Std.OUT)
    for word in ("first", "second"):
        assert elastic_launch(config(1, logs_specs=logs), "echo")(word) == {0: None}
    outputs = {p.read_text() for p in tmp_path.glob("t_*/default_role/attempt_0/0/stdout.log")}
    assert outputs == {"first\n", "second\n"}


def test_a_log_level_asked_of_the_launch_holds_for_its_run_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "watchdogd")
    assert elastic_launch(config(1), "true", log_level="warning")() == {0: None}
    assert not [r for r in caplog.records if r.name == "watchdogd"], caplog.text
    assert logging.getLogger("watchdogd").level == logging.INFO  # the caller's, back
    assert elastic_launch(config(1), "true")() == {0: None}
    assert "group_state" in caplog.text


def test_called_from_inside_a_running_event_loop() -> None:
    async def main() -> tuple[dict[int, object], dict[int, object], int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        blocking = elastic_launch(config(1), workers.rank_and_args)()  # blocks, never nests
        ticks = 0  # the blocking call held the loop: whatever ticked, ticked before it
        started = time.monotonic()
        waited = await launch_agent_async(config(1), workers.rank_and_args, "a")
        elapsed = time.monotonic() - started
        ticker.cancel()
        return blocking, waited, ticks, elapsed

    blocking, waited, ticks, elapsed = asyncio.run(main())
    assert blocking == {0: (0, 0, ())} and waited == {0: (0, 0, ("a",))}
    # The loop went on while the async variant waited: at least every other 10 ms tick.
    assert ticks >= max(1, int(elapsed / 0.01) // 2), (ticks, elapsed)


def test_the_agent_runs_a_spec_and_reports_a_run_result() -> None:
    spec = WorkerSpec(
        role="trainer", local_world_size=2, entrypoint=workers.rank_and_args, args=(5,)
    )
    result = LocalElasticAgent(spec, "spawn").run()  # the documentation's (spec, start_method)
    assert result == RunResult(WorkerState.SUCCEEDED, {0: (0, 0, (5,)), 1: (1, 1, (5,))})
    failing = WorkerSpec(
        role="t", local_world_size=2, entrypoint=workers.always_fails, max_restarts=0
    )
    result = LocalElasticAgent(failing).run()
    assert result.is_failed() and list(result.failures) == [1]
    assert result.failures[1].message["message"] == "ValueError: the loss is NaN"


@pytest.mark.parametrize("flavour", ["--torch", "--watchdogd"])
def test_the_seed_timer_example_runs_with_torch_and_with_watchdogd(flavour: str) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/seed_local_timer_agent.py"), flavour],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "local rank 1, attempt 0: hangs" in out.stdout
    assert "local rank 1, attempt 1: done" in out.stdout
    assert out.stdout.rstrip().endswith("{0: 0, 1: 1}")
    assert "SUCCEEDED" in out.stdout


def test_without_torch_the_failure_has_torchs_shape(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(
        '{"message": {"message": "ValueError: nan", "extraInfo": '
        '{"py_callstack": "Traceback ...\\nValueError: nan\\n", "timestamp": "1700000000"}}}'
    )
    ours = launcher.ProcessFailure(local_rank=1, pid=42, exitcode=1, error_file=str(error_file))
    theirs = errors.ProcessFailure(local_rank=1, pid=42, exitcode=1, error_file=str(error_file))
    for field in ("message", "timestamp", "error_file_data"):
        assert getattr(ours, field) == getattr(theirs, field)
    killed = launcher.ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file="")
    assert killed.message == "Signal 9 (SIGKILL) received by PID 7"
    error = launcher.ChildFailedError("train", {3: ours, 2: killed})
    assert error.get_first_failure()[0] == 3  # the earlier timestamp
    text = error.format_msg()
    assert text.startswith("train FAILED")
    assert "rank      : 3 (local_rank: 1)" in text and "ValueError: nan" in text
    assert "Signal 9 (SIGKILL)" in text


def test_a_handled_signal_reaches_the_workers_and_ends_the_call() -> None:
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(LaunchError, match="SIGTERM received, passed to the workers"):
        elastic_launch(config(2, signals_to_handle="SIGTERM"), workers.sleeps)()
    assert time.monotonic() - started < 30
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
