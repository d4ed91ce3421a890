"""The installed commands, end to end: ``watchdogd serve`` and ``watchdogctl``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import watchdogd_client as wd

from ..conftest import REPO, wait_until

TRAINER = [sys.executable, str(REPO / "examples/trainer.py")]


@contextmanager
def serve(runtime_dir: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        ["watchdogd", "serve", "--runtime-dir", str(runtime_dir), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with proc:
        try:
            banner = proc.stdout.readline()
            assert "serving" in banner, proc.stderr.read() if proc.stderr else banner
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def ctl(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["watchdogctl", "--socket", str(socket), *args], capture_output=True, text=True
    )


def test_serve_reports_endpoints_and_stops_cleanly_on_sigterm(short_dir: Path) -> None:
    with serve(short_dir, "--event-log", str(short_dir / "events.jsonl")) as proc:
        assert proc.stdout is not None
        rest = proc.stdout.readline() + proc.stdout.readline()
        assert str(short_dir / "watchdogd.sock") in rest
        assert str(short_dir / "timer.fifo") in rest
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    names = [
        json.loads(line)["name"] for line in (short_dir / "events.jsonl").read_text().splitlines()
    ]
    assert names == ["daemon_started", "daemon_stopping"]
    assert not (short_dir / "watchdogd.sock").exists()


def test_watchdogctl_timers_and_status(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir) as daemon:
        # Found by `pidof watchdogd-serve` and `pgrep -x watchdogd-serve`: not the kernel's
        # own [watchdogd] thread, which `pidof watchdogd` finds.
        assert Path(f"/proc/{daemon.pid}/comm").read_text() == "watchdogd-serve\n"
        cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[:3] == [b"watchdogd-serve", b"--runtime-dir", bytes(short_dir)]
        trainer = subprocess.Popen(
            [*TRAINER, "--hang-at", "1", "--step-timeout", "30"],
            env={**os.environ, "WATCHDOGD_SOCKET": str(sock)},
            stdout=subprocess.PIPE,
            text=True,
        )
        with trainer:
            try:
                assert trainer.stdout is not None
                for line in trainer.stdout:
                    if "hanging" in line:
                        break
                out = ctl(sock, "timers", "--json")
                assert out.returncode == 0, out.stderr
                (timer,) = json.loads(out.stdout)
                assert {"pid", "scope_id", "remaining_s", "signal", "source", "uid"} <= timer.keys()
                assert (timer["pid"], timer["scope_id"], timer["source"]) == (
                    trainer.pid,
                    "train_step",
                    "socket",
                )
                assert 0 < timer["remaining_s"] <= 30
                table = ctl(sock, "timers").stdout
                assert "train_step" in table and "SIGKILL" in table
                status = json.loads(ctl(sock, "status", "--json").stdout)
                assert status["timers"] == 1
                shown = ctl(sock, "status").stdout
                assert "timers" in shown
                assert re.search(r"^uptime +\d+\.\d s$", shown, re.M), shown  # not 19.3838…
                assert "being read" not in shown  # read at start: the first status has it
            finally:
                trainer.kill()


def test_hung_example_trainer_is_killed_through_the_fifo(short_dir: Path) -> None:
    with serve(short_dir):
        trainer = subprocess.run(
            [*TRAINER, "--hang-at", "2", "--step-timeout", "0.5"],
            env={**os.environ, "TORCHELASTIC_TIMER_FILE": str(short_dir / "timer.fifo")},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert trainer.returncode == -signal.SIGKILL
        assert "step 1 done" in trainer.stdout
        status = wd.status(str(short_dir / "watchdogd.sock"))
        assert (status.signalled, status.timers) == (1, 0)


def test_bad_config_names_the_key(short_dir: Path) -> None:
    config = short_dir / "bad.toml"
    config.write_text("[limits]\nmax_frame = -1\n")
    out = subprocess.run(
        ["watchdogd", "serve", "--config", str(config)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "limits.max_frame" in out.stderr
    config.write_text("colour = 'blue'\n")
    out = subprocess.run(
        ["watchdogd", "serve", "--config", str(config)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "colour" in out.stderr


def test_second_daemon_exits_3_naming_the_first(short_dir: Path) -> None:
    with serve(short_dir) as first:
        out = subprocess.run(
            ["watchdogd", "serve", "--runtime-dir", str(short_dir)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 3
        assert f"pid {first.pid}" in out.stderr
        assert first.poll() is None


def test_watchdogctl_without_daemon_exits_3(short_dir: Path) -> None:
    out = ctl(short_dir / "none.sock", "status")
    assert out.returncode == 3
    assert str(short_dir / "none.sock") in out.stderr


def test_help_explains_the_defaults() -> None:
    out = subprocess.run(["watchdogd", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "XDG_RUNTIME_DIR" in out.stdout and "--fifo" in out.stdout


def test_a_specs_relative_paths_are_its_directorys_not_the_daemons(short_dir: Path) -> None:
    job = short_dir / "job"
    (job / "bin").mkdir(parents=True)
    (job / "bin/where.sh").write_text("#!/bin/sh\npwd\n")
    (job / "bin/where.sh").chmod(0o755)
    spec = job / "spec.toml"
    spec.write_text(
        'name = "rel"\nentrypoint = ["bin/where.sh"]\nlog_dir = "logs"\nredirects = "1"\n'
    )
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir):  # its working directory: the tests', not job/
        out = subprocess.run(["watchdogctl", "--socket", str(sock), "submit", "spec.toml"],
                             capture_output=True, text=True, cwd=job)  # fmt: skip
        assert out.returncode == 0, out.stderr
        stdout = job / "logs/rel/attempt_0/0/stdout.log"
        wait_until(lambda: stdout.exists() and stdout.read_text() == f"{job}\n")


def test_watchdogctl_controls_groups(short_dir: Path) -> None:
    config = short_dir / "watchdogd.toml"
    config.write_text(
        f"""
