"""Warm spares (``--prewarm``): a worker that starts from a spare is the worker a fresh
interpreter would have been; spares replace themselves, and leave with the group.

Each test runs the installed ``watchdogd run`` with real workers. The
prewarmed module of the tests is a marker of our own (``wd_prewarm_probe``):
a worker knows it started from a spare when the module is already imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import kept_dumps
from ..conftest import watchdogd_run as run

PROBE = "import os\nIMPORTED_BY = os.getpid()\n"

# What a worker sees of itself, as a fresh interpreter would show it.
SELF_REPORT = """
    import json, os, subprocess, sys
    here = os.environ["OUT"]
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().rstrip(b"\\0").decode().split("\\0")
    # Monitoring by command line: `pgrep -f` finds the worker by its script or module.
    found = subprocess.run(["pgrep", "-f", "pkg.report"], capture_output=True, text=True)
    seen = {
        "cmdline": cmdline,
        "pgrep": str(os.getpid()) in found.stdout.split(),
        "env": dict(os.environ),
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "path0": sys.path[0],
        "spare": "wd_prewarm_probe" in sys.modules,
    }
    with open(os.path.join(here, f"seen-{attempt}-{rank}.json"), "w") as f:
        json.dump(seen, f)
"""


def probe_env(tmp_path: Path, out: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "wd_prewarm_probe.py").write_text(PROBE)
    # The rest of PYTHONPATH stays: the daemon and the spares it starts run the same code.
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "OUT": str(out)}


def normalised(seen: dict[str, object]) -> dict[str, object]:
    """What must match between two runs: not what each run makes anew (its runtime dir)."""
    env = dict(seen["env"])  # type: ignore[call-overload]
    runtime = str(Path(env["WATCHDOGD_SOCKET"]).parent)
    for key in ("WATCHDOGD_SOCKET", "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_ERROR_FILE"):
        env[key] = env[key].replace(runtime, "<runtime>")
    env["TORCHELASTIC_ERROR_FILE"] = "/".join(env["TORCHELASTIC_ERROR_FILE"].split("/")[-3:])
    return {**seen, "env": env, "spare": None}


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_prewarmed_worker_is_what_a_fresh_one_is(tmp_path: Path, how: str) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/report.py").write_text(textwrap.dedent(SELF_REPORT))
    target = ["-m", "pkg.report"] if how == "module" else ["pkg/report.py"]
    seen = {}
    out = tmp_path / "out"  # the same for both runs: it is in their environment
    out.mkdir()
    for flavour, extra in (("fresh", []), ("spare", ["--prewarm", "wd_prewarm_probe"])):
        done = subprocess.run(
            ["watchdogd", "run", "--nproc-per-node", "2", "--master-port", "29611",
             "--log-dir", str(tmp_path / "logs"), *extra, *target, "x", "--y"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**os.environ, **probe_env(tmp_path, out)},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen[flavour] = {
            rank: json.loads((out / f"seen-0-{rank}.json").read_bytes()) for rank in (0, 1)
        }
    for rank in (0, 1):
        assert not seen["fresh"][rank]["spare"] and seen["spare"][rank]["spare"]
        fresh, spare = normalised(seen["fresh"][rank]), normalised(seen["spare"][rank])
        for key in fresh["env"].keys() | spare["env"].keys():  # a diff that names the variable
            assert (key, spare["env"].get(key)) == (key, fresh["env"].get(key))
        assert spare == fresh
    assert seen["spare"][0]["argv"][1:] == ["x", "--y"]
    assert seen["spare"][0]["cmdline"][-len(target) - 2 :] == [*target, "x", "--y"]
    assert seen["spare"][0]["pgrep"]
    assert seen["spare"][0]["name"] == "__main__"
    assert seen["spare"][0]["path0"] == str(tmp_path if how == "module" else tmp_path / "pkg")


CRASH_ONCE = """
    import os, sys, time
    import watchdogd_client as wd
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    spare = "wd_prewarm_probe" in sys.modules
    print(f"attempt {attempt} rank {rank} spare={spare}", flush=True)
    if attempt == "0":
        time.sleep(0.3)
        sys.exit(1 if rank == "0" else 0)
    # Attempt 1 ran on spares; new ones take their place once every rank is at work
    # (reported a step), or REFILL_HOLD seconds after, not before; they show in the
    # group's view.
    client = wd.SocketTimerClient(os.environ["WATCHDOGD_SOCKET"])
    time.sleep(1.0)
    held = len(client.list_groups()[0].spares)
    if os.environ["REPORT"] == "1":
        client.progress(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spares = client.list_groups()[0].spares
        if len(spares) == 2 and all(s.ready for s in spares):
            break
        time.sleep(0.05)
    if rank == "0":
        print("held", held, "spares", [(s.local_rank, s.ready, s.rss_bytes > 0) for s in spares],
              flush=True)
"""


@pytest.mark.parametrize("report", ["1", "0"], ids=["at-work", "silent"])
def test_a_crash_restarts_onto_spares_and_new_ones_take_their_place(
    tmp_path: Path, report: str
) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(CRASH_ONCE))
    events = tmp_path / "events.jsonl"
    out = run("--nproc-per-node", "2", "--max-restarts", "1", "--prewarm", "wd_prewarm_probe",
              "--event-log", str(events), str(worker),
              env={**probe_env(tmp_path, tmp_path), "REPORT": report})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "attempt 1 rank 0 spare=True" in out.stdout
    assert "attempt 1 rank 1 spare=True" in out.stdout
    assert "held 0 spares [(0, True, True), (1, True, True)]" in out.stdout
    # Each attempt took both spares; the pool refilled after each, and says how long it took.
    refills = [e["metadata"]["after_s"] for e in map(json.loads, events.read_text().splitlines())
               if e["name"] == "spares_refilled"]  # fmt: skip
    assert len(refills) == 2 and all(0 < after < 30 for after in refills), refills


HANGS = """
    import os, sys, time
    import watchdogd_client as wd

    def stuck_in_the_data_loader():
        time.sleep(60)

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"attempt {attempt} spare={'wd_prewarm_probe' in sys.modules}", flush=True)
    with wd.expires(after=0.5, scope="batch"):
        if attempt == "0":
            stuck_in_the_data_loader()
