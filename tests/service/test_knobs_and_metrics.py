"""torch agent's environment knobs, the metrics endpoint and the health check."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import watchdogd_client as wd
from watchdogd.core.stragglers import Stragglers
from watchdogd.service.metrics import LoopMonitor, Metrics
from watchdogd.service.stats import Stats
from watchdogd_client.groups import GroupInfo, GroupState, RendezvousInfo, SpareInfo

from ..conftest import python, run_log_dir, running_daemon, wait_for, wait_until

pytestmark = pytest.mark.anyio

ENV_DUMP = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump(dict(os.environ), f)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["watchdogd", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def worker_env(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    script = tmp_path / "dump_env.py"
    script.write_text(ENV_DUMP)
    out = run(str(script), str(tmp_path / "env.json"), env=env)
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads((tmp_path / "env.json").read_text())
    return result


def test_enable_file_timer_zero_keeps_the_fifo_from_workers(tmp_path: Path) -> None:
    assert "TORCHELASTIC_TIMER_FILE" in worker_env(tmp_path, {})
    env = worker_env(tmp_path, {"TORCHELASTIC_ENABLE_FILE_TIMER": "0"})
    assert "TORCHELASTIC_TIMER_FILE" not in env
    assert "WATCHDOGD_SOCKET" in env


def test_timer_file_knob_is_the_fifo_served_and_handed_down(short_dir: Path) -> None:
    fifo = short_dir / "torch-timer.fifo"
    worker = short_dir / "worker.py"
    worker.write_text(
        """
import os, time
from torch.distributed.elastic import timer
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
print(os.environ["TORCHELASTIC_TIMER_FILE"], flush=True)
with timer.expires(after=0.5):
    time.sleep(600)
