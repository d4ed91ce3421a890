"""Nothing outlives its attempt (issue 30): the processes a worker starts end with it.

Each worker starts two children that sleep: one in a session of its own
(as a daemonizing tool would), one in the worker's own session (as a data
loader's workers are). The rows of the README's comparison: what is left
after a job that ended 0, and after its agent was SIGKILLed. Each runs in
both modes: a cgroup v2 per worker (``auto``, skipped where cgroup v2 cannot
be written) and the weaker ``session`` mode (process group, ``/proc`` and
the daemon as child subreaper).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import anyio
import pytest

from watchdogd.launcher import LaunchConfig, elastic_launch
from watchdogd.linux import cgroups, enter_cell

from ..conftest import wait_until
from ..conftest import watchdogd_run as run
from . import launch_workers as workers

CHILDREN = """
import os, subprocess, sys, time
from pathlib import Path
out, marker = sys.argv[1], sys.argv[2]
for own_session in (True, False):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3000)", marker],
        start_new_session=own_session,
    )
    Path(out, f"child-{child.pid}").touch()
Path(out, f"worker-{os.getpid()}").touch()
if sys.argv[3] == "hang":
    time.sleep(300)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    while len(list(Path(out).glob("worker-*"))) < 2:  # its peer's children started too
        time.sleep(0.01)
    sys.exit(3)
"""


def _cgroup_writable() -> bool:
    try:
        job = cgroups.open_job_cgroup()
    except OSError:
        return False
    job.close()
    return True


MODES = [
    pytest.param(
        "auto",
        marks=pytest.mark.skipif(not _cgroup_writable(), reason="cgroup v2 cannot be written"),
    ),
    "session",
]


def alive(marker: str) -> list[int]:
    """The processes whose command line holds ``marker`` (zombies are gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def marker() -> str:
    token = uuid.uuid4().hex[:12]
    yield token
    for pid in alive(token):  # what a failing test left
        os.kill(pid, signal.SIGKILL)


def job(tmp_path: Path, marker: str, mode: str, behaviour: str, *flags: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(CHILDREN))
    return [
        "watchdogd",
        "run",
        "--process-containment",
        mode,
        *flags,
        str(script),
        str(tmp_path),
        marker,
        behaviour,
    ]


@pytest.mark.parametrize("mode", MODES)
def test_no_child_outlives_a_job_that_ended_0(tmp_path: Path, marker: str, mode: str) -> None:
    # Rows 1 and 2: 2 ranks, rank 1 exits 3 in attempt 0, attempt 1 succeeds.
    # Output to a file: a leftover child holding a pipe would keep the run from ending.
    log = tmp_path / "run.log"
    with log.open("w") as output:
        command = job(
            tmp_path, marker, mode, "exit", "--nproc-per-node", "2", "--max-restarts", "1"
        )
        code = subprocess.run(command, stdout=output, stderr=output, timeout=60).returncode
    stderr = log.read_text()
    assert code == 0, stderr
    started = len(list(tmp_path.glob("child-*")))
    assert started == 8  # 2 ranks x 2 attempts x 2 children
    assert alive(marker) == []
    expected = "cgroup v2 per worker" if mode == "auto" else "weaker: sessions and /proc"
    assert expected in stderr


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_agent_takes_its_workers_along(tmp_path: Path, marker: str, mode: str) -> None:
    # Row 3: SIGKILL `watchdogd run` while 2 workers run, each with a setsid'd child.
    command = job(tmp_path, marker, mode, "hang", "--nproc-per-node", "2")
    with subprocess.Popen(command, stderr=subprocess.DEVNULL) as agent:
        try:
            # 2 workers, 4 children, and the agent, whose command line holds the marker too.
            wait_until(lambda: len(alive(marker)) == 7, timeout=30)
        finally:
            agent.kill()
    time.sleep(1.0)
    left = alive(marker)
    workers_left = [p for p in left if f"worker-{p}" in os.listdir(tmp_path)]
    assert workers_left == []  # the parent-death signal, in both modes
    if mode == "auto":
        assert left == []  # the keeper killed the job's cgroup
    else:
        # What the weaker mode cannot catch: once the agent that would sweep them is gone,
        # nothing ends the workers' children, whatever their session.
        assert len(left) == 4


AGENT = """
import sys
from watchdogd.launcher import LaunchConfig, elastic_launch
from tests.system import launch_workers as workers
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="t")
elastic_launch(config, workers.leaves_children)(sys.argv[1], sys.argv[2], True)
"""


def test_a_killed_launcher_takes_its_callables_along(tmp_path: Path, marker: str) -> None:
    # Row 3 under the launcher: SIGKILL the process running elastic_launch while its
    # 2 callable workers run, each with a setsid'd child and one in its own session.
    root = Path(__file__).parents[2]
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, "-c", AGENT, marker, str(tmp_path)]
    with subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL) as agent:
        try:
            # The 4 children, and the agent, whose command line holds the marker too.
            wait_until(lambda: len(list(tmp_path.glob("worker-*"))) == 2, timeout=60)
            wait_until(lambda: len(alive(marker)) == 5, timeout=30)
        finally:
            agent.kill()
    time.sleep(1.0)
    left = alive(marker)
    workers_left = [p for p in _pids(tmp_path, "worker-") if _running(p)]
    assert workers_left == []  # the parent-death signal, tied to the starter's own thread
    if _cgroup_writable():
        assert left == []  # the keeper killed the job's cgroup
    else:
        assert len(left) == 4  # the weaker mode, as for a command


def _pids(directory: Path, prefix: str) -> list[int]:
    return [int(p.name.removeprefix(prefix)) for p in directory.glob(f"{prefix}*")]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not _cgroup_writable(), reason="cgroup v2 cannot be written")