"""


def test_a_hung_prewarmed_worker_is_killed_by_its_timer_with_a_stack_dump(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(HANGS))
    logs = tmp_path / "logs"
    out = run("--max-restarts", "1", "--prewarm", "wd_prewarm_probe", "--log-dir", str(logs),
              str(worker), env=probe_env(tmp_path, tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "attempt 0 spare=True" in out.stdout and "attempt 1 spare=True" in out.stdout
    assert "timer 'batch' expired" in out.stderr or "'batch'" in out.stderr
    dumps = kept_dumps(out.stderr)
    assert any("stuck_in_the_data_loader" in d.read_text() for d in dumps.iterdir())
    shutil.rmtree(dumps.parent)


def _spares_alive(token: str) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"watchdogd.groups.spare" in cmdline and token.encode() in cmdline:
                alive.append(int(entry.name))
    return alive


# Each worker runs until a replacement spare of each rank has died, one of them twice.
UNTIL_SPARES_DIED = """
    import json, os, sys, time
    import watchdogd_client as wd
    # a step shown: the group is at work, so its spares' replacements start
    wd.SocketTimerClient(os.environ["WATCHDOGD_SOCKET"]).progress(1)
    events, deadline = sys.argv[1], time.monotonic() + 30

    def died():
        if not os.path.exists(events):
            return []
        with open(events) as f:
            lines = [line for line in f if line.endswith("\\n") and '"spare_died"' in line]
        return [json.loads(line)["metadata"]["local_rank"] for line in lines]

    while time.monotonic() < deadline:
        ranks = died()
        if {0, 1} <= set(ranks) and max(ranks.count(0), ranks.count(1)) >= 2:
            break
        time.sleep(0.05)
    print("worker done")
"""


def test_spares_leave_with_the_group_and_a_dying_one_is_reported(tmp_path: Path) -> None:
    # Every import of this module fails: the first spares still become the first
    # attempt's workers (their user code imports what it needs), and each replacement
    # dies, is reported, and is tried again after a pause. The workers are at work at once
    # (a step reported), so the replacements start then.
    site = tmp_path / "site"
    site.mkdir()
    token = f"wd_broken_{os.getpid()}"
    (site / f"{token}.py").write_text("raise ImportError('this module is broken')\n")
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(UNTIL_SPARES_DIED))
    events = tmp_path / "events.jsonl"
    out = run("--nproc-per-node", "2", "--prewarm", token, "--event-log", str(events),
              str(worker), str(events), env={"PYTHONPATH": os.pathsep.join(
                  filter(None, [str(site), os.environ.get("PYTHONPATH")]))})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("worker done") == 2
    assert _spares_alive(token) == []
    died = [
        json.loads(line)["metadata"]
        for line in events.read_text().splitlines()
        if json.loads(line)["name"] == "spare_died"
    ]
    assert {d["local_rank"] for d in died} == {0, 1}
    assert all("ImportError: this module is broken" in d["reason"] for d in died)
    ranks = [d["local_rank"] for d in died]
    assert max(ranks.count(0), ranks.count(1)) >= 2  # replaced, and reported again


def test_prewarm_needs_a_python_entrypoint() -> None:
    out = run("--prewarm", "json", "--no-python", "true")
    assert out.returncode == 2
    assert "prewarm needs a Python entrypoint" in out.stderr


GLOO_HANG = """
    import os, time
    import torch
    import torch.distributed as dist
    import torch.distributed.elastic.timer as timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    total = torch.ones(1)
    if rank == 1 and attempt == "0":
        with timer.expires(after=1):  # torch's own client and expires
            time.sleep(60)  # hung; rank 0 waits for it in all_reduce
    dist.all_reduce(total)
    print(f"rank {rank} attempt {attempt} sum {total.item()}", flush=True)
    dist.destroy_process_group()
"""


def test_a_real_torch_job_hung_in_a_collective_recovers_where_torchrun_dies(
    tmp_path: Path,
) -> None:
    script = tmp_path / "gloo_hang.py"
    script.write_text(textwrap.dedent(GLOO_HANG))
    ours = run("--nproc-per-node", "2", "--max-restarts", "1", "--prewarm", "torch",
               str(script), timeout=120)  # fmt: skip
    assert ours.returncode == 0, ours.stderr
    assert "rank 0 attempt 1 sum 2.0" in ours.stdout and "rank 1 attempt 1 sum 2.0" in ours.stdout
    assert "killed by SIGKILL" in ours.stderr
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", "1", "--monitor-interval", "0.1", str(script)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
    )  # fmt: skip
    # torch's file timer server reaps the hung rank, then signals its own agent.
    assert torchrun.returncode in (-9, 137), torchrun.stderr
    assert "attempt 1" not in torchrun.stdout
