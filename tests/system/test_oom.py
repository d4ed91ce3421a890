"""Why a rank died (issue 30, item 3): the OOM killer, named, and each rank's peak memory.

A worker allocates 200 MB under a 50 MB cap (``--worker-memory-max``): the
kernel's OOM killer ends it, and its memory cgroup counts the kill
(v2 ``memory.events``, or v1 ``memory.oom_control`` on a hybrid host). The
tests run where a memory cgroup can be written, and otherwise skip saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.request import urlopen

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from watchdogd.launcher import LaunchConfig, child_failed, run_launch
from watchdogd.linux import cgroups, enter_cell, memory_cgroups
from watchdogd.linux.procs import read_stat
from watchdogd_client.groups import GroupSpec

from ..conftest import running_daemon, wait_until
from ..conftest import watchdogd_run as run
from . import launch_workers as workers


def _no_memory_cgroup() -> str | None:
    """Why no memory cgroup can be written here (None: one can)."""
    try:
        v2 = cgroups.open_job_cgroup()
    except OSError:
        v2 = None
    try:
        memory_cgroups.open_memory_job(v2.path if v2 is not None else None).remove()
    except OSError as e:
        return f"no memory cgroup can be written here: {e.strerror or e}"
    finally:
        if v2 is not None:
            v2.close()
    return None


_WHY_NOT = _no_memory_cgroup()
needs_memory = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

# Attempt 0: rank 1 allocates past the cap. Attempt 1: rank 0 asks watchdogctl about the
# group, then rank 1 allocates past the cap again, and the group fails.
WORKER = """
import os, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank, attempt = os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if rank == "0":
    if attempt == "1":
        groups = subprocess.run(
            ["watchdogctl", "--socket", os.environ["WATCHDOGD_SOCKET"], "groups"],
            capture_output=True, text=True,
        )
        (out / "groups.txt").write_text(groups.stdout + groups.stderr)
    time.sleep(60)
while attempt == "1" and not (out / "groups.txt").exists():
    time.sleep(0.01)
