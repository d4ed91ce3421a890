"""Worker groups with real processes: ``watchdogd run`` end to end, and groups in the daemon."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.groups.child import ChildProcess
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import REPO, run_log_dir, running_daemon, wait_for, wait_until
from ..conftest import watchdogd_run as run

TRAINER = str(REPO / "examples/trainer.py")


def script(tmp_path: Path, code: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(code))
    return str(path)


def test_success_exits_zero_and_ranks_sharing_the_console_keep_their_lines_whole(
    tmp_path: Path,
) -> None:
    out = run("--nproc-per-node", "3", TRAINER, "--steps", "300", "--step-time", "0")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(
        f"rank {r}: step {s} done" for r in range(3) for s in range(300)
    )
    assert "SUCCEEDED" in out.stderr


def test_crash_restarts_up_to_max_restarts_then_fails(tmp_path: Path) -> None:
    out = run("--nproc_per_node=2", "--max_restarts=2", TRAINER, "--crash-at", "1")
    assert out.returncode == 1
    # Each attempt ends at its first crash; the other rank may be stopped before its own.
    assert 3 <= out.stdout.count("crashing at step 1") <= 6
    assert "FAILED after 3 attempt(s), 2 restart(s)" in out.stderr
    assert "exited with status 1" in out.stderr


def test_hung_worker_is_killed_by_its_timer_and_the_group_restarts(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import os, sys, time
        import watchdogd_client as wd
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        with wd.expires(after=0.5, scope="allreduce"):
            if attempt == 0 and os.environ["LOCAL_RANK"] == "1":
                time.sleep(600)  # hung collective
        print(f"rank {os.environ['RANK']} attempt {attempt} ok", flush=True)
        """,
    )
    started = time.monotonic()
    out = run("--nproc-per-node", "2", "--max-restarts", "1", worker)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 30
    assert "rank 1 attempt 1 ok" in out.stdout
    assert "rank 1 attempt 0 ok" not in out.stdout
    assert "killed by SIGKILL (watchdogd: timer 'allreduce' expired)" in out.stderr


def test_a_worker_idle_past_the_idle_timeout_is_hung_and_one_never_armed_is_not(
    tmp_path: Path,
) -> None:
    worker = script(
        tmp_path,
        """
        import os, time
        import watchdogd_client as wd
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if os.environ["LOCAL_RANK"] == "0":
            with wd.expires(after=30, scope="step"):
                pass
            wd.get_client().sync()
            if attempt == 0:
                time.sleep(600)  # holds no timer: stuck between steps
        else:
            time.sleep(1.5)  # never arms one: not watched
        print(f"rank {os.environ['RANK']} attempt {attempt} ok", flush=True)
        """,
    )
    started = time.monotonic()
    out = run("--nproc-per-node", "2", "--max-restarts", "1", "--idle-timeout", "0.5", worker)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 30
    assert "killed by SIGKILL (watchdogd: timer '(idle)' expired)" in out.stderr
    # The ranks write to one console as they like (as under torchrun): no line order.
    assert "rank 0 attempt 1 ok" in out.stdout and "rank 1 attempt 1 ok" in out.stdout
    assert "rank 0 attempt 0 ok" not in out.stdout
    bad = run("--idle-timeout", "0", worker)
    assert bad.returncode == 2 and "--idle-timeout" in bad.stderr  # names the flag given


def test_hung_worker_failure_is_reported_when_restarts_run_out(tmp_path: Path) -> None:
    out = run("--nproc-per-node", "1", TRAINER, "--hang-at", "1", "--step-timeout", "0.5")
    assert out.returncode == 1
    assert "rank 0 (local rank 0" in out.stderr
    assert "timer 'train_step' expired" in out.stderr