def test_the_next_run_removes_a_dead_agents_cgroups(tmp_path: Path, marker: str) -> None:
    # The agent and its keeper both SIGKILLed: the workers' children stay in the job's
    # cgroup until the next `watchdogd run` on the node finds it, kills and removes it.
    command = job(tmp_path, marker, "auto", "hang", "--nproc-per-node", "2")
    with subprocess.Popen(command, stderr=subprocess.DEVNULL) as agent:
        try:
            wait_until(lambda: len(alive(marker)) == 7, timeout=30)
            keeper = [p for p in alive(str(agent.pid)) if p != agent.pid and "keeper" in _cmd(p)]
            assert len(keeper) == 1
            os.kill(keeper[0], signal.SIGKILL)
        finally:
            agent.kill()
    wait_until(lambda: len(alive(marker)) == 4, timeout=5)  # the workers died with it
    out = run("--no-python", "true")
    assert out.returncode == 0, out.stderr
    assert "stale_cgroups_removed cgroups='" in out.stderr
    assert f"-{agent.pid}-" in out.stderr
    wait_until(lambda: alive(marker) == [], timeout=5)


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_callables_children_end_with_it(tmp_path: Path, marker: str) -> None:
    # Rows 1 and 2 under the launcher: the function returns, its children go.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="t")
    values = elastic_launch(config, workers.leaves_children)(marker, str(tmp_path))
    assert values == {0: 0, 1: 1}
    assert len(list(tmp_path.glob("child-*"))) == 4
    assert alive(marker) == []


@pytest.mark.parametrize("mode", MODES)
def test_watchdogctl_status_says_how_workers_are_contained(tmp_path: Path, mode: str) -> None:
    worker = tmp_path / "status.py"
    worker.write_text(
        "import os, subprocess\n"
        "subprocess.run(['watchdogctl', '--socket', os.environ['WATCHDOGD_SOCKET'], 'status'])\n"
    )
    out = run("--process-containment", mode, str(worker))
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("containment"))
    if mode == "auto":
        assert "cgroup v2 per worker" in line
    else:
        assert "weaker: sessions and /proc, no cgroup (process_containment = session)" in line


@pytest.fixture(params=[True, False], ids=["setpriv", "python-shim"])
def shim(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shim: the native one (``setpriv`` and ``sh``), and the Python one."""
    if request.param and enter_cell._SETPRIV is None:
        pytest.skip("no setpriv (util-linux) on this machine: the Python shim serves")
    if not request.param:
        monkeypatch.setattr(enter_cell, "_SETPRIV", None)


@pytest.mark.usefixtures("shim")
def test_the_shim_asks_for_the_parent_death_signal_then_runs_the_program() -> None:
    probe = (
        "import ctypes; v = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
    )
    out = subprocess.run(
        enter_cell.shim_command((), [sys.executable, "-c", probe]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (out.returncode, out.stdout.strip()) == (0, str(signal.SIGKILL)), out.stderr


@pytest.mark.usefixtures("shim")
def test_the_shim_runs_nothing_once_its_parent_is_another() -> None:
    # As if the daemon died before the shim asked for the signal: another parent (a
    # shell in between here) has it, and the program never runs.
    shim = enter_cell.shim_command((), [sys.executable, "-c", "print('ran')"])
    out = subprocess.run(
        ["/bin/sh", "-c", '"$@"; exit $?', "sh", *shim], capture_output=True, text=True, timeout=30
    )
    assert (out.returncode, out.stdout) == (128 + signal.SIGKILL, ""), out.stderr


def test_the_session_sweep_takes_no_child_the_daemon_started_for_itself() -> None:
    # A torch helper (c10d, the agent store) runs in a session of its own, as a
    # worker's re-parented orphan would: only the registration tells them apart.
    from watchdogd.linux import sessions

    helper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert helper.pid in sessions.adopted(set())  # what an orphan looks like
        sessions.started_own(helper.pid)
        assert helper.pid not in sessions.adopted(set())
    finally:
        sessions.ended_own(helper.pid)
        helper.kill()
        helper.wait()


@pytest.mark.skipif(not _cgroup_writable(), reason="cgroup v2 cannot be written")
@pytest.mark.anyio
async def test_settling_kills_a_cells_setsid_child_and_waits_on_cgroup_events(
    marker: str,
) -> None:
    job = cgroups.open_job_cgroup()
    try:
        cell = job.cell("g.worker0")
        assert cell.procs is not None
        sleeper = f"import time; time.sleep(3000)  # {marker}"
        launch = (
            "import subprocess, sys; "
            f"subprocess.Popen([sys.executable, '-c', {sleeper!r}], start_new_session=True)"
        )
        shim = enter_cell.shim_command(cell.procs, [sys.executable, "-c", launch])
        await anyio.run_process(shim, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: len(alive(marker)) == 1, timeout=10)
        (child,) = cell.alive()
        assert alive(marker) == [child]
        # The wake-up: a change of cgroup.events, seen through inotify.
        changes = cgroups._Changes([cell])
        try:
            os.kill(child, signal.SIGKILL)
            with anyio.fail_after(10):
                await changes.wait()
        finally:
            changes.close()
        assert cell.alive() == []
        # The settle itself, with another child left.
        await anyio.run_process(shim, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: len(alive(marker)) == 1, timeout=10)
        with anyio.fail_after(10):
            await job.settle([cell])
        assert cell.alive() == [] and alive(marker) == []
        cell.remove()  # by the job's writer thread
        wait_until(lambda: not cell.path.exists(), timeout=5)
    finally:
        job.close()