block = bytearray(200 << 20)
"""


@needs_memory
def test_a_worker_past_its_memory_cap_is_reported_killed_by_the_oom_killer(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    events = tmp_path / "events.jsonl"
    out = run(
        "--worker-memory-max", "50M", "--nproc-per-node", "2", "--max-restarts", "1",
        "--shutdown-timeout", "1", "--event-log", str(events), str(script), str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    failed = [
        event["metadata"]
        for event in map(json.loads, events.read_text().splitlines())
        if event["name"] == "worker_failed"
    ]
    assert [(e["local_rank"], e["reason"], e["oom_kills"]) for e in failed] == [
        (1, "killed by the OOM killer", 1)
    ] * 2
    # The peak is the cap's: the worker touched pages until the kernel stopped it.
    assert all(49 << 20 <= e["memory_peak_bytes"] <= 51 << 20 for e in failed)
    groups = (tmp_path / "groups.txt").read_text()
    assert "rank 1: killed by the OOM killer" in groups, groups
    assert "RANK:PID PEAK" in groups and "MiB" in groups, groups
    assert "): killed by the OOM killer" in out.stderr  # the error summary's rank line


@needs_memory
def test_a_callable_past_its_memory_cap_fails_with_the_oom_killer_named() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=0, run_id="t")
    result = run_launch(config, workers.allocates, [200], worker_memory_max="50M")
    assert [f.reason for f in result.failures] == ["killed by the OOM killer"]
    message = str(child_failed(result.name, result.failures))
    assert "Signal 9 (SIGKILL) received by PID" in message
    assert "killed by the OOM killer" in message, message


@needs_memory
def test_a_worker_sigkilled_otherwise_is_not_reported_as_oom_killed() -> None:
    out = run("--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)")
    assert out.returncode == 1, out.stderr
    assert "): killed by SIGKILL" in out.stderr
    assert "OOM" not in out.stderr


def _keeper_of(agent: int) -> int:
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if any(arg.endswith(b"keeper.py") for arg in argv) and str(agent).encode() in argv:
                return int(entry.name)
    raise AssertionError(f"no keeper for {agent}")


@needs_memory
@pytest.mark.parametrize("keeper_killed", [False, True], ids=["by-its-keeper", "at-the-next-run"])
def test_a_dead_agents_memory_cgroups_are_removed(keeper_killed: bool) -> None:
    mine = memory_cgroups.v1_memory_dir(
        Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text()
    )
    if mine is None or not os.access(mine, os.W_OK):
        pytest.skip("memory is accounted in the v2 cells here: no v1 memory cgroup to leave")
    agent = subprocess.Popen(["watchdogd", "run", "--", "sleep", "300"], stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: list(mine.glob(f"watchdogd-{agent.pid}-*/default_*")) != [], timeout=30)
        [job] = mine.glob(f"watchdogd-{agent.pid}-*")
        if keeper_killed:
            os.kill(_keeper_of(agent.pid), signal.SIGKILL)
    finally:
        agent.kill()
        agent.wait()
    if not keeper_killed:  # it emptied the v2 job: the same processes, so this one too
        wait_until(lambda: not job.exists(), timeout=15)
        return
    time.sleep(0.5)
    assert job.exists()  # nobody left to remove it
    out = run("--", "true")
    assert out.returncode == 0, out.stderr
    assert not job.exists()


@needs_memory
@pytest.mark.anyio
async def test_each_ranks_peak_and_the_oom_kills_are_exported(short_dir: Path) -> None:
    # Attempt 0 allocates past the cap; attempt 1 runs on, its peak growing from zero.
    code = "import os, time\nif os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
    code += "    bytearray(200 << 20)\ntime.sleep(60)\n"
    spec = GroupSpec(
        name="g",
        entrypoint=[sys.executable, "-c", code],
        max_restarts=1,
        worker_memory_max=50 << 20,
    )
    async with running_daemon(short_dir, metrics_listen="127.0.0.1:0", stack_dumps="off") as d:
        assert d.http_address is not None
        url = "http://{}:{}/metrics".format(*d.http_address)
        d.supervisor.submit(spec)

        async def scrape() -> dict[str, float]:
            text = await anyio.to_thread.run_sync(lambda: urlopen(url).read().decode())
            return {
                f"{sample.name}{sorted(sample.labels.items())}": sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }

        oom = "watchdogd_worker_oom_kills_total[('group', 'g')]"
        peak = "watchdogd_worker_memory_peak_bytes[('group', 'g'), ('rank', '0')]"
        with anyio.fail_after(30):
            while (samples := await scrape()).get(oom) != 1 or not samples.get(peak):
                await anyio.sleep(0.05)
        assert 0 < samples[peak] < 50 << 20  # attempt 1's, not attempt 0's


@pytest.mark.parametrize("native", [True, False], ids=["setpriv", "python-shim"])
def test_the_shim_enters_every_cgroup_of_the_cell_before_the_program(
    tmp_path: Path, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain files stand in for the v2 cell's and the v1 memory cgroup's cgroup.procs.
    if native and enter_cell._SETPRIV is None:
        pytest.skip("no setpriv (util-linux) on this machine: the Python shim serves")
    if not native:
        monkeypatch.setattr(enter_cell, "_SETPRIV", None)
    procs = (str(tmp_path / "v2.procs"), str(tmp_path / "memory.procs"))
    probe = "import sys; print(' '.join(open(p).read().strip() for p in sys.argv[1:3]))"
    out = subprocess.run(
        enter_cell.shim_command(procs, [sys.executable, "-c", probe, *procs, "--", "x"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (out.returncode, out.stdout.strip()) == (0, "0 0"), out.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare: the memory hierarchy is made read-only in a mount namespace",
)
def test_a_cap_where_no_memory_cgroup_can_be_written_fails_the_group_saying_why() -> None:
    remount = "mount -o remount,ro,bind /sys/fs/cgroup/memory 2>/dev/null; "
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", remount + 'exec watchdogd run "$@"', "sh",
         "--worker-memory-max", "50M", "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "worker_memory_max cannot be set: no memory cgroup can be written" in out.stderr


def test_a_dead_owners_v1_memory_job_is_swept_and_what_it_held_killed() -> None:
    # The session fallback's orphans may be left in a v1 memory job: the next start
    # kills them (matched by start time, through a pidfd) and removes the job.
    try:
        base = memory_cgroups._own_v1_dir()
    except OSError as e:
        pytest.skip(f"no v1 memory hierarchy can be written here: {e}")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as owner:
        start = read_stat(owner.pid).start_time
        owner.kill()
    job = base / f"watchdogd-{owner.pid}-{start}.1"
    cell = job / "rank0.1"
    cell.mkdir(parents=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (cell / "cgroup.procs").write_text(str(orphan.pid))
        swept = memory_cgroups.sweep_stale()
        assert orphan.wait(10) == -signal.SIGKILL
        assert [(s.path, s.owner, s.pids) for s in swept if s.path == str(job)] == [
            (str(job), owner.pid, [orphan.pid])
        ]
    finally:
        orphan.kill()
        orphan.wait()
        memory_cgroups.MemoryJob(job, memory_cgroups.V1).remove()