[[groups]]
name = "sleepy"
entrypoint = ["{sys.executable}", "-c", "import time; time.sleep(600)"]
nproc = 2
"""
    )
    sock = short_dir / "watchdogd.sock"

    def groups() -> list[dict[str, Any]]:
        return json.loads(ctl(sock, "groups", "--json").stdout)

    with serve(short_dir, "--config", str(config)):
        wait_until(lambda: len(groups()[0]["workers"]) == 2)
        (group,) = groups()
        assert (group["name"], group["state"], group["attempt"]) == ("sleepy", "HEALTHY", 0)
        assert "sleepy" in ctl(sock, "groups").stdout

        spec = short_dir / "quick.toml"
        spec.write_text('name = "quick"\nentrypoint = ["true"]\nnproc = 2\n')
        out = ctl(sock, "submit", str(spec))
        assert out.returncode == 0 and "quick" in out.stdout
        wait_until(
            lambda: (
                {g["name"]: g["state"] for g in json.loads(ctl(sock, "groups", "--json").stdout)}
                == {"sleepy": "HEALTHY", "quick": "SUCCEEDED"}
            )
        )

        spec.write_text('name = "bad"\nentrypoint = ["true"]\nnproc = 0\n')
        out = ctl(sock, "submit", str(spec))
        assert out.returncode == 2 and "nproc" in out.stderr

        assert ctl(sock, "restart", "sleepy").returncode == 0
        wait_until(lambda: json.loads(ctl(sock, "groups", "--json").stdout)[0]["attempt"] == 1)
        assert ctl(sock, "stop", "sleepy").returncode == 0
        wait_until(
            lambda: json.loads(ctl(sock, "groups", "--json").stdout)[0]["state"] == "STOPPED"
        )
        out = ctl(sock, "stop", "nope")
        assert out.returncode == 1 and "no group named 'nope'" in out.stderr
