"""Nothing of a run is left on disk: its runtime directory goes on every way out, and one
whose run was killed is swept by the next run, never a live run's.

Each test gives ``watchdogd run`` a temporary directory of its own (``TMPDIR``),
so what is left there is what the run left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from watchdogd.core.config import Config
from watchdogd.foreground import run_group
from watchdogd.linux.run_dirs import make_run_dir
from watchdogd_client.groups import GroupSpec

from ..conftest import REPO, wait_until
from ..conftest import watchdogd_run as run

MAKE_RUN_DIR = (
    "from watchdogd.linux.run_dirs import make_run_dir; print(make_run_dir(), flush=True)"
)


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {"TMPDIR": str(tmp)}


def test_a_run_leaves_nothing_whether_it_succeeds_or_fails(
    tmpdir_env: tuple[Path, dict[str, str]],
) -> None:
    tmp, env = tmpdir_env
    assert run("--no-python", "true", env=env).returncode == 0
    assert list(tmp.iterdir()) == []
    failed = run("--no-python", "--max-restarts", "1", "false", env=env)
    assert failed.returncode == 93, failed.stderr  # `false` twice alike: a bad program
    assert list(tmp.iterdir()) == []


def test_a_run_stopped_by_sigterm_leaves_nothing(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    tmp, env = tmpdir_env
    ready = tmp_path / "ready"
    worker = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    proc = subprocess.Popen(
        ["watchdogd", "run", "--no-python", sys.executable, "-c", worker],
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(ready.exists, timeout=30)
        assert any(p.name.startswith("watchdogd-run-") for p in tmp.iterdir())  # while it runs
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert "SIGTERM received" in stderr
    assert list(tmp.iterdir()) == []


def test_a_run_that_raises_leaves_nothing(
    tmpdir_env: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, _ = tmpdir_env
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def broken_caller(send_signal: object) -> None:
        raise RuntimeError("the launch API's caller broke")

    spec = GroupSpec(name="g", entrypoint=["true"])
    with pytest.raises(RuntimeError, match="caller broke"):
        run_group(Config(), spec, on_started=broken_caller)
    assert list(tmp.iterdir()) == []


def test_a_stale_run_dir_is_swept_at_the_next_start_and_a_live_one_is_not(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    tmp, env = tmpdir_env
    child_env = {**os.environ, **env, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    maker = [sys.executable, "-c", MAKE_RUN_DIR]
    # A run killed before it could tidy: its owner is gone.
    stale = Path(subprocess.check_output(maker, env=child_env, text=True).strip())
    (stale / "watchdogd.sock").touch()
    # Another, killed after a hung worker's stacks were dumped: the dumps stay.
    stale_dumps = Path(subprocess.check_output(maker, env=child_env, text=True).strip())
    (stale_dumps / "dumps").mkdir()
    (stale_dumps / "dumps" / "1-2.txt").write_text("stacks")
    # A run going on now: its owner still runs.
    live_owner = subprocess.Popen(
        [sys.executable, "-c", MAKE_RUN_DIR + "; import time; time.sleep(60)"],
        env=child_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live_owner.stdout is not None
        live = Path(live_owner.stdout.readline().strip())
        # Kept dumps of a finished run carry no owner: never swept.
        kept = tmp / "watchdogd-run-kept"
        (kept / "dumps").mkdir(parents=True)
        events = tmp_path / "events.jsonl"
        out = run("--event-log", str(events), "--no-python", "true", env=env)
        assert out.returncode == 0, out.stderr
    finally:
        live_owner.kill()
        live_owner.communicate()
    assert not stale.exists()
    assert sorted(p.name for p in stale_dumps.rglob("*")) == ["1-2.txt", "dumps"]
    assert (live / "owner.json").exists()
    assert kept.is_dir()
    (swept,) = [e for e in map(json.loads, events.read_text().splitlines()) if "swept" in e["name"]]
    assert swept["name"] == "stale_run_dirs_swept"
    assert sorted(swept["metadata"]["paths"].split()) == sorted([str(stale), str(stale_dumps)])


def test_a_run_dir_records_its_owner_and_is_private(tmp_path: Path) -> None:
    directory = make_run_dir(tmp_path)
    record = json.loads((directory / "owner.json").read_text())
    assert record["pid"] == os.getpid()
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert record["start_time"] == int(f.read().rsplit(")", 1)[1].split()[19])
    assert directory.stat().st_mode & 0o777 == 0o700