def test_env_contract_for_every_rank(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import json, os, sys
        keys = sys.argv[1].split(",")
        path = os.path.join(sys.argv[2], os.environ["RANK"] + ".json")
        with open(path, "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
        """,
    )
    keys = [
        "LOCAL_RANK", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "TORCHELASTIC_TIMER_FILE",
        "WATCHDOGD_SOCKET", "CUDA_VISIBLE_DEVICES",
    ]  # fmt: skip
    out = run(
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3", "--master-addr", "10.1.2.3",
        "--master-port", "29555", "--rdzv-id", "job7", "--role", "trainer", "--max-restarts", "4",
        "--log-dir", str(tmp_path / "logs"),
        worker, ",".join(keys), str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for local_rank in range(3):
        rank = 3 + local_rank
        env = json.loads((tmp_path / f"{rank}.json").read_text())
        assert env["LOCAL_RANK"] == str(local_rank)
        assert env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2")
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "6"
        assert (env["LOCAL_WORLD_SIZE"], env["ROLE_NAME"]) == ("3", "trainer")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "29555")
        assert env["TORCHELASTIC_RUN_ID"] == "job7"
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "4")
        assert env["TORCHELASTIC_ERROR_FILE"] == str(
            run_log_dir(tmp_path / "logs")
            / "trainer"
            / "attempt_0"
            / str(local_rank)
            / "error.json"
        )
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert env["TORCHELASTIC_TIMER_FILE"].endswith("timer.fifo")
        assert env["WATCHDOGD_SOCKET"].endswith("watchdogd.sock")
        assert env["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_virtual_local_rank_gives_each_worker_one_gpu(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import os, sys
        with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
            f.write(os.environ["LOCAL_RANK"] + " " + os.environ["CUDA_VISIBLE_DEVICES"])
        """,
    )
    fake = {"CUDA_VISIBLE_DEVICES": "4,6,7"}
    out = run("--nproc-per-node", "3", "--virtual-local-rank", worker, str(tmp_path), env=fake)
    assert out.returncode == 0, out.stderr
    assert [(tmp_path / str(r)).read_text() for r in range(3)] == ["0 4", "0 6", "0 7"]
    out = run("--nproc-per-node", "4", "--virtual-local-rank", worker, str(tmp_path), env=fake)
    assert out.returncode == 2
    assert "nproc 4 > 3 devices" in out.stderr


def test_logs_per_attempt_and_rank_with_tee_prefix_and_no_lost_lines(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import os, sys, time
        for i in range(5000):
            print(f"line {i}")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at exit")
        rank, attempt = os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        done = os.path.join(sys.argv[1], f"done-{attempt}")
        if rank == "0":
            open(done, "w").close()
        else:
            while not os.path.exists(done):  # rank 0 finished writing: now fail
                time.sleep(0.01)
        os._exit(int(attempt == "0" and rank == "1"))
        """,
    )
    logs = tmp_path / "logs"
    out = run(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
        "--tee", "1", "--redirects", "2", "--local-ranks-filter", "1", worker, str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for attempt in (0, 1):
        for rank in (0, 1):
            rank_dir = run_log_dir(logs) / "default" / f"attempt_{attempt}" / str(rank)
            stdout = (rank_dir / "stdout.log").read_text()
            assert stdout.count("\n") == 5000 and stdout.endswith("no newline at exit")
            assert (rank_dir / "stderr.log").read_text() == "to stderr\n"
    console = out.stdout.splitlines()
    assert all(line.startswith("[default1]:") for line in console)  # rank 0 filtered out
    assert len(console) == 2 * 5001
    assert "to stderr" not in out.stderr


def test_error_file_message_lands_in_the_failure_report(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import json, os, sys
        error = {"message": {"message": "RuntimeError: CUDA out of memory", "extraInfo": {}}}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump(error, f)
        sys.exit(3)
        """,
    )
    out = run("--log-dir", str(tmp_path / "logs"), worker)
    assert out.returncode == 1
    assert "exited with status 3" in out.stderr
    assert "error: RuntimeError: CUDA out of memory" in out.stderr


def test_torchrun_entrypoint_forms(tmp_path: Path) -> None:
    out = run("--no-python", "sh", "-c", "echo $RANK-$WORLD_SIZE")
    assert (out.returncode, out.stdout) == (0, "0-1\n")
    out = run("--nproc-per-node", "2", "--", "sh", "-c", "echo hi")
    assert (out.returncode, out.stdout) == (0, "hi\nhi\n")
    out = run("-m", "json.tool", "--help")
    assert out.returncode == 0 and "json.tool" in out.stdout
    out = run("--rdzv-backend", "zookeeper", TRAINER)
    assert out.returncode == 2 and "zookeeper" in out.stderr


def test_sigterm_stops_workers_gracefully_leaving_no_orphans(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        """
        import os, signal, subprocess, sys, time
        child = subprocess.Popen(["sleep", "600"])  # a data loader, say
        with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        time.sleep(600)
        """,
    )
    proc = subprocess.Popen(
        ["watchdogd", "run", "--nproc-per-node", "2", worker, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with proc:
        wait_until(lambda: all((tmp_path / str(r)).exists() for r in range(2)), timeout=30)
        time.sleep(0.2)
        pids = [int(p) for r in range(2) for p in (tmp_path / str(r)).read_text().split()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1  # torchrun's status after a signal it handles
        assert "worker_failed" not in proc.stderr.read() if proc.stderr else True
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


VFORK_WORKER = r"""
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
int main(void) {
    /* The parent of a vfork waits in D state until the child execs or exits. */
    pid_t child = vfork();
    if (child == 0) { sleep(600); _exit(0); }
    waitpid(child, 0, 0);
    return 0;
}
"""


def test_worker_stuck_in_d_state_makes_the_group_unhealthy(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the vfork worker (the detector has pure tests)")
    source = tmp_path / "dstate.c"
    source.write_text(VFORK_WORKER)
    subprocess.run([cc, "-o", str(tmp_path / "dstate"), str(source)], check=True)
    started = time.monotonic()
    proc = subprocess.run(
        ["watchdogd", "run", "--max-restarts", "3", "--no-python", str(tmp_path / "dstate")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "1"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "UNHEALTHY after 1 attempt(s), 0 restart(s)" in proc.stderr
    assert "D state" in proc.stderr
    assert time.monotonic() - started < 30


@pytest.mark.anyio
async def test_daemon_groups_from_config_and_control(short_dir: Path, tmp_path: Path) -> None:
    sleeper = GroupSpec(
        name="sleepy", entrypoint=[sys.executable, "-c", "import time; time.sleep(600)"], nproc=2
    )
    async with running_daemon(short_dir, groups=[sleeper]) as daemon:
        runner = daemon.supervisor.get("sleepy")
        await wait_for(lambda: len(runner.workers) == 2)
        client = wd.SocketTimerClient(daemon.socket_path)
        try:
            (info,) = await anyio.to_thread.run_sync(client.list_groups)
            assert (info.name, info.state, info.attempt) == ("sleepy", GroupState.HEALTHY, 0)
            assert sorted(w.local_rank for w in info.workers) == [0, 1]
            first_pids = {w.pid for w in info.workers}
            assert all(pid in daemon.supervisor.workers for pid in first_pids)

            await anyio.to_thread.run_sync(client.restart_group, "sleepy")
            # The attempt counts from the stop; its workers start once the last ones are gone.
            await wait_for(
                lambda: (
                    runner.machine.attempt == 1
                    and len(runner.workers) == 2
                    and not first_pids & {w.pid for w in runner.workers.values()}
                )
            )
            assert runner.machine.restarts_left == 0  # operator restarts are free

            quick = GroupSpec(name="quick", entrypoint=["true"], nproc=3)
            await anyio.to_thread.run_sync(client.submit_group, quick)
            await wait_for(lambda: daemon.supervisor.get("quick").state is GroupState.SUCCEEDED)

            await anyio.to_thread.run_sync(client.stop_group, "sleepy")
            await wait_for(lambda: runner.finished.is_set())
            assert runner.state is GroupState.STOPPED
            with pytest.raises(wd.RequestError, match="no group named"):
                await anyio.to_thread.run_sync(client.stop_group, "nope")
        finally:
            client.close()


@pytest.mark.anyio
async def test_groups_and_their_workers_stop_in_the_reverse_of_their_start_order(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker that takes a moment to stop: a group still stopping would overlap the next.
    lingering = "import signal, sys, time\n" + (
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.2), sys.exit(0)))\ntime.sleep(600)"
    )
    sent: list[tuple[int, int]] = []
    send_signal = ChildProcess.send_signal

    def recording(child: ChildProcess, signum: int) -> None:
        sent.append((child.pid, signum))
        send_signal(child, signum)

    monkeypatch.setattr(ChildProcess, "send_signal", recording)
    names = ["first", "second", "third"]
    async with running_daemon(short_dir) as daemon:
        runners = [
            daemon.supervisor.submit(
                GroupSpec(name=name, entrypoint=[sys.executable, "-c", lingering], nproc=3)
            )
            for name in names
        ]
        await wait_for(lambda: all(len(r.workers) == 3 for r in runners))
        local_rank = {w.pid: w.local_rank for r in runners for w in r.workers.values()}
        await daemon.supervisor.stop_all()
        assert all(r.state is GroupState.STOPPED for r in runners)
        moves = [
            (e.metadata["group"], e.metadata["state"])
            for e in daemon.events.since()
            if e.name == "group_state" and e.metadata["state"] in ("STOPPING", "STOPPED")
        ]
    assert moves == [(name, state) for name in reversed(names) for state in ("STOPPING", "STOPPED")]
    terms = [local_rank[pid] for pid, signum in sent if signum == signal.SIGTERM]
    assert terms == [2, 1, 0] * 3  # in each group, the last started first