"""
    )
    pytest.importorskip("torch.distributed.elastic.timer")
    out = run(str(worker), env={"TORCHELASTIC_TIMER_FILE": str(fifo)})
    assert out.returncode == 1
    assert out.stdout.strip() == str(fifo)
    assert "watchdogd: timer" in out.stderr and "expired" in out.stderr


def test_health_check_port_answers_with_last_progress(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        ["watchdogd", "run", "--", sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "TORCHELASTIC_HEALTH_CHECK_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with proc:
        try:
            wait_until(lambda: _answers(port))  # 200 once the run's loop is going
            status, body = get(f"http://127.0.0.1:{port}/healthz")
            health = json.loads(body)
            assert health["status"] in ("ok", "stalled") and status in (200, 503)
            assert abs(health["last_progress_time"] - time.time()) < 5
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 1  # torchrun's status after a signal it handles
        finally:
            proc.kill()


def _answers(port: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    except OSError:
        return False


def test_duplicate_filters_copy_matching_lines_per_rank(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import sys\nfor i in range(100):\n"
        "    print(f'step {i}' + (' NCCL WARN timeout' if i % 10 == 0 else ''))\n"
        "print('CUDA error: boom', file=sys.stderr)\n"
    )
    logs = tmp_path / "logs"
    out = run(
        "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3",
        "--duplicate-stdout-filters", "NCCL WARN,nothing-matches",
        "--duplicate-stderr-filters", "CUDA error",
        str(worker), env={},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        rank_dir = run_log_dir(logs) / "default" / "attempt_0" / str(rank)
        filtered = (rank_dir / "filtered_stdout.log").read_text().splitlines()
        assert filtered == [f"step {i} NCCL WARN timeout" for i in range(0, 100, 10)]
        assert len((rank_dir / "stdout.log").read_text().splitlines()) == 100
        assert (rank_dir / "filtered_stderr.log").read_text() == "CUDA error: boom\n"
    assert out.stdout == ""  # redirected: files only


async def test_metrics_parse_and_move(short_dir: Path) -> None:
    async with running_daemon(short_dir, metrics_listen="127.0.0.1:0", stack_dumps="off") as d:
        assert d.http_address is not None
        base = f"http://127.0.0.1:{d.http_address[1]}"

        def scrape() -> dict[str, float]:
            _, text = get(f"{base}/metrics")
            values = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    values[f"{sample.name}{{{labels}}}"] = sample.value
            return values

        before = await anyio.to_thread.run_sync(scrape)
        assert before["watchdogd_active_timers{}"] == 0
        hung = python(
            f"""
            import time, watchdogd_client as wd
            with wd.expires(after=0.2, client=wd.SocketTimerClient({str(d.socket_path)!r})):
                time.sleep(600)
            """
        )
        assert await anyio.to_thread.run_sync(hung.wait, 30) == -signal.SIGKILL
        client = wd.SocketTimerClient(d.socket_path)
        try:

            def refused_then_sync() -> None:
                client.acquire_for(1, "init", time.time() + 5, 9)
                client.sync()

            with pytest.raises(wd.RequestError):
                await anyio.to_thread.run_sync(refused_then_sync)
        finally:
            client.close()
        after = await anyio.to_thread.run_sync(scrape)
        assert after["watchdogd_requests_total{op=acquire,transport=socket}"] >= 2
        assert after["watchdogd_expiries_total{injected=false}"] == 1
        assert after["watchdogd_kills_total{signal=9}"] == 1
        assert after["watchdogd_refusals_total{reason=refused}"] == 1
        assert after["watchdogd_expiry_to_signal_seconds_count{}"] == 1
        assert after["watchdogd_groups{state=HEALTHY}"] == 0


async def test_healthz_goes_503_while_the_loop_is_blocked(short_dir: Path) -> None:
    async with running_daemon(
        short_dir, max_stall=None, metrics_listen="127.0.0.1:0", health_max_lag=0.3
    ) as d:
        assert d.http_address is not None
        url = f"http://127.0.0.1:{d.http_address[1]}/healthz"
        await wait_for(lambda: d.loop_monitor.stalled_for() == 0)
        assert (await anyio.to_thread.run_sync(get, url))[0] == 200
        answers: list[tuple[int, Any]] = []

        def ask_later() -> None:
            time.sleep(1.4)
            status, body = get(url)
            answers.append((status, json.loads(body)))

        asker = threading.Thread(target=ask_later)
        asker.start()
        time.sleep(2.0)  # noqa: ASYNC251 - blocking the daemon's loop is the point
        await anyio.to_thread.run_sync(asker.join)
        ((status, health),) = answers
        assert status == 503
        assert health["status"] == "stalled" and health["lag_s"] >= 0.3
        await wait_for(lambda: d.loop_monitor.stalled_for() == 0)
        assert (await anyio.to_thread.run_sync(get, url))[0] == 200


def test_standby_spares_ready_and_attempts_without_progress_show_in_the_metrics() -> None:
    def group(name: str, standby: bool, failed_without_progress: int) -> GroupInfo:
        rdzv = RendezvousInfo(backend="etcd", run_id="r", round=0, group_rank=-1,
                              group_world_size=0, standby=standby)  # fmt: skip
        return GroupInfo(name=name, state=GroupState.HEALTHY, attempt=0, restarts_left=0,
                         workers=[], rendezvous=rdzv, started_at=0.0,
                         failed_without_progress=failed_without_progress)  # fmt: skip

    infos = [group("waits", True, 0), group("runs", False, 2)]
    infos[1].spares = [SpareInfo(local_rank=0, pid=1, ready=True, ready_after_s=2.5),
                       SpareInfo(local_rank=1, pid=2, ready=False)]  # fmt: skip
    no_stragglers = SimpleNamespace(
        board=Stragglers(), drilled=set(), drill_flags=0, replacements=0
    )
    metrics = Metrics(
        Stats(),
        [],
        [],
        no_stragglers,
        lambda: [],
        lambda: infos,
        LoopMonitor(),  # type: ignore[arg-type]
    )
    families = {
        f.name: {s.labels.get("group"): s.value for s in f.samples}
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    assert families["watchdogd_rendezvous_standby"] == {"waits": 1.0, "runs": 0.0}
    assert families["watchdogd_group_failed_without_progress"] == {"waits": 0.0, "runs": 2.0}
    assert families["watchdogd_spares_ready"] == {"runs": 1.0}  # a group with spares only
