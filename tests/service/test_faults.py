"""Faults on demand: each injected kind is handled as its real fault, and only when allowed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from prometheus_client import generate_latest

import watchdogd_client as wd
from watchdogd.core.faults import parse_fault
from watchdogd_client.groups import Fault, GroupSpec, GroupState

from ..conftest import REPO, running_daemon, wait_for
from ..conftest import watchdogd_run as run

# 40 steps of 50 ms, each in a 1 s timer; every attempt prints when it is done.
STEPS = textwrap.dedent(
    """
    import os, sys, time
    import watchdogd_client as wd
    for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
        with wd.expires(after=1.0, scope="step"):
            time.sleep(float(os.environ.get("STEP_S", "0.05")))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"rank {os.environ['RANK']} attempt {attempt} done", flush=True)
    """
)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("hang", "killed by SIGKILL (watchdogd: timer 'step' expired) (injected fault: hang)"),
        (
            "sigstop",
            "killed by SIGKILL (watchdogd: timer 'step' expired) (injected fault: sigstop)",
        ),
        ("kill", "killed by SIGKILL (injected fault: kill)"),
        ("exit:3", "exited with status 3 (injected fault: exit)"),
    ],
)
def test_each_injected_fault_is_handled_as_the_real_one_once(
    tmp_path: Path, fault: str, reason: str
) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(STEPS)
    # After the worker armed its first timer (a stopped one with none would never be found).
    inject = f"{fault}:rank=1:after=1"
    out = run("--nproc-per-node", "2", "--max-restarts", "1", "--inject", inject, str(worker))
    assert out.returncode == 0, out.stderr
    assert "fault_injected" in out.stderr and "injected=True" in out.stderr
    assert reason in out.stderr, out.stderr
    # Once: the restarted attempt runs to its end.
    # The ranks write to one console as they like (as under torchrun): no line order.
    assert "rank 0 attempt 1 done" in out.stdout and "rank 1 attempt 1 done" in out.stdout
    assert "rank 1 attempt 0 done" not in out.stdout
    dumped = "stacks of hung workers in" in out.stderr
    assert dumped == (fault == "hang")  # a stopped process writes no stacks; a killed one, none


def test_a_bad_fault_names_what_is_wrong(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(STEPS)
    for inject, named in [
        ("hang:rank=2", "faults[0].rank: 2 is not a rank of this job (ranks 0..1)"),
        ("freeze:rank=0", "Invalid enum value 'freeze'"),
        ("slow:0.5:rank=0", "factor"),
        ("hang:after=1", "which rank?"),
    ]:
        bad = run("--nproc-per-node", "2", "--inject", inject, str(worker))
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr
    with pytest.raises(ValueError, match="'3' is not KEY=VALUE"):
        parse_fault("kill:3:rank=0")


async def ctl(socket_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = ["watchdogctl", "--socket", str(socket_path), *args]
    return await anyio.to_thread.run_sync(
        lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    )


SLOW_SETTINGS = {"fault_injection": True, "straggler_window": 6, "stack_dumps": "off"}


@pytest.mark.anyio
async def test_an_injected_slowdown_is_a_straggler_not_a_hang(short_dir: Path) -> None:
    spec = GroupSpec(
        name="train",
        entrypoint=[sys.executable, "-c", STEPS, "60"],
        nproc=4,
        env={"STEP_S": "0.04"},
        faults=[Fault(kind="slow", rank=2, factor=1.6, after=0.2)],
    )
    async with running_daemon(short_dir, groups=[spec], **SLOW_SETTINGS) as daemon:
        runner = daemon.supervisor.get("train")
        await wait_for(lambda: runner.state is GroupState.SUCCEEDED, 30)
        events = daemon.events.since()
    (injected,) = [e for e in events if e.name == "fault_injected"]
    assert injected.metadata["kind"] == "slow" and injected.metadata["rank"] == 2
    flags = [e for e in events if e.name == "straggler"]
    assert [e.metadata["rank"] for e in flags] == [2]
    assert flags[0].metadata["injected"] is True  # an alert rule can tell the drill
    scrape = generate_latest(daemon.metrics.registry).decode()
    assert 'watchdogd_straggler_flags_total{injected="true"} 1.0' in scrape
    assert 'watchdogd_straggler_flags_total{injected="false"} 0.0' in scrape
    assert not [e for e in events if e.name == "timer_expired"]  # 1.6 x 40 ms < the 1 s timer


@pytest.mark.anyio
async def test_inject_over_the_socket_only_where_enabled_and_for_operators(
    short_dir: Path,
) -> None:
    spec = GroupSpec(name="train", entrypoint=[sys.executable, "-c", STEPS, "400"], nproc=2)
    async with running_daemon(short_dir, groups=[spec]) as daemon:
        await wait_for(lambda: len(daemon.supervisor.get("train").workers) == 2)
        refused = await ctl(daemon.socket_path, "inject", "train", "kill:rank=0")
        bad = await ctl(daemon.socket_path, "inject", "train", "kill")
        client = wd.SocketTimerClient(daemon.socket_path)
        try:
            with pytest.raises(wd.RequestError, match="disabled: set fault_injection = true"):
                await anyio.to_thread.run_sync(
                    client.submit_group,
                    GroupSpec(
                        name="drill", entrypoint=["true"], faults=[Fault(kind="kill", rank=0)]
                    ),
                )
        finally:
            client.close()
        daemon.supervisor.stop("train")
    assert refused.returncode == 1 and "fault injection is disabled" in refused.stderr
    assert bad.returncode == 2 and "which rank?" in bad.stderr

    async with running_daemon(short_dir, groups=[spec], fault_injection=True) as daemon:
        runner = daemon.supervisor.get("train")
        await wait_for(lambda: len(runner.workers) == 2)
        done = await ctl(daemon.socket_path, "inject", "train", "kill:rank=1")
        elsewhere = await ctl(daemon.socket_path, "inject", "train", "kill:rank=7")
        await wait_for(lambda: runner.state is GroupState.FAILED, 30)
    assert done.returncode == 0 and "kill injected into rank 1 of train" in done.stdout
    assert elsewhere.returncode == 1 and "rank 7 does not run on this node" in elsewhere.stderr
    assert runner.failures.last is not None
    assert runner.failures.last.reason == "killed by SIGKILL (injected fault: kill)"


@pytest.mark.anyio
async def test_a_stopped_rank_is_killed_at_its_deadline_without_waiting_for_stacks(
    short_dir: Path,
) -> None:
    # A stopped process writes no faulthandler dump: the kill must not wait the
    # stack_dump_timeout (2 s) for one, and its event says why there is none. The
    # workers start slowly (as under load): the stop waits for the first timer
    # client, since a worker stopped before it armed a timer would hang unseen.
    spec = GroupSpec(
        name="train",
        entrypoint=[sys.executable, "-c", "import time; time.sleep(1)\n" + STEPS, "400"],
        nproc=2,
        faults=[Fault(kind="sigstop", rank=1, after=0.2)],
    )
    async with running_daemon(short_dir, groups=[spec], fault_injection=True) as daemon:
        runner = daemon.supervisor.get("train")
        await wait_for(lambda: runner.state is GroupState.FAILED, 30)
        events = daemon.events.since()
        scrape = generate_latest(daemon.metrics.registry).decode()
    (expired,) = [e for e in events if e.name == "timer_expired"]
    assert expired.metadata["action"] == "signalled"
    # A drill's expiry, told from a real one by events and metrics alike.
    assert expired.metadata["injected"] is True
    assert 'watchdogd_expiries_total{injected="true"} 1.0' in scrape
    assert 'watchdogd_expiries_total{injected="false"} 0.0' in scrape
    assert float(expired.metadata["late_ms"] or 0) < 1000, expired.metadata
    assert expired.metadata["stopped"] is True
    assert expired.metadata["dump"] is None


# Rank 0 of the first attempt asks its own run's daemon for a drill, as an operator would.
INJECTS = textwrap.dedent(
    """
    import os, subprocess
    if os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        asked = ["watchdogctl", "inject", "default", "kill:rank=1:after=0.5"]
        out = subprocess.run(asked, capture_output=True, text=True)
        print(f"inject: {out.returncode} {out.stdout.strip()} {out.stderr.strip()}", flush=True)
    """
)


def test_watchdogctl_injects_into_a_run_started_with_fault_injection(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(INJECTS + STEPS)
    refused = run("--nproc-per-node", "2", str(worker))
    assert refused.returncode == 0, refused.stderr
    # The flag of the command in use, not a config key `watchdogd run` cannot set.
    assert "inject: 1" in refused.stdout and "--fault-injection" in refused.stdout
    assert "fault_injection = true" not in refused.stdout
    drilled = run("--nproc-per-node", "2", "--max-restarts", "1", "--fault-injection", str(worker))
    assert drilled.returncode == 0, drilled.stderr
    assert "inject: 0 kill injected into rank 1 of default" in drilled.stdout
    assert "killed by SIGKILL (injected fault: kill)" in drilled.stderr
