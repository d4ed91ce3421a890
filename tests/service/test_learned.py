"""Learned deadlines over real endpoints: resolved on arm, the FIFO's initial, kept across runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import watchdogd_client as wd
from watchdogd_client.groups import DeadlineRule, GroupSpec, GroupState

from ..conftest import REPO, python, running_daemon, wait_for
from ..conftest import watchdogd_run as run

pytestmark = pytest.mark.anyio

# Four steps of 0.2 s teach the deadline (one skipped, three learned); the fifth hangs.
LEARNS_THEN_HANGS = textwrap.dedent(
    """
    import time
    import watchdogd_client as wd
    for _ in range(4):
        with wd.expires(after=wd.LEARN(initial=30), scope="step"):
            time.sleep(0.2)
    with wd.expires(after=wd.LEARN(initial=30), scope="step"):
        time.sleep(600)
    """
)

# Each step reports the deadline it was armed with (seconds from now), then ends.
REPORTS_DEADLINES = textwrap.dedent(
    """
    import json, os, sys, time
    import watchdogd_client as wd
    client = wd.get_client()
    steps = [float(s) for s in sys.argv[1].split(",")]
    armed = []
    for seconds in steps + [0.0]:
        with wd.expires(after=wd.LEARN(initial=30), scope="step"):
            (timer,) = [t for t in client.list_timers() if t.scope_id == "step"]
            armed.append(timer.remaining_s)
            time.sleep(seconds)
    with open(os.environ["REPORT"], "w") as f:
        json.dump(armed, f)
    """
)


async def test_a_learned_deadline_is_resolved_on_arm_and_kills_a_hang_early(
    short_dir: Path,
) -> None:
    spec = GroupSpec(
        name="train",
        entrypoint=[sys.executable, "-c", LEARNS_THEN_HANGS],
        deadlines=[DeadlineRule(scope="step", samples=3, skip=1, floor=0)],
    )
    async with running_daemon(short_dir, groups=[spec], stack_dumps="off") as daemon:
        runner = daemon.supervisor.get("train")
        with anyio.fail_after(10):  # initial=30 would take 30 s
            await wait_for(lambda: runner.state is GroupState.FAILED, 10)
        client = wd.SocketTimerClient(daemon.socket_path)
        try:
            listing = await anyio.to_thread.run_sync(client.scopes)
        finally:
            client.close()
        command = ["watchdogctl", "--socket", str(daemon.socket_path), "scopes"]
        table = await anyio.to_thread.run_sync(
            lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
        )
    assert runner.failures.last is not None
    assert "timer 'step' expired" in runner.failures.last.reason
    (step,) = [s for s in listing.scopes if s.scope == "step"]
    assert step.deadline_source == "learned"
    assert step.deadline_s == pytest.approx(0.4, rel=0.25)  # margin 2 x the 0.2 s steps
    assert "LEARN DEADLINE (s)" in table.stdout and "learned" in table.stdout


def test_watchdogd_run_learns_per_attempt_and_names_a_bad_flag(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(LEARNS_THEN_HANGS)
    started = time.monotonic()
    out = run("--max-restarts", "1", "--deadline", "step:samples=3,skip=1,floor=0", str(worker))
    assert out.returncode == 1, out.stderr
    # Each attempt learns again (its first steps are its own), then kills its hang early.
    assert "FAILED after 2 attempt(s)" in out.stderr
    assert "killed by SIGKILL (watchdogd: timer 'step' expired)" in out.stderr
    assert time.monotonic() - started < 30  # the initial deadline: 30 s an attempt
    for flags, named in [
        (("--deadline", "step:margin=0"), "margin"),
        (("--deadline", "st[ep"), "scope"),
        (("--deadline", "step:samples=5,initial"), "'initial' is not KEY=VALUE"),
        (("--job-key", "../etc"), "--job-key"),  # the flag given
    ]:
        bad = run(*flags, str(worker))
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr


async def test_the_fifo_arms_the_initial_and_cannot_learn_without_one(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(
            """
            import sys, time
            import watchdogd_client as wd
            client = wd.FileTimerClient(sys.argv[1])
            try:
                with wd.expires(after=wd.LEARN, scope="bare", client=client):
                    pass
            except ValueError as e:
                print(e, flush=True)
            with wd.expires(after=wd.LEARN(initial=60), scope="step", client=client):
                print("armed", flush=True)
                time.sleep(600)
            """,
            str(daemon.fifo_path),
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            refusal = await anyio.to_thread.run_sync(child.stdout.readline)
            assert await anyio.to_thread.run_sync(child.stdout.readline) == "armed\n"
            await wait_for(lambda: daemon.timers.table.get(child.pid, "step") is not None)
            listing = daemon.queries.timer_list(0, None)
        finally:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
    assert "FileTimerClient" in refusal and "LEARN(initial=SECONDS)" in refusal
    (timer,) = listing.timers
    assert timer.source == "fifo"
    assert 55 < timer.remaining_s <= 60


async def test_what_a_job_learned_seeds_its_next_run_only_after_n_samples(
    short_dir: Path, tmp_path: Path
) -> None:
    learned_dir = tmp_path / "learned"
    rule = [DeadlineRule(scope="step", samples=3, skip=0, floor=0)]

    async def one_run(steps: str, report: Path) -> list[float]:
        spec = GroupSpec(
            name="train",
            entrypoint=[sys.executable, "-c", REPORTS_DEADLINES, steps],
            env={"REPORT": str(report)},
            job_key="llama-7b",
            deadlines=rule,
        )
        async with running_daemon(short_dir, groups=[spec], learned_dir=str(learned_dir)) as d:
            runner = d.supervisor.get("train")
            await wait_for(lambda: runner.state is GroupState.SUCCEEDED, 30)
        return list(json.loads(await anyio.Path(report).read_text()))

    first = await one_run("0.05,0.4,0.05", tmp_path / "first.json")
    assert all(29 < armed <= 30 for armed in first[:3])  # learning: the call's initial
    assert first[3] == pytest.approx(0.8, rel=0.2)  # 2 x the 0.4 s outlier
    saved = json.loads(await anyio.Path(learned_dir / "llama-7b.json").read_bytes())
    assert saved["job_key"] == "llama-7b"
    assert saved["scopes"]["step"]["max_s"] == pytest.approx(0.4, rel=0.1)
    assert os.stat(learned_dir).st_mode & 0o077 == 0

    second = await one_run("0.05,0.05,0.05", tmp_path / "second.json")
    assert all(29 < armed <= 30 for armed in second[:3])  # the seed waits for this run's samples
    assert second[3] == pytest.approx(0.8, rel=0.2)  # then the first run's outlier counts
